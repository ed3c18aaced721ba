//! `memsave trace`: one case of a suite, recorded allocation by allocation with
//! `memsave-trace`, through the same step code as `memsave bench`.
//!
//! The model and input are built from the suite's seed as the runner builds them, the
//! strategy's plan is applied, the suite's warm-up steps run unrecorded, and then one
//! step is recorded: phases from the step ([`StepEvent`]), a mark per layer
//! (`layer i`, also when a checkpoint recomputes it in backward), `end of forward`
//! where the runner reads `retained_after_forward_bytes`, parameters and input
//! registered with the recorder.
use crate::models::Model;
use crate::optimizer::CaseOptimizer;
use crate::runner::apply_plan;
use crate::step::{f_step_observed, f_step_with, StepEvent, StepMeasurement, StepObserver};
use crate::strategies::resolve;
use crate::suite::{DeviceChoice, Suite};
use memsave_amp::GradScaler;
use memsave_plan::Batch;
use memsave_trace::{Phase, Recorder, Session, Trace};
use std::sync::Arc;
use tch::Device;

/// The mark set where the runner reads `retained_after_forward_bytes`.
pub const END_OF_FORWARD: &str = "end of forward";

/// A recorded case: the trace, and what the recorded step measured or why it failed.
#[derive(Debug)]
pub struct TracedCase {
    /// Every allocation and free of the recorded step.
    pub trace: Trace,
    /// The recorded step's own measurement, or its error (the trace is kept either way:
    /// it shows where the step failed).
    pub step: Result<StepMeasurement, String>,
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
    /// The recorder failed.
    #[error(transparent)]
    Record(#[from] memsave_trace::TraceError),
}

/// Tells a recording session the phases of the step.
struct Phases<'s>(&'s Session);

impl StepObserver for Phases<'_> {
    fn step_event(&self, event: StepEvent) {
        match event {
            StepEvent::Forward => self.0.phase(Phase::Forward),
            StepEvent::ForwardDone => self.0.mark(END_OF_FORWARD),
            StepEvent::Backward => {
                self.0.phase(Phase::Backward);
                self.0.mark("backward");
            }
            StepEvent::Optimizer => {
                self.0.phase(Phase::Optimizer);
                self.0.mark("optimizer");
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
        return Err(memsave_trace::TraceError::UnsupportedDevice(Device::Cuda(0)).into());
    }
    let device = Device::Cpu;
    memsave_meter::install();
    if let Some(n) = suite.threads {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    let config = resolve(strategy_spec).map_err(TraceCaseError::Setup)?;
    tch::manual_seed(suite.seed as i64);
    let model = Model::build(spec, device).map_err(|e| TraceCaseError::Setup(e.to_string()))?;
    let x = Batch::input(model.input.shallow_clone());
    model.ctx.set_residual(config.residual);
    let mut model = model;
    apply_plan(&mut model, &x, &config, device).map_err(TraceCaseError::Setup)?;
    let mut scaler = config
        .scaler
        .map(GradScaler::new)
        .transpose()
        .map_err(|e| TraceCaseError::Setup(e.to_string()))?;
    let mut optimizer = config
        .optimizer
        .map(|spec| CaseOptimizer::build(&spec, &model.params()))
        .transpose()
        .map_err(TraceCaseError::Setup)?;
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
    let parameter_bytes = params
        .iter()
        .map(|p| p.numel() as u64 * p.kind().elt_size_in_bytes() as u64)
        .sum();
    let (step, trace) = Recorder::new(device)
        .parameters(&params)
        .inputs(&[x.input.shallow_clone()])
        .record(|session| {
            let layers = session.clone();
            model
                .ctx
                .set_block_observer(Some(Arc::new(move |i| layers.mark(format!("layer {i}")))));
            let step = f_step_observed(
                &model,
                &x,
                &config,
                device,
                false,
                scaler.as_mut(),
                optimizer.as_mut(),
                &Phases(session),
            );
            model.ctx.set_block_observer(None);
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
