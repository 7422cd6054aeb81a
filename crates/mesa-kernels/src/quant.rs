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
//! after the first is quantized in **one pass** with the current estimate `{o, s}` while the
//! same pass reduces the batch's min/max; a group whose batch left the estimate by more than
//! one step (`min < o − s` or `max > o + (levels + 1)·s`) is then saved with the batch's exact
//! range instead and encoded again by a second launch that touches only such groups (no host
//! synchronisation: it reads one counter and returns when no group escaped). So every finite
//! element decodes within one step of its group's saved scale (values outside the estimate
//! clamp only inside that one-step band). The EMA is updated from the batch's statistics.
//! [`StatsMode::Exact`] reads the input twice (statistics, then codes) for comparison.
//! Nothing synchronises with the host. Bytes of each launch: `docs/kernels.md`.
//!
//! The parameters used are stored with the codes ([`SavedActivation`]), so later updates of
//! the running estimate never change what backward decodes. The codes, parameters and
//! non-finite counter can also live in memory the caller owns (a host framework's
//! allocator): [`SavedViewMut`] / [`SavedView`], sized by [`saved_sizes`]
//! (`docs/fused.md`, "Codes in memory the caller owns"); the owned handle runs through
//! the same views.
//!
//! How far the estimate was from a batch ([`Quantizer::batch_report`], off unless
//! [`Quantizer::set_batch_report`]): the batch's widened groups, its clamped groups and the
//! largest error in steps of the saved scale — the exact error of the clamped extremes, and
//! a bound (`max(clamp, 1/2 or 1)`) over all elements ([`BatchReport`]). Computed on the host
//! from copies of the batch's exact per-group min/max and saved parameters that the batch
//! leaves on the device (two small device-to-device copies per batch; finalize then runs as
//! its own launch).
use bytemuck::{Pod, Zeroable};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::{kernel_view, Grouping, Layout};
use crate::tensor::{TensorMut, TensorRef};

mod saved_view;
pub(crate) use saved_view::check_code_address;
pub use saved_view::{saved_sizes, SavedSizes, SavedView, SavedViewMut, CODE_ALIGN};

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
    /// `floor(t' + u)` with `t'` the position `t` on the 2⁻¹⁶ grid and `u = k / 2¹⁶` from 16
    /// bits of Philox4x32-7 (Salmon et al., SC'11) keyed by the call's key and counted by the
    /// element's logical index, evaluated in integers (`(rint(t·2¹⁶) + k) >> 16`: a value on
    /// a level keeps its code): unbiased to within 2⁻¹⁷ of a step (`E[x̂] = x` inside the range
    /// up to the grid of `t'`), error < scale, identical on the GPU and the emulation and on
    /// every kernel path. Batch `k` of a [`Quantizer`] uses the key
    /// `seed + k · 0x9E3779B97F4A7C15` (wrapping): replayable from the seed and the batch
    /// count. The bits: [`crate::reference::quant::rounding_bits`]; docs/kernels.md,
    /// "Stochastic rounding".
    Stochastic {
        /// Philox key of batch 0.
        seed: u64,
    },
}

/// Where the quantization range comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsMode {
    /// Mesa's running estimate: one pass per batch (first batch: exact statistics), plus a
    /// second launch that encodes again the groups whose batch left the estimate by more than
    /// one step (saved with their exact range; none in the steady state). Error ≤ one step of
    /// the saved scale for every finite element (module docs).
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
            return Err(Error::unsupported("bits", format!("{}-bit codes (supported: 8, 4, 2)", self.bits)));
        }
        if !(0.0..=1.0).contains(&self.momentum) {
            return Err(Error::invalid_argument("momentum", format!("{} is outside [0, 1]", self.momentum)));
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
        .ok_or_else(|| Error::too_large("codes", format!("{numel} elements of {bits}-bit codes overflow a byte count")))
}

/// The product of `shape`, or [`Error::TooLarge`] when it overflows `usize`.
pub(crate) fn checked_numel(shape: &[usize], what: &str) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::too_large(what, format!("the element count of shape {shape:?} overflows")))
}

