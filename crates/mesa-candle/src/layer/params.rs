//! The layer's parameters: one flat tensor (the layer's `param_dtype`) with named views in a
//! fixed order.
use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use crate::error::Error;

/// Names, shapes and offsets (in elements) of the parameters inside the flat tensor.
///
/// A GPT block ([`ParamLayout::new`]) uses the usual per-weight names of a pre-/post-LN block
/// (GPT-J / NeoX style): `ln_1`, `attn.q_proj`, `attn.k_proj`, `attn.v_proj`,
/// `attn.out_proj`, `ln_2`, `mlp.fc_in`, `mlp.fc_out`, each with `.weight` (`[out, in]` for
/// the projections, as candle-nn's `Linear`) and `.bias`. A Llama block
/// ([`ParamLayout::llama`]) uses Hugging Face's and candle-transformers' names, without
/// biases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    total: usize,
    /// A Llama block's `(heads, kv_heads, tensor)` (what [`ParamLayout::shard`] needs beyond
    /// the shapes); `None` for a GPT block.
    llama: Option<(usize, usize, usize)>,
}

/// One named view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamEntry {
    /// The checkpoint name (without prefix).
    pub name: &'static str,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Offset of its first element in the flat tensor.
    pub offset: usize,
}

impl ParamEntry {
    /// Number of elements.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl ParamLayout {
    /// The layout of a layer of width `hidden` and FFN width `ffn`.
    #[must_use]
    pub fn new(hidden: usize, ffn: usize) -> Self {
        ParamLayout::from_specs(hidden, ffn, 1)
    }

    /// The layout of one rank's parameters of a layer split over `tensor` ranks (Megatron
    /// tensor parallelism, Shoeybi et al. 2019 §3): the Q, K, V projections and the FFN's
    /// first linear keep `1/t` of their output rows (`C/t`, `F/t`: whole heads, column
    /// parallel), the output projection and the FFN's second linear `1/t` of their input
    /// columns (row parallel); their biases and the LayerNorms are whole (replicated).
    /// Same names and order as [`ParamLayout::new`], which is `sharded(_, _, 1)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `tensor` is 0 or does not divide `hidden` and `ffn`.
    pub fn sharded(hidden: usize, ffn: usize, tensor: usize) -> Result<Self, Error> {
        if tensor == 0 || hidden % tensor != 0 || ffn % tensor != 0 {
            return Err(Error::InvalidArgument {
                name: "tensor",
                why: format!("{tensor} ranks must divide hidden {hidden} and ffn {ffn}"),
            });
        }
        Ok(ParamLayout::from_specs(hidden, ffn, tensor))
    }

    /// Rank `rank`'s flat parameters ([`ParamLayout::sharded`] with `tensor` ranks) cut from
    /// the whole layer's flat parameters `full` (laid out as `self`, the unsharded layout).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (`rank ≥ tensor`, `tensor` not dividing the widths, `self`
    /// already sharded), [`Error::Shape`] (`full` not `[total]`); candle's errors.
    pub fn shard(&self, full: &Tensor, rank: usize, tensor: usize) -> candle_core::Result<Tensor> {
        if let Some((heads, kv_heads, t)) = self.llama {
            return self.shard_llama(full, rank, tensor, (heads, kv_heads, t));
        }
        let (c, f) = (self.entry("ln_1.weight")?.shape[0], self.entry("mlp.fc_in.bias")?.shape[0]);
        if self.entry("attn.q_proj.weight")?.shape[0] != c {
            return Err(
                Error::InvalidArgument { name: "layout", why: "shard() cuts the unsharded layout".into() }.into()
            );
        }
        let local = ParamLayout::sharded(c, f, tensor)?;
        if rank >= tensor {
            return Err(Error::InvalidArgument { name: "rank", why: format!("{rank} is not below {tensor}") }.into());
        }
        if full.dims() != [self.total] {
            return Err(Error::Shape {
                what: "flat parameters".into(),
                expected: vec![self.total],
                got: full.dims().to_vec(),
            }
            .into());
        }
        let mut parts = Vec::with_capacity(local.entries.len());
        for e in &local.entries {
            let whole = self.view(full, e.name)?;
            let part = match e.shape.as_slice() {
                // the output rows of a column-parallel linear (and its bias)
                &[rows, _] | &[rows] if whole.dim(0)? != rows => whole.narrow(0, rank * rows, rows)?,
                // the input columns of a row-parallel linear
                &[_, cols] if whole.dim(1)? != cols => whole.narrow(1, rank * cols, cols)?,
                _ => whole,
            };
            parts.push(part.contiguous()?.flatten_all()?);
        }
        Tensor::cat(&parts, 0)
    }

