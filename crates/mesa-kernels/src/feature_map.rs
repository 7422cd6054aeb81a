//! Feature maps of linear attention, forward and backward, as kernels: ReLU, ELU+1
//! (Katharopoulos et al. 2020) and FAVOR+ positive orthogonal random features (Choromanski
//! et al., *Rethinking Attention with Performers*, 2020, §2.3 Lemma 1 and §2.4).
//!
//! ```text
//! ReLU:    φ(x) = max(x, 0)
//! ELU+1:   φ(x) = x + 1 (x > 0),  exp(x) (x ≤ 0)
//! FAVOR+:  x' = x·d^(−1/4),  u_i = ω_iᵀx' − |x'|²/2,  φ_i(x) = exp(u_i − c)/√m,  i < m
//! ```
//!
//! FAVOR+ is unbiased for the softmax kernel: `E_ω[φ(q)ᵀφ(k)] = e^(−c_q−c_k) exp(qᵀk/√d)`
//! (Lemma 1 with `ω ~ N(0, I_d)`), so normalised linear attention over `φ(q), φ(k)`
//! estimates softmax attention. The stabiliser `c` ([`FavorStabilizer`]) must cancel in
//! `out_t = Σ_s φ(q_t)·φ(k_s) v_s / Σ_s φ(q_t)·φ(k_s)`: any factor per query row cancels,
//! but a key factor must be the same for every key a query sees. Hence:
//! * queries: [`FavorStabilizer::RowMax`], `c_t = max_i u_i(q_t)` — features ≤ 1/√m;
//! * causal keys: [`FavorStabilizer::Bound`], `c = max_i |ω_i|²/2`, a constant that needs
//!   no statistic of any position (no leak of the future): since
//!   `u_i = |ω_i|²/2 − |x' − ω_i|²/2`, every key feature is `≤ 1/√m` — no overflow in any
//!   dtype. Underflow: `φ_i = exp(−|x'−ω_i|²/2 − (c − |ω_i|²/2))/√m` reaches f16's
//!   smallest subnormal (2⁻²⁴) once the exponent is below ≈ −16.6, e.g. `|x'−ω_i|² ≳ 33`
//!   for typical `|ω_i|² ≈ d`; f32 and bf16 (8-bit exponent) reach ≈ −87. Produce f32 or
//!   bf16 features for `d ≳ 32`.
//! * bidirectional keys: [`FavorStabilizer::SequenceMax`], `c = max` over the whole `(b, h)`
//!   sequence and all features (every query sees every key).
//!
//! The backward treats `c` as a constant (as the Performer code does with a stop-gradient):
//! exact for normalised attention, whose output does not depend on `c` (up to the ε guard).
//!
//! ω ([`FavorProjection::orthogonal`]): blocks of `d` rows from the QR (Gram–Schmidt) of
//! `d×d` Gaussian matrices, each row rescaled to the norm of an independent Gaussian vector
//! (so rows are marginally `N(0, I_d)`, mutually orthogonal within a block: §2.4), generated
//! on the host from a seed — reproducible on every backend.
use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::linear_attention::{expect_shape, la_tensor, rank4, to_i64};
use crate::tensor::{TensorMut, TensorRef};

/// Largest input dimension `d` of FAVOR+ (one row of `x'` lives in shared memory).
pub const FAVOR_MAX_IN_DIM: usize = 1024;
/// Largest number of FAVOR+ features `m` (one row of `dφ·φ` lives in shared memory).
pub const FAVOR_MAX_FEATURES: usize = 4096;

/// The FAVOR+ stabiliser `c` (see the module docs for which to use where).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FavorStabilizer {
    /// `c = 0`: the plain estimator (overflows f16 for `u > 11`, f32 for `u > 88`).
    None,
    /// `c_t = max_i u_i(x_t)`, per row: for queries.
    RowMax,
    /// `c = max_i |ω_i|²/2` (a constant of ω): for causal keys.
    Bound,
    /// `c = max` over the `(b, h)` sequence and features: for bidirectional keys.
    SequenceMax,
}

/// A FAVOR+ projection ω `[m, d]` (f32) on a device.
pub struct FavorProjection {
    host: Vec<f32>,
    device: Buffer<f32>,
    features: usize,
    in_dim: usize,
}

