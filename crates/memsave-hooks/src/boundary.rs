//! The built-in stores as levers of `memsave-checkpoint`'s budget planner: a
//! checkpoint's input kept on disk or compressed until its recompute.
use crate::compress::{Compress, Compressed};
use crate::error::HooksError;
use crate::offload::{DiskOffload, Offloaded};
use crate::scope::SavedTensorHooks;
use memsave_checkpoint::{BoundaryStore, StoreError, Stored};
use tch::Tensor;

/// What `store` (named so) kept in `stored`; [`HooksError::Foreign`] when another
/// store made it.
fn downcast<'a, T: 'static>(stored: &'a Stored, store: &'static str) -> Result<&'a T, HooksError> {
    stored
        .downcast_ref::<T>()
        .ok_or(HooksError::Foreign { store })
}

/// Disk offload as a lever: the boundary is written before `store` returns (so the
/// planner's measured cost is what the forward pays), read back for the recompute;
/// bitwise lossless. Build the `DiskOffload` with `prefetch(0)` for a lever: a
/// read-ahead brings the next boundary back before its recompute, which the plan does
/// not count. A write that fails keeps the tensor in memory (nothing is lost; the
/// store's [`stats`](DiskOffload::stats) count it in `kept_in_memory`).
impl BoundaryStore for DiskOffload {
    fn name(&self) -> String {
        format!("offload to disk ({})", self.dir().display())
    }

    fn is_lossless(&self) -> bool {
        true
    }

    fn store(&self, boundary: &Tensor) -> Result<Stored, StoreError> {
        let packed = self.pack(boundary)?;
        // A failed write keeps the tensor in memory; the stats say so.
        let _ = self.flush();
        Ok(Box::new(packed))
    }

    fn restore(&self, stored: &Stored) -> Result<Tensor, StoreError> {
        let packed = downcast::<Offloaded>(stored, "offload to disk")?;
        self.unpack(packed)
    }

    fn resident_bytes(&self, stored: &Stored) -> Option<u64> {
        stored
            .downcast_ref::<Offloaded>()
            .map(Offloaded::resident_bytes)
    }
}

/// Compression as a lever: the boundary kept in the codec's form, decoded for the
/// recompute. Lossy: the recompute runs on the decoded values, so gradients change
/// within the codec's error.
impl BoundaryStore for Compress {
    fn name(&self) -> String {
        format!("compress to {}", self.codec().name())
    }

    fn is_lossless(&self) -> bool {
        false
    }

    fn store(&self, boundary: &Tensor) -> Result<Stored, StoreError> {
        Ok(Box::new(self.pack(boundary)?))
    }

    fn restore(&self, stored: &Stored) -> Result<Tensor, StoreError> {
        let packed = downcast::<Compressed>(stored, "compress")?;
        self.unpack(packed)
    }

    fn resident_bytes(&self, stored: &Stored) -> Option<u64> {
        stored.downcast_ref::<Compressed>().map(|c| match c {
            Compressed::Kept(t) => memsave_sys::tensor::nbytes(t),
            Compressed::Encoded(e) => e.stored_bytes(),
        })
    }
}
