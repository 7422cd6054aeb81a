//! A transformer encoder block (one real all-MiniLM-L6-v2 layer, batch 4 × 128 tokens of real
//! text, `fixtures/minilm_block.safetensors`) forward and backward with full-precision saved
//! activations and with every saved activation compressed to 8/4/2-bit codes (matmul inputs
//! by quantize-on-save; softmax, GELU and LayerNorm by the fused kernels, whose backward reads
//! the codes). The matmuls are a host reference (f32, f64 accumulation). The harness is the
//! compress_report example's `block` module, shared here through `#[path]`.
mod common;

#[allow(dead_code)]
#[path = "../examples/compress_report/block.rs"]
mod block;

use block::{Mode, GRAD_NAMES};

#[test]
fn block_on_compressed_activations() {
    let device = mesa_kernels::Device::emulator();
    let report = block::run(&device, &common::fixture_dir().join("minilm_block.safetensors")).expect("block");
    report.print();
    // the harness's forward reproduces the numpy forward of the fixture (float16-stored:
    // half an f16 ulp at |y| <= 16 is 2^-7)
    assert!(report.forward_max_abs_diff <= 2f64.powi(-7), "forward differs: {}", report.forward_max_abs_diff);
    // bookkeeping: f32 run = 4 bytes per saved element + the LayerNorms' f32 mean/rstd
    let numel = block::saved_numel_literal();
    assert_eq!(report.f32_bytes, 4 * numel + 2 * 2 * 512 * 4);
    assert_eq!(report.bf16_bytes, 2 * numel + 2 * 2 * 512 * 4);
    for r in &report.runs {
        let Mode::Compressed { bits, shared } = r.mode else { continue };
        for (name, a) in GRAD_NAMES.iter().zip(&r.agreement) {
            assert!(a.cosine.is_finite() && a.rel_l2.is_finite(), "{} {name}: non-finite agreement", r.mode.name());
        }
        // codes: bits/8 bytes per element plus the per-group parameters and LayerNorm stats
        let codes = if shared { numel - 512 * 384 - 512 * 1536 } else { numel } * bits as usize / 8;
        assert!(
            r.saved_bytes >= codes && r.saved_bytes <= codes + 16 * 1024,
            "{}: {} bytes",
            r.mode.name(),
            r.saved_bytes
        );
        if bits == 8 {
            // Issue target: weight-gradient cosine >= 0.999. Met by Wv, Wo, W1, W2; NOT by Wq and
            // Wk (measured 0.9960 / 0.9965): their gradients flow through dS = P ⊙ (dP − Σ dP·P),
            // and 8-bit affine codes of attention probabilities (step 1/255 against typical
            // values ~1/128 at N = 128) carry that error. Keeping P in f32 with everything else
            // at 8 bits gives 0.9997 (docs/fused.md, "Block"). Asserted at the measured level so
            // that a regression fails; the gap is reported, not hidden.
            for (name, a) in GRAD_NAMES.iter().zip(&r.agreement) {
                let floor = match *name {
                    "wq" | "wk" => 0.995,
                    "wv" | "wo" | "w1" | "w2" => 0.999,
                    _ => continue,
                };
                assert!(a.cosine >= floor, "{} {name}: cosine {} < {floor}", r.mode.name(), a.cosine);
            }
            if shared {
                assert!(r.saved_bytes * 2 <= report.bf16_bytes, "8-bit shared: more than half of bf16");
                assert!(r.saved_bytes * 4 <= report.f32_bytes, "8-bit shared: more than a quarter of f32");
            }
        }
    }
}