/// What the last batch of a [`Quantizer`] did to its values (Mesa §3.3: how far the running
/// estimate was from the batch), from [`Quantizer::batch_report`].
///
/// Steps are of each group's **saved** scale, the parameters the batch was encoded with and
/// that backward decodes: the running estimate for a kept group, the batch's own exact range
/// for a widened one. With `L = 2^bits − 1` and a group's saved `{offset o, scale s}` (f32),
/// its codes decode to `[o, top]`, `top = fmaf(L, s, o)` (the kernels' decode). From the
/// batch's exact per-group `min`/`max` (f32, as reduced by the kernels):
///
/// ```text
/// excursion_g = max(o − min, max − top, 0) / s          (f64; 0 when s = 0 and min = max = o)
/// max_clamp_steps = max_g excursion_g                    (exact: attained)
/// max_error_steps = max(max_clamp_steps, r),  r = 1/2 (nearest) or 1 (stochastic rounding)
/// ```
///
/// An element below `o` gets code 0 and decodes to `o`; one above `top` gets code `L` and
/// decodes to `top` (in both roundings), so the group's extreme element errs by exactly its
/// excursion: `max_clamp_steps` is the **exact** largest error of the clamped elements
/// (up to the f64 rounding of one subtraction and one division), attained by the batch's
/// extreme element. Elements inside `[o, top]` err by at most `r` steps (plus the f32
/// rounding of the code position and of the decode, relative `≈ 2⁻²³·|x| / s`), a bound
/// that is not necessarily attained. So `max_error_steps` is an **upper bound** on
/// `max |x − x̂| / s` over the batch's finite elements, equal to the exact maximum whenever
/// `max_clamp_steps > r` (then the extreme element attains it). `max_clamp_steps ≤ 1` (up to
/// the f32 rounding of `top`): a group that left the estimate by more than one step is
/// widened, and a widened group's range holds its batch (excursion 0).
///
/// Groups with NaN/±Inf inputs (their saved scale is NaN: they decode to NaN) are counted
/// in `nonfinite_groups` and left out of both maxima; a batch of such groups only reports
/// 0 steps.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchReport {
    /// [`Quantizer::batches`] after the reported batch (it is batch `batches − 1`).
    pub batches: u64,
    /// Whether it was encoded in one pass with the running estimate ([`StatsMode::Running`]
    /// after the first batch); otherwise with its own exact statistics.
    pub one_pass: bool,
    /// Parameter groups.
    pub groups: usize,
    /// Groups saved with the batch's exact range because the batch left the running estimate
    /// by more than one step (0 for a batch not encoded in one pass).
    pub widened_groups: usize,
    /// Groups with a finite element outside the range their saved parameters decode to
    /// (elements clamped to code 0 or `L`; in the one-step band, else the group is widened).
    pub clamped_groups: usize,
    /// Groups with NaN/±Inf inputs, left out of the error figures.
    pub nonfinite_groups: usize,
    /// The largest error of a clamped element, in steps of its group's saved scale (exact;
    /// 0 when nothing clamped).
    pub max_clamp_steps: f64,
    /// Upper bound on the largest error of any finite element, in steps of its group's saved
    /// scale: `max(max_clamp_steps, 1/2 or 1)` (see the type's docs).
    pub max_error_steps: f64,
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
    /// Whether each batch keeps what [`Quantizer::batch_report`] reads.
    reporting: bool,
    /// What the last batch recorded for its report (`None`: nothing valid recorded).
    recorded: Option<RecordedBatch>,
}

impl std::fmt::Debug for Quantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quantizer")
            .field("device", &self.device)
            .field("config", &self.config)
            .field("groups", &self.state.as_ref().map(|s| s.groups))
            .field("batches", &self.batches)
            .field("reporting", &self.reporting)
            .finish()
    }
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
    /// `[groups + 1]`: 1 for a group the last one-pass batch widened, then their count.
    widen: Buffer<u32>,
    /// One counter: the blocks of a statistics pass that finalizes the batch itself
    /// (`sys::MesaFusedFinalize`); 0 between launches.
    arrivals: Buffer<u32>,
    /// The last batch's statistics and saved parameters, while reports are on.
    record: Option<ReportBuffers>,
}

/// Device copies kept for [`Quantizer::batch_report`]: `[groups]` each.
struct ReportBuffers {
    /// The batch's statistics as reduced, copied before finalize resets them (16 B a group).
    stats: Buffer<GroupStats>,
    /// The parameters the batch was saved with, copied after finalize (8 B a group).
    params: Buffer<GroupParams>,
}

/// Host facts about the batch whose copies [`ReportBuffers`] hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RecordedBatch {
    /// Encoded in one pass with the running estimate (the widen flags are this batch's).
    one_pass: bool,
    /// [`Quantizer::batches`] after it.
    batches: u64,
    rounding: Rounding,
    bits: u32,
}

/// Who finalizes a batch (statistics → parameters and running estimate): the producer's own
/// statistics pass in its last block, or a separate `quant_finalize` launch after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finalize {
    /// The producer's statistics kernels take the `sys::MesaFusedFinalize` they are given.
    InPass,
    /// `encode` launches `quant_finalize` after the statistics pass.
    Separate,
}

impl Quantizer {
    /// A quantizer for `device`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a bit width other than 8, 4, 2; [`Error::InvalidArgument`]
    /// for a momentum outside `[0, 1]` (or NaN).
    pub fn new(device: &Device, config: QuantConfig) -> Result<Self> {
        config.check()?;
        Ok(Quantizer { device: device.clone(), config, state: None, batches: 0, reporting: false, recorded: None })
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

    /// How many groups the last batch in one pass ([`StatsMode::Running`]) saved with its own
    /// exact range because it left the running estimate by more than one step, or `None`
    /// before such a batch. Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn widened_groups(&self) -> Result<Option<u32>> {
        match &self.state {
            Some(s) if self.batches > 1 && self.config.stats == StatsMode::Running => {
                Ok(s.widen.to_vec()?.last().copied())
            }
            _ => Ok(None),
        }
    }

    /// Turns the per-batch record behind [`Quantizer::batch_report`] on or off (off for a new
    /// quantizer). Turning it off frees the record; turning it on takes effect from the
    /// next batch.
    ///
    /// Cost per batch while on (stream-ordered, no host synchronisation): two
    /// device-to-device copies, of the batch's statistics (16 B a group) before finalize
    /// resets them and of its saved parameters (8 B a group) after; and finalize runs as a
    /// launch of its own after the statistics pass ([`Quantizer::quantize`]: three launches
    /// per one-pass batch instead of two, plus the copies; the fused producers launch it
    /// anyway). Memory: 24 B a group on the device.
    pub fn set_batch_report(&mut self, enabled: bool) {
        self.reporting = enabled;
        if !enabled {
            self.recorded = None;
            if let Some(state) = self.state.as_mut() {
                state.record = None;
            }
        }
    }

    /// Whether batches are recorded for [`Quantizer::batch_report`].
    #[must_use]
    pub fn batch_report_enabled(&self) -> bool {
        self.reporting
    }

