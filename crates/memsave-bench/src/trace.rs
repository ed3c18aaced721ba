//! `memsave trace`: one case of a suite, recorded allocation by allocation with
//! `memsave-trace`, through the same step code as `memsave bench`.
//!
//! The model and input are built from the suite's seed as the runner builds them (under
//! the suite's `memory_limit`, as in `memsave bench`), the strategy's plan is applied, the suite's warm-up steps run unrecorded, and then one
//! step is recorded: phases from the step ([`StepEvent`]), a mark per layer
//! (`layer i`, also when a checkpoint recomputes it in backward, which is then a
//! recomputation: what it allocates is `recompute`, per block), `end of forward`
//! where the runner reads `retained_after_forward_bytes`, parameters and input
//! registered with the recorder, and the optimizer's state and gradients shown to it
//! through memsave-optim's `Observer` (state created lazily in the first update,
//! fetched from disk for one update, gradients a step in backward frees).
use crate::models::{BlockEvent, BlockObserver, Model};
use crate::optimizer::CaseOptimizer;
use crate::step::{f_step_observed, f_step_with, StepEvent, StepMeasurement, StepObserver};
use crate::strategies::{resolve, Unavailable};
use crate::suite::{DeviceChoice, Suite};
use memsave_amp::GradScaler;
use memsave_step::plan::apply_plan;
use memsave_step::Workload;
use memsave_trace::{OptimizerRoles, Phase, Recorder, Session, Trace};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tch::{Device, Tensor};

/// The mark set where the runner reads `retained_after_forward_bytes`.
pub const END_OF_FORWARD: &str = "end of forward";

/// A recorded case: the trace, and what the recorded step measured or why it failed.
#[derive(Debug)]
pub struct TracedCase {
    /// Every allocation and free of the recorded step.
    pub trace: Trace,
    /// The recorded step's own measurement, or its error (the trace is kept either way:
    /// it shows where the step failed).
    pub step: Result<StepMeasurement, memsave_step::StepError>,
    /// Bytes of the model's parameters.
    pub parameter_bytes: u64,
}

/// Why a case could not be traced at all.
#[derive(Debug, thiserror::Error)]
pub enum TraceCaseError {
    /// No model of that name in the suite.
    #[error("the suite has no model '{name}' (models: {known})")]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// The suite's model names.
        known: String,
    },
    /// No strategy of that name in the suite.
    #[error("the suite has no strategy '{name}' (strategies: {known})")]
    UnknownStrategy {
        /// The name asked for.
        name: String,
        /// The suite's strategy names.
        known: String,
    },
    /// The case cannot be set up (plan, device, scaler).
    #[error("{0}")]
    Setup(String),
    /// The strategy cannot run on the model (what `memsave bench` reports
    /// `unavailable`).
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The recorder failed.
    #[error(transparent)]
    Record(#[from] memsave_trace::TraceError),
}

/// Tells a recording session the phases of the step, and, when backward is done, the
/// gradients of `params` (the model's, and ZeRO-3's shards): data parallel's hooks
/// take the parameters' post-accumulate-grad slots, so the recorder's own hooks
/// cannot see them, and the optimizer frees them before the recording ends. Keeps
/// `backward` set while the step is in backward, for [`block_observer`].
pub(crate) struct Phases<'s> {
    pub session: &'s Session,
    pub params: Vec<Tensor>,
    pub backward: Arc<AtomicBool>,
}

/// The block observer of a recorded step: a mark `layer i` when block `i` starts, and,
/// for a block that runs while the step is in backward (`backward`, kept by
/// [`Phases`]), a recomputation: the harness's blocks run in backward only when a
/// checkpoint recomputes them. What the recomputation allocates is then `recompute`
/// in the trace, with its bytes and time per block, instead of `temporary`.
pub(crate) fn block_observer(session: &Session, backward: Arc<AtomicBool>) -> BlockObserver {
    let session = session.clone();
    // Per block started and not yet ended, innermost last: whether it is a
    // recomputation.
    let running: Mutex<Vec<bool>> = Mutex::new(Vec::new());
    Arc::new(move |event| {
        let mut running = running.lock().unwrap_or_else(|p| p.into_inner());
        match event {
            BlockEvent::Start(i) => {
                let label = format!("layer {i}");
                session.mark(label.clone());
                let recomputing = backward.load(Ordering::Relaxed);
                if recomputing {
                    session.recomputation_start(label);
                }
                running.push(recomputing);
            }
            BlockEvent::End(_) => {
                if running.pop() == Some(true) {
                    session.recomputation_end();
                }
            }
        }
    })
}

impl StepObserver for Phases<'_> {
    fn step_event(&self, event: StepEvent) {
        let s = self.session;
        self.backward
            .store(event == StepEvent::Backward, Ordering::Relaxed);
        match event {
            StepEvent::Forward => s.phase(Phase::Forward),
            StepEvent::ForwardDone => s.mark(END_OF_FORWARD),
            StepEvent::Backward => {
                s.phase(Phase::Backward);
                s.mark("backward");
            }
            StepEvent::Optimizer => {
                let grads: Vec<Tensor> = self.params.iter().map(Tensor::grad).collect();
                s.gradients(&grads);
                s.phase(Phase::Optimizer);
                s.mark("optimizer");
            }
        }
    }
}

