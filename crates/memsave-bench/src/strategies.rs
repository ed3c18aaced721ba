//! What a strategy changes in a training step, resolved from the suite's techniques
//! into `memsave_step`'s [`StepConfig`].
use crate::suite::{CheckpointSpec, StrategySpec, Technique};
use memsave_checkpoint::Plan;
pub use memsave_step::{GradsAfter, PlanChoice, ResidualUpdate, SavedTensors, StepConfig};

/// The step of `strategy`, or why it cannot run in this build.
pub fn resolve(strategy: &StrategySpec) -> Result<StepConfig, String> {
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
            Technique::OffloadGrads => config.offload_grads = Some(GradsAfter::Restored),
            Technique::Zero(_) => {
                return Err("zero shards the training state over ranks: set world_size: N on the suite (or --world-size N)".into())
            }
            // The runner searches for these (runner.rs); the step itself is plain.
            Technique::AutoBatch(_) | Technique::Fit(_) => {}
        }
    }
    if config.offload_grads.is_some() && config.scaler.is_some() {
        return Err("offload_grads keeps gradients in files, but grad_scaler must check every gradient for inf/NaN at once; drop one".into());
    }
    if config.optimizer.is_some_and(|o| o.in_backward) {
        if config.micro_batches.is_some() && config.offload_grads.is_none() {
            return Err("optimizer in_backward steps at every backward, so it cannot accumulate over micro-batches in memory; drop accumulate or in_backward, or add offload_grads: {to: disk}".into());
        }
        if config.scaler.is_some() {
            return Err("optimizer in_backward cannot check every gradient for inf/NaN before the first update, so it cannot run with grad_scaler; drop one".into());
        }
    }
    Ok(config)
}
