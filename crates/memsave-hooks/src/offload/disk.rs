//! `DiskOffload`: saved activations written to files by a background thread and read
//! back, ahead of need, in backward.
use super::file::{self, Layout, StoreDir};
use super::{lock, WriteFailures};
use crate::distinct::{distinct, Expanded};
use crate::error::{HookError, OffloadError, PolicyError};
use crate::policy::{KeptStats, SavePolicy, Selector};
use crate::saved_once::{Lookup, Region, SavedOnce, View};
use crate::scope::SavedTensorHooks;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use tch::Tensor;

/// Bytes that may wait for the writer by default: 4 MiB (at least one tensor always
/// may, however large). More lets the forward run further ahead of the disk but puts
/// what waits on the forward's peak, at the writer's pace: on small models 16 MiB in
/// flight made the peak vary from run to run by more than a checkpoint plan's.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: u64 = 4 << 20;

/// Saved-tensor hooks that keep saved activations in files of a directory you choose,
/// on any device (torchtune's activation offloading, to disk).
///
/// - **Its own directory.** [`new`](Self::new) makes a directory for the store inside
///   the one you choose, named `memsave-<pid>-<start>-<boot>-<n>-<host>` after the
///   process that owns it ([`dir`](Self::dir)), and removes it with whatever is left
///   in it when the store and every tensor it packed are dropped. A run killed before
///   that (Ctrl-C) leaves its directory behind: the next store made in the same
///   directory (by [`DiskOffload`] or [`GradOffload`](crate::GradOffload)) removes the
///   directories of stores whose process is gone (on this host, and yours), never
///   those of a live process.
/// - **Forward.** `pack` hands the tensor to a background writer thread and returns;
///   the tensor's memory is freed as soon as it is written and nothing else holds it.
///   At most [`max_in_flight_bytes`](Self::max_in_flight_bytes) wait for the writer:
///   beyond that `pack` waits, so the forward never holds more than that in unwritten
///   activations.
/// - **Backward.** `unpack` reads the file back (or takes the tensor still waiting
///   for the writer) and asks the same thread to read the next
///   [`prefetch`](Self::prefetch) files ahead, newest first, the order in which
///   backward needs them (LIFO).
/// - **Exact.** Bytes go to disk and back unchanged: gradients are bitwise equal to
///   the baseline's. Each file carries a CRC-32; a file truncated or changed before
///   backward makes backward return `Err` naming it, never a wrong gradient.
/// - **Cleanup.** A file is removed when autograd frees the saved tensor (after its
///   backward, or when the graph is dropped): after backward the store's directory
///   is empty.
/// - **Expanded tensors.** A saved tensor expanded from a smaller one (stride 0 in a
///   dimension: `expand`, broadcasting) is written as the smaller one and expanded
///   back in backward: a `[1, 1024]` row expanded to `[256, 1024]` writes 4 KiB of
///   f32, not 1 MiB.
/// - **Bad directory.** [`new`](Self::new) checks that the directory exists and takes
///   files. A write that fails later (disk full, directory removed) keeps that tensor
///   in memory instead, so nothing is lost, and [`flush`](Self::flush) returns the
///   error once, naming the directory.
///
/// - **What stays alive is not written** ([`SavePolicy::exact`]): parameters (and
///   their views), the tensors given to [`excluding`](Self::excluding), buffers
///   (floating-point vectors and scalars without a `grad_fn`: running statistics,
///   batch norm's saved statistics) and constants (tensors without a `grad_fn` that
///   an earlier step saved and that are still alive: a table or mask a layer holds)
///   stay in memory, where they are anyway: writing them cost a file each (80 of the
///   139 files of a ResNet-18 step were batch norm's statistics) and added their
///   bytes while they waited for the writer. Traps: constants are known from the
///   second step on (the first writes each once), and the batch is written unless
///   excluded; see [`SavePolicy`] for the rules and [`policy`](Self::policy) to
///   change them. So from the second step on, the bytes written per step are those
///   of the distinct tensors the step saves, less all of these.
/// - **Written once.** A tensor that several autograd nodes save is written once
///   while its file is alive, whatever layout each saves it in (a ReLU's output saved
///   by the ReLU and, flattened, by the layer after it; an attention's output saved in
///   its strided layout and, as a contiguous view, by the output projection), as
///   [`Compress`](crate::Compress) stores it once: a save of the same storage, dtype
///   and version whose elements all lie inside the memory an earlier save fills
///   shares that save's file and gets its own view of it back, bitwise.
///   [`OffloadStats::shared`] counts the second saves.
/// - **No copy for other layouts.** A saved tensor that fills its memory without gaps
///   (contiguous, transposed, permuted, channels-last) is written as that memory lies
///   and comes back with its own strides; one with gaps (a slice of every other
///   column) is written as a contiguous copy of its elements.
///
/// Trap: a directory on a RAM-backed file system (`tmpfs`, often `/tmp`) only moves
/// the bytes to another part of memory.
///
/// ```
/// use memsave_hooks::{saved_tensors_hooks, DiskOffload};
/// use tch::{Device, Kind, Tensor};
///
/// let dir = tempfile::tempdir().unwrap();
/// let w = Tensor::randn([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
/// let store = DiskOffload::new(dir.path()).unwrap().excluding(&[x.shallow_clone()]);
/// assert!(store.dir().starts_with(dir.path())); // its own directory in there
/// let loss = saved_tensors_hooks(store.clone(), || x.mm(&w).tanh().sum(Kind::Float)).unwrap();
/// store.flush().unwrap();
/// assert_eq!(store.stats().written_bytes, 32 * 64 * 4); // tanh's output
/// loss.backward();
/// assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 0);
/// drop((loss, store));
/// assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
/// ```
#[derive(Clone)]
pub struct DiskOffload {
    store: Arc<Store>,
    select: Selector,
    saved: Arc<SavedOnce<Held>>,
    prefetch: usize,
    max_in_flight_bytes: u64,
    synchronous: bool,
}

