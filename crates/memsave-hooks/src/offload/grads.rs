//! `GradOffload`: parameters' gradients kept in files between backward passes, so that
//! accumulating them over micro-batches does not hold them all in memory.
use super::file::{self, Layout, StoreDir};
use super::{lock, WriteFailures};
use crate::error::{FileError, OffloadError, SharedError};
use memsave_sys::grad_hooks::{register_post_accumulate_grad_hook, GradHookHandle};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// What [`GradOffload::on_complete`] runs on a parameter whose gradient is whole: its
/// index among the parameters and the parameter (its `.grad` set). An `Err` (any
/// error: `?` converts a typed error, or a `String`) fails the backward, and
/// [`complete_remaining`](GradOffload::complete_remaining) returns it as
/// [`OffloadError::OnComplete`], its source.
pub type OnComplete =
    Box<dyn FnMut(usize, &Tensor) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Send>;

/// Gradients accumulated in files instead of memory (ZeRO-Offload's gradient
/// offload, to disk), for gradient accumulation over micro-batches that would not fit
/// with every gradient held.
///
/// - **Each backward.** A post-accumulate-grad hook on each parameter adds the sum
///   stored so far (read back from its file) to the gradient just computed, writes
///   the result to the parameter's file and frees `.grad`. In memory, at most one
///   parameter's gradient and its stored sum exist at a time, instead of all
///   gradients.
/// - **The last micro-batch.** After [`set_last_micro_batch(true)`](Self::set_last_micro_batch),
///   a parameter whose gradient is whole goes to [`on_complete`](Self::on_complete)
///   instead (typically one optimizer step of that parameter, freeing its gradient):
///   gradient accumulation and the optimizer step in backward together.
/// - **After.** [`restore`](Self::restore) puts the stored gradients back into `.grad`;
///   [`f_grad`](Self::f_grad) reads one. With `on_complete`, call
///   [`complete_remaining`](Self::complete_remaining) after the last backward: a
///   parameter that got no gradient in it (unused by that micro-batch) has its hook
///   not fire, and its stored sum is handed over there.
/// - **Exact.** The sum is the one plain accumulation makes: the new gradient plus the
///   stored sum, and floating-point addition of two numbers does not depend on their
///   order, so gradients are bitwise equal.
/// - **Damaged files.** Each file carries a CRC-32. A file changed, truncated or
///   removed after it was written loses that parameter's sum: the backward that reads
///   it fails naming the file (and frees that parameter's `.grad`, a part of the
///   sum), and from then on [`check`](Self::check), [`restore`](Self::restore),
///   [`f_grad`](Self::f_grad), [`complete_remaining`](Self::complete_remaining) and
///   every later backward that reaches the parameter return that error: never a
///   gradient short of the lost sum. To rerun the accumulation, drop this offload,
///   clear the parameters' gradients and make a new one.
/// - **Write failures.** A gradient that cannot be written stays in `.grad` (so the
///   next backward adds into it, as without offload); nothing is lost, and
///   [`check`](Self::check) reports it once.
/// - **Its own directory.** The files go to a directory of the offload's own inside
///   the one given to [`new`](Self::new) ([`dir`](Self::dir)), named and cleaned up
///   as [`DiskOffload`](crate::DiskOffload)'s: removed when the offload is dropped,
///   and, left behind by a killed run, by the next store made in the same directory.
///
/// Traps: the hooks take the parameters' post-accumulate-grad hook slot, of which
/// libtorch keeps one per tensor, so a parameter stepped by
/// `memsave_optim::Optimizer::step_in_backward` cannot also be offloaded: step it from
/// `on_complete` instead. A gradient scaler is not supported (unscaling needs every
/// gradient at once). Dropping the offload removes the hooks and its files, stored
/// gradients included: restore them first if you need them.
///
/// ```
/// use memsave_hooks::GradOffload;
/// use tch::{Device, Kind, Tensor};
///
/// let dir = tempfile::tempdir().unwrap();
/// let w = Tensor::randn([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let offload = GradOffload::new(&[w.shallow_clone()], dir.path()).unwrap();
/// assert!(offload.dir().starts_with(dir.path()));
/// for _ in 0..2 {
///     let x = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
///     x.mm(&w).sum(Kind::Float).backward();
///     assert!(!w.grad().defined()); // in the file, not in memory
/// }
/// assert_eq!(offload.stats().stored_bytes, 64 * 64 * 4);
/// offload.restore().unwrap(); // the sum of both backward passes
/// assert!(w.grad().defined());
/// drop(offload);
/// assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
/// ```
pub struct GradOffload {
    shared: Arc<Shared>,
    params: Vec<Tensor>,
    hooks: Vec<GradHookHandle>,
}

