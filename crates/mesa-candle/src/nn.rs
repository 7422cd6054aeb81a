//! candle-nn's layers with our [`ops`] inside: the constructors, weight names and
//! initialisation of candle-nn 0.11.1, so a model swaps a layer by changing one path.
//!
//! | candle-nn | here | config (defaults) |
//! |---|---|---|
//! | `linear(in, out, vb)`, `linear_no_bias`, `linear_b(in, out, bias, vb)` → `Linear` | [`linear`], [`linear_no_bias`], [`linear_b`] → [`Linear`] | [`Codes`] via [`Linear::with_codes`] |
//! | `layer_norm(size, config, vb)`, `layer_norm_no_bias(size, eps, vb)` → `LayerNorm` | [`layer_norm`], [`layer_norm_no_bias`] → [`LayerNorm`] | [`LayerNormConfig`] (eps 1e-5, remove mean, affine; from an `f64` eps or a `candle_nn::LayerNormConfig`) |
//! | `rms_norm(size, eps, vb)` → `RmsNorm` | [`rms_norm`] → [`RmsNorm`] | [`RmsNormConfig`] (from an `f64` eps) |
//! | `ops::softmax_last_dim(xs)` | [`softmax_last_dim`], or `xs.apply(&Softmax::new(bits))` | bits of [`Softmax::new`] (8) |
//! | `xs.gelu_erf()`, `xs.gelu()` | `xs.apply(&Gelu::erf())`, `xs.apply(&Gelu::tanh())` | [`Codes`] via [`Gelu::new`] |
//! | `Dropout::new(p)`, `forward(xs, train)` | [`Dropout`] (the same calls) | — (a key, not a mask) |
//!
//! Every layer keeps its input for backward as the default [`Codes`] unless given others
//! (`with_codes`, a config's `codes`); what each op keeps and how its backward runs: the
//! table of [`crate::ops`].
//!
//! The constructors read the names candle-nn reads — `weight` and `bias`, and for the
//! norms also `gamma` and `beta` when those are present — with candle-nn's initialisation
//! hints for a [`VarBuilder`] over a `VarMap` (Linear: Kaiming-normal weight, bias uniform in
//! `±1/√in`; norms: weight 1, bias 0). So a model built from the same `VarMap` with
//! candle-nn and with this module shares its variables.
//!
//! The layers are [`Module`]s holding their weights ([`Module`], [`ModuleT`] and
//! [`VarBuilder`] are re-exported, so one `use` line can switch). A clone shares the weights
//! and the op, running estimate included.
use std::sync::Arc;

use candle_core::{Result, Tensor};

use crate::ops;
pub use crate::ops::{Codes, Dropout, Gelu, GeluForm, Rounding, Softmax, StatsMode};
pub use candle_core::{Module, ModuleT};
pub use candle_nn::VarBuilder;

/// The configuration of [`layer_norm`]: candle-nn's `LayerNormConfig` and the [`Codes`]
/// kept for backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormConfig {
    /// ε added to the variance.
    pub eps: f64,
    /// Subtract the row mean (LayerNorm); `false` makes it an RMSNorm, as in candle-nn.
    pub remove_mean: bool,
    /// A bias (`bias`) besides the weight.
    pub affine: bool,
    /// The codes of `x̂` kept for backward.
    pub codes: Codes,
}

impl Default for LayerNormConfig {
    /// candle-nn's defaults (eps 1e-5, remove the mean, affine) and the default [`Codes`].
    fn default() -> Self {
        LayerNormConfig { eps: 1e-5, remove_mean: true, affine: true, codes: Codes::default() }
    }
}

impl From<f64> for LayerNormConfig {
    /// The defaults with `eps`.
    fn from(eps: f64) -> Self {
        LayerNormConfig { eps, ..LayerNormConfig::default() }
    }
}

impl From<candle_nn::LayerNormConfig> for LayerNormConfig {
    /// The same eps, mean removal and affinity, the default [`Codes`].
    fn from(c: candle_nn::LayerNormConfig) -> Self {
        LayerNormConfig { eps: c.eps, remove_mean: c.remove_mean, affine: c.affine, codes: Codes::default() }
    }
}

/// The configuration of [`rms_norm`]: ε and the [`Codes`] kept for backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormConfig {
    /// ε added to the mean square.
    pub eps: f64,
    /// The codes of `x̂` kept for backward.
    pub codes: Codes,
}

impl From<f64> for RmsNormConfig {
    /// `eps` and the default [`Codes`].
    fn from(eps: f64) -> Self {
        RmsNormConfig { eps, codes: Codes::default() }
    }
}

