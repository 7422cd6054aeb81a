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
    let device = common::emulator();
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
            // Issue target: every parameter's gradient cosine >= 0.999 at 8 bits — met (min
            // 0.99959, W1) since P is saved as square-root companded codes (SoftmaxCodes::Sqrt):
            // Wq 0.99962, Wk 0.99963 (linear [0, 1] codes: 0.99596 / 0.99650; docs/fused.md,
            // "Block"). bk is excluded: its true gradient is 0 (softmax shift invariance), so its
            // reference is rounding noise.
            for (name, a) in GRAD_NAMES.iter().zip(&r.agreement) {
                if *name == "bk" || *name == "input" {
                    continue;
                }
                assert!(a.cosine >= 0.999, "{} {name}: cosine {} < 0.999", r.mode.name(), a.cosine);
            }
            if shared {
                assert!(r.saved_bytes * 2 <= report.bf16_bytes, "8-bit shared: more than half of bf16");
                assert!(r.saved_bytes * 4 <= report.f32_bytes, "8-bit shared: more than a quarter of f32");
            }
        }
        if bits == 4 {
            // regression floor at the measured level of companded P (Wq 0.8846, Wk 0.8768;
            // linear [0, 1] codes gave 0.621 / 0.656)
            for (name, a) in GRAD_NAMES.iter().zip(&r.agreement) {
                if matches!(*name, "wq" | "wk") {
                    assert!(a.cosine >= 0.85, "{} {name}: cosine {} < 0.85", r.mode.name(), a.cosine);
                }
            }
        }
    }
}
