//! The f64 reference of gated linear attention (`reference::gated_linear_attention`, issue 41)
//! against independent computations: the step-by-step recurrence `S_t = exp(a_t) S_{t−1} +
//! k_t v'_tᵀ`, today's ungated reference at `a = 0`, K and V repeated to every query head,
//! central finite differences of a scalar loss for every gradient (`da` included), and a
//! reset (`a_t = −∞`) against the suffix run alone.
use mesa_kernels::reference::gated_linear_attention::{backward, forward, Decay, Gated, GatedDims};
use mesa_kernels::reference::linear_attention as ungated;

/// A deterministic generator (SplitMix64) of values in [-1, 1).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.next()).collect()
    }
}

struct Case {
    dims: GatedDims,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    a: Vec<f64>,
    s0: Vec<f64>,
    normalize: Option<f64>,
}

impl Case {
    fn new(seed: u64, dims: GatedDims, normalize: Option<f64>) -> Self {
        let mut g = Gen(seed);
        let (b, h, kv, l, m, d) = (dims.batch, dims.heads, dims.kv_heads, dims.len, dims.feat, dims.dim);
        let w = d + usize::from(normalize.is_some());
        // positive features and state when normalised (denominators away from 0)
        let pos = |x: Vec<f64>| if normalize.is_some() { x.iter().map(|v| v.abs() + 0.1).collect() } else { x };
        Case {
            dims,
            q: pos(g.vec(b * h * l * m)),
            k: pos(g.vec(b * kv * l * m)),
            v: g.vec(b * kv * l * d),
            // log-decays in [−1, 0)
            a: g.vec(b * kv * l).iter().map(|x| -(x.abs()) - 1e-3).collect(),
            s0: pos(g.vec(b * kv * m * w)),
            normalize,
        }
    }
    fn gated(&self) -> Gated<'_> {
        Gated {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            decay: Decay::PerStep(&self.a),
            dims: self.dims,
            normalize: self.normalize,
            initial: Some(&self.s0),
        }
    }
}

