//! The C++ bridge of memsave, behind safe wrappers.
//!
//! libtorch exposes more than tch-rs wraps. This crate compiles a small C++ library
//! against the same libtorch and offers safe Rust functions over it: a counting CPU
//! allocator ([`alloc`]), accelerator statistics ([`device`]), tensor introspection
//! ([`tensor`]), device-generic autocast state ([`autocast`]) and a custom autograd
//! saved-tensor hooks that call back into Rust ([`hooks`]) and checkpointing built on them
//! ([`checkpoint`]).
//!
//! No C++ exception and no Rust panic crosses the boundary: every fallible call returns
//! [`Result`] with libtorch's message.
//!
//! ```
//! use memsave_sys::alloc;
//! alloc::install_counting_allocator().unwrap();
//! let before = alloc::allocated();
//! let t = tch::Tensor::zeros([256], (tch::Kind::Float, tch::Device::Cpu));
//! assert_eq!(alloc::allocated() - before, 1024);
//! drop(t);
//! assert_eq!(alloc::allocated(), before);
//! ```

pub mod alloc;
pub mod autocast;
pub mod checkpoint;
pub mod device;
pub mod dist;
mod error;
mod ffi;
pub mod grad_hooks;
pub mod hooks;
pub mod ops;
pub mod quant;
pub mod rng;
pub mod tensor;
pub mod version;

pub use error::{
    callback_message, in_rust_terms, is_out_of_memory_message, panic_message, CallbackError, Error,
    Result,
};
