//! Gradient checkpointing on saved-tensor hooks (`memsave-checkpoint` builds the
//! user-facing API on it).
//!
//! The closure runs with grad enabled under a hook frame that keeps a handle instead of
//! each tensor autograd saves; the first handle unpacked in backward reruns the closure
//! and hands the recomputed tensors to the original graph (PyTorch's non-reentrant
//! scheme), so every autograd entry point works through a checkpoint.
use crate::error::{callback_message, check, CallbackError};
use crate::ffi::CTensor;
use crate::{ffi, Error, Result};
use parking_lot::ReentrantMutex;
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;
use tch::Tensor;

/// The closure a checkpoint owns: maps its inputs to its outputs, or says why not
/// with any error ([`CallbackError`]: `String`s, `&str`s and every
/// `std::error::Error + Send + Sync` convert into it with `?` or `.into()`).
///
/// The error crosses libtorch as text only: the forward (or the backward whose
/// recomputation failed) returns an [`Error`] whose message is
/// [`callback_message`]'s one line, the error followed by the causes its text leaves
/// out.
///
/// `Fn`, not `FnMut`: a backward that runs inside the function (`autograd.grad` in a
/// checkpointed function) can need the recomputation while the forward is still running
/// it, so the closure is called again from within its own call on the same thread.
pub type CheckpointFn =
    Box<dyn Fn(&[Tensor]) -> std::result::Result<Vec<Tensor>, CallbackError> + Send>;

/// Calls from other threads (engine threads of other devices) take turns; calls from
/// within a call on the same thread go through.
type Shared = ReentrantMutex<CheckpointFn>;

/// The text of a panic payload; kept here for the callers that name it by this path
/// (it lives with the crate's errors: [`crate::panic_message`]).
pub use crate::error::panic_message;

fn report_failure(out: *mut c_void, message: &str) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `out` is the live Outputs object the bridge passed to `run`; the message
    // is copied by the bridge before this CString is dropped.
    unsafe { ffi::ms_outputs_fail(out, message.as_ptr()) }
}

/// Called by the bridge in the forward and in every recomputation.
unsafe extern "C" fn run(
    ctx: *mut c_void,
    inputs: *const *mut CTensor,
    n: usize,
    out: *mut c_void,
) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `Box<Shared>` leaked in `checkpoint`; it lives until
        // `drop_closure` runs, which the bridge does only after the last `run`.
        let shared = unsafe { &*(ctx as *const Shared) };
        let inputs: Vec<Tensor> = (0..n)
            // SAFETY: the bridge passes `n` valid at::Tensor pointers that outlive the
            // call; clone_from_ptr makes new handles to them.
            .map(|i| unsafe { Tensor::clone_from_ptr((*inputs.add(i)).cast()) })
            .collect();
        let f = shared.lock();
        // The error's text is made, and the error dropped, inside `catch_unwind`: its
        // `Display` or `Drop` is the caller's code and may panic.
        f(&inputs).map_err(|error| callback_message(&*error))
    }));
    match result {
        Ok(Ok(outputs)) => {
            for t in &outputs {
                // SAFETY: `out` is the live Outputs object; the bridge copies the handle.
                unsafe { ffi::ms_outputs_push(out, t.as_ptr().cast()) }
            }
        }
        Ok(Err(message)) => report_failure(out, &message),
        Err(payload) => report_failure(out, &format!("panicked: {}", panic_message(&*payload))),
    }
}

/// Called by the bridge exactly once, when the closure is no longer needed.
unsafe extern "C" fn drop_closure(ctx: *mut c_void) {
    // A panic in a captured value's destructor must not unwind into C++.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `Box<Shared>` leaked in `checkpoint`, dropped only here.
        drop(unsafe { Box::from_raw(ctx as *mut Shared) });
    }));
}

/// The text of the error that ends a recomputation once every tensor backward needs is
/// back; a closure that unwraps it panics with this text, which is not a failure.
fn stop_message() -> &'static str {
    // SAFETY: the bridge returns a pointer to a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(ffi::ms_checkpoint_stop_message()) }
        .to_str()
        .unwrap_or("memsave-checkpoint: recomputation stopped early")
}

