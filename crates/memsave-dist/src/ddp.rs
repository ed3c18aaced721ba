//! Data parallel training: every rank holds the whole model, computes gradients on its
//! share of the batch, and the gradients are averaged over the ranks in buckets while
//! backward is still running (PyTorch's `DistributedDataParallel`).
use std::sync::{Arc, Mutex};

use memsave_sys::grad_hooks::GradHookHandle;
use tch::{Kind, Tensor};

use crate::bucket::{copy_from_flat, BucketReduce, Buckets};
use crate::check::same_shapes_everywhere;
use crate::error::{DistError, Result};
use crate::group::ProcessGroup;
use crate::ready::ready_hooks;

/// Options of [`DistributedDataParallel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DdpConfig {
    /// Largest bucket, in bytes of gradient (PyTorch's `bucket_cap_mb`, default 25 MiB).
    /// A parameter larger than this gets a bucket of its own.
    pub bucket_cap_bytes: u64,
    /// Copy rank 0's parameters to every rank at construction (PyTorch does).
    pub broadcast_parameters: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_cap_bytes: 25 << 20,
            broadcast_parameters: true,
        }
    }
}

/// Averages gradients over the ranks of a group as backward produces them.
///
/// Parameters are grouped into buckets, in reverse order (the order backward usually
/// produces their gradients). A post-accumulate-grad hook on each parameter counts
/// ready gradients; when a bucket is complete, and every bucket before it has been
/// reduced, its gradients are flattened, summed over the ranks with one all-reduce,
/// divided by the world size and copied back. Buckets are always reduced in the same
/// order, so every rank issues the same collectives and the sums are deterministic.
///
/// Inside [`DistributedDataParallel::no_sync`] nothing is communicated: gradients only
/// accumulate locally (the micro-batches of gradient accumulation before the last).
///
/// A parameter that gets a gradient on some ranks only is averaged as if the others
/// had a zero gradient; one that gets none on any rank is left without a gradient, so
/// an optimizer skips it as on one process (PyTorch's `find_unused_parameters=True`).
///
/// Traps: a parameter that gets no gradient in a backward leaves its bucket incomplete;
/// [`DistributedDataParallel::f_backward`] then reduces it, but a plain
/// `loss.backward()` does not, and the next collective on another rank waits for it
/// until the timeout. The hooks run on the thread of backward (the caller's, on the
/// CPU). Each parameter can carry only one post-accumulate-grad hook, so this cannot
/// be combined with `step_in_backward`.
#[derive(Debug)]
pub struct DistributedDataParallel {
    // Dropped first: removing the hooks releases their references to `state`.
    _hooks: Vec<GradHookHandle>,
    state: Arc<Mutex<Reducer>>,
}

#[derive(Debug)]
struct Reducer {
    group: ProcessGroup,
    params: Vec<Tensor>,
    buckets: Buckets,
    sync: bool,
    reductions: u64,
}

impl DistributedDataParallel {
    /// Wraps `params` (every rank passes its copies of the same parameters, in the same
    /// order). Checks once, with one small collective, that every rank has the same
    /// shapes, and copies rank 0's values everywhere unless told not to.
    pub fn new(group: &ProcessGroup, params: &[Tensor], config: DdpConfig) -> Result<Self> {
        let rank = group.rank();
        same_shapes_everywhere(group, params)?;
        if config.broadcast_parameters {
            let _no_grad = tch::no_grad_guard();
            for p in params {
                group.broadcast(p, 0)?;
            }
        }
        let state = Arc::new(Mutex::new(Reducer {
            group: group.clone(),
            params: params.iter().map(Tensor::shallow_clone).collect(),
            buckets: Buckets::new(params, config.bucket_cap_bytes),
            sync: true,
            reductions: 0,
        }));
        let hooks = ready_hooks(params, &state, rank, Reducer::mark_ready)?;
        Ok(Self {
            _hooks: hooks,
            state,
        })
    }

    /// Runs `f` (forward and backward of a micro-batch) without communication: the
    /// gradients only accumulate locally (PyTorch's `no_sync`). The backward after it,
    /// outside `no_sync`, reduces the accumulated gradients.
    pub fn no_sync<T>(&self, f: impl FnOnce() -> T) -> T {
        self.lock().sync = false;
        let out = f();
        self.lock().sync = true;
        out
    }

