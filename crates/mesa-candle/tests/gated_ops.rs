//! The gated linear-attention op (`mesa_candle::ops::GatedLinearAttention`, issue 41) against
//! the f64 reference `mesa_kernels::reference::gated_linear_attention`: output, final state and
//! the gradients of q, k, v, the log-decay a and the initial state, through candle's autograd;
//! per-step and per-head decay, grouped heads, a reset (a = −∞), normalised or not, the identity
//! or the ELU+1 feature map, f32/f16/bf16/f64; bad inputs as typed errors.
//!
//! Bounds (per element, derived; u = 2⁻²⁴). The op computes in f32 (16-bit inputs are cast
//! exactly, f64 inputs are f32 values here) and adds no arithmetic of its own to the kernel's
//! but the feature map and the final rounding to the dtype, so the kernel's error analysis
//! (`tests/gated_linear_attention.rs` at the repository root) applies:
//! * every result is a sum of products, each of a dot over M, over D + 1, a chain of ≤ L rows
//!   through the state, ≤ C rows of a chunk and ≤ L/C + 2 weight products: with the classical
//!   bound `n·u·Σ|terms|`, `n = M + D + 2L + 2C + L/C + 24`, times `mag`, the same sum of
//!   absolute values (the reference run on |φ(q)|, |φ(k)|, |v|, |S₀|, |dout|, |d_final|);
//! * a weight `exp(Σ a)` is formed from prefix sums over ≤ C steps of its chunk and ≤ C steps
//!   before it, so its exponent, hence its relative error, is off by ≤ 2C·u·(L + C)·α
//!   (α = max |a| of the finite log-decays): that term times `mag` again;
//! * the ELU+1 map rounds φ once (relative u on each of φ(q), φ(k): 2u·mag more) and its
//!   backward multiplies by φ' once (`dx = φ'(x)·dφ`: φ'·bound(dφ) + u·|dx|);
//! * `da_r = Σ_{t≥r} φ(q_t)·dφ(q_t) − Σ_{t≥r} φ(k_t)·dφ(k_t) + ⟨d_final, S_final⟩` (scaling
//!   a_r by e^ε is q_t·e^ε, k_t·e^−ε for t ≥ r, S_final·e^ε), so its error is that of those
//!   dots from the dq, dk and final-state errors, plus (M + G + L + 4)·u times their
//!   magnitudes (the dots, the group's G heads, the suffix sum); per head: summed over B and
//!   L, plus B·L·u·Σ of the summands' magnitudes;
//! * normalised (positive features, ELU+1, so every denominator is ≥ its own row's term and
//!   the sums have no cancellation in them): `o = n/den` with both off by the bound above
//!   relatively to their magnitudes, so `mag(o) = mag(n)/den + |o|`; a gradient is the
//!   unnormalised one of `dout/den` (term 1) minus the one of `v = 1`, `dout = (dout·o)/den`
//!   (term 2): `mag` is the sum of both terms' magnitudes;
//! * results stored in a 16-bit dtype round once more: `u_T·|ref|`;
//! * 16-bit inputs with the identity map run the kernels in their dtype, every product on
//!   tensor cores as split bf16 pairs: `(n·u + 6·2⁻¹⁸)·mag` more (derived in
//!   `tests/gated_linear_attention.rs` at the repository root), and a normalised backward
//!   reads the output rounded to the dtype (`dden` off by `u_T` relatively): `4·u_T·mag` more.
//!   (With the ELU+1 map the op computes in f32, as above.)
//!
//! Normalised cases keep every denominator away from zero: positive features (ELU+1, or the
//! identity on `|q|`, `|k|`).
mod common;

use candle_core::{DType, Tensor, Var};
use common::{assert_within, flat, unit, Rng};
use mesa_candle::ops::{FeatureKind, GatedConfig, GatedLinearAttention};
use mesa_kernels::reference::gated_linear_attention as rg;

const U: f64 = 1.0 / 16_777_216.0;

