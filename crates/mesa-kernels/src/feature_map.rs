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
use crate::layout::Layout;
use crate::linear_attention::{TensorMut, TensorRef};

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
    /// [`Error::Unsupported`] for `d` or `m` above [`FAVOR_MAX_IN_DIM`] /
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
    /// [`Error::Shape`] when `omega.len() != m·d` or an entry is not finite;
    /// [`Error::Unsupported`] for sizes past the limits; CUDA errors.
    pub fn from_matrix(device: &Device, features: usize, in_dim: usize, omega: &[f32]) -> Result<Self> {
        Self::check_dims(features, in_dim)?;
        if omega.len() != features * in_dim {
            return Err(Error::LegacyShape(format!(
                "omega has {} entries, [{features}, {in_dim}] needs {}",
                omega.len(),
                features * in_dim
            )));
        }
        if omega.iter().any(|x| !x.is_finite()) {
            return Err(Error::LegacyShape("omega has a non-finite entry".into()));
        }
        let device_copy = device.upload(if omega.is_empty() { &[0.0f32] } else { omega })?;
        Ok(FavorProjection { host: omega.to_vec(), device: device_copy, features, in_dim })
    }

    fn check_dims(features: usize, in_dim: usize) -> Result<()> {
        if in_dim > FAVOR_MAX_IN_DIM || features > FAVOR_MAX_FEATURES {
            return Err(Error::LegacyUnsupported(format!(
                "FAVOR+ with d = {in_dim}, m = {features} (at most d = {FAVOR_MAX_IN_DIM}, m = {FAVOR_MAX_FEATURES})"
            )));
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
#[derive(Clone, Copy)]
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

fn shape4(layout: &Layout, len: usize, what: &'static str) -> Result<[usize; 4]> {
    let s = layout.shape();
    if s.len() != 4 {
        return Err(Error::LegacyShape(format!("{what}: expected a rank-4 [B, H, L, F] view, got shape {s:?}")));
    }
    layout.check_fits(len, what)?;
    Ok([s[0], s[1], s[2], s[3]])
}

fn la_tensor(layout: &Layout, data: *mut std::ffi::c_void) -> sys::MesaLaTensor {
    let mut strides = [0i64; 4];
    for (k, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate().take(4) {
        strides[k] = if n > 1 { s as i64 } else { 0 };
    }
    sys::MesaLaTensor { data, strides }
}

fn check_favor_dims(map: &FeatureMap<'_>, d: usize) -> Result<()> {
    if let FeatureMap::Favor { projection, .. } = map {
        if projection.in_dim != d {
            return Err(Error::LegacyShape(format!(
                "FAVOR+ projection is for d = {}, input has d = {d}",
                projection.in_dim
            )));
        }
        FavorProjection::check_dims(projection.features, d)?;
    }
    Ok(())
}

/// φ = map(x): `x: [B, H, L, d]` → `phi: [B, H, L, m]` (any strides; one dtype).
///
/// Bytes: `d` read + `m` written per row (+ ω, `4·m·d`, cached). FLOPs (FAVOR+): `2md` per
/// row, twice with [`FavorStabilizer::RowMax`] / [`FavorStabilizer::SequenceMax`].
///
/// # Errors
/// [`Error::Shape`] (ranks, shapes, ω's `d`, overlapping output), [`Error::Unsupported`],
/// [`Error::BufferTooShort`], [`Error::TooLarge`], [`Error::WrongBackend`], CUDA errors.
pub fn forward<T: Element>(
    device: &Device,
    map: &FeatureMap<'_>,
    x: TensorRef<'_, T>,
    phi: TensorMut<'_, T>,
) -> Result<()> {
    let (xd, xl) = (x.data_ref(), x.layout());
    let xs = shape4(xl, xd.len(), "x")?;
    let (mut pm, pl) = phi.parts();
    let ps = shape4(pl, pm.len(), "phi")?;
    check_favor_dims(map, xs[3])?;
    let m = map.out_dim(xs[3]);
    if ps != [xs[0], xs[1], xs[2], m] {
        return Err(Error::LegacyShape(format!("phi: shape {ps:?}, expected {:?}", [xs[0], xs[1], xs[2], m])));
    }
    pl.check_no_overlap("phi")?;
    let (omega_mem, stabilizer, bound) = match map {
        FeatureMap::Favor { projection, stabilizer } => {
            (Some(projection.device_mem()), *stabilizer, projection.bound())
        }
        _ => (None, FavorStabilizer::None, 0.0),
    };
    let xp = device.read_ptr(&xd, xl.offset(), "x")?;
    let pp = device.write_ptr(&mut pm, pl.offset(), "phi")?;
    let wp = match omega_mem.as_ref() {
        Some(w) => Some(device.read_ptr(w, 0, "omega")?),
        None => None,
    };
    let args = sys::MesaFeatureArgs {
        map: map.code(),
        stabilizer: (match stabilizer {
            FavorStabilizer::None => sys::MESA_FAVOR_NONE,
            FavorStabilizer::RowMax => sys::MESA_FAVOR_ROW_MAX,
            FavorStabilizer::Bound => sys::MESA_FAVOR_BOUND,
            FavorStabilizer::SequenceMax => sys::MESA_FAVOR_SEQUENCE_MAX,
        }) as sys::MesaFavorStabilizer,
        dtype: T::DTYPE.to_sys(),
        _pad: 0,
        batch: xs[0] as i64,
        heads: xs[1] as i64,
        len: xs[2] as i64,
        in_dim: xs[3] as i64,
        out_dim: m as i64,
        x: la_tensor(xl, xp.addr),
        phi: la_tensor(pl, pp.addr),
        omega: wp.as_ref().map_or(std::ptr::null(), |p| p.addr as *const f32),
        bound,
        _pad2: 0,
    };
    // SAFETY: x and phi are rank-4 views inside their buffers (check_fits) with matching
    // [B, H, L] and phi's last dim = m; phi does not overlap itself; ω holds m·d f32 (its
    // in_dim was checked equal to x's d).
    unsafe {
        device.launch("feature_map_forward", &args, sys::mesa_feature_map_forward, sys::mesa_emu_feature_map_forward)
    }
}

/// dx from dφ. ReLU and ELU+1 read `x`; FAVOR+ also reads `phi` (the forward's output),
/// `dx' = Σ_i dφ_i φ_i (ω_i − x')`, `dx = d^(−1/4) dx'` (c constant: see the module docs).
///
/// # Errors
/// As [`forward`]; [`Error::Shape`] when FAVOR+ is given no `phi`.
pub fn backward<T: Element>(
    device: &Device,
    map: &FeatureMap<'_>,
    x: TensorRef<'_, T>,
    phi: Option<TensorRef<'_, T>>,
    dphi: TensorRef<'_, T>,
    dx: TensorMut<'_, T>,
) -> Result<()> {
    let (xd, xl) = (x.data_ref(), x.layout());
    let xs = shape4(xl, xd.len(), "x")?;
    check_favor_dims(map, xs[3])?;
    let m = map.out_dim(xs[3]);
    let want = [xs[0], xs[1], xs[2], m];
    let (gd, gl) = (dphi.data_ref(), dphi.layout());
    if shape4(gl, gd.len(), "dphi")? != want {
        return Err(Error::LegacyShape(format!("dphi: shape {:?}, expected {want:?}", gl.shape())));
    }
    let phi_pair = match (&phi, map) {
        (Some(p), FeatureMap::Favor { .. }) => {
            let d = p.data_ref();
            if shape4(p.layout(), d.len(), "phi")? != want {
                return Err(Error::LegacyShape(format!("phi: shape {:?}, expected {want:?}", p.layout().shape())));
            }
            Some((d, p.layout()))
        }
        (None, FeatureMap::Favor { .. }) => return Err(Error::LegacyShape("FAVOR+ backward needs phi".into())),
        _ => None,
    };
    let (mut dm, dl) = dx.parts();
    if shape4(dl, dm.len(), "dx")? != xs {
        return Err(Error::LegacyShape(format!("dx: shape {:?}, expected {xs:?}", dl.shape())));
    }
    dl.check_no_overlap("dx")?;
    let omega_mem = match map {
        FeatureMap::Favor { projection, .. } => Some(projection.device_mem()),
        _ => None,
    };
    let xp = device.read_ptr(&xd, xl.offset(), "x")?;
    let gp = device.read_ptr(&gd, gl.offset(), "dphi")?;
    let pp = match phi_pair.as_ref() {
        Some((d, l)) => Some((device.read_ptr(d, l.offset(), "phi")?, *l)),
        None => None,
    };
    let wp = match omega_mem.as_ref() {
        Some(w) => Some(device.read_ptr(w, 0, "omega")?),
        None => None,
    };
    let dp = device.write_ptr(&mut dm, dl.offset(), "dx")?;
    let null = sys::MesaLaTensor { data: std::ptr::null_mut(), strides: [0; 4] };
    let args = sys::MesaFeatureBackwardArgs {
        map: map.code(),
        dtype: T::DTYPE.to_sys(),
        batch: xs[0] as i64,
        heads: xs[1] as i64,
        len: xs[2] as i64,
        in_dim: xs[3] as i64,
        out_dim: m as i64,
        x: la_tensor(xl, xp.addr),
        phi: pp.as_ref().map_or(null, |(p, l)| la_tensor(l, p.addr)),
        dphi: la_tensor(gl, gp.addr),
        dx: la_tensor(dl, dp.addr),
        omega: wp.as_ref().map_or(std::ptr::null(), |p| p.addr as *const f32),
    };
    // SAFETY: x, dx: [B, H, L, d], dphi (and phi for FAVOR+): [B, H, L, m], each inside its
    // buffer (check_fits); dx does not overlap itself; ω holds m·d f32.
    unsafe {
        device.launch("feature_map_backward", &args, sys::mesa_feature_map_backward, sys::mesa_emu_feature_map_backward)
    }
}

impl FavorProjection {
    fn device_mem(&self) -> crate::device::MemRef<'_, f32> {
        crate::device::DeviceMemory::mem_ref(&self.device)
    }
}
