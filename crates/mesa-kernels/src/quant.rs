//! Activation compression (Mesa: Pan et al., *Mesa: A Memory-saving Training Framework for
//! Transformers*, 2021, §3): the forward pass stays exact, the copy kept for backward is
//! stored as 8-, 4- or 2-bit codes with per-group offset and scale.
//!
//! Codes (asymmetric affine; Mesa §3.2, Eq. 1–2):
//!
//! ```text
//! levels = 2^bits − 1,  scale = (max − min) / levels,  offset = min
//! code   = clamp(round((x − offset) / scale), 0, levels)      round: nearest-even or stochastic
//! x̂      = code · scale + offset
//! ```
//!
//! Statistics (Mesa §3.3): per group, `min` and `max` of the batch, kept on the device as an
//! exponential moving average (`running = m · running + (1 − m) · batch`, Mesa's λ = 0.9),
//! initialised from the first batch's exact statistics. In [`StatsMode::Running`] each batch
//! after the first is quantized in **one pass** with the current estimate while the same
//! pass reduces the batch's min/max for the next update (values outside the estimate clamp);
//! [`StatsMode::Exact`] reads the input twice (statistics, then codes) for comparison.
//! Nothing synchronises with the host.
//!
//! The parameters used are stored with the codes ([`SavedActivation`]), so later updates of
//! the running estimate never change what backward decodes.
use std::ffi::c_void;

use bytemuck::{Pod, Zeroable};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, DeviceMemory, DeviceMemoryMut, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::{kernel_view, Grouping, Layout};

/// Decoding parameters of one group: `x̂ = code · scale + offset` (f32).
///
/// `scale` is NaN for a group whose input held NaN or ±Inf: it decodes to NaN.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub struct GroupParams {
    /// The group's minimum (the value of code 0).
    pub offset: f32,
    /// Quantization step: range / (2^bits − 1).
    pub scale: f32,
}

/// Per-group batch reduction (kernel scratch; layout of `MesaGroupStats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct GroupStats {
    min_key: u32,
    max_key: u32,
    nonfinite: u32,
    _pad: u32,
}

const STATS_RESET: GroupStats = GroupStats { min_key: u32::MAX, max_key: 0, nonfinite: 0, _pad: 0 };

// SAFETY: plain-old-data structs with the C layout of MesaGroupParams / MesaGroupStats
// (asserted below); all-zero bit patterns are valid.
unsafe impl DeviceRepr for GroupParams {}
unsafe impl ValidAsZeroBits for GroupParams {}
unsafe impl DeviceRepr for GroupStats {}
unsafe impl ValidAsZeroBits for GroupStats {}

const _: () = {
    assert!(std::mem::size_of::<GroupParams>() == std::mem::size_of::<sys::MesaGroupParams>());
    assert!(std::mem::align_of::<GroupParams>() == std::mem::align_of::<sys::MesaGroupParams>());
    assert!(std::mem::size_of::<GroupStats>() == std::mem::size_of::<sys::MesaGroupStats>());
    assert!(std::mem::align_of::<GroupStats>() == std::mem::align_of::<sys::MesaGroupStats>());
};

/// How codes are rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// Round to nearest, ties to even. Deterministic; error ≤ scale / 2.
    Nearest,
    /// `floor(t + u)` with `u ∈ [0, 1)` from Philox4x32-10 keyed by the seed and counted by
    /// the element's logical index: unbiased (`E[x̂] = x` inside the range), error < scale,
    /// identical on the GPU and the emulation. Batch `k` of a [`Quantizer`] uses the key
    /// `seed + k · 0x9E3779B97F4A7C15` (wrapping).
    Stochastic {
        /// Philox key of batch 0.
        seed: u64,
    },
}

/// Where the quantization range comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsMode {
    /// Mesa's running estimate: one pass per batch (first batch: exact statistics).
    Running,
    /// This batch's exact min/max: two passes per batch. The running estimate is still kept.
    Exact,
}

/// Configuration of a [`Quantizer`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantConfig {
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
    /// Which elements share parameters.
    pub grouping: Grouping,
    /// Rounding of codes.
    pub rounding: Rounding,
    /// EMA momentum `m` in `[0, 1]` (Mesa: 0.9).
    pub momentum: f32,
    /// Running estimate (one pass) or exact per-batch statistics (two passes).
    pub stats: StatsMode,
}

