//! Tensor introspection that tch does not expose: reference counts, versions, grad mode.
use crate::error::check;
use crate::{ffi, Result};
use tch::Tensor;

/// Number of handles to the tensor's `TensorImpl` (tch handles, shallow clones and
/// tensors autograd saved as inputs all count).
pub fn use_count(t: &Tensor) -> Result<u64> {
    let mut out = 0i64;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_use_count(t.as_ptr().cast(), &mut out) })?;
    Ok(out.max(0) as u64)
}

/// Number of `TensorImpl`s sharing the tensor's storage (views and outputs saved by
/// autograd count); 0 for a tensor without storage.
pub fn storage_use_count(t: &Tensor) -> Result<u64> {
    let mut out = 0i64;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_storage_use_count(t.as_ptr().cast(), &mut out) })?;
    Ok(out.max(0) as u64)
}

/// Bytes of the tensor's storage (PyTorch's `t.untyped_storage().nbytes()`): all of
/// it, whatever part the tensor views (a slice of a dataset counts the dataset); 0 for
/// a tensor without storage.
pub fn storage_nbytes(t: &Tensor) -> Result<u64> {
    let mut out = 0i64;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_storage_nbytes(t.as_ptr().cast(), &mut out) })?;
    Ok(out.max(0) as u64)
}

/// The address of the start of the tensor's storage (PyTorch's
/// `t.untyped_storage().data_ptr()`): the same for every view of one storage, so a key
/// to count each storage once while the tensors are alive; 0 for a tensor without
/// storage or with an empty one.
pub fn storage_data_ptr(t: &Tensor) -> Result<usize> {
    let mut out = 0usize;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*; `out`
    // is a valid, writable usize for the duration of the call.
    check(unsafe { ffi::ms_tensor_storage_data_ptr(t.as_ptr().cast(), &mut out) })?;
    Ok(out)
}

/// The tensor's version counter: bumped by every in-place operation on it or its views.
pub fn version(t: &Tensor) -> Result<u64> {
    let mut out = 0i64;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_version(t.as_ptr().cast(), &mut out) })?;
    Ok(out.max(0) as u64)
}

/// Whether autograd records operations on this thread: `false` under `no_grad`
/// (PyTorch's `torch.is_grad_enabled()`).
pub fn grad_enabled() -> Result<bool> {
    let mut out: std::os::raw::c_int = 0;
    // SAFETY: `out` is a live, writable c_int for the call.
    check(unsafe { ffi::ms_grad_enabled(&mut out) })?;
    Ok(out != 0)
}

/// Bytes of the tensor's elements as its shape sees them: `numel × element size`
/// (PyTorch's `Tensor.nbytes`), with no call into libtorch.
///
/// Trap: this is the view's size, not its storage's. A slice counts only its own
/// elements, an `expand`ed tensor counts every repeated element though they share one,
/// and two views of one storage each count in full; to count memory held, count each
/// storage once.
pub fn nbytes(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

/// Copies `data` into `t` (a contiguous CPU `Uint8` tensor) from byte `offset` on,
/// with no temporary tensor. An `Err` if `t` is not such a tensor or the bytes would
/// not fit in it. Trap: autograd's version counter is not bumped; fill a tensor you
/// just made, not one autograd may have saved.
pub fn write_bytes(t: &Tensor, offset: usize, data: &[u8]) -> Result<()> {
    let too_far = || crate::Error::new(format!("writing bytes at {offset}: out of range"));
    let offset = i64::try_from(offset).map_err(|_| too_far())?;
    let len = i64::try_from(data.len()).map_err(|_| too_far())?;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*; `data`
    // is a live slice of `len` bytes, and the C++ side checks, without overflow, that
    // the range lies inside `t` before copying.
    check(unsafe { ffi::ms_tensor_write_bytes(t.as_ptr().cast(), offset, data.as_ptr(), len) })
}

/// A weak handle to a tensor's storage: it does not keep the storage's data alive, and
/// tells whether another tensor uses that very storage. An address alone cannot:
/// once the first storage is freed, a new one may get the same address.
#[derive(Debug)]
pub struct WeakStorage(std::ptr::NonNull<std::ffi::c_void>);

// SAFETY: the handle is a heap-allocated c10::weak_intrusive_ptr, whose reference
// counts are atomic; `lock()` and destruction are safe from any thread.
unsafe impl Send for WeakStorage {}
// SAFETY: as above; `is_storage_of` only reads the handle.
unsafe impl Sync for WeakStorage {}

impl WeakStorage {
    /// A weak handle to `t`'s storage; `Err` for a tensor without storage.
    pub fn new(t: &Tensor) -> Result<Self> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*;
        // `out` is written only on success.
        check(unsafe { ffi::ms_storage_weak_new(t.as_ptr().cast(), &mut out) })?;
        std::ptr::NonNull::new(out)
            .map(WeakStorage)
            .ok_or_else(|| crate::Error::new("no storage handle was made"))
    }

    /// True when the storage is still alive and `t` uses it.
    pub fn is_storage_of(&self, t: &Tensor) -> Result<bool> {
        let mut out = false;
        // SAFETY: `self.0` came from ms_storage_weak_new and is freed only on drop;
        // `t` is a live tch tensor.
        check(unsafe {
            ffi::ms_storage_weak_is_storage_of(self.0.as_ptr(), t.as_ptr().cast(), &mut out)
        })?;
        Ok(out)
    }
}

