//! memsave: utilities that cut the memory of training with tch-rs, each measured to the
//! byte.
//!
//! This facade re-exports the individual crates:
//! - [`meter`]: `memory_allocated`, peaks, scopes with marks, summaries, leak detection.
//! - [`checkpoint`]: `checkpoint`, and `CheckpointedSequential` with plans up to an
//!   optimal schedule for a byte budget.
//! - [`inplace`]: in-place operations exactly where nobody else holds the tensor
//!   (copy-on-write in the style of `Rc::make_mut`), and version checks.
//! - [`amp`]: autocast scopes and a `GradScaler` with PyTorch's semantics.
//! - [`accum`]: gradient accumulation with exact micro-batch weighting, and a search for
//!   the largest micro-batch that fits a budget.
//! - [`optim`]: `AdamW` and `Sgd` with f32, bf16 or 8-bit blockwise state, the step
//!   inside backward, and state kept on the CPU or on disk.
//! - [`hooks`]: saved-tensor hooks (PyTorch's `saved_tensors_hooks`) for Rust, with
//!   `SaveOnCpu` and `Accounting`.
//! - [`dist`]: distributed training on libtorch's c10d: process groups, the launcher,
//!   data parallel with bucketed all-reduce and `no_sync`, ZeRO-1/2 sharded state.
//! - [`step`]: your own model as a `Workload` and one measured training step under any
//!   combination of the levers above; `Trainer` runs such steps in a loop of your own.
//! - [`fit`]: the fastest configuration of those levers whose peak fits a byte budget
//!   with the global batch kept.
//! - [`models`]: real architectures as workloads (ResNet, MobileNetV2, a LLaMA-style
//!   decoder, a ViT) with tch's variable names.
//! - [`sys`]: the C++ bridge (counting allocator, tensor introspection, autocast state,
//!   the autograd engine with saved-tensor hooks behind checkpointing).
//!
//! ```
//! use memsave::meter::{measure, Bytes};
//! use tch::{Device, Kind, Tensor};
//!
//! let (_, m) = measure(Device::Cpu, |_| Tensor::zeros([256, 256], (Kind::Float, Device::Cpu)));
//! assert_eq!(m.retained_bytes(), 262_144);
//! assert_eq!(Bytes(m.retained_bytes() as u64).to_string(), "256.00 KiB");
//! ```
#![forbid(unsafe_code)]

/// The README's snippets, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub use memsave_accum as accum;
pub use memsave_amp as amp;
pub use memsave_checkpoint as checkpoint;
pub use memsave_dist as dist;
pub use memsave_fit as fit;
pub use memsave_hooks as hooks;
pub use memsave_inplace as inplace;
pub use memsave_meter as meter;
pub use memsave_models as models;
pub use memsave_optim as optim;
pub use memsave_step as step;
pub use memsave_sys as sys;
pub use memsave_trace as trace;
