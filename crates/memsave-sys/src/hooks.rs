//! Saved-tensor hooks: a thread-local stack of pack/unpack pairs that autograd consults
//! for every tensor it saves for backward (PyTorch's `saved_tensors_hooks`, which
//! libtorch otherwise offers to Python only). `memsave-hooks` builds the user-facing
//! scope on it.
//!
//! The first push installs memsave's autograd engine as libtorch's default: a subclass
//! of libtorch's engine that behaves like it and, in addition, asks the calling thread's
//! innermost frame for hooks whenever a tensor is saved.
//!
//! One difference from libtorch's engine: a backward that fails (an in-place update of
//! a saved tensor, an unpack hook's error, out of memory) without `keep_graph` frees the
//! saved tensors of every node it would have run, as a backward that succeeds does;
//! libtorch frees only the nodes it ran. That matters when the graph holds a reference
//! cycle: `x += f(x)` on a tensor `f` saved gives `x` a `grad_fn` that leads back to the
//! node holding `x`, and its backward fails before that node, so with libtorch's engine
//! the input and the weights stay allocated after every handle to them is dropped. The
//! trap: running backward through such a graph again fails with libtorch's "Trying to
//! backward through the graph a second time"; pass `keep_graph` to retry a backward.
use crate::error::{callback_message, check, panic_message, CallbackError};
use crate::ffi::CTensor;
use crate::{ffi, Error, Result};
use std::any::Any;
use std::ffi::{c_char, c_void, CString};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// What a pack hook keeps in place of a saved tensor.
pub type Packed = Box<dyn Any + Send>;

/// The bridge may unpack on any engine thread: the packed value is reached through a
/// lock, so it needs to be `Send` only.
type Stored = Mutex<Packed>;

/// A pack/unpack pair. Both run with grad mode off; `pack` runs on the thread that saves
/// the tensor (the forward's), `unpack` on whichever thread runs that part of backward.
pub trait RawHooks: Send + Sync + 'static {
    /// Keeps `tensor` (or what is needed to rebuild it); an `Err` is reported, naming
    /// the tensor, when backward needs it (as [`callback_message`]'s text: libtorch
    /// takes no Rust error). `saved_by` is the aten op that saved it (`aten::addmm`)
    /// when [`records_ops`](Self::records_ops) is true.
    fn pack(
        &self,
        tensor: &Tensor,
        saved_by: Option<&str>,
    ) -> std::result::Result<Packed, CallbackError>;
    /// Whether `pack` wants `saved_by`: tracking the running op costs a callback per op
    /// while the frame is pushed.
    fn records_ops(&self) -> bool {
        false
    }
    /// Rebuilds the tensor from what `pack` kept; it must have the packed shape and dtype.
    /// An `Err` fails the backward with [`callback_message`]'s text.
    fn unpack(&self, packed: &Packed) -> std::result::Result<Tensor, CallbackError>;
}

type Ctx = Arc<dyn RawHooks>;

fn write_error(sink: *mut c_void, message: &str) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `sink` is the live std::string the bridge passed; it copies the message.
    unsafe { ffi::ms_error_sink_set(sink, message.as_ptr()) }
}

/// The bridge status of a hook call: 0, or 1 after writing its error or panic to `error`.
///
/// Callers turn a hook's error into its text inside their `catch_unwind` ([`caught`]):
/// the error's `Display` and `Drop` are the user's code and may panic.
fn status(result: std::thread::Result<std::result::Result<(), Failed>>, error: *mut c_void) -> i32 {
    let message = match result {
        Ok(Ok(())) => return 0,
        Ok(Err(Failed(message))) => message,
        Err(payload) => format!("panicked: {}", panic_message(&*payload)),
    };
    write_error(error, &message);
    1
}

/// A hook that failed: its error's text, for libtorch.
struct Failed(String);

/// A hook's error as its text, made (and the error dropped) where a panic of its
/// `Display` or `Drop` is still caught.
fn caught(e: CallbackError) -> Failed {
    Failed(callback_message(&*e))
}

unsafe extern "C" fn pack(
    ctx: *mut c_void,
    t: *const CTensor,
    saved_by: *const c_char,
    packed: *mut *mut c_void,
    error: *mut c_void,
) -> i32 {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `Box<Ctx>` leaked in `push`, alive until `drop_ctx`.
        let hooks = unsafe { &*(ctx as *const Ctx) };
        // SAFETY: `t` is a live at::Tensor for the call; this makes a new handle to it.
        let tensor = unsafe { Tensor::clone_from_ptr((t as *mut CTensor).cast()) };
        let saved_by = (!saved_by.is_null())
            // SAFETY: a non-null `saved_by` is a NUL-terminated op name that outlives the call.
            .then(|| unsafe { std::ffi::CStr::from_ptr(saved_by) }.to_string_lossy());
        let p = hooks.pack(&tensor, saved_by.as_deref()).map_err(caught)?;
        // SAFETY: `packed` is a valid out-pointer; ownership passes to the bridge,
        // which hands it back to `free_packed` exactly once.
        unsafe { *packed = Box::into_raw(Box::new(Stored::new(p))) as *mut c_void };
        Ok(())
    }));
    status(result, error)
}

unsafe extern "C" fn unpack(
    ctx: *mut c_void,
    packed: *mut c_void,
    out: *mut CTensor,
    error: *mut c_void,
) -> i32 {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in `pack`.
        let hooks = unsafe { &*(ctx as *const Ctx) };
        // SAFETY: `packed` is the Box<Stored> that `pack` returned; the bridge still owns it.
        let stored = unsafe { &*(packed as *const Stored) };
        let packed = stored
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let t = hooks.unpack(&packed).map_err(caught)?;
        // SAFETY: `out` is a live at::Tensor slot of the bridge; the handle is copied.
        unsafe { ffi::ms_tensor_assign(out, t.as_ptr().cast()) };
        Ok(())
    }));
    status(result, error)
}