impl WeakStorage {
    /// True while the storage's data is alive: something still holds a tensor on it.
    pub fn is_alive(&self) -> Result<bool> {
        let mut out = false;
        // SAFETY: `self.0` came from ms_storage_weak_new and is freed only on drop.
        check(unsafe { ffi::ms_storage_weak_alive(self.0.as_ptr(), &mut out) })?;
        Ok(out)
    }
}

impl Drop for WeakStorage {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from ms_storage_weak_new and is freed exactly once, here.
        unsafe { ffi::ms_storage_weak_free(self.0.as_ptr()) }
    }
}

/// True when the tensor is a view of another tensor's storage.
pub fn is_view(t: &Tensor) -> Result<bool> {
    let mut out = false;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_is_view(t.as_ptr().cast(), &mut out) })?;
    Ok(out)
}

/// True when the tensor is a view of a leaf that requires grad (a parameter seen
/// through `t()`, as a linear layer saves its weight): it lives as long as the leaf.
pub fn is_view_of_grad_leaf(t: &Tensor) -> Result<bool> {
    let mut out = false;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_is_view_of_grad_leaf(t.as_ptr().cast(), &mut out) })?;
    Ok(out)
}

/// For a view, the number of handles to its base `TensorImpl` (1: only the view holds
/// it); `None` when the tensor is not a view.
pub fn base_use_count(t: &Tensor) -> Result<Option<u64>> {
    let mut out = 0i64;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*.
    check(unsafe { ffi::ms_tensor_base_use_count(t.as_ptr().cast(), &mut out) })?;
    Ok((out >= 0).then_some(out as u64))
}

/// How a view that autograd tracks was created (libtorch's `CreationMeta`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewCreation {
    /// An ordinary view, made in grad mode by a single-output view op.
    Default,
    /// Returned by a custom autograd function.
    InCustomFunction,
    /// One of several views returned by one op (`chunk`, `split`, `unbind`).
    MultiOutputNode,
    /// Made while grad mode was off (`no_grad`).
    NoGradMode,
    /// Made in inference mode.
    InferenceMode,
}

/// For a view that autograd tracks (a backward-differentiable view), how it was
/// created; `None` for any other tensor, views that autograd does not track included.
///
/// libtorch refuses an in-place write to a view created any way but
/// [`ViewCreation::Default`] when autograd records the write (grad mode on and an
/// operand that requires grad): "Output 0 of SplitBackward0 is a view and is being
/// modified inplace...", "A view was created in no_grad mode...".
pub fn view_creation(t: &Tensor) -> Result<Option<ViewCreation>> {
    let mut out = -1i32;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*, and
    // `out` is a valid, writable i32 for the duration of the call.
    check(unsafe { ffi::ms_tensor_view_creation_meta(t.as_ptr().cast(), &mut out) })?;
    match out {
        -1 => Ok(None),
        0 => Ok(Some(ViewCreation::Default)),
        1 => Ok(Some(ViewCreation::InCustomFunction)),
        2 => Ok(Some(ViewCreation::MultiOutputNode)),
        3 => Ok(Some(ViewCreation::NoGradMode)),
        4 => Ok(Some(ViewCreation::InferenceMode)),
        other => Err(crate::Error::new(format!(
            "libtorch reported an unknown view creation kind {other}"
        ))),
    }
}

/// Drops the tensor's gradient (PyTorch's `p.grad = None`), freeing its memory, where
/// tch's `zero_grad` only fills it with zeros.
pub fn set_grad_none(t: &Tensor) -> Result<()> {
    // SAFETY: `t` is a live tch tensor; mutable_grad() is changed through the shared
    // TensorImpl, which tch itself does for its in-place operations on `&Tensor`.
    check(unsafe { ffi::ms_tensor_set_grad_none(t.as_ptr() as *mut _) })
}