    /// Turns the reduction in backward on or off (PyTorch's
    /// `require_backward_grad_sync`): off, backward only accumulates gradients locally,
    /// as inside [`no_sync`](Self::no_sync). For a backward this type does not run
    /// itself, e.g. the one a gradient accumulator runs for each micro-batch: off
    /// before every micro-batch's backward but the last, on before the last, then
    /// [`f_flush`](Self::f_flush).
    ///
    /// Trap: it stays as set; a step that fails while it is off must turn it back on,
    /// or the next step's gradients are never averaged.
    pub fn set_require_backward_grad_sync(&self, on: bool) {
        self.lock().sync = on;
    }

    /// Whether backward reduces the gradients now (see
    /// [`set_require_backward_grad_sync`](Self::set_require_backward_grad_sync)).
    pub fn require_backward_grad_sync(&self) -> bool {
        self.lock().sync
    }

    /// Reduces every bucket the last backward left incomplete (a parameter without a
    /// gradient on any rank keeps none), so that every rank has issued the same
    /// collectives and holds the averaged gradients: what [`f_backward`](Self::f_backward) does after
    /// its backward, for a backward run some other way. Nothing when every bucket was
    /// reduced already, or inside `no_sync`.
    pub fn f_flush(&self) -> Result<()> {
        self.lock().flush()
    }

    /// Backward from `loss`, then reduces any bucket backward left incomplete (a
    /// parameter without a gradient on any rank keeps none), so that every rank has
    /// issued the same collectives. Inside [`DistributedDataParallel::no_sync`] it only runs backward.
    pub fn f_backward(&self, loss: &Tensor) -> Result<()> {
        let rank = self.lock().group.rank();
        loss.f_backward().map_err(|source| DistError::Tensor {
            rank,
            context: "backward",
            source,
        })?;
        self.lock().flush()
    }

    /// Number of bucket all-reduces so far.
    pub fn reductions(&self) -> u64 {
        self.lock().reductions
    }

    /// Number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.lock().buckets.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Reducer> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BucketReduce for Reducer {
    fn buckets(&mut self) -> &mut Buckets {
        &mut self.buckets
    }

    fn syncing(&self) -> bool {
        self.sync
    }

    fn reduce(&mut self, bucket: usize) -> Result<()> {
        let rank = self.group.rank();
        let err = |source| DistError::Tensor {
            rank,
            context: "gradient bucket",
            source,
        };
        let _no_grad = tch::no_grad_guard();
        let members = self.buckets.members(bucket);
        let mut grads = Vec::with_capacity(members.len());
        // 1 for each gradient this rank has, summed over the ranks with the gradients.
        let mut used = Vec::with_capacity(members.len());
        for &i in members {
            let p = &self.params[i];
            let mut g = p.grad();
            used.push(f32::from(u8::from(g.defined())));
            if !g.defined() {
                g = p.f_zeros_like().map_err(err)?;
                memsave_sys::dist::set_grad(p, &g)?;
            }
            grads.push(g);
        }
        let mut pieces = grads
            .iter()
            .map(|g| g.f_reshape([-1]))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        // In the gradients' kind, so that the flags do not promote a bf16 or f16 bucket
        // to f32 (sums of 0 and 1 are exact in bf16 up to 256 ranks).
        let kind = grads
            .first()
            .map_or(Ok(Kind::Float), Tensor::f_kind)
            .map_err(err)?;
        pieces.push(
            Tensor::f_from_slice(&used)
                .and_then(|t| t.f_to_kind(kind))
                .map_err(err)?,
        );
        let flat = Tensor::f_cat(&pieces, 0).map_err(err)?;
        drop(pieces);
        self.group.all_reduce(&flat)?;
        let n = grads.len() as i64;
        let used = flat
            .f_narrow(0, flat.numel() as i64 - n, n)
            .and_then(|t| t.f_to_kind(Kind::Float))
            .map_err(err)?;
        let used = Vec::<f32>::try_from(used).map_err(err)?;
        let mut flat = flat;
        let _ = flat
            .f_div_scalar_(self.group.world_size() as f64)
            .map_err(err)?;
        copy_from_flat(&flat, &grads).map_err(err)?;
        // A parameter no rank has a gradient for keeps none, so the optimizer skips it
        // (PyTorch's DDP with `find_unused_parameters`): weight decay must not move it.
        for (&i, u) in members.iter().zip(used) {
            if u == 0.0 {
                memsave_sys::tensor::set_grad_none(&self.params[i])?;
            }
        }
        self.reductions += 1;
        Ok(())
    }
}

impl Reducer {
    /// Reduces the buckets not yet reduced in this backward, in order.
    fn flush(&mut self) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        self.reduce_owed()
    }
}
