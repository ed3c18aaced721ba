//! The default CPU generator's state, which tch does not expose (it has
//! `tch::manual_seed` only): save it before work that draws random numbers and put it
//! back after, and the numbers drawn next are the ones that would have been drawn
//! without that work. `memsave_fit::fit` does so around its probe runs.
//!
//! Trap: only the CPU generator; CUDA generators have states of their own.
use crate::error::check;
use crate::ffi::CTensor;
use crate::{ffi, Result};
use tch::Tensor;

/// A copy of the default CPU generator's state (a uint8 CPU tensor, as PyTorch's
/// `torch.get_rng_state()` returns): later draws do not change it.
///
/// ```
/// use tch::{Kind, Device, Tensor};
/// let state = memsave_sys::rng::cpu_state().unwrap();
/// let a = Tensor::rand([4], (Kind::Float, Device::Cpu));
/// memsave_sys::rng::set_cpu_state(&state).unwrap();
/// let b = Tensor::rand([4], (Kind::Float, Device::Cpu));
/// assert!(a.equal(&b));
/// // Not a generator's state: an error, nothing changed.
/// assert!(memsave_sys::rng::set_cpu_state(&Tensor::zeros([3], (Kind::Float, Device::Cpu))).is_err());
/// ```
pub fn cpu_state() -> Result<Tensor> {
    let mut out: *mut CTensor = std::ptr::null_mut();
    // SAFETY: `out` is a writable pointer; on success the bridge writes a new
    // at::Tensor to it that nothing else owns.
    check(unsafe { ffi::ms_rng_cpu_state(&mut out) })?;
    // SAFETY: a new at::Tensor owned by the Tensor that wraps it from now on.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

/// Makes `state` (from [`cpu_state`]) the default CPU generator's state (PyTorch's
/// `torch.set_rng_state`). Fails, changing nothing, on a tensor that is not such a
/// state.
pub fn set_cpu_state(state: &Tensor) -> Result<()> {
    // SAFETY: `state` is a live tensor for the call; the bridge only reads it.
    check(unsafe { ffi::ms_rng_set_cpu_state(state.as_ptr().cast()) })
}
