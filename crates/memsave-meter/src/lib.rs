//! An exact memory meter for tch-rs, named as PyTorch names it.
//!
//! [`memory_allocated`] tells the bytes held by live tensors on a device, the way
//! `torch.cuda.memory_allocated()` does on a GPU, and works on the CPU too: on first
//! use the meter installs a counting CPU allocator (once, thread-safely) that counts
//! every storage libtorch allocates. Views and shallow clones share storage and add 0.
//!
//! What is counted on the CPU: every tensor storage allocated through libtorch's CPU
//! allocator after installation. Not counted: tensors created before installation
//! (call [`install`] first thing in `main` to count everything), scratch memory that
//! kernels take with plain `malloc` (oneDNN/MKL workspaces), and Rust-side memory.
//!
//! ```
//! use memsave_meter::{memory_allocated, measure, Bytes};
//! use tch::{Device, Kind, Tensor};
//!
//! let dev = Device::Cpu;
//! let start = memory_allocated(dev);
//! let t = Tensor::zeros([1024, 1024], (Kind::Float, dev));
//! assert_eq!(memory_allocated(dev) - start, 4_194_304);
//! assert_eq!(Bytes(4_194_304).to_string(), "4.00 MiB");
//!
//! // A scope: start/end bytes, the peak above start, and named marks.
//! let (_, m) = measure(dev, |marks| {
//!     let y = &t + &t;
//!     marks.mark("after y");
//!     let _z = &y + &t;
//! });
//! assert_eq!(m.peak_bytes, 2 * 4_194_304);
//! assert_eq!(m.marks[0].bytes - m.start_bytes, 4_194_304);
//! assert_eq!(m.end_bytes, m.start_bytes);
//! ```
//!
//! Timing on the CPU: call [`settle_c_allocator`] once before the first timed step,
//! so that glibc's `malloc` does not time the first steps under page faults the later
//! ones do not pay.
//!
//! Like tch, every fallible call has an `f_` form that returns a [`Result`]
//! ([`f_measure`], [`f_detect_leak`], [`f_memory_allocated`], ...); the short name
//! panics with the error's message. No reading is ever made up: a device that cannot
//! be metered (CUDA on a machine without a GPU) is an error, not 0 bytes.
#![forbid(unsafe_code)]

mod bytes;
mod c_allocator;
mod leak;
mod limit;
mod scope;
mod stats;
mod summary;

pub use bytes::{format_bytes, Bytes, BytesAtLeast, ParseBytesError};
pub use c_allocator::settle_c_allocator;
pub use leak::{detect_leak, f_detect_leak, LeakReport};
pub use limit::MemoryLimitGuard;
pub use scope::{f_measure, measure, Mark, Marks, Measurement};
pub use stats::{
    empty_cache, f_empty_cache, f_live_allocations, f_max_memory_allocated, f_memory_allocated,
    f_reset_peak_memory_stats, f_set_memory_limit, install, live_allocations, max_memory_allocated,
    memory_allocated, memory_limit, reset_peak_memory_stats, set_memory_limit,
};
pub use summary::memory_summary;

/// Errors of the meter: the device is not available, or libtorch refused the request.
#[derive(Debug, thiserror::Error)]
pub enum MeterError {
    /// The device cannot be metered here (no CUDA, an index out of range, ...).
    #[error("cannot meter {device:?}: {reason}")]
    Device {
        /// The device asked for.
        device: tch::Device,
        /// Why it cannot be metered.
        reason: String,
    },
}

/// Result of a fallible meter call.
pub type Result<T, E = MeterError> = std::result::Result<T, E>;
