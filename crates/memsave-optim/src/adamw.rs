//! AdamW: Adam with weight decay decoupled from the gradient (Loshchilov & Hutter).
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{OptimError, Result};
use crate::optimizer::{non_negative, Optimizer, Rule};
use crate::scratch::Scratch;
use crate::state::Sign;

/// AdamW's hyper-parameters, with PyTorch's defaults.
///
/// One update of a parameter `p` with gradient `g` at step `t`, in the order libtorch
/// computes it (so that f32 results match tch's `nn::adamw` bit for bit):
/// `p *= 1 - lr * weight_decay`; `m = beta1 * m + (1 - beta1) * g`;
/// `v = beta2 * v + (1 - beta2) * g * g`;
/// `p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moments (default (0.9, 0.999)).
    pub betas: (f64, f64),
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 1e-2).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// An AdamW optimizer; see [`Optimizer`] for the methods and [`AdamWConfig`] for the rule.
pub type AdamW = Optimizer<AdamWConfig>;

impl Rule for AdamWConfig {
    const NAME: &'static str = "adamw";

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn validate(&self) -> Result<()> {
        let (b1, b2) = self.betas;
        let problem = if !non_negative(self.lr) {
            Some(format!("lr must be finite and >= 0, got {}", self.lr))
        } else if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            Some(format!("betas must be in [0, 1), got ({b1}, {b2})"))
        } else if !non_negative(self.eps) {
            Some(format!("eps must be finite and >= 0, got {}", self.eps))
        } else if !non_negative(self.weight_decay) {
            Some(format!(
                "weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            ))
        } else {
            None
        };
        problem.map_or(Ok(()), |p| Err(OptimError::Config(format!("AdamW: {p}"))))
    }

    fn buffers(&self) -> &'static [(&'static str, Sign)] {
        &[("exp_avg", Sign::Signed), ("exp_avg_sq", Sign::NonNegative)]
    }

    fn update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buffers: &mut [Tensor],
        step: u64,
        scratch: &mut Scratch,
    ) -> Result<(), tch::TchError> {
        let (beta1, beta2) = self.betas;
        // libtorch raises to a double power; powi could differ in the last bit.
        let bias_correction1 = 1.0 - beta1.powf(step as f64);
        let bias_correction2 = 1.0 - beta2.powf(step as f64);
        let step_size = self.lr / bias_correction1;
        let (exp_avg, rest) = buffers.split_at_mut(1);
        let (exp_avg, exp_avg_sq) = (&mut exp_avg[0], &mut rest[0]);
        // Everything the update allocates comes first (from the scratch, so only the
        // first chunk of a parameter allocates), so that running out of memory leaves
        // the parameter and its moments as they were: the numbers (0-dim tensors, see
        // `number`) and one buffer for the denominator, libtorch's own temporary. The
        // writes after that allocate nothing: the numbers of addcmul_ and addcdiv_
        // reach the kernel as C++ Scalars (`memsave_sys::tensor`), as in libtorch's
        // AdamW, so `(1 - beta2) * g` and `-step_size * m` need no copy.
        let decay = (self.weight_decay != 0.0)
            .then(|| scratch.number(1.0 - self.lr * self.weight_decay, param))
            .transpose()?;
        let beta1_t = scratch.number(beta1, param)?;
        let one_minus_beta1 = scratch.number(1.0 - beta1, param)?;
        let beta2_t = scratch.number(beta2, param)?;
        let sqrt_bias_correction2 = scratch.number(bias_correction2.sqrt(), param)?;
        let eps = scratch.number(self.eps, param)?;
        let denom = scratch.empty_like(exp_avg_sq)?;

        if let Some(decay) = &decay {
            let _ = param.f_mul_(decay)?;
        }
        let _ = exp_avg.f_mul_(&beta1_t)?;
        let _ = exp_avg.f_addcmul_(grad, &one_minus_beta1)?;
        let _ = exp_avg_sq.f_mul_(&beta2_t)?;
        memsave_sys::tensor::addcmul_(exp_avg_sq, grad, grad, 1.0 - beta2).map_err(torch)?;
        let mut denom = exp_avg_sq.f_sqrt_out(&denom)?;
        let _ = denom.f_div_(&sqrt_bias_correction2)?;
        let _ = denom.f_add_(&eps)?;
        memsave_sys::tensor::addcdiv_(param, exp_avg, &denom, -step_size).map_err(torch)?;
        Ok(())
    }
}

/// A bridge error as the `TchError` [`Rule::update`] returns (its message kept, so that
/// an out-of-memory one is still recognised as such).
fn torch(e: memsave_sys::Error) -> tch::TchError {
    tch::TchError::Torch(e.message().to_owned())
}
