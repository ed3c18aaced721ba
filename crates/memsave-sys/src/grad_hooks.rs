//! Post-accumulate-grad hooks in Rust: a closure that runs on a leaf tensor right
//! after its gradient has been accumulated into `.grad` during backward (PyTorch's
//! `Tensor.register_post_accumulate_grad_hook`), the seam for fusing an optimizer step
//! into backward.
//!
//! The hook runs on the thread that executes the backward pass for the tensor's
//! device (the calling thread on the CPU, an autograd worker thread for CUDA), once per
//! backward in which the tensor receives a gradient. An error or a panic in the
//! closure makes that backward fail: tch's `f_backward` returns `Err` with the message.
//! libtorch keeps one such hook per tensor, so registering a second one is refused.
use crate::error::{callback_message, check, panic_message, CallbackError};
use crate::ffi::CTensor;
use crate::{ffi, Result};
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use tch::Tensor;

/// The closure of a hook: receives the tensor (whose `.grad` is set), or says why not
/// (any error: `String`s and `std::error::Error`s convert into [`CallbackError`]; the
/// backward fails with [`callback_message`]'s text of it).
pub type GradHookFn = Box<dyn FnMut(&Tensor) -> Result<(), CallbackError> + Send>;

type Shared = Mutex<GradHookFn>;

/// An installed hook; dropping it (or [`GradHookHandle::remove`]) uninstalls it.
///
/// The handle holds a reference to the tensor. Do not drop it from inside its own hook.
#[derive(Debug)]
pub struct GradHookHandle {
    tensor: Tensor,
    id: usize,
}

/// Called by the bridge each time the hook fires.
unsafe extern "C" fn run(ctx: *mut c_void, tensor: *const CTensor, status: *mut c_void) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `Box<Shared>` leaked in `register`; the bridge drops it
        // only when the hook is destroyed, after its last call.
        let shared = unsafe { &*(ctx as *const Shared) };
        // SAFETY: the bridge passes the live at::Tensor the hook fired for;
        // clone_from_ptr makes a new handle to it.
        let t = unsafe { Tensor::clone_from_ptr((tensor as *mut CTensor).cast()) };
        let mut f = shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // The error's text is made, and the error dropped, inside `catch_unwind`: its
        // `Display` or `Drop` is the caller's code and may panic.
        f(&t).map_err(|e| callback_message(&*e))
    }));
    let message = match result {
        Ok(Ok(())) => return,
        Ok(Err(message)) => message,
        Err(payload) => format!("panicked: {}", panic_message(&*payload)),
    };
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `status` is the live status object of this call; the bridge copies the
    // message before this CString is dropped.
    unsafe { ffi::ms_grad_hook_fail(status, message.as_ptr()) }
}

/// Called by the bridge exactly once, when the hook is destroyed.
unsafe extern "C" fn drop_hook(ctx: *mut c_void) {
    // A panic in a captured value's destructor must not unwind into C++.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `Box<Shared>` leaked in `register`, dropped only here.
        drop(unsafe { Box::from_raw(ctx as *mut Shared) });
    }));
}

/// Installs `f` as the post-accumulate-grad hook of `tensor`, a leaf that requires
/// grad and has no such hook yet.
///
/// Whatever the hook captures lives until the handle is dropped (or the tensor freed):
/// a closure that holds the tensor itself keeps it alive until then.
pub fn register_post_accumulate_grad_hook(
    tensor: &Tensor,
    f: GradHookFn,
) -> Result<GradHookHandle> {
    let ctx = Box::into_raw(Box::new(Mutex::new(f))) as *mut c_void;
    let mut id: *mut c_void = std::ptr::null_mut();
    // SAFETY: `tensor` is a live tch tensor; ownership of `ctx` passes to the bridge,
    // which calls `drop_hook` on it exactly once.
    check(unsafe {
        ffi::ms_grad_hook_register(tensor.as_ptr().cast(), ctx, run, drop_hook, &mut id)
    })?;
    Ok(GradHookHandle {
        tensor: tensor.shallow_clone(),
        id: id as usize,
    })
}

impl GradHookHandle {
    /// Uninstalls the hook; returns false when it was no longer the tensor's hook.
    pub fn remove(mut self) -> Result<bool> {
        self.uninstall()
    }

    fn uninstall(&mut self) -> Result<bool> {
        if self.id == 0 {
            return Ok(false);
        }
        let mut removed = false;
        // SAFETY: `tensor` is a live tch tensor; `id` is only compared, never dereferenced.
        check(unsafe {
            ffi::ms_grad_hook_remove(
                self.tensor.as_ptr().cast(),
                self.id as *mut c_void,
                &mut removed,
            )
        })?;
        self.id = 0;
        Ok(removed)
    }
}

impl Drop for GradHookHandle {
    fn drop(&mut self) {
        let _ = self.uninstall();
    }
}