unsafe extern "C" fn free_packed(_ctx: *mut c_void, packed: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `packed` came from `Box::into_raw` in `pack`; freed only here, once.
        drop(unsafe { Box::from_raw(packed as *mut Stored) });
    }));
}

unsafe extern "C" fn drop_ctx(ctx: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` came from `Box::into_raw` in `push`; dropped only here, once.
        drop(unsafe { Box::from_raw(ctx as *mut Ctx) });
    }));
}

/// A frame pushed on the calling thread's hook stack; removed when dropped.
///
/// Not `Send`: the stack is per thread, so a frame must be left on the thread that
/// entered it. A frame is removed from wherever it is on the stack when it is dropped
/// or exited, so frames left out of order never leave hooks behind; the frames pushed
/// after it stay in force. [`HookFrame::exit`] says when it was not the innermost.
#[derive(Debug)]
pub struct HookFrame {
    id: u64,
    exited: bool,
    _not_send: PhantomData<*const ()>,
}

/// Pushes `hooks` as the calling thread's innermost saved-tensor hooks.
pub fn push(hooks: Arc<dyn RawHooks>) -> Result<HookFrame> {
    let record_ops = hooks.records_ops();
    let ctx = Box::into_raw(Box::new(hooks)) as *mut c_void;
    let mut id = 0u64;
    // SAFETY: ownership of `ctx` passes to the bridge, which calls `drop_ctx` exactly
    // once; the callbacks match the bridge's signatures; `id` is writable.
    check(unsafe {
        ffi::ms_hooks_push(
            ctx,
            pack,
            unpack,
            free_packed,
            drop_ctx,
            record_ops,
            &mut id,
        )
    })?;
    Ok(HookFrame {
        id,
        exited: false,
        _not_send: PhantomData,
    })
}

impl HookFrame {
    /// Removes this frame; `Err` when it was not the innermost one (frames left out of
    /// order). The frame is removed in either case.
    pub fn exit(mut self) -> Result<()> {
        self.exited = true;
        match pop(self.id)? {
            1 => Ok(()),
            2 => Err(Error::new(
                "saved_tensors_hooks: a hook scope was left while a scope entered after it was still \
                 open (left out of order); its hooks are removed, the newer scope's stay until it is \
                 left; leave scopes in reverse order of entry",
            )),
            _ => Err(Error::new(
                "saved_tensors_hooks: the hook scope was already gone from this thread's stack",
            )),
        }
    }
}

/// Removes frame `id` from the calling thread's stack: 0 not found, 1 it was the
/// innermost, 2 it was under newer frames.
fn pop(id: u64) -> Result<i32> {
    let mut popped = 0;
    // SAFETY: plain values and a writable int; the bridge catches every exception.
    check(unsafe { ffi::ms_hooks_pop(id, &mut popped) })?;
    Ok(popped)
}

impl Drop for HookFrame {
    fn drop(&mut self) {
        if !self.exited {
            let _ = pop(self.id);
        }
    }
}

/// Installs memsave's autograd engine as libtorch's default (idempotent). Pushing a
/// frame or checkpointing does this; call it first to make later behaviour independent
/// of which comes first, and so that a backward that fails frees its graph (see the
/// [module docs](self)) even in a process that never pushes hooks.
pub fn install_engine() -> Result<()> {
    // SAFETY: no arguments; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_hooks_install_engine() })
}

/// The name of the autograd node the calling thread is running in backward
/// (`AddmmBackward0`), or `None` outside backward. Called from an unpack hook, it names
/// the node that saved the tensor being unpacked: PyTorch's name for whose saved
/// tensor it is (`grad_fn._saved_mat1` of an `AddmmBackward0`).
pub fn current_autograd_node_name() -> Result<Option<String>> {
    let mut sink: *mut c_void = std::ptr::null_mut();
    // SAFETY: `sink` is a writable pointer; on success it owns a new std::string.
    check(unsafe { ffi::ms_string_new(&mut sink) })?;
    let mut has = false;
    // SAFETY: `sink` is the string made above.
    let status = check(unsafe { ffi::ms_current_autograd_node_name(sink, &mut has) });
    // SAFETY: `sink` is a live std::string; its text is copied before it is freed once.
    let name = unsafe { std::ffi::CStr::from_ptr(ffi::ms_string_data(sink)) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: freed exactly once, after its last use.
    unsafe { ffi::ms_string_free(sink) };
    status?;
    Ok(has.then_some(name))
}

/// The name of the autograd node that produced `t` (`AddmmBackward0`), or `None` for a
/// leaf or a tensor without history.
pub fn grad_fn_name(t: &Tensor) -> Result<Option<String>> {
    let mut sink: *mut c_void = std::ptr::null_mut();
    // SAFETY: `sink` is a writable pointer; on success it owns a new std::string.
    check(unsafe { ffi::ms_string_new(&mut sink) })?;
    let mut has = false;
    // SAFETY: `t` is a live tch tensor and `sink` the string made above.
    let status = check(unsafe { ffi::ms_tensor_grad_fn_name(t.as_ptr().cast(), sink, &mut has) });
    // SAFETY: `sink` is a live std::string; its text is copied before it is freed once.
    let name = unsafe { std::ffi::CStr::from_ptr(ffi::ms_string_data(sink)) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: freed exactly once, after its last use.
    unsafe { ffi::ms_string_free(sink) };
    status?;
    Ok(has.then_some(name))
}