impl QuantConfig {
    /// Mesa's defaults: 8 bits, one group per head along `head_axis`, round to nearest,
    /// momentum 0.9, running estimate.
    #[must_use]
    pub fn per_head(head_axis: usize) -> Self {
        QuantConfig {
            bits: 8,
            grouping: Grouping::Heads { axis: head_axis },
            rounding: Rounding::Nearest,
            momentum: 0.9,
            stats: StatsMode::Running,
        }
    }

    /// Mesa's defaults with one group for the whole tensor.
    #[must_use]
    pub fn per_tensor() -> Self {
        QuantConfig { grouping: Grouping::Tensor, ..QuantConfig::per_head(0) }
    }

    fn check(&self) -> Result<()> {
        if !matches!(self.bits, 2 | 4 | 8) {
            return Err(Error::Unsupported(format!("{}-bit codes (supported: 8, 4, 2)", self.bits)));
        }
        if !(0.0..=1.0).contains(&self.momentum) {
            return Err(Error::Shape(format!("momentum {} outside [0, 1]", self.momentum)));
        }
        Ok(())
    }
}

/// Bytes of packed codes for `numel` elements at `bits` bits.
///
/// # Errors
/// [`Error::TooLarge`] when the count overflows `usize`.
pub fn code_bytes(numel: usize, bits: u32) -> Result<usize> {
    numel
        .checked_mul(bits as usize)
        .map(|b| b.div_ceil(8))
        .ok_or_else(|| Error::TooLarge(format!("{numel} elements of {bits}-bit codes overflow a byte count")))
}

/// Quantizes activations for saving, and owns the per-group running estimate on the device.
///
/// One quantizer per saved tensor (per layer, per op), as in Mesa. The group count is fixed
/// by the first batch; later batches may change other dimensions (e.g. sequence length).
pub struct Quantizer {
    device: Device,
    config: QuantConfig,
    state: Option<RunningState>,
    batches: u64,
}

/// The per-batch decisions shared by `quantize_into` and the fused producers.
struct BatchPlan {
    first: bool,
    exact: bool,
    seed: u64,
    rounding: sys::MesaRounding,
}

struct RunningState {
    groups: usize,
    running: Buffer<GroupParams>,
    stats: Buffer<GroupStats>,
}

impl Quantizer {
    /// A quantizer for `device`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a bit width other than 8, 4, 2; [`Error::Shape`] for a
    /// momentum outside `[0, 1]`.
    pub fn new(device: &Device, config: QuantConfig) -> Result<Self> {
        config.check()?;
        Ok(Quantizer { device: device.clone(), config, state: None, batches: 0 })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &QuantConfig {
        &self.config
    }

    /// The device the quantizer's state lives on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Batches quantized so far.
    #[must_use]
    pub fn batches(&self) -> u64 {
        self.batches
    }

    /// The running estimate per group (`offset` = EMA of min, `scale` = EMA of range/levels),
    /// or `None` before the first batch. Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn running_params(&self) -> Result<Option<Vec<GroupParams>>> {
        match &self.state {
            Some(s) => Ok(Some(s.running.to_vec()?)),
            None => Ok(None),
        }
    }

    /// Quantizes `x` (viewed through `layout`) into a new [`SavedActivation`], allocating its
    /// codes and parameters on the device (stream-ordered).
    ///
    /// Shapes: any rank; the group axis per [`QuantConfig::grouping`]. dtypes: f32, f16, bf16.
    /// Bytes moved: `numel · sizeof(T)` read (twice in [`StatsMode::Exact`] and on the first
    /// batch), `numel · bits / 8` written.
    ///
    /// # Errors
    /// [`Error::Shape`] (bad grouping, group count differing from the first batch),
    /// [`Error::BufferTooShort`], [`Error::TooLarge`], [`Error::WrongBackend`],
    /// [`Error::Misaligned`], CUDA errors.
    pub fn quantize<T: Element>(
        &mut self,
        x: &(impl DeviceMemory<T> + ?Sized),
        layout: &Layout,
    ) -> Result<SavedActivation> {
        let numel = layout.check_fits(x.mem_ref().len(), "input")?;
        let groups = self.config.grouping.num_groups(layout.shape())?;
        let mut saved = SavedActivation {
            codes: self.device.alloc_for_kernel::<u8>(code_bytes(numel, self.config.bits)?)?,
            params: self.device.alloc_for_kernel::<GroupParams>(groups)?,
            nonfinite: self.device.alloc_for_kernel::<u32>(1)?,
            shape: layout.shape().to_vec(),
            strides: layout.strides().to_vec(),
            dtype: T::DTYPE,
            bits: self.config.bits,
            grouping: self.config.grouping,
            companding: Companding::None,
        };
        self.quantize_into(x, layout, &mut saved)?;
        Ok(saved)
    }

