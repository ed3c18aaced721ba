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