    /// The report of the last batch ([`BatchReport`]: groups, widened groups, the largest
    /// quantization error in steps), or `None` when that batch was not recorded (reports off,
    /// see [`Quantizer::set_batch_report`], or no batch since they were turned on). An empty
    /// tensor is no batch and leaves the report as it was.
    ///
    /// Host computation from the copies the batch left on the device; synchronises (three
    /// small device→host copies: 16 + 8 + 4 B a group).
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn batch_report(&self) -> Result<Option<BatchReport>> {
        let (Some(recorded), Some(state)) = (self.recorded, self.state.as_ref()) else {
            return Ok(None);
        };
        let Some(record) = state.record.as_ref() else {
            return Ok(None);
        };
        let stats = record.stats.to_vec()?;
        let params = record.params.to_vec()?;
        let widened = match recorded.one_pass {
            true => state.widen.to_vec()?.last().map_or(0, |&n| n as usize),
            false => 0,
        };
        Ok(Some(batch_report(&stats, &params, widened, recorded)))
    }

    /// Quantizes `x` into a new [`SavedActivation`], allocating its codes and parameters on
    /// the device (stream-ordered).
    ///
    /// Shapes: any rank; the group axis per [`QuantConfig::grouping`]. dtypes: f32, f16, bf16.
    /// Bytes moved: `numel · sizeof(T)` read (twice in [`StatsMode::Exact`] and on the first
    /// batch), `numel · bits / 8` written; in [`StatsMode::Running`] the elements of the
    /// groups that escaped the estimate are read and encoded once more (none in the steady
    /// state). An empty tensor launches nothing and does not count
    /// as a batch. In-place: not applicable (the codes are new memory); a raw input pointer
    /// into the handle's buffers is rejected (overlapping inputs and outputs →
    /// [`Error::Aliasing`]).
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] (bad grouping, group count differing from the first batch),
    /// [`Error::TooLarge`] (code count overflows), [`Error::Unsupported`] (more than
    /// [`MAX_DIMS`](crate::MAX_DIMS) dimensions that cannot merge), [`Error::WrongBackend`],
    /// [`Error::Misaligned`], [`Error::Aliasing`], CUDA errors ([`Error::Driver`],
    /// [`Error::CudaRuntime`]).
    pub fn quantize<T: Element>(&mut self, x: &TensorRef<'_, T>) -> Result<SavedActivation> {
        let mut saved = self.new_saved(x.layout(), T::DTYPE)?;
        self.quantize_into(x, &mut saved)?;
        Ok(saved)
    }

    /// Like [`Quantizer::quantize`], reusing the allocations of `saved` (which must come
    /// from this quantizer's device and be sized for a tensor of the same element count and
    /// group count; it is overwritten entirely). Avoids allocation in a training loop.
    ///
    /// # Errors
    /// As [`Quantizer::quantize`], plus [`Error::InvalidArgument`] when `saved` is sized
    /// differently.
    pub fn quantize_into<T: Element>(&mut self, x: &TensorRef<'_, T>, saved: &mut SavedActivation) -> Result<()> {
        let groups = self.config.grouping.num_groups(x.shape())?;
        let code_len = code_bytes(x.numel(), self.config.bits)?;
        if saved.codes.len() != code_len || saved.params.len() != groups || saved.nonfinite.len() != 1 {
            return Err(Error::invalid_argument(
                "saved",
                format!(
                    "the handle holds {} code bytes and {} groups; this tensor needs {code_len} and {groups}",
                    saved.codes.len(),
                    saved.params.len()
                ),
            ));
        }
        saved.check_device(&self.device)?;
        let (mut view, meta) = saved.view_mut()?;
        *meta = self.quantize_to(x, &mut view)?;
        Ok(())
    }

    /// Like [`Quantizer::quantize`], writing the codes, parameters and non-finite count into
    /// memory the caller owns (`out`, sized by [`saved_sizes`] for `x`'s shape and this
    /// quantizer's config; overwritten entirely). Returns what the codes encode: keep it
    /// with the buffers, [`SavedView::new`] needs it to read them.
    ///
    /// The running estimate (and the statistics scratch, the widened-group flags, the batch
    /// report's record) stays in the quantizer; everything a later decode needs is in `out`.
    ///
    /// # Errors
    /// As [`Quantizer::quantize`], plus [`Error::BufferTooShort`] / [`Error::InvalidArgument`]
    /// (a part of `out` shorter / longer than the tensor needs), [`Error::Misaligned`]
    /// (codes not [`CODE_ALIGN`]-byte aligned, or a raw pointer not aligned to its element),
    /// [`Error::Aliasing`] (`out`'s parts overlapping each other or `x`). Nothing is launched
    /// when a check fails.
    pub fn quantize_to<T: Element>(&mut self, x: &TensorRef<'_, T>, out: &mut SavedViewMut<'_>) -> Result<SavedMeta> {
        self.config.grouping.num_groups(x.shape())?;
        // the kernel view merges dimensions: only for a non-empty tensor (its sub-products
        // are then bounded by the checked element count); nothing is launched otherwise
        let view = match x.numel() {
            0 => None,
            _ => Some(kernel_view(x.layout(), &self.config.grouping, T::DTYPE)?),
        };
        let device = self.device.clone();
        let mut launch = Launch::new(&device);
        let xp = launch.input(x, "input")?;
        let meta =
            self.encode::<T>(&mut launch, out, x.layout(), Finalize::InPass, |launch, step, sink, finalize| {
                // SAFETY (both kernels): `xp` is the registered input view described by
                // `view.desc`; the sink's codes/params/stats are the saved handle's and the
                // quantizer's buffers, registered by `encode` and sized there for this tensor.
                // (`encode` runs no step for an empty tensor, the only case without a view.)
                let view = view.as_ref().ok_or(Error::KernelArgument { op: "quantize of an empty tensor" })?;
                match step {
                    ProducerStep::Stats => {
                        let args = sys::MesaQuantStatsArgs {
                            x: xp,
                            x_desc: view.desc,
                            grouping: view.grouping,
                            stats: sink.stats,
                            finalize,
                        };
                        unsafe { launch.launch("quant_stats", &args, sys::mesa_quant_stats, sys::mesa_emu_quant_stats) }
                    }
                    ProducerStep::Codes | ProducerStep::CodesAndStats | ProducerStep::Widen(_) => {
                        let widen = match step {
                            ProducerStep::Widen(flags) => flags,
                            _ => std::ptr::null(),
                        };
                        let args = sys::MesaQuantizeArgs {
                            x: xp,
                            x_desc: view.desc,
                            grouping: view.grouping,
                            params: sink.params,
                            codes: sink.codes,
                            stats: sink.stats,
                            seed: sink.seed,
                            bits: sink.bits,
                            rounding: sink.rounding,
                            map: sys::MESA_CODE_MAP_IDENTITY as sys::MesaCodeMap,
                            _pad: 0,
                            widen,
                            finalize,
                        };
                        unsafe { launch.launch("quantize", &args, sys::mesa_quantize, sys::mesa_emu_quantize) }
                    }
                }
            })?;
        launch.finish()?;
        Ok(meta)
    }

    /// An unwritten handle sized for a tensor of `layout`'s shape with this quantizer's bit
    /// width and grouping (element count checked before any product is used).
    pub(crate) fn new_saved(&self, layout: &Layout, dtype: DType) -> Result<SavedActivation> {
        SavedActivation::allocate(
            &self.device,
            &SavedMeta {
                shape: layout.shape().to_vec(),
                strides: layout.strides().to_vec(),
                dtype,
                bits: self.config.bits,
                grouping: self.config.grouping,
                companding: Companding::None,
            },
        )
    }

    /// Encodes one batch into `saved` (made by [`Quantizer::new_saved`] for a tensor of
    /// `layout`), with the steps shared by [`Quantizer::quantize_into`] and the fused
    /// producers: exact statistics (first batch, [`StatsMode::Exact`]) = `run(Stats)`,
    /// finalize, `run(Codes)`; running estimate = `run(CodesAndStats)` with the running
    /// parameters, finalize (which flags the groups that escaped the estimate and saves their
    /// exact range), `run(Widen)` with the saved parameters. `run` launches the producer's kernel through `launch`, on which
    /// the caller has registered the producer's own tensors; the quantizer's state and the
    /// handle's buffers are registered here. An empty tensor launches nothing and does not
    /// count as a batch.
    pub(crate) fn encode<'a, T: Element>(
        &'a mut self,
        launch: &mut Launch<'a>,
        saved: &'a mut SavedViewMut<'_>,
        layout: &Layout,
        finalize_by: Finalize,
        mut run: impl FnMut(&mut Launch<'a>, ProducerStep, sys::MesaCodeSink, sys::MesaFusedFinalize) -> Result<()>,
    ) -> Result<SavedMeta> {
        if !same_stream(launch.device(), &self.device) {
            return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
        }
        let meta = self.meta_for(layout, T::DTYPE);
        let groups = saved.check_sizes(&meta)?.groups;
        // the caller's memory is registered (backend, alignment, aliasing) before anything runs
        let SavedViewMut { codes, params, nonfinite } = saved;
        let codes = launch.output(codes, "saved codes")?.cast::<u8>();
        check_code_address(codes as usize, "saved codes")?;
        let params = launch.output(params, "saved parameters")?.cast::<GroupParams>();
        let nonfinite = launch.output(nonfinite, "non-finite counter")?.cast::<u32>();
        if layout.numel() == 0 {
            // nothing to encode; the batch does not count towards the running estimate
            // SAFETY: params holds `groups` entries and the counter one (check_sizes), both
            // registered above
            unsafe {
                zero_registered(launch, params, groups)?;
                zero_registered(launch, nonfinite, 1)?;
            }
            return Ok(meta);
        }
        let group_run = meta.group_map()?.0;
        self.state_for(groups)?;
        self.record_for(groups)?;
        let BatchPlan { first, exact, seed, rounding } = self.batch_plan();
        let Quantizer { config, state, batches, recorded, .. } = self;
        // invalid until this batch's copies are enqueued
        *recorded = None;
        let state = state.as_mut().ok_or(Error::KernelArgument { op: "quantizer state" })?;
        // a recorded batch finalizes in a launch of its own: its statistics are copied in
        // between, before finalize resets them
        let record = match state.record.as_mut() {
            Some(r) => Some((
                launch.write_buffer(&mut r.stats, "batch report statistics")?,
                launch.write_buffer(&mut r.params, "batch report parameters")?,
            )),
            None => None,
        };
        let finalize_by = if record.is_some() { Finalize::Separate } else { finalize_by };
        let stats = launch.write_buffer(&mut state.stats, "quantizer statistics")?;
        let running = launch.write_buffer(&mut state.running, "running estimate")?;
        let widen = launch.write_buffer(&mut state.widen, "widened groups")?;
        let arrivals = match finalize_by {
            Finalize::InPass => launch.write_buffer(&mut state.arrivals, "finalize arrivals")?,
            Finalize::Separate => std::ptr::null_mut(),
        };
        let sink = |with_codes: bool, params: *const GroupParams, with_stats: bool| sys::MesaCodeSink {
            codes: if with_codes { codes } else { std::ptr::null_mut() },
            params: if with_codes { params.cast() } else { std::ptr::null() },
            stats: if with_stats { stats.cast() } else { std::ptr::null_mut() },
            group_run: group_run as i64,
            group_count: groups as i64,
            seed,
            bits: config.bits as i32,
            rounding,
            map: sys::MESA_CODE_MAP_IDENTITY as sys::MesaCodeMap,
            _pad: 0,
        };
        let finalize = |mode: u32| sys::MesaQuantFinalizeArgs {
            stats: stats.cast(),
            running: running.cast(),
            params: params.cast(),
            nonfinite_total: nonfinite,
            widen: if mode == sys::MESA_FINALIZE_RUNNING { widen } else { std::ptr::null_mut() },
            count: groups as i64,
            momentum: config.momentum,
            bits: config.bits as i32,
            mode: mode as sys::MesaFinalizeMode,
            running_initialized: i32::from(!first),
        };
        // The finalize of a statistics pass: inside it (its last block; the counter was
        // registered above and is 0 between launches), or a launch of its own after it.
        // SAFETY (finalize): stats, running and params hold `groups` entries (state_for and
        // the handle's allocation for this group count), nonfinite one; all registered above.
        let mut stats_pass = |launch: &mut Launch<'a>, step: ProducerStep, sink: sys::MesaCodeSink, mode: u32| {
            let fused = sys::MesaFusedFinalize {
                args: finalize(mode),
                arrivals: if finalize_by == Finalize::InPass { arrivals } else { std::ptr::null_mut() },
            };
            run(launch, step, sink, fused)?;
            if let Some((record_stats, _)) = record {
                // SAFETY: both hold `groups` entries (state_for, record_for), registered above
                unsafe { copy_registered(launch, stats.cast_const(), record_stats, groups)? };
            }
            if finalize_by == Finalize::Separate {
                let args = finalize(mode);
                unsafe {
                    launch.launch("quant_finalize", &args, sys::mesa_quant_finalize, sys::mesa_emu_quant_finalize)?
                };
            }
            if let Some((_, record_params)) = record {
                // SAFETY: both hold `groups` entries (the handle's allocation, record_for)
                unsafe { copy_registered(launch, params.cast_const(), record_params, groups)? };
            }
            Ok::<(), Error>(())
        };
        if exact {
            stats_pass(launch, ProducerStep::Stats, sink(false, std::ptr::null(), true), sys::MESA_FINALIZE_EXACT)?;
            run(launch, ProducerStep::Codes, sink(true, params, false), sys::MesaFusedFinalize::default())?;
        } else {
            // one pass: codes from the running estimate, this batch's statistics reduced in
            // the same read; then params <- running (what was used) or, for a group that
            // escaped it, the batch's exact range; running <- EMA of the batch statistics;
            // then the escaped groups (none in the steady state) are encoded again.
            stats_pass(launch, ProducerStep::CodesAndStats, sink(true, running, true), sys::MESA_FINALIZE_RUNNING)?;
            run(launch, ProducerStep::Widen(widen), sink(true, params, false), sys::MesaFusedFinalize::default())?;
        }
        *batches += 1;
        if record.is_some() {
            *recorded = Some(RecordedBatch {
                one_pass: !exact,
                batches: *batches,
                rounding: config.rounding,
                bits: config.bits,
            });
        }
        Ok(meta)
    }

    /// What codes of a tensor of `layout` and `dtype` saved by this quantizer encode.
    pub(crate) fn meta_for(&self, layout: &Layout, dtype: DType) -> SavedMeta {
        SavedMeta {
            shape: layout.shape().to_vec(),
            strides: layout.strides().to_vec(),
            dtype,
            bits: self.config.bits,
            grouping: self.config.grouping,
            companding: Companding::None,
        }
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
                return Err(Error::invalid_layout(
                    "input",
                    format!("this quantizer tracks {} groups; the tensor has {groups}", s.groups),
                ));
            }
        } else {
            let stats = self.device.upload(&vec![STATS_RESET; groups])?;
            let running = self.device.alloc_zeros::<GroupParams>(groups)?;
            let flags = groups.checked_add(1).ok_or_else(|| Error::too_large("groups", "the group count overflows"))?;
            let widen = self.device.alloc_zeros::<u32>(flags)?;
            let arrivals = self.device.alloc_zeros::<u32>(1)?;
            self.state = Some(RunningState { groups, running, stats, widen, arrivals, record: None });
        }
        Ok(())
    }

    /// Allocates the report's copies (`[groups]` each) when reports are on and they are not
    /// there yet (after [`Quantizer::state_for`]).
    fn record_for(&mut self, groups: usize) -> Result<()> {
        match self.state.as_mut() {
            Some(state) if self.reporting && state.record.is_none() => {
                state.record = Some(ReportBuffers {
                    stats: self.device.upload(&vec![STATS_RESET; groups])?,
                    params: self.device.alloc_zeros::<GroupParams>(groups)?,
                });
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// The f32 value of an order-preserving key of the statistics (the kernels' `key_float`).
fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 { key & 0x7fff_ffff } else { !key })
}

/// How far one group's finite batch range `[lo, hi]` (f32) lies outside what its saved
/// parameters decode to, `[o, fmaf(L, s, o)]`, in steps `s` (f64, ≥ 0). A zero step decodes
/// every code to `o`: 0 when the range is `{o}`, else `+inf` (the running path never saves
/// such a group: it would have been widened).
fn excursion_steps(lo: f32, hi: f32, p: GroupParams, levels: f32) -> f64 {
    let top = levels.mul_add(p.scale, p.offset);
    let below = f64::from(p.offset) - f64::from(lo);
    let above = f64::from(hi) - f64::from(top);
    let out = below.max(above).max(0.0);
    match (out > 0.0, p.scale > 0.0) {
        (false, _) => 0.0,
        (true, true) => out / f64::from(p.scale),
        (true, false) => f64::INFINITY,
    }
}

/// The report of one batch from its statistics and saved parameters (`[groups]` each,
/// host copies) and its widened-group count.
fn batch_report(stats: &[GroupStats], params: &[GroupParams], widened: usize, batch: RecordedBatch) -> BatchReport {
    let levels = ((1u32 << batch.bits) - 1) as f32;
    let rounding_steps = match batch.rounding {
        Rounding::Nearest => 0.5,
        Rounding::Stochastic { .. } => 1.0,
    };
    let mut report = BatchReport {
        batches: batch.batches,
        one_pass: batch.one_pass,
        groups: stats.len(),
        widened_groups: widened,
        clamped_groups: 0,
        nonfinite_groups: 0,
        max_clamp_steps: 0.0,
        max_error_steps: 0.0,
    };
    for (s, &p) in stats.iter().zip(params) {
        if s.nonfinite != 0 {
            report.nonfinite_groups += 1;
            continue;
        }
        if s.min_key == STATS_RESET.min_key {
            continue; // no element
        }
        let steps = excursion_steps(key_value(s.min_key), key_value(s.max_key), p, levels);
        report.clamped_groups += usize::from(steps > 0.0);
        report.max_clamp_steps = report.max_clamp_steps.max(steps);
        // a zero step decodes its (all equal) elements exactly: no rounding error
        let rounding = if p.scale > 0.0 { rounding_steps } else { 0.0 };
        report.max_error_steps = report.max_error_steps.max(steps.max(rounding));
    }
    report
}

/// Copies `len` elements from `src` to `dst`, both addresses of buffers registered on
/// `launch` (at least `len` elements each, not overlapping), ordered on its stream after
/// the work enqueued so far (the emulation runs synchronously: copied now).
///
/// # Safety
/// As stated: `src` and `dst` come from `launch`'s registrations and hold `len` elements.
unsafe fn copy_registered<T: Copy>(launch: &Launch<'_>, src: *const T, dst: *mut T, len: usize) -> Result<()> {
    match launch.device().kind() {
        Kind::Emulator => {
            // SAFETY: the caller's contract; the emulation's kernels have completed
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            Ok(())
        }
        Kind::Cuda(s) => {
            s.context().bind_to_thread().map_err(Error::driver("binding the stream's context"))?;
            let bytes = len * std::mem::size_of::<T>();
            // SAFETY: the caller's contract; the launch holds the buffers' guards, and the
            // copy is ordered on the stream the kernels use
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst as u64, src as u64, bytes, s.cu_stream()) }
                .map_err(Error::driver("copying the batch report's record"))
        }
    }
}

