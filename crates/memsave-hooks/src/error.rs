//! Errors of hook scopes, and the error type hooks return.

/// What a pack or unpack hook returns on failure; reported at the backward call that
/// needed the tensor, with the tensor's shape, dtype and producing op.
pub type HookError = Box<dyn std::error::Error + Send + Sync>;

/// Why a hook scope could not be entered or left, or a store was handed a value it
/// did not make.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HooksError {
    /// The bridge could not push or pop the frame (libtorch's message).
    #[error("saved_tensors_hooks: {0}")]
    Bridge(String),
    /// Scopes were left in another order than they were entered.
    #[error("{0}")]
    OutOfOrder(String),
    /// A store was handed a value that it did not make: a boundary another
    /// `BoundaryStore` kept, or a packed value of another type than its hooks pack (a
    /// bug in the caller, never in the data).
    #[error("{store}: the stored value was not made by this store")]
    Foreign {
        /// The store (its name, or its hooks' type).
        store: &'static str,
    },
}

impl From<memsave_sys::Error> for HooksError {
    fn from(e: memsave_sys::Error) -> Self {
        if e.message().contains("out of order") {
            HooksError::OutOfOrder(e.message().to_owned())
        } else {
            HooksError::Bridge(e.message().to_owned())
        }
    }
}

/// The cause kept by an error of this crate: any error, shared so that the error
/// stays `Clone` (a lost gradient sum is reported again at every later call).
///
/// It derefs to the cause, and is not an error itself: the `source()` of the error
/// holding it is the cause, which downcasts to its own type
/// (`e.source().and_then(|s| s.downcast_ref::<std::io::Error>())`).
#[derive(Clone)]
pub struct SharedError(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>);

impl SharedError {
    /// `e` as a shared cause.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        SharedError(std::sync::Arc::new(e))
    }
}

impl From<Box<dyn std::error::Error + Send + Sync + 'static>> for SharedError {
    fn from(e: Box<dyn std::error::Error + Send + Sync + 'static>) -> Self {
        SharedError(e.into())
    }
}

impl std::ops::Deref for SharedError {
    type Target = dyn std::error::Error + Send + Sync + 'static;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl std::fmt::Debug for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

/// Why an offload store cannot take, or did not take, saved tensors or gradients.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// The directory is missing, not a directory, or does not take files.
    #[error("offload directory {}: {reason}", dir.display())]
    Dir {
        /// The directory given.
        dir: std::path::PathBuf,
        /// What is wrong with it (the system's message).
        reason: String,
    },
    /// Writes failed; those tensors (or gradients) were kept in memory.
    #[error("offload directory {}: {count} tensor(s) could not be written and were kept in memory (the first: {first})", dir.display())]
    KeptInMemory {
        /// The store's directory.
        dir: std::path::PathBuf,
        /// Tensors kept in memory.
        count: u64,
        /// Why the first of them could not be written (naming its file).
        #[source]
        first: FileError,
    },
    /// A saved tensor's file was damaged (changed, truncated or removed) between
    /// forward and backward: the backward that needs it fails rather than compute
    /// gradients from other bytes.
    #[error("offload store file {source}; refusing to compute gradients from it")]
    Damaged {
        /// What is wrong with the file, naming it.
        #[source]
        source: FileError,
    },
    /// A parameter's gradient cannot be offloaded: it does not require grad, or
    /// already has a post-accumulate-grad hook (libtorch's message).
    #[error("parameter {index} (shape {shape:?}): {source}")]
    Param {
        /// Its index among the parameters given.
        index: usize,
        /// Its shape.
        shape: Vec<i64>,
        /// The bridge's error.
        #[source]
        source: memsave_sys::Error,
    },
    /// A parameter's offloaded gradient sum is lost: its file was damaged (changed,
    /// truncated or removed) after it was written. Reported at every later call.
    #[error("gradient sum of parameter {index} (shape {shape:?}) in {source}; the accumulated gradient is lost: rerun the accumulation with a new GradOffload")]
    GradLost {
        /// Its index among the parameters given.
        index: usize,
        /// Its shape.
        shape: Vec<i64>,
        /// What is wrong with the file, naming it.
        #[source]
        source: FileError,
    },
    /// `on_complete` returned an error for a parameter.
    #[error("parameter {index} (shape {shape:?}): on_complete failed: {source}")]
    OnComplete {
        /// Its index among the parameters given.
        index: usize,
        /// Its shape.
        shape: Vec<i64>,
        /// The error `on_complete` returned.
        #[source]
        source: SharedError,
    },
    /// libtorch failed putting a parameter's stored gradient sum back into `.grad` or
    /// freeing `.grad` (libtorch's message).
    #[error("parameter {index} (shape {shape:?}): cannot {action} its gradient: {source}")]
    Grad {
        /// Its index among the parameters given.
        index: usize,
        /// Its shape.
        shape: Vec<i64>,
        /// What was being done: `add the stored sum to`, `set`, `free`.
        action: &'static str,
        /// libtorch's error.
        #[source]
        source: SharedError,
    },
}

/// Why a store's file could not be written, or not read back as it was written.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The system or libtorch refused (creating, writing, opening or reading the file,
    /// or viewing the tensor as bytes).
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done: `create`, `write`, `open`, `read`, ...
        action: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// The system's or libtorch's error.
        #[source]
        source: SharedError,
    },
    /// The file holds another number of bytes than the tensor it was written from.
    #[error("{} was truncated or changed after it was written: {found} bytes, expected {expected}", path.display())]
    Length {
        /// The file.
        path: std::path::PathBuf,
        /// Bytes in the file.
        found: u64,
        /// Bytes of the tensor.
        expected: u64,
    },
    /// The file's bytes differ from those written (CRC-32 mismatch).
    #[error("{} was changed after it was written (checksum mismatch)", path.display())]
    Checksum {
        /// The file.
        path: std::path::PathBuf,
    },
}

impl FileError {
    /// An [`FileError::Io`] from any error.
    pub(crate) fn io(
        action: &'static str,
        path: &std::path::Path,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        FileError::Io {
            action,
            path: path.to_path_buf(),
            source: SharedError::new(source),
        }
    }
}

/// What a store's `check()` found wrong with its [`SavePolicy`](crate::SavePolicy).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Names of `keep_ops` that no saved tensor's saving op or producer matched so
    /// far: a typo, or an op this libtorch lowers to another (check after a step).
    #[error("keep_ops names op(s) that saved or produced no saved tensor so far: {}{}; names must equal a saving aten op (aten::native_layer_norm) or a producing autograd node (NativeLayerNormBackward0) as Accounting reports them", .names.join(", "), similar(.near))]
    UnseenOps {
        /// The names never seen, in the order given.
        names: Vec<String>,
        /// Saving ops and producers seen that look like one of them (sorted, at most
        /// 8): `aten::native_batch_norm` for `aten::batch_norm`, `ReluBackward0` for
        /// `relu`.
        near: Vec<String>,
    },
}

fn similar(near: &[String]) -> String {
    if near.is_empty() {
        String::new()
    } else {
        format!(" (similar names seen: {})", near.join(", "))
    }
}
