//! Checkpoint regions: any candle code whose activations are recomputed in backward instead
//! of kept (gradient checkpointing, Chen et al. 2016; the "full recomputation" of
//! Korthikanti et al. 2022, §5).
//!
//! Candle's autograd keeps every argument of every op until backward, so a model built from
//! candle ops (ours or candle-nn's) keeps every intermediate of its forward. A region runs a
//! closure or a [`Module`] over its inputs **detached**, keeps only its output, and enters
//! candle's graph as one op over its inputs and the parameters the closure read; its
//! backward reruns the closure on the kept inputs, differentiates the rerun with candle's own
//! `backward`, and hands candle the gradients of the inputs and of every parameter, which
//! candle adds into the caller's [`candle_core::backprop::GradStore`] like any other.
//!
//! ```text
//! forward:   y = f(x, θ)           keeps x (candle: the op's argument); f's internals are freed
//! backward:  y' = f(x, θ) again    on the same inputs, the same dropout keys
//!            (∂L/∂x, ∂L/∂θ) = vjp of y' at dL/dy   (candle's backward of Σ y'⊙dy)
//! ```
//!
//! **What is kept.** The region's inputs (as arguments of its op), a one-element anchor per
//! three parameters (the parameters are the caller's variables, alive anyway), the closure,
//! and 32 bytes of replay state. A stack of regions where each one's output is the next
//! one's input keeps one tensor per region. Peak memory moves to the backward: one region's
//! full forward graph at a time, plus its gradients.
//!
//! **Parameters.** Found, not declared: after the forward, the region walks the graph of its
//! result ([`Tensor::sorted_nodes`]) and takes every variable it reaches.
//!
//! **Pass tracked tensors as inputs, do not capture them.** A tracked tensor the closure
//! captures (an encoder's output read by a decoder's cross-attention, a mask computed from a
//! variable) is kept alive by the closure, and the region's backward differentiates the whole
//! graph upstream of it again — earlier regions there rerun once per capturing region — and
//! hands the upstream variables their gradients itself, summed in another order than
//! candle's (equal within rounding, not bit for bit). As an input of [`Region::run`] it
//! costs nothing of that: its gradient goes back through candle's graph like any other.
//!
//! **Randomness replays.** Each region draws a 64-bit key; [`next_key`] hands the ops inside
//! the region keys derived from it in call order, and the rerun hands out the same keys.
//! [`crate::ops::Dropout`] draws its mask from such a key (Philox, as the layer's masks), and
//! a [`crate::TransformerLayer`] inside a region may take its seed from [`next_key`]. A region
//! whose rerun differs from its forward — it drew from a generator it cannot replay, such as
//! candle-nn's `Dropout` or `Tensor::rand*` — fails its backward with
//! [`Error::RegionReplay`] instead of returning gradients of a
//! different function. The check compares the rerun's output with the forward's (which candle
//! hands the backward) element by element on their device, NaN equal to NaN: three
//! comparisons and a sum over the output, and one scalar read by the host per backward of the
//! region (a device synchronisation on CUDA); [`Region::verify_replay`] turns it off.
//!
//! **Exactness.** The gradients equal those of the same code without the region **bit for
//! bit** when the rerun computes what the forward computed (deterministic ops, the same keys)
//! and each variable read in the region is read nowhere else, and the region captures no
//! tracked tensor (above): candle's backward of the rerun
//! is the same sequence of ops, and the one added term (`0 + g`) is exact. A variable read
//! both inside and outside a region (tied weights), or in two regions, gets the same terms
//! summed in another order: equal within the rounding of those sums (`|δ| ≤ γ_m Σ|gᵢ|` for
//! `m` terms). Ops with running statistics ([`crate::ops`] configs with running statistics
//! on, `StatsMode::Running` layers) update their estimate in the forward and again in the
//! rerun, and the rerun encodes with the updated estimate; their gradients then differ from
//! the region-free model's by the codes' error. The default, exact statistics, has no such
//! state.
//!
//! Regions nest (the inner region's key is drawn from the outer's stream, so the outer rerun
//! replays it) and work on tensor- and sequence-parallel ranks ([`crate::parallel`]): the
//! rerun issues the same collectives in the same order on every rank, since every rank runs
//! its backward in the same order.
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Module, ModuleT, Tensor, Var};

use crate::attach::{attach, Backward};
use crate::error::Error;
use crate::ops::tensor_result;

