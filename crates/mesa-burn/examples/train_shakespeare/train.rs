//! One run: a model trained from a seed with one set of ops, then scored on the validation
//! text; the bytes autodiff keeps for backward measured at the second step.
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;

use crate::data::{self, Corpus, SplitMix};
use crate::model::{Model, Ops, Sizes};

/// A training configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `smoke` or `cpu`.
    pub name: &'static str,
    /// Layers.
    pub layers: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Heads.
    pub heads: usize,
    /// FFN width.
    pub ffn: usize,
    /// Context.
    pub context: usize,
    /// Windows per step.
    pub batch: usize,
    /// Optimiser steps.
    pub steps: usize,
    /// Peak learning rate (linear warm-up over the first 10 % of steps, cosine to 10 %).
    pub lr: f64,
    /// Validation characters scored (from the start of the validation text; `None`: all).
    pub val_chars: Option<usize>,
}

/// What a run gives.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Mean training loss of the first step.
    pub first_loss: f64,
    /// Validation loss after the last step (nats per character).
    pub final_val: f64,
    /// Bytes allocated by the second step's forward and alive when it returns (the graph
    /// and what each op keeps for backward; the loss scalar included).
    pub bytes_alive: isize,
    /// Wall seconds of the training steps.
    pub train_s: f64,
    /// Wall seconds of the run (training and validation).
    pub wall_s: f64,
}

/// The learning rate of `step` (0-based).
pub fn learning_rate(s: &Settings, step: usize) -> f64 {
    let warm = (s.steps / 10).max(1);
    if step < warm {
        return s.lr * (step + 1) as f64 / warm as f64;
    }
    let t = (step - warm) as f64 / (s.steps - warm).max(1) as f64;
    s.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// Windows per validation batch.
const VAL_BATCH: usize = 128;

/// Trains one model from `seed` with `ops`. `live` reads the counting allocator.
///
/// # Errors
/// A mesa-burn op refusing its arguments (as text).
pub fn run(s: &Settings, corpus: &Corpus, ops: Ops, seed: u64, live: fn() -> isize) -> Result<RunResult, String> {
    let t0 = Instant::now();
    let device = Device::flex().autodiff();
    let sizes = Sizes {
        vocab: corpus.vocab.len(),
        layers: s.layers,
        hidden: s.hidden,
        heads: s.heads,
        ffn: s.ffn,
        context: s.context,
    };
    let mut model = Model::new(&sizes, &mut SplitMix(seed), &device);
    // candle-nn's AdamW defaults of the candle example: β₂ 0.99, ε 1e-8, weight decay 0.01
    let mut opt = AdamWConfig::new().with_beta_2(0.99).with_epsilon(1e-8).with_weight_decay(0.01).init();
    let order = data::train_order(corpus.train.len(), s.context, s.batch, s.steps, seed ^ 0x5EED_DA7A);
    let (mut first_loss, mut bytes_alive) = (f64::NAN, 0);
    for (step, starts) in order.iter().enumerate() {
        let (x, y) = data::windows(&corpus.train, starts, s.context, &device);
        let before = live();
        let loss = model.loss(x, y, ops).map_err(|e| format!("step {step}: {e}"))?;
        if step == 1 {
            // step 0 warmed up what is allocated once per process
            bytes_alive = live() - before;
        }
        if step == 0 {
            first_loss = f64::from(loss.clone().into_scalar::<f32>());
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(learning_rate(s, step), model, grads);
    }
    let train_s = t0.elapsed().as_secs_f64();
    let final_val = validate(&model, corpus, s, ops)?;
    Ok(RunResult { first_loss, final_val, bytes_alive, train_s, wall_s: t0.elapsed().as_secs_f64() })
}

/// Mean cross-entropy over every transition of the non-overlapping validation windows
/// (no autodiff: `Module::valid`).
fn validate(model: &Model, corpus: &Corpus, s: &Settings, ops: Ops) -> Result<f64, String> {
    let m = model.valid();
    let device = m.device();
    let len = s.val_chars.unwrap_or(corpus.val.len()).min(corpus.val.len());
    let starts = data::val_starts(len, s.context);
    if starts.is_empty() {
        return Err(format!("{len} validation characters hold no window of {} + 1", s.context));
    }
    let mut sum = 0.0;
    for chunk in starts.chunks(VAL_BATCH) {
        let (x, y) = data::windows(&corpus.val, chunk, s.context, &device);
        let loss = m.loss(x, y, ops).map_err(|e| format!("validation: {e}"))?;
        sum += f64::from(loss.into_scalar::<f32>()) * chunk.len() as f64;
    }
    Ok(sum / starts.len() as f64)
}
