//! `memsave fit`: `memsave_plan::fit` on a model of a suite, built as the runner
//! builds it (same seed, same input), optionally with an optimizer.
use crate::models::Model;
use crate::runner::{resolve_device, RunError};
use crate::suite::{OptimizerSpec, Suite};
use memsave_plan::{fit, Batch, FitError, FitReport, FitRequest, Workload};
use tch::Device;

/// A bundled model with the optimizer `fit` should count and step.
struct WithOptimizer {
    model: Model,
    optimizer: Option<OptimizerSpec>,
}

impl Workload for WithOptimizer {
    fn name(&self) -> &str {
        self.model.name()
    }
    fn device(&self) -> Device {
        Workload::device(&self.model)
    }
    fn layers(&self) -> &memsave_checkpoint::CheckpointedSequential {
        self.model.layers()
    }
    fn layers_mut(&mut self) -> &mut memsave_checkpoint::CheckpointedSequential {
        self.model.layers_mut()
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        self.model.parameters()
    }
    fn global_batch(&self) -> i64 {
        self.model.global_batch()
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        self.model.batch(size)
    }
    fn optimizer(&self) -> Option<OptimizerSpec> {
        self.optimizer
    }
}

/// Why `fit` could not run on a suite's model.
#[derive(Debug, thiserror::Error)]
pub enum FitCaseError {
    /// No model of that name in the suite.
    #[error("the suite has no model '{name}' (models: {known})")]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// The suite's model names.
        known: String,
    },
    /// The suite's device is not available.
    #[error(transparent)]
    Device(#[from] RunError),
    /// Building the model failed.
    #[error("building the model failed: {0}")]
    Build(String),
    /// `fit` itself gave no answer.
    #[error(transparent)]
    Fit(#[from] FitError),
}

/// Runs `fit` on the suite's model `model` (built from the suite's seed on the suite's
/// device, under its thread count), with `optimizer` stepped in every step if given.
pub fn fit_model(
    suite: &Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
) -> Result<FitReport, FitCaseError> {
    let spec = suite
        .models
        .iter()
        .find(|m| m.name == model)
        .ok_or_else(|| FitCaseError::UnknownModel {
            name: model.to_owned(),
            known: suite
                .models
                .iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    let device = resolve_device(suite.device)?;
    memsave_meter::install();
    if let Some(n) = suite.threads {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    tch::manual_seed(suite.seed as i64);
    let model = std::panic::catch_unwind(|| Model::build(spec, device))
        .map_err(|_| FitCaseError::Build("the model's constructor panicked".into()))?
        .map_err(|e| FitCaseError::Build(e.to_string()))?;
    let mut workload = WithOptimizer { model, optimizer };
    Ok(fit(&mut workload, request)?)
}
