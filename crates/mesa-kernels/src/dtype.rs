//! Element types: f32, f16 and bf16 (from `half`), all computed in f32 inside the kernels.
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use mesa_kernels_sys as sys;

/// The floating-point storage types the kernels read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
}

impl DType {
    /// Bytes per element.
    #[must_use]
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Lower-case name (`"f32"`, `"f16"`, `"bf16"`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    pub(crate) const fn to_sys(self) -> sys::MesaDType {
        (match self {
            DType::F32 => sys::MESA_DTYPE_F32,
            DType::F16 => sys::MESA_DTYPE_F16,
            DType::BF16 => sys::MESA_DTYPE_BF16,
        }) as sys::MesaDType
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A storage type the kernels accept: `f32`, `half::f16` or `half::bf16`.
pub trait Element:
    sealed::Sealed + Copy + Default + Send + Sync + DeviceRepr + ValidAsZeroBits + bytemuck::Pod + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Exact widening to f64.
    fn to_f64(self) -> f64;
    /// Rounding (to nearest even) from f64.
    fn from_f64(v: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

/// `v` rounded to f32 *to odd* (truncate, then set the last bit if anything was cut off).
/// Rounding that value to nearest-even at 16-bit precision gives exactly the correctly
/// rounded 16-bit value of `v` (f32 keeps ≥ 2 more bits than f16 and bf16), which a plain
/// f64 → f32 → 16-bit path (double rounding) does not.
fn round_to_odd_f32(v: f64) -> f32 {
    let f = v as f32;
    if !f.is_finite() || f64::from(f) == v {
        return f;
    }
    // toward zero first
    let t = if f64::from(f).abs() > v.abs() { f32::from_bits(f.to_bits() - 1) } else { f };
    f32::from_bits(t.to_bits() | 1)
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f32(round_to_odd_f32(v))
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f32(round_to_odd_f32(v))
    }
}
