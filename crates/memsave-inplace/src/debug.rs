//! Debug checks that a closure did not mutate the tensors it was given.
use crate::version::mutations;
use crate::{InplaceError, Result};
use memsave_sys::tensor::version;
use tch::Tensor;

/// Runs `f` and returns its value, or [`InplaceError::Mutated`] naming each of
/// `inputs` (labelled `input 0`, `input 1`, ...) whose version changed while it ran.
///
/// Unlike [`VersionGuard`](crate::VersionGuard) this holds no extra handle, so it does
/// not change what the copy-on-write helpers see inside `f`.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let x = Tensor::ones([3], (Kind::Float, Device::Cpu));
/// let y = memsave_inplace::check_unmutated(&[&x], || x.relu())?;
/// let err = memsave_inplace::check_unmutated(&[&x], || x.shallow_clone().relu_()).unwrap_err();
/// assert!(err.to_string().contains("`input 0` was mutated 1 time(s)"), "{err}");
/// # Ok::<(), memsave_inplace::InplaceError>(())
/// ```
pub fn check_unmutated<R>(inputs: &[&Tensor], f: impl FnOnce() -> R) -> Result<R> {
    let before = inputs
        .iter()
        .map(|t| version(t))
        .collect::<Result<Vec<u64>, _>>()?;
    let value = f();
    let labels: Vec<String> = (0..inputs.len()).map(|i| format!("input {i}")).collect();
    let mutated = mutations(
        labels
            .iter()
            .zip(inputs)
            .zip(before)
            .map(|((label, t), v)| (label.as_str(), *t, v)),
    )?;
    if mutated.is_empty() {
        Ok(value)
    } else {
        Err(InplaceError::Mutated(mutated))
    }
}

/// Like `debug_assert!`: in debug builds runs `f` under [`check_unmutated`] and panics
/// with the mutations it names; in release builds just runs `f`.
///
/// # Panics
/// In debug builds, when `f` mutated one of `inputs` or a version could not be read.
pub fn debug_assert_unmutated<R>(inputs: &[&Tensor], f: impl FnOnce() -> R) -> R {
    if cfg!(debug_assertions) {
        check_unmutated(inputs, f).unwrap_or_else(|e| panic!("debug_assert_unmutated: {e}"))
    } else {
        f()
    }
}
