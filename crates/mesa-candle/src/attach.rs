//! Carrying a result computed by our kernels into candle's autograd.
//!
//! An op here runs its forward on detached views of its arguments (so candle records
//! nothing of its internals), then hands the result to candle through a custom op whose
//! `*_fwd` only moves that storage out (no copy, no second computation) and whose `bwd` is
//! the op's own backward. Candle's `BackpropOp` keeps a clone of every argument until
//! backward (`candle-core/src/op.rs`): that is the op's arguments and nothing else.
use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor};

use crate::error::Error;

/// The backward of an op attached with [`attach`].
pub(crate) trait Backward: Send + Sync + 'static {
    /// The op's name (candle's error messages).
    fn name(&self) -> &'static str;
    /// Gradients of the arguments (in order; `None` for an argument without one) from the
    /// arguments, the forward's result and the gradient of that result.
    fn backward(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>>;
}

struct Carrier<B> {
    result: Mutex<Option<(Storage, Shape)>>,
    backward: B,
}

/// Bytes of the boxed op state `attach` leaves in candle's graph for a backward of type `B`
/// (alive until the backward has run): the host bookkeeping the planner counts per op.
pub(crate) const fn carrier_bytes<B>() -> usize {
    std::mem::size_of::<Carrier<B>>()
}

impl<B: Backward> Carrier<B> {
    fn take(&self) -> candle_core::Result<(Storage, Shape)> {
        let mut slot = self.result.lock().map_err(|_| Error::StateConsumed { op: self.backward.name() })?;
        slot.take().ok_or_else(|| Error::StateConsumed { op: self.backward.name() }.into())
    }

    fn take_cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            (other, _) => Err(Error::UnsupportedDevice {
                op: self.backward.name(),
                device: format!("{:?}", other.device().location()),
            }
            .into()),
        }
    }

    #[cfg(feature = "cuda")]
    fn take_cuda(&self) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        match self.take()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            (other, _) => Err(Error::UnsupportedDevice {
                op: self.backward.name(),
                device: format!("{:?}", other.device().location()),
            }
            .into()),
        }
    }

    fn grads<const N: usize>(
        &self,
        args: [&Tensor; N],
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; N]> {
        let mut grads = self.backward.backward(&args, res, grad)?.into_iter();
        Ok(std::array::from_fn(|_| grads.next().flatten()))
    }
}

impl<B: Backward> CustomOp1 for Carrier<B> {
    fn name(&self) -> &'static str {
        self.backward.name()
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.take_cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.take_cuda()
    }
    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let [g] = self.grads([arg], res, grad)?;
        Ok(g)
    }
}

impl<B: Backward> CustomOp2 for Carrier<B> {
    fn name(&self) -> &'static str {
        self.backward.name()
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.take_cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.take_cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [ga, gb] = self.grads([a, b], res, grad)?;
        Ok((ga, gb))
    }
}

impl<B: Backward> CustomOp3 for Carrier<B> {
    fn name(&self) -> &'static str {
        self.backward.name()
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.take_cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.take_cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [ga, gb, gc] = self.grads([a, b, c], res, grad)?;
        Ok((ga, gb, gc))
    }
}

/// `result` (computed from detached `args`) as a node of candle's graph over `args`, whose
/// gradient is `backward`'s. One to three arguments.
pub(crate) fn attach<B: Backward>(
    args: &[&Tensor],
    result: (Storage, Shape),
    backward: B,
) -> candle_core::Result<Tensor> {
    let carrier = Carrier { result: Mutex::new(Some(result)), backward };
    match *args {
        [a] => a.apply_op1(carrier),
        [a, b] => a.apply_op2(b, carrier),
        [a, b, c] => a.apply_op3(b, c, carrier),
        _ => Err(Error::InvalidArgument { name: "args", why: format!("{} arguments (1 to 3)", args.len()) }.into()),
    }
}