/// Sets `len` elements at `dst` (an address of a buffer registered on `launch` for writing)
/// to zero bytes, ordered on its stream (the emulation: now).
///
/// # Safety
/// `dst` comes from `launch`'s registrations and holds `len` elements.
pub(crate) unsafe fn zero_registered<T: Copy>(launch: &Launch<'_>, dst: *mut T, len: usize) -> Result<()> {
    let bytes = len * std::mem::size_of::<T>();
    match launch.device().kind() {
        Kind::Emulator => {
            // SAFETY: the caller's contract
            unsafe { std::ptr::write_bytes(dst.cast::<u8>(), 0, bytes) };
            Ok(())
        }
        Kind::Cuda(s) => {
            s.context().bind_to_thread().map_err(Error::driver("binding the stream's context"))?;
            // SAFETY: the caller's contract; ordered on the op's stream, guards held
            unsafe { cudarc::driver::result::memset_d8_async(dst as u64, 0, bytes, s.cu_stream()) }
                .map_err(Error::driver("zeroing saved parameters"))
        }
    }
}

/// Copies `src` to `dst` (an address of a buffer registered on `launch` for writing, at
/// least `src.len()` elements), ordered on its stream; on CUDA the stream is synchronised
/// before `src` is released (used for a handful of parameters of an empty tensor only).
///
/// # Safety
/// `dst` comes from `launch`'s registrations and holds `src.len()` elements.
pub(crate) unsafe fn write_registered<T: Copy>(launch: &Launch<'_>, dst: *mut T, src: &[T]) -> Result<()> {
    match launch.device().kind() {
        Kind::Emulator => {
            // SAFETY: the caller's contract; `src` is host memory, not registered
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
            Ok(())
        }
        Kind::Cuda(s) => {
            s.context().bind_to_thread().map_err(Error::driver("binding the stream's context"))?;
            // SAFETY: the caller's contract; the copy completes (synchronize below) before
            // `src` can be released
            unsafe { cudarc::driver::result::memcpy_htod_async(dst as u64, src, s.cu_stream()) }
                .map_err(Error::driver("writing saved parameters"))?;
            s.synchronize().map_err(Error::driver("writing saved parameters"))
        }
    }
}

