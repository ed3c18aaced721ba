//! `PassThrough`: which saved tensors a packing hook leaves alone because they stay
//! alive anyway.
use std::collections::HashSet;
use std::sync::Arc;
use tch::Tensor;

/// The saved tensors that compression and offload hooks keep as they are.
///
/// Packing a tensor saves memory only when the pack holds the last reference to its
/// data. A parameter stays alive for the whole training run, and a tensor the caller
/// still holds (the batch, say) stays alive until the caller drops it; compressing or
/// offloading either would *add* the packed copy's bytes (PyTorch's `save_on_cpu`
/// copies the weights too). So these are passed through untouched:
///
/// - **parameters**: leaves that require grad (`nn::VarStore` variables), and views
///   of them (a linear layer saves its weight as `weight.t()`, a view that is not a
///   leaf itself);
/// - **the excluded tensors**: every tensor whose data pointer is one of those given
///   to [`excluding`](Self::excluding) (the batch you hold, say);
/// - **empty tensors**, which hold no bytes.
///
/// Trap: "still held" cannot be seen from inside a hook (at pack time the forward
/// itself still holds every activation), so a tensor you keep past the forward is
/// packed unless you exclude it. A view at an offset into an excluded tensor has its
/// own data pointer and is packed.
#[derive(Debug, Clone, Default)]
pub struct PassThrough {
    excluded: Arc<HashSet<usize>>,
}

impl PassThrough {
    /// Parameters only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also passes through tensors sharing data with `tensors` (parameters, inputs you
    /// hold).
    pub fn excluding(mut self, tensors: &[Tensor]) -> Self {
        let excluded = Arc::make_mut(&mut self.excluded);
        for t in tensors.iter().filter(|t| t.numel() > 0) {
            excluded.insert(t.data_ptr() as usize);
        }
        self
    }

    /// True when `tensor` is left as it is; `Err` when libtorch cannot tell whether it
    /// is a view.
    pub fn contains(&self, tensor: &Tensor) -> Result<bool, memsave_sys::Error> {
        Ok(tensor.numel() == 0 || self.is_excluded(tensor) || self.is_parameter(tensor)?)
    }

    /// A parameter (a leaf that requires grad) or a view of one.
    pub(crate) fn is_parameter(&self, tensor: &Tensor) -> Result<bool, memsave_sys::Error> {
        Ok((tensor.is_leaf() && tensor.requires_grad())
            || memsave_sys::tensor::is_view_of_grad_leaf(tensor)?)
    }

    /// Shares its data pointer with an excluded tensor.
    pub(crate) fn is_excluded(&self, tensor: &Tensor) -> bool {
        tensor.numel() > 0 && self.excluded.contains(&(tensor.data_ptr() as usize))
    }
}
