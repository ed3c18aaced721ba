//! What a configuration changes in a training step: the residual update, the
//! checkpoint plan, autocast, micro-batching, loss scaling, the optimizer and the
//! saved-tensor hooks. The harness resolves a suite's strategy into one; `fit` builds
//! them from its candidates.
use crate::levers::{CompressDtype, OffloadSpec, OptimizerSpec};
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
    /// `Plan::Budget(bytes)` whose solver may also keep checkpoint inputs in boundary
    /// stores (`CheckpointedSequential::with_levers`): a disk store (with `offload`, in
    /// a temporary directory made for the case) and a codec (with `compress`), measured
    /// when the model is profiled.
    BudgetWithLevers {
        /// The budget.
        bytes: u64,
        /// Whether the solver may offload boundaries to disk.
        offload: bool,
        /// The codec the solver may compress boundaries with.
        compress: Option<CompressDtype>,
    },
}

/// What the forward's saved-tensor hooks do with saved activations, if anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SavedTensors {
    /// Stored smaller by `memsave_hooks::Compress`.
    Compress(CompressDtype),
    /// Offloaded by `memsave_hooks::DiskOffload` or `memsave_hooks::SaveOnCpu`.
    Offload(OffloadSpec),
    /// Offloaded by `memsave_hooks::DiskOffload` in the default directory, each pack
    /// waiting for its own write and backward reading without prefetch, so that what
    /// the store holds in memory does not depend on its writer thread's pace: `fit`
    /// predicts peaks with it.
    OffloadSynchronous,
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
    /// Gradients kept in files between backward passes (`memsave_hooks::GradOffload`
    /// in the default offload directory), if any: the optimizer in backward steps each
    /// whole gradient during the last micro-batch's backward.
    pub offload_grads: Option<GradsAfter>,
    /// With [`offload_grads`](Self::offload_grads): only the gradients of parameters
    /// of at least this many bytes go to files; the smaller ones accumulate in memory
    /// (`memsave_hooks::GradOffload::keep_in_memory`). Files cost a write and a read per
    /// parameter and backward, mostly time and little memory for biases and norms'
    /// weights. `None` (the default): every gradient. Under [`GradsAfter::Dropped`]
    /// the kept ones stay in `.grad` after the step (the next step frees them).
    pub offload_grads_at_least: Option<u64>,
    /// The parameters off the device between their uses, if any (see
    /// [`ParamsOffload`]).
    pub offload_params: Option<ParamsOffload>,
}

/// Where the parameters live between their uses, off the device: each unit (a layer of
/// the workload's `CheckpointedSequential`, or a top-level block of a model of blocks)
/// keeps its weights there, and they are brought in for its forward, its
/// recomputation and its backward, then freed, so that the device holds about one
/// unit's weights besides the working set (DeepSpeed's ZeRO-Infinity, FSDP2's
/// `CPUOffloadPolicy`). On one process it runs as ZeRO-3 over a group of one whose
/// shards are in files (`memsave_dist::FsdpConfig::shards_in_files`); under
/// [`DataParallel::Fsdp`](crate::DataParallel::Fsdp) each rank's shards go to files.
///
/// The optimizer must step in backward ([`OptimizerSpec::in_backward`](crate::OptimizerSpec::in_backward)):
/// each unit's weights are read, stepped and written as its gradients land. With
/// micro-batches, each unit's gradients are summed in a file of its own until the last
/// micro-batch's backward steps it. The weights are bitwise those of the same step
/// (the same micro-batches) with the parameters on the device and the optimizer
/// stepped after backward. Between steps the workload's
/// parameters read NaN; read the weights with
/// [`Trainer::restore_full_parameters`](crate::Trainer::restore_full_parameters) (or
/// the handle's `Fsdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamsOffload {
    /// In files of a temporary directory made for the trainer (`offload_params: {to:
    /// disk}` in a suite). Each file is checked (length and CRC-32) when it is read:
    /// a damaged one fails the step, naming it.
    Disk,
}

/// What becomes of offloaded gradients that no optimizer in backward consumed, once
/// the measured step is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradsAfter {
    /// Put back into `.grad` after the measurement, for the caller to read (the
    /// harness compares them with the baseline's).
    Restored,
    /// Dropped with their files (`fit`'s runs, which only measure: putting them back
    /// could exceed the simulated capacity the run is under).
    Dropped,
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
            offload_grads: None,
            offload_grads_at_least: None,
            offload_params: None,
        }
    }
}