    /// Like [`Quantizer::quantize`], reusing the allocations of `saved` (which must come
    /// from this quantizer's device and be sized for a tensor of the same element count and
    /// group count; it is overwritten entirely). Avoids allocation in a training loop.
    ///
    /// # Errors
    /// As [`Quantizer::quantize`], plus [`Error::Shape`] when `saved` is sized differently.
    pub fn quantize_into<T: Element>(
        &mut self,
        x: &(impl DeviceMemory<T> + ?Sized),
        layout: &Layout,
        saved: &mut SavedActivation,
    ) -> Result<()> {
        let mem = x.mem_ref();
        let numel = layout.check_fits(mem.len(), "input")?;
        let view = kernel_view(layout, &self.config.grouping, T::DTYPE)?;
        let groups = view.grouping.count as usize;
        let code_len = code_bytes(numel, self.config.bits)?;
        if saved.codes.len() != code_len || saved.params.len() != groups || saved.nonfinite.len() != 1 {
            return Err(Error::Shape(format!(
                "saved activation holds {} code bytes and {} groups; this tensor needs {code_len} and {groups}",
                saved.codes.len(),
                saved.params.len()
            )));
        }
        if numel == 0 {
            // nothing to encode; the batch does not count towards the running estimate
            self.device.copy_into(&vec![GroupParams::default(); saved.params.len()], &mut saved.params)?;
            self.device.copy_into(&[0u32], &mut saved.nonfinite)?;
            saved.set_meta(layout, T::DTYPE, &self.config);
            return Ok(());
        }
        self.state_for(groups)?;
        let BatchPlan { first, exact, seed, rounding } = self.batch_plan();
        let Quantizer { device, config, state, .. } = self;
        let state = state.as_mut().ok_or_else(|| Error::Shape("quantizer state missing".into()))?;
        let xp = device.read_ptr(&mem, layout.offset(), "input")?;
        let mut stats_mem = state.stats.mem_mut();
        let stats_p = device.write_ptr(&mut stats_mem, 0, "stats")?;
        let mut running_mem = state.running.mem_mut();
        let running_p = device.write_ptr(&mut running_mem, 0, "running")?;
        let mut params_mem = saved.params.mem_mut();
        let params_p = device.write_ptr(&mut params_mem, 0, "params")?;
        let mut codes_mem = saved.codes.mem_mut();
        let codes_p = device.write_ptr(&mut codes_mem, 0, "codes")?;
        let mut nf_mem = saved.nonfinite.mem_mut();
        let nf_p = device.write_ptr(&mut nf_mem, 0, "nonfinite")?;

        let finalize = |mode: u32| sys::MesaQuantFinalizeArgs {
            stats: stats_p.addr.cast(),
            running: running_p.addr.cast(),
            params: params_p.addr.cast(),
            nonfinite_total: nf_p.addr.cast(),
            count: groups as i64,
            momentum: config.momentum,
            bits: config.bits as i32,
            mode: mode as sys::MesaFinalizeMode,
            running_initialized: i32::from(!first),
        };
        let mut quantize = sys::MesaQuantizeArgs {
            x: xp.addr as *const c_void,
            x_desc: view.desc,
            grouping: view.grouping,
            params: params_p.addr as *const sys::MesaGroupParams,
            codes: codes_p.addr.cast(),
            stats: std::ptr::null_mut(),
            seed,
            bits: config.bits as i32,
            rounding,
            map: sys::MESA_CODE_MAP_IDENTITY as sys::MesaCodeMap,
            _pad: 0,
        };
        // SAFETY (all launches below): every pointer comes from a buffer checked above to hold
        // what the kernel touches — the input view fits its buffer (check_fits), codes hold
        // code_bytes(numel) bytes, params/stats/running hold `groups` entries, nonfinite one;
        // the cudarc guards keep the accesses ordered on the stream.
        if exact {
            let stats_args = sys::MesaQuantStatsArgs {
                x: xp.addr as *const c_void,
                x_desc: view.desc,
                grouping: view.grouping,
                stats: stats_p.addr.cast(),
            };
            unsafe {
                device.launch("quant_stats", &stats_args, sys::mesa_quant_stats, sys::mesa_emu_quant_stats)?;
                device.launch(
                    "quant_finalize",
                    &finalize(sys::MESA_FINALIZE_EXACT),
                    sys::mesa_quant_finalize,
                    sys::mesa_emu_quant_finalize,
                )?;
                device.launch("quantize", &quantize, sys::mesa_quantize, sys::mesa_emu_quantize)?;
            }
        } else {
            // one pass: codes from the running estimate, this batch's statistics reduced in
            // the same read; then params <- running (what was used), running <- EMA.
            quantize.params = running_p.addr as *const sys::MesaGroupParams;
            quantize.stats = stats_p.addr.cast();
            unsafe {
                device.launch("quantize", &quantize, sys::mesa_quantize, sys::mesa_emu_quantize)?;
                device.launch(
                    "quant_finalize",
                    &finalize(sys::MESA_FINALIZE_RUNNING),
                    sys::mesa_quant_finalize,
                    sys::mesa_emu_quant_finalize,
                )?;
            }
        }
        drop((xp, stats_p, running_p, params_p, codes_p, nf_p));
        self.batches += 1;
        saved.set_meta(layout, T::DTYPE, &self.config);
        Ok(())
    }

