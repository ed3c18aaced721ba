//! memsave: utilities that cut the memory of training with tch-rs, each measured to the
//! byte.
//!
//! This facade re-exports the individual crates:
//! - [`meter`]: `memory_allocated`, peaks, scopes with marks, summaries, leak detection.
//! - [`sys`]: the C++ bridge (counting allocator, tensor introspection, autocast state,
//!   the custom autograd node behind checkpointing).
//!
//! ```
//! use memsave::meter::{measure, Bytes};
//! use tch::{Device, Kind, Tensor};
//!
//! let (_, m) = measure(Device::Cpu, |_| Tensor::zeros([256, 256], (Kind::Float, Device::Cpu)));
//! assert_eq!(m.retained_bytes(), 262_144);
//! assert_eq!(Bytes(m.retained_bytes() as u64).to_string(), "256.00 KiB");
//! ```
#![forbid(unsafe_code)]

pub use memsave_meter as meter;
pub use memsave_sys as sys;
