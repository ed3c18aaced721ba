//! Which ops a piece of work runs, as libtorch's dispatcher sees them.
//!
//! [`sample_coupling_op`] tells whether a step computes any sample's output from other
//! samples of the batch (BatchNorm in training mode normalizes with the whole batch's
//! statistics). Where one does, splitting the batch into micro-batches and accumulating
//! gradients is not the same step: the gradients and the running statistics change.
use crate::error::check;
use crate::{ffi, Result};
use std::ffi::c_void;

/// Runs `f` on this thread and says which op, if any, coupled the samples of a batch
/// while it ran: the name of the first batch-norm-family op in training mode the
/// dispatcher records (`aten::_batch_norm_impl_index` for tch's `batch_norm` on the CPU;
/// also `aten::native_batch_norm`, `aten::_native_batch_norm_legit`,
/// `aten::_batch_norm_with_update`, cuDNN's and MIOpen's). In evaluation mode they use
/// their running statistics and couple nothing. Layer, group and instance norm
/// normalize each sample on its own and are not counted.
///
/// Trap: only ops run on the calling thread are seen.
///
/// ```
/// use tch::{nn, nn::ModuleT, Device, Kind, Tensor};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let bn = nn::batch_norm1d(vs.root(), 3, Default::default());
/// let x = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
/// let (_, op) = memsave_sys::ops::sample_coupling_op(|| bn.forward_t(&x, true)).unwrap();
/// assert!(op.is_some_and(|op| op.contains("batch_norm")));
/// let (_, op) = memsave_sys::ops::sample_coupling_op(|| bn.forward_t(&x, false)).unwrap();
/// assert_eq!(op, None);
/// ```
pub fn sample_coupling_op<T>(f: impl FnOnce() -> T) -> Result<(T, Option<String>)> {
    let recorder = Recorder::begin()?;
    let value = f();
    let op = recorder.end()?;
    Ok((value, op))
}

/// A recording in progress; ended (and freed) exactly once, by `end` or on drop.
struct Recorder(*mut c_void);

impl Recorder {
    fn begin() -> Result<Self> {
        let mut recorder: *mut c_void = std::ptr::null_mut();
        // SAFETY: `recorder` is a writable pointer; on success it owns a new recorder.
        check(unsafe { ffi::ms_coupling_begin(&mut recorder) })?;
        Ok(Self(recorder))
    }

    fn end(mut self) -> Result<Option<String>> {
        let recorder = std::mem::replace(&mut self.0, std::ptr::null_mut());
        end(recorder)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if !self.0.is_null() {
            let _ = end(self.0);
        }
    }
}

fn end(recorder: *mut c_void) -> Result<Option<String>> {
    let mut sink: *mut c_void = std::ptr::null_mut();
    // SAFETY: `sink` is a writable pointer; on success it owns a new std::string.
    let made = check(unsafe { ffi::ms_string_new(&mut sink) });
    let mut found = false;
    // SAFETY: `recorder` came from ms_coupling_begin and is ended only here, once (the
    // bridge frees it in every case); `sink` is null only if making it failed, and the
    // bridge writes to it only when it is not.
    let status = check(unsafe { ffi::ms_coupling_end(recorder, sink, &mut found) });
    made?;
    // SAFETY: `sink` is a live std::string; its text is copied before it is freed once.
    let name = unsafe { std::ffi::CStr::from_ptr(ffi::ms_string_data(sink)) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: freed exactly once, after its last use.
    unsafe { ffi::ms_string_free(sink) };
    status?;
    Ok(found.then_some(name))
}