/// Sets the tensor's gradient to `grad` (PyTorch's `p.grad = g`), which must have the
/// tensor's dtype, device and shape; the gradient shares `grad`'s memory.
pub fn set_grad(t: &Tensor, grad: &Tensor) -> Result<()> {
    // SAFETY: both are live tch tensors; mutable_grad() is changed through the shared
    // TensorImpl, as in `set_grad_none`.
    check(unsafe { ffi::ms_tensor_set_grad(t.as_ptr() as *mut _, grad.as_ptr().cast()) })
}

/// Back-propagates `grads` from `tensors` (PyTorch's `torch.autograd.backward(tensors,
/// grads)`), accumulating into every leaf that requires grad. tch's `backward` only
/// starts from a scalar with an implicit gradient of one.
pub fn backward_with_grads(tensors: &[Tensor], grads: &[Tensor], keep_graph: bool) -> Result<()> {
    if tensors.len() != grads.len() {
        return Err(crate::Error::new(format!(
            "backward_with_grads: {} tensors but {} gradients",
            tensors.len(),
            grads.len()
        )));
    }
    let roots: Vec<*mut crate::ffi::CTensor> =
        tensors.iter().map(|t| t.as_ptr() as *mut _).collect();
    let root_grads: Vec<*mut crate::ffi::CTensor> =
        grads.iter().map(|t| t.as_ptr() as *mut _).collect();
    // SAFETY: both arrays hold live at::Tensor pointers borrowed for the call and have
    // the same length, checked above.
    check(unsafe {
        ffi::ms_backward_with_grads(roots.as_ptr(), root_grads.as_ptr(), roots.len(), keep_graph)
    })
}

/// True when autograd records operations on this thread.
pub fn grad_mode_enabled() -> bool {
    // SAFETY: reads a thread-local flag.
    unsafe { ffi::ms_grad_mode_enabled() }
}

/// Enables or disables grad mode on this thread; prefer tch's `no_grad` guards.
pub fn set_grad_mode_enabled(enabled: bool) {
    // SAFETY: writes a thread-local flag.
    unsafe { ffi::ms_grad_mode_set_enabled(enabled) }
}

/// Multiplies each tensor by `inv_scale` in place and sets `found_inf` (a one-element
/// f32 tensor) to 1.0 when any value is inf or NaN; libtorch's
/// `_amp_foreach_non_finite_check_and_unscale_`.
pub fn amp_non_finite_check_and_unscale(
    tensors: &[Tensor],
    found_inf: &Tensor,
    inv_scale: &Tensor,
) -> Result<()> {
    let ptrs: Vec<*mut crate::ffi::CTensor> =
        tensors.iter().map(|t| t.as_ptr() as *mut _).collect();
    // SAFETY: every pointer comes from a live tch tensor borrowed for the call; the
    // kernel mutates them through their shared TensorImpls.
    check(unsafe {
        ffi::ms_amp_non_finite_check_and_unscale(
            ptrs.as_ptr(),
            ptrs.len(),
            found_inf.as_ptr() as *mut _,
            inv_scale.as_ptr().cast(),
        )
    })
}

/// `t += value * t1 * t2` in place: PyTorch's `t.addcmul_(t1, t2, value=value)`. tch's
/// `addcmul_` has no `value`, and its ops that take a number panic when they fail (see
/// memsave-optim's `number` module); here the number reaches the kernel as a C++
/// `Scalar`, so the op allocates nothing (a number passed as a 0-dim tensor costs one)
/// and a failure is an error. `value` is rounded to `t`'s kind as libtorch rounds it.
pub fn addcmul_(t: &mut Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<()> {
    // SAFETY: the three are live tch tensors borrowed for the call; `t` is changed in
    // place through its TensorImpl, as tch's own in-place ops do.
    check(unsafe {
        ffi::ms_addcmul_(
            t.as_mut_ptr().cast(),
            t1.as_ptr().cast(),
            t2.as_ptr().cast(),
            value,
        )
    })
}

/// `t += value * t1 / t2` in place: PyTorch's `t.addcdiv_(t1, t2, value=value)`; see
/// [`addcmul_`].
pub fn addcdiv_(t: &mut Tensor, t1: &Tensor, t2: &Tensor, value: f64) -> Result<()> {
    // SAFETY: as in `addcmul_`.
    check(unsafe {
        ffi::ms_addcdiv_(
            t.as_mut_ptr().cast(),
            t1.as_ptr().cast(),
            t2.as_ptr().cast(),
            value,
        )
    })
}

/// Turns autograd's anomaly detection on or off for the process (PyTorch's
/// `torch.autograd.set_detect_anomaly`): a failing backward then names the forward op
/// whose node failed, and NaNs produced in backward become errors. Slow: for debugging.
pub fn set_detect_anomaly(enabled: bool) -> Result<()> {
    // SAFETY: a plain value; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_set_detect_anomaly(enabled) })
}

/// Whether anomaly detection is on (see [`set_detect_anomaly`]).
pub fn is_anomaly_enabled() -> Result<bool> {
    let mut out = false;
    // SAFETY: `out` is a valid, writable bool; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_is_anomaly_enabled(&mut out) })?;
    Ok(out)
}

#[cfg(test)]
mod anomaly_tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn anomaly_detection_toggles_and_the_hint_names_the_rust_call() {
        set_detect_anomaly(true).unwrap();
        assert!(is_anomaly_enabled().unwrap());
        set_detect_anomaly(false).unwrap();
        assert!(!is_anomaly_enabled().unwrap());
        // libtorch's own version check: its hint must come out in Rust terms.
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let h = &x * 2.0;
        let y = h.exp();
        let _ = y.shallow_clone().g_add_scalar_(1.0);
        let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
        let rust = crate::in_rust_terms(&err);
        assert!(
            err.contains("torch.autograd.set_detect_anomaly(True"),
            "{err}"
        );
        assert!(
            rust.contains("memsave_sys::tensor::set_detect_anomaly(true)")
                && !rust.contains("(True"),
            "{rust}"
        );
    }
}

