//! Rotary position embeddings against the f64 reference (`mesa_kernels::reference::rope`), on
//! every backend and dtype, both pairings, partial rotation, offsets and strided views.
//!
//! Tolerance (derived): the kernel rounds `inv_freq = base^(−2i/R)` (its exponent rounded
//! first: a relative error of `ln(base)·2⁻²⁴`, at most 13·2⁻²⁴ for base 5·10⁵, and `powf`'s
//! own 2 ulp), then `inv_freq/π` and `θ/π = p·inv_freq/π` (2⁻²⁴ each): `|Δθ| ≤ 20·2⁻²⁴·θ`;
//! `sincospif` within 2 ulp; the two products and the fused add three roundings of terms
//! below `|x_a| + |x_b|`. So `|y − ref| ≤ (|x_a| + |x_b|)·2⁻²⁴·(20θ + 8) + u_T·|ref|` (u_T the
//! output's unit roundoff).
mod common;

use half::{bf16, f16};
use mesa_kernels::reference::{self, rope as rr};
use mesa_kernels::rope::{rope, rope_backward, RopeConfig, RopePairing};
use mesa_kernels::{DType, Device, Element, Error, Layout, TensorMut, TensorRef};
use rand::RngExt;

const EPS: f64 = 1.0 / 16_777_216.0;

/// Runs RoPE (or its inverse) of `x` viewed through `l` ([..., S, D]) into a dense output;
/// returns the output and the input's logical values.
fn run<T: Element>(device: &Device, cfg: &RopeConfig, x: &[T], l: &Layout, inverse: bool) -> (Vec<f64>, Vec<f64>) {
    let xb = device.upload(x).expect("up");
    let n: usize = l.shape().iter().product();
    let mut yb = device.upload(&vec![T::from_f64(f64::NAN); n]).expect("up");
    let dense = Layout::contiguous(l.shape());
    let xv = TensorRef::new(&xb, l).expect("view");
    let mut yv = TensorMut::new(&mut yb, &dense).expect("view");
    if inverse {
        rope_backward(device, cfg, &xv, &mut yv).expect("rope_backward");
    } else {
        rope(device, cfg, &xv, &mut yv).expect("rope");
    }
    let y = yb.to_vec().expect("down").iter().map(|v| v.to_f64()).collect();
    (y, reference::gather(x, l))
}

/// Checks one output against the reference with the bound of the module docs.
fn check(what: &str, y: &[f64], x: &[f64], shape: &[usize], cfg: &RopeConfig, inverse: bool, u_t: f64) {
    let (seq, dim) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let want = rr::rope(x, seq, dim, cfg, inverse);
    let r = cfg.rotary_dims.unwrap_or(dim);
    for (e, (got, w)) in y.iter().zip(&want).enumerate() {
        let (row, d) = (e / dim, e % dim);
        let p = (cfg.position_offset + row % seq) as f64;
        let tol = if d < r {
            let i = match cfg.pairing {
                RopePairing::Halves => d % (r / 2),
                RopePairing::Interleaved => d / 2,
            };
            let (a, b) = match cfg.pairing {
                RopePairing::Halves => (i, i + r / 2),
                RopePairing::Interleaved => (2 * i, 2 * i + 1),
            };
            let theta = p * f64::from(cfg.base).powf(-2.0 * i as f64 / r as f64);
            (x[row * dim + a].abs() + x[row * dim + b].abs()) * EPS * (20.0 * theta + 8.0) + u_t * w.abs()
        } else {
            0.0 // passed through: the same bits
        };
        assert!((got - w).abs() <= tol, "{what}: element {e} (row {row}, dim {d}): {got} vs {w} (tol {tol})");
    }
}

fn random<T: Element>(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.random::<f64>() * 4.0 - 2.0)).collect()
}

macro_rules! each_dtype {
    ($body:ident) => {
        $body::<f32>(DType::F32);
        $body::<f16>(DType::F16);
        $body::<bf16>(DType::BF16);
    };
}

