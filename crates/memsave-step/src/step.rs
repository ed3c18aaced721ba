//! One measured training step (forward, loss, backward), with the same definitions for
//! every strategy, as in `pytorch_suite.py`.
//!
//! - start: allocated when the step begins, gradients set to none (parameters, input);
//! - peak: the highest allocation during the step minus start;
//! - retained after forward: allocated right after the forward (output alive, autocast
//!   weight cache alive, a disk offload store's writes finished) minus start; with
//!   micro-batches the largest over them, which from the second on includes the
//!   gradients accumulated so far;
//! - the output is held until its backward has finished, as a Python variable would be.
use crate::config::{GradsAfter, StepConfig};
use crate::error::StepError;
use crate::measure::{PeakPhase, TraceEntry};
use crate::optimizer::CaseOptimizer;
use crate::saved::{SavedBytes, StepHooks};
use crate::workload::{Batch, Workload};
use memsave_accum::{free_grads, GradAccumulator, Split};
use memsave_amp::{AutocastGuard, GradScaler};
use memsave_hooks::GradOffload;
use memsave_meter::{f_max_memory_allocated, f_memory_allocated, measure};
use std::cell::Cell;
use std::time::Instant;
use tch::{Device, Tensor};

/// What one step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMeasurement {
    /// Allocated at the step's start.
    pub start_bytes: u64,
    /// Highest allocation during the step minus `start_bytes`.
    pub peak_bytes: u64,
    /// Allocated right after the forward minus `start_bytes`.
    pub retained_after_forward_bytes: u64,
    /// Wall time of forward, loss and backward (and the scaler's unscale and update),
    /// between two device synchronizations.
    pub time_s: f64,
    /// Per-block memory of the (first micro-batch's) forward, when asked for.
    pub trace: Vec<TraceEntry>,
    /// The phase during which the allocation reached `peak_bytes`.
    pub peak_phase: PeakPhase,
    /// Bytes the strategy's offload hooks wrote to their store or host memory.
    pub offloaded_bytes: Option<u64>,
    /// Bytes the strategy's compression hooks saved.
    pub compressed_saved_bytes: Option<u64>,
}

/// A point of a step that [`f_step_observed`] tells its observer about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepEvent {
    /// A forward (of the step, or of a micro-batch) begins.
    Forward,
    /// The model's forward ended: where `retained_after_forward_bytes` is read.
    ForwardDone,
    /// The loss is computed and backward begins.
    Backward,
    /// The optimizer's part of the step begins: the optimizer step after backward,
    /// or the scaler's unscale and update.
    Optimizer,
}

/// Follows the parts of a step, e.g. to record its memory by phase (`memsave trace`).
pub trait StepObserver {
    /// The step reached `event`.
    fn step_event(&self, event: StepEvent);
}

/// The observer of a step nobody follows: every event is ignored.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unobserved;

impl StepObserver for Unobserved {
    fn step_event(&self, _: StepEvent) {}
}

/// Runs one step of `model` on the batch `x` as `config` says; errors carry
/// libtorch's text.
///
/// The model's residual update and checkpoint plan must already be set. A strategy
/// that writes into its input gets a copy of `x` (made before the step starts), so
/// the suite's input stays intact for the next case. Micro-batches run through
/// `memsave_accum::GradAccumulator::f_accumulate`; with `scaler` (the strategy has
/// `grad_scaler`, and `config.scaler` is set) the losses go through
/// `memsave_amp::GradScaler`, and the step ends with its unscale and update. Pass the
/// same scaler to every step of a case, as a training loop would.
pub fn f_step(
    model: &dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    record_trace: bool,
    scaler: Option<&mut GradScaler>,
) -> Result<StepMeasurement, StepError> {
    f_step_observed(
        model,
        x,
        config,
        device,
        record_trace,
        scaler,
        None,
        &Unobserved,
    )
}

