//! What a strategy changes in a training step: the residual update, the checkpoint
//! plan, autocast, micro-batching and loss scaling, resolved from the suite's
//! techniques.
use crate::suite::{
    CheckpointSpec, CompressDtype, OffloadSpec, OptimizerSpec, StrategySpec, Technique,
};
use memsave_amp::GradScalerConfig;
use memsave_checkpoint::Plan;
use tch::Kind;

/// How a residual block adds its branch `f(x)` to its input `x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResidualUpdate {
    /// `x + f(x)`, out of place: what autograd needs.
    #[default]
    Add,
    /// `x += f(x)`: mutates `x`, which the layer saved for backward, so backward fails.
    InplaceAdd,
    /// `add(x, f(x), out=x)`: `out=` does not support autograd, so the forward fails.
    AddOut,
    /// memsave-inplace's `residual_add`: in place only when nothing else holds `x`.
    Safe,
}

impl ResidualUpdate {
    /// True when the update may write into its input, so the runner gives it a copy
    /// of the suite's input rather than the shared one.
    pub fn writes_input(self) -> bool {
        matches!(self, ResidualUpdate::InplaceAdd | ResidualUpdate::AddOut)
    }
}

/// The checkpoint plan of a strategy, before a budget is solved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanChoice {
    /// A plan that needs no profile.
    Fixed(Plan),
    /// `Plan::Budget(bytes)`: the model is profiled on the step's input first.
    Budget(u64),
}

/// What the forward's saved-tensor hooks do with saved activations, if anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SavedTensors {
    /// Stored smaller by `memsave_hooks::Compress`.
    Compress(CompressDtype),
    /// Offloaded by `memsave_hooks::DiskOffload` or `memsave_hooks::SaveOnCpu`.
    Offload(OffloadSpec),
}

/// Everything a measured step needs to know about a strategy.
#[derive(Debug, Clone, PartialEq)]
pub struct StepConfig {
    /// The residual update of every block.
    pub residual: ResidualUpdate,
    /// The checkpoint plan of the model.
    pub plan: PlanChoice,
    /// Autocast dtype of the forward and the loss, if any.
    pub autocast: Option<Kind>,
    /// Number of micro-batches of the first batch dimension, if any.
    pub micro_batches: Option<usize>,
    /// The settings of the case's `GradScaler`, if the strategy scales the loss.
    pub scaler: Option<GradScalerConfig>,
    /// The optimizer stepped inside the measured step, if any.
    pub optimizer: Option<OptimizerSpec>,
    /// Saved-tensor hooks around the forward, if any.
    pub saved: Option<SavedTensors>,
}

impl StepConfig {
    /// Plain training: the baseline.
    pub fn baseline() -> Self {
        Self {
            residual: ResidualUpdate::Add,
            plan: PlanChoice::Fixed(Plan::None),
            autocast: None,
            micro_batches: None,
            scaler: None,
            optimizer: None,
            saved: None,
        }
    }

    /// The step of `strategy`, or why it cannot run in this build.
    pub fn resolve(strategy: &StrategySpec) -> Result<Self, String> {
        let mut config = Self::baseline();
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
                    }
                }
                Technique::Autocast(dtype) => config.autocast = Some(dtype.kind),
                Technique::Accumulate { micro_batches } => {
                    config.micro_batches = Some(*micro_batches)
                }
                Technique::GradScaler(spec) => config.scaler = Some(spec.config()),
                Technique::Compress(dtype) => config.saved = Some(SavedTensors::Compress(*dtype)),
                Technique::Offload(spec) => {
                    config.saved = Some(SavedTensors::Offload(spec.clone()))
                }
                Technique::Optimizer(spec) => config.optimizer = Some(*spec),
            }
        }
        if config.optimizer.is_some_and(|o| o.in_backward) {
            if config.micro_batches.is_some() {
                return Err("optimizer in_backward steps at every backward, so it cannot accumulate over micro-batches; drop accumulate or in_backward".into());
            }
            if config.scaler.is_some() {
                return Err("optimizer in_backward cannot check every gradient for inf/NaN before the first update, so it cannot run with grad_scaler; drop one".into());
            }
        }
        Ok(config)
    }
}