/// What [`DiskOffload`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Tensors written to the store.
    pub tensors_written: u64,
    /// Bytes written to the store.
    pub written_bytes: u64,
    /// Tensors kept in memory because their write failed.
    pub kept_in_memory: u64,
    /// Bytes read back from the store.
    pub read_bytes: u64,
    /// Tensors saved again while their file was alive, sharing it (not in
    /// `tensors_written`).
    pub shared: u64,
    /// Tensors kept in memory by the policy, by reason (not written).
    pub kept: KeptStats,
}

/// The directory, the writer's queue and what is in flight; shared by clones.
struct Store {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// What the store's files and the worker thread share; the last of them to go
/// removes the store's directory.
struct Shared {
    dir: StoreDir,
    next_id: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    in_flight_bytes: u64,
    live: BTreeMap<u64, Weak<Entry>>,
    stats: OffloadStats,
    failures: WriteFailures,
}

enum Job {
    Write(Arc<Entry>),
    Read(Arc<Entry>),
}

/// One offloaded tensor: its file and where its bytes are now.
struct Entry {
    id: u64,
    path: PathBuf,
    /// The file's tensor: the memory the saved tensor's distinct elements fill, in
    /// memory order, when they fill a span (`region`); else those elements,
    /// contiguous.
    layout: Layout,
    /// The span the file holds, to view it with the saved tensor's strides.
    region: Option<Region>,
    /// The saved tensor's sizes when only its distinct elements were kept.
    expanded: Option<Expanded>,
    slot: Mutex<Slot>,
    shared: Arc<Shared>,
}

/// Where an entry's bytes are. The worker holds the entry's lock while it writes or
/// reads the file, so an unpack or a drop that needs the entry waits for it.
enum Slot {
    /// Waiting for the writer (which frees it once written).
    Queued(Tensor),
    /// On disk only.
    Written { crc: u32 },
    /// On disk, a read-ahead queued.
    Loading { crc: u32 },
    /// Read ahead, waiting for its unpack.
    Prefetched { crc: u32, tensor: Tensor },
    /// The write failed: kept in memory.
    InMemory(Tensor),
    /// Autograd freed it; its file is removed.
    Freed,
}

/// A tensor packed by [`DiskOffload`]: kept as it was, or in the store.
pub struct Offloaded(Packed);

enum Packed {
    Kept(Tensor),
    /// The entry, shared by the packs of one tensor saved twice, and this pack's view
    /// of its memory when it is another view than the tensor written.
    Stored(Arc<Held>, Option<View>),
}

/// An entry held by packs: when the last of them goes (autograd freed every save of
/// the tensor), its file is removed.
struct Held(Arc<Entry>);

impl std::fmt::Debug for Offloaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Packed::Kept(_) => f.write_str("Offloaded::Kept"),
            Packed::Stored(e, _) => write!(f, "Offloaded::Stored({})", e.0.path.display()),
        }
    }
}