/// [`f_step`] that also steps `optimizer` (the case's, for a strategy with
/// `optimizer:`) inside the measured step: after backward (under the scaler when there
/// is one), or, built with `in_backward`, from its hooks during backward. Either way
/// the gradients are freed when the step ends.
///
/// An optimizer stepping in backward cannot run with an enabled scaler (`scaler`, or
/// `config.scaler`): its hooks would step each parameter from the scaled gradient,
/// before any unscaling or inf/NaN check. That is an error before the step starts,
/// with no gradient freed, no parameter changed and the scaler untouched.
pub fn f_step_with(
    model: &dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    record_trace: bool,
    scaler: Option<&mut GradScaler>,
    optimizer: Option<&mut CaseOptimizer>,
) -> Result<StepMeasurement, StepError> {
    f_step_observed(
        model,
        x,
        config,
        device,
        record_trace,
        scaler,
        optimizer,
        &Unobserved,
    )
}

/// [`f_step_with`], telling `observer` when each part of the step begins.
#[allow(clippy::too_many_arguments)]
pub fn f_step_observed(
    model: &dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    record_trace: bool,
    mut scaler: Option<&mut GradScaler>,
    mut optimizer: Option<&mut CaseOptimizer>,
    observer: &dyn StepObserver,
) -> Result<StepMeasurement, StepError> {
    // Before anything runs: an optimizer in backward would step every parameter from
    // its scaled gradient.
    let scales = config.scaler.as_ref().is_some_and(|c| c.enabled)
        || scaler.as_deref().is_some_and(GradScaler::is_enabled);
    if scales
        && optimizer
            .as_deref()
            .is_some_and(CaseOptimizer::steps_in_backward)
    {
        return Err(StepError::invalid(crate::optimizer::SCALER_IN_BACKWARD));
    }
    let params = model.parameters();
    free_grads(&params).map_err(accumulation)?;
    let grad_offload = if config.offload_grads.is_some() {
        if config.scaler.is_some() || scaler.is_some() {
            return Err(StepError::invalid("offload_grads cannot be combined with a gradient scaler: unscaling needs every gradient at once"));
        }
        let dir = crate::saved::default_dir()?;
        // First: an optimizer in backward gives up its hooks, whose slots the offload
        // takes.
        let stepper = match optimizer.as_deref_mut() {
            Some(o) => o.param_stepper(&params)?,
            None => None,
        };
        let offload =
            GradOffload::new(&params, &dir).map_err(|e| StepError::lever("offload_grads", e))?;
        Some(match stepper {
            Some(f) => offload.on_complete(f),
            None => offload,
        })
    } else {
        None
    };
    let input = if config.residual.writes_input() {
        let mut copy = x.input.f_empty_like()?;
        copy.f_copy_(&x.input)?;
        Batch {
            input: copy,
            target: x.target.as_ref().map(Tensor::shallow_clone),
        }
    } else {
        x.shallow_clone()
    };
    // Compression and offload pass the parameters and the input through: both stay
    // alive anyway.
    let hooks = match &config.saved {
        Some(choice) => {
            let mut held: Vec<Tensor> = params.iter().map(Tensor::shallow_clone).collect();
            held.push(input.input.shallow_clone());
            held.extend(input.target.as_ref().map(Tensor::shallow_clone));
            Some(StepHooks::new(choice, &held)?)
        }
        None => None,
    };
    let levers_before = model.layers().lever_stats();
    let mut trace = Vec::new();
    let (result, m) = measure(
        device,
        |_| -> Result<(u64, f64, PeakPhase, SavedBytes), StepError> {
            let start = f_memory_allocated(device).map_err(meter)?;
            synchronize(device);
            let t0 = Instant::now();
            let mut retained = 0;
            let phases = PhaseTracker::new(device);
            // The forward and the loss of one pass; the output is returned so the caller
            // holds it until its backward has finished, as a Python variable would be.
            let mut forward =
                |xin: &Batch, trace_this: bool| -> Result<(Tensor, Tensor), StepError> {
                    let _autocast = config
                        .autocast
                        .map(|kind| AutocastGuard::new(device, kind))
                        .transpose()
                        .map_err(|e| StepError::lever("autocast", e))?;
                    observer.step_event(StepEvent::Forward);
                    if trace_this {
                        model.start_trace();
                    }
                    let hooks_guard = hooks.as_ref().map(StepHooks::enter).transpose()?;
                    let out = model.layers().f_forward(&xin.input);
                    if let Some(guard) = hooks_guard {
                        guard
                            .exit()
                            .map_err(|e| StepError::lever("saved tensors", e))?;
                    }
                    if let Some(hooks) = &hooks {
                        hooks.settle();
                    }
                    if trace_this {
                        trace = model.stop_trace();
                    }
                    let out = out.map_err(|e| StepError::lever("checkpoint", e))?;
                    let now = f_memory_allocated(device).map_err(meter)?;
                    retained = retained.max(now.saturating_sub(start));
                    observer.step_event(StepEvent::ForwardDone);
                    let loss = model.loss(&out, xin.target.as_ref())?;
                    phases.ended(PeakPhase::Forward)?;
                    observer.step_event(StepEvent::Backward);
                    Ok((out, loss))
                };
            match config.micro_batches {
                None => {
                    let (out, loss) = forward(&input, record_trace)?;
                    if let Some(g) = &grad_offload {
                        g.set_last_micro_batch(true);
                    }
                    match scaler.as_deref_mut() {
                        Some(scaler) => {
                            let scaled = scaler.f_scale(&loss).map_err(grad_scaler)?;
                            scaled.f_backward()?;
                        }
                        None => loss.f_backward()?,
                    }
                    drop(loss);
                    drop(out);
                    phases.ended(PeakPhase::Backward)?;
                }
                Some(count) => {
                    let batch =
                        *input.input.size().first().ok_or_else(|| {
                            StepError::invalid("the input has no batch dimension")
                        })?;
                    let mut held: Option<Tensor> = None;
                    GradAccumulator::with_split(Split::Count(count))
                        .f_accumulate(&params, scaler.as_deref_mut(), batch, |mb| {
                            // The previous micro-batch's output, alive until its backward ended.
                            held = None;
                            if mb.index > 0 {
                                phases.ended(PeakPhase::Backward)?;
                            }
                            let xin = input.f_narrow(mb.start, mb.len)?;
                            let (out, loss) = forward(&xin, record_trace && mb.index == 0)?;
                            if let Some(g) = &grad_offload {
                                g.set_last_micro_batch(mb.end() == batch);
                            }
                            held = Some(out);
                            Ok::<_, StepError>(loss)
                        })
                        .map_err(micro_batch_error)?;
                    drop(held);
                    phases.ended(PeakPhase::Backward)?;
                }
            }
            if let Some(g) = &grad_offload {
                g.complete_remaining().map_err(offload_grads)?;
                g.check().map_err(offload_grads)?;
            }
            match (optimizer, scaler) {
                (Some(optimizer), scaler) => {
                    observer.step_event(StepEvent::Optimizer);
                    // An optimizer stepping after backward needs the gradients back.
                    if let Some(g) = &grad_offload {
                        g.restore().map_err(offload_grads)?;
                    }
                    optimizer.step(scaler)?;
                    phases.ended(PeakPhase::Optimizer)?;
                }
                (None, Some(scaler)) => {
                    observer.step_event(StepEvent::Optimizer);
                    scaler.f_unscale_params_(&params).map_err(grad_scaler)?;
                    scaler.f_update().map_err(grad_scaler)?;
                }
                (None, None) => {}
            }
            synchronize(device);
            let time_s = t0.elapsed().as_secs_f64();
            let saved = match &hooks {
                Some(hooks) => hooks.finish()?,
                None => SavedBytes::default(),
            };
            Ok((retained, time_s, phases.peak_phase.get(), saved))
        },
    );
    release_step_leftovers(&input.input, config);
    let (retained, time_s, peak_phase, saved) = result?;
    // Without an optimizer the gradients are the step's result: back into `.grad`,
    // after the measurement, as a caller reading them afterwards would do.
    if let (Some(g), Some(GradsAfter::Restored)) = (grad_offload, config.offload_grads) {
        g.restore().map_err(offload_grads)?;
    }
    let saved = saved.with_levers(&levers_before, &model.layers().lever_stats());
    Ok(StepMeasurement {
        start_bytes: m.start_bytes,
        peak_bytes: m.peak_bytes,
        retained_after_forward_bytes: retained,
        time_s,
        trace,
        peak_phase,
        offloaded_bytes: saved.offloaded_bytes,
        compressed_saved_bytes: saved.compressed_saved_bytes,
    })
}

