//! The saving, measured: a Linear → GELU → Linear model on Flex with a counting global
//! allocator. After the forward (the caller's input dropped, the output held), the bytes
//! still allocated are the output plus what autodiff keeps for backward. With mesa-burn's
//! ops that is the codes (1 byte per element at 8 bits) of the three tensors the backward
//! needs; with burn's ops it is those tensors in f32.
//!
//! The same for a transformer's MLP block with LayerNorm and a residual connection.
//!
//! One test in this binary: the counter is process-wide, so nothing may run beside it.
//!
//! Deliberate break (checked while writing it): the Linear state also holding its f32
//! input (`x.clone()` in `LinearState`) makes this test fail with 1 903 724 bytes kept
//! against the 589 848 of the codes (+ 11 796 allowed).
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use burn::tensor::{activation, DType, Device, Tensor};
use common::{data, tensor};

/// The system allocator, counting the bytes currently allocated.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::SeqCst);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

const B: usize = 256;
const D_IN: usize = 256;
const D_H: usize = 1024;
const D_OUT: usize = 256;

struct Model {
    l1: mesa_burn::nn::Linear,
    gelu: mesa_burn::nn::Gelu,
    l2: mesa_burn::nn::Linear,
}

impl Model {
    fn new(device: &Device) -> Self {
        use mesa_burn::nn::{GeluConfig, LinearConfig};
        Model {
            l1: LinearConfig::new(D_IN, D_H).init(device),
            gelu: GeluConfig::new().init(),
            l2: LinearConfig::new(D_H, D_OUT).init(device),
        }
    }

    fn forward_mesa(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.l1.forward(x).unwrap();
        let g = self.gelu.forward(h).unwrap();
        self.l2.forward(g).unwrap()
    }

    /// The same model with burn's ops on the same parameters.
    fn forward_burn(&self, x: Tensor<2>) -> Tensor<2> {
        let lin = |l: &mesa_burn::nn::Linear, x| {
            burn::tensor::module::linear(x, l.weight.val(), l.bias.as_ref().map(|b| b.val()))
        };
        lin(&self.l2, activation::gelu(lin(&self.l1, x)))
    }
}

/// An MLP block of a transformer: `x + Linear(GELU(Linear(LayerNorm(x))))`.
struct Block {
    ln: mesa_burn::nn::LayerNorm,
    mlp: Model,
}