/// The closure of a region: inputs to output.
type RegionFn = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync;

/// The keys handed out outside any region (a process-wide stream).
static GLOBAL_KEYS: AtomicU64 = AtomicU64::new(0);

/// The base of the process-wide stream (changed by [`set_seed`]).
static GLOBAL_SEED: AtomicU64 = AtomicU64::new(0x6D65_7361_2D6B_6579);

thread_local! {
    /// The regions being run on this thread, innermost last: (key, keys drawn so far,
    /// rerun or forward).
    static STACK: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

#[derive(Debug, Clone, Copy)]
struct Frame {
    key: u64,
    drawn: u64,
    replay: bool,
}

/// SplitMix64's finaliser: a key per (stream, index).
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sets the process-wide stream that [`next_key`] draws from outside any region (and so the
/// keys of top-level regions and of [`crate::ops::Dropout`] outside regions), and restarts
/// it. Keys drawn inside a region depend only on that region's key.
pub fn set_seed(seed: u64) {
    GLOBAL_SEED.store(seed, Ordering::SeqCst);
    GLOBAL_KEYS.store(0, Ordering::SeqCst);
}

/// The next 64-bit key for a random op: inside a region, the region's `i`-th key (the same in
/// its forward and its rerun); outside, the next of the process-wide stream ([`set_seed`]).
#[must_use]
pub fn next_key() -> u64 {
    let inner = STACK.with(|s| {
        s.borrow_mut().last_mut().map(|f| {
            let k = mix(f.key, f.drawn);
            f.drawn += 1;
            k
        })
    });
    inner.unwrap_or_else(|| mix(GLOBAL_SEED.load(Ordering::SeqCst), GLOBAL_KEYS.fetch_add(1, Ordering::SeqCst)))
}

/// Whether this thread is inside a region's forward or rerun (an op that draws its own
/// randomness should then take it from [`next_key`]).
#[must_use]
pub fn in_region() -> bool {
    STACK.with(|s| !s.borrow().is_empty())
}

/// Whether the innermost region on this thread is being rerun by its backward (an op with
/// state to update once per step may skip the update then).
#[must_use]
pub fn replaying() -> bool {
    STACK.with(|s| s.borrow().last().is_some_and(|f| f.replay))
}

/// Runs `f` inside a frame of key `key`, popped on every exit path.
fn in_frame<R>(key: u64, replay: bool, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            STACK.with(|s| s.borrow_mut().pop());
        }
    }
    STACK.with(|s| s.borrow_mut().push(Frame { key, drawn: 0, replay }));
    let _pop = Pop;
    f()
}

/// A checkpoint region's settings; [`Region::run`] runs one.
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct Region {
    verify_replay: bool,
}

impl Default for Region {
    /// The rerun is checked against the forward.
    fn default() -> Self {
        Region { verify_replay: true }
    }
}

impl Region {
    /// The default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the backward compares its rerun's output with the forward's, element by
    /// element, and fails with [`Error::RegionReplay`] when any differs (default on; off
    /// saves a few elementwise passes and one host read of a scalar per backward).
    pub fn verify_replay(mut self, on: bool) -> Self {
        self.verify_replay = on;
        self
    }

    /// `f(inputs)` as a checkpoint region (the module docs): candle keeps `inputs`, not
    /// `f`'s intermediates; the backward reruns `f` and returns the gradients of `inputs`
    /// and of every variable `f` read.
    ///
    /// `inputs`: one or more tensors of any shape, dtype and device (candle checks what `f`
    /// does with them); `f` gets detached copies (the same storage) in the same order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no inputs; `f`'s own errors; in backward,
    /// [`Error::RegionReplay`] when the rerun's output differs from the forward's.
    pub fn run<F>(&self, inputs: &[&Tensor], f: F) -> candle_core::Result<Tensor>
    where
        F: Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let first =
            inputs.first().ok_or(Error::InvalidArgument { name: "inputs", why: "a region needs one".into() })?;
        let key = next_key();
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        let y = in_frame(key, false, || f(&detached))?;
        let params = variables_of(&y);
        // the region's graph goes with `y`: only its storage, copied once, enters candle's graph
        let result = tensor_result(&y.detach())?;
        drop(y);