fn accumulation(e: memsave_accum::AccumError) -> StepError {
    StepError::lever("accumulation", e)
}

/// An error of the accumulation loop: a micro-batch's own [`StepError`] (raised in the
/// step's closure) as it was, anything else as the accumulation's.
fn micro_batch_error(e: memsave_accum::AccumError) -> StepError {
    match e {
        memsave_accum::AccumError::MicroBatch { source, .. } if source.is::<StepError>() => {
            match source.downcast::<StepError>() {
                Ok(step) => *step,
                Err(other) => StepError::lever("accumulation", other),
            }
        }
        other => accumulation(other),
    }
}

fn offload_grads(e: memsave_hooks::OffloadError) -> StepError {
    StepError::lever("offload_grads", e)
}

fn grad_scaler(e: memsave_amp::AmpError) -> StepError {
    StepError::lever("grad_scaler", e)
}

fn meter(e: memsave_meter::MeterError) -> StepError {
    StepError::lever("meter", e)
}

/// Which phase raised the running peak last, read when each phase ends (shared by
/// the forward closure and the accumulation loop, hence the cells).
struct PhaseTracker {
    device: Device,
    seen: Cell<u64>,
    peak_phase: Cell<PeakPhase>,
}

impl PhaseTracker {
    fn new(device: Device) -> Self {
        Self {
            device,
            seen: Cell::new(0),
            peak_phase: Cell::new(PeakPhase::Forward),
        }
    }

