//! `memsave fit`: `memsave_fit::fit` on a model of a suite, built as the runner
//! builds it (same seed, same input), optionally with an optimizer.
use crate::message::one_line;
use crate::models::Model;
use crate::runner::{resolve_device, RunError};
use crate::suite::{
    ModelSpec, ModelSpecError, OptimizerKind, OptimizerSpec, StatePrecision, Suite, Technique,
};
use memsave_fit::{fit_with, FitEvent};
use memsave_fit::{FitError, FitReport, FitRequest};
use memsave_meter::Bytes;
use memsave_step::{Batch, Workload};
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
    fn buffers(&self) -> Vec<tch::Tensor> {
        self.model.buffers()
    }
    fn loss(
        &self,
        output: &tch::Tensor,
        target: Option<&tch::Tensor>,
    ) -> Result<tch::Tensor, tch::TchError> {
        self.model.loss(output, target)
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
    /// The requested global batch is outside the limits a suite's model is held to.
    #[error("a global batch of {batch}: {source}")]
    GlobalBatch {
        /// The global batch asked for.
        batch: i64,
        /// Why, in the suite's words ([`ModelSpec::with_global_batch`]'s error).
        #[source]
        source: ModelSpecError,
    },
    /// Found before building anything: the least every configuration holds is more
    /// than the budget, or than the memory there is.
    #[error("{0}")]
    TooLarge(String),
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
///
/// Before anything is built, the request is checked against what the suite says of
/// the model: a `global_batch` over the suite's limits is refused, and so is a model
/// whose parameters, optimizer state, batch (input and target) and largest gradient
/// (the least any configuration holds) do not fit the memory available, or whose
/// largest gradient alone does not fit the budget (see [`least_memory`]). A model
/// near the parameter limit otherwise takes minutes to build before failing.
pub fn fit_model(
    suite: &Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
) -> Result<FitReport, FitCaseError> {
    fit_model_with(suite, model, request, optimizer, &mut |_| {})
}

/// [`fit_model`], telling `progress` each phase of the fit as it starts
/// ([`memsave_fit::fit_with`]).
pub fn fit_model_with(
    suite: &Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
    progress: &mut dyn FnMut(&FitEvent),
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
    if let Some(batch) = request.global_batch {
        spec.with_global_batch(batch)
            .map_err(|source| FitCaseError::GlobalBatch { batch, source })?;
    }
    let least = least_memory(spec, request, optimizer.as_ref());
    check_least(
        &least,
        spec,
        request,
        suite.memory_limit.as_ref().map(|s| s.bytes),
    )?;
    let device = resolve_device(suite.device)?;
    memsave_meter::install();
    if let Some(n) = suite.threads {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    tch::manual_seed(suite.seed as i64);
    let model = std::panic::catch_unwind(|| Model::build(spec, device))
        .map_err(|payload| {
            FitCaseError::Build(format!(
                "the model's constructor panicked: {}",
                one_line(&memsave_sys::checkpoint::panic_message(&*payload))
            ))
        })?
        .map_err(|e| FitCaseError::Build(one_line(&e.to_string())))?;
    let mut workload = WithOptimizer { model, optimizer };
    Ok(fit_with(&mut workload, request, progress)?)
}

/// The optimizer `memsave fit` steps when it is not told one: the suite's first
/// `optimizer` technique (alone or in a `with:` list) with its kind and
/// hyperparameters (`lr`, `betas`, `eps`, `weight_decay`, `momentum`), its state in
/// f32, on the device and stepped after backward: the state's precision (with
/// `int8_state` allowed), where the step happens and the gradients' place are fit's
/// to choose. `None` when the suite has no optimizer.
pub fn suite_optimizer(suite: &Suite) -> Option<OptimizerSpec> {
    suite.strategies.iter().find_map(|s| {
        s.techniques.iter().find_map(|t| match t {
            Technique::Optimizer(spec) => Some(OptimizerSpec {
                kind: spec.kind,
                lr: spec.lr,
                betas: spec.betas,
                eps: spec.eps,
                weight_decay: spec.weight_decay,
                momentum: spec.momentum,
                ..OptimizerSpec::default()
            }),
            _ => None,
        })
    })
}

/// The least memory any configuration of a fit holds, in bytes, computed from the
/// suite's model alone (f32 parameters); `None` where a count overflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeastMemory {
    /// The parameters.
    pub parameters: Option<u64>,
    /// The gradient of the largest parameter: whole in memory at some moment of every
    /// step, even with the step in backward or the gradients in files. It counts in
    /// the budget.
    pub largest_gradient: Option<u64>,
    /// The optimizer's state at its smallest allowed precision: a buffer per parameter
    /// for each value the rule keeps (AdamW: two moments; SGD with momentum: one, without
    /// momentum: none), at the bytes of the spec's `state` (4, 2 or 1), or 1 with
    /// `int8_state` allowed (the int8 codes' scales, 4 bytes per 256 values, are left
    /// out: this is a least).
    pub optimizer_state: Option<u64>,
    /// The copy of the weights `fit` keeps in host memory to put them back after each
    /// run of a step that updates them (with an optimizer).
    pub weights_copy: Option<u64>,
    /// The suite's batch ([`ModelSpec::batch_bytes`]: the input at its dtype's bytes,
    /// and a zoo model's target), and the global batch's when it is larger (new
    /// tensors).
    pub batch: Option<u64>,
}

impl LeastMemory {
    /// Everything the process holds at least: all the fields added up.
    pub fn total(&self) -> Option<u64> {
        [
            self.parameters,
            self.largest_gradient,
            self.optimizer_state,
            self.weights_copy,
            self.batch,
        ]
        .into_iter()
        .try_fold(0u64, |sum, b| sum.checked_add(b?))
    }

    /// What libtorch allocates at least (all but the host copy of the weights).
    pub fn tensors(&self) -> Option<u64> {
        [
            self.parameters,
            self.largest_gradient,
            self.optimizer_state,
            self.batch,
        ]
        .into_iter()
        .try_fold(0u64, |sum, b| sum.checked_add(b?))
    }

    /// The parts of [`total`](Self::total) (with `host_copy`) or of
    /// [`tensors`](Self::tensors), for a message: each one not zero, by name.
    fn parts(&self, host_copy: bool) -> String {
        let mut parts = Vec::new();
        for (what, bytes) in [
            ("parameters", self.parameters),
            ("optimizer state", self.optimizer_state),
            (
                "a copy of the weights",
                if host_copy {
                    self.weights_copy
                } else {
                    Some(0)
                },
            ),
            ("largest gradient", self.largest_gradient),
            ("batch", self.batch),
        ] {
            match bytes {
                Some(0) => {}
                Some(b) => parts.push(format!("{what} {}", Bytes(b))),
                None => parts.push(format!("{what} over 2^64 bytes")),
            }
        }
        parts.join(", ")
    }
}

/// The least memory a fit of `spec` holds under `request` with `optimizer`.
pub fn least_memory(
    spec: &ModelSpec,
    request: &FitRequest,
    optimizer: Option<&OptimizerSpec>,
) -> LeastMemory {
    const F32: u64 = 4;
    let count = spec.parameter_count();
    let parameters = count.and_then(|n| n.checked_mul(F32));
    let optimizer_state = match optimizer {
        None => Some(0),
        Some(o) => {
            let buffers = match o.kind {
                OptimizerKind::Adamw => 2,
                OptimizerKind::Sgd if o.momentum.unwrap_or(0.0) != 0.0 => 1,
                OptimizerKind::Sgd => 0,
            };
            let per_value = if request.allow.int8_state {
                1
            } else {
                match o.state {
                    StatePrecision::F32 => 4,
                    StatePrecision::Bf16 => 2,
                    StatePrecision::Int8 => 1,
                }
            };
            count.and_then(|n| n.checked_mul(buffers * per_value))
        }
    };
    let weights_copy = match optimizer {
        Some(_) => parameters,
        None => Some(0),
    };
    let global_batch = match request.global_batch {
        Some(b) if spec.batch.first().is_some_and(|&first| b > first) => {
            spec.with_global_batch(b).ok().and_then(|s| s.batch_bytes())
        }
        _ => Some(0),
    };
    let batch = spec
        .batch_bytes()
        .zip(global_batch)
        .and_then(|(a, b)| a.checked_add(b));
    LeastMemory {
        parameters,
        largest_gradient: spec.largest_parameter().and_then(|n| n.checked_mul(F32)),
        optimizer_state,
        weights_copy,
        batch,
    }
}

/// Refuses a fit whose least memory is over the budget or the memory there is.
fn check_least(
    least: &LeastMemory,
    spec: &ModelSpec,
    request: &FitRequest,
    memory_limit: Option<u64>,
) -> Result<(), FitCaseError> {
    let name = &spec.name;
    let budget = Bytes(request.budget_bytes);
    match least.largest_gradient {
        Some(g) if g <= request.budget_bytes => {}
        g => {
            let shown = g.map_or("over 2^64 bytes".to_owned(), |g| Bytes(g).to_string());
            return Err(FitCaseError::TooLarge(format!(
                "no configuration fits {budget}: the largest parameter of model '{name}' has a gradient of {shown}, which every step holds whole at least once, whatever the levers; give a budget of at least {shown} (nothing was built)"
            )));
        }
    }
    let hint = "reduce layers or hidden, or use a machine with more memory";
    if let Some(limit) = memory_limit {
        if least.tensors().is_none_or(|t| t > limit) {
            return Err(FitCaseError::TooLarge(format!(
                "model '{name}' needs at least {} before its first step ({}), more than the suite's memory_limit of {}; {hint} (nothing was built)",
                least.tensors().map_or("over 2^64 bytes".to_owned(), |t| Bytes(t).to_string()),
                least.parts(false),
                Bytes(limit)
            )));
        }
    }
    if let Some((available, what)) = available_memory() {
        if least.total().is_none_or(|t| t > available) {
            let int8 = if least.optimizer_state.unwrap_or(0) > 0 && !request.allow.int8_state {
                "; --allow int8-state keeps the optimizer state in a quarter of that"
            } else {
                ""
            };
            return Err(FitCaseError::TooLarge(format!(
                "model '{name}' needs at least {} before its first step ({}), more than the {} {what}; {hint}{int8} (nothing was built)",
                least.total().map_or("over 2^64 bytes".to_owned(), |t| Bytes(t).to_string()),
                least.parts(true),
                Bytes(available)
            )));
        }
    }
    Ok(())
}

/// The memory this process can still have, and what limits it: the kernel's estimate
/// of available memory (`MemAvailable`), or the room left under this control group's
/// limit if that is less. `None` where neither can be read (not Linux).
pub fn available_memory() -> Option<(u64, &'static str)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let machine = meminfo.as_deref().and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|kb| kb.trim().parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    // cgroup v2 ("max" when unlimited, which does not parse), then v1.
    let group = read("/sys/fs/cgroup/memory.max")
        .zip(read("/sys/fs/cgroup/memory.current"))
        .or_else(|| {
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
                .zip(read("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
        })
        .map(|(limit, used)| limit.saturating_sub(used));
    match (machine, group) {
        (Some(m), Some(g)) if g < m => Some((g, "left under this control group's memory limit")),
        (Some(m), _) => Some((m, "this machine has available")),
        (None, Some(g)) => Some((g, "left under this control group's memory limit")),
        (None, None) => None,
    }
}