    /// The layout of a Llama block ([`super::LlamaBlock`]) in Hugging Face's names (the part
    /// after `model.layers.N.`): `input_layernorm.weight` `[C]`, `self_attn.q_proj.weight`
    /// `[C, C]`, `self_attn.k_proj.weight` and `self_attn.v_proj.weight` `[H_kv·d, C]`,
    /// `self_attn.o_proj.weight` `[C, C]`, `post_attention_layernorm.weight` `[C]`,
    /// `mlp.gate_proj.weight` and `mlp.up_proj.weight` `[F, C]`, `mlp.down_proj.weight`
    /// `[C, F]` (`d = C/H`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `heads` does not divide `hidden` or `kv_heads` does
    /// not divide `heads`.
    pub fn llama(hidden: usize, heads: usize, kv_heads: usize, ffn: usize) -> Result<Self, Error> {
        if heads == 0 || hidden % heads != 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::InvalidArgument {
                name: "kv_heads",
                why: format!(
                    "hidden {hidden}, heads {heads}, kv_heads {kv_heads}: H must divide C, H_kv must divide H"
                ),
            });
        }
        let (c, f, kv) = (hidden, ffn, kv_heads * (hidden / heads));
        let mut layout = ParamLayout::from_list_checked(vec![
            ("input_layernorm.weight", vec![c]),
            ("self_attn.q_proj.weight", vec![c, c]),
            ("self_attn.k_proj.weight", vec![kv, c]),
            ("self_attn.v_proj.weight", vec![kv, c]),
            ("self_attn.o_proj.weight", vec![c, c]),
            ("post_attention_layernorm.weight", vec![c]),
            ("mlp.gate_proj.weight", vec![f, c]),
            ("mlp.up_proj.weight", vec![f, c]),
            ("mlp.down_proj.weight", vec![c, f]),
        ])?;
        layout.llama = Some((heads, kv_heads, 1));
        Ok(layout)
    }

    /// One rank's layout of a Llama block split over `tensor` ranks (Megatron's split, as
    /// [`ParamLayout::sharded`]): Q, gate and up keep `1/t` of their output rows (`C/t`, `F/t`),
    /// W_o and down `1/t` of their input columns; K and V keep the rank's `H_kv/t` KV heads, or,
    /// when `t > H_kv`, the one KV head its query heads read (replicated over `t/H_kv` ranks);
    /// the norms are whole. Same names and order as [`ParamLayout::llama`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] as [`ParamLayout::llama`], and when `tensor` is 0, does not
    /// divide `heads` and `ffn`, or `tensor` and `kv_heads` do not divide one another.
    pub fn llama_sharded(
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        ffn: usize,
        tensor: usize,
    ) -> Result<Self, Error> {
        ParamLayout::llama(hidden, heads, kv_heads, ffn)?; // the unsharded shape's checks
        let t = tensor;
        if t == 0 || heads % t != 0 || ffn % t != 0 || (kv_heads % t != 0 && t % kv_heads != 0) {
            return Err(Error::InvalidArgument {
                name: "tensor",
                why: format!(
                    "{t} ranks must divide heads {heads} and ffn {ffn}, and divide or be a multiple of kv_heads {kv_heads}"
                ),
            });
        }
        let (c, f, d) = (hidden, ffn, hidden / heads);
        let kv = (kv_heads / t).max(1) * d;
        let mut layout = ParamLayout::from_list_checked(vec![
            ("input_layernorm.weight", vec![c]),
            ("self_attn.q_proj.weight", vec![c / t, c]),
            ("self_attn.k_proj.weight", vec![kv, c]),
            ("self_attn.v_proj.weight", vec![kv, c]),
            ("self_attn.o_proj.weight", vec![c, c / t]),
            ("post_attention_layernorm.weight", vec![c]),
            ("mlp.gate_proj.weight", vec![f / t, c]),
            ("mlp.up_proj.weight", vec![f / t, c]),
            ("mlp.down_proj.weight", vec![c, f / t]),
        ])?;
        layout.llama = Some((heads, kv_heads, t));
        Ok(layout)
    }

    /// The layout of `config`'s block on one of `tensor` ranks ([`ParamLayout::sharded`] or
    /// [`ParamLayout::llama_sharded`]).
    ///
    /// # Errors
    /// As those.
    pub fn sharded_of(config: &super::LayerConfig, tensor: usize) -> Result<Self, Error> {
        match config.block {
            super::Block::Gpt => ParamLayout::sharded(config.hidden, config.ffn, tensor),
            super::Block::Llama(l) => {
                ParamLayout::llama_sharded(config.hidden, config.heads, l.kv_heads, config.ffn, tensor)
            }
        }
    }

    /// [`ParamLayout::shard`] of a Llama block (`self` unsharded: `t = 1`).
    fn shard_llama(
        &self,
        full: &Tensor,
        rank: usize,
        tensor: usize,
        (heads, kv_heads, t): (usize, usize, usize),
    ) -> candle_core::Result<Tensor> {
        if t != 1 {
            return Err(
                Error::InvalidArgument { name: "layout", why: "shard() cuts the unsharded layout".into() }.into()
            );
        }
        let c = self.entry("input_layernorm.weight")?.shape[0];
        let f = self.entry("mlp.gate_proj.weight")?.shape[0];
        let local = ParamLayout::llama_sharded(c, heads, kv_heads, f, tensor)?;
        if rank >= tensor {
            return Err(Error::InvalidArgument { name: "rank", why: format!("{rank} is not below {tensor}") }.into());
        }
        if full.dims() != [self.total] {
            let (what, expected, got) = ("flat parameters".into(), vec![self.total], full.dims().to_vec());
            return Err(Error::Shape { what, expected, got }.into());
        }
        let d = c / heads;
        let mut parts = Vec::with_capacity(local.entries.len());
        for e in &local.entries {
            let whole = self.view(full, e.name)?;
            let part = match (e.name, e.shape.as_slice()) {
                // the KV heads this rank's query heads read: heads ⌊r·H_kv/t⌋ onwards
                ("self_attn.k_proj.weight" | "self_attn.v_proj.weight", &[rows, _]) => {
                    whole.narrow(0, rank * kv_heads / tensor * d, rows)?
                }
                (_, &[rows, _]) if whole.dim(0)? != rows => whole.narrow(0, rank * rows, rows)?,
                (_, &[_, cols]) if whole.dim(1)? != cols => whole.narrow(1, rank * cols, cols)?,
                _ => whole,
            };
            parts.push(part.contiguous()?.flatten_all()?);
        }
        Tensor::cat(&parts, 0)
    }

    /// The unsharded layout of `config`'s block ([`ParamLayout::new`] or [`ParamLayout::llama`]).
    ///
    /// # Errors
    /// As [`ParamLayout::llama`].
    pub fn of(config: &super::LayerConfig) -> Result<Self, Error> {
        let layout = match config.block {
            super::Block::Gpt => ParamLayout::new(config.hidden, config.ffn),
            super::Block::Llama(l) => ParamLayout::llama(config.hidden, config.heads, l.kv_heads, config.ffn)?,
        };
        if !matches!(config.attention, super::Attention::InputGated { .. }) {
            return Ok(layout);
        }
        // the input gate's parameters, after the block's ([`super::Attention::InputGated`])
        let (c, kv) = (config.hidden, config.kv_heads());
        let names = GateNames::of(config.block);
        let mut specs: Vec<(&'static str, Vec<usize>)> =
            layout.entries.iter().map(|e| (e.name, e.shape.clone())).collect();
        specs.extend([(names.weight, vec![kv, c]), (names.bias, vec![kv]), (names.a_log, vec![kv])]);
        let mut gated = ParamLayout::from_list_checked(specs)?;
        gated.llama = layout.llama;
        Ok(gated)
    }

    /// [`ParamLayout::from_list`] with every element count and offset checked.
    fn from_list_checked(specs: Vec<(&'static str, Vec<usize>)>) -> Result<Self, Error> {
        let total = specs.iter().try_fold(0usize, |acc, (_, shape)| {
            shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).and_then(|n| acc.checked_add(n))
        });
        match total {
            Some(_) => Ok(ParamLayout::from_list(specs)),
            None => Err(Error::InvalidArgument {
                name: "hidden",
                why: "the layer's parameter count overflows usize".into(),
            }),
        }
    }

    fn from_list(specs: Vec<(&'static str, Vec<usize>)>) -> Self {
        let mut offset = 0;
        let entries = specs
            .into_iter()
            .map(|(name, shape)| {
                let e = ParamEntry { name, offset, shape };
                offset += e.numel();
                e
            })
            .collect();
        ParamLayout { entries, total: offset, llama: None }
    }

    fn from_specs(hidden: usize, ffn: usize, tensor: usize) -> Self {
        let (c, f, t) = (hidden, ffn, tensor.max(1));
        let specs: [(&'static str, Vec<usize>); 16] = [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.q_proj.weight", vec![c / t, c]),
            ("attn.q_proj.bias", vec![c / t]),
            ("attn.k_proj.weight", vec![c / t, c]),
            ("attn.k_proj.bias", vec![c / t]),
            ("attn.v_proj.weight", vec![c / t, c]),
            ("attn.v_proj.bias", vec![c / t]),
            ("attn.out_proj.weight", vec![c, c / t]),
            ("attn.out_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.fc_in.weight", vec![f / t, c]),
            ("mlp.fc_in.bias", vec![f / t]),
            ("mlp.fc_out.weight", vec![c, f / t]),
            ("mlp.fc_out.bias", vec![c]),
        ];
        ParamLayout::from_list(specs.into())
    }

    /// The views, in order.
    #[must_use]
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// Elements of the flat tensor.
    #[must_use]
    pub fn total(&self) -> usize {
        self.total
    }

    /// The entry called `name`.
    ///
    /// # Errors
    /// [`Error::MissingParameter`] for a name the layer does not have.
    pub fn entry(&self, name: &str) -> Result<&ParamEntry, Error> {
        self.entries.iter().find(|e| e.name == name).ok_or_else(|| Error::MissingParameter { name: name.into() })
    }

    /// The view `name` of `flat` (a narrow and a reshape: no copy).
    ///
    /// # Errors
    /// [`Error::MissingParameter`]; candle's errors when `flat` is not `[total]`.
    pub fn view(&self, flat: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        let e = self.entry(name)?;
        flat.narrow(0, e.offset, e.numel())?.reshape(e.shape.as_slice())
    }

    /// A flat tensor from per-weight tensors named `prefix + name` (a checkpoint, e.g. from
    /// `candle_core::safetensors::load`), converted to f32 on `device`.
    ///
    /// # Errors
    /// [`Error::MissingParameter`] for an absent name, [`Error::Shape`] for a wrong shape.
    pub fn flatten(
        &self,
        tensors: &HashMap<String, Tensor>,
        prefix: &str,
        device: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        let mut parts = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let key = format!("{prefix}{}", e.name);
            let t = tensors.get(&key).ok_or(Error::MissingParameter { name: key.clone() })?;
            if t.dims() != e.shape.as_slice() {
                return Err(Error::Shape { what: key, expected: e.shape.clone(), got: t.dims().to_vec() }.into());
            }
            parts.push(t.to_device(device)?.to_dtype(DType::F32)?.flatten_all()?);
        }
        Tensor::cat(&parts, 0)
    }

    /// The per-weight tensors of a flat tensor (views), under their names.
    ///
    /// # Errors
    /// As [`ParamLayout::view`].
    pub fn unflatten(&self, flat: &Tensor) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        self.entries.iter().map(|e| Ok((e.name, self.view(flat, e.name)?))).collect()
    }

    /// A flat variable initialised as usual: norm weights 1, biases 0, projection weights
    /// `N(0, 0.02²)` from candle's generator on `device`; an input gate's
    /// ([`super::Attention::InputGated`]) `A_log` 0 and bias Mamba-2's (`Δ_h` log-spaced over
    /// `[10⁻³, 10⁻¹]` across the KV heads at a zero input).
    ///
    /// # Errors
    /// candle's errors.
    pub fn init(&self, device: &candle_core::Device) -> candle_core::Result<Var> {
        let mut parts = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let norm = e.name.starts_with("ln_") || e.name.ends_with("layernorm.weight");
            let t = if e.name.ends_with("decay_proj.bias") {
                // Mamba-2's: softplus(b_h) = Δ_h log-spaced over [10⁻³, 10⁻¹] (b = ln(e^Δ − 1))
                let n = e.numel();
                let dt = |h: usize| 1e-3 * 100f64.powf(if n > 1 { h as f64 / (n - 1) as f64 } else { 0.5 });
                let b: Vec<f32> = (0..n).map(|h| dt(h).exp_m1().ln() as f32).collect();
                Tensor::from_vec(b, n, device)?
            } else if e.name.ends_with("A_log") {
                // A = 1 (the decay's scale then is Δ alone)
                Tensor::zeros(e.numel(), DType::F32, device)?
            } else if norm && e.name.ends_with(".weight") {
                Tensor::ones(e.numel(), DType::F32, device)?
            } else if e.name.ends_with(".bias") {
                Tensor::zeros(e.numel(), DType::F32, device)?
            } else {
                Tensor::randn(0f32, 0.02, e.numel(), device)?
            };
            parts.push(t);
        }
        Var::from_tensor(&Tensor::cat(&parts, 0)?)
    }
}

/// The names of an input gate's parameters ([`super::Attention::InputGated`]) in a block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GateNames {
    /// `[H_kv, C]`
    pub weight: &'static str,
    /// `[H_kv]`
    pub bias: &'static str,
    /// `[H_kv]`
    pub a_log: &'static str,
}

impl GateNames {
    pub(crate) fn of(block: super::Block) -> GateNames {
        match block {
            super::Block::Gpt => {
                GateNames { weight: "attn.decay_proj.weight", bias: "attn.decay_proj.bias", a_log: "attn.A_log" }
            }
            super::Block::Llama(_) => GateNames {
                weight: "self_attn.decay_proj.weight",
                bias: "self_attn.decay_proj.bias",
                a_log: "self_attn.A_log",
            },
        }
    }
}