    /// Runs a fused producer (GELU, LayerNorm, … in [`crate::fused`]) that writes the codes of
    /// a saved tensor of `shape` in the same pass as its output, with exactly the steps of
    /// [`Quantizer::quantize_into`]: exact statistics (first batch, [`StatsMode::Exact`]) =
    /// `launch(Stats)`, finalize, `launch(Codes)`; running estimate = `launch(CodesAndStats)`
    /// with the running parameters, finalize. `strides` are recorded in the saved handle.
    pub(crate) fn produce<T: Element>(
        &mut self,
        shape: &[usize],
        strides: &[usize],
        mut launch: impl FnMut(ProducerStep, sys::MesaCodeSink) -> Result<()>,
    ) -> Result<SavedActivation> {
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::TooLarge("element count".into()))?;
        let (axis, span, groups) = self.config.grouping.resolve(shape)?;
        let group_run = match axis {
            Some(a) => span * shape[a + 1..].iter().product::<usize>(),
            None => 1,
        }
        .max(1);
        let layout = Layout::strided(shape, strides, 0)?;
        let mut saved = SavedActivation {
            codes: self.device.alloc_for_kernel::<u8>(code_bytes(numel, self.config.bits)?)?,
            params: self.device.alloc_for_kernel::<GroupParams>(groups)?,
            nonfinite: self.device.alloc_for_kernel::<u32>(1)?,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            dtype: T::DTYPE,
            bits: self.config.bits,
            grouping: self.config.grouping,
            companding: Companding::None,
        };
        if numel == 0 {
            self.device.copy_into(&vec![GroupParams::default(); groups], &mut saved.params)?;
            self.device.copy_into(&[0u32], &mut saved.nonfinite)?;
            saved.set_meta(&layout, T::DTYPE, &self.config);
            return Ok(saved);
        }
        self.state_for(groups)?;
        let BatchPlan { first, exact, seed, rounding } = self.batch_plan();
        let Quantizer { device, config, state, .. } = self;
        let state = state.as_mut().ok_or_else(|| Error::Shape("quantizer state missing".into()))?;
        let mut stats_mem = state.stats.mem_mut();
        let stats_p = device.write_ptr(&mut stats_mem, 0, "stats")?;
        let mut running_mem = state.running.mem_mut();
        let running_p = device.write_ptr(&mut running_mem, 0, "running")?;
        let mut params_mem = saved.params.mem_mut();
        let params_p = device.write_ptr(&mut params_mem, 0, "params")?;
        let mut codes_mem = saved.codes.mem_mut();
        let codes_p = device.write_ptr(&mut codes_mem, 0, "codes")?;
        let mut nf_mem = saved.nonfinite.mem_mut();
        let nf_p = device.write_ptr(&mut nf_mem, 0, "nonfinite")?;
        let sink = |codes: bool, params: *const sys::MesaGroupParams, stats: bool| sys::MesaCodeSink {
            codes: if codes { codes_p.addr.cast() } else { std::ptr::null_mut() },
            params: if codes { params } else { std::ptr::null() },
            stats: if stats { stats_p.addr.cast() } else { std::ptr::null_mut() },
            group_run: group_run as i64,
            group_count: groups as i64,
            seed,
            bits: config.bits as i32,
            rounding,
            map: sys::MESA_CODE_MAP_IDENTITY as sys::MesaCodeMap,
            _pad: 0,
        };
        let finalize = |mode: u32| sys::MesaQuantFinalizeArgs {
            stats: stats_p.addr.cast(),
            running: running_p.addr.cast(),
            params: params_p.addr.cast(),
            nonfinite_total: nf_p.addr.cast(),
            count: groups as i64,
            momentum: config.momentum,
            bits: config.bits as i32,
            mode: mode as sys::MesaFinalizeMode,
            running_initialized: i32::from(!first),
        };
        if exact {
            launch(ProducerStep::Stats, sink(false, std::ptr::null(), true))?;
            // SAFETY: stats/running/params hold `groups` entries, nonfinite one (allocated above
            // or by state_for for this group count).
            unsafe {
                device.launch(
                    "quant_finalize",
                    &finalize(sys::MESA_FINALIZE_EXACT),
                    sys::mesa_quant_finalize,
                    sys::mesa_emu_quant_finalize,
                )?;
            }
            launch(ProducerStep::Codes, sink(true, params_p.addr as *const sys::MesaGroupParams, false))?;
        } else {
            launch(ProducerStep::CodesAndStats, sink(true, running_p.addr as *const sys::MesaGroupParams, true))?;
            // SAFETY: as above.
            unsafe {
                device.launch(
                    "quant_finalize",
                    &finalize(sys::MESA_FINALIZE_RUNNING),
                    sys::mesa_quant_finalize,
                    sys::mesa_emu_quant_finalize,
                )?;
            }
        }
        drop((stats_p, running_p, params_p, codes_p, nf_p));
        self.batches += 1;
        saved.set_meta(&layout, T::DTYPE, &self.config);
        Ok(saved)
    }

    /// What this batch does: whether it is the first, whether it takes the exact (two-pass)
    /// path, and its Philox key and rounding mode.
    fn batch_plan(&self) -> BatchPlan {
        let first = self.batches == 0;
        let (seed, rounding) = match self.config.rounding {
            Rounding::Nearest => (0, sys::MESA_ROUND_NEAREST),
            Rounding::Stochastic { seed } => {
                (seed.wrapping_add(self.batches.wrapping_mul(0x9E37_79B9_7F4A_7C15)), sys::MESA_ROUND_STOCHASTIC)
            }
        };
        BatchPlan {
            first,
            exact: first || self.config.stats == StatsMode::Exact,
            seed,
            rounding: rounding as sys::MesaRounding,
        }
    }

    fn state_for(&mut self, groups: usize) -> Result<()> {
        if let Some(s) = &self.state {
            if s.groups != groups {
                return Err(Error::Shape(format!(
                    "this quantizer tracks {} groups; the tensor has {groups}",
                    s.groups
                )));
            }
        } else {
            let stats = self.device.upload(&vec![STATS_RESET; groups])?;
            let running = self.device.alloc_zeros::<GroupParams>(groups)?;
            self.state = Some(RunningState { groups, running, stats });
        }
        Ok(())
    }
}

