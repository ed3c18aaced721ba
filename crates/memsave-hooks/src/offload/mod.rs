//! Offload: saved activations kept outside the device's memory until backward, and
//! gradients kept outside it between backward passes.
mod disk;
mod file;
mod grads;

pub use disk::{DiskOffload, OffloadStats, Offloaded, DEFAULT_MAX_IN_FLIGHT_BYTES};
pub use grads::{GradOffload, GradOffloadStats, OnComplete};