#[derive(Clone, Debug)]
struct Case {
    b: usize,
    h: usize,
    hkv: usize,
    l: usize,
    m: usize,
    d: usize,
    chunk: usize,
    per_head: bool,
    normalize: bool,
    initial: bool,
    elu: bool,
    dtype: DType,
    /// (b, kv head, t) set to −∞ (per step only)
    resets: Vec<(usize, usize, usize)>,
}

fn case(b: usize, h: usize, hkv: usize, l: usize) -> Case {
    Case {
        b,
        h,
        hkv,
        l,
        m: 4,
        d: 3,
        chunk: 8,
        per_head: false,
        normalize: false,
        initial: true,
        elu: false,
        dtype: DType::F32,
        resets: vec![],
    }
}

impl Case {
    fn width(&self) -> usize {
        self.d + usize::from(self.normalize)
    }
    fn dims(&self) -> rg::GatedDims {
        rg::GatedDims { batch: self.b, heads: self.h, kv_heads: self.hkv, len: self.l, feat: self.m, dim: self.d }
    }
    fn a_shape(&self) -> Vec<usize> {
        if self.per_head {
            vec![self.hkv]
        } else {
            vec![self.b, self.hkv, self.l]
        }
    }
    fn state_shape(&self) -> Vec<usize> {
        vec![self.b, self.hkv, self.m, self.width()]
    }
}

fn elu1(x: f64) -> f64 {
    if x > 0.0 {
        x + 1.0
    } else {
        x.exp()
    }
}
fn elu1_grad(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else {
        x.exp()
    }
}

/// The reference's forward and gradients (`dout`, `d_final`) on f64 slices.
fn reference(
    c: &Case,
    dims: rg::GatedDims,
    qkv: [&[f64]; 3],
    a: &[f64],
    s0: Option<&[f64]>,
    dout: &[f64],
    d_final: Option<&[f64]>,
) -> (rg::GatedOutput, rg::GatedGrads) {
    let decay = if c.per_head { rg::Decay::PerHead(a) } else { rg::Decay::PerStep(a) };
    let g =
        rg::Gated { q: qkv[0], k: qkv[1], v: qkv[2], decay, dims, normalize: c.normalize.then_some(1e-6), initial: s0 };
    (rg::forward(&g).unwrap(), rg::backward(&g, dout, d_final).unwrap())
}

/// The unnormalised reference on absolute values, per-step decay (`a` expanded): the
/// magnitudes `mag` of the module docs.
fn magnitudes(
    c: &Case,
    dims: rg::GatedDims,
    qkv: [&[f64]; 3],
    a_steps: &[f64],
    s0: Option<&[f64]>,
    dout: &[f64],
    d_final: Option<&[f64]>,
) -> (rg::GatedOutput, rg::GatedGrads) {
    let abs = |x: &[f64]| x.iter().map(|v| v.abs()).collect::<Vec<_>>();
    let (q, k, v, g) = (abs(qkv[0]), abs(qkv[1]), abs(qkv[2]), abs(dout));
    let s0 = s0.map(abs);
    let df = d_final.map(abs);
    let plain = Case { normalize: false, per_head: false, ..c.clone() };
    reference(&plain, dims, [&q, &k, &v], a_steps, s0.as_deref(), &g, df.as_deref())
}