impl std::fmt::Debug for GradOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradOffload")
            .field("dir", &self.dir())
            .field("params", &self.params.len())
            .field("stats", &self.stats())
            .finish()
    }
}

/// What a [`GradOffload`] wrote, read and holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradOffloadStats {
    /// Bytes written to files, over every backward.
    pub written_bytes: u64,
    /// Bytes read back from files.
    pub read_bytes: u64,
    /// Bytes of gradient sums in files now.
    pub stored_bytes: u64,
    /// Gradients that could not be written and were kept in memory, over every
    /// backward (write failures; not the parameters
    /// [`GradOffload::keep_in_memory`] picks, which are never written).
    pub kept_in_memory: u64,
}

/// A parameter's gradient sum of the backward passes so far, outside `.grad`.
#[derive(Debug, Clone)]
enum Sum {
    /// None stored.
    Empty,
    /// In its file, with the file's tensor and checksum.
    Stored { layout: Layout, crc: u32 },
    /// Its file was damaged: the sum is gone. Why, naming the file.
    Lost(FileError),
}

struct Shared {
    /// The offload's directory; the hooks hold `Shared`, and removing them drops it.
    dir: StoreDir,
    /// Per parameter.
    sums: Mutex<Vec<Sum>>,
    /// The parameters' shapes, for errors.
    shapes: Vec<Vec<i64>>,
    last: AtomicBool,
    /// Per parameter: its gradient stays in `.grad` (see `GradOffload::keep_in_memory`).
    in_memory: Vec<AtomicBool>,
    /// Per parameter: handed to `on_complete` since the last micro-batch began.
    completed: Vec<AtomicBool>,
    on_complete: Mutex<Option<OnComplete>>,
    written: AtomicU64,
    read: AtomicU64,
    /// Gradients that could not be written, reported by `check`.
    failures: Mutex<WriteFailures>,
}

impl Shared {
    fn path(&self, index: usize) -> PathBuf {
        self.dir.path().join(format!("grad-{index}"))
    }

    /// The stored sum of parameter `index` read back (`None` when none is stored),
    /// its file removed when `remove`. A file that cannot be read back makes the sum
    /// lost, for good: `Err` now and at every later call.
    fn read(&self, index: usize, remove: bool) -> Result<Option<Tensor>, OffloadError> {
        self.take(index, remove, |_| true, file::read)
    }

    /// Parameter `index`'s stored sum handed to `how` (its file, layout and
    /// checksum) when one is stored and `usable` takes its layout, else `None`; on
    /// success its file is removed when `remove`. A file `how` cannot read back makes
    /// the sum lost, for good (its file removed): `Err` now and at every later call.
    fn take<T>(
        &self,
        index: usize,
        remove: bool,
        usable: impl FnOnce(&Layout) -> bool,
        how: impl FnOnce(&Path, &Layout, u32) -> Result<T, FileError>,
    ) -> Result<Option<T>, OffloadError> {
        let (layout, crc) = match &lock(&self.sums)[index] {
            Sum::Empty => return Ok(None),
            Sum::Lost(e) => return Err(self.lost(index, e.clone())),
            Sum::Stored { layout, crc } => (layout.clone(), *crc),
        };
        if !usable(&layout) {
            return Ok(None);
        }
        // Read without the lock: the hooks of parameters on other devices run on
        // other threads at the same time.
        let path = self.path(index);
        let read = how(&path, &layout, crc);
        let mut sums = lock(&self.sums);
        match read {
            Ok(t) => {
                if remove {
                    sums[index] = Sum::Empty;
                    let _ = std::fs::remove_file(&path);
                }
                self.read.fetch_add(layout.bytes, Ordering::Relaxed);
                Ok(Some(t))
            }
            Err(e) => {
                sums[index] = Sum::Lost(e.clone());
                let _ = std::fs::remove_file(&path);
                Err(self.lost(index, e))
            }
        }
    }