/// candle-nn's `Linear`, `y = x·Wᵀ + b`, running [`ops::CodedLinear`]: the input is kept as
/// codes for `dW`; `x: [..., in]`, `weight: [out, in]`, `bias: [out]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    op: Arc<ops::CodedLinear>,
}

impl Linear {
    /// A Linear over `weight` and `bias` with the default [`Codes`] (candle-nn's signature).
    #[must_use]
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias, op: Arc::new(ops::CodedLinear::new(Codes::default())) }
    }

    /// The same layer keeping its input with `codes`.
    #[must_use]
    pub fn with_codes(self, codes: Codes) -> Self {
        Linear { op: Arc::new(ops::CodedLinear::new(codes)), ..self }
    }

    /// The weight `[out, in]`.
    #[must_use]
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[out]`, if any.
    #[must_use]
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for Linear {
    /// [`ops::CodedLinear::forward`] with the layer's weights (errors there).
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.op.forward(xs, &self.weight, self.bias.as_ref())
    }
}

/// candle-nn's `linear`: `weight` `[out, in]` and `bias` `[out]` under `vb`.
///
/// # Errors
/// The [`VarBuilder`]'s (a missing name, a tensor of another shape).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    let bound = 1. / (in_dim as f64).sqrt();
    let bias = vb.get_with_hints(out_dim, "bias", candle_nn::Init::Uniform { lo: -bound, up: bound })?;
    Ok(Linear::new(weight, Some(bias)))
}

/// candle-nn's `linear_no_bias`: `weight` `[out, in]` under `vb`.
///
/// # Errors
/// The [`VarBuilder`]'s.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    Ok(Linear::new(weight, None))
}

/// candle-nn's `linear_b`: [`linear`] or [`linear_no_bias`].
///
/// # Errors
/// The [`VarBuilder`]'s.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    if bias {
        linear(in_dim, out_dim, vb)
    } else {
        linear_no_bias(in_dim, out_dim, vb)
    }
}

/// The op a norm layer runs.
#[derive(Debug, Clone)]
enum Norm {
    Centered(Arc<ops::LayerNorm>),
    Rms(Arc<ops::RmsNorm>),
}

impl Norm {
    fn new(remove_mean: bool, eps: f64, codes: Codes) -> Self {
        // the kernels take eps in f32, as candle-nn's fused ops do
        if remove_mean {
            Norm::Centered(Arc::new(ops::LayerNorm::new(eps as f32, codes)))
        } else {
            Norm::Rms(Arc::new(ops::RmsNorm::new(eps as f32, codes)))
        }
    }
}

/// candle-nn's `LayerNorm` over the last axis: [`ops::LayerNorm`] (the mean removed) or
/// [`ops::RmsNorm`] (not), times the weight, plus the bias if any (without a bias the
/// LayerNorm kernel runs with a zero one; with a bias and no mean removal the bias is added
/// by candle).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
    norm: Norm,
}

impl LayerNorm {
    /// A LayerNorm over `weight` and `bias` with `eps` and the default [`Codes`] (candle-nn's
    /// signature, as are the next two).
    #[must_use]
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm::from_parts(weight, Some(bias), LayerNormConfig::from(eps))
    }

    /// A LayerNorm without a bias.
    #[must_use]
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        LayerNorm::from_parts(weight, None, LayerNormConfig::from(eps))
    }

    /// An RMSNorm (no mean removed, no bias).
    #[must_use]
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        LayerNorm::from_parts(weight, None, LayerNormConfig { remove_mean: false, ..LayerNormConfig::from(eps) })
    }

    /// The same layer keeping `x̂` with `codes`.
    #[must_use]
    pub fn with_codes(self, codes: Codes) -> Self {
        LayerNorm { norm: Norm::new(self.remove_mean, self.eps, codes), ..self }
    }

    fn from_parts(weight: Tensor, bias: Option<Tensor>, c: LayerNormConfig) -> Self {
        LayerNorm {
            weight,
            bias,
            remove_mean: c.remove_mean,
            eps: c.eps,
            norm: Norm::new(c.remove_mean, c.eps, c.codes),
        }
    }

    /// The weight `[C]`.
    #[must_use]
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[C]`, if any.
    #[must_use]
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// ε.
    #[must_use]
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the row mean is subtracted.
    #[must_use]
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }
}