/// Which launch of a fused producer [`Quantizer::encode`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProducerStep {
    /// Statistics of the saved tensor only (exact mode, before finalize); codes NULL.
    Stats,
    /// Output and codes with the exact parameters just finalized; stats NULL.
    Codes,
    /// Output and codes with the running estimate, statistics reduced in the same pass.
    CodesAndStats,
    /// After [`ProducerStep::CodesAndStats`] and finalize: codes again (with the sink's saved
    /// parameters, stats NULL) of only the units holding an element of a group flagged in
    /// `[groups + 1]` (flags, then their count: `MesaQuantizeArgs::widen`); nothing else is
    /// written. Nothing at all runs on the device past one load when the count is 0.
    Widen(*const u32),
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
    meta: SavedMeta,
}

/// What a saved tensor encodes: the original's view, dtype, and the code format. Returned
/// by the producers that write into a [`SavedViewMut`] (keep it with the caller's buffers:
/// [`SavedView::new`] needs it to read them back).
#[derive(Debug, Clone, PartialEq)]
pub struct SavedMeta {
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) bits: u32,
    pub(crate) grouping: Grouping,
    pub(crate) companding: Companding,
}

impl SavedMeta {
    /// The meta a producer returns when it saves a **contiguous** tensor of `shape` and `dtype`
    /// with `config` ([`Quantizer::quantize_to`] and the fused producers' `_to` variants,
    /// e.g. [`crate::fused::gelu_forward_to`], on an input made with `TensorRef::contiguous`):
    /// that shape, its row-major strides, `dtype`, the config's bits and grouping, no
    /// companding. It depends on these arguments only, never on the data, so a framework that
    /// builds a backward's state before the producer has run (a deferred executor, e.g. burn's
    /// Fusion) can make it on the calling thread and pass it to [`SavedView::new`] later.
    /// Softmax's fixed-parameter codes have their own: [`crate::fused::SoftmaxSave::saved_meta`].
    ///
    /// # Errors
    /// What [`Quantizer::new`] and [`saved_sizes`] refuse, before a producer could run:
    /// [`Error::Unsupported`] (bits not 8/4/2), [`Error::InvalidArgument`] (momentum outside
    /// `[0, 1]`), [`Error::InvalidLayout`] (the grouping does not fit `shape`),
    /// [`Error::TooLarge`] (the element or byte count overflows).
    pub fn contiguous(shape: &[usize], dtype: DType, config: &QuantConfig) -> Result<Self> {
        config.check()?;
        let _sizes: SavedSizes = saved_sizes(shape, config)?;
        let layout = Layout::contiguous(shape);
        Ok(SavedMeta {
            shape: shape.to_vec(),
            strides: layout.strides().to_vec(),
            dtype,
            bits: config.bits,
            grouping: config.grouping,
            companding: Companding::None,
        })
    }

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
    /// How codes map to values.
    #[must_use]
    pub fn companding(&self) -> Companding {
        self.companding
    }