/// Bytes of one copy of the CPU generator's state: what a checkpoint whose function
/// draws random numbers keeps to replay them (with `preserve_rng`).
pub fn cpu_generator_state_bytes() -> Result<u64> {
    let mut out = 0i64;
    // SAFETY: `out` is a valid, writable i64; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_cpu_generator_state_bytes(&mut out) })?;
    Ok(out.max(0) as u64)
}

/// Keeps panics that carry the early-stop message off stderr. Installed once per process
/// on the first checkpoint; every other panic goes to the hook that was there before.
fn quiet_early_stop_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        let stop = stop_message();
        std::panic::set_hook(Box::new(move |info| {
            let message = panic_message(info.payload());
            if !message.contains(stop) {
                previous(info);
            }
        }));
    });
}

/// Runs `f(inputs)` with grad enabled, keeping a handle instead of every tensor autograd
/// saves inside it, and reruns `f` in backward to get those tensors back.
///
/// In backward the first handle unpacked restores the RNG state of the forward (when
/// `preserve_rng`) and its autocast state, reruns `f` on detached copies of the inputs
/// and stops it as soon as every tensor still needed is back. The original graph then
/// continues, so parameter gradients, `run_backward` to chosen tensors, `create_graph`
/// and `keep_graph` behave as without checkpointing. A backward inside `f` works too:
/// one that reaches the checkpoint's own tensors during the forward reruns `f` up to the
/// last tensor saved so far, and one inside a recomputation runs through the
/// recomputation's own graph, whose tensors live until the recomputation ends. An error or panic in `f` comes back
/// as `Err` from the forward, or from the backward call when the rerun fails. A
/// function that modifies an input in place is refused at the forward. When grad mode
/// is off, `f` simply runs.
///
/// With `preserve_rng`, checkpointed regions on different threads take turns (a
/// process-wide lock), so that each one's random draws are its own. A region waits at
/// most half a second for the lock, then runs anyway (a region may wait for a worker
/// thread that runs a checkpointed branch); a region whose generators' state moved
/// while a region of another thread ran fails (at the forward, or at the recomputation)
/// instead of replaying numbers that may be another thread's.
///
/// With `early_stop` (PyTorch's default), the recomputation is ended right after the
/// last tensor backward needs, by making the op that saves it fail: `f` is unwound from
/// there (a panic through tch's short-named ops, kept off stderr). Trap: the unwinding
/// poisons a `std::sync::Mutex` that `f` holds across that op and skips the rest of
/// `f`, a `join` of a thread it started included (the thread is left running). Without
/// it, `f` runs to its end and may stop early itself by asking [`recomputation_done`].
pub fn checkpoint(
    inputs: &[Tensor],
    preserve_rng: bool,
    early_stop: bool,
    f: CheckpointFn,
) -> Result<Vec<Tensor>> {
    checkpoint_named(inputs, None, preserve_rng, early_stop, false, f)
}

/// Whether the recomputation running on this thread has every tensor its backward needs
/// back: a checkpointed function run without early stop may return at once (what it
/// returns in a recomputation is not used). False outside recomputations.
pub fn recomputation_done() -> bool {
    // SAFETY: no arguments; the bridge function does not throw.
    unsafe { ffi::ms_checkpoint_recomputation_done() }
}

/// Runs `f` and then writes every running statistic that an op of `f` updated on this
/// thread (BatchNorm's and InstanceNorm's running mean and variance, the ops of
/// [`ops::sample_coupling_op`](crate::ops::sample_coupling_op)'s family) back to its
/// value before `f`: for runs that must not count as training steps (a profile, a
/// calibration, a planner's probe). Also when `f` panics (the panic goes on).
///
/// Only ops run on this thread are seen: a backward's engine threads update no
/// running statistics, so a forward run here is covered.
///
/// # Errors
/// Out of memory setting up the scope (then `f` is not run).
pub fn with_running_stats_preserved<R>(f: impl FnOnce() -> R) -> Result<R> {
    struct Scope(*mut c_void);
    impl Drop for Scope {
        fn drop(&mut self) {
            // SAFETY: the pointer came from ms_running_stats_scope_enter on this thread
            // (Scope is not Send) and is freed exactly once, here, in LIFO order since
            // scopes nest with the calls of this function.
            unsafe { ffi::ms_running_stats_scope_exit(self.0) }
        }
    }
    // SAFETY: no arguments; returns null on failure and never throws.
    let raw = unsafe { ffi::ms_running_stats_scope_enter() };
    if raw.is_null() {
        return Err(Error::new(
            "out of memory entering a running-statistics scope",
        ));
    }
    let _scope = Scope(raw);
    Ok(f())
}