#[test]
fn rope_matches_the_reference_every_dtype_pairing_and_view() {
    fn case<T: Element>(dtype: DType) {
        let mut rng = common::rng("rope_parity");
        let u_t = common::unit_roundoff(dtype);
        for device in common::backends() {
            for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
                // [B, H, S, D] from position 5, all dims rotated (Llama 2's base)
                let cfg = RopeConfig { base: 10_000.0, pairing, rotary_dims: None, position_offset: 5 };
                let shape = [2, 3, 17, 64];
                let x: Vec<T> = random(&mut rng, shape.iter().product());
                let l = Layout::contiguous(&shape);
                for inverse in [false, true] {
                    let (y, xs) = run(&device, &cfg, &x, &l, inverse);
                    check(&format!("{dtype:?} {pairing:?} inverse {inverse}"), &y, &xs, &shape, &cfg, inverse, u_t);
                }
                // a [B, S, H, D] projection read as [B, H, S, D] (strided), half the dims rotated
                // (GPT-NeoX's rotary_pct 0.5), Llama 3's base, positions past 100 000
                let cfg = RopeConfig { base: 500_000.0, pairing, rotary_dims: Some(16), position_offset: 100_000 };
                let x: Vec<T> = random(&mut rng, 2 * 9 * 4 * 32);
                let l = Layout::contiguous(&[2, 9, 4, 32]).transpose(1, 2).expect("t");
                let (y, xs) = run(&device, &cfg, &x, &l, false);
                check(&format!("{dtype:?} {pairing:?} strided, partial"), &y, &xs, l.shape(), &cfg, false, u_t);
            }
        }
    }
    each_dtype!(case);
}

#[test]
fn the_backward_undoes_the_forward() {
    // RoPE is a rotation: RoPE⁻¹(RoPE(x)) = x within the two passes' bounds (f32)
    let mut rng = common::rng("rope_inverse");
    let device = common::emulator();
    let cfg = RopeConfig::llama(500_000.0);
    let shape = [4, 33, 128];
    let x: Vec<f32> = random(&mut rng, shape.iter().product());
    let l = Layout::contiguous(&shape);
    let (y, xs) = run(&device, &cfg, &x, &l, false);
    let y32: Vec<f32> = y.iter().map(|v| *v as f32).collect();
    let (back, _) = run(&device, &cfg, &y32, &l, true);
    for (e, (b, x0)) in back.iter().zip(&xs).enumerate() {
        let p = (e / 128 % 33) as f64;
        let tol = 4.0 * EPS * (20.0 * p + 8.0) * 4.0;
        assert!((b - x0).abs() <= tol, "element {e}: {b} vs {x0} (tol {tol})");
    }
}

#[test]
fn bad_input_is_an_error() {
    let device = common::emulator();
    let xb = device.upload(&[1.0f32; 64]).expect("up");
    let mut yb = device.alloc_zeros::<f32>(64).expect("alloc");
    let l = Layout::contiguous(&[4, 16]);
    let x = TensorRef::new(&xb, &l).expect("v");
    let mut y = TensorMut::new(&mut yb, &l).expect("v");
    let odd = RopeConfig { rotary_dims: Some(7), ..RopeConfig::llama(10_000.0) };
    assert!(matches!(rope(&device, &odd, &x, &mut y), Err(Error::InvalidLayout { .. })));
    let wide = RopeConfig { rotary_dims: Some(18), ..RopeConfig::llama(10_000.0) };
    assert!(matches!(rope(&device, &wide, &x, &mut y), Err(Error::InvalidLayout { .. })));
    for base in [1.0, f32::NAN, f32::INFINITY, -3.0] {
        let cfg = RopeConfig::llama(base);
        assert!(matches!(rope(&device, &cfg, &x, &mut y), Err(Error::InvalidLayout { .. })), "base {base}");
    }
    let far = RopeConfig { position_offset: 1 << 24, ..RopeConfig::llama(10_000.0) };
    assert!(matches!(rope(&device, &far, &x, &mut y), Err(Error::InvalidLayout { .. })));
    let flat = Layout::contiguous(&[64]);
    let (x1, mut y1) = (TensorRef::new(&xb, &flat).expect("v"), TensorMut::new(&mut yb, &flat).expect("v"));
    assert!(matches!(rope(&device, &RopeConfig::llama(10_000.0), &x1, &mut y1), Err(Error::InvalidLayout { .. })));
    let other = Layout::contiguous(&[8, 8]);
    let mut y2 = TensorMut::new(&mut yb, &other).expect("v");
    assert!(matches!(rope(&device, &RopeConfig::llama(10_000.0), &x, &mut y2), Err(Error::ShapeMismatch { .. })));
}