impl Module for LayerNorm {
    /// `xs: [..., C]`; errors of [`ops::LayerNorm::forward`] and [`ops::RmsNorm::forward`].
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        // the kernels take eps in f32: checked here, where the value the caller gave is known
        // (candle-nn also accepts 0; these ops do not: a zero row would divide 0 by 0)
        let eps32 = self.eps as f32;
        if !(eps32 > 0.0 && eps32.is_finite()) {
            let name = if self.remove_mean { "layer norm eps" } else { "rms norm eps" };
            return Err(crate::Error::InvalidArgument {
                name,
                why: format!("must be positive and finite in f32 (the kernels' precision), got {:e}", self.eps),
            }
            .into());
        }
        match &self.norm {
            Norm::Centered(op) => match &self.bias {
                Some(bias) => op.forward(xs, &self.weight, bias),
                None => op.forward(xs, &self.weight, &self.weight.zeros_like()?),
            },
            Norm::Rms(op) => {
                let ys = op.forward(xs, &self.weight)?;
                match &self.bias {
                    Some(bias) => ys.broadcast_add(bias),
                    None => Ok(ys),
                }
            }
        }
    }
}

/// candle-nn's `layer_norm`: `weight` (or `gamma`) and, when `config.affine`, `bias` (or
/// `beta`), each `[size]`, under `vb`. `config`: a [`LayerNormConfig`], an `f64` eps or a
/// `candle_nn::LayerNormConfig`.
///
/// # Errors
/// The [`VarBuilder`]'s.
pub fn layer_norm<C: Into<LayerNormConfig>>(size: usize, config: C, vb: VarBuilder) -> Result<LayerNorm> {
    let config = config.into();
    // candle-nn's lookup: an existing alias first, else "weight" / "bias" (a VarMap creates them)
    let name = |names: [&'static str; 2]| names.into_iter().find(|n| vb.contains_tensor(n)).unwrap_or(names[0]);
    let weight = vb.get_with_hints(size, name(["weight", "gamma"]), candle_nn::Init::Const(1.))?;
    let bias = if config.affine {
        Some(vb.get_with_hints(size, name(["bias", "beta"]), candle_nn::Init::Const(0.))?)
    } else {
        None
    };
    Ok(LayerNorm::from_parts(weight, bias, config))
}

/// candle-nn's `layer_norm_no_bias`: [`layer_norm`] without the bias.
///
/// # Errors
/// The [`VarBuilder`]'s.
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    layer_norm(size, LayerNormConfig { affine: false, ..LayerNormConfig::from(eps) }, vb)
}

/// candle-nn's `RmsNorm`, `y = x·rstd·w` over the last axis: [`ops::RmsNorm`].
#[derive(Debug, Clone)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// An RMSNorm over `weight` with `eps` and the default [`Codes`] (candle-nn's signature).
    #[must_use]
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm::rms_norm(weight, eps))
    }

    /// The same layer keeping `x̂` with `codes`.
    #[must_use]
    pub fn with_codes(self, codes: Codes) -> Self {
        RmsNorm(self.0.with_codes(codes))
    }

    /// The [`LayerNorm`] it is.
    #[must_use]
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The weight `[C]`.
    #[must_use]
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// ε.
    #[must_use]
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The forward (candle-nn's name for its differentiable path; here every path is).
    ///
    /// # Errors
    /// Those of [`ops::RmsNorm::forward`].
    pub fn forward_diff(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

impl Module for RmsNorm {
    /// `xs: [..., C]`; errors of [`ops::RmsNorm::forward`].
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

/// candle-nn's `rms_norm`: `weight` (or `gamma`) `[size]` under `vb`. `config`: an
/// [`RmsNormConfig`] or an `f64` eps.
///
/// # Errors
/// The [`VarBuilder`]'s.
pub fn rms_norm<C: Into<RmsNormConfig>>(size: usize, config: C, vb: VarBuilder) -> Result<RmsNorm> {
    let RmsNormConfig { eps, codes } = config.into();
    let config = LayerNormConfig { eps, remove_mean: false, affine: false, codes };
    Ok(RmsNorm(layer_norm(size, config, vb)?))
}

/// candle-nn's `ops::softmax_last_dim`: [`Softmax`] with 8-bit codes, no mask.
///
/// # Errors
/// Those of [`Softmax::forward`].
pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    Softmax::default().forward(xs, None)
}

impl Module for Softmax {
    /// Softmax over the last axis without a mask: `xs.apply(&softmax)`. (`softmax.forward(&xs)`
    /// names the inherent [`Softmax::forward`], which takes the mask too.)
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Softmax::forward(self, xs, None)
    }
}
