//! Process-wide counters of the copy-on-write helpers: how often they mutated in place,
//! how often they copied, and the bytes the in-place updates did not allocate.
use memsave_meter::Bytes;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

static IN_PLACE: AtomicU64 = AtomicU64::new(0);
static COPIED: AtomicU64 = AtomicU64::new(0);
static BYTES_SAVED: AtomicU64 = AtomicU64::new(0);

/// A snapshot of the counters; see [`stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InplaceStats {
    /// Calls that updated their tensor in place.
    pub in_place: u64,
    /// Calls that computed out of place because the tensor was shared or unsuitable.
    pub copied: u64,
    /// Bytes the in-place updates did not allocate: the size of each mutated tensor.
    pub bytes_saved: u64,
}

impl InplaceStats {
    /// The counts accumulated since `earlier` (a snapshot taken before).
    pub fn since(&self, earlier: &InplaceStats) -> InplaceStats {
        InplaceStats {
            in_place: self.in_place.saturating_sub(earlier.in_place),
            copied: self.copied.saturating_sub(earlier.copied),
            bytes_saved: self.bytes_saved.saturating_sub(earlier.bytes_saved),
        }
    }
}

impl fmt::Display for InplaceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in place, {} copied, {} not allocated",
            self.in_place,
            self.copied,
            Bytes(self.bytes_saved)
        )
    }
}

/// The counters now. They are process-wide: other threads' calls count too.
pub fn stats() -> InplaceStats {
    InplaceStats {
        in_place: IN_PLACE.load(Ordering::Relaxed),
        copied: COPIED.load(Ordering::Relaxed),
        bytes_saved: BYTES_SAVED.load(Ordering::Relaxed),
    }
}

/// Sets every counter to zero.
pub fn reset_stats() {
    IN_PLACE.store(0, Ordering::Relaxed);
    COPIED.store(0, Ordering::Relaxed);
    BYTES_SAVED.store(0, Ordering::Relaxed);
}

pub(crate) fn record_in_place(bytes: u64) {
    IN_PLACE.fetch_add(1, Ordering::Relaxed);
    BYTES_SAVED.fetch_add(bytes, Ordering::Relaxed);
}

pub(crate) fn record_copied() {
    COPIED.fetch_add(1, Ordering::Relaxed);
}
