//! One measured training step (forward, loss, backward), with the same definitions for
//! every strategy, as in `pytorch_suite.py`.
//!
//! - start: allocated when the step begins, gradients set to none (parameters, input);
//! - peak: the highest allocation during the step minus start;
//! - retained after forward: allocated right after the forward (output alive, autocast
//!   weight cache alive, a disk offload store's writes finished) minus start; with
//!   micro-batches the largest over them, which from the second on includes the
//!   gradients accumulated so far;
//! - the output is dropped once the loss is computed, as in a careful loop
//!   (`loss = ce(model(x), y)`): what backward needs of it, autograd keeps.
use crate::config::{GradsAfter, StepConfig};
use crate::error::StepError;
use crate::measure::{PeakPhase, TraceEntry};
use crate::optimizer::CaseOptimizer;
use crate::parallel::{DataParallelHandle, SyncGuard};
use crate::saved::{SavedBytes, StepHooks};
use crate::statistics::StatisticsGuard;
use crate::workload::{Batch, Workload};
use memsave_accum::{free_grads, GradAccumulator, Split};
use memsave_amp::{AutocastGuard, GradScaler};
use memsave_hooks::GradOffload;
use memsave_meter::{f_max_memory_allocated, f_memory_allocated, measure};
use std::cell::{Cell, RefCell};
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
    /// Allocated when the last backward had ended (and, data parallel, the gradients
    /// were averaged or reduced into their shards), before the optimizer's part, minus
    /// `start_bytes`: mostly the gradients the optimizer steps from (this rank's shard
    /// of them under ZeRO-2; none left by an optimizer in backward or offloaded
    /// gradients).
    pub after_backward_bytes: u64,
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
    /// Bytes this rank's process group sent during the step (counted from the
    /// collectives' sizes, see `memsave_dist::ProcessGroup::bytes_sent`), when the step
    /// ran data parallel; `None` on one process.
    pub bytes_sent: Option<u64>,
    /// The step's loss: each micro-batch's (the workload's `loss`) weighted by its
    /// examples, so for a mean loss the whole batch's, as one forward of it would
    /// give (up to rounding; with BatchNorm a split changes it). Data parallel: this
    /// rank's share's. `None` when the loss is not a single value. Read with one
    /// device synchronization per micro-batch, as `loss.item()` in PyTorch.
    pub loss: Option<f64>,
}

impl StepMeasurement {
    /// The most bytes the device held at any moment of the step: `start_bytes +
    /// peak_bytes`, absolute like PyTorch's `max_memory_allocated` (the parameters, the
    /// optimizer's state, the input and anything else the process holds count), as
    /// `memsave-fit`'s budget counts it. Warning: `peak_bytes` alone leaves out what
    /// the step began with.
    pub fn device_peak_bytes(&self) -> u64 {
        self.start_bytes + self.peak_bytes
    }
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
///
/// A thin form of [`StepRun`], which also takes an optimizer, an observer and data
/// parallel.
pub fn f_step(
    model: &dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    record_trace: bool,
    scaler: Option<&mut GradScaler>,
) -> Result<StepMeasurement, StepError> {
    StepRun::new(device)
        .record_trace(record_trace)
        .scaler(scaler)
        .f_step(model, x, config)
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
    StepRun::new(device)
        .record_trace(record_trace)
        .scaler(scaler)
        .optimizer(optimizer)
        .f_step(model, x, config)
}

/// [`f_step_with`], telling `observer` when each part of the step begins.
#[allow(clippy::too_many_arguments)]
pub fn f_step_observed(
    model: &dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    record_trace: bool,
    scaler: Option<&mut GradScaler>,
    optimizer: Option<&mut CaseOptimizer>,
    observer: &dyn StepObserver,
) -> Result<StepMeasurement, StepError> {
    StepRun::new(device)
        .record_trace(record_trace)
        .scaler(scaler)
        .optimizer(optimizer)
        .observer(observer)
        .f_step(model, x, config)
}

/// What one step runs with besides the model, its batch and its [`StepConfig`]: the
/// live objects a configuration cannot hold (the case's `GradScaler` and optimizer, an
/// observer, data parallel over a process group) and the device. Every step of memsave
/// (the harness's, `fit`'s probes, a [`Trainer`](crate::Trainer)'s) runs through
/// [`f_step`](Self::f_step); [`f_step`](fn@f_step), [`f_step_with`] and
/// [`f_step_observed`] are short forms of it.
///
/// ```
/// # use memsave_checkpoint::CheckpointedSequential;
/// # use memsave_step::{Batch, StepConfig, Workload};
/// # use tch::{nn, nn::Module, Device, Kind, Tensor};
/// # struct Mlp { vs: nn::VarStore, layers: CheckpointedSequential, data: Tensor }
/// # impl Workload for Mlp {
/// #     fn name(&self) -> &str { "mlp" }
/// #     fn device(&self) -> Device { Device::Cpu }
/// #     fn layers(&self) -> &CheckpointedSequential { &self.layers }
/// #     fn layers_mut(&mut self) -> &mut CheckpointedSequential { &mut self.layers }
/// #     fn parameters(&self) -> Vec<Tensor> { self.vs.trainable_variables() }
/// #     fn global_batch(&self) -> i64 { 8 }
/// #     fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
/// #         Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
/// #     }
/// # }
/// # let vs = nn::VarStore::new(Device::Cpu);
/// # let lin = nn::linear(vs.root(), 16, 16, Default::default());
/// # let layers = CheckpointedSequential::new().add_fn(move |x| lin.forward(x));
/// # let model = Mlp { vs, layers, data: Tensor::rand([8, 16], (Kind::Float, Device::Cpu)) };
/// use memsave_step::step::StepRun;
///
/// let x = model.batch(8)?;
/// let m = StepRun::new(Device::Cpu).f_step(&model, &x, &StepConfig::baseline())?;
/// assert_eq!(m.bytes_sent, None); // one process
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct StepRun<'a> {
    device: Device,
    record_trace: bool,
    scaler: Option<&'a mut GradScaler>,
    optimizer: Option<&'a mut CaseOptimizer>,
    observer: &'a dyn StepObserver,
    data_parallel: Option<&'a DataParallelHandle>,
    check_statistics: bool,
}

