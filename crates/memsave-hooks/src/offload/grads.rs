//! `GradOffload`: parameters' gradients kept in files between backward passes, so that
//! accumulating them over micro-batches does not hold them all in memory.
use super::file::{self, Layout};
use crate::error::OffloadError;
use memsave_sys::grad_hooks::{register_post_accumulate_grad_hook, GradHookHandle};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// What [`GradOffload::on_complete`] runs on a parameter whose gradient is whole: its
/// index among the parameters and the parameter (its `.grad` set). An `Err` fails the
/// backward.
pub type OnComplete = Box<dyn FnMut(usize, &Tensor) -> Result<(), String> + Send>;

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
///   order, so gradients are bitwise equal. Each file carries a CRC-32: a file changed
///   between two backward passes fails the backward with an error naming it.
/// - **Never lost.** A gradient that cannot be written stays in `.grad` (so the next
///   backward adds into it, as without offload); [`check`](Self::check) reports it.
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
/// for _ in 0..2 {
///     let x = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
///     x.mm(&w).sum(Kind::Float).backward();
///     assert!(!w.grad().defined()); // in the file, not in memory
/// }
/// assert_eq!(offload.stats().stored_bytes, 64 * 64 * 4);
/// offload.restore().unwrap(); // the sum of both backward passes
/// assert!(w.grad().defined());
/// ```
pub struct GradOffload {
    shared: Arc<Shared>,
    params: Vec<Tensor>,
    hooks: Vec<GradHookHandle>,
}

impl std::fmt::Debug for GradOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradOffload")
            .field("dir", &self.shared.dir)
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
    /// Gradients that could not be written and were kept in memory.
    pub kept_in_memory: u64,
}

struct Shared {
    dir: PathBuf,
    prefix: String,
    /// Per parameter, the stored sum's layout and checksum.
    slots: Mutex<Vec<Option<(Layout, u32)>>>,
    last: AtomicBool,
    on_complete: Mutex<Option<OnComplete>>,
    written: AtomicU64,
    read: AtomicU64,
    /// The first write failure (and how many), kept for `check`.
    failure: Mutex<Option<(u64, String)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn path(&self, index: usize) -> PathBuf {
        self.dir.join(format!("{}-grad-{index}", self.prefix))
    }

    /// The stored sum of parameter `index`, read back and its file removed.
    fn take(&self, index: usize) -> Result<Option<Tensor>, String> {
        let Some((layout, crc)) = lock(&self.slots)[index].take() else {
            return Ok(None);
        };
        let path = self.path(index);
        let t = file::read(&path, &layout, crc)?;
        let _ = std::fs::remove_file(&path);
        self.read.fetch_add(layout.bytes, Ordering::Relaxed);
        Ok(Some(t))
    }

    /// Puts parameter `index`'s stored sum, if any, back into `p`'s `.grad`: added to
    /// what is there (the new gradient plus the sum, as plain accumulation adds), or
    /// as the gradient when there is none; its file is removed.
    fn put_back(&self, index: usize, p: &Tensor) -> Result<(), String> {
        let Some(stored) = self.take(index)? else {
            return Ok(());
        };
        let mut grad = p.grad();
        if grad.defined() {
            grad.f_add_(&stored).map(|_| ()).map_err(|e| e.to_string())
        } else {
            memsave_sys::tensor::set_grad(p, &stored).map_err(|e| e.to_string())
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
                lock(&self.slots)[index] = Some((layout, crc));
                true
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                let mut failure = lock(&self.failure);
                match failure.as_mut() {
                    Some((count, _)) => *count += 1,
                    None => *failure = Some((1, e)),
                }
                false
            }
        }
    }

    /// The hook of parameter `index`, `p` with its `.grad` just accumulated.
    fn on_grad(&self, index: usize, p: &Tensor) -> Result<(), String> {
        let _no_grad = tch::no_grad_guard();
        if !p.grad().defined() {
            return Ok(());
        }
        self.put_back(index, p)?;
        let grad = p.grad();
        if self.last.load(Ordering::Relaxed) {
            if let Some(f) = lock(&self.on_complete).as_mut() {
                drop(grad);
                return f(index, p);
            }
        }
        if self.store(index, &grad) {
            drop(grad);
            memsave_sys::tensor::set_grad_none(p).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for index in 0..lock(&self.slots).len() {
            let _ = std::fs::remove_file(self.path(index));
        }
    }
}

