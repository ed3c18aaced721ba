//! The scaler's saved state, with the keys of PyTorch's `GradScaler.state_dict()`.
use serde::{Deserialize, Serialize};

/// What [`GradScaler::state_dict`](crate::GradScaler::state_dict) saves; serializes with
/// the keys of PyTorch's state dict (`scale`, `growth_factor`, `backoff_factor`,
/// `growth_interval`, `_growth_tracker`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f64,
    /// See [`GradScalerConfig::growth_factor`](crate::GradScalerConfig::growth_factor).
    pub growth_factor: f64,
    /// See [`GradScalerConfig::backoff_factor`](crate::GradScalerConfig::backoff_factor).
    pub backoff_factor: f64,
    /// See [`GradScalerConfig::growth_interval`](crate::GradScalerConfig::growth_interval).
    pub growth_interval: i64,
    /// Consecutive finite steps since the scale last changed.
    #[serde(rename = "_growth_tracker")]
    pub growth_tracker: i64,
}
