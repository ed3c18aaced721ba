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

/// What a callback that libtorch runs (a saved-tensor hook's pack or unpack, a
/// post-accumulate-grad hook) returns when it fails: any error, boxed. `String`, `&str`
/// and every `std::error::Error + Send + Sync` convert into it (with `?` or `.into()`).
///
/// The error crosses into C++ as text only: autograd's `backward` then fails with
/// [`callback_message`]'s one line, the error and the causes its text leaves out.
pub type CallbackError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The text a failed callback hands to libtorch: the error's message, followed by
/// each cause in its [`source`](std::error::Error::source) chain that the text does
/// not already include (`: cause`), so nothing is lost and nothing said twice.
pub fn callback_message(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_owned()
    }
}

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

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Failed(&'static str, #[source] Option<Box<Failed>>);

    #[test]
    fn a_callback_s_message_adds_the_causes_its_text_leaves_out_once_each() {
        let plain: CallbackError = "no space left".into();
        assert_eq!(callback_message(&*plain), "no space left");
        let chained = Failed(
            "writing the gradient of parameter 3",
            Some(Box::new(Failed(
                "disk full",
                Some(Box::new(Failed("errno 28", None))),
            ))),
        );
        assert_eq!(
            callback_message(&chained),
            "writing the gradient of parameter 3: disk full: errno 28"
        );
        // A cause the text already quotes is not repeated.
        let quoted = Failed(
            "offload: disk full",
            Some(Box::new(Failed("disk full", None))),
        );
        assert_eq!(callback_message(&quoted), "offload: disk full");
    }

    #[test]
    fn panic_payloads_of_literals_and_formatted_messages_are_their_text() {
        let literal = std::panic::catch_unwind(|| panic!("boom")).unwrap_err();
        assert_eq!(panic_message(&*literal), "boom");
        let n = 3;
        let formatted = std::panic::catch_unwind(|| panic!("boom {n}")).unwrap_err();
        assert_eq!(panic_message(&*formatted), "boom 3");
        let other = std::panic::catch_unwind(|| std::panic::panic_any(7u8)).unwrap_err();
        assert_eq!(panic_message(&*other), "unknown panic payload");
    }

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