impl FavorProjection {
    /// Orthogonal random features (Performer §2.4): `m` rows for inputs of dimension `d`,
    /// from `seed` (SplitMix64 + Box–Muller in f64, Gram–Schmidt per block of `d` rows).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `d` or `m` above [`FAVOR_MAX_IN_DIM`] /
    /// [`FAVOR_MAX_FEATURES`]; CUDA allocation errors.
    pub fn orthogonal(device: &Device, features: usize, in_dim: usize, seed: u64) -> Result<Self> {
        Self::check_dims(features, in_dim)?;
        let mut rng = SplitMix64(seed);
        let mut rows: Vec<f32> = Vec::with_capacity(features * in_dim);
        while rows.len() < features * in_dim {
            // one block: Gram–Schmidt of d Gaussian vectors (twice, for orthogonality in f64)
            let mut block: Vec<Vec<f64>> = Vec::with_capacity(in_dim);
            while block.len() < in_dim {
                let mut g: Vec<f64> = (0..in_dim).map(|_| rng.gaussian()).collect();
                for _ in 0..2 {
                    for prev in &block {
                        let dot: f64 = g.iter().zip(prev).map(|(a, b)| a * b).sum();
                        for (x, p) in g.iter_mut().zip(prev) {
                            *x -= dot * p;
                        }
                    }
                }
                let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
                if norm > 1e-6 {
                    block.push(g.into_iter().map(|x| x / norm).collect());
                }
            }
            for row in block {
                if rows.len() >= features * in_dim {
                    break;
                }
                // the norm of an independent N(0, I_d) vector: rows marginally Gaussian
                let scale = (0..in_dim).map(|_| rng.gaussian().powi(2)).sum::<f64>().sqrt();
                rows.extend(row.iter().map(|x| (x * scale) as f32));
            }
        }
        Self::from_matrix(device, features, in_dim, &rows)
    }

    /// A projection from an explicit row-major `[m, d]` matrix.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `omega.len() != m·d`, an entry is not finite, or the
    /// sizes pass the limits; CUDA errors.
    pub fn from_matrix(device: &Device, features: usize, in_dim: usize, omega: &[f32]) -> Result<Self> {
        Self::check_dims(features, in_dim)?;
        // check_dims bounds both factors: no overflow
        let needed = features * in_dim;
        if omega.len() != needed {
            return Err(Error::invalid_argument(
                "omega",
                format!("it has {} entries, [{features}, {in_dim}] needs {needed}", omega.len()),
            ));
        }
        if omega.iter().any(|x| !x.is_finite()) {
            return Err(Error::invalid_argument("omega", "an entry is not finite"));
        }
        let device_copy = device.upload(if omega.is_empty() { &[0.0f32] } else { omega })?;
        Ok(FavorProjection { host: omega.to_vec(), device: device_copy, features, in_dim })
    }

    fn check_dims(features: usize, in_dim: usize) -> Result<()> {
        if in_dim > FAVOR_MAX_IN_DIM {
            return Err(Error::invalid_argument(
                "in_dim",
                format!("FAVOR+ input dimension d = {in_dim} is above {FAVOR_MAX_IN_DIM}"),
            ));
        }
        if features > FAVOR_MAX_FEATURES {
            return Err(Error::invalid_argument(
                "features",
                format!("FAVOR+ feature count m = {features} is above {FAVOR_MAX_FEATURES}"),
            ));
        }
        Ok(())
    }

    /// ω, row-major `[m, d]`.
    #[must_use]
    pub fn omega(&self) -> &[f32] {
        &self.host
    }
    /// `m`.
    #[must_use]
    pub fn features(&self) -> usize {
        self.features
    }
    /// `d`.
    #[must_use]
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }
    /// The [`FavorStabilizer::Bound`] constant `max_i |ω_i|²/2` (f32 of the f64 value).
    #[must_use]
    pub fn bound(&self) -> f32 {
        self.host
            .chunks(self.in_dim.max(1))
            .map(|r| r.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() * 0.5)
            .fold(0.0f64, f64::max) as f32
    }
}

impl std::fmt::Debug for FavorProjection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FavorProjection")
            .field("features", &self.features)
            .field("in_dim", &self.in_dim)
            .finish_non_exhaustive()
    }
}

