//! Offload: saved activations kept outside the device's memory until backward, and
//! gradients kept outside it between backward passes.
mod disk;
mod file;
mod grads;

pub use disk::{DiskOffload, OffloadStats, Offloaded, DEFAULT_MAX_IN_FLIGHT_BYTES};
pub use grads::{GradOffload, GradOffloadStats, OnComplete};

/// Locks `m`, going on after a panic of another holder (the data are plain counters
/// and slots, consistent between statements).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