#[cfg(test)]
mod pointwise_tests {
    use super::{addcdiv_, addcmul_};
    use tch::{Device, Kind, Tensor};

    #[test]
    fn addcmul_and_addcdiv_take_a_value_and_report_a_bad_shape() {
        let mut t = Tensor::from_slice(&[1.0f32, 2.0]);
        let a = Tensor::from_slice(&[3.0f32, 4.0]);
        let b = Tensor::from_slice(&[0.5f32, 2.0]);
        addcmul_(&mut t, &a, &b, 0.5).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.75, 6.0]);
        addcdiv_(&mut t, &a, &b, -0.25).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [0.25, 5.5]);
        let wrong = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let e = addcmul_(&mut t, &a, &wrong, 1.0).unwrap_err();
        assert!(e.to_string().contains("size"), "{e}");
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [0.25, 5.5]);
    }
}

#[cfg(test)]
mod nbytes_tests {
    use super::nbytes;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn nbytes_is_elements_times_element_size_for_each_kind() {
        let cpu = Device::Cpu;
        assert_eq!(nbytes(&Tensor::zeros([3, 5], (Kind::Float, cpu))), 60);
        assert_eq!(nbytes(&Tensor::zeros([7], (Kind::BFloat16, cpu))), 14);
        assert_eq!(nbytes(&Tensor::zeros([2, 3, 4], (Kind::Int8, cpu))), 24);
        assert_eq!(nbytes(&Tensor::zeros([5], (Kind::Int64, cpu))), 40);
        assert_eq!(nbytes(&Tensor::zeros([9], (Kind::Bool, cpu))), 9);
        assert_eq!(nbytes(&Tensor::zeros([0, 8], (Kind::Float, cpu))), 0);
        assert_eq!(nbytes(&Tensor::from(2.5f64)), 8);
    }

    #[test]
    fn nbytes_of_a_view_counts_the_view_not_its_storage() {
        let base = Tensor::zeros([10, 4], (Kind::Float, Device::Cpu));
        assert_eq!(nbytes(&base.narrow(0, 1, 2)), 32);
        assert_eq!(nbytes(&base.select(1, 0)), 40);
        // One row's storage, a hundred rows seen.
        let row = Tensor::zeros([1, 4], (Kind::Float, Device::Cpu));
        assert_eq!(nbytes(&row.expand([100, 4], false)), 1600);
    }
}

#[cfg(test)]
mod storage_nbytes_tests {
    use super::storage_nbytes;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_slice_counts_its_whole_storage() {
        let data = Tensor::zeros([10, 4], (Kind::Float, Device::Cpu));
        assert_eq!(storage_nbytes(&data).unwrap(), 160);
        assert_eq!(storage_nbytes(&data.narrow(0, 0, 2)).unwrap(), 160);
        assert_eq!(storage_nbytes(&data.get(3)).unwrap(), 160);
        let own = data.narrow(0, 0, 2).copy();
        assert_eq!(storage_nbytes(&own).unwrap(), 32);
        use super::storage_data_ptr;
        let base = storage_data_ptr(&data).unwrap();
        assert_ne!(base, 0);
        assert_eq!(storage_data_ptr(&data.narrow(0, 3, 2)).unwrap(), base);
        assert_ne!(storage_data_ptr(&own).unwrap(), base);
    }
}