    /// Parameter `index`'s sum lost to `e`.
    fn lost(&self, index: usize, e: FileError) -> OffloadError {
        OffloadError::GradLost {
            index,
            shape: self.shapes[index].clone(),
            source: e,
        }
    }

    /// libtorch's failure `source` to `action` parameter `index`'s gradient.
    fn grad_error(
        &self,
        index: usize,
        action: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> OffloadError {
        OffloadError::Grad {
            index,
            shape: self.shapes[index].clone(),
            action,
            source: SharedError::new(source),
        }
    }

    /// Puts parameter `index`'s stored sum, if any, back into `p`'s `.grad`: added to
    /// what is there (the new gradient plus the sum, as plain accumulation adds), or
    /// as the gradient when there is none; its file is removed. A lost sum frees
    /// `.grad` (a part of the sum) and is an `Err`.
    fn put_back(&self, index: usize, p: &Tensor) -> Result<(), OffloadError> {
        // Into the live gradient a chunk at a time where it can take the sum in place
        // (contiguous, of the sum's kind, shape and device): no second copy of it.
        let grad = p.grad();
        let in_place = |layout: &Layout| {
            grad.defined()
                && grad.is_contiguous()
                && grad.kind() == layout.kind
                && grad.size() == layout.shape
                && grad.device() == layout.device
        };
        let added = self.take(index, true, in_place, |path, layout, crc| {
            file::add_into(path, layout, crc, &grad)
        });
        drop(grad);
        let stored = match added {
            Ok(Some(())) => return Ok(()),
            Ok(None) => self.read(index, true),
            Err(e) => Err(e),
        };
        let stored = match stored {
            Ok(Some(stored)) => stored,
            Ok(None) => return Ok(()),
            Err(e) => {
                let _ = memsave_sys::tensor::set_grad_none(p);
                return Err(e);
            }
        };
        let mut grad = p.grad();
        if grad.defined() {
            grad.f_add_(&stored)
                .map(|_| ())
                .map_err(|e| self.grad_error(index, "add the stored sum to", e))
        } else {
            memsave_sys::tensor::set_grad(p, &stored).map_err(|e| self.grad_error(index, "set", e))
        }
    }

    /// Writes `grad` as parameter `index`'s stored sum; false (the failure recorded)
    /// when it could not be written.
    fn store(&self, index: usize, grad: &Tensor) -> bool {
        let path = self.path(index);
        let grad = grad.contiguous();
        match file::write(&path, &grad) {
            Ok(crc) => {
                let layout = Layout::of(&grad);
                self.written.fetch_add(layout.bytes, Ordering::Relaxed);
                lock(&self.sums)[index] = Sum::Stored { layout, crc };
                true
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                lock(&self.failures).record(e);
                false
            }
        }
    }

    /// Runs `f` (the `on_complete`) on parameter `index`, its error kept as the cause.
    fn complete(&self, f: &mut OnComplete, index: usize, p: &Tensor) -> Result<(), OffloadError> {
        self.completed[index].store(true, Ordering::Relaxed);
        f(index, p).map_err(|source| OffloadError::OnComplete {
            index,
            shape: self.shapes[index].clone(),
            source: SharedError::from(source),
        })
    }

    /// The hook of parameter `index`, `p` with its `.grad` just accumulated.
    fn on_grad(&self, index: usize, p: &Tensor) -> Result<(), OffloadError> {
        let _no_grad = tch::no_grad_guard();
        if !p.grad().defined() {
            return Ok(());
        }
        self.put_back(index, p)?;
        let grad = p.grad();
        if self.last.load(Ordering::Relaxed) {
            if let Some(f) = lock(&self.on_complete).as_mut() {
                drop(grad);
                return self.complete(f, index, p);
            }
        }
        if self.in_memory[index].load(Ordering::Relaxed) {
            // Accumulates in `.grad`, as without the offload.
            return Ok(());
        }
        if self.store(index, &grad) {
            drop(grad);
            memsave_sys::tensor::set_grad_none(p).map_err(|e| self.grad_error(index, "free", e))?;
        }
        Ok(())
    }
}

impl GradOffload {
    /// Offloads the gradients of `params` (leaves that require grad, without a
    /// post-accumulate-grad hook) to files in a directory of its own inside `dir`,
    /// which must exist and take new files (checked now); the error names the
    /// directory or the parameter. Removes the directories that stores of processes
    /// now gone left in `dir` (see [`DiskOffload`](crate::DiskOffload)).
    pub fn new(params: &[Tensor], dir: impl AsRef<Path>) -> Result<Self, OffloadError> {
        let shared = Arc::new(Shared {
            dir: StoreDir::create(dir.as_ref())?,
            sums: Mutex::new(vec![Sum::Empty; params.len()]),
            shapes: params.iter().map(Tensor::size).collect(),
            last: AtomicBool::new(false),
            in_memory: params.iter().map(|_| AtomicBool::new(false)).collect(),
            completed: params.iter().map(|_| AtomicBool::new(false)).collect(),
            on_complete: Mutex::new(None),
            written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            failures: Mutex::default(),
        });
        let mut hooks = Vec::with_capacity(params.len());
        for (index, p) in params.iter().enumerate() {
            let s = Arc::clone(&shared);
            let hook = register_post_accumulate_grad_hook(
                p,
                Box::new(move |t: &Tensor| Ok(s.on_grad(index, t)?)),
            )
            .map_err(|source| OffloadError::Param {
                index,
                shape: p.size(),
                source,
            })?;
            hooks.push(hook);
        }
        Ok(Self {
            shared,
            params: params.iter().map(Tensor::shallow_clone).collect(),
            hooks,
        })
    }

