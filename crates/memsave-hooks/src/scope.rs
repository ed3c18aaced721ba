//! The hook scope: a pack/unpack pair on the calling thread's stack.
use crate::error::{HookError, HooksError};
use memsave_sys::hooks::{self as raw, HookFrame, Packed, RawHooks};
use memsave_sys::CallbackError;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tch::Tensor;

/// Ids of hook scopes, unique in the process.
static NEXT_SCOPE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The hook scopes ([`HooksGuard`]s) open on this thread, innermost last.
    static OPEN: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The innermost hook scope open on this thread, if any.
pub(crate) fn innermost_scope() -> Option<u64> {
    OPEN.try_with(|open| open.borrow().last().copied())
        .ok()
        .flatten()
}

/// Whether hook scope `id` is still open on this thread.
pub(crate) fn scope_is_open(id: u64) -> bool {
    OPEN.try_with(|open| open.borrow().contains(&id))
        .unwrap_or(false)
}

/// A hook scope's place among this thread's open scopes; leaves it when dropped.
struct ScopeId(u64);

impl ScopeId {
    fn open() -> Self {
        let id = NEXT_SCOPE.fetch_add(1, Ordering::Relaxed);
        let _ = OPEN.try_with(|open| open.borrow_mut().push(id));
        ScopeId(id)
    }
}

impl Drop for ScopeId {
    fn drop(&mut self) {
        let id = self.0;
        let _ = OPEN.try_with(|open| open.borrow_mut().retain(|&s| s != id));
    }
}

/// A pack/unpack pair for the tensors autograd saves (PyTorch's `pack_hook`/`unpack_hook`).
///
/// - `pack` runs in the forward, on the thread that runs the op, with grad mode off and
///   hooks disabled (a tensor saved inside `pack` is saved plainly).
/// - `unpack` runs in backward, on whichever thread runs that node (the calling thread
///   on the CPU, an engine thread per CUDA device), once per use; with
///   `keep_graph`/`create_graph` it may run several times for one packed value, so it
///   must not consume it.
/// - `unpack` must return a tensor of the packed shape and dtype on the same device;
///   another shape or dtype makes backward fail naming the tensor.
/// - An `Err` (or a panic) in either hook makes the backward call that needs the
///   tensor return `Err` naming it; the process goes on.
pub trait SavedTensorHooks: Send + Sync + 'static {
    /// What is kept in place of the tensor.
    type Packed: Send + 'static;
    /// Keeps `tensor`, or what is needed to rebuild it.
    fn pack(&self, tensor: &Tensor) -> Result<Self::Packed, HookError>;
    /// Rebuilds the tensor from what [`pack`](Self::pack) kept.
    fn unpack(&self, packed: &Self::Packed) -> Result<Tensor, HookError>;
    /// Whether to call [`pack_saved_by`](Self::pack_saved_by) with the name of the op
    /// that saves each tensor. Off by default: it costs a callback per op while the
    /// scope is open.
    fn records_ops(&self) -> bool {
        false
    }
    /// [`pack`](Self::pack), told which aten op saved the tensor (`aten::addmm`);
    /// called instead of `pack` when [`records_ops`](Self::records_ops) is true.
    fn pack_saved_by(
        &self,
        tensor: &Tensor,
        saved_by: Option<&str>,
    ) -> Result<Self::Packed, HookError> {
        let _ = saved_by;
        self.pack(tensor)
    }
}

struct Erased<H>(H);

/// `hooks` as memsave-sys's type-erased [`RawHooks`], as a hook scope installs them:
/// for a saved-tensor hook of another crate that hands these hooks the tensors it does
/// not keep itself (ZeRO-3's `Fsdp::forward_with`). Packing and unpacking are the
/// hooks' own, `records_ops` included; a value packed by other hooks is refused.
pub fn raw_hooks<H: SavedTensorHooks>(hooks: H) -> Arc<dyn RawHooks> {
    Arc::new(Erased(hooks))
}

impl<H: SavedTensorHooks> RawHooks for Erased<H> {
    fn pack(&self, tensor: &Tensor, saved_by: Option<&str>) -> Result<Packed, CallbackError> {
        let packed = if self.0.records_ops() {
            self.0.pack_saved_by(tensor, saved_by)?
        } else {
            self.0.pack(tensor)?
        };
        Ok(Box::new(packed))
    }

    fn unpack(&self, packed: &Packed) -> Result<Tensor, CallbackError> {
        let packed = packed
            .downcast_ref::<H::Packed>()
            .ok_or(HooksError::Foreign {
                store: std::any::type_name::<H>(),
            })?;
        self.0.unpack(packed)
    }

    fn records_ops(&self) -> bool {
        self.0.records_ops()
    }
}

/// Hooks made of two closures; see [`hooks_from_fn`].
pub struct FnHooks<P, U> {
    pack: P,
    unpack: U,
}

