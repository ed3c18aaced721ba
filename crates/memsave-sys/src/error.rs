use std::ffi::CStr;

/// An error reported by libtorch or by the bridge, with libtorch's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    message: String,
}

impl Error {
    /// An error with the given message.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }

    /// The message, as libtorch or the bridge wrote it.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// True when libtorch reported an out-of-memory error (also the simulated one).
    pub fn is_out_of_memory(&self) -> bool {
        is_out_of_memory_message(&self.message)
    }
}

/// True when `message` is one of libtorch's out-of-memory errors: CUDA's caching
/// allocator ("CUDA out of memory"), the CPU allocator's ("DefaultCPUAllocator: not
/// enough memory", when the system refuses the allocation) or memsave's simulated
/// capacity ("out of memory"). Errors that only pass such a message on (e.g. a tch or
/// optimizer error wrapping libtorch's text) are recognized by their text too.
pub fn is_out_of_memory_message(message: &str) -> bool {
    message.contains("out of memory") || message.contains("not enough memory")
}

/// The result of a bridge call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// libtorch's messages give Python's calls as hints; these are the Rust ones.
const PYTHON_HINTS: &[(&str, &str)] = &[
    (
        "torch.autograd.set_detect_anomaly(True, check_nan=False)",
        "memsave_sys::tensor::set_detect_anomaly(true)",
    ),
    (
        "torch.autograd.set_detect_anomaly(True)",
        "memsave_sys::tensor::set_detect_anomaly(true)",
    ),
    (
        "retain_graph=True",
        "keep_graph = true (tch's run_backward)",
    ),
];

/// `message` with libtorch's Python hints replaced by the Rust calls that do the same
/// (`set_detect_anomaly`, `keep_graph`).
pub fn in_rust_terms(message: &str) -> String {
    PYTHON_HINTS
        .iter()
        .fold(message.to_owned(), |m, (python, rust)| {
            m.replace(python, rust)
        })
}

/// Turns a bridge status (0: success) into a `Result`, reading this thread's last error.
pub(crate) fn check(status: i32) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: ms_last_error returns a NUL-terminated string owned by this thread's
    // bridge state; it stays valid until the next bridge call on this thread, and it
    // is copied before that.
    let message = unsafe { CStr::from_ptr(crate::ffi::ms_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(Error {
        message: in_rust_terms(&message),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_s_out_of_memory_messages_are_recognized() {
        for message in [
            "DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes.",
            "CUDA out of memory. Tried to allocate 20.00 MiB",
            "memsave: out of memory: the simulated capacity of 4096 B is reached",
        ] {
            assert!(is_out_of_memory_message(message), "{message}");
            assert!(Error::new(message).is_out_of_memory(), "{message}");
        }
        assert!(!is_out_of_memory_message(
            "shape '[2, 3]' is invalid for input of size 7"
        ));
    }
}