fn run(c: &Case, rng: &mut Rng) {
    let cpu = candle_core::Device::Cpu;
    let (b, h, hkv, l, m, d) = (c.b, c.h, c.hkv, c.l, c.m, c.d);
    let group = h / hkv;
    // normalised with the identity map: positive features (module docs)
    let positive = |t: Tensor| if c.normalize && !c.elu { t.abs().unwrap() } else { t };
    let q = positive(rng.tensor(&[b, h, l, m], 0.0, 1.0, c.dtype));
    let k = positive(rng.tensor(&[b, hkv, l, m], 0.0, 1.0, c.dtype));
    let v = rng.tensor(&[b, hkv, l, d], 0.0, 1.0, c.dtype);
    let alpha = 0.8;
    let mut a_vals: Vec<f32> =
        (0..c.a_shape().iter().product::<usize>()).map(|_| -(0.02 + (alpha - 0.02) * rng.uniform()) as f32).collect();
    for &(rb, rk, rt) in &c.resets {
        a_vals[(rb * hkv + rk) * l + rt] = f32::NEG_INFINITY;
    }
    let side = if c.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let a = Tensor::from_vec(a_vals.clone(), c.a_shape(), &cpu).unwrap().to_dtype(side).unwrap();
    let s0 = c.initial.then(|| rng.tensor(&c.state_shape(), 0.0, 1.0, DType::F32).to_dtype(side).unwrap());
    let with_state = !c.normalize;
    // the upstream gradients reach the op in its result's dtype (candle's cast): values exact
    // in it, so that the reference sees the same ones
    let dout = flat(&rng.tensor(&[b, h, l, d], 0.0, 1.0, c.dtype));
    let d_final = with_state.then(|| flat(&rng.tensor(&c.state_shape(), 0.0, 1.0, DType::F32)));

    // the op, through candle's autograd
    let device = common::device();
    let var = |t: &Tensor| Var::from_tensor(&t.to_device(&device).unwrap()).unwrap();
    let (qv, kv, vv, av) = (var(&q), var(&k), var(&v), var(&a));
    let sv = s0.as_ref().map(var);
    let map = c.elu.then_some(FeatureKind::Elu1);
    let config = GatedConfig { normalize: c.normalize, chunk: c.chunk, ..GatedConfig::default() };
    let op = GatedLinearAttention::new(config, map);
    let g_out = Tensor::from_vec(dout.clone(), (b, h, l, d), &device).unwrap();
    let (y, fin) = if with_state {
        let (y, s) = op.forward_with_state(&qv, &kv, &vv, &av, sv.as_ref().map(Var::as_tensor)).unwrap();
        (y, Some(s))
    } else {
        assert!(sv.is_none(), "normalised cases run without a state");
        (op.forward(&qv, &kv, &vv, &av).unwrap(), None)
    };
    assert_eq!(y.dtype(), c.dtype);
    let mut loss = (y.to_dtype(DType::F64).unwrap() * g_out).unwrap().sum_all().unwrap();
    if let (Some(s), Some(df)) = (&fin, &d_final) {
        assert_eq!(s.dims(), c.state_shape().as_slice());
        let df = Tensor::from_vec(df.clone(), c.state_shape(), &device).unwrap();
        loss = (loss + (s.to_dtype(DType::F64).unwrap() * df).unwrap().sum_all().unwrap()).unwrap();
    }
    let store = loss.backward().unwrap();
    let grad = |t: &Var| flat(store.get(t.as_tensor()).expect("a gradient"));

    // the reference, on the same (dtype-rounded) values
    let (qf, kf, vf) = (flat(&q), flat(&k), flat(&v));
    let phi = |x: &[f64]| if c.elu { x.iter().map(|&v| elu1(v)).collect() } else { x.to_vec() };
    let dphi = |x: &[f64]| if c.elu { x.iter().map(|&v| elu1_grad(v)).collect() } else { vec![1.0; x.len()] };
    let (pq, pk) = (phi(&qf), phi(&kf));
    let af: Vec<f64> = a_vals.iter().map(|&x| f64::from(x)).collect();
    let s0f = s0.as_ref().map(flat);
    let dims = c.dims();
    let (fw, gr) = reference(c, dims, [&pq, &pk, &vf], &af, s0f.as_deref(), &dout, d_final.as_deref());

    // bounds (module docs)
    let a_steps: Vec<f64> = if c.per_head { (0..b * hkv * l).map(|i| af[(i / l) % hkv]).collect() } else { af.clone() };
    let (mag_out, mag_fin, mag_dq, mag_dk, mag_dv) = if c.normalize {
        // term 1: dout/den; term 2: v = 1, dout = (dout·o)/den (module docs)
        let den = &fw.den;
        let g1: Vec<f64> = (0..dout.len()).map(|i| dout[i] / den[i / d]).collect();
        let (_, t1) = magnitudes(c, dims, [&pq, &pk, &vf], &a_steps, None, &g1, None);
        let ones = vec![1.0; b * hkv * l];
        let g2: Vec<f64> = (0..b * h * l)
            .map(|r| (0..d).map(|j| (dout[r * d + j] * fw.out[r * d + j]).abs()).sum::<f64>() / den[r])
            .collect();
        let dims1 = rg::GatedDims { dim: 1, ..dims };
        let (_, t2) = magnitudes(c, dims1, [&pq, &pk, &ones], &a_steps, None, &g2, None);
        let (mn, _) = magnitudes(c, dims, [&pq, &pk, &vf], &a_steps, None, &dout, None);
        let out: Vec<f64> = (0..mn.out.len()).map(|i| mn.out[i] / den[i / d] + fw.out[i].abs()).collect();
        let add = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(p, q)| p + q).collect::<Vec<_>>();
        (out, vec![], add(&t1.dq, &t2.dq), add(&t1.dk, &t2.dk), t1.dv)
    } else {
        let (mf, mg) = magnitudes(c, dims, [&pq, &pk, &vf], &a_steps, s0f.as_deref(), &dout, d_final.as_deref());
        (mf.out, mf.final_state, mg.dq, mg.dk, mg.dv)
    };
    let n = (m + d + 2 * l + 2 * c.chunk + l / c.chunk + 24 + if c.elu { 2 } else { 0 }) as f64;
    let f32_factor = U * (n + 2.0 * c.chunk as f64 * (l + c.chunk) as f64 * alpha);
    let ut = if c.dtype == DType::F64 { 0.0 } else { unit(c.dtype) };
    let ut = if c.dtype == DType::F32 { 0.0 } else { ut };
    // 16-bit on the kernels in its own dtype (identity map): the tensor cores' split pairs,
    // and a normalised backward's rounded output (module docs)
    let native16 = ut > 0.0 && !c.elu;
    let tc = if native16 { n * U + 6.0 * 2f64.powi(-18) + if c.normalize { 4.0 * ut } else { 0.0 } } else { 0.0 };
    let bound = |mag: &[f64]| mag.iter().map(|x| (f32_factor + tc) * x).collect::<Vec<f64>>();
    // 16-bit results round once more; a subnormal result may be off by half its spacing
    let rounded = |tol: Vec<f64>, want: &[f64]| -> Vec<f64> {
        tol.iter().zip(want).map(|(t, w)| t + ut * w.abs() + if ut > 0.0 { 6e-8 } else { 0.0 }).collect()
    };
    let (tdphi_q, tdphi_k) = (bound(&mag_dq), bound(&mag_dk));
    // the map's backward: dx = φ'·dφ (one more rounding)
    let via_map = |tol: &[f64], x: &[f64], want: &[f64]| -> Vec<f64> {
        let dp = dphi(x);
        (0..tol.len()).map(|i| dp[i] * tol[i] + if c.elu { U * want[i].abs() } else { 0.0 }).collect()
    };
    let dq_want: Vec<f64> = gr.dq.iter().zip(dphi(&qf)).map(|(g, p)| g * p).collect();
    let dk_want: Vec<f64> = gr.dk.iter().zip(dphi(&kf)).map(|(g, p)| g * p).collect();
    let what = |s: &str| format!("{s} ({c:?})");
    assert_within(&what("out"), &flat(&y), &fw.out, &rounded(bound(&mag_out), &fw.out));
    assert_within(&what("dq"), &grad(&qv), &dq_want, &rounded(via_map(&tdphi_q, &qf, &dq_want), &dq_want));
    assert_within(&what("dk"), &grad(&kv), &dk_want, &rounded(via_map(&tdphi_k, &kf, &dk_want), &dk_want));
    assert_within(&what("dv"), &grad(&vv), &gr.dv, &rounded(bound(&mag_dv), &gr.dv));
    let tfin = bound(&mag_fin);
    if let Some(s) = &fin {
        assert_within(&what("final state"), &flat(s), &fw.final_state, &tfin);
    }
    if let Some(sv) = &sv {
        // the reverse chain of d_final and dout through the state: bounded as the others
        let (_, mg) = magnitudes(c, dims, [&pq, &pk, &vf], &a_steps, s0f.as_deref(), &dout, d_final.as_deref());
        assert_within(&what("d_initial"), &grad(sv), &gr.d_initial, &bound(&mg.d_initial));
    }

    // da (module docs): per (b, kv head, r), from the suffix sums of the dots' errors
    let mut tda = vec![0.0; b * hkv * l];
    let mut mda = vec![0.0; b * hkv * l];
    let fin_term = |bi: usize, kh: usize| -> (f64, f64) {
        let Some(df) = &d_final else { return (0.0, 0.0) };
        let w = c.width();
        let range = (bi * hkv + kh) * m * w..(bi * hkv + kh + 1) * m * w;
        let mag: f64 = range.clone().map(|i| df[i].abs() * mag_fin[i]).sum();
        let err: f64 = range.map(|i| df[i].abs() * tfin[i]).sum();
        (mag, err)
    };
    for bi in 0..b {
        for kh in 0..hkv {
            // ⟨d_final, S_final⟩: its dot's roundings and the final state's error
            let (fin_mag, fin_err) = fin_term(bi, kh);
            let mut err = fin_err + (m * c.width() + 4) as f64 * U * fin_mag;
            let mut dots_mag = 0.0;
            for r in (0..l).rev() {
                for hh in kh * group..(kh + 1) * group {
                    let row = ((bi * h + hh) * l + r) * m;
                    for i in row..row + m {
                        err += pq[i].abs() * tdphi_q[i];
                        dots_mag += pq[i].abs() * mag_dq[i];
                    }
                }
                let row = ((bi * hkv + kh) * l + r) * m;
                for i in row..row + m {
                    err += pk[i].abs() * tdphi_k[i];
                    dots_mag += pk[i].abs() * mag_dk[i];
                }
                let at = (bi * hkv + kh) * l + r;
                tda[at] = err + (m + group + l + 4) as f64 * U * dots_mag;
                mda[at] = dots_mag + fin_mag;
            }
        }
    }
    let tda = if c.per_head {
        (0..hkv)
            .map(|kh| {
                let rows = (0..b).flat_map(|bi| (0..l).map(move |r| (bi * hkv + kh) * l + r));
                rows.map(|i| tda[i] + (b * l) as f64 * U * mda[i]).sum()
            })
            .collect()
    } else {
        tda
    };
    assert_within(&what("da"), &grad(&av), &gr.da, &tda);
}

