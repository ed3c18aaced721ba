//! The data-parallel modes `fit` chooses between on the ranks of a process group: one
//! more lever, probed and measured on every rank with the others.
use memsave_step::{DataParallel, DdpConfig, FsdpConfig, StepConfig, Workload, ZeroStage};
use serde::Serialize;

/// How the ranks share a step (see `memsave_step::parallel`): what each rank holds of
/// the parameters, their gradients and the optimizer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ParallelMode {
    /// Data parallel: every rank holds everything; the gradients are averaged in
    /// buckets during backward.
    #[serde(rename = "ddp")]
    Ddp,
    /// ZeRO-1: each rank keeps 1/N of the optimizer's state.
    #[serde(rename = "zero1")]
    Zero1,
    /// ZeRO-2: each rank keeps 1/N of the optimizer's state and of the gradients.
    #[serde(rename = "zero2")]
    Zero2,
    /// ZeRO-3 (FSDP): each rank keeps 1/N of the parameters too, gathering a layer's
    /// weights only while it runs (`reshard_after_forward`, FSDP2's default). Needs a
    /// workload that says which parameters each layer uses
    /// (`Workload::layer_parameters`, `Workload::set_layer_wrapper`).
    #[serde(rename = "zero3")]
    Zero3,
}

impl ParallelMode {
    /// Every mode, in the order `fit` considers them (most memory first).
    pub const ALL: [ParallelMode; 4] = [
        ParallelMode::Ddp,
        ParallelMode::Zero1,
        ParallelMode::Zero2,
        ParallelMode::Zero3,
    ];

    /// The step engine's mode.
    pub fn data_parallel(self) -> DataParallel {
        match self {
            ParallelMode::Ddp => DataParallel::Ddp(DdpConfig::default()),
            ParallelMode::Zero1 => DataParallel::Zero(ZeroStage::One),
            ParallelMode::Zero2 => DataParallel::Zero(ZeroStage::Two),
            ParallelMode::Zero3 => DataParallel::Fsdp(FsdpConfig::default()),
        }
    }

    /// The mode as a strategy names it: `ddp`, `zero(stage=1)`, `zero(stage=2)`,
    /// `zero(stage=3)`.
    pub fn name(self) -> &'static str {
        match self {
            ParallelMode::Ddp => "ddp",
            ParallelMode::Zero1 => "zero(stage=1)",
            ParallelMode::Zero2 => "zero(stage=2)",
            ParallelMode::Zero3 => "zero(stage=3)",
        }
    }

    /// Why this mode cannot run `workload` at all, if so: ZeRO-3 needs to know which
    /// parameters each layer uses and to run each layer's forward inside its unit (a
    /// model of blocks has its units found per block when it is set up).
    /// (Removes any layer wrapper the workload has: `fit` sets its own per run.)
    pub(crate) fn refuses_workload(self, workload: &dyn Workload) -> Option<String> {
        if self != ParallelMode::Zero3 {
            return None;
        }
        let name = workload.name();
        // A model of blocks: one unit per top-level block, found when it is set up.
        if let Some(blocks) = workload.blocks() {
            blocks.set_wrapper(None);
            return None;
        }
        let why = match workload.layer_parameters() {
            Err(e) => format!(
                "the workload '{name}' could not find which parameters each layer uses: {e}"
            ),
            Ok(None) => format!("the workload '{name}' does not say which parameters each layer uses (Workload::layer_parameters)"),
            Ok(Some(_)) if !workload.set_layer_wrapper(None) => format!("the workload '{name}' cannot run its layers inside their units (Workload::set_layer_wrapper)"),
            Ok(Some(_)) => return None,
        };
        Some(format!("{REFUSED}{}: {why}", self.name()))
    }

    /// Why this mode cannot run `config` (`DataParallel::check`'s reason, after
    /// [`REFUSED`] and the mode's name), if so.
    pub(crate) fn refuses(self, config: &StepConfig) -> Option<String> {
        self.data_parallel()
            .check(config)
            .err()
            .map(|e| format!("{REFUSED}{}: {e}", self.name()))
    }
}

/// How the note of a configuration a mode refuses begins.
pub(crate) const REFUSED: &str = "refused by ";
