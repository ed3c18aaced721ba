//! Offload: saved activations kept outside the device's memory until backward.
mod disk;
mod file;

pub use disk::{DiskOffload, OffloadStats, Offloaded, DEFAULT_MAX_IN_FLIGHT_BYTES};
