//! Errors of hook scopes, and the error type hooks return.

/// What a pack or unpack hook returns on failure; reported at the backward call that
/// needed the tensor, with the tensor's shape, dtype and producing op.
pub type HookError = Box<dyn std::error::Error + Send + Sync>;

/// Why a hook scope could not be entered or left.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HooksError {
    /// The bridge could not push or pop the frame (libtorch's message).
    #[error("saved_tensors_hooks: {0}")]
    Bridge(String),
    /// Scopes were left in another order than they were entered.
    #[error("{0}")]
    OutOfOrder(String),
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

/// Why an offload store cannot take, or did not take, saved tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    /// The directory is missing, not a directory, or does not take files.
    #[error("offload directory {}: {reason}", dir.display())]
    Dir {
        /// The directory given.
        dir: std::path::PathBuf,
        /// What is wrong with it (the system's message).
        reason: String,
    },
    /// Writes failed during the forward; those tensors were kept in memory.
    #[error("offload directory {}: {count} tensor(s) could not be written and were kept in memory ({reason})", dir.display())]
    KeptInMemory {
        /// The store's directory.
        dir: std::path::PathBuf,
        /// Tensors kept in memory.
        count: u64,
        /// The first failure (the system's message, naming the file).
        reason: String,
    },
    /// A parameter's gradient cannot be offloaded (e.g. it already has a
    /// post-accumulate-grad hook, or does not require grad), its offloaded sum was
    /// lost (its file damaged), or `on_complete` failed on it.
    #[error("parameter {index} (shape {shape:?}): {reason}")]
    Param {
        /// Its index among the parameters given.
        index: usize,
        /// Its shape.
        shape: Vec<i64>,
        /// libtorch's or the check's message.
        reason: String,
    },
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
