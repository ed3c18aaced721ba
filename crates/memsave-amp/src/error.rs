//! The errors of autocast scopes and the gradient scaler.
use tch::{Device, Kind};

/// What went wrong in `memsave-amp`; each message says what to change.
#[derive(Debug, thiserror::Error)]
pub enum AmpError {
    /// Autocast was asked for a dtype its device type does not support.
    #[error("autocast on {device:?} supports BFloat16 and Half, got {kind:?}")]
    UnsupportedDtype {
        /// The device asked for.
        device: Device,
        /// The dtype asked for.
        kind: Kind,
    },
    /// Autocast or the scaler was asked for a device that is absent or not supported.
    #[error("cannot use {device:?}: {reason}")]
    Device {
        /// The device asked for.
        device: Device,
        /// Why it cannot be used.
        reason: String,
    },
    /// A `GradScalerConfig` value is out of range.
    #[error("invalid GradScaler setting: {0}")]
    InvalidConfig(String),
    /// `unscale_`, `step` or `update` ran before any `scale` in this iteration.
    #[error("attempted {op} but the scale was never created: call scale(&loss) and backward on the scaled loss earlier in the iteration")]
    NotScaled {
        /// The operation that needed the scale.
        op: &'static str,
    },
    /// `unscale_` ran twice for the same parameters without an `update` between.
    #[error("unscale_() has already been called on this optimizer since the last update(); unscale once per iteration, then step() and update()")]
    AlreadyUnscaled,
    /// `unscale_` ran after `step` for the same parameters without an `update` between.
    #[error("unscale_() is being called after step(); call update() first, then start the next iteration")]
    UnscaleAfterStep,
    /// `step` ran twice for the same parameters without an `update` between.
    #[error(
        "step() has already been called since the last update(); call update() once per iteration"
    )]
    AlreadyStepped,
    /// No parameter of the optimizer had a gradient, so nothing was checked for inf/NaN.
    #[error("no inf checks were recorded for this optimizer: none of its parameters has a gradient (call backward on the scaled loss before step)")]
    NoGradients,
    /// `update` ran although no `unscale_`/`step` checked any gradient since the last one.
    #[error("no inf checks were recorded prior to update(): call step(&mut optimizer) (or unscale_) in this iteration before update()")]
    NoInfChecks,
    /// A gradient is fp16; the scaler unscales f32 (or bf16/f64) gradients only.
    #[error("attempting to unscale FP16 gradients: keep the parameters in f32 and let autocast run the forward in Half")]
    Fp16Gradients,
    /// The state to load came from a disabled scaler (PyTorch's empty state dict).
    #[error(
        "the state to load is empty, possibly because it was saved from a disabled GradScaler"
    )]
    EmptyState,
    /// libtorch reported an error through tch.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// libtorch reported an error through the memsave bridge.
    #[error(transparent)]
    Bridge(#[from] memsave_sys::Error),
}

/// The result of a fallible `memsave-amp` call.
pub type Result<T, E = AmpError> = std::result::Result<T, E>;
