//! Stochastic gradient descent with momentum, dampening, Nesterov and weight decay.
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{OptimError, Result};
use crate::optimizer::{non_negative, Optimizer, Rule};
use crate::scratch::Scratch;
use crate::state::Sign;

/// SGD's hyper-parameters, with PyTorch's defaults.
///
/// One update of `p` with gradient `g`: `d = g + weight_decay * p`; with momentum,
/// `b = d` at the first step and `b = momentum * b + (1 - dampening) * d` after, then
/// `d = d + momentum * b` (Nesterov) or `d = b`; finally `p -= lr * d`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Momentum factor (default 0: no momentum buffer, no state).
    pub momentum: f64,
    /// Dampening of the momentum (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (default false); needs `momentum > 0` and `dampening == 0`.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// An SGD optimizer; see [`Optimizer`] for the methods and [`SgdConfig`] for the rule.
pub type Sgd = Optimizer<SgdConfig>;

impl Rule for SgdConfig {
    const NAME: &'static str = "sgd";

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn validate(&self) -> Result<()> {
        let problem = if !non_negative(self.lr) {
            Some(format!("lr must be finite and >= 0, got {}", self.lr))
        } else if !non_negative(self.momentum) {
            Some(format!(
                "momentum must be finite and >= 0, got {}",
                self.momentum
            ))
        } else if !non_negative(self.weight_decay) {
            Some(format!(
                "weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            ))
        } else if !self.dampening.is_finite() {
            Some(format!("dampening must be finite, got {}", self.dampening))
        } else if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            Some("nesterov needs momentum > 0 and dampening 0".to_owned())
        } else {
            None
        };
        problem.map_or(Ok(()), |p| Err(OptimError::Config(format!("SGD: {p}"))))
    }

    fn buffers(&self) -> &'static [(&'static str, Sign)] {
        if self.momentum != 0.0 {
            &[("momentum_buffer", Sign::Signed)]
        } else {
            &[]
        }
    }

    fn update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buffers: &mut [Tensor],
        step: u64,
        scratch: &mut Scratch,
    ) -> Result<(), tch::TchError> {
        // Everything the update allocates comes first (from the scratch), so that
        // running out of memory leaves the parameter and its momentum as they were
        // (see AdamW's update).
        let d = if self.weight_decay != 0.0 {
            let wd = scratch.number(self.weight_decay, param)?;
            let out = scratch.empty_like(grad)?;
            grad.f_addcmul_out(&out, param, &wd)?
        } else {
            grad.shallow_clone()
        };
        let minus_lr = scratch.number(-self.lr, param)?;
        let Some(buf) = buffers.first_mut() else {
            let _ = param.f_addcmul_(&d, &minus_lr)?;
            return Ok(());
        };
        let momentum = scratch.number(self.momentum, param)?;
        let one_minus_dampening = scratch.number(1.0 - self.dampening, param)?;
        let nesterov = self.nesterov.then(|| scratch.empty_like(&d)).transpose()?;

        if step == 1 {
            buf.f_copy_(&d)?;
        } else {
            let _ = buf.f_mul_(&momentum)?;
            let _ = buf.f_addcmul_(&d, &one_minus_dampening)?;
        }
        let d = match nesterov {
            Some(out) => d.f_addcmul_out(&out, buf, &momentum)?,
            None => buf.shallow_clone(),
        };
        let _ = param.f_addcmul_(&d, &minus_lr)?;
        Ok(())
    }
}