impl std::fmt::Debug for StepRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRun")
            .field("device", &self.device)
            .field("record_trace", &self.record_trace)
            .field("scaler", &self.scaler.is_some())
            .field("optimizer", &self.optimizer.is_some())
            .field("data_parallel", &self.data_parallel.map(|d| d.mode()))
            .field("check_statistics", &self.check_statistics)
            .finish_non_exhaustive()
    }
}

impl<'a> StepRun<'a> {
    /// A step on `device` with no scaler, no optimizer, no observer, no trace and one
    /// process.
    pub fn new(device: Device) -> Self {
        Self {
            device,
            record_trace: false,
            scaler: None,
            optimizer: None,
            observer: &Unobserved,
            data_parallel: None,
            check_statistics: true,
        }
    }

    /// Whether a step with a micro-batch of one example (or a batch of one, unsplit)
    /// checks that the running statistics [`Workload::buffers`] lists are still finite,
    /// failing with [`StepError::NonFiniteStatistics`] (the statistics put back) when
    /// one is not. On by default; the check copies every finite floating-point buffer
    /// the workload lists before the step (counted in its start bytes: running
    /// statistics are kilobytes, but frozen weights listed as buffers are copied whole)
    /// and reads them after it. Turn it off for a throwaway step whose statistics are
    /// put back anyway (a probe).
    pub fn check_statistics(mut self, on: bool) -> Self {
        self.check_statistics = on;
        self
    }

    /// Records the per-block memory of the (first micro-batch's) forward into
    /// [`StepMeasurement::trace`].
    pub fn record_trace(mut self, on: bool) -> Self {
        self.record_trace = on;
        self
    }

    /// Scales the losses with `scaler` and ends the step with its unscale and update
    /// (the case's scaler: pass the same one to every step).
    pub fn scaler(mut self, scaler: Option<&'a mut GradScaler>) -> Self {
        self.scaler = scaler;
        self
    }

    /// Steps `optimizer` inside the measured step (see [`f_step_with`]).
    pub fn optimizer(mut self, optimizer: Option<&'a mut CaseOptimizer>) -> Self {
        self.optimizer = optimizer;
        self
    }

    /// Tells `observer` when each part of the step begins.
    pub fn observer(mut self, observer: &'a dyn StepObserver) -> Self {
        self.observer = observer;
        self
    }

    /// Runs the step as this rank's part of a data parallel step over `data_parallel`'s
    /// group (see [`crate::parallel`]): `x` is this rank's share of the batch, the
    /// gradients are averaged over the ranks after the last micro-batch's backward
    /// (DDP) or reduced into a ZeRO optimizer's shards, and
    /// [`StepMeasurement::bytes_sent`] counts what the group sent. Under ZeRO the
    /// optimizer must be the handle's ([`DataParallelHandle::optimizer`]).
    pub fn data_parallel(mut self, data_parallel: Option<&'a DataParallelHandle>) -> Self {
        self.data_parallel = data_parallel;
        self
    }