fn dims(batch: usize, heads: usize, kv_heads: usize, len: usize) -> GatedDims {
    GatedDims { batch, heads, kv_heads, len, feat: 3, dim: 2 }
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn the_sum_is_the_recurrence() {
    for normalize in [None, Some(1e-6)] {
        let c = Case::new(1, dims(2, 4, 2, 7), normalize);
        let got = forward(&c.gated()).unwrap();
        let GatedDims { batch, heads, kv_heads, len, feat: m, dim: d } = c.dims;
        let w = d + usize::from(normalize.is_some());
        let group = heads / kv_heads;
        for b in 0..batch {
            for kh in 0..kv_heads {
                let kv = b * kv_heads + kh;
                let mut s: Vec<f64> = c.s0[kv * m * w..][..m * w].to_vec();
                for t in 0..len {
                    let decay = c.a[kv * len + t].exp();
                    for i in 0..m {
                        for j in 0..w {
                            let vj = if j < d { c.v[(kv * len + t) * d + j] } else { 1.0 };
                            s[i * w + j] = decay * s[i * w + j] + c.k[(kv * len + t) * m + i] * vj;
                        }
                    }
                    for hq in kh * group..(kh + 1) * group {
                        let qh = b * heads + hq;
                        let qs: Vec<f64> =
                            (0..w).map(|j| (0..m).map(|i| c.q[(qh * len + t) * m + i] * s[i * w + j]).sum()).collect();
                        let den = normalize.map_or(1.0, |e| qs[d] + e);
                        for (j, x) in qs[..d].iter().enumerate() {
                            let want = x / den;
                            let have = got.out[(qh * len + t) * d + j];
                            assert!(
                                (have - want).abs() <= 1e-12 * want.abs().max(1.0),
                                "{normalize:?} {b} {hq} {t}: {have} vs {want}"
                            );
                        }
                    }
                }
                assert!(max_diff(&got.final_state[kv * m * w..][..m * w], &s) <= 1e-12, "final state");
            }
        }
    }
}

#[test]
fn no_decay_is_the_ungated_reference() {
    let mut c = Case::new(2, dims(1, 3, 3, 6), Some(1e-6));
    c.a.iter_mut().for_each(|x| *x = 0.0);
    let gated = Gated { initial: None, ..c.gated() };
    let got = forward(&gated).unwrap();
    let d = c.dims;
    let plain = ungated::Attention {
        q: &c.q,
        k: &c.k,
        v: &c.v,
        dims: ungated::Dims { batch: d.batch, heads: d.heads, len: d.len, feat: d.feat, dim: d.dim },
        causal: true,
        normalize: Some(1e-6),
    };
    let (out, _) = ungated::forward(&plain).unwrap();
    assert!(max_diff(&got.out, &out) <= 1e-13, "forward");
    let dout = Gen(7).vec(out.len());
    let (dq, dk, dv) = ungated::backward(&plain, &dout).unwrap();
    let grads = backward(&gated, &dout, None).unwrap();
    assert!(
        max_diff(&grads.dq, &dq) <= 1e-12 && max_diff(&grads.dk, &dk) <= 1e-12 && max_diff(&grads.dv, &dv) <= 1e-12
    );
}

#[test]
fn grouped_heads_are_repeated_heads_with_summed_gradients() {
    let c = Case::new(3, dims(2, 4, 2, 5), None);
    let GatedDims { batch, heads, kv_heads, len, feat: m, dim: d } = c.dims;
    let g = heads / kv_heads;
    // K, V, a and S₀ repeated to every query head
    let rep = |x: &[f64], per: usize| -> Vec<f64> {
        let mut out = Vec::new();
        for b in 0..batch {
            for h in 0..heads {
                out.extend_from_slice(&x[(b * kv_heads + h / g) * per..][..per]);
            }
        }
        out
    };
    let (k, v, a, s0) = (rep(&c.k, len * m), rep(&c.v, len * d), rep(&c.a, len), rep(&c.s0, m * d));
    let full = Gated {
        k: &k,
        v: &v,
        decay: Decay::PerStep(&a),
        initial: Some(&s0),
        dims: GatedDims { kv_heads: heads, ..c.dims },
        ..c.gated()
    };
    let (got, want) = (forward(&c.gated()).unwrap(), forward(&full).unwrap());
    assert!(max_diff(&got.out, &want.out) <= 1e-14);
    let dout = Gen(9).vec(got.out.len());
    let (gg, gf) = (backward(&c.gated(), &dout, None).unwrap(), backward(&full, &dout, None).unwrap());
    assert!(max_diff(&gg.dq, &gf.dq) <= 1e-13);
    // the grouped gradients are the repeated ones summed over each group
    let sum = |x: &[f64], per: usize| -> Vec<f64> {
        let mut out = vec![0.0; batch * kv_heads * per];
        for b in 0..batch {
            for h in 0..heads {
                for (i, y) in x[(b * heads + h) * per..][..per].iter().enumerate() {
                    out[(b * kv_heads + h / g) * per + i] += y;
                }
            }
        }
        out
    };
    assert!(max_diff(&gg.dk, &sum(&gf.dk, len * m)) <= 1e-13);
    assert!(max_diff(&gg.dv, &sum(&gf.dv, len * d)) <= 1e-13);
    assert!(max_diff(&gg.da, &sum(&gf.da, len)) <= 1e-13);
    assert!(max_diff(&gg.d_initial, &sum(&gf.d_initial, m * d)) <= 1e-13);
}

/// `Σ out ⊙ dout + Σ S_{L−1} ⊙ dS` of the case with one input perturbed.
fn loss(c: &Case, per_head: Option<&[f64]>, dout: &[f64], dsf: &[f64]) -> f64 {
    let decay = per_head.map_or(Decay::PerStep(&c.a), Decay::PerHead);
    let o = forward(&Gated { decay, ..c.gated() }).unwrap();
    o.out.iter().zip(dout).map(|(x, y)| x * y).sum::<f64>()
        + o.final_state.iter().zip(dsf).map(|(x, y)| x * y).sum::<f64>()
}

#[test]
fn every_gradient_matches_central_differences() {
    // central differences with step h: truncation O(h²·|f'''|) and cancellation
    // O(ε·|f|/h); with h = 1e-5, |f| ≲ 10: both ≲ 1e-9, asserted within 1e-7 (absolute,
    // gradients of order 1)
    let h = 1e-5;
    for normalize in [None, Some(1e-6)] {
        let c = Case::new(4, dims(1, 2, 1, 5), normalize);
        let mut g = Gen(11);
        let dout = g.vec(c.q.len() / c.dims.feat * c.dims.dim);
        let w = c.dims.dim + usize::from(normalize.is_some());
        let dsf = g.vec(c.dims.batch * c.dims.kv_heads * c.dims.feat * w);
        let grads = backward(&c.gated(), &dout, Some(&dsf)).unwrap();
        let fd = |f: &dyn Fn(&mut Case, f64)| -> f64 {
            let (mut plus, mut minus) = (Case::new(4, c.dims, normalize), Case::new(4, c.dims, normalize));
            f(&mut plus, h);
            f(&mut minus, -h);
            (loss(&plus, None, &dout, &dsf) - loss(&minus, None, &dout, &dsf)) / (2.0 * h)
        };
        let check = |what: &str, i: usize, analytic: f64, numeric: f64| {
            assert!((analytic - numeric).abs() <= 1e-7, "{normalize:?} {what}[{i}]: {analytic} vs {numeric}");
        };
        for i in 0..c.q.len() {
            check("dq", i, grads.dq[i], fd(&|x: &mut Case, e| x.q[i] += e));
        }
        for i in 0..c.k.len() {
            check("dk", i, grads.dk[i], fd(&|x: &mut Case, e| x.k[i] += e));
        }
        for i in 0..c.v.len() {
            check("dv", i, grads.dv[i], fd(&|x: &mut Case, e| x.v[i] += e));
        }
        for i in 0..c.a.len() {
            check("da", i, grads.da[i], fd(&|x: &mut Case, e| x.a[i] += e));
        }
        for i in 0..c.s0.len() {
            check("dS0", i, grads.d_initial[i], fd(&|x: &mut Case, e| x.s0[i] += e));
        }
        // a per-head rate: its gradient is the per-step gradients summed
        let rate = [-0.3];
        let per = backward(&Gated { decay: Decay::PerHead(&rate), ..c.gated() }, &dout, Some(&dsf)).unwrap();
        let numeric = (loss(&c, Some(&[-0.3 + h]), &dout, &dsf) - loss(&c, Some(&[-0.3 - h]), &dout, &dsf)) / (2.0 * h);
        check("da per head", 0, per.da[0], numeric);
    }
}

#[test]
fn minus_infinity_resets_the_state_without_nan() {
    let mut c = Case::new(5, dims(1, 2, 2, 8), Some(1e-6));
    let r = 3;
    for kh in 0..2 {
        c.a[kh * 8 + r] = f64::NEG_INFINITY;
    }
    let got = forward(&c.gated()).unwrap();
    assert!(got.out.iter().chain(&got.final_state).all(|x| x.is_finite()));
    // rows r.. equal the suffix run from a zero state
    let GatedDims { heads, len, feat: m, dim: d, .. } = c.dims;
    let suffix = |x: &[f64], per: usize| -> Vec<f64> {
        (0..heads).flat_map(|h| x[(h * len + r) * per..][..(len - r) * per].to_vec()).collect()
    };
    let (q, k, v, a) = (suffix(&c.q, m), suffix(&c.k, m), suffix(&c.v, d), suffix(&c.a, 1));
    let mut a = a;
    for kh in 0..2 {
        a[kh * (len - r)] = 0.0; // the reset step itself decays a zero state
    }
    let tail = Gated {
        q: &q,
        k: &k,
        v: &v,
        decay: Decay::PerStep(&a),
        dims: GatedDims { len: len - r, ..c.dims },
        normalize: c.normalize,
        initial: None,
    };
    let want = forward(&tail).unwrap();
    assert!(max_diff(&suffix(&got.out, d), &want.out) <= 1e-13);
    let dout = Gen(13).vec(got.out.len());
    let grads = backward(&c.gated(), &dout, None).unwrap();
    for x in [&grads.dq, &grads.dk, &grads.dv, &grads.da, &grads.d_initial] {
        assert!(x.iter().all(|v| v.is_finite()), "a gradient is not finite");
    }
    // nothing before the reset reaches the rows after it: S₀'s gradient comes from rows < r
    assert_eq!(grads.da[r], 0.0, "the reset step's own gradient (every weight across it is 0)");
}

#[test]
fn bad_input_is_an_error() {
    let c = Case::new(6, dims(1, 3, 2, 4), None);
    assert!(forward(&c.gated()).is_err(), "H_kv = 2 does not divide H = 3");
    let mut c = Case::new(6, dims(1, 2, 1, 4), None);
    c.a[1] = 0.5;
    assert!(forward(&c.gated()).is_err(), "a positive log-decay");
    c.a[1] = f64::NAN;
    assert!(forward(&c.gated()).is_err(), "NaN");
    c.a[1] = 0.0;
    let short = &c.q[1..];
    assert!(forward(&Gated { q: short, ..c.gated() }).is_err(), "a short q");
}
