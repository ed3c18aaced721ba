//! A custom autograd node whose backward reruns a Rust closure (the mechanism of
//! gradient checkpointing; `memsave-checkpoint` builds the user-facing API on it).
use crate::error::check;
use crate::{ffi, Error, Result};
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use tch::Tensor;
use torch_sys::C_tensor;

/// The closure a checkpoint owns: maps its inputs to its outputs, or says why not.
pub type CheckpointFn = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>, String> + Send>;

type Shared = Mutex<CheckpointFn>;

/// The text of a panic payload (`panic!` with a literal or a formatted message).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_owned()
    }
}

fn report_failure(out: *mut c_void, message: &str) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `out` is the live Outputs object the bridge passed to `run`; the message
    // is copied by the bridge before this CString is dropped.
    unsafe { ffi::ms_outputs_fail(out, message.as_ptr()) }
}

/// Called by the bridge in the forward and in every recomputation.
unsafe extern "C" fn run(
    ctx: *mut c_void,
    inputs: *const *mut C_tensor,
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
            .map(|i| unsafe { Tensor::clone_from_ptr(*inputs.add(i)) })
            .collect();
        let mut f = shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&inputs)
    }));
    match result {
        Ok(Ok(outputs)) => {
            for t in &outputs {
                // SAFETY: `out` is the live Outputs object; the bridge copies the handle.
                unsafe { ffi::ms_outputs_push(out, t.as_ptr()) }
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

/// Runs `f(inputs)` without building a graph and attaches its floating-point outputs to
/// a node that reruns `f` in backward.
///
/// In backward the node restores the RNG state of the forward (when `preserve_rng`)
/// and its autocast state, reruns `f` with grad enabled on detached copies of the
/// inputs, back-propagates through the rerun (so parameter gradients accumulate as
/// without checkpointing, even when no input requires grad) and hands the inputs'
/// gradients on. An error or panic in `f` comes back as `Err` from the forward, or from
/// the `f_backward` call in backward. When grad mode is off, `f` simply runs.
pub fn checkpoint(inputs: &[Tensor], preserve_rng: bool, f: CheckpointFn) -> Result<Vec<Tensor>> {
    let ptrs: Vec<*mut C_tensor> = inputs.iter().map(|t| t.as_ptr() as *mut _).collect();
    let ctx = Box::into_raw(Box::new(Mutex::new(f))) as *mut c_void;
    let mut vec: *mut c_void = std::ptr::null_mut();
    // SAFETY: `ptrs` holds live at::Tensor pointers borrowed for the call; ownership of
    // `ctx` passes to the bridge, which calls `drop_closure` on it exactly once.
    check(unsafe {
        ffi::ms_checkpoint(
            ptrs.as_ptr(),
            ptrs.len(),
            ctx,
            run,
            drop_closure,
            preserve_rng,
            &mut vec,
        )
    })?;
    if vec.is_null() {
        return Err(Error::new("checkpoint: the bridge returned no outputs"));
    }
    // SAFETY: `vec` is the vector handle the bridge returned; each get() is a new
    // at::Tensor owned by the Tensor wrapping it, and the vector is freed once.
    let outputs = unsafe {
        let n = ffi::ms_tensor_vec_len(vec);
        let outputs = (0..n)
            .map(|i| Tensor::from_ptr(ffi::ms_tensor_vec_get(vec, i)))
            .collect();
        ffi::ms_tensor_vec_free(vec);
        outputs
    };
    Ok(outputs)
}
