//! [`StepError`]: why a training step (or the building of one) failed.

/// Why a [`Trainer`](crate::Trainer) could not be built or a step failed. The variants
/// say what a caller can act on: shrink the step ([`OutOfMemory`](Self::OutOfMemory)),
/// fix the configuration ([`InvalidConfig`](Self::InvalidConfig)), or read libtorch's
/// message ([`Torch`](Self::Torch)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// The device (or memsave's simulated capacity) ran out of memory; the message is
    /// libtorch's. The gradients of the failed step are freed; the parameters are
    /// unchanged unless the optimizer had begun stepping (in backward), and then each
    /// parameter is either stepped once or not at all.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// Options that contradict each other or the model (e.g. a `GradScaler` with the
    /// optimizer stepping in backward), refused before anything ran.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// libtorch, a hook or a store failed otherwise; the message says which and why.
    #[error("{0}")]
    Torch(String),
}

impl StepError {
    /// True for [`StepError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, StepError::OutOfMemory(_))
    }

    /// Classifies a message of the step's internals: libtorch's out-of-memory errors
    /// (also the simulated capacity's) become [`StepError::OutOfMemory`].
    pub(crate) fn from_message(message: String) -> StepError {
        if message.contains("out of memory") {
            StepError::OutOfMemory(message)
        } else {
            StepError::Torch(message)
        }
    }
}

impl From<tch::TchError> for StepError {
    fn from(e: tch::TchError) -> Self {
        StepError::from_message(e.to_string())
    }
}
