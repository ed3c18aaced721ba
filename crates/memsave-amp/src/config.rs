//! The scaler's knobs, with PyTorch's defaults.
use crate::error::{AmpError, Result};

/// Settings of a [`GradScaler`](crate::GradScaler), `torch.amp.GradScaler`'s arguments.
///
/// ```
/// use memsave_amp::GradScalerConfig;
/// let config = GradScalerConfig { growth_interval: 100, ..Default::default() };
/// assert_eq!(config.init_scale, 65536.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The scale before the first update (default 2^16 = 65536).
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` consecutive steps without inf/NaN
    /// (default 2).
    pub growth_factor: f64,
    /// Multiplies the scale after a step with inf/NaN gradients (default 0.5).
    pub backoff_factor: f64,
    /// Consecutive finite steps before the scale grows (default 2000).
    pub growth_interval: i64,
    /// When false every call is a pass-through: `scale` returns the loss unchanged and
    /// `step` always steps (default true).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    /// Checks the ranges PyTorch requires, plus finiteness and positivity.
    pub fn validate(&self) -> Result<()> {
        let invalid = |msg: String| Err(AmpError::InvalidConfig(msg));
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return invalid(format!(
                "init_scale must be finite and > 0, got {}",
                self.init_scale
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return invalid(format!(
                "growth_factor must be finite and > 1.0, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return invalid(format!(
                "backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval < 1 || self.growth_interval > i64::from(i32::MAX) {
            return invalid(format!(
                "growth_interval must be in 1..=2^31-1 (the growth tracker is an i32), got {}",
                self.growth_interval
            ));
        }
        Ok(())
    }
}
