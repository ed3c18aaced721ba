//! Levers beyond recomputation: keep a checkpoint's input (a layer boundary) elsewhere or
//! smaller between the forward and the recompute.
//!
//! Every checkpoint keeps its input for the whole backward: that is the floor of
//! recomputation alone. A [`BoundaryStore`] can hold that input instead, in a file, in
//! host memory or compressed, and give it back to the recompute. The budget solver then
//! chooses, per boundary, keep or store (and with which store) from costs measured once
//! on the real boundaries ([`LeverProfile`]), and `CheckpointedSequential::explain` says
//! what it chose. `memsave-hooks` implements the trait for its disk offload and its
//! compression codecs.
use crate::error::{catching_panics, CheckpointError, Result};
use crate::layers::SharedLayer;
use memsave_meter::measure;
use memsave_sys::hooks::{Packed, RawHooks};
use memsave_sys::CallbackError;
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tch::Tensor;

/// What a store keeps in place of a boundary tensor.
pub type Stored = Box<dyn Any + Send>;

/// Why a store could not keep or give back a boundary: any error, boxed (`String`,
/// `&str` and every `std::error::Error + Send + Sync` convert into it with `?` or
/// `.into()`). A failure in the forward or the recompute fails the step with its
/// text and causes ([`memsave_sys::callback_message`]).
pub type StoreError = memsave_sys::CallbackError;

/// Somewhere a checkpoint's input can wait for the recompute: a file, host memory, a
/// compressed copy.
///
/// - `store` runs in the forward, on the forward's thread, with grad mode off, when the
///   checkpoint starts; once it returns, the checkpoint no longer holds the tensor, so its
///   memory is freed when nothing else holds it. The bytes the stored form keeps in
///   memory are measured, not declared: a store that writes in the background should
///   finish the write before returning, or the measured cost (and the planned peak) will
///   be wrong.
/// - `restore` runs in backward when the recompute starts, on whichever thread runs it,
///   possibly several times for one stored value (`keep_graph`): it must not consume it.
///   It returns a tensor of the stored shape and dtype; a lossless store returns the same
///   bits, so gradients stay bitwise equal.
/// - The stored value is dropped when the autograd graph is freed.
pub trait BoundaryStore: Send + Sync + 'static {
    /// A short name for `explain` ("offload to disk", "int8").
    fn name(&self) -> String;
    /// True when `restore` gives back exactly the bits that were stored.
    fn is_lossless(&self) -> bool;
    /// Keeps `boundary` (or what rebuilds it); `Err` says why it could not.
    fn store(&self, boundary: &Tensor) -> std::result::Result<Stored, StoreError>;
    /// Rebuilds the tensor from what [`store`](Self::store) kept.
    fn restore(&self, stored: &Stored) -> std::result::Result<Tensor, StoreError>;
    /// Bytes `stored` keeps in memory, when the store can tell (for
    /// [`LeverStats::resident_bytes`]); `None` by default.
    fn resident_bytes(&self, stored: &Stored) -> Option<u64> {
        let _ = stored;
        None
    }
}

/// What one store took from the forwards so far (not the profile's calibration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeverStats {
    /// The store's [`name`](BoundaryStore::name).
    pub name: String,
    /// The store's [`is_lossless`](BoundaryStore::is_lossless).
    pub lossless: bool,
    /// Boundaries stored.
    pub tensors: u64,
    /// Their bytes as they were.
    pub bytes: u64,
    /// Bytes their stored forms kept in memory, if the store tells
    /// ([`BoundaryStore::resident_bytes`]).
    pub resident_bytes: Option<u64>,
}

#[derive(Default)]
struct Counters {
    tensors: AtomicU64,
    bytes: AtomicU64,
    resident_bytes: AtomicU64,
    resident_unknown: AtomicBool,
}

/// What storing one boundary with one store costs, measured on the boundary itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundaryCost {
    /// Bytes the stored form keeps in memory (0 for a file, the compressed size for a
    /// codec).
    pub resident_bytes: u64,
    /// Peak of `store` above its start, the stored form included (the boundary itself,
    /// alive during the store, is not counted).
    pub store_peak_bytes: u64,
    /// Peak of `restore` above its start, the restored tensor included.
    pub restore_peak_bytes: u64,
    /// Seconds of `store`.
    pub store_time_s: f64,
    /// Seconds of `restore`.
    pub restore_time_s: f64,
}

/// A store's measured costs at each boundary of a chain.
#[derive(Debug, Clone, PartialEq)]
pub struct LeverProfile {
    /// The store's [`name`](BoundaryStore::name).
    pub name: String,
    /// The store's [`is_lossless`](BoundaryStore::is_lossless).
    pub lossless: bool,
    /// `boundaries[l]`: the cost of storing layer `l`'s input, `None` where it cannot be
    /// stored with gain: the chain's input (the caller holds it) and the output of a
    /// layer that saves its own output for backward (that copy stays anyway).
    pub boundaries: Vec<Option<BoundaryCost>>,
}

