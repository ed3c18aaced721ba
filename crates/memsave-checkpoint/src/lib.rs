//! Gradient checkpointing for tch-rs: keep few activations, recompute the rest in
//! backward.
//!
//! - [`checkpoint`] / [`checkpoint1`] / [`Checkpoint`]: run a function without keeping its
//!   activations; a custom autograd node recomputes it in backward. Parameters inside get
//!   their gradients even when no input requires grad; several inputs and outputs,
//!   integer outputs and nesting work; the RNG state is restored for the recompute.
//! - [`CheckpointedSequential`] with a [`Plan`]: `None`, `EveryLayer`, `Segments(k)`
//!   (parity with `checkpoint_sequential`), `Nested` (logarithmic memory) and
//!   `Budget(bytes)`: the schedule with the least recomputation whose predicted peak
//!   fits, solved by dynamic programming ([`Solver`]) over a measured profile.
//! - Levers beyond recomputation ([`BoundaryStore`], set with
//!   [`CheckpointedSequential::with_levers`]): every checkpoint keeps its input for the
//!   whole backward, the floor of recomputation alone. A boundary store (disk offload
//!   or a compression codec from `memsave-hooks`, or your own) can keep that input
//!   instead until the recompute. With levers, `Budget` chooses per top-level
//!   checkpoint: keep the input, or store it with one of the stores, from the bytes and
//!   seconds [`CheckpointedSequential::profile`] measures for each store on each real
//!   boundary; [`CheckpointedSequential::explain`] says what it chose for each boundary
//!   and why. Without levers (the default) plans are recompute-only, as before. A
//!   lossless store keeps gradients bitwise equal to the plain run's.
//!
//! - [`Blocks`]: a model that is not a chain (a U-Net, an encoder–decoder) as its own
//!   forward function whose parts run as named blocks, any number of tensors in and
//!   out, each under its own [`BlockLever`] (keep, recompute, recompute with its inputs
//!   in a store, saved tensors to hooks); [`Blocks::profile`] and
//!   [`BlocksProfile::solve`] plan which blocks to recompute within a budget.
//!
//! Why it helps: in `x = x + linear(x)` every layer saves its input for backward, so a
//! plain forward keeps one activation per layer. A checkpointed segment keeps only its
//! input and rebuilds the rest when backward reaches it.
//!
//! ```
//! use memsave_checkpoint::{CheckpointedSequential, Plan};
//! use memsave_meter::measure;
//! use tch::nn::{self, Module};
//! use tch::{Device, Kind, Tensor};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! // No dropout here, so no need to keep an RNG state (5,056 bytes) per checkpoint.
//! let mut seq = CheckpointedSequential::new().preserve_rng(false);
//! for i in 0..8 {
//!     let lin = nn::linear(vs.root() / i, 16, 16, Default::default());
//!     seq = seq.add_fn(move |x| x + lin.forward(x));
//! }
//! let x = Tensor::rand([32, 16], (Kind::Float, Device::Cpu));
//! let act = 32 * 16 * 4; // bytes of one activation
//!
//! let (y, plain) = measure(Device::Cpu, |_| seq.f_forward(&x).unwrap());
//! assert_eq!(plain.retained_bytes(), 8 * act); // one saved input per layer
//! drop(y);
//!
//! seq.set_plan(Plan::Segments(4)).unwrap(); // checkpoints [0..2] [2..4] [4..6], then 6 7
//! let (y, ckpt) = measure(Device::Cpu, |_| seq.f_forward(&x).unwrap());
//! assert_eq!(ckpt.retained_bytes(), 5 * act); // x2 x4 x6 x7 and the output x8
//! y.square().mean(Kind::Float).backward();
//! ```
#![forbid(unsafe_code)]

mod block_plan;
mod blocks;
mod crossing;
mod error;
mod function;
mod layers;
mod levers;
mod plan;
mod profile;
mod schedule;
mod sequential;
mod solver;

pub use block_plan::{BlocksProfile, PlannedLever, ProfileOptions};
pub use blocks::{
    BlockKey, BlockLever, BlockNotice, BlockObserver, BlockRecord, BlockWrapper, Blocks,
    LeversSnapshot, Shared,
};
pub use error::{CheckpointError, Result};
pub use function::{checkpoint, checkpoint1, Checkpoint};
pub use levers::{BoundaryCost, BoundaryStore, LeverProfile, LeverStats, StoreError, Stored};
/// Whether the recomputation running on this thread has every tensor its backward
/// needs back: a checkpointed function may return at once (what it returns there is
/// not used). False outside recomputations.
pub use memsave_sys::checkpoint::recomputation_done;
pub use plan::Plan;
pub use profile::{ChainProfile, LayerProfile};
pub use schedule::{Block, Schedule, StoredBoundary};
pub use sequential::{CheckpointedSequential, PlanSnapshot};
pub use solver::{predict, predict_with_levers, Prediction, Solver};
