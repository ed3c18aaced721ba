//! The version of libtorch the bridge was compiled against.
use crate::ffi;
use std::ffi::CStr;

/// The libtorch version memsave's C++ bridge was built against: `TORCH_VERSION` from
/// `<torch/version.h>`, such as `2.13.0` (no local build tag such as `+cpu`).
///
/// ```
/// let version = memsave_sys::version::libtorch_version();
/// assert_eq!(version.split('.').count(), 3, "{version}");
/// ```
///
/// It is read from the headers at build time, so it names the libtorch whose headers
/// compiled the bridge; the shared library loaded at run time is the same one unless
/// `LD_LIBRARY_PATH` points elsewhere.
pub fn libtorch_version() -> &'static str {
    // SAFETY: `ms_libtorch_version` takes no arguments, cannot throw, and returns a
    // pointer to a NUL-terminated string literal with static storage duration.
    let version = unsafe { CStr::from_ptr(ffi::ms_libtorch_version()) };
    version.to_str().unwrap_or("unknown")
}
