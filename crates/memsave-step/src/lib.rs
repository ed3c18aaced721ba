//! The user's model as a memsave [`Workload`] and one measured training step under any
//! combination of memsave's levers ([`step`], or a [`Trainer`] in a loop of your own).
//!
//! This is memsave's one step engine: the harness (`memsave-bench`), the planner
//! (`memsave-fit`, which chooses a [`StepConfig`] for a byte budget), the examples and
//! your own loop all run their steps here. The harness's bundled models are
//! workloads, its strategies resolve to a [`StepConfig`], and its measured step is
//! [`step::f_step_with`].
//!
//! Modules: [`workload`] (the trait and [`Batch`]), [`config`] (what a configuration
//! changes in a step), [`levers`] (optimizer and saved-tensor settings), [`measure`]
//! (peak phase, per-block trace), [`step`] (one measured step: [`StepRun`]),
//! [`optimizer`] (the optimizer of a run) and [`parallel`] (the step on the ranks of a
//! process group: data parallel and ZeRO stages 1 to 3, [`DataParallel`]).
#![forbid(unsafe_code)]

pub mod config;
mod error;
pub mod levers;
pub mod lr_scheduler;
pub mod measure;
pub mod optimizer;
pub mod parallel;
pub mod plan;
mod saved;
mod statistics;
pub mod step;
mod trainer;
pub mod workload;

pub use config::{GradsAfter, ParamsOffload, PlanChoice, ResidualUpdate, SavedTensors, StepConfig};
pub use error::StepError;
pub use lr_scheduler::{CosineDecay, LRScheduler, LinearWarmup};
pub use trainer::{Trainer, TrainerBuilder};

pub use levers::{
    CompressDtype, OffloadSpec, OptimizerKind, OptimizerSpec, StatePlacement, StatePrecision,
};
pub use measure::{PeakPhase, TraceEntry};
/// The process group and the data parallel options a step takes (re-exported from
/// `memsave-dist`).
pub use memsave_dist::{DdpConfig, FsdpConfig, FsdpStats, ProcessGroup, ZeroStage};
pub use optimizer::{CaseOptimizer, SavedWeights};
pub use parallel::{DataParallel, DataParallelHandle};
pub use step::{
    f_step, f_step_observed, f_step_with, StepEvent, StepMeasurement, StepObserver, StepRun,
};
pub use workload::{
    mean_square, var_store_buffers, Batch, LayerWrapper, LayerWrapperSlot, Workload,
};