impl GradOffload {
    /// Offloads the gradients of `params` (leaves that require grad, without a
    /// post-accumulate-grad hook) to files in `dir`, which must exist and take new
    /// files (checked now); the error names the directory or the parameter.
    pub fn new(params: &[Tensor], dir: impl AsRef<Path>) -> Result<Self, OffloadError> {
        let dir = dir.as_ref().to_path_buf();
        let prefix = file::store_prefix(&dir)?;
        let shared = Arc::new(Shared {
            dir: dir.clone(),
            prefix,
            slots: Mutex::new(vec![None; params.len()]),
            last: AtomicBool::new(false),
            on_complete: Mutex::new(None),
            written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            failure: Mutex::new(None),
        });
        let mut hooks = Vec::with_capacity(params.len());
        for (index, p) in params.iter().enumerate() {
            let s = Arc::clone(&shared);
            let hook = register_post_accumulate_grad_hook(
                p,
                Box::new(move |t: &Tensor| s.on_grad(index, t)),
            )
            .map_err(|e| OffloadError::Param {
                index,
                shape: p.size(),
                reason: e.to_string(),
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

    /// Says whether the next backward passes are the last micro-batch's: their
    /// gradients, with the stored sums added, go to [`on_complete`](Self::on_complete)
    /// when there is one (without one, they are stored as in any backward).
    pub fn set_last_micro_batch(&self, last: bool) {
        self.shared.last.store(last, Ordering::Relaxed);
    }

    /// Hands over the sums still stored for parameters that received no gradient in
    /// the last micro-batch's backward (their hook did not fire): each is put back
    /// into `.grad` and given to [`on_complete`](Self::on_complete), as plain
    /// accumulation followed by a step would step it. Call it after that backward;
    /// without `on_complete` it does nothing.
    pub fn complete_remaining(&self) -> Result<(), OffloadError> {
        let mut f = lock(&self.shared.on_complete);
        let Some(f) = f.as_mut() else {
            return Ok(());
        };
        let _no_grad = tch::no_grad_guard();
        for (index, p) in self.params.iter().enumerate() {
            if lock(&self.shared.slots)[index].is_none() {
                continue;
            }
            self.shared
                .put_back(index, p)
                .map_err(|reason| self.read_error(reason))?;
            f(index, p).map_err(|reason| OffloadError::Param {
                index,
                shape: p.size(),
                reason,
            })?;
        }
        Ok(())
    }

    /// The stored gradient of parameter `index` (not removed), `None` when none is
    /// stored.
    pub fn f_grad(&self, index: usize) -> Result<Option<Tensor>, OffloadError> {
        let Some((layout, crc)) = lock(&self.shared.slots).get(index).cloned().flatten() else {
            return Ok(None);
        };
        file::read(&self.shared.path(index), &layout, crc)
            .map(Some)
            .map_err(|reason| self.read_error(reason))
    }

    /// Puts every stored gradient back: into `.grad`, added to what is there (the sum
    /// plain accumulation would hold), and removes its file.
    pub fn restore(&self) -> Result<(), OffloadError> {
        let _no_grad = tch::no_grad_guard();
        for (index, p) in self.params.iter().enumerate() {
            self.shared
                .put_back(index, p)
                .map_err(|reason| self.read_error(reason))?;
        }
        Ok(())
    }

    /// Reports, once, the gradients that could not be written and were kept in memory.
    pub fn check(&self) -> Result<(), OffloadError> {
        match lock(&self.shared.failure).take() {
            None => Ok(()),
            Some((count, reason)) => Err(OffloadError::KeptInMemory {
                dir: self.shared.dir.clone(),
                count,
                reason,
            }),
        }
    }

    /// What was written and read, and what is stored now.
    pub fn stats(&self) -> GradOffloadStats {
        let stored_bytes = lock(&self.shared.slots)
            .iter()
            .flatten()
            .map(|(layout, _)| layout.bytes)
            .sum();
        GradOffloadStats {
            written_bytes: self.shared.written.load(Ordering::Relaxed),
            read_bytes: self.shared.read.load(Ordering::Relaxed),
            stored_bytes,
            kept_in_memory: lock(&self.shared.failure).as_ref().map_or(0, |(n, _)| *n),
        }
    }

    fn read_error(&self, reason: String) -> OffloadError {
        OffloadError::Dir {
            dir: self.shared.dir.clone(),
            reason,
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
