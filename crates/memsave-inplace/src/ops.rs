//! The named copy-on-write operations: `residual_add`, `add`, `mul`, `relu`, `gelu`,
//! `dropout`, `clamp`. Each `f_` function returns a `Result`; its short twin panics.
use crate::cow::apply;
use crate::exclusive::can_mutate_in_place;
use crate::fits::{binary_fits, scalar_keeps_kind, Category};
use crate::{InplaceError, Result};
use memsave_sys::tensor::grad_mode_enabled;
use tch::Tensor;

/// True when autograd will record an op on `x` (grad mode is on and `x` requires grad).
fn autograd_records(x: &Tensor) -> bool {
    grad_mode_enabled() && x.requires_grad()
}

fn or_panic(r: Result<Tensor>) -> Tensor {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// `x + fx` for the residual update `x = x + f(x)`, in place when nobody else holds `x`.
///
/// In training, `f` usually saved `x` for its backward (a `linear` does), so `x` is
/// shared and this computes `x + fx` out of place: the in-place `x += f(x)` would make
/// backward fail. Under `no_grad` nothing is saved and `x` is updated in place, so a
/// stack of residual layers needs one activation, not one per layer.
///
/// Compute `fx` before the call, since `x` moves into it:
///
/// ```
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let layer = nn::linear(vs.root(), 8, 8, Default::default());
/// let x = tch::no_grad(|| -> memsave_inplace::Result<Tensor> {
///     let mut x = Tensor::rand([4, 8], (Kind::Float, Device::Cpu));
///     for _ in 0..3 {
///         let fx = layer.forward(&x);
///         x = memsave_inplace::f_residual_add(x, &fx)?;
///     }
///     Ok(x)
/// })?;
/// assert_eq!(x.size(), [4, 8]);
/// # Ok::<(), memsave_inplace::InplaceError>(())
/// ```
pub fn f_residual_add(x: Tensor, fx: &Tensor) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)? && binary_fits(&x, fx);
    apply(
        "residual_add",
        x,
        allowed,
        |x| x.f_add_(fx),
        |x| x.f_add(fx),
    )
}

/// [`f_residual_add`], panicking where it returns an error.
///
/// # Panics
/// When `x + fx` fails (shapes that do not broadcast, ...).
pub fn residual_add(x: Tensor, fx: &Tensor) -> Tensor {
    or_panic(f_residual_add(x, fx))
}

/// `x + other`, in place when nobody else holds `x` and the sum has `x`'s shape and
/// dtype (no broadcasting that grows `x`, no promotion: `int + float` is copied).
pub fn f_add(x: Tensor, other: &Tensor) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)? && binary_fits(&x, other);
    apply("add", x, allowed, |x| x.f_add_(other), |x| x.f_add(other))
}

/// [`f_add`], panicking where it returns an error.
///
/// # Panics
/// When `x + other` fails.
pub fn add(x: Tensor, other: &Tensor) -> Tensor {
    or_panic(f_add(x, other))
}

/// `x * other`, in place under the conditions of [`f_add`], and only when `other` does
/// not require grad in grad mode.
///
/// # Traps
/// When `other` requires grad, its gradient needs the original `x`, so libtorch's
/// `mul_` saves a copy of `x` first: the in-place form would allocate as much as the
/// out-of-place one, and this computes out of place.
pub fn f_mul(x: Tensor, other: &Tensor) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)?
        && binary_fits(&x, other)
        && !(grad_mode_enabled() && other.requires_grad());
    apply("mul", x, allowed, |x| x.f_mul_(other), |x| x.f_mul(other))
}

/// [`f_mul`], panicking where it returns an error.
///
/// # Panics
/// When `x * other` fails.
pub fn mul(x: Tensor, other: &Tensor) -> Tensor {
    or_panic(f_mul(x, other))
}