/// SplitMix64 (Steele et al. 2014) and Box–Muller: a tiny reproducible Gaussian source.
struct SplitMix64(u64);
impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
    fn gaussian(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Which feature map.
#[derive(Debug, Clone, Copy)]
pub enum FeatureMap<'a> {
    /// `max(x, 0)`.
    Relu,
    /// `elu(x) + 1`.
    Elu1,
    /// FAVOR+ with projection ω and stabiliser `c`.
    Favor {
        /// ω `[m, d]`.
        projection: &'a FavorProjection,
        /// How `c` is chosen.
        stabilizer: FavorStabilizer,
    },
}

impl FeatureMap<'_> {
    fn code(&self) -> sys::MesaFeatureMap {
        (match self {
            FeatureMap::Relu => sys::MESA_FEATURE_RELU,
            FeatureMap::Elu1 => sys::MESA_FEATURE_ELU1,
            FeatureMap::Favor { .. } => sys::MESA_FEATURE_FAVOR,
        }) as sys::MesaFeatureMap
    }
    /// Output features `m` for inputs of dimension `d`.
    #[must_use]
    pub fn out_dim(&self, in_dim: usize) -> usize {
        match self {
            FeatureMap::Relu | FeatureMap::Elu1 => in_dim,
            FeatureMap::Favor { projection, .. } => projection.features,
        }
    }
}

/// x's shape, with its `d` checked against a FAVOR+ projection.
fn x_shape(map: &FeatureMap<'_>, x: &[usize]) -> Result<[usize; 4]> {
    let xs = rank4(x, "x")?;
    if let FeatureMap::Favor { projection, .. } = map {
        if projection.in_dim != xs[3] {
            return Err(Error::shape_mismatch("x", &[xs[0], xs[1], xs[2], projection.in_dim], x));
        }
    }
    Ok(xs)
}

fn stabilizer_code(s: FavorStabilizer) -> sys::MesaFavorStabilizer {
    (match s {
        FavorStabilizer::None => sys::MESA_FAVOR_NONE,
        FavorStabilizer::RowMax => sys::MESA_FAVOR_ROW_MAX,
        FavorStabilizer::Bound => sys::MESA_FAVOR_BOUND,
        FavorStabilizer::SequenceMax => sys::MESA_FAVOR_SEQUENCE_MAX,
    }) as sys::MesaFavorStabilizer
}

/// φ = map(x): `x: [B, H, L, d]` → `phi: [B, H, L, m]` (any strides; one dtype).
///
/// In-place: not supported (a `phi` overlapping `x` → [`Error::Aliasing`]).
///
/// Bytes: `d` read + `m` written per row (+ ω, `4·m·d`, cached). FLOPs (FAVOR+): `2md` per
/// row, twice with [`FavorStabilizer::RowMax`] / [`FavorStabilizer::SequenceMax`]. An empty
/// `phi` launches nothing.
///
/// # Errors
/// [`Error::InvalidLayout`] (rank ≠ 4), [`Error::ShapeMismatch`] (`x`'s `d` differing from
/// ω's, `phi` not `[B, H, L, m]`), [`Error::Aliasing`], [`Error::TooLarge`],
/// [`Error::WrongBackend`], [`Error::Misaligned`], CUDA errors.
pub fn forward<T: Element>(
    device: &Device,
    map: &FeatureMap<'_>,
    x: &TensorRef<'_, T>,
    phi: &mut TensorMut<'_, T>,
) -> Result<()> {
    let xs = x_shape(map, x.shape())?;
    let m = map.out_dim(xs[3]);
    expect_shape(phi.shape(), [xs[0], xs[1], xs[2], m], "phi")?;
    if phi.numel() == 0 {
        return Ok(());
    }
    let (omega, stabilizer, bound) = match map {
        FeatureMap::Favor { projection, stabilizer } => (Some(&projection.device), *stabilizer, projection.bound()),
        _ => (None, FavorStabilizer::None, 0.0),
    };
    let mut launch = Launch::new(device);
    let args = sys::MesaFeatureArgs {
        map: map.code(),
        stabilizer: stabilizer_code(stabilizer),
        dtype: T::DTYPE.to_sys(),
        _pad: 0,
        batch: to_i64(xs[0], "batch")?,
        heads: to_i64(xs[1], "heads")?,
        len: to_i64(xs[2], "sequence length")?,
        in_dim: to_i64(xs[3], "input dimension")?,
        out_dim: to_i64(m, "feature count")?,
        x: la_tensor(x.layout(), launch.input(x, "x")?.cast_mut()),
        phi: la_tensor(&phi.layout().clone(), launch.output(phi, "phi")?),
        omega: match omega {
            Some(w) => launch.read_buffer(w, "omega")?,
            None => std::ptr::null(),
        },
        bound,
        _pad2: 0,
    };
    // SAFETY: x and phi are registered rank-4 views inside their buffers (TensorRef /
    // TensorMut::new) with matching [B, H, L] and phi's last dim = m; phi overlaps neither
    // itself nor x (TensorMut::new, the builder's aliasing check); ω (registered) holds m·d
    // f32 (its in_dim was checked equal to x's d).
    unsafe {
        launch.launch(
            "feature_map_forward",
            &args,
            sys::mesa_feature_map_forward,
            sys::mesa_emu_feature_map_forward,
        )?;
    }
    launch.finish()
}