impl Block {
    fn new(device: &Device) -> Self {
        use mesa_burn::nn::{GeluConfig, LayerNormConfig, LinearConfig};
        Block {
            ln: LayerNormConfig::new(D_IN).init(device),
            mlp: Model {
                l1: LinearConfig::new(D_IN, D_H).init(device),
                gelu: GeluConfig::new().init(),
                l2: LinearConfig::new(D_H, D_IN).init(device),
            },
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone() + self.mlp.forward_mesa(self.ln.forward(x).unwrap())
    }
}

/// Bytes allocated after the forward minus before it (the input made and dropped inside),
/// and the forward's output (returned so that it stays alive through the measurement).
fn kept_after_forward(model: &Model, device: &Device, mesa: bool) -> (isize, Tensor<2>) {
    let xv = data(B * D_IN, 21, -2.0, 2.0);
    let before = live();
    let y = {
        let x = tensor(&xv, [B, D_IN], DType::F32, device);
        if mesa {
            model.forward_mesa(x)
        } else {
            model.forward_burn(x)
        }
    };
    (live() - before, y)
}

#[test]
fn autodiff_keeps_the_codes_not_the_f32_inputs() {
    // The output y: [B, D_OUT] f32.
    let y_bytes = (B * D_OUT * 4) as isize;
    // What mesa-burn keeps, exactly (HostCodes::bytes): 8-bit codes of x [B, D_IN] (l1's
    // input), of h [B, D_H] (GELU's input) and of g [B, D_H] (l2's input), one byte each
    // (every count a multiple of 8, so no padding word), plus one 8-byte group (offset,
    // scale) per tensor: 65 536 + 262 144 + 262 144 + 24 = 589 848 bytes.
    let codes = (B * D_IN + 2 * B * D_H + 3 * 8) as isize;
    assert_eq!(codes, 589_848);
    // burn's ops keep x, h and g in f32: 4·(65 536 + 2·262 144) = 2 359 296 bytes.
    let f32_inputs = (4 * (B * D_IN + 2 * B * D_H)) as isize;
    // Allowance for burn's graph bookkeeping (nodes, ids, the Arc and shape vectors around
    // each saved state): 2 % of the codes (11.8 kB), far below the 1.77 MB the codes save.
    let overhead = codes / 50;

    for device in common::autodiff_devices() {
        let model = Model::new(&device);
        // warm-up: allocations made once per process (autodiff's graph server, the emulator
        // threads' scratch) happen here, not inside the measurement
        for mesa in [true, false] {
            let (_, y) = kept_after_forward(&model, &device, mesa);
            let _ = y.sum().backward();
        }

        let (kept, y) = kept_after_forward(&model, &device, true);
        let saved = kept - y_bytes;
        eprintln!(
            "mesa-burn ({:?}): {kept} bytes kept, {saved} besides the output",
            device.gradient_checkpointing_strategy()
        );
        assert!(saved >= codes, "kept {saved} bytes for backward, less than the codes ({codes}): something is missing");
        assert!(
            saved <= codes + overhead,
            "kept {saved} bytes for backward, more than the codes ({codes}) + {overhead}"
        );
        // and the backward still runs from them
        let grads = y.sum().backward();
        assert!(model.l1.weight.val().grad(&grads).is_some());
    }

    // burn's own ops, no checkpointing: the f32 inputs stay alive for backward
    let device = Device::flex().autodiff();
    let model = Model::new(&device);
    let (_, y) = kept_after_forward(&model, &device, false);
    let _ = y.sum().backward();
    let (kept, y) = kept_after_forward(&model, &device, false);
    let saved = kept - y_bytes;
    eprintln!("burn: {kept} bytes kept, {saved} besides the output");
    assert!(saved >= f32_inputs, "burn kept {saved} bytes, expected at least its f32 inputs ({f32_inputs})");
    drop(y);

    // The MLP block x + L2(GELU(L1(LN(x)))) with D_OUT = D_IN: the residual add keeps
    // nothing; LayerNorm keeps the codes of x̂ [B, D_IN] and rstd (4 bytes per row), L1 the
    // codes of LN's output [B, D_IN], GELU and L2 those of [B, D_H] each, one 8-byte group
    // per coded tensor: 2·65 536 + 2·262 144 + 4·256 + 4·8 = 656 416 bytes.
    let block_codes = (2 * B * D_IN + 2 * B * D_H + 4 * B + 4 * 8) as isize;
    assert_eq!(block_codes, 656_416);
    for device in common::autodiff_devices() {
        let block = Block::new(&device);
        let xv = data(B * D_IN, 22, -2.0, 2.0);
        let run = || {
            let before = live();
            let y = block.forward(tensor(&xv, [B, D_IN], DType::F32, &device));
            (live() - before, y)
        };
        let (_, y) = run();
        let _ = y.sum().backward();
        let (kept, y) = run();
        let saved = kept - y_bytes;
        eprintln!(
            "block ({:?}): {kept} bytes kept, {saved} besides the output",
            device.gradient_checkpointing_strategy()
        );
        assert!(saved >= block_codes, "block kept {saved} bytes, less than its codes ({block_codes})");
        assert!(
            saved <= block_codes + block_codes / 50,
            "block kept {saved} bytes, more than its codes ({block_codes}) + 2 %"
        );
        let grads = y.sum().backward();
        assert!(block.ln.gamma.val().grad(&grads).is_some());
    }
}