/// Records one step of `model` under `strategy` (names as in the suite).
///
/// Traces run on the CPU (the counting allocator's recorder); a suite whose device is
/// `cuda` is refused, one with `auto` runs on the CPU.
pub fn trace_case(
    suite: &Suite,
    model: &str,
    strategy: &str,
) -> Result<TracedCase, TraceCaseError> {
    let spec = suite
        .models
        .iter()
        .find(|m| m.name == model)
        .ok_or_else(|| TraceCaseError::UnknownModel {
            name: model.to_owned(),
            known: names(suite.models.iter().map(|m| m.name.as_str())),
        })?;
    let strategy_spec = suite
        .strategies
        .iter()
        .find(|s| s.name == strategy)
        .ok_or_else(|| TraceCaseError::UnknownStrategy {
            name: strategy.to_owned(),
            known: names(suite.strategies.iter().map(|s| s.name.as_str())),
        })?;
    if suite.device == DeviceChoice::Cuda {
        return Err(TraceCaseError::Setup(format!(
            "suite '{}' runs on `device: cuda`, but memsave trace records on the CPU only (CUDA's caching allocator is not read); set `device: cpu` or `device: auto` in a copy of the suite",
            suite.suite
        )));
    }
    let device = Device::Cpu;
    memsave_meter::install();
    if let Some(n) = suite.threads {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    let config = resolve(strategy_spec)?;
    // The suite's simulated capacity, as `memsave bench` applies it: over the model,
    // its input and the steps.
    let _limit = suite
        .memory_limit
        .as_ref()
        .map(|s| memsave_meter::MemoryLimitGuard::f_new(device, s.bytes))
        .transpose()
        .map_err(|e| TraceCaseError::Setup(format!("cannot apply the memory limit: {e}")))?;
    tch::manual_seed(suite.seed as i64);
    let model = Model::build(spec, device).map_err(|e| TraceCaseError::Setup(e.to_string()))?;
    let x = model.data();
    crate::models::residual_available(spec, config.residual)?;
    model.ctx.set_residual(config.residual);
    let mut model = model;
    apply_plan(&mut model, &x, &config, device)
        .map_err(|e| TraceCaseError::Setup(e.to_string()))?;
    let mut scaler = config
        .scaler
        .map(GradScaler::new)
        .transpose()
        .map_err(|e| TraceCaseError::Setup(e.to_string()))?;
    let mut optimizer = config
        .optimizer
        .map(|spec| CaseOptimizer::build(&spec, &model.params()))
        .transpose()
        .map_err(|e| TraceCaseError::Setup(e.to_string()))?;
    for _ in 0..suite.warmup {
        // A failing strategy fails again in the recorded step, which reports it.
        let warm = f_step_with(
            &model,
            &x,
            &config,
            device,
            false,
            scaler.as_mut(),
            optimizer.as_mut(),
        );
        if warm.is_err() {
            break;
        }
    }
    let params = model.params();
    let parameter_bytes = params.iter().map(memsave_sys::tensor::nbytes).sum();
    // State from the warm-up steps exists already; state created or fetched during the
    // step, and gradients an optimizer in backward frees, are shown to the session.
    let state = optimizer
        .as_ref()
        .map(CaseOptimizer::state_tensors)
        .unwrap_or_default();
    let inputs: Vec<Tensor> = std::iter::once(&x.input)
        .chain(x.target.as_ref())
        .map(Tensor::shallow_clone)
        .collect();
    let (step, trace) = Recorder::new(device)
        .parameters(&params)
        .inputs(&inputs)
        .optimizer_state(&state)
        // Gradients in files take each parameter's one post-accumulate-grad hook.
        .gradient_hooks(config.offload_grads.is_none())
        .record(|session| {
            let backward = Arc::new(AtomicBool::new(false));
            model
                .ctx
                .set_block_observer(Some(block_observer(session, backward.clone())));
            // A model of named blocks: each block's run is marked by its key.
            if let Some(blocks) = Workload::blocks(&model) {
                blocks.set_observer(Some(memsave_trace::block_runs(session)));
            }
            if let Some(optimizer) = optimizer.as_mut() {
                optimizer.set_observer(Some(Arc::new(OptimizerRoles(session.clone()))));
            }
            let step = f_step_observed(
                &model,
                &x,
                &config,
                device,
                false,
                scaler.as_mut(),
                optimizer.as_mut(),
                &Phases {
                    session,
                    params: params.iter().map(Tensor::shallow_clone).collect(),
                    backward,
                },
            );
            model.ctx.set_block_observer(None);
            if let Some(blocks) = Workload::blocks(&model) {
                blocks.set_observer(None);
            }
            if let Some(optimizer) = optimizer.as_mut() {
                optimizer.set_observer(None);
                session.optimizer_state(&optimizer.state_tensors());
            }
            session.phase(Phase::Other);
            step
        })?;
    Ok(TracedCase {
        trace,
        step,
        parameter_bytes,
    })
}

fn names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}
