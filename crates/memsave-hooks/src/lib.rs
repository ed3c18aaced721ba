//! Saved-tensor hooks for tch-rs: decide what autograd keeps for backward.
//!
//! Every activation-memory technique goes through one door: the tensors autograd saves
//! during the forward so that backward can use them. PyTorch opens that door with
//! `torch.autograd.graph.saved_tensors_hooks`, but libtorch offers it to Python only.
//! This crate offers it to Rust: inside [`saved_tensors_hooks`] (or while a
//! [`HooksGuard`] lives), each tensor autograd saves on this thread goes through your
//! [`SavedTensorHooks::pack`], and backward gets it back through
//! [`SavedTensorHooks::unpack`]. Built-ins: [`SaveOnCpu`] keeps CUDA activations in host
//! memory, [`Accounting`] tells which ops keep your memory, [`Compress`] stores saved
//! activations as bf16, fp16, fp8 or int8 (a [`Codec`]), and [`DiskOffload`] keeps them
//! in files until backward.
//!
//! The packing built-ins pack only what a [`SavePolicy`] lets them. Packing what stays
//! alive anyway only adds bytes, so parameters, the tensors you name, buffers
//! (running statistics) and constants (tensors without a `grad_fn` found alive from
//! one step to the next: a table or mask a layer holds) are kept as they are by all
//! three; the batch only when you name it. [`Compress`] also keeps
//! what backward is numerically sensitive to (the statistics of normalization ops)
//! and tensors under 4 KiB, and compresses a normalization's input with blocks per
//! channel or row, each stored relative to its own midpoint: int8 over everything a
//! batch-norm network saves made gradient errors of 0.29 (ResNet-18) to 2.13
//! (MobileNetV2), with no warning, and a channel far from zero (small batches, deep
//! layers) made bf16's 1.4e-2 on ResNet-18 at batch 4. A tensor that two nodes save is
//! packed once.
//!
//! Gradients are not saved tensors, but they are the other half of what training keeps:
//! [`GradOffload`] (post-accumulate-grad hooks) keeps the gradients accumulated over
//! micro-batches in files instead of memory, and hands each whole one to your
//! `on_complete` (an optimizer step) in the last micro-batch's backward.
//!
//! [`DiskOffload`] and [`Compress`] are also levers of `memsave-checkpoint`'s budget
//! planner (they implement its `BoundaryStore`): given to
//! `CheckpointedSequential::with_levers`, they may keep the inputs of checkpoints
//! until their recompute, where the planner finds that cheaper than recomputing more.
//!
//! ```
//! use memsave_hooks::{saved_tensors_hooks, Accounting};
//! use tch::{Device, Kind, Tensor};
//!
//! let w = Tensor::ones([256, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
//! let x = Tensor::ones([64, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
//! // Parameters stay alive anyway: leave them out of the account.
//! let accounting = Accounting::new().excluding(&[w.shallow_clone()]);
//! let loss = saved_tensors_hooks(accounting.clone(), || x.matmul(&w).tanh().sum(Kind::Float)).unwrap();
//! // mm saved its input x (64 x 256 floats, a leaf); tanh saved its own output.
//! assert_eq!(accounting.bytes_by_op().get("aten::mm"), Some(&(64 * 256 * 4)));
//! assert_eq!(accounting.bytes_by_op().get("aten::tanh"), Some(&(64 * 256 * 4)));
//! assert_eq!(accounting.bytes_by_producer().get("leaf"), Some(&(64 * 256 * 4)));
//! assert_eq!(accounting.bytes_by_producer().get("TanhBackward0"), Some(&(64 * 256 * 4)));
//! loss.backward();
//! assert!(w.grad().defined());
//! ```
#![forbid(unsafe_code)]

mod accounting;
mod alive;
mod boundary;
mod codec;
mod compress;
mod distinct;
mod error;
mod offload;
mod pass_through;
mod policy;
mod save_on_cpu;
mod saved_once;
mod scope;

pub use accounting::{producer_of, Accounting, SavedRecord};
pub use codec::{Codec, Encoded, DEFAULT_BLOCK};
pub use compress::{Compress, CompressStats, Compressed, SharedEncoded};
pub use error::{FileError, HookError, HooksError, OffloadError, PolicyError, SharedError};
pub use offload::{
    read_tensor_file, write_tensor_file, DiskOffload, GradOffload, GradOffloadStats, OffloadStats,
    Offloaded, OnComplete, DEFAULT_MAX_IN_FLIGHT_BYTES,
};
pub use pass_through::PassThrough;
pub use policy::{
    Kept, KeptStats, SavePolicy, SavedInfo, DEFAULT_MIN_BYTES, NORM_OPS, ROW_BLOCK, ROW_BLOCK_OPS,
};
pub use save_on_cpu::{OnCpu, SaveOnCpu};
pub use scope::{
    hooks_from_fn, raw_hooks, saved_tensors_hooks, FnHooks, HooksGuard, SavedTensorHooks,
};