    /// Runs `f` on each parameter whose gradient is whole during a backward after
    /// [`set_last_micro_batch(true)`](Self::set_last_micro_batch), instead of storing
    /// it: e.g. one optimizer step of that parameter, then freeing its gradient. What
    /// `f` leaves in `.grad` stays there.
    pub fn on_complete(self, f: OnComplete) -> Self {
        *lock(&self.shared.on_complete) = Some(f);
        self
    }

    /// Keeps the gradients of the parameters `keep` picks in `.grad`, where they
    /// accumulate as without the offload, and offloads only the others: files cost a
    /// write and a read per parameter and backward, which for small parameters (biases,
    /// norms' weights) is mostly time and little memory. Kept ones go to
    /// [`on_complete`](Self::on_complete) in the last micro-batch's backward as the
    /// others do (or in [`complete_remaining`](Self::complete_remaining), when their
    /// hook did not fire then); gradients stay bitwise those of plain accumulation.
    ///
    /// ```
    /// use memsave_hooks::GradOffload;
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let w = Tensor::randn([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let b = Tensor::zeros([64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// // Only gradients of 1 KiB or more go to files.
    /// let offload = GradOffload::new(&[w.shallow_clone(), b.shallow_clone()], dir.path())
    ///     .unwrap()
    ///     .keep_in_memory(|p| p.numel() * 4 < 1024);
    /// let x = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
    /// (x.mm(&w) + &b).sum(Kind::Float).backward();
    /// assert!(!w.grad().defined() && b.grad().defined());
    /// assert_eq!(offload.stats().stored_bytes, 64 * 64 * 4);
    /// ```
    pub fn keep_in_memory(self, keep: impl Fn(&Tensor) -> bool) -> Self {
        for (p, flag) in self.params.iter().zip(&self.shared.in_memory) {
            flag.store(keep(p), Ordering::Relaxed);
        }
        self
    }

    /// Says whether the next backward passes are the last micro-batch's: their
    /// gradients, with the stored sums added, go to [`on_complete`](Self::on_complete)
    /// when there is one (without one, they are stored as in any backward).
    pub fn set_last_micro_batch(&self, last: bool) {
        // A new last micro-batch (not a second call within one: its backward passes
        // hand each parameter over once) starts with none handed over.
        let was = self.shared.last.swap(last, Ordering::Relaxed);
        if last && !was {
            for done in &self.shared.completed {
                done.store(false, Ordering::Relaxed);
            }
        }
    }

    /// The offload's own directory, inside the one given to [`new`](Self::new).
    pub fn dir(&self) -> &Path {
        self.shared.dir.path()
    }

    /// Hands over the sums still stored for parameters that received no gradient in
    /// the last micro-batch's backward (their hook did not fire): each is put back
    /// into `.grad` and given to [`on_complete`](Self::on_complete), as plain
    /// accumulation followed by a step would step it. Call it after that backward;
    /// without `on_complete` it does nothing. `Err` at the first parameter whose sum
    /// is lost (see the type's docs) or whose `on_complete` fails.
    pub fn complete_remaining(&self) -> Result<(), OffloadError> {
        let mut f = lock(&self.shared.on_complete);
        let Some(f) = f.as_mut() else {
            return Ok(());
        };
        let _no_grad = tch::no_grad_guard();
        for (index, p) in self.params.iter().enumerate() {
            // A sum in its file, or one kept in `.grad` that was not handed over yet.
            let stored = !matches!(lock(&self.shared.sums)[index], Sum::Empty);
            let kept = self.shared.in_memory[index].load(Ordering::Relaxed)
                && !self.shared.completed[index].load(Ordering::Relaxed)
                && p.grad().defined();
            if !stored && !kept {
                continue;
            }
            self.shared.put_back(index, p)?;
            self.shared.complete(f, index, p)?;
        }
        Ok(())
    }

    /// The stored gradient of parameter `index` (not removed), `None` when none is
    /// stored (a parameter [`keep_in_memory`](Self::keep_in_memory) picks: its sum is
    /// in `.grad`; or `index` is out of range); `Err` when its sum is lost.
    pub fn f_grad(&self, index: usize) -> Result<Option<Tensor>, OffloadError> {
        if index >= self.params.len() {
            return Ok(None);
        }
        self.shared.read(index, false)
    }

    /// Puts every stored gradient back: into `.grad`, added to what is there (the sum
    /// plain accumulation would hold), and removes its file. `Err` naming the first
    /// parameter whose sum is lost (see the type's docs), after putting back the
    /// others; again at every later call.
    pub fn restore(&self) -> Result<(), OffloadError> {
        let _no_grad = tch::no_grad_guard();
        let mut first = None;
        for (index, p) in self.params.iter().enumerate() {
            if let Err(e) = self.shared.put_back(index, p) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// `Err` naming the first parameter whose sum is lost (at every call, see the
    /// type's docs; a damaged file is found when it is read: by a backward,
    /// [`restore`](Self::restore) or [`f_grad`](Self::f_grad)); else `Err` for the gradients that could not be written and were
    /// kept in memory since the last such `Err` (each said once).
    pub fn check(&self) -> Result<(), OffloadError> {
        let lost = lock(&self.shared.sums)
            .iter()
            .enumerate()
            .find_map(|(index, sum)| match sum {
                Sum::Lost(e) => Some((index, e.clone())),
                _ => None,
            });
        if let Some((index, e)) = lost {
            return Err(self.shared.lost(index, e));
        }
        match lock(&self.shared.failures).report() {
            None => Ok(()),
            Some((count, first)) => Err(OffloadError::KeptInMemory {
                dir: self.dir().to_path_buf(),
                count,
                first,
            }),
        }
    }

    /// What was written and read, and what is stored now.
    pub fn stats(&self) -> GradOffloadStats {
        let stored_bytes = lock(&self.shared.sums)
            .iter()
            .map(|sum| match sum {
                Sum::Stored { layout, .. } => layout.bytes,
                _ => 0,
            })
            .sum();
        GradOffloadStats {
            written_bytes: self.shared.written.load(Ordering::Relaxed),
            read_bytes: self.shared.read.load(Ordering::Relaxed),
            stored_bytes,
            kept_in_memory: lock(&self.shared.failures).total,
        }
    }
}

impl Drop for GradOffload {
    fn drop(&mut self) {
        for hook in self.hooks.drain(..) {
            let _ = hook.remove();
        }
    }
}