    /// The sizes of its codes and parameters.
    pub(crate) fn sizes(&self) -> Result<SavedSizes> {
        let numel = checked_numel(&self.shape, "saved activation")?;
        Ok(SavedSizes { code_bytes: code_bytes(numel, self.bits)?, groups: self.grouping.num_groups(&self.shape)? })
    }

    /// `(i / run) % count` map of the groups over the logical shape: (run, count). For an
    /// empty tensor the run is 1 (nothing is indexed).
    pub(crate) fn group_map(&self) -> Result<(usize, usize)> {
        let shape = &self.shape;
        let (axis, span, count) = self.grouping.resolve(shape)?;
        if shape.contains(&0) {
            return Ok((1, count));
        }
        let run = match axis {
            // a sub-product of the element count, checked when the sizes were (no overflow)
            Some(a) => span * shape[a + 1..].iter().product::<usize>(),
            None => 1,
        };
        Ok((run.max(1), count))
    }
}

impl std::fmt::Debug for SavedActivation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedActivation")
            .field("shape", &self.meta.shape)
            .field("strides", &self.meta.strides)
            .field("dtype", &self.meta.dtype)
            .field("bits", &self.meta.bits)
            .field("grouping", &self.meta.grouping)
            .field("companding", &self.meta.companding)
            .field("groups", &self.params.len())
            .field("size_in_bytes", &self.size_in_bytes())
            .finish()
    }
}

