//! Dropout whose mask is regenerated from a Philox key instead of kept, and replayed inside
//! checkpoint regions.
use candle_core::{ModuleT, Tensor};

use crate::attach::{attach, Backward};
use crate::layer::dropout::keyed_mask;

/// Inverted dropout: `y = x ⊙ m / (1 − p)`, `m` Bernoulli(1 − p) per element, in training;
/// the identity otherwise (Srivastava et al. 2014).
///
/// The mask comes from a 64-bit key drawn with [`crate::region::next_key`] (Philox4x32-10,
/// element `i` kept when the 24-bit uniform at counter `i` is `≥ p`, as the layer's masks:
/// [`crate::layer::dropout`]): inside a [checkpoint region](crate::region) the rerun draws
/// the same key, so the mask replays; outside, keys follow the process-wide stream
/// ([`crate::region::set_seed`]). The backward regenerates the mask from the key: the op
/// keeps 8 bytes, not the mask (candle keeps its argument `x`, as for every op).
///
/// Any float dtype; any shape and device. The mask is built in f32 (`0` or `1/(1 − p)`
/// rounded to f32) and converted to the dtype: in f64 the scale is that f32 value (for
/// `p = 0.1`, 1.1111111640930176, not 1.1111111111111112), in f16 and bf16 it is rounded
/// once more. The masks are generated on
/// the host (copied to the device for CUDA tensors).
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f32,
}

impl Dropout {
    /// Drop probability `p` in `[0, 1)` (checked at the call: [`crate::Error::InvalidArgument`]).
    #[must_use]
    pub fn new(p: f32) -> Self {
        Dropout { p }
    }

    /// The drop probability.
    #[must_use]
    pub fn p(&self) -> f32 {
        self.p
    }

    /// `x` with dropout applied when `train`, else `x` itself.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] for `p` outside `[0, 1)`; candle's errors.
    pub fn forward(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        if !train {
            return Ok(x.clone());
        }
        // checked before the key is drawn, so a bad `p` does not advance the stream
        if !(0.0..1.0).contains(&self.p) {
            let why = format!("must be in [0, 1), got {}", self.p);
            return Err(crate::Error::InvalidArgument { name: "dropout p", why }.into());
        }
        let key = crate::region::next_key();
        match self.apply(key, &x.detach())? {
            None => Ok(x.clone()),
            Some(y) => attach(&[x], super::tensor_result(&y)?, DropoutGrad { key, p: self.p }),
        }
    }

    fn apply(&self, key: u64, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        keyed_mask(key, self.p, x.dims(), x.device())?.map(|m| x.mul(&m.to_dtype(x.dtype())?)).transpose()
    }
}

impl ModuleT for Dropout {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.forward(x, train)
    }
}

struct DropoutGrad {
    key: u64,
    p: f32,
}

impl Backward for DropoutGrad {
    fn name(&self) -> &'static str {
        "mesa-dropout"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        Ok(vec![Dropout { p: self.p }.apply(self.key, grad)?])
    }
}
