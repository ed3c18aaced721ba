//! The errors of the optimizers: each names what to fix (a parameter, a file, an option).
use std::path::PathBuf;

/// Why an optimizer call failed.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// libtorch refused an operation (a device or dtype mismatch, out of memory, ...).
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// The C++ bridge refused an operation (hook registration, freeing a gradient).
    #[error(transparent)]
    Bridge(#[from] memsave_sys::Error),
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
    /// that read it did not update the parameter.
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

/// The result of a fallible optimizer call.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;
