//! Distributed training for tch-rs on libtorch's own distributed engine, c10d.
//!
//! When parameters, gradients and optimizer state do not fit one device, training is
//! spread over processes that each hold part of the work. This crate gives tch users
//! what PyTorch users have in `torch.distributed`: process groups joined through a
//! rendezvous store ([`init_process_group`] from the environment, or
//! [`ProcessGroup::new_tcp`] and [`ProcessGroup::new_file`]) with `all_reduce`,
//! `reduce_scatter`, `all_gather`, `broadcast` and `barrier` over Gloo; a launcher that
//! starts the ranks of a node and ends them all when one fails ([`launch()`], the CLI's
//! `memsave launch`); data parallel training whose gradients are averaged in buckets
//! while backward runs, with `no_sync` for gradient accumulation
//! ([`DistributedDataParallel`]); and ZeRO stages 1 and 2 on `memsave-optim`'s
//! optimizers, so that each of N ranks keeps 1/N of the optimizer state and, in stage 2,
//! of the gradients ([`ZeroOptimizer`]); and ZeRO stage 3, fully sharded data parallel
//! ([`Fsdp`], PyTorch's FSDP2 `fully_shard`), where each rank keeps 1/N of every
//! parameter too and gathers a unit's weights only while it runs, with sharded
//! checkpoints ([`Fsdp::save_sharded`]). Every error names the rank that saw it.
//!
//! One rank over a file rendezvous (a real group of one; with `memsave launch -n 4`,
//! [`init_process_group`] joins four):
//!
//! ```
//! use memsave_dist::{DistributedDataParallel, DdpConfig, InitOptions, ProcessGroup};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//!
//! let dir = tempfile::tempdir()?;
//! let group = ProcessGroup::new_file(&dir.path().join("store"), 0, 1, &InitOptions::default())?;
//! let t = Tensor::from_slice(&[1.0f32, 2.0]);
//! group.all_reduce(&t)?;
//! assert_eq!(Vec::<f32>::try_from(&t)?, [1.0, 2.0]); // the sum over one rank
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = nn::linear(vs.root(), 4, 1, Default::default());
//! let ddp = DistributedDataParallel::new(&group, &vs.trainable_variables(), DdpConfig::default())?;
//! let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
//! ddp.no_sync(|| net.forward(&x).sum(Kind::Float).backward()); // accumulates locally
//! ddp.f_backward(&net.forward(&x).sum(Kind::Float))?; // averages over the ranks
//! assert_eq!(ddp.reductions(), 1);
//! # Ok::<(), anyhow::Error>(())
//! ```
#![forbid(unsafe_code)]

mod bucket;
mod check;
mod ddp;
mod error;
mod fsdp;
mod group;
pub mod launch;
mod ready;
mod shard_files;
mod sharded_checkpoint;
mod zero;

pub use ddp::{DdpConfig, DistributedDataParallel};
pub use error::{DistError, Result};
pub use fsdp::{Fsdp, FsdpConfig, FsdpStats, FsdpUnit, FsdpUnits, SHARD_FILE_CHUNK_VALUES};
pub use group::{init_process_group, Backend, InitOptions, ProcessGroup, Work};
pub use launch::{
    free_port, launch, LaunchConfig, MAX_NPROC_PER_NODE, OUTPUT_DRAIN, RANK_THREADS_VAR,
};
pub use zero::{ZeroOptimizer, ZeroStage};