#[test]
fn matches_the_reference_f32() {
    let mut rng = Rng::new("gated matches_the_reference_f32");
    let mut cases = vec![
        case(2, 2, 2, 19),
        case(1, 4, 2, 21),
        case(2, 3, 1, 9),
        Case { per_head: true, ..case(2, 4, 2, 19) },
        Case { initial: false, ..case(1, 2, 1, 16) },
        // a reset at row 0, inside a chunk and on a chunk boundary
        Case { resets: vec![(0, 0, 0), (0, 1, 5), (1, 0, 8)], ..case(2, 4, 2, 19) },
        Case { elu: true, ..case(1, 4, 2, 17) },
        Case { normalize: true, elu: true, initial: false, ..case(2, 4, 2, 19) },
        Case { normalize: true, elu: true, initial: false, per_head: true, ..case(1, 2, 1, 13) },
    ];
    cases.push(Case { dtype: DType::F64, ..case(1, 4, 2, 11) });
    for c in &cases {
        run(c, &mut rng);
    }
}

#[test]
fn matches_the_reference_f16_bf16() {
    let mut rng = Rng::new("gated matches_the_reference_f16_bf16");
    for dtype in [DType::F16, DType::BF16] {
        run(&Case { dtype, ..case(2, 4, 2, 19) }, &mut rng);
        run(&Case { dtype, per_head: true, ..case(1, 2, 1, 10) }, &mut rng);
        // normalised 16-bit with a feature map: the backward reruns the f32 forward
        run(&Case { dtype, normalize: true, elu: true, initial: false, ..case(1, 4, 2, 12) }, &mut rng);
        // normalised 16-bit, identity map: the kernels in the dtype, the rounded output read back
        run(&Case { dtype, normalize: true, initial: false, ..case(1, 4, 2, 21) }, &mut rng);
        // a reset, chunks of 5 with a tail
        run(&Case { dtype, resets: vec![(0, 1, 7)], chunk: 5, ..case(1, 4, 2, 13) }, &mut rng);
    }
}