impl SavedView<'_> {
    /// Decodes into `y` (any strides, same shape as the original; any of f32/f16/bf16,
    /// independent of the original dtype). Stream-ordered. Each value is
    /// `q = code · scale + offset` (f32 `fmaf`), squared for [`Companding::Sqrt`].
    ///
    /// Bytes moved: `numel · bits / 8` read, `numel · sizeof(T)` written. In-place: not
    /// supported (an output overlapping the codes or parameters → [`Error::Aliasing`]).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] (output shape differs from the original's),
    /// [`Error::InvalidLayout`] (the saved grouping does not fit the shape),
    /// [`Error::Unsupported`] (too many dimensions that cannot merge), [`Error::WrongBackend`],
    /// [`Error::Misaligned`] (codes not [`CODE_ALIGN`]-byte aligned, parameters not 4-byte
    /// aligned), [`Error::Aliasing`] (an output overlapping the codes or parameters), CUDA
    /// errors.
    pub fn dequantize<T: Element>(&self, device: &Device, y: &mut TensorMut<'_, T>) -> Result<()> {
        if y.shape() != self.meta.shape.as_slice() {
            return Err(Error::shape_mismatch("dequantize output", &self.meta.shape, y.shape()));
        }
        if y.numel() == 0 {
            return Ok(());
        }
        let view = kernel_view(y.layout(), &self.meta.grouping, T::DTYPE)?;
        let mut launch = Launch::new(device);
        let (codes, params) = self.register(&mut launch)?;
        let args = sys::MesaDequantizeArgs {
            codes,
            params,
            grouping: view.grouping,
            y: launch.output(y, "output")?,
            y_desc: view.desc,
            bits: self.meta.bits as i32,
            map: self.meta.companding.sys(),
        };
        // SAFETY: the output view is registered and described by `view.desc`; codes and
        // params are registered and were checked (SavedView::new) to hold this shape's
        // code bytes and groups.
        unsafe { launch.launch("dequantize", &args, sys::mesa_dequantize, sys::mesa_emu_dequantize)? };
        launch.finish()
    }

    /// Registers the codes and parameters as inputs of `launch` (codes' alignment checked).
    pub(crate) fn register<'a>(&'a self, launch: &mut Launch<'a>) -> Result<(*const u8, *const sys::MesaGroupParams)> {
        let codes = launch.input(&self.codes, "saved codes")?.cast::<u8>();
        check_code_address(codes as usize, "saved codes")?;
        let params = launch.input(&self.params, "saved parameters")?.cast();
        Ok((codes, params))
    }
}

