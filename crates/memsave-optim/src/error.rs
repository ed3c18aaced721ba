//! The errors of the optimizers: each names what to fix (a parameter, a file, an option).
use std::path::PathBuf;

/// Why an optimizer call failed.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// libtorch refused an operation (a device or dtype mismatch, ...); out of memory
    /// is [`OptimError::OutOfMemory`].
    #[error(transparent)]
    Torch(tch::TchError),
    /// The C++ bridge refused an operation (hook registration, freeing a gradient); out
    /// of memory is [`OptimError::OutOfMemory`].
    #[error(transparent)]
    Bridge(memsave_sys::Error),
    /// An allocation failed: the device, or the meter's simulated CPU limit
    /// (`memsave_meter::MemoryLimitGuard`), has no room for what the call needs.
    ///
    /// A step that fails so leaves the parameters it had not reached as they were; see
    /// [`Optimizer::f_step`](crate::Optimizer::f_step) for the one it failed on. Free
    /// memory and call it again.
    #[error("out of memory{}: {message}", parameter.map_or(String::new(), |i| format!(" updating parameter {i}")))]
    OutOfMemory {
        /// The parameter being updated, when it was in a parameter's update.
        parameter: Option<usize>,
        /// libtorch's message, its first line (what was asked for, what was free).
        message: String,
    },
    /// The GradScaler refused the step (no gradient to check, stepped twice, ...).
    #[error(transparent)]
    Scaler(#[from] memsave_amp::AmpError),
    /// A parameter cannot be optimized as given.
    #[error("parameter {index} (shape {shape:?}): {reason}")]
    Parameter {
        /// Position of the parameter across all groups, in the order they were added.
        index: usize,
        /// Its shape, to tell which one it is.
        shape: Vec<i64>,
        /// What is wrong with it.
        reason: String,
    },
    /// A saved state does not fit this optimizer.
    #[error("the saved state does not fit this optimizer: {0}")]
    StateMismatch(String),
    /// An option is out of its range or two options contradict each other.
    #[error("invalid optimizer configuration: {0}")]
    Config(String),
    /// The step cannot be fused into backward with these settings.
    #[error("cannot step in backward: {0}")]
    InBackward(String),
    /// Reading or writing a state file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A state file of [`crate::Placement::Disk`] is not what the optimizer wrote: it
    /// is shorter or longer, or its CRC-32 differs (a byte changed on disk). The step
    /// that read it did not update the parameter. Also a file of
    /// [`Optimizer::save`](crate::Optimizer::save) holding a tensor whose bytes do not
    /// match their CRC-32: [`Optimizer::load`](crate::Optimizer::load) loaded nothing.
    #[error("{}: {reason}", path.display())]
    StateFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A state file is not valid JSON of a saved state.
    #[error("{}: not a saved optimizer state: {source}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        source: serde_json::Error,
    },
}

impl OptimError {
    /// True for [`OptimError::OutOfMemory`]: the call failed for want of memory, and
    /// may succeed with more.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, OptimError::OutOfMemory { .. })
    }

    /// `e` as [`OptimError::OutOfMemory`] when it is libtorch's out-of-memory error
    /// (the simulated one included), at `parameter`; `None` otherwise.
    pub(crate) fn torch_out_of_memory(e: &tch::TchError, parameter: Option<usize>) -> Option<Self> {
        match e {
            tch::TchError::Torch(message) => Self::out_of_memory(message, parameter),
            other => Self::out_of_memory(&other.to_string(), parameter),
        }
    }

    /// An [`OptimError::OutOfMemory`] that names no parameter, naming `index`.
    pub(crate) fn in_parameter(self, index: usize) -> Self {
        match self {
            OptimError::OutOfMemory {
                parameter: None,
                message,
            } => OptimError::OutOfMemory {
                parameter: Some(index),
                message,
            },
            other => other,
        }
    }

    fn out_of_memory(message: &str, parameter: Option<usize>) -> Option<Self> {
        memsave_sys::Error::new(message)
            .is_out_of_memory()
            .then(|| OptimError::OutOfMemory {
                parameter,
                message: first_line(message),
            })
    }
}

/// The first line of libtorch's message: the rest is a C++ backtrace.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim_end().to_owned()
}

impl From<tch::TchError> for OptimError {
    fn from(e: tch::TchError) -> Self {
        Self::torch_out_of_memory(&e, None).unwrap_or(OptimError::Torch(e))
    }
}

impl From<memsave_sys::Error> for OptimError {
    fn from(e: memsave_sys::Error) -> Self {
        Self::out_of_memory(e.message(), None).unwrap_or(OptimError::Bridge(e))
    }
}

/// The result of a fallible optimizer call.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;