fn err_text(r: candle_core::Result<Tensor>) -> String {
    match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let _rng = Rng::new("gated bad_inputs_are_typed_errors");
    let dev = candle_core::Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
    let a = |s: &[usize], x: f32| Tensor::full(x, s, &dev).unwrap();
    let op = GatedLinearAttention::new(GatedConfig::default(), None);
    let (q, k, v) = (z(&[1, 4, 5, 3]), z(&[1, 2, 5, 3]), z(&[1, 2, 5, 2]));
    let ok = a(&[1, 2, 5], -0.5);
    assert!(op.forward(&q, &k, &v, &ok).is_ok());
    assert!(op.forward(&q, &k, &v, &a(&[2], -0.5)).is_ok());
    let cases: Vec<(&str, candle_core::Result<Tensor>, &str)> = vec![
        ("q rank 3", op.forward(&z(&[4, 5, 3]), &k, &v, &ok), "expected rank 4"),
        ("H_kv not dividing H", op.forward(&q, &z(&[1, 3, 5, 3]), &v, &ok), "must divide"),
        ("k of another L", op.forward(&q, &z(&[1, 2, 6, 3]), &v, &ok), "keys: expected shape [1, 2, 5, 3]"),
        ("v of another H_kv", op.forward(&q, &k, &z(&[1, 1, 5, 2]), &ok), "values: expected shape"),
        ("a per step of another L", op.forward(&q, &k, &v, &a(&[1, 2, 4], -0.5)), "per step [B, H_kv, L]"),
        ("a per head of another H_kv", op.forward(&q, &k, &v, &a(&[4], -0.5)), "per head [H_kv]"),
        ("a of rank 2", op.forward(&q, &k, &v, &a(&[2, 5], -0.5)), "expected rank 3"),
        ("a positive", op.forward(&q, &k, &v, &a(&[1, 2, 5], 0.25)), "must be ≤ 0"),
        ("a NaN", op.forward(&q, &k, &v, &a(&[2], f32::NAN)), "must be ≤ 0"),
        ("a f16", op.forward(&q, &k, &v, &ok.to_dtype(DType::F16).unwrap()), "dtype F16"),
        ("k f16", op.forward(&q, &k.to_dtype(DType::F16).unwrap(), &v, &ok), "dtype F16"),
        ("q i64", op.forward(&q.to_dtype(DType::I64).unwrap(), &k, &v, &ok), "I64"),
        (
            "initial of another width",
            op.forward_with_state(&q, &k, &v, &ok, Some(&z(&[1, 2, 3, 3]))).map(|r| r.0),
            "initial state [B, H_kv, M', W]: expected shape [1, 2, 3, 2]",
        ),
        (
            "chunk 0",
            GatedLinearAttention::new(GatedConfig { chunk: 0, ..GatedConfig::default() }, None)
                .forward(&q, &k, &v, &ok),
            "chunk",
        ),
    ];
    for (what, r, needle) in cases {
        let text = err_text(r);
        assert!(text.contains(needle), "{what}: the error {text:?} does not say {needle:?}");
    }
    // a reset (−∞) is a value, not an error
    assert!(op.forward(&q, &k, &v, &a(&[2], f32::NEG_INFINITY)).is_ok());
}