/// True when `a` and `b` run on the same stream (or are both the emulation).
pub(crate) fn same_stream(a: &Device, b: &Device) -> bool {
    match (a.stream(), b.stream()) {
        (None, None) => true,
        (Some(a), Some(b)) => a.cu_stream() == b.cu_stream(),
        _ => false,
    }
}

impl SavedActivation {
    /// Logical shape of the original tensor.
    #[must_use]
    pub fn shape(&self) -> &[usize] {
        &self.meta.shape
    }
    /// Strides (elements) of the view it was quantized from.
    #[must_use]
    pub fn strides(&self) -> &[usize] {
        &self.meta.strides
    }
    /// dtype of the original tensor.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }
    /// Bits per code.
    #[must_use]
    pub fn bits(&self) -> u32 {
        self.meta.bits
    }
    /// The grouping of the parameters.
    #[must_use]
    pub fn grouping(&self) -> Grouping {
        self.meta.grouping
    }
    /// How codes map to values (linear, or square-root companded: decoding squares).
    #[must_use]
    pub fn companding(&self) -> Companding {
        self.meta.companding
    }
    /// Number of elements.
    #[must_use]
    pub fn numel(&self) -> usize {
        // checked when the handle was allocated (0 for an empty shape, whatever its other dims)
        checked_numel(&self.meta.shape, "saved activation").unwrap_or(0)
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
        self.numel() * self.meta.dtype.size_in_bytes()
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

    /// Decodes into `y` (any strides, same shape as the original; any of f32/f16/bf16,
    /// independent of the original dtype): [`SavedView::dequantize`] of [`SavedActivation::view`].
    ///
    /// # Errors
    /// As [`SavedView::dequantize`].
    pub fn dequantize<T: Element>(&self, device: &Device, y: &mut TensorMut<'_, T>) -> Result<()> {
        self.check_device(device)?;
        self.view()?.dequantize(device, y)
    }

    /// The handle as a [`SavedView`] (what the `_view` consumers read; the owned consumers
    /// go through it).
    ///
    /// # Errors
    /// None in practice (the buffers were sized for the meta when allocated); the view's
    /// checks, as [`SavedView::new`].
    pub fn view(&self) -> Result<SavedView<'_>> {
        SavedView::new(
            TensorRef::contiguous(&self.codes, &[self.codes.len()])?,
            TensorRef::contiguous(&self.params, &[self.params.len()])?,
            self.meta.clone(),
        )
    }

    /// The handle's buffers as a [`SavedViewMut`] for a producer, and its meta to overwrite
    /// with what the producer returns.
    pub(crate) fn view_mut(&mut self) -> Result<(SavedViewMut<'_>, &mut SavedMeta)> {
        let (nc, np) = (self.codes.len(), self.params.len());
        let view = SavedViewMut::new(
            TensorMut::contiguous(&mut self.codes, &[nc])?,
            TensorMut::contiguous(&mut self.params, &[np])?,
            TensorMut::contiguous(&mut self.nonfinite, &[1])?,
        )?;
        Ok((view, &mut self.meta))
    }

    /// An unwritten handle for a tensor described by `meta`: codes for every element,
    /// parameters for every group, a zeroed non-finite counter. The element count is checked
    /// before anything is sized by it.
    pub(crate) fn allocate(device: &Device, meta: &SavedMeta) -> Result<SavedActivation> {
        let numel = checked_numel(&meta.shape, "saved activation")?;
        let groups = meta.grouping.num_groups(&meta.shape)?;
        Ok(SavedActivation {
            codes: device.alloc_for_kernel::<u8>(code_bytes(numel, meta.bits)?)?,
            params: device.alloc_for_kernel::<GroupParams>(groups)?,
            nonfinite: device.upload(&[0u32])?,
            meta: meta.clone(),
        })
    }

    /// Checks that the handle lives on `device`'s backend.
    pub(crate) fn check_backend(&self, device: &Device) -> Result<()> {
        self.check_device(device)
    }

    fn check_device(&self, device: &Device) -> Result<()> {
        match (device.kind(), &self.codes) {
            (Kind::Cuda(_), Buffer::Cuda(_)) | (Kind::Emulator, Buffer::Host(_)) => Ok(()),
            _ => Err(Error::wrong_backend("saved activation", "it belongs to another backend")),
        }
    }
}
