//! Mixed precision for tch-rs with PyTorch's semantics: autocast scopes and a
//! `GradScaler`.
//!
//! [`autocast`] and [`AutocastGuard`] switch autocast per device type (CPU or CUDA,
//! where tch only toggles the CUDA flag), nest correctly and clear the weight-cast cache
//! when the outermost scope ends, as `torch.autocast` does. Under bf16 autocast a
//! linear layer saves the bf16 cast of its input for backward instead of the f32 input
//! (plus the bf16 cast of its weight when its input needs a gradient). For the seed
//! network, `[50, 100, 512]` through 10 layers of `x = x + Linear(512, 512)(x)`, the
//! bytes retained after the forward are, measured to the byte by the
//! `bf16_retained` example and equal to the formulas:
//!
//! | forward | formula | bytes |
//! | --- | --- | --- |
//! | f32 | `L*BSH*4` | 102 400 000 (97.66 MiB) |
//! | bf16 autocast | `L*BSH*2 + BSH*4 + (L-1)*H*H*2` | 66 158 592 (63.09 MiB) |
//!
//! [`GradScaler`] is `torch.amp.GradScaler`: `scale`, `unscale_` (for clipping),
//! `step` that skips the optimizer on inf/NaN gradients and says so, `update` through
//! libtorch's `_amp_update_scale_` kernel, and a serializable state.
//!
//! ```
//! use memsave_amp::{autocast, GradScaler, StepOutcome};
//! use tch::nn::{self, Module, OptimizerConfig};
//! use tch::{Device, Kind, Tensor};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let vs = nn::VarStore::new(Device::Cpu);
//! let layer = nn::linear(vs.root(), 8, 8, Default::default());
//! let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//! let mut scaler = GradScaler::default();
//!
//! let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
//! let loss = autocast(Device::Cpu, Kind::BFloat16, || {
//!     let y = layer.forward(&x);
//!     assert_eq!(y.kind(), Kind::BFloat16);
//!     y.to_kind(Kind::Float).square().mean(Kind::Float)
//! });
//! scaler.f_scale(&loss)?.f_backward()?;
//! scaler.f_unscale_(&opt)?; // true gradients from here on: clip them
//! opt.clip_grad_norm(1.0);
//! assert_eq!(scaler.f_step(&mut opt)?, StepOutcome::Stepped);
//! scaler.f_update()?;
//! assert_eq!(scaler.get_scale(), 65536.0); // grows only after 2000 finite steps
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod autocast;
mod clip;
mod config;
mod error;
mod outcome;
mod scaler;
mod state;

pub use autocast::{
    autocast, autocast_state, f_autocast, f_autocast_disabled, AutocastGuard, AutocastState,
};
pub use clip::f_clip_grad_norm_;
pub use config::GradScalerConfig;
pub use error::{AmpError, Result};
pub use outcome::StepOutcome;
pub use scaler::GradScaler;
pub use state::GradScalerState;
