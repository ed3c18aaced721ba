//! Gradient-norm clipping that returns errors instead of panicking.
use crate::error::Result;
use tch::{Kind, Tensor};

/// Scales the gradients of `params` so that their joint L2 norm is at most `max_norm`
/// (`torch.nn.utils.clip_grad_norm_`); returns the norm before clipping.
///
/// Parameters without a gradient are skipped; with none at all the norm is 0. With a
/// [`GradScaler`](crate::GradScaler), call [`unscale_`](crate::GradScaler::unscale_)
/// first, or the threshold applies to scaled gradients. An inf/NaN gradient gives an
/// inf/NaN norm; the scaler then skips the step anyway.
pub fn f_clip_grad_norm_(params: &[Tensor], max_norm: f64) -> Result<f64> {
    let _no_grad = tch::no_grad_guard();
    let mut grads = Vec::new();
    for p in params {
        let g = p.f_grad()?;
        if g.defined() {
            grads.push(g);
        }
    }
    if grads.is_empty() {
        return Ok(0.0);
    }
    let mut norms = Vec::with_capacity(grads.len());
    for g in &grads {
        norms.push(g.f_norm()?.f_to_kind(Kind::Double)?);
    }
    let total_norm = Tensor::f_stack(&norms, 0)?.f_norm()?.f_double_value(&[])?;
    let clip_coef = max_norm / (total_norm + 1e-6);
    if clip_coef < 1.0 {
        for g in &mut grads {
            let _scaled_in_place = g.f_mul_scalar_(clip_coef)?;
        }
    }
    Ok(total_norm)
}
