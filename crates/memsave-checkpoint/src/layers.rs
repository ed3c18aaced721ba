//! Layers shared between a sequential model and the checkpoints that recompute them.
use std::fmt;
use std::sync::{Arc, Mutex};
use tch::nn::Module;
use tch::Tensor;

/// A layer that checkpoint closures can own: the autograd graph may outlive a borrow of
/// the model, so each layer sits behind an `Arc`; the `Mutex` makes it shareable across
/// the threads autograd may run on (tch modules are `Send` but not `Sync`).
#[derive(Clone)]
pub(crate) struct SharedLayer(Arc<Mutex<Box<dyn Module>>>);

impl SharedLayer {
    pub(crate) fn new(module: Box<dyn Module>) -> Self {
        Self(Arc::new(Mutex::new(module)))
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let module = self.0.lock().unwrap_or_else(|p| p.into_inner());
        module.forward(x)
    }
}

impl fmt::Debug for SharedLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let module = self.0.lock().unwrap_or_else(|p| p.into_inner());
        write!(f, "{module:?}")
    }
}
