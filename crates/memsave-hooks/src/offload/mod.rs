//! Offload: saved activations kept outside the device's memory until backward, and
//! gradients kept outside it between backward passes.
mod disk;
mod file;
mod grads;

pub use disk::{DiskOffload, OffloadStats, Offloaded, DEFAULT_MAX_IN_FLIGHT_BYTES};
pub use file::{read_tensor_file, write_tensor_file};
pub use grads::{GradOffload, GradOffloadStats, OnComplete};

/// Locks `m`, going on after a panic of another holder (the data are plain counters
/// and slots, consistent between statements).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Writes that failed, their tensors kept in memory instead: counted for the stats,
/// and each reported once, by the first report after it.
#[derive(Debug, Default)]
struct WriteFailures {
    /// Every failure so far.
    total: u64,
    /// How many since the last report, and the first one's error.
    unreported: Option<(u64, crate::error::FileError)>,
}

impl WriteFailures {
    fn record(&mut self, error: crate::error::FileError) {
        self.total += 1;
        match &mut self.unreported {
            Some((count, _)) => *count += 1,
            None => self.unreported = Some((1, error)),
        }
    }

    /// The failures since the last report (how many, the first one's error), now
    /// reported.
    fn report(&mut self) -> Option<(u64, crate::error::FileError)> {
        self.unreported.take()
    }
}