/// Which launch of a fused producer [`Quantizer::produce`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProducerStep {
    /// Statistics of the saved tensor only (exact mode, before finalize); codes NULL.
    Stats,
    /// Output and codes with the exact parameters just finalized; stats NULL.
    Codes,
    /// Output and codes with the running estimate, statistics reduced in the same pass.
    CodesAndStats,
}

/// How the codes of a [`SavedActivation`] map to values.
///
/// With `q = code · scale + offset` (f32, one `fmaf`) the decoded value is `q` itself
/// ([`Companding::None`]) or `q · q` ([`Companding::Sqrt`]: the codes are of `√x`, uniform
/// in `√x`; for non-negative tensors with fixed parameters, e.g. the softmax output of
/// [`crate::fused::softmax_forward`]). [`SavedActivation::dequantize`] and the backward
/// kernels apply it; the saved bytes do not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Companding {
    /// Linear codes: `x̂ = q`.
    #[default]
    None,
    /// Square-root companded codes: `code = round((√x − offset)/scale)`, `x̂ = q²`. The step
    /// in `x` is `≈ 2√x · scale`: finer than linear codes below `x = 1/4` (with `[0, 1]`
    /// parameters), coarser above.
    Sqrt,
}

impl Companding {
    pub(crate) fn sys(self) -> sys::MesaCodeMap {
        (match self {
            Companding::None => sys::MESA_CODE_MAP_IDENTITY,
            Companding::Sqrt => sys::MESA_CODE_MAP_SQRT,
        }) as sys::MesaCodeMap
    }
}

