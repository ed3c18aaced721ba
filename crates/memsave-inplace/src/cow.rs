//! Copy-on-write in the style of `Rc::make_mut`: take the tensor by value, mutate it
//! when nobody else holds it, otherwise compute out of place.
use crate::exclusive::can_mutate_in_place;
use crate::stats::{record_copied, record_in_place};
use crate::{InplaceError, Result};
use tch::{TchError, Tensor};

/// Runs `in_place` on `x` when [`can_mutate_in_place`] says so and returns `x`;
/// otherwise returns `out_of_place(&x)` and drops `x`.
///
/// `in_place` must mutate its argument and compute what `out_of_place` would; its
/// return value (tch's alias of the mutated tensor) is dropped. Use tch's `f_` twins:
/// `|x| x.f_mul_(&y)` with `|x| x.f_mul(&y)`.
///
/// # Errors
/// [`InplaceError::Torch`] when the closure that ran fails; `x` is dropped then.
///
/// # Traps
/// This generic form only checks who holds `x`. The named helpers ([`f_add`](crate::f_add),
/// [`f_gelu`](crate::f_gelu), ...) also check what this one cannot know:
/// - broadcasting that would grow `x`, or a dtype promotion that `x` cannot hold (the
///   in-place op would fail or silently cast);
/// - ops whose in-place form makes autograd save a copy of the original `x` (`gelu_`,
///   `clamp_`, and `mul_` by a tensor that requires grad), which saves no memory.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let y = Tensor::ones([3], (Kind::Float, Device::Cpu));
/// let x = Tensor::ones([3], (Kind::Float, Device::Cpu));
/// let x = memsave_inplace::f_inplace_or(x, |x| x.f_sub_(&y), |x| x.f_sub(&y))?;
/// assert_eq!(x.sum(Kind::Float).double_value(&[]), 0.0);
/// # Ok::<(), memsave_inplace::InplaceError>(())
/// ```
pub fn f_inplace_or(
    x: Tensor,
    in_place: impl FnOnce(&mut Tensor) -> Result<Tensor, TchError>,
    out_of_place: impl FnOnce(&Tensor) -> Result<Tensor, TchError>,
) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)?;
    apply("inplace_or", x, allowed, in_place, out_of_place)
}

/// [`f_inplace_or`], panicking where it returns an error.
///
/// # Panics
/// When the operation fails (bad shape or dtype, ...).
pub fn inplace_or(
    x: Tensor,
    in_place: impl FnOnce(&mut Tensor) -> Result<Tensor, TchError>,
    out_of_place: impl FnOnce(&Tensor) -> Result<Tensor, TchError>,
) -> Tensor {
    f_inplace_or(x, in_place, out_of_place).unwrap_or_else(|e| panic!("{e}"))
}

/// The one place that mutates or copies, and counts which it did.
pub(crate) fn apply(
    op: &'static str,
    mut x: Tensor,
    in_place_allowed: bool,
    in_place: impl FnOnce(&mut Tensor) -> Result<Tensor, TchError>,
    out_of_place: impl FnOnce(&Tensor) -> Result<Tensor, TchError>,
) -> Result<Tensor> {
    if in_place_allowed {
        // libtorch checks its arguments before writing, so an error leaves `x` as it was.
        drop(in_place(&mut x).map_err(|e| InplaceError::torch(op, e))?);
        record_in_place(memsave_sys::tensor::nbytes(&x));
        Ok(x)
    } else {
        let y = out_of_place(&x).map_err(|e| InplaceError::torch(op, e))?;
        record_copied();
        Ok(y)
    }
}