        let extras: Vec<Tensor> = inputs[1..].iter().map(|t| (*t).clone()).chain(params.iter().cloned()).collect();
        let slot: GradSlot = Arc::new(Mutex::new(None));
        let anchor = anchor_chain(first, &extras, &slot)?;
        let grad = RegionGrad {
            f: Arc::new(f),
            key,
            verify: self.verify_replay,
            inputs: inputs.len(),
            params,
            slot,
            extras: inputs[1..].iter().map(|t| (*t).clone()).collect(),
        };
        match &anchor {
            Some(a) => attach(&[first, a], result, grad),
            None => attach(&[first], result, grad),
        }
    }
}

/// `f(x)` as a checkpoint region with the default settings ([`Region::run`] with one input).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor, Var};
/// let w = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let x = Var::new(&[[0.5f32, -1.]], &Device::Cpu)?;
/// let w2 = w.as_tensor().clone();
/// let y = mesa_candle::region::checkpoint(x.as_tensor(), move |x| x.matmul(&w2)?.tanh())?;
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(w.as_tensor()).is_some() && grads.get(x.as_tensor()).is_some());
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`Region::run`].
pub fn checkpoint<F>(x: &Tensor, f: F) -> candle_core::Result<Tensor>
where
    F: Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
{
    Region::new().run(&[x], move |t| f(&t[0]))
}

/// A module whose every forward is a checkpoint region: a model swaps `block` for
/// `Checkpointed::new(block)` and keeps only the block's input for backward. The module is
/// held in an [`Arc`] that each region's closure shares (no clone of the module, whose
/// type need not be `Clone`).
#[derive(Debug)]
pub struct Checkpointed<M> {
    module: Arc<M>,
    region: Region,
}

impl<M> Clone for Checkpointed<M> {
    fn clone(&self) -> Self {
        Checkpointed { module: self.module.clone(), region: self.region }
    }
}

impl<M> Checkpointed<M> {
    /// `module` with the default [`Region`].
    pub fn new(module: M) -> Self {
        Checkpointed { module: Arc::new(module), region: Region::new() }
    }

    /// `module` with `region`'s settings.
    pub fn with_region(module: M, region: Region) -> Self {
        Checkpointed { module: Arc::new(module), region }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        &self.module
    }
}

impl<M: Module + Send + Sync + 'static> Module for Checkpointed<M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let m = self.module.clone();
        self.region.run(&[x], move |t| m.forward(&t[0]))
    }
}

/// For [`ModuleT`] (train/eval) modules, `forward_t` of the wrapper with `train` fixed per
/// call and replayed (an inherent method: candle's blanket `ModuleT` for every [`Module`]
/// already covers the wrapper, with `train` ignored).
impl<M: ModuleT + Send + Sync + 'static> Checkpointed<M> {
    /// `module.forward_t(x, train)` as a region.
    ///
    /// # Errors
    /// As [`Region::run`].
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let m = self.module.clone();
        self.region.run(&[x], move |t| m.forward_t(&t[0], train))
    }
}

/// The gradients the region's backward computed for its extra inputs and parameters, handed
/// to the anchors (which candle runs after the region's op: they are its argument).
type GradSlot = Arc<Mutex<Option<Vec<Option<Tensor>>>>>;

/// The number of elements where `rerun` and `forward` differ (NaN equal to NaN, `−0` to `+0`),
/// counted on their device; one scalar read by the host.
fn differing(rerun: &Tensor, forward: &Tensor) -> candle_core::Result<f64> {
    if rerun.shape() != forward.shape() || rerun.dtype() != forward.dtype() {
        return Ok(f64::INFINITY);
    }
    let differ = rerun.ne(forward)?.to_dtype(DType::F32)?;
    let both_nan = (rerun.ne(rerun)?.to_dtype(DType::F32)? * forward.ne(forward)?.to_dtype(DType::F32)?)?;
    // 0/1 values: the sum is 0 exactly when no element differs
    (differ - both_nan)?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()
}

/// Every variable `y`'s graph reaches, once each, in candle's order.
fn variables_of(y: &Tensor) -> Vec<Tensor> {
    let mut seen = HashSet::new();
    let mut vars: Vec<Tensor> =
        y.sorted_nodes().into_iter().filter(|n| n.is_variable() && seen.insert(n.id())).cloned().collect();
    vars.shrink_to_fit(); // kept until backward: no spare capacity
    vars
}

