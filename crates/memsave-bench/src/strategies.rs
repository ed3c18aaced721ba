//! What a strategy changes in a training step, resolved from the suite's techniques
//! into `memsave_step`'s [`StepConfig`].
use crate::suite::{CheckpointSpec, StrategySpec, Technique};
use memsave_checkpoint::Plan;
pub use memsave_step::{GradsAfter, PlanChoice, ResidualUpdate, SavedTensors, StepConfig};

/// The step of `strategy`, or why it cannot run in this build.
pub fn resolve(strategy: &StrategySpec) -> Result<StepConfig, Unavailable> {
    let mut config = StepConfig::baseline();
    for technique in &strategy.techniques {
        match technique {
            Technique::Baseline => {}
            Technique::InplaceAdd => config.residual = ResidualUpdate::InplaceAdd,
            Technique::AddOut => config.residual = ResidualUpdate::AddOut,
            Technique::SafeResidual => config.residual = ResidualUpdate::Safe,
            Technique::Checkpoint(spec) => {
                config.plan = match spec {
                    CheckpointSpec::Segments(k) => PlanChoice::Fixed(Plan::Segments(*k)),
                    CheckpointSpec::EveryLayer => PlanChoice::Fixed(Plan::EveryLayer),
                    CheckpointSpec::Nested => PlanChoice::Fixed(Plan::Nested),
                    CheckpointSpec::Budget(size) => PlanChoice::Budget(size.bytes),
                    CheckpointSpec::BudgetWithLevers {
                        budget,
                        offload,
                        compress,
                    } => PlanChoice::BudgetWithLevers {
                        bytes: budget.bytes,
                        offload: *offload,
                        compress: *compress,
                    },
                }
            }
            Technique::Autocast(dtype) => config.autocast = Some(dtype.kind),
            Technique::Accumulate { micro_batches } => config.micro_batches = Some(*micro_batches),
            Technique::GradScaler(spec) => config.scaler = Some(spec.config()),
            Technique::Compress(dtype) => config.saved = Some(SavedTensors::Compress(*dtype)),
            Technique::Offload(spec) => config.saved = Some(SavedTensors::Offload(spec.clone())),
            Technique::Optimizer(spec) => config.optimizer = Some(*spec),
            Technique::OffloadGrads(at_least) => {
                config.offload_grads = Some(GradsAfter::Restored);
                config.offload_grads_at_least = at_least.as_ref().map(|s| s.bytes);
            }
            Technique::OffloadParams => {
                config.offload_params = Some(memsave_step::ParamsOffload::Disk)
            }
            Technique::Zero(_) => return Err(Unavailable::ZeroNeedsRanks),
            // The runner searches for these (runner.rs); the step itself is plain.
            Technique::AutoBatch(_) | Technique::Fit(_) => {}
        }
    }
    if config.offload_grads.is_some() && config.scaler.is_some() {
        return Err(Unavailable::OffloadGradsWithScaler);
    }
    if config.optimizer.is_some_and(|o| o.in_backward) {
        // With the parameters in files, each unit's gradients wait in a file of its
        // own between micro-batches.
        let in_files = config.offload_grads.is_some() || config.offload_params.is_some();
        if config.micro_batches.is_some() && !in_files {
            return Err(Unavailable::InBackwardWithAccumulation);
        }
        if config.scaler.is_some() {
            return Err(Unavailable::InBackwardWithScaler);
        }
    }
    Ok(config)
}

/// Why a strategy cannot run (on a model): the case is reported `unavailable`, and
/// `memsave check` refuses the suite.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// `zero` on a suite without `world_size`.
    #[error(
        "zero shards the training state over ranks: set world_size: N on the suite (or --world-size N)"
    )]
    ZeroNeedsRanks,
    /// `offload_params` on a suite without `world_size`.
    #[error(
        "offload_params runs the step as ZeRO-3 over a process group (of one on one process): set world_size: 1 on the suite (or --world-size 1)"
    )]
    OffloadParamsNeedsRanks,
    /// `offload_grads` with `grad_scaler`.
    #[error("offload_grads keeps gradients in files, but grad_scaler must check every gradient for inf/NaN at once; drop one")]
    OffloadGradsWithScaler,
    /// An optimizer `in_backward` with `accumulate` but without `offload_grads`.
    #[error("optimizer in_backward steps at every backward, so it cannot accumulate over micro-batches in memory; drop accumulate or in_backward, or add offload_grads: {{to: disk}}")]
    InBackwardWithAccumulation,
    /// An optimizer `in_backward` with `grad_scaler`.
    #[error("optimizer in_backward cannot check every gradient for inf/NaN before the first update, so it cannot run with grad_scaler; drop one")]
    InBackwardWithScaler,
    /// A checkpoint plan other than `every_layer` on a network of blocks.
    #[error("the model '{model}' ({kind}) is a model of blocks, not a chain: its checkpoint plan is every_layer (every block recomputed) or none; memsave fit plans its blocks one by one")]
    NotAChain {
        /// The model's name.
        model: String,
        /// Its kind (`unet`, `encoder_decoder`).
        kind: &'static str,
    },
    /// A residual update (`inplace_add`, `add_out`, `safe_residual`) on a zoo network.
    #[error("the model '{model}' ({kind}) has no residual blocks to apply {update:?} to (the zoo's blocks add as their architecture does)")]
    NoResidualBlocks {
        /// The model's name.
        model: String,
        /// Its kind (`resnet`, ...).
        kind: &'static str,
        /// The update asked for.
        update: ResidualUpdate,
    },
    /// The strategy cannot run on the suite's `world_size` ranks (the reason names the
    /// technique).
    #[error("{0}")]
    OnRanks(String),
}