impl std::fmt::Debug for DiskOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskOffload")
            .field("dir", &self.dir())
            .field("prefetch", &self.prefetch)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .finish_non_exhaustive()
    }
}

impl DiskOffload {
    /// A store in a directory of its own inside `dir`, which must exist and take new
    /// files (checked now by writing and removing a probe file); the error names
    /// `dir`. Removes the directories that stores of processes now gone left in
    /// `dir` (see the type's docs).
    pub fn new(dir: impl AsRef<Path>) -> Result<Self, OffloadError> {
        let dir = dir.as_ref();
        let shared = Arc::new(Shared {
            dir: StoreDir::create(dir)?,
            next_id: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let (tx, rx) = channel::<Job>();
        let worker_shared = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("memsave-offload".into())
            .spawn(move || {
                let _no_grad = tch::no_grad_guard();
                for job in rx {
                    match job {
                        Job::Write(entry) => worker_shared.write(entry),
                        Job::Read(entry) => worker_shared.read_ahead(entry),
                    }
                }
            })
            .map_err(|e| OffloadError::Dir {
                dir: dir.to_path_buf(),
                reason: format!("cannot start its writer thread: {e}"),
            })?;
        Ok(Self {
            store: Arc::new(Store {
                shared,
                jobs: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
            }),
            select: Selector::new(SavePolicy::exact()),
            saved: Arc::default(),
            prefetch: 1,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            synchronous: false,
        })
    }

    /// Also leaves tensors sharing data with `tensors` in memory (inputs you hold,
    /// parameters' views); see [`PassThrough`](crate::PassThrough).
    pub fn excluding(mut self, tensors: &[Tensor]) -> Self {
        self.select = self.select.excluding(tensors);
        self
    }

    /// Decides what is written by `policy` instead of [`SavePolicy::exact`]; the
    /// exclusions stay.
    pub fn policy(mut self, policy: SavePolicy) -> Self {
        self.select = self.select.policy(policy);
        self
    }

    /// `Err` ([`PolicyError::UnseenOps`]) listing the [`SavePolicy::keep_ops`] names
    /// that no saved tensor's saving op or producer matched so far, with the similar
    /// names seen; call it after the first step. `Ok` when `keep_ops` names none.
    pub fn check(&self) -> Result<(), PolicyError> {
        self.select.check()
    }

    /// How many files backward reads ahead of the one it needs (default 1; 0: none).
    /// Each costs one tensor's memory during backward.
    pub fn prefetch(mut self, count: usize) -> Self {
        self.prefetch = count;
        self
    }

    /// At most this many bytes wait for the writer (default
    /// [`DEFAULT_MAX_IN_FLIGHT_BYTES`]); a larger tensor waits alone.
    pub fn max_in_flight_bytes(mut self, bytes: u64) -> Self {
        self.max_in_flight_bytes = bytes;
        self
    }

    /// With `true`, `pack` returns only once its tensor is written, so no saved
    /// tensor waits in memory for the writer: what the forward holds no longer
    /// depends on the writer thread's pace (memsave-plan's `fit` predicts peaks with
    /// it), at the cost of the forward waiting for each write. Default false.
    pub fn synchronous(mut self, synchronous: bool) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// The store's own directory, inside the one given to [`new`](Self::new).
    pub fn dir(&self) -> &Path {
        self.store.shared.dir.path()
    }

    /// What the store did so far.
    pub fn stats(&self) -> OffloadStats {
        let mut stats = lock(&self.store.shared.state).stats;
        stats.kept = self.select.kept();
        stats
    }

    /// Waits until every tensor packed so far is written (or kept in memory), leaving
    /// a failed write for [`flush`](Self::flush) to report: a point to read memory
    /// at that does not depend on the writer's pace.
    pub fn wait_written(&self) {
        drop(self.store.shared.wait_written());
    }

    /// Waits until every tensor packed so far is written (or kept in memory); `Err`
    /// naming the directory if a write failed since the last `Err`, said once.
    pub fn flush(&self) -> Result<(), OffloadError> {
        let shared = &self.store.shared;
        let mut state = shared.wait_written();
        match state.failures.report() {
            None => Ok(()),
            Some((count, first)) => Err(OffloadError::KeptInMemory {
                dir: shared.dir.path().to_path_buf(),
                count,
                first,
            }),
        }
    }

    fn send(&self, job: Job) -> bool {
        match lock(&self.store.jobs).as_ref() {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        }
    }

    /// Marks the next `prefetch` written entries below `id` (newest first) as loading
    /// and queues their reads.
    fn read_ahead_of(&self, id: u64) {
        if self.prefetch == 0 {
            return;
        }
        let candidates: Vec<Arc<Entry>> = {
            let state = lock(&self.store.shared.state);
            state
                .live
                .range(..id)
                .rev()
                .filter_map(|(_, e)| e.upgrade())
                .take(self.prefetch)
                .collect()
        };
        for entry in candidates {
            let mut slot = lock(&entry.slot);
            if let Slot::Written { crc } = *slot {
                *slot = Slot::Loading { crc };
                drop(slot);
                if !self.send(Job::Read(Arc::clone(&entry))) {
                    *lock(&entry.slot) = Slot::Written { crc };
                }
            }
        }
    }
}

impl Shared {
    /// Waits until nothing is in flight; the state, locked.
    fn wait_written(&self) -> MutexGuard<'_, State> {
        self.wait_while(lock(&self.state), |s| s.in_flight_bytes > 0)
    }

    /// Waits, on `state`, while `busy` holds for it.
    fn wait_while<'a>(
        &self,
        state: MutexGuard<'a, State>,
        busy: impl FnMut(&mut State) -> bool,
    ) -> MutexGuard<'a, State> {
        self.changed
            .wait_while(state, busy)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Writes a queued entry (the lock held throughout), then lets the next pack go.
    fn write(&self, entry: Arc<Entry>) {
        let bytes = entry.layout.bytes;
        {
            let mut slot = lock(&entry.slot);
            let Slot::Queued(tensor) = &*slot else {
                drop(slot);
                return self.release(bytes);
            };
            match file::write(&entry.path, tensor) {
                Ok(crc) => {
                    *slot = Slot::Written { crc };
                    let mut state = lock(&self.state);
                    state.stats.tensors_written += 1;
                    state.stats.written_bytes += bytes;
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&entry.path);
                    let tensor = tensor.shallow_clone();
                    *slot = Slot::InMemory(tensor);
                    let mut state = lock(&self.state);
                    state.stats.kept_in_memory += 1;
                    state.failures.record(e);
                }
            }
        }
        drop(entry);
        self.release(bytes);
    }

    fn release(&self, bytes: u64) {
        let mut state = lock(&self.state);
        state.in_flight_bytes = state.in_flight_bytes.saturating_sub(bytes);
        drop(state);
        self.changed.notify_all();
    }

    /// Reads an entry ahead of its unpack, unless the unpack came first.
    fn read_ahead(&self, entry: Arc<Entry>) {
        let mut slot = lock(&entry.slot);
        let Slot::Loading { crc } = *slot else {
            return;
        };
        // A failed read-ahead is retried, and reported, by the unpack.
        *slot = match file::read(&entry.path, &entry.layout, crc) {
            Ok(tensor) => {
                lock(&self.state).stats.read_bytes += entry.layout.bytes;
                Slot::Prefetched { crc, tensor }
            }
            Err(_) => Slot::Written { crc },
        };
    }
}