/// A boundary store as the chain uses it, counting what the forwards hand it.
#[derive(Clone)]
pub(crate) struct Lever(pub(crate) Arc<dyn BoundaryStore>, Arc<Counters>);

impl Lever {
    pub(crate) fn new(store: Arc<dyn BoundaryStore>) -> Self {
        Self(store, Arc::default())
    }

    pub(crate) fn stats(&self) -> LeverStats {
        let c = &self.1;
        LeverStats {
            name: self.0.name(),
            lossless: self.0.is_lossless(),
            tensors: c.tensors.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            resident_bytes: (!c.resident_unknown.load(Ordering::Relaxed))
                .then(|| c.resident_bytes.load(Ordering::Relaxed)),
        }
    }
}

impl RawHooks for Lever {
    fn pack(
        &self,
        tensor: &Tensor,
        _saved_by: Option<&str>,
    ) -> std::result::Result<Packed, CallbackError> {
        let stored = self.0.store(tensor)?;
        let c = &self.1;
        c.tensors.fetch_add(1, Ordering::Relaxed);
        let bytes = memsave_sys::tensor::nbytes(tensor);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        match self.0.resident_bytes(&stored) {
            Some(b) => {
                c.resident_bytes.fetch_add(b, Ordering::Relaxed);
            }
            None => c.resident_unknown.store(true, Ordering::Relaxed),
        }
        Ok(stored)
    }

    fn unpack(&self, packed: &Packed) -> std::result::Result<Tensor, CallbackError> {
        self.0.restore(packed)
    }
}

fn min_time<T>(runs: usize, mut f: impl FnMut() -> T) -> (T, f64) {
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let out = f();
        best = best.min(start.elapsed().as_secs_f64());
        last = Some(out);
    }
    (last.expect("at least one run"), best)
}

/// Measures `store` on one boundary tensor: store and restore, twice each for the time.
fn measure_store(store: &dyn BoundaryStore, x: &Tensor) -> Result<BoundaryCost> {
    let device = x.device();
    let fail = |what: &str, e: StoreError| {
        CheckpointError::Torch(format!(
            "calibrating the boundary store {:?}: {what} failed: {}",
            store.name(),
            memsave_sys::callback_message(&*e)
        ))
    };
    let (stored, store_time_s) = min_time(2, || tch::no_grad(|| store.store(x)));
    drop(stored);
    let (stored, stored_m) = measure(device, |_| tch::no_grad(|| store.store(x)));
    let stored = stored.map_err(|e| fail("store", e))?;
    let (restored, restore_time_s) = min_time(2, || tch::no_grad(|| store.restore(&stored)));
    drop(restored);
    let (restored, restored_m) = measure(device, |_| tch::no_grad(|| store.restore(&stored)));
    drop(restored.map_err(|e| fail("restore", e))?);
    Ok(BoundaryCost {
        resident_bytes: stored_m.retained_bytes().max(0) as u64,
        store_peak_bytes: stored_m.peak_bytes,
        restore_peak_bytes: restored_m.peak_bytes,
        store_time_s,
        restore_time_s,
    })
}

/// Runs the chain without grad on `example` and measures every store on every boundary
/// a checkpoint can start at (layers `1..len`), skipping outputs of layers that save
/// them (`saves_output[l]` for layer `l`).
pub(crate) fn profile_levers(
    layers: &[SharedLayer],
    example: &Tensor,
    saves_output: &[bool],
    stores: &[Lever],
) -> Result<Vec<LeverProfile>> {
    let mut profiles: Vec<LeverProfile> = stores
        .iter()
        .map(|s| LeverProfile {
            name: s.0.name(),
            lossless: s.0.is_lossless(),
            boundaries: vec![None; layers.len()],
        })
        .collect();
    let run = || -> Result<()> {
        let mut x = example.detach();
        for (l, layer) in layers
            .iter()
            .enumerate()
            .take(layers.len().saturating_sub(1))
        {
            x = tch::no_grad(|| layer.forward_t(&x, true));
            if saves_output[l] {
                continue;
            }
            for (store, profile) in stores.iter().zip(profiles.iter_mut()) {
                profile.boundaries[l + 1] = Some(measure_store(&*store.0, &x)?);
            }
        }
        Ok(())
    };
    // A calibration is not a training step: BatchNorm's running statistics stay as they were.
    memsave_sys::checkpoint::with_running_stats_preserved(|| {
        catching_panics("a layer panicked while calibrating boundary stores", run)
    })
    .map_err(|e| CheckpointError::Torch(e.to_string()))??;
    Ok(profiles)
}