    fn ended(&self, phase: PeakPhase) -> Result<(), StepError> {
        let peak = f_max_memory_allocated(self.device).map_err(meter)?;
        if peak > self.seen.get() {
            self.seen.set(peak);
            self.peak_phase.set(phase);
        }
        Ok(())
    }
}

/// Waits for the device's queued kernels, so that the clock reads finished work (CUDA
/// runs kernels asynchronously); a no-op on the CPU.
fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// Frees what libtorch keeps alive after some steps, so that every step (and the next
/// case) starts from the parameters and the input alone:
///
/// `x += f(x)` on a tensor a layer saved for backward forms a reference cycle (the
/// saved input holds the tensor, whose new `grad_fn` holds the saved input), which leaks
/// the mutated tensor; detaching it in place breaks the cycle.
fn release_step_leftovers(input: &Tensor, config: &StepConfig) {
    if config.residual.writes_input() {
        let mut input = input.shallow_clone();
        let _ = input.f_detach_();
    }
}

/// The gradients of `params`, copied out of libtorch (so that keeping them does not
/// count as allocated device memory); an undefined gradient reads as zeros.
pub fn f_grads(params: &[Tensor]) -> Result<Vec<Vec<f32>>, tch::TchError> {
    params
        .iter()
        .map(|p| {
            let g = p.grad();
            if !g.defined() {
                return Ok(vec![0.0; p.numel()]);
            }
            Vec::<f32>::try_from(&g.f_reshape([-1])?)
        })
        .collect()
}

/// The largest absolute difference between two sets of gradients; NaN when any
/// difference is NaN (a diverged gradient must not look close).
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y))
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, |max, d| if d.is_nan() { f64::NAN } else { max.max(d) })
}

/// The relative L2 error of `a` against the reference `b`, over all gradients
/// together: `|a - b| / |b|` (0 when both are zero, NaN when any value is NaN).
pub fn rel_l2_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y)) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        num += (x - y) * (x - y);
        den += y * y;
    }
    if num == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}