/// The op hands 16-bit inputs to the kernels in their own dtype (tensor cores) when the map is
/// the identity: its final state is bitwise the kernels' bf16 run's, and differs from their f32
/// run on the same values (which the op would give if it cast to f32 first).
#[test]
fn sixteen_bit_inputs_run_the_kernels_in_their_dtype() {
    use half::bf16;
    use mesa_kernels::gated_linear_attention as gk;
    use mesa_kernels::TensorRef;
    let mut rng = Rng::new("gated sixteen_bit_inputs_run_the_kernels_in_their_dtype");
    let cpu = candle_core::Device::Cpu;
    let (b, h, hkv, l, m, d) = (1, 2, 1, 21, 8, 5);
    let q = rng.tensor(&[b, h, l, m], 0.0, 1.0, DType::BF16);
    let k = rng.tensor(&[b, hkv, l, m], 0.0, 1.0, DType::BF16);
    let v = rng.tensor(&[b, hkv, l, d], 0.0, 1.0, DType::BF16);
    let a_vals: Vec<f32> = (0..b * hkv * l).map(|_| -(0.02 + 0.5 * rng.uniform()) as f32).collect();
    let a = Tensor::from_vec(a_vals.clone(), (b, hkv, l), &cpu).unwrap();
    let config = GatedConfig { chunk: 8, ..GatedConfig::default() };
    let (_, fin) = GatedLinearAttention::new(config, None).forward_with_state(&q, &k, &v, &a, None).unwrap();
    let fin: Vec<f32> = fin.flatten_all().unwrap().to_vec1().unwrap();

    // the kernels themselves, in bf16 and in f32 on the same values
    let device = mesa_kernels::Device::emulator();
    let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
    let (qh, kh, vh) = (host(&q), host(&k), host(&v));
    let kernel_state = |f32_inputs: bool| -> Vec<f32> {
        let (qs, ks, vs) = ([b, h, l, m], [b, hkv, l, m], [b, hkv, l, d]);
        let ar = TensorRef::contiguous(&a_vals, &[b, hkv, l]).unwrap();
        let saved = if f32_inputs {
            let w = |x: &[bf16]| x.iter().map(|y| y.to_f32()).collect::<Vec<f32>>();
            let (qf, kf, vf) = (w(&qh), w(&kh), w(&vh));
            let mut out = vec![0f32; b * h * l * d];
            let (qr, kr, vr) = (
                TensorRef::contiguous(&qf, &qs).unwrap(),
                TensorRef::contiguous(&kf, &ks).unwrap(),
                TensorRef::contiguous(&vf, &vs).unwrap(),
            );
            let mut o = mesa_kernels::TensorMut::contiguous(&mut out, &[b, h, l, d]).unwrap();
            let args =
                gk::ForwardArgs { q: &qr, k: &kr, v: &vr, decay: gk::Decay::PerStep(&ar), initial: None, out: &mut o };
            gk::forward(&device, &config, args).unwrap()
        } else {
            let mut out = vec![bf16::ZERO; b * h * l * d];
            let (qr, kr, vr) = (
                TensorRef::contiguous(&qh, &qs).unwrap(),
                TensorRef::contiguous(&kh, &ks).unwrap(),
                TensorRef::contiguous(&vh, &vs).unwrap(),
            );
            let mut o = mesa_kernels::TensorMut::contiguous(&mut out, &[b, h, l, d]).unwrap();
            let args =
                gk::ForwardArgs { q: &qr, k: &kr, v: &vr, decay: gk::Decay::PerStep(&ar), initial: None, out: &mut o };
            gk::forward(&device, &config, args).unwrap()
        };
        saved.final_state().unwrap()
    };
    let (native, via_f32) = (kernel_state(false), kernel_state(true));
    assert_ne!(native, via_f32, "the bf16 and f32 kernels agree bitwise here: the test cannot tell them apart");
    assert_eq!(fin, native, "the op's final state is not the bf16 kernels'");
}
