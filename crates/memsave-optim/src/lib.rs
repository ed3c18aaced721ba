//! Optimizers for tch-rs that cut the memory of the training state.
//!
//! Once activations are under control, what remains of a training step is the state:
//! for AdamW in f32, 16 bytes per parameter (weight, gradient, two moments). This crate
//! has [`AdamW`] and [`Sgd`] written in Rust on tch tensors, with PyTorch's update
//! rules and defaults (in f32 they match tch's `nn::adamw` and `nn::sgd` bit for bit),
//! parameter groups, learning-rate changes and a serializable state. Three things tch's
//! optimizers cannot do: keep the moments in bf16 or in 8-bit blockwise codes
//! ([`State`]; the update is still computed in f32), keep them off the device
//! ([`Placement`]), and step each parameter inside backward as soon as its gradient is
//! ready, freeing the gradient at once ([`Optimizer::step_in_backward`]).
//!
//! ```
//! use memsave_optim::{AdamW, AdamWConfig, Options, State};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root(), 4, 1, Default::default());
//! let options = Options { state: State::Int8Blockwise { block: 256 }, ..Default::default() };
//! let mut opt = AdamW::with_options(&vs.trainable_variables(), AdamWConfig::default(), options)?;
//! let x = Tensor::randn([16, 4], (Kind::Float, Device::Cpu));
//! let y = x.sum_dim_intlist(1, true, Kind::Float);
//! for _ in 0..3 {
//!     opt.zero_grad(true);
//!     net.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
//!     opt.f_step()?;
//! }
//! assert_eq!(opt.step_count(0), 3);
//! // Two 8-bit moments and their f32 block scales: 4 weights + 1 bias.
//! assert_eq!(opt.state_bytes(), 2 * (4 + 4) + 2 * (1 + 4));
//! # Ok::<(), memsave_optim::OptimError>(())
//! ```
#![forbid(unsafe_code)]

mod adamw;
mod error;
mod hook;
mod number;
mod observe;
mod optimizer;
mod placement;
mod saved;
mod scratch;
mod sgd;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use error::{OptimError, Result};
pub use hook::InBackward;
pub use observe::Observer;
pub use optimizer::{zero_grad, Optimizer, Options, Rule};
pub use placement::Placement;
pub use saved::{SavedGroup, SavedParam, SavedState, SavedTensor};
pub use scratch::Scratch;
pub use sgd::{Sgd, SgdConfig};
pub use state::{Sign, State};