/// The tensors of [`backward`]: `x, dx: [B, H, L, d]`, `phi, dphi: [B, H, L, m]`.
#[derive(Debug)]
pub struct FeatureBackwardArgs<'a, 'b, T> {
    /// The forward's input.
    pub x: &'a TensorRef<'b, T>,
    /// The forward's output: required for FAVOR+, ignored otherwise.
    pub phi: Option<&'a TensorRef<'b, T>>,
    /// The upstream gradient.
    pub dphi: &'a TensorRef<'b, T>,
    /// The gradient of `x` (written).
    pub dx: &'a mut TensorMut<'b, T>,
}

/// dx from dφ. ReLU and ELU+1 read `x`; FAVOR+ also reads `phi` (the forward's output),
/// `dx' = Σ_i dφ_i φ_i (ω_i − x')`, `dx = d^(−1/4) dx'` (c constant: see the module docs).
///
/// In-place: not supported (a `dx` overlapping `x`, `phi` or `dphi` → [`Error::Aliasing`]).
///
/// # Errors
/// As [`forward`] (with `dphi`, `phi` and `dx` named in [`Error::ShapeMismatch`]);
/// [`Error::InvalidArgument`] when FAVOR+ is given no `phi`.
pub fn backward<T: Element>(device: &Device, map: &FeatureMap<'_>, args: FeatureBackwardArgs<'_, '_, T>) -> Result<()> {
    let FeatureBackwardArgs { x, phi, dphi, dx } = args;
    let xs = x_shape(map, x.shape())?;
    let m = map.out_dim(xs[3]);
    let want = [xs[0], xs[1], xs[2], m];
    expect_shape(dphi.shape(), want, "dphi")?;
    let (phi, omega) = match (phi, map) {
        (Some(p), FeatureMap::Favor { projection, .. }) => {
            expect_shape(p.shape(), want, "phi")?;
            (Some(p), Some(&projection.device))
        }
        (None, FeatureMap::Favor { .. }) => {
            return Err(Error::invalid_argument("phi", "the FAVOR+ backward needs the forward output phi"))
        }
        _ => (None, None),
    };
    expect_shape(dx.shape(), xs, "dx")?;
    if dx.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let null = sys::MesaLaTensor { data: std::ptr::null_mut(), strides: [0; 4] };
    let args = sys::MesaFeatureBackwardArgs {
        map: map.code(),
        dtype: T::DTYPE.to_sys(),
        batch: to_i64(xs[0], "batch")?,
        heads: to_i64(xs[1], "heads")?,
        len: to_i64(xs[2], "sequence length")?,
        in_dim: to_i64(xs[3], "input dimension")?,
        out_dim: to_i64(m, "feature count")?,
        x: la_tensor(x.layout(), launch.input(x, "x")?.cast_mut()),
        phi: match phi {
            Some(p) => la_tensor(p.layout(), launch.input(p, "phi")?.cast_mut()),
            None => null,
        },
        dphi: la_tensor(dphi.layout(), launch.input(dphi, "dphi")?.cast_mut()),
        dx: la_tensor(&dx.layout().clone(), launch.output(dx, "dx")?),
        omega: match omega {
            Some(w) => launch.read_buffer(w, "omega")?,
            None => std::ptr::null(),
        },
    };
    // SAFETY: x, dx: [B, H, L, d], dphi (and phi for FAVOR+): [B, H, L, m], registered and
    // inside their buffers; dx overlaps no input (the builder's aliasing check); ω
    // (registered) holds m·d f32.
    unsafe {
        launch.launch(
            "feature_map_backward",
            &args,
            sys::mesa_feature_map_backward,
            sys::mesa_emu_feature_map_backward,
        )?;
    }
    launch.finish()
}
