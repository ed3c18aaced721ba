//! Gradient accumulation for tch-rs: one optimizer step from several micro-batches,
//! with the full-batch gradient, a fraction of the activation memory, and the largest
//! micro-batch that fits a byte budget.
//!
//! [`f_split`] cuts a batch into micro-batches (by count or by maximum size) and gives
//! each the weight `len / batch_size` that makes the weighted sum of mean-reduced
//! micro-losses the full-batch mean, also for an uneven last micro-batch.
//! [`GradAccumulator`] runs your per-micro-batch closure (plain, under autocast, or
//! checkpointed: the forward is yours), backpropagates the weighted losses, steps the
//! optimizer once (optionally through a [`memsave_amp::GradScaler`], skipping the whole
//! step on inf/NaN) and frees the gradients with set-to-none semantics
//! ([`free_grads`]). [`fit_micro_batch`] searches the largest micro-batch whose
//! forward and backward fit under a byte budget: on the CPU under the meter's
//! simulated limit, on CUDA by the measured peak of each trial.
//!
//! With `N` balanced micro-batches of a batch of `B` samples, the activations alive at
//! once are those of `ceil(B / N)` samples instead of `B`.
//!
//! ```
//! use memsave_accum::{GradAccumulator, Split};
//! use tch::nn::{self, Module, OptimizerConfig};
//! use tch::{Device, Kind, Tensor};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 4, 1, Default::default());
//! let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
//! let (x, y) = (Tensor::randn([10, 4], (Kind::Float, Device::Cpu)), Tensor::zeros([10, 1], (Kind::Float, Device::Cpu)));
//!
//! // 10 samples in micro-batches of at most 4: 4, 4, 2, weighted 0.4, 0.4, 0.2.
//! let accumulator = GradAccumulator::with_split(Split::MaxSize(4));
//! let step = accumulator.f_step(&mut opt, 10, |mb| {
//!     let pred = model.forward(&mb.narrow(&x));
//!     pred.f_mse_loss(&mb.narrow(&y), tch::Reduction::Mean)
//! })?;
//! assert_eq!(step.micro_steps.len(), 3);
//! assert!(!step.outcome.is_skipped());
//! // Gradients were freed after the step, not zeroed.
//! assert!(!vs.trainable_variables()[0].grad().defined());
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod accumulate;
mod error;
mod fit;
mod grads;
mod limit;
mod split;

pub use accumulate::{AccumConfig, AccumStep, GradAccumulator, MicroStep};
pub use error::{AccumError, BoxError, Result};
pub use fit::{fit_micro_batch, FitReport, Trial};
pub use grads::free_grads;
pub use split::{f_split, MicroBatch, Split, MAX_MICRO_BATCHES};