impl Offloaded {
    /// Bytes this packed tensor keeps in memory now: all of it when passed through or
    /// kept after a failed write, what still waits for the writer, else 0.
    pub(crate) fn resident_bytes(&self) -> u64 {
        use memsave_sys::tensor::nbytes;
        match &self.0 {
            Packed::Kept(t) => nbytes(t),
            Packed::Stored(held, _) => match &*lock(&held.0.slot) {
                Slot::Queued(t) | Slot::InMemory(t) | Slot::Prefetched { tensor: t, .. } => {
                    nbytes(t)
                }
                _ => 0,
            },
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let entry = &self.0;
        let mut slot = lock(&entry.slot);
        if !matches!(*slot, Slot::InMemory(_) | Slot::Queued(_)) {
            let _ = std::fs::remove_file(&entry.path);
        }
        *slot = Slot::Freed;
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        lock(&self.shared.state).live.remove(&self.id);
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        lock(&self.jobs).take();
        if let Some(worker) = lock(&self.worker).take() {
            let _ = worker.join();
        }
    }
}

impl SavedTensorHooks for DiskOffload {
    type Packed = Offloaded;

    fn pack(&self, tensor: &Tensor) -> Result<Offloaded, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        self.select.records_ops()
    }

    fn pack_saved_by(
        &self,
        tensor: &Tensor,
        saved_by: Option<&str>,
    ) -> Result<Offloaded, HookError> {
        let (base, expanded) = distinct(tensor)?;
        let bytes = memsave_sys::tensor::nbytes(&base);
        if self.select.decide(tensor, bytes, saved_by)?.kept.is_some() {
            return Ok(Offloaded(Packed::Kept(tensor.shallow_clone())));
        }
        let region = Region::of(&base);
        let lookup = self.saved.get_or_make(tensor, region.clone(), || {
            Ok(Some(Arc::new(Held(self.write(base, region, expanded)?))))
        })?;
        Ok(Offloaded(match lookup {
            Lookup::Made(held) => Packed::Stored(held, None),
            Lookup::Shared(held, view) => {
                lock(&self.store.shared.state).stats.shared += 1;
                Packed::Stored(held, view)
            }
            Lookup::Declined => Packed::Kept(tensor.shallow_clone()),
        }))
    }

