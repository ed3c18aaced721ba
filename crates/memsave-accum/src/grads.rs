//! Freeing gradients with set-to-none semantics.
use crate::error::Result;
use tch::Tensor;

/// Drops the gradient of every tensor in `params` (PyTorch's
/// `zero_grad(set_to_none=True)`), so their memory is freed until the next backward.
///
/// tch's `Optimizer::zero_grad` only fills gradients with zeros, which keeps one
/// parameter-sized buffer per parameter alive between steps.
pub fn free_grads(params: &[Tensor]) -> Result<()> {
    for p in params {
        memsave_sys::tensor::set_grad_none(p)?;
    }
    Ok(())
}