/// Hooks from a pack closure and an unpack closure, as PyTorch's
/// `saved_tensors_hooks(pack_hook, unpack_hook)` takes them.
///
/// ```
/// use memsave_hooks::{hooks_from_fn, saved_tensors_hooks};
/// use tch::{Device, Kind, Tensor};
///
/// // Keep saved activations in bf16 and restore their dtype in backward.
/// let hooks = hooks_from_fn(
///     |t: &Tensor| Ok((t.kind(), t.to_kind(Kind::BFloat16))),
///     |(kind, t): &(Kind, Tensor)| Ok(t.to_kind(*kind)),
/// );
/// let x = Tensor::linspace(-1.0, 1.0, 8, (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let y = saved_tensors_hooks(hooks, || x.tanh().sum(Kind::Float)).unwrap();
/// y.backward();
/// let exact = 1.0 - x.detach().tanh().square();
/// assert!(x.grad().allclose(&exact, 1e-2, 1e-2, false));
/// ```
pub fn hooks_from_fn<T, P, U>(pack: P, unpack: U) -> FnHooks<P, U>
where
    T: Send + 'static,
    P: Fn(&Tensor) -> Result<T, HookError> + Send + Sync + 'static,
    U: Fn(&T) -> Result<Tensor, HookError> + Send + Sync + 'static,
{
    FnHooks { pack, unpack }
}

impl<T, P, U> SavedTensorHooks for FnHooks<P, U>
where
    T: Send + 'static,
    P: Fn(&Tensor) -> Result<T, HookError> + Send + Sync + 'static,
    U: Fn(&T) -> Result<Tensor, HookError> + Send + Sync + 'static,
{
    type Packed = T;
    fn pack(&self, tensor: &Tensor) -> Result<T, HookError> {
        (self.pack)(tensor)
    }
    fn unpack(&self, packed: &T) -> Result<Tensor, HookError> {
        (self.unpack)(packed)
    }
}

/// While it lives, `hooks` handle every tensor autograd saves on this thread.
///
/// Traps:
/// - **Thread-local.** The guard covers the thread that made it; ops on other threads
///   save plainly. It is not `Send`, so it is also left on that thread.
/// - **Innermost wins.** Guards nest; the newest one handles saves until it is
///   dropped. A checkpoint (`memsave-checkpoint`) is itself a hook scope, so tensors
///   saved inside a checkpointed function go to the checkpoint, not to outer hooks.
/// - **Only new saves.** Tensors saved before the guard was made keep their plain
///   storage; what matters is when the op runs, not when backward runs.
/// - **One scope per step.** The packing built-ins take a tensor without a `grad_fn`
///   that a guard on this thread saw saved, and that is still alive once that guard
///   is gone, for a constant (see [`SavePolicy`](crate::SavePolicy)): open a guard
///   per step, not one around the whole training loop, or they never find one.
/// - **Drop order.** A guard covers exactly its own lifetime, in whatever order guards
///   are dropped: dropping an outer guard while an inner one lives removes the outer
///   hooks at once and leaves the inner ones in force until that guard goes (guards
///   held as struct fields drop in declaration order, outer first). Nothing is left on
///   the thread once every guard is gone. [`HooksGuard::exit`] reports a guard left
///   while a newer one was still alive, as a hint that the scopes overlap.
///
/// The first guard (or checkpoint) installs memsave's autograd engine as libtorch's
/// default, for the rest of the process: libtorch's own engine plus the hook lookup.
pub struct HooksGuard {
    frame: HookFrame,
    /// Dropped after the frame: the scope counts as open while its hooks are in force.
    scope: ScopeId,
}

impl HooksGuard {
    /// Pushes `hooks` as this thread's innermost saved-tensor hooks.
    pub fn new<H: SavedTensorHooks>(hooks: H) -> Result<Self, HooksError> {
        let frame = raw::push(raw_hooks(hooks))?;
        Ok(Self {
            frame,
            scope: ScopeId::open(),
        })
    }

    /// Leaves the scope; `Err` ([`HooksError::OutOfOrder`]) when a guard made after it
    /// is still alive. The scope's hooks are removed in either case.
    pub fn exit(self) -> Result<(), HooksError> {
        let HooksGuard { frame, scope } = self;
        let left = frame.exit();
        drop(scope);
        Ok(left?)
    }
}

impl std::fmt::Debug for HooksGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HooksGuard").finish_non_exhaustive()
    }
}

/// Runs `f` with `hooks` handling every tensor autograd saves on this thread (PyTorch's
/// `with saved_tensors_hooks(pack, unpack):`). See [`HooksGuard`] for the traps.
///
/// The scope ends when `f` returns or panics; the tensors packed inside it stay packed
/// until backward uses or frees them.
pub fn saved_tensors_hooks<H: SavedTensorHooks, T>(
    hooks: H,
    f: impl FnOnce() -> T,
) -> Result<T, HooksError> {
    let guard = HooksGuard::new(hooks)?;
    let value = f();
    guard.exit()?;
    Ok(value)
}