    fn unpack(&self, packed: &Offloaded) -> Result<Tensor, HookError> {
        match &packed.0 {
            Packed::Kept(t) => Ok(t.shallow_clone()),
            Packed::Stored(held, view) => {
                let entry = &held.0;
                let stored = self.unpack_stored(entry)?;
                Ok(match (view, &entry.region) {
                    (Some(view), _) => view.f_of(&stored)?,
                    (None, Some(region)) => {
                        Expanded::restore(entry.expanded.as_ref(), region.f_view_of(&stored)?)?
                    }
                    (None, None) => Expanded::restore(entry.expanded.as_ref(), stored)?,
                })
            }
        }
    }
}

impl DiskOffload {
    /// A new entry for `base` (a saved tensor's distinct elements), queued for the
    /// writer once at most `max_in_flight_bytes` wait (written before this returns
    /// when synchronous). A base that fills `region` is written as that memory, as it
    /// lies (no copy, whatever its strides); another one as a contiguous copy.
    fn write(
        &self,
        base: Tensor,
        region: Option<Region>,
        expanded: Option<Expanded>,
    ) -> Result<Arc<Entry>, HookError> {
        let tensor = match &region {
            Some(region) => region.f_memory(&base)?.detach(),
            None => base.f_contiguous()?.detach(),
        };
        let layout = Layout::of(&tensor);
        let shared = &self.store.shared;
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry {
            id,
            path: shared.dir.path().join(format!("{id}.bin")),
            layout,
            region,
            expanded,
            slot: Mutex::new(Slot::Queued(tensor.shallow_clone())),
            shared: Arc::clone(shared),
        });
        {
            let max = self.max_in_flight_bytes;
            let mut state = shared.wait_while(lock(&shared.state), |s| {
                s.in_flight_bytes > 0 && s.in_flight_bytes + entry.layout.bytes > max
            });
            state.in_flight_bytes += entry.layout.bytes;
            state.live.insert(id, Arc::downgrade(&entry));
        }
        if !self.send(Job::Write(Arc::clone(&entry))) {
            *lock(&entry.slot) = Slot::InMemory(tensor);
            shared.release(entry.layout.bytes);
        } else if self.synchronous {
            // Only this tensor can be in flight: wait until the writer is done with it.
            drop(shared.wait_written());
        }
        Ok(entry)
    }

    /// The file's tensor of `entry`: taken from memory or the read-ahead, or read.
    fn unpack_stored(&self, entry: &Arc<Entry>) -> Result<Tensor, HookError> {
        let crc = {
            let mut slot = lock(&entry.slot);
            match &*slot {
                Slot::Queued(t) | Slot::InMemory(t) => return Ok(t.shallow_clone()),
                Slot::Freed => return Err("the offloaded tensor was already freed".into()),
                // The read-ahead has not started: read it here, the worker will skip it.
                Slot::Written { crc } | Slot::Loading { crc } => {
                    let crc = *crc;
                    *slot = Slot::Written { crc };
                    crc
                }
                Slot::Prefetched { crc, .. } => {
                    let crc = *crc;
                    let taken = std::mem::replace(&mut *slot, Slot::Written { crc });
                    drop(slot);
                    self.read_ahead_of(entry.id);
                    if let Slot::Prefetched { tensor, .. } = taken {
                        return Ok(tensor);
                    }
                    crc
                }
            }
        };
        self.read_ahead_of(entry.id);
        let tensor = file::read(&entry.path, &entry.layout, crc)
            .map_err(|source| OffloadError::Damaged { source })?;
        lock(&self.store.shared.state).stats.read_bytes += entry.layout.bytes;
        Ok(tensor)
    }
}
