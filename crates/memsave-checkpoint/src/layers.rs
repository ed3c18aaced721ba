//! Layers shared between a sequential model and the checkpoints that recompute them.
use std::fmt;
use std::sync::{Arc, Mutex};
use tch::nn::ModuleT;
use tch::Tensor;

/// A layer that checkpoint closures can own: the autograd graph may outlive a borrow of
/// the model, so each layer sits behind an `Arc`; the `Mutex` makes it shareable across
/// the threads autograd may run on (tch modules are `Send` but not `Sync`).
#[derive(Clone)]
pub(crate) struct SharedLayer(Arc<Mutex<Box<dyn ModuleT>>>);

impl SharedLayer {
    pub(crate) fn new(module: Box<dyn ModuleT>) -> Self {
        Self(Arc::new(Mutex::new(module)))
    }

    /// The layer's forward; `train` as tch's `ModuleT::forward_t` (BatchNorm's batch
    /// statistics and dropout when true).
    pub(crate) fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let module = self.0.lock().unwrap_or_else(|p| p.into_inner());
        module.forward_t(x, train)
    }
}

impl fmt::Debug for SharedLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let module = self.0.lock().unwrap_or_else(|p| p.into_inner());
        write!(f, "{module:?}")
    }
}