/// [`checkpoint`] that does not keep its inputs either: at the forward, each defined
/// input is packed by the calling thread's innermost hook frame (push one with
/// [`hooks::push`](crate::hooks::push) around this call), which keeps it in its stead;
/// the recompute unpacks it. The packed inputs live as long as the checkpoint (until
/// the graph is freed), so a second backward with `keep_graph` unpacks them again.
/// Errors when no hook frame is pushed.
///
/// Trap: an input that something else still holds (the caller, a tensor saved by an
/// earlier op) stays in memory however it is packed.
pub fn checkpoint_packing_inputs(
    inputs: &[Tensor],
    preserve_rng: bool,
    early_stop: bool,
    f: CheckpointFn,
) -> Result<Vec<Tensor>> {
    checkpoint_named(inputs, None, preserve_rng, early_stop, true, f)
}

/// [`checkpoint`] (or, with `pack_inputs`, [`checkpoint_packing_inputs`]) whose error
/// messages call the function `name` (`None`: "the function"), e.g. "the function
/// checkpointed at src/model.rs:42:17": a failure in backward then says which
/// checkpointed function it came from.
pub fn checkpoint_named(
    inputs: &[Tensor],
    name: Option<&str>,
    preserve_rng: bool,
    early_stop: bool,
    pack_inputs: bool,
    f: CheckpointFn,
) -> Result<Vec<Tensor>> {
    quiet_early_stop_panics();
    let name = name.map(|n| CString::new(n.replace('\0', " ")).unwrap_or_default());
    let ptrs: Vec<*mut CTensor> = inputs.iter().map(|t| t.as_ptr() as *mut _).collect();
    let ctx = Box::into_raw(Box::new(ReentrantMutex::new(f))) as *mut c_void;
    let mut vec: *mut c_void = std::ptr::null_mut();
    // SAFETY: `ptrs` holds live at::Tensor pointers borrowed for the call; ownership of
    // `ctx` passes to the bridge, which calls `drop_closure` on it exactly once; `name`
    // is null or a NUL-terminated string the bridge copies before returning.
    check(unsafe {
        ffi::ms_checkpoint(
            ptrs.as_ptr(),
            ptrs.len(),
            ctx,
            run,
            drop_closure,
            name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
            preserve_rng,
            early_stop,
            pack_inputs,
            &mut vec,
        )
    })?;
    if vec.is_null() {
        return Err(Error::new("checkpoint: the bridge returned no outputs"));
    }
    take_tensor_vec(vec)
}

/// Reads and frees a vector handle returned by the bridge.
fn take_tensor_vec(vec: *mut c_void) -> Result<Vec<Tensor>> {
    // SAFETY: `vec` is a live vector handle returned by the bridge.
    let n = unsafe { ffi::ms_tensor_vec_len(vec) };
    let mut outputs = Vec::with_capacity(n);
    let mut failure = None;
    for i in 0..n {
        let mut t: *mut CTensor = std::ptr::null_mut();
        // SAFETY: `i < n`; on success `t` is a new at::Tensor owned by the Tensor that
        // wraps it.
        match check(unsafe { ffi::ms_tensor_vec_get(vec, i, &mut t) }) {
            // SAFETY: the bridge wrote a new at::Tensor that nothing else owns.
            Ok(()) => outputs.push(unsafe { Tensor::from_ptr(t.cast()) }),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    // SAFETY: the handle is freed exactly once, after its last use.
    unsafe { ffi::ms_tensor_vec_free(vec) };
    match failure {
        Some(e) => Err(e),
        None => Ok(outputs),
    }
}