    /// Runs one step of `model` on `x` as `config` says (see [`f_step`](fn@f_step) and
    /// [`f_step_with`]).
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`] before anything runs for an empty batch, and for
    /// options that contradict each other (a scaler with an optimizer in backward or with offloaded gradients,
    /// data parallel options [`DataParallel::check`](crate::DataParallel::check)
    /// refuses); [`StepError::OutOfMemory`] and the others when the step fails.
    pub fn f_step(
        mut self,
        model: &dyn Workload,
        x: &Batch,
        config: &StepConfig,
    ) -> Result<StepMeasurement, StepError> {
        self.check(config)?;
        // Split or not, before any gradient is freed: weight decay would step on nothing.
        if x.input.size().first() == Some(&0) {
            return Err(StepError::invalid(
                "the batch is empty (0 examples): a step needs at least one",
            ));
        }
        // memsave's autograd engine frees the graph of a backward that fails (the
        // seed's `x += f(x)`), which libtorch's leaves holding the input and weights;
        // installed before the first step, not by whichever lever first pushes hooks.
        memsave_sys::hooks::install_engine().map_err(|e| StepError::lever("autograd engine", e))?;
        let params = model.parameters();
        free_grads(&params).map_err(accumulation)?;
        if let Some(dp) = self.data_parallel {
            free_grads(&dp.shards()).map_err(accumulation)?;
            dp.start_step()?;
        }
        let grad_offload = self.grad_offload(config, &params)?;
        let input = step_input(x, config)?;
        let hooks = step_hooks(config, &params, &input)?;
        let levers_before = lever_stats(model);
        let sent_before = self.data_parallel.map(DataParallelHandle::bytes_sent);
        let smallest = smallest_micro_batch(&input, config);
        let guard = match smallest {
            Some(1) if self.check_statistics => Some(StatisticsGuard::save(model)?),
            _ => None,
        };
        let device = self.device;
        let (result, m) = measure(device, |_| {
            self.measured(
                model,
                config,
                &params,
                &input,
                hooks.as_ref(),
                grad_offload.as_ref(),
            )
        });
        release_step_leftovers(&input.input, config);
        let measured = result?;
        // Without an optimizer the gradients are the step's result: back into `.grad`,
        // after the measurement, as a caller reading them afterwards would do (also
        // when the statistics check below fails: the gradients are the step's).
        if let (Some(g), Some(GradsAfter::Restored)) = (grad_offload, config.offload_grads) {
            g.restore().map_err(offload_grads)?;
        }
        if let (Some(guard), Some(smallest)) = (guard, smallest) {
            guard.check(smallest, config.micro_batches.is_some_and(|k| k > 1))?;
        }
        let saved = measured
            .saved
            .with_levers(&levers_before, &lever_stats(model));
        Ok(StepMeasurement {
            start_bytes: m.start_bytes,
            peak_bytes: m.peak_bytes,
            retained_after_forward_bytes: measured.retained,
            after_backward_bytes: measured.after_backward,
            time_s: measured.time_s,
            trace: measured.trace,
            peak_phase: measured.peak_phase,
            offloaded_bytes: saved.offloaded_bytes,
            compressed_saved_bytes: saved.compressed_saved_bytes,
            bytes_sent: sent_before
                .zip(self.data_parallel)
                .map(|(before, dp)| dp.bytes_sent() - before),
            loss: measured.loss,
        })
    }

    /// Refuses, before anything runs, what cannot work together: an optimizer in
    /// backward would step every parameter from its scaled gradient; unscaling needs
    /// every gradient at once, which offloaded gradients are not; and what data
    /// parallel refuses.
    fn check(&self, config: &StepConfig) -> Result<(), StepError> {
        let scales = config.scaler.as_ref().is_some_and(|c| c.enabled)
            || self.scaler.as_deref().is_some_and(GradScaler::is_enabled);
        let optimizer = self.optimizer.as_deref();
        if scales && optimizer.is_some_and(CaseOptimizer::steps_in_backward) {
            return Err(StepError::invalid(crate::optimizer::SCALER_IN_BACKWARD));
        }
        if scales && optimizer.is_some_and(|o| o.zero_stage().is_some()) {
            return Err(StepError::invalid(crate::optimizer::SCALER_WITH_ZERO));
        }
        if config.offload_grads.is_some() && (config.scaler.is_some() || self.scaler.is_some()) {
            return Err(StepError::invalid("offload_grads cannot be combined with a gradient scaler: unscaling needs every gradient at once"));
        }
        crate::parallel::check_offload_params(config)?;
        let in_files = self
            .data_parallel
            .and_then(DataParallelHandle::fsdp)
            .is_some_and(|f| f.shard_dir().is_some());
        if config.offload_params.is_some() && !in_files {
            return Err(StepError::invalid("offload_params needs the parameters in files before the step: run it through a Trainer, or set it up with DataParallelHandle::offload_params and pass it to the step"));
        }
        match self.data_parallel {
            Some(dp) => dp.check_step(config, optimizer, scales),
            None => Ok(()),
        }
    }

    /// The gradient offload of `config.offload_grads`; an optimizer in backward gives
    /// up its hooks first, whose slots the offload takes, and steps from its
    /// `on_complete`.
    fn grad_offload(
        &mut self,
        config: &StepConfig,
        params: &[Tensor],
    ) -> Result<Option<GradOffload>, StepError> {
        if config.offload_grads.is_none() {
            return Ok(None);
        }
        let dir = crate::saved::default_dir()?;
        let stepper = match self.optimizer.as_deref_mut() {
            Some(o) => o.param_stepper(params)?,
            None => None,
        };
        let mut offload =
            GradOffload::new(params, &dir).map_err(|e| StepError::lever("offload_grads", e))?;
        if let Some(least) = config.offload_grads_at_least {
            offload = offload.keep_in_memory(move |p| memsave_sys::tensor::nbytes(p) < least);
        }
        Ok(Some(match stepper {
            Some(f) => offload.on_complete(f),
            None => offload,
        }))
    }

    /// The measured part of the step: the passes, the reduction of the gradients, the
    /// optimizer, and what the hooks saved.
    fn measured(
        &mut self,
        model: &dyn Workload,
        config: &StepConfig,
        params: &[Tensor],
        input: &Batch,
        hooks: Option<&StepHooks>,
        grad_offload: Option<&GradOffload>,
    ) -> Result<Measured, StepError> {
        let device = self.device;
        let start = f_memory_allocated(device).map_err(meter)?;
        synchronize(device);
        let t0 = Instant::now();
        let pass = Pass {
            model,
            config,
            device,
            observer: self.observer,
            hooks,
            data_parallel: self.data_parallel,
            start,
            retained: Cell::new(0),
            trace: RefCell::new(Vec::new()),
            phases: PhaseTracker::new(device),
            loss: Cell::new(Some((0.0, 0))),
        };
        self.passes(&pass, params, input, grad_offload)?;
        if let Some(g) = grad_offload {
            g.complete_remaining().map_err(offload_grads)?;
            g.check().map_err(offload_grads)?;
        }
        if let Some(dp) = self.data_parallel {
            dp.finish_backward()?;
        }
        let after_backward = f_memory_allocated(device)
            .map_err(meter)?
            .saturating_sub(start);
        self.optimizer_part(&pass, params, grad_offload)?;
        synchronize(device);
        let time_s = t0.elapsed().as_secs_f64();
        let saved = match hooks {
            Some(hooks) => hooks.finish()?,
            None => SavedBytes::default(),
        };
        Ok(Measured {
            loss: pass
                .loss
                .get()
                .filter(|&(_, n)| n > 0)
                .map(|(sum, n)| sum / n as f64),
            retained: pass.retained.get(),
            after_backward,
            time_s,
            trace: pass.trace.into_inner(),
            peak_phase: pass.phases.peak_phase.get(),
            saved,
        })
    }

    /// Forward, loss and backward of the whole batch, or of each micro-batch through
    /// the accumulator; under DDP the backward of every micro-batch but the last only
    /// accumulates locally.
    fn passes(
        &mut self,
        pass: &Pass<'_>,
        params: &[Tensor],
        input: &Batch,
        grad_offload: Option<&GradOffload>,
    ) -> Result<(), StepError> {
        let record_trace = self.record_trace;
        let Some(count) = pass.config.micro_batches else {
            let loss = pass.forward(input, record_trace)?;
            if let Some(g) = grad_offload {
                g.set_last_micro_batch(true);
            }
            match self.scaler.as_deref_mut() {
                Some(scaler) => scaler.f_scale(&loss).map_err(grad_scaler)?.f_backward()?,
                None => loss.f_backward()?,
            }
            drop(loss);
            return pass.phases.ended(PeakPhase::Backward);
        };
        let batch = *input
            .input
            .size()
            .first()
            .ok_or_else(|| StepError::invalid("the input has no batch dimension"))?;
        let data_parallel = self.data_parallel;
        let _sync = SyncGuard(data_parallel);
        GradAccumulator::with_split(Split::Count(count))
            .f_accumulate(params, self.scaler.as_deref_mut(), batch, |mb| {
                if mb.index > 0 {
                    pass.phases.ended(PeakPhase::Backward)?;
                }
                let xin = input.f_narrow(mb.start, mb.len)?;
                let loss = pass.forward(&xin, record_trace && mb.index == 0)?;
                let last = mb.end() == batch;
                if let Some(g) = grad_offload {
                    g.set_last_micro_batch(last);
                }
                if let Some(dp) = data_parallel {
                    dp.set_grad_sync(last)?;
                }
                Ok::<_, StepError>(loss)
            })
            .map_err(micro_batch_error)?;
        pass.phases.ended(PeakPhase::Backward)
    }

    /// The optimizer's part: its step after backward (the offloaded gradients back
    /// first), or the scaler's unscale and update without one.
    fn optimizer_part(
        &mut self,
        pass: &Pass<'_>,
        params: &[Tensor],
        grad_offload: Option<&GradOffload>,
    ) -> Result<(), StepError> {
        match (self.optimizer.as_deref_mut(), self.scaler.as_deref_mut()) {
            (Some(optimizer), scaler) => {
                self.observer.step_event(StepEvent::Optimizer);
                // An optimizer stepping after backward needs the gradients back.
                if let Some(g) = grad_offload {
                    g.restore().map_err(offload_grads)?;
                }
                optimizer.step(scaler)?;
                pass.phases.ended(PeakPhase::Optimizer)
            }
            (None, Some(scaler)) => {
                self.observer.step_event(StepEvent::Optimizer);
                scaler.f_unscale_params_(params).map_err(grad_scaler)?;
                scaler.f_update().map_err(grad_scaler)
            }
            (None, None) => Ok(()),
        }
    }
}

/// What the measured part of a step found.
struct Measured {
    loss: Option<f64>,
    retained: u64,
    after_backward: u64,
    time_s: f64,
    trace: Vec<TraceEntry>,
    peak_phase: PeakPhase,
    saved: SavedBytes,
}

/// The forward and the loss of one pass (the batch, or a micro-batch), and what the
/// passes of a step record: the largest allocation retained after a forward, the
/// trace, the phase of the peak.
struct Pass<'s> {
    model: &'s dyn Workload,
    config: &'s StepConfig,
    device: Device,
    observer: &'s dyn StepObserver,
    hooks: Option<&'s StepHooks>,
    data_parallel: Option<&'s DataParallelHandle>,
    start: u64,
    retained: Cell<u64>,
    trace: RefCell<Vec<TraceEntry>>,
    phases: PhaseTracker,
    /// The passes' losses times their examples, and the examples; `None` once a loss
    /// was not a single value.
    loss: Cell<Option<(f64, i64)>>,
}

impl Pass<'_> {
    /// The forward and the loss of `xin`. The output is dropped here, once the loss is
    /// computed: a loop that keeps it (`out = model(x); loss = ce(out, y)`) holds the
    /// logits through backward, which the loss's backward does not need.
    fn forward(&self, xin: &Batch, trace_this: bool) -> Result<Tensor, StepError> {
        let model = self.model;
        let _autocast = self
            .config
            .autocast
            .map(|kind| AutocastGuard::new(self.device, kind))
            .transpose()
            .map_err(|e| StepError::lever("autocast", e))?;
        self.observer.step_event(StepEvent::Forward);
        if trace_this {
            model.start_trace();
        }
        let hooks_guard = self.hooks.map(StepHooks::enter).transpose()?;
        let out = match self.data_parallel {
            // ZeRO-3's saved-tensor hook, innermost, hands what is not a weight to the
            // step's hooks (whose scope stays open around it).
            Some(dp) => dp.forward(self.hooks.map(StepHooks::raw), || {
                model.layers().f_forward(&xin.input)
            }),
            None => Ok(model.layers().f_forward(&xin.input)),
        };
        if let Some(guard) = hooks_guard {
            guard
                .exit()
                .map_err(|e| StepError::lever("saved tensors", e))?;
        }
        if let Some(hooks) = self.hooks {
            hooks.settle();
        }
        if trace_this {
            *self.trace.borrow_mut() = model.stop_trace();
        }
        let out = out?.map_err(|e| StepError::lever("checkpoint", e))?;
        let now = f_memory_allocated(self.device).map_err(meter)?;
        self.retained
            .set(self.retained.get().max(now.saturating_sub(self.start)));
        self.observer.step_event(StepEvent::ForwardDone);
        let loss = model.loss(&out, xin.target.as_ref())?;
        drop(out);
        let examples = xin.input.size().first().copied().unwrap_or(1);
        let noted = match self.loss.get() {
            Some((sum, n)) if loss.numel() == 1 => Some((
                sum + loss.f_double_value(&[])? * examples as f64,
                n + examples,
            )),
            _ => None,
        };
        self.loss.set(noted);
        self.phases.ended(PeakPhase::Forward)?;
        self.observer.step_event(StepEvent::Backward);
        Ok(loss)
    }
}

/// The step's input: `x`, or a copy of it for a residual update that writes into its
/// input (so that the caller's batch stays intact).
fn step_input(x: &Batch, config: &StepConfig) -> Result<Batch, StepError> {
    if !config.residual.writes_input() {
        return Ok(x.shallow_clone());
    }
    let mut copy = x.input.f_empty_like()?;
    copy.f_copy_(&x.input)?;
    Ok(Batch {
        input: copy,
        target: x.target.as_ref().map(Tensor::shallow_clone),
    })
}

/// The saved-tensor hooks of `config.saved`. Compression and offload pass the
/// parameters and the input through: both stay alive anyway.
fn step_hooks(
    config: &StepConfig,
    params: &[Tensor],
    input: &Batch,
) -> Result<Option<StepHooks>, StepError> {
    let Some(choice) = &config.saved else {
        return Ok(None);
    };
    let mut held: Vec<Tensor> = params.iter().map(Tensor::shallow_clone).collect();
    held.push(input.input.shallow_clone());
    held.extend(input.target.as_ref().map(Tensor::shallow_clone));
    StepHooks::new(choice, &held).map(Some)
}

fn accumulation(e: memsave_accum::AccumError) -> StepError {
    StepError::lever("accumulation", e)
}

/// An error of the accumulation loop: a micro-batch's own [`StepError`] (raised in the
/// step's closure) as it was, anything else as the accumulation's.
fn micro_batch_error(e: memsave_accum::AccumError) -> StepError {
    use memsave_accum::AccumError;
    let inner = match &e {
        AccumError::MicroBatch { source, .. } => source.downcast_ref::<StepError>(),
        _ => None,
    };
    match inner {
        // A configuration refused inside the loop is the configuration's error.
        Some(StepError::InvalidConfig(_)) => match e {
            AccumError::MicroBatch { source, .. } => match source.downcast::<StepError>() {
                Ok(step) => *step,
                Err(other) => StepError::lever("accumulation", other),
            },
            other => accumulation(other),
        },
        // Out of memory stays out of memory, its text naming the micro-batch.
        Some(step) if step.is_out_of_memory() => StepError::OutOfMemory {
            message: e.to_string(),
            source: Box::new(e),
        },
        _ => accumulation(e),
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

/// Examples in the smallest micro-batch of a step of `config` on `input` (the whole
/// batch when it is not split; as [`Split::Count`] splits it), or `None` for an input
/// without a batch dimension or a split the step refuses anyway.
fn smallest_micro_batch(input: &Batch, config: &StepConfig) -> Option<i64> {
    let batch = *input.input.size().first()?;
    match config.micro_batches {
        None => Some(batch),
        Some(count) => memsave_accum::f_split(batch, Split::Count(count))
            .ok()?
            .iter()
            .map(|mb| mb.len)
            .min(),
    }
}

/// What the boundary stores of `model` took so far: the chain's, then its blocks'.
fn lever_stats(model: &dyn Workload) -> Vec<memsave_checkpoint::LeverStats> {
    if let Some(blocks) = model.blocks() {
        let mut stats = model.layers().lever_stats();
        stats.extend(blocks.lever_stats());
        return stats;
    }
    match crate::plan::planned_blocks(model) {
        // A chain's blocks count its boundary stores as well as its layers' own.
        Some(layers) => layers.lever_stats(),
        None => model.layers().lever_stats(),
    }
}