/// A chain of one-element anchor ops over `extras` (three per op, the previous anchor first),
/// whose backward hands each extra its gradient from `slot`; `None` when there are none.
fn anchor_chain(first: &Tensor, extras: &[Tensor], slot: &GradSlot) -> candle_core::Result<Option<Tensor>> {
    let mut anchor: Option<Tensor> = None;
    let mut start = 0;
    while start < extras.len() {
        let take = if anchor.is_some() { 2 } else { 3 }.min(extras.len() - start);
        let mut args: Vec<&Tensor> = anchor.iter().collect();
        args.extend(&extras[start..start + take]);
        let zero = Tensor::zeros(1, DType::F32, first.device())?;
        let a = attach(
            &args,
            tensor_result(&zero)?,
            AnchorGrad { slot: slot.clone(), start, count: take, chained: anchor.is_some() },
        )?;
        anchor = Some(a);
        start += take;
    }
    Ok(anchor)
}

struct AnchorGrad {
    slot: GradSlot,
    start: usize,
    count: usize,
    chained: bool,
}

impl Backward for AnchorGrad {
    fn name(&self) -> &'static str {
        "mesa-region-params"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let slot = self.slot.lock().map_err(|_| Error::StateConsumed { op: "region" })?;
        let grads = slot.as_ref().ok_or(Error::StateConsumed { op: "region" })?;
        let mut out = Vec::with_capacity(args.len());
        if self.chained {
            out.push(Some(grad.zeros_like()?));
        }
        out.extend(grads[self.start..self.start + self.count].iter().cloned());
        Ok(out)
    }
}

struct RegionGrad {
    f: Arc<RegionFn>,
    key: u64,
    verify: bool,
    inputs: usize,
    /// extra inputs (after the first), as given
    extras: Vec<Tensor>,
    params: Vec<Tensor>,
    slot: GradSlot,
}

impl Backward for RegionGrad {
    fn name(&self) -> &'static str {
        "mesa-region"
    }
    fn backward(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        // the inputs as fresh variables (the same storage), the parameters as they are
        // (candle makes a variable only by copying: one transient copy per tracked input)
        let tensors: Vec<Tensor> = std::iter::once(args[0])
            .chain(self.extras.iter())
            .map(|t| if t.track_op() { Ok(Var::from_tensor(&t.detach())?.into_inner()) } else { Ok(t.detach()) })
            .collect::<candle_core::Result<_>>()?;
        let y = in_frame(self.key, true, || (self.f)(&tensors))?;
        if self.verify {
            let n = differing(&y, &res.detach())?;
            if n != 0.0 {
                return Err(Error::RegionReplay {
                    why: format!(
                        "{n} of {} elements of the rerun's output differ from the forward's: the region drew from a \
                         generator it cannot replay (candle-nn's Dropout, Tensor::rand*; use mesa_candle::ops::Dropout \
                         or keys from region::next_key) or ran a nondeterministic op",
                        y.elem_count()
                    ),
                }
                .into());
            }
        }
        let mut store = if y.track_op() { Some(y.mul(&grad.detach())?.sum_all()?.backward()?) } else { None };
        let mut take = |t: &Tensor| if t.is_variable() { store.as_mut().and_then(|s| s.remove(t)) } else { None };
        let dx = take(&tensors[0]);
        let rest: Vec<Option<Tensor>> =
            tensors[1..self.inputs].iter().chain(self.params.iter()).map(&mut take).collect();
        *self.slot.lock().map_err(|_| Error::StateConsumed { op: "region" })? = Some(rest);
        let mut out = vec![dx];
        if args.len() > 1 {
            out.push(Some(args[1].zeros_like()?));
        }
        Ok(out)
    }
}

/// Host bytes one region keeps besides its tensors' data, for `parameters` variables (see
/// [`crate::plan::region_state_bytes`]). Candle's tensor headers are private types, so the
/// three constants are measured (candle-core 0.11.1, x86_64, `tests/memory.rs`,
/// `region_bookkeeping_matches_the_planner`): the region's op with its output's header and
/// its closure's `Arc` (552 bytes), each one-element anchor op (380), each parameter's
/// handle (8). What the closure captures is the caller's and not counted.
pub(crate) fn state_bytes(parameters: usize) -> usize {
    const REGION: usize = 552;
    const ANCHOR: usize = 380;
    const PARAMETER: usize = 8;
    // the first anchor takes three parameters, each further one two (and the previous anchor)
    let anchors = if parameters == 0 { 0 } else { 1 + parameters.saturating_sub(3).div_ceil(2) };
    REGION + ANCHOR * anchors + PARAMETER * parameters
}