/// `relu(x)`, in place when nobody else holds `x`.
///
/// relu saves its *output* for backward, so the result is shared afterwards (an
/// in-place update of it would corrupt backward): a second helper call on it copies.
/// After an op that saved `x` as its output (`exp`, `sigmoid`, another `relu`), `x` is
/// shared and this copies.
pub fn f_relu(x: Tensor) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)?;
    apply("relu", x, allowed, |x| x.f_relu_(), |x| x.f_relu())
}

/// [`f_relu`], panicking where it returns an error.
///
/// # Panics
/// When relu fails (a bool tensor, ...).
pub fn relu(x: Tensor) -> Tensor {
    or_panic(f_relu(x))
}

/// `gelu(x)` with `approximate` `"none"` or `"tanh"`, in place when nobody else holds
/// `x` and autograd does not record the op.
///
/// # Traps
/// gelu's backward needs its input, so when autograd records it (grad mode on and `x`
/// requires grad) libtorch's `gelu_` saves a copy of `x`: no memory saved, so this
/// computes out of place. The in-place path is for inference.
pub fn f_gelu(x: Tensor, approximate: &str) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)? && !autograd_records(&x);
    apply(
        "gelu",
        x,
        allowed,
        |x| x.f_gelu_(approximate),
        |x| x.f_gelu(approximate),
    )
}

/// [`f_gelu`], panicking where it returns an error.
///
/// # Panics
/// When gelu fails (an integer tensor, an unknown `approximate`).
pub fn gelu(x: Tensor, approximate: &str) -> Tensor {
    or_panic(f_gelu(x, approximate))
}

/// `dropout(x, p, train)`, in place when nobody else holds `x`.
///
/// When `train` is false or `p` is 0, dropout is the identity: `x` comes back
/// untouched and neither counter moves. In training the mask (one `x`-sized tensor) is
/// saved for backward either way; the in-place form saves the result's allocation.
/// With the same RNG state both forms draw the same mask.
///
/// # Errors
/// [`InplaceError::InvalidArgument`] when `p` is not in `[0, 1]`.
pub fn f_dropout(x: Tensor, p: f64, train: bool) -> Result<Tensor> {
    if !(0.0..=1.0).contains(&p) {
        return Err(InplaceError::InvalidArgument {
            op: "dropout",
            message: format!("dropout probability has to be between 0 and 1, but got {p}"),
        });
    }
    if !train || p == 0.0 {
        return Ok(x);
    }
    let allowed = can_mutate_in_place(&x)?;
    apply(
        "dropout",
        x,
        allowed,
        |x| x.f_dropout_(p, train),
        |x| x.f_dropout(p, train),
    )
}

/// [`f_dropout`], panicking where it returns an error.
///
/// # Panics
/// When `p` is not in `[0, 1]` or dropout fails.
pub fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    or_panic(f_dropout(x, p, train))
}

/// `clamp(x, min, max)`, in place when nobody else holds `x`, `x` is floating or
/// complex, and autograd does not record the op.
///
/// # Traps
/// - The bounds are floats, so an integer `x` is promoted (as PyTorch does with float
///   bounds) and the result is computed out of place as a float tensor.
/// - clamp's backward needs its input; when autograd records it, `clamp_` saves a copy
///   of `x`, so this computes out of place, as [`f_gelu`] does.
pub fn f_clamp(x: Tensor, min: f64, max: f64) -> Result<Tensor> {
    let allowed = can_mutate_in_place(&x)?
        && scalar_keeps_kind(&x, Category::Floating)
        && !autograd_records(&x);
    apply(
        "clamp",
        x,
        allowed,
        |x| x.f_clamp_(min, max),
        |x| x.f_clamp(min, max),
    )
}

/// [`f_clamp`], panicking where it returns an error.
///
/// # Panics
/// When clamp fails (a complex tensor, ...).
pub fn clamp(x: Tensor, min: f64, max: f64) -> Tensor {
    or_panic(f_clamp(x, min, max))
}
