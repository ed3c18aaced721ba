//! [`StepError`]: why a training step (or the building of one) failed.

/// Any error of a crate a step calls into, kept as the cause of a [`StepError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a [`Trainer`](crate::Trainer) could not be built or a step failed. The variants
/// say what a caller can act on: shrink the step ([`OutOfMemory`](Self::OutOfMemory)),
/// fix the configuration ([`InvalidConfig`](Self::InvalidConfig)), or read the cause
/// ([`Torch`](Self::Torch), [`Lever`](Self::Lever), [`Io`](Self::Io); each keeps the
/// error it came from as its [`source`](std::error::Error::source)).
///
/// Whatever failed for want of memory (libtorch's allocator, memsave's simulated
/// capacity, an optimizer's state) is [`OutOfMemory`](Self::OutOfMemory), whichever
/// lever it happened in.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The device (or memsave's simulated capacity) ran out of memory; the message is
    /// libtorch's. The gradients of the failed step are freed; the parameters are
    /// unchanged unless the optimizer had begun stepping (in backward), and then each
    /// parameter is either stepped once or not at all. Its text is the message, which
    /// says "out of memory" (or the system's "not enough memory") itself.
    #[error("{message}")]
    OutOfMemory {
        /// libtorch's (or the lever's) message.
        message: String,
        /// The error it came from.
        #[source]
        source: BoxError,
    },
    /// Options that contradict each other or the model (e.g. a `GradScaler` with the
    /// optimizer stepping in backward), refused before anything ran.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// libtorch failed (other than for memory); its message says why.
    #[error("{0}")]
    Torch(#[source] tch::TchError),
    /// One of memsave's levers failed: `lever` names it (`optimizer`, `offload`,
    /// `compress`, `offload_grads`, `accumulation`, `autocast`, `grad_scaler`,
    /// `checkpoint`, `meter`), `source` is that crate's error.
    #[error("{lever}: {source}")]
    Lever {
        /// The lever, as a suite names it.
        lever: &'static str,
        /// Its crate's error.
        #[source]
        source: BoxError,
    },
    /// A step whose micro-batches (or whose batch) held one example turned finite
    /// running statistics NaN or infinite: a BatchNorm got one value per
    /// channel in training (one example, a 1x1 feature map), where its unbiased
    /// variance divides by zero. PyTorch refuses that input ("Expected more than 1
    /// value per channel when training"); libtorch's kernel does not. The statistics
    /// are put back as they were before the step; the step itself ran (the gradients,
    /// and with an optimizer the parameters, are its). Use micro-batches of at least
    /// two examples. Checked only for the buffers [`Workload::buffers`](crate::Workload::buffers)
    /// lists, and only for steps with a one-example micro-batch.
    #[error(
        "{} of {micro_batch} example left {buffers} running statistic(s) NaN or \
         infinite (BatchNorm given one value per channel in training, as with a 1x1 \
         feature map; PyTorch refuses this input): they are put back as before the step; \
         {}",
        if *split { "a micro-batch" } else { "a batch" },
        if *split { "use micro-batches of at least 2 examples" } else { "the batch must have 2 or more examples" }
    )]
    NonFiniteStatistics {
        /// How many buffers turned non-finite.
        buffers: usize,
        /// Examples in the smallest micro-batch of the step (the batch's, unsplit).
        micro_batch: i64,
        /// Whether the step split its batch into micro-batches: if not, the batch
        /// itself is too small, and no split helps.
        split: bool,
    },
    /// A file or directory of the step (an offload store's) could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the path.
        what: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
}

impl StepError {
    /// True for [`StepError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, StepError::OutOfMemory { .. })
    }

    /// `source` as the failure of `lever`, or as [`StepError::OutOfMemory`] when it
    /// failed for want of memory.
    pub fn lever(lever: &'static str, source: impl Into<BoxError>) -> StepError {
        let source = source.into();
        let message = source.to_string();
        if memsave_sys::is_out_of_memory_message(&message) {
            StepError::OutOfMemory { message, source }
        } else {
            StepError::Lever { lever, source }
        }
    }

    /// An [`StepError::InvalidConfig`] with `message`.
    pub(crate) fn invalid(message: impl Into<String>) -> StepError {
        StepError::InvalidConfig(message.into())
    }
}

impl From<tch::TchError> for StepError {
    fn from(e: tch::TchError) -> Self {
        let message = e.to_string();
        if memsave_sys::is_out_of_memory_message(&message) {
            StepError::OutOfMemory {
                message,
                source: Box::new(e),
            }
        } else {
            StepError::Torch(e)
        }
    }
}
