//! What an optimizer shows a memory tool while it steps: each gradient it reads and
//! each parameter's state tensors while they are in memory.
use std::fmt;
use std::sync::Arc;

use tch::Tensor;

/// Shown the tensors an optimizer works with, as it works with them; set with
/// [`Optimizer::set_observer`](crate::Optimizer::set_observer). `memsave-trace` uses it
/// to tell optimizer state and gradients from temporaries.
///
/// Why a callback and not a list read after the step: the state is created lazily, in
/// a parameter's first update; with [`Placement::Disk`](crate::Placement::Disk) it is in
/// memory only during that parameter's update; and with
/// [`Optimizer::step_in_backward`](crate::Optimizer::step_in_backward) the gradient is
/// freed inside backward right after the update. None of them can be found afterwards.
///
/// Both methods run inside the step (inside backward, on its thread, for a step in
/// backward) with the optimizer borrowed: they must not call back into it. They must
/// not change the tensors either.
pub trait Observer: Send + Sync {
    /// Parameter `index`'s gradient, just before its update reads it.
    fn gradient(&self, index: usize, grad: &Tensor) {
        let _ = (index, grad);
    }

    /// Parameter `index`'s state tensors (moments, momentum; 8-bit codes and their
    /// block scales), each time they are in memory for an update: after they are
    /// created (zeros, before the first update) or fetched from where they live
    /// between steps, and again after they are put back there when that makes new
    /// tensors ([`Placement::Cpu`](crate::Placement::Cpu) with CUDA parameters).
    fn state(&self, index: usize, tensors: &[Tensor]) {
        let _ = (index, tensors);
    }
}

/// The optimizer's observer, if any (`Debug` for the optimizer's derive).
#[derive(Clone, Default)]
pub(crate) struct ObserverSlot(pub(crate) Option<Arc<dyn Observer>>);

impl fmt::Debug for ObserverSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(Observer)"
        } else {
            "None"
        })
    }
}
