//! Linear attention with B·H = 65538 heads, more than the 65535 a grid's y or z dimension
//! holds: every launch must cover them (the kernels' grids are one-dimensional grid-stride
//! loops over 64-bit item counts). Its own binary because it is slow on the emulator
//! (~0.4 M small blocks' worth of items): here the emulator checks the memory (canaries and
//! guard pages), barriers and launch bounds, but does not shuffle the schedule or track shared
//! memory, which the small cases of `tests/linear_attention.rs` do under every check.
mod common;

use mesa_kernels::emulator::{self, Checks};
use mesa_kernels::linear_attention::{
    backward, forward, BackwardArgs, ForwardArgs, Grads, LinearAttentionConfig, MemoryMode,
};
use mesa_kernels::{Device, DeviceMemory, DeviceMemoryMut, Layout, TensorMut, TensorRef};

struct Shape {
    b: usize,
    h: usize,
    l: usize,
    m: usize,
    d: usize,
}

impl Shape {
    fn qk(&self) -> usize {
        self.b * self.h * self.l * self.m
    }
    fn vd(&self) -> usize {
        self.b * self.h * self.l * self.d
    }
}

fn tr<'a, T>(mem: &'a (impl DeviceMemory<T> + ?Sized), layout: &Layout) -> TensorRef<'a, T> {
    TensorRef::new(mem, layout).expect("input view")
}

fn tm<'a, T>(mem: &'a mut (impl DeviceMemoryMut<T> + ?Sized), layout: &Layout) -> TensorMut<'a, T> {
    TensorMut::new(mem, layout).expect("output view")
}

/// The emulator with memcheck, synccheck and bounds (unless `MESA_EMU_CHECK` chose), the seed
/// as the suite's.
fn emulator() -> Device {
    if std::env::var_os("MESA_EMU_CHECK").is_none() {
        let (_, seed) = emulator::checks();
        emulator::set_checks(Checks::MEM.with(Checks::SYNC).with(Checks::BOUNDS), seed);
    }
    Device::emulator()
}

#[test]
fn more_than_65535_heads() {
    // The boundary mode has the three kinds of launch (per-chunk items for dq; per (b, h)
    // accumulation for the forward, dk, dv, which is SLiM's dq too), so it alone runs here.
    many_heads_case(MemoryMode::BoundaryStates);
}

fn many_heads_case(memory: MemoryMode) {
    let n = Shape { b: 2, h: 32769, l: 2, m: 1, d: 1 };
    let device = emulator();
    let q: Vec<f32> = (0..n.qk()).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
    let k: Vec<f32> = (0..n.qk()).map(|i| 1.0 + (i % 3) as f32).collect();
    let v: Vec<f32> = (0..n.vd()).map(|i| (i % 11) as f32 - 5.0).collect();
    let lq = Layout::contiguous(&[n.b, n.h, n.l, n.m]);
    let lv = Layout::contiguous(&[n.b, n.h, n.l, n.d]);
    let mut out = vec![f32::NAN; n.vd()];
    let cfg = LinearAttentionConfig { normalize: false, memory, ..LinearAttentionConfig::causal() };
    let saved = forward(
        &device,
        &cfg,
        ForwardArgs { q: &tr(&q, &lq), k: &tr(&k, &lq), v: &tr(&v, &lv), out: &mut tm(&mut out, &lv) },
    )
    .expect("forward");
    let g: Vec<f32> = (0..n.vd()).map(|i| (i % 5) as f32 - 2.0).collect();
    let (mut dq, mut dk, mut dv) = (vec![f32::NAN; n.qk()], vec![f32::NAN; n.qk()], vec![f32::NAN; n.vd()]);
    backward(
        &device,
        &saved,
        BackwardArgs {
            q: &tr(&q, &lq),
            k: &tr(&k, &lq),
            v: &tr(&v, &lv),
            out: None,
            dout: &tr(&g, &lv),
            grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
        },
    )
    .expect("backward");
    // M = D = 1: out_0 = q0 k0 v0, out_1 = q1 (k0 v0 + k1 v1), all exact in f32 here
    for bh in 0..n.b * n.h {
        let (q0, q1, k0, k1, v0, v1) = (q[2 * bh], q[2 * bh + 1], k[2 * bh], k[2 * bh + 1], v[2 * bh], v[2 * bh + 1]);
        assert_eq!(out[2 * bh], q0 * k0 * v0, "bh {bh}");
        assert_eq!(out[2 * bh + 1], q1 * (k0 * v0 + k1 * v1), "bh {bh}");
        // gradients (small dyadic values: every product and sum is exact in f32)
        let (g0, g1) = (g[2 * bh], g[2 * bh + 1]);
        assert_eq!(dq[2 * bh], g0 * v0 * k0, "dq bh {bh}");
        assert_eq!(dq[2 * bh + 1], g1 * (v0 * k0 + v1 * k1), "dq bh {bh}");
        assert_eq!(dk[2 * bh], v0 * (g0 * q0 + g1 * q1), "dk bh {bh}");
        assert_eq!(dk[2 * bh + 1], v1 * g1 * q1, "dk bh {bh}");
        assert_eq!(dv[2 * bh], k0 * (q0 * g0 + q1 * g1), "dv bh {bh}");
        assert_eq!(dv[2 * bh + 1], k1 * q1 * g1, "dv bh {bh}");
    }
}