/// A saved activation: packed codes, the per-group parameters that produced them, and the
/// shape/strides/dtype of the original, on the device that made it.
pub struct SavedActivation {
    codes: Buffer<u8>,
    params: Buffer<GroupParams>,
    nonfinite: Buffer<u32>,
    shape: Vec<usize>,
    strides: Vec<usize>,
    dtype: DType,
    bits: u32,
    grouping: Grouping,
    companding: Companding,
}

impl SavedActivation {
    /// Logical shape of the original tensor.
    #[must_use]
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Strides (elements) of the view it was quantized from.
    #[must_use]
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// dtype of the original tensor.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Bits per code.
    #[must_use]
    pub fn bits(&self) -> u32 {
        self.bits
    }
    /// The grouping of the parameters.
    #[must_use]
    pub fn grouping(&self) -> Grouping {
        self.grouping
    }
    /// How codes map to values (linear, or square-root companded: decoding squares).
    #[must_use]
    pub fn companding(&self) -> Companding {
        self.companding
    }
    /// Number of elements.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Number of parameter groups.
    #[must_use]
    pub fn num_groups(&self) -> usize {
        self.params.len()
    }
    /// Bytes held for backward: packed codes + 8 bytes per group + a 4-byte non-finite counter.
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.codes.size_in_bytes() + self.params.size_in_bytes() + self.nonfinite.size_in_bytes()
    }
    /// Bytes of the original tensor (`numel · sizeof(dtype)`).
    #[must_use]
    pub fn original_bytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }
    /// The packed codes (logical row-major order; bits < 8 pack the first element in the
    /// least significant bits of each byte).
    #[must_use]
    pub fn codes(&self) -> &Buffer<u8> {
        &self.codes
    }
    /// Copies the per-group parameters to the host. Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn params(&self) -> Result<Vec<GroupParams>> {
        self.params.to_vec()
    }
    /// Number of NaN/±Inf inputs seen (their groups decode to NaN). Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn nonfinite_count(&self) -> Result<u32> {
        Ok(self.nonfinite.to_vec()?.first().copied().unwrap_or(0))
    }

    /// Overwrites codes and parameters with a byte pattern (tests poison outputs with this
    /// to check that every byte is written).
    #[doc(hidden)]
    pub fn fill_for_testing(&mut self, device: &Device, byte: u8) -> Result<()> {
        let codes = vec![byte; self.codes.len()];
        device.copy_into(&codes, &mut self.codes)?;
        let f = f32::from_bits(u32::from_ne_bytes([byte; 4]));
        let params = vec![GroupParams { offset: f, scale: f }; self.params.len()];
        device.copy_into(&params, &mut self.params)?;
        device.copy_into(&[u32::from_ne_bytes([byte; 4])], &mut self.nonfinite)
    }

    /// Decodes into `y` viewed through `layout` (any strides, same shape as the original;
    /// any of f32/f16/bf16, independent of the original dtype). Stream-ordered. Each value is
    /// `q = code · scale + offset` (f32 `fmaf`), squared for [`Companding::Sqrt`].
    ///
    /// Bytes moved: `numel · bits / 8` read, `numel · sizeof(T)` written.
    ///
    /// # Errors
    /// [`Error::Shape`] (shape differs, output view overlaps itself),
    /// [`Error::BufferTooShort`], [`Error::WrongBackend`], [`Error::Misaligned`], CUDA errors.
    pub fn dequantize<T: Element>(
        &self,
        device: &Device,
        y: &mut (impl DeviceMemoryMut<T> + ?Sized),
        layout: &Layout,
    ) -> Result<()> {
        if layout.shape() != self.shape.as_slice() {
            return Err(Error::Shape(format!(
                "dequantize into shape {:?}, saved shape is {:?}",
                layout.shape(),
                self.shape
            )));
        }
        self.check_device(device)?;
        let mut mem = y.mem_mut();
        let numel = layout.check_fits(mem.len(), "output")?;
        layout.check_no_overlap("output")?;
        if numel == 0 {
            return Ok(());
        }
        let view = kernel_view(layout, &self.grouping, T::DTYPE)?;
        let codes_mem = self.codes.mem_ref();
        let codes_p = device.read_ptr(&codes_mem, 0, "codes")?;
        let params_mem = self.params.mem_ref();
        let params_p = device.read_ptr(&params_mem, 0, "params")?;
        let yp = device.write_ptr(&mut mem, layout.offset(), "output")?;
        let args = sys::MesaDequantizeArgs {
            codes: codes_p.addr as *const u8,
            params: params_p.addr as *const sys::MesaGroupParams,
            grouping: view.grouping,
            y: yp.addr,
            y_desc: view.desc,
            bits: self.bits as i32,
            map: self.companding.sys(),
        };
        // SAFETY: the output view fits its buffer and does not overlap itself; codes and
        // params were sized for this shape and grouping when quantized.
        unsafe { device.launch("dequantize", &args, sys::mesa_dequantize, sys::mesa_emu_dequantize) }
    }

    /// An uninitialised handle for a producer with fixed parameters (softmax).
    pub(crate) fn allocate(
        device: &Device,
        shape: &[usize],
        strides: &[usize],
        dtype: DType,
        bits: u32,
        grouping: Grouping,
        companding: Companding,
    ) -> Result<SavedActivation> {
        let numel = shape.iter().product::<usize>();
        let groups = grouping.num_groups(shape)?;
        Ok(SavedActivation {
            codes: device.alloc_for_kernel::<u8>(code_bytes(numel, bits)?)?,
            params: device.alloc_for_kernel::<GroupParams>(groups)?,
            nonfinite: device.upload(&[0u32])?,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            dtype,
            bits,
            grouping,
            companding,
        })
    }

    /// Mutable access to (codes, params, nonfinite) for a producer kernel.
    pub(crate) fn parts_mut(&mut self) -> (&mut Buffer<u8>, &mut Buffer<GroupParams>, &mut Buffer<u32>) {
        (&mut self.codes, &mut self.params, &mut self.nonfinite)
    }

    /// Read access to (codes, params) for a consumer kernel.
    pub(crate) fn parts(&self) -> (&Buffer<u8>, &Buffer<GroupParams>) {
        (&self.codes, &self.params)
    }

    /// `(i / run) % count` map of the groups over the logical shape: (run, count).
    pub(crate) fn group_map(&self) -> Result<(usize, usize)> {
        let (axis, span, count) = self.grouping.resolve(&self.shape)?;
        let run = match axis {
            Some(a) => span * self.shape[a + 1..].iter().product::<usize>(),
            None => 1,
        };
        Ok((run.max(1), count))
    }

    /// Checks that the handle lives on `device`'s backend.
    pub(crate) fn check_backend(&self, device: &Device) -> Result<()> {
        self.check_device(device)
    }

    fn set_meta(&mut self, layout: &Layout, dtype: DType, config: &QuantConfig) {
        self.shape = layout.shape().to_vec();
        self.strides = layout.strides().to_vec();
        self.dtype = dtype;
        self.bits = config.bits;
        self.grouping = config.grouping;
        self.companding = Companding::None;
    }

    fn check_device(&self, device: &Device) -> Result<()> {
        match (device.kind(), &self.codes) {
            (Kind::Cuda(_), Buffer::Cuda(_)) | (Kind::Emulator, Buffer::Host(_)) => Ok(()),
            _ => Err(Error::WrongBackend("saved activation belongs to another backend".into())),
        }
    }
}
