//! [`Trainer`]: one configuration of memsave's levers, built once, stepped from a
//! user's own training loop.
use crate::config::{PlanChoice, StepConfig};
use crate::error::StepError;
use crate::levers::OptimizerSpec;
use crate::lr_scheduler::LRScheduler;
use crate::optimizer::CaseOptimizer;
use crate::parallel::{DataParallel, DataParallelHandle};
use crate::step::{StepMeasurement, StepRun};
use crate::workload::{Batch, Workload};
use memsave_amp::{GradScaler, GradScalerConfig};
use memsave_checkpoint::{BlockKey, BlockLever, Plan, Schedule};
use memsave_dist::FsdpConfig;
use memsave_dist::ProcessGroup;

/// Builds a [`Trainer`]: the configuration's levers (a [`StepConfig`]), and optionally
/// an optimizer, a `GradScaler` and an explicit checkpoint schedule. Contradictory
/// options are refused by [`build`](Self::build), before any step runs.
///
/// ```
/// use memsave_checkpoint::{CheckpointedSequential, Plan};
/// use memsave_step::{
///     Batch, OptimizerKind, OptimizerSpec, PlanChoice, StepConfig, TrainerBuilder, Workload,
/// };
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
///
/// struct Mlp { vs: nn::VarStore, layers: CheckpointedSequential, data: Tensor }
/// impl Workload for Mlp {
///     fn name(&self) -> &str { "mlp" }
///     fn device(&self) -> Device { Device::Cpu }
///     fn layers(&self) -> &CheckpointedSequential { &self.layers }
///     fn layers_mut(&mut self) -> &mut CheckpointedSequential { &mut self.layers }
///     fn parameters(&self) -> Vec<Tensor> { self.vs.trainable_variables() }
///     fn global_batch(&self) -> i64 { 8 }
///     fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
///         Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
///     }
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut layers = CheckpointedSequential::new();
/// for i in 0..4 {
///     let lin = nn::linear(vs.root() / i, 16, 16, Default::default());
///     layers = layers.add_fn(move |x| x + lin.forward(x).tanh());
/// }
/// let data = Tensor::rand([8, 16], (Kind::Float, Device::Cpu));
/// let mut model = Mlp { vs, layers, data };
///
/// let mut config = StepConfig::baseline();
/// config.plan = PlanChoice::Fixed(Plan::EveryLayer);
/// config.micro_batches = Some(2);
/// let spec = OptimizerSpec { kind: OptimizerKind::Adamw, ..Default::default() };
/// let mut trainer = TrainerBuilder::new(config).optimizer(spec).build(&mut model)?;
/// let batch = trainer.model().batch(8)?;
/// for _ in 0..3 {
///     let m = trainer.step(&batch)?;
///     assert!(m.peak_bytes > 0);
/// }
/// assert_eq!(trainer.steps(), 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TrainerBuilder {
    config: StepConfig,
    schedule: Option<Option<Schedule>>,
    block_levers: Option<Vec<(BlockKey, BlockLever)>>,
    record_trace: bool,
    data_parallel: Option<(ProcessGroup, DataParallel)>,
}

impl TrainerBuilder {
    /// A builder for `config`'s levers. Its checkpoint plan is set on the model's layers
    /// by [`build`](Self::build) (a budget plan profiles the model on its first batch
    /// then), unless [`schedule`](Self::schedule) gives an explicit schedule.
    pub fn new(config: StepConfig) -> Self {
        Self {
            config,
            schedule: None,
            block_levers: None,
            record_trace: false,
            data_parallel: None,
        }
    }

    /// Steps `spec`'s optimizer inside every step (after backward, or in backward with
    /// `in_backward`), replacing the configuration's optimizer if it has one.
    pub fn optimizer(mut self, spec: OptimizerSpec) -> Self {
        self.config.optimizer = Some(spec);
        self
    }

    /// Scales the loss with a `GradScaler` of these settings (for fp16 autocast).
    pub fn grad_scaler(mut self, config: GradScalerConfig) -> Self {
        self.config.scaler = Some(config);
        self
    }

    /// Sets these levers by key, every other block kept, after the plan (e.g. the
    /// levers `fit` chose, `memsave_fit::Choice::block_levers`): on a model of blocks
    /// ([`Workload::blocks`]) its blocks'; on a chain, layer `i` is the block `layer i`
    /// and the layers go under `Plan::PerLayer` (see [`crate::plan::set_block_levers`])
    /// instead of a schedule. [`build`](Self::build) refuses them on a chain beside a
    /// checkpoint plan or schedule, and a lever whose saves go to a store under ZeRO-3
    /// (its unit's gathered weights would go with them).
    pub fn block_levers(mut self, levers: Vec<(BlockKey, BlockLever)>) -> Self {
        self.block_levers = Some(levers);
        self
    }

    /// Follows `schedule` (`None`: recompute nothing) instead of the configuration's
    /// plan: e.g. the schedule `fit` chose (`memsave_fit::Choice::schedule`).
    pub fn schedule(mut self, schedule: Option<Schedule>) -> Self {
        self.schedule = Some(schedule);
        self
    }

    /// Records the per-block memory of each step's forward into
    /// [`StepMeasurement::trace`] (the workload must support tracing).
    pub fn record_trace(mut self, on: bool) -> Self {
        self.record_trace = on;
        self
    }

    /// Runs every step as this process's rank of `group` (see [`crate::parallel`]):
    /// data parallel ([`DataParallel::Ddp`]: gradients averaged over the ranks), ZeRO
    /// ([`DataParallel::Zero`]: the optimizer's state, and at stage 2 the gradients,
    /// sharded) or ZeRO-3 ([`DataParallel::Fsdp`]: the parameters sharded too, one unit
    /// per layer; the checkpoint plan is set before the layers are sharded). Each rank
    /// passes its own share of the batch to
    /// [`Trainer::step`]; a budget plan is profiled on `global_batch / world_size`
    /// examples.
    ///
    /// Trap: [`build`](Self::build) is then a collective (every rank builds its trainer
    /// over the same model at the same point, and rank 0's parameters are copied to
    /// every rank), and so is every step.
    pub fn data_parallel(mut self, group: &ProcessGroup, mode: DataParallel) -> Self {
        self.data_parallel = Some((group.clone(), mode));
        self
    }

    /// Checks the options, sets the checkpoint plan (or schedule) on `model`'s layers,
    /// and builds the optimizer over `model`'s parameters and the scaler.
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`] for contradictory options (a `GradScaler` with the
    /// optimizer in backward or with offloaded gradients, zero micro-batches, a schedule
    /// for another number of layers, data parallel options
    /// [`DataParallel::check`] refuses, ...), before anything runs; others when the
    /// plan's profile or the optimizer's state cannot be built.
    pub fn build<W: Workload>(self, model: &mut W) -> Result<Trainer<'_, W>, StepError> {
        let config = self.config;
        validate(&config)?;
        crate::parallel::check_offload_params(&config)?;
        if let Some((_, mode)) = &self.data_parallel {
            mode.check(&config)?;
        }
        let world_size = self
            .data_parallel
            .as_ref()
            .map_or(1, |(group, _)| group.world_size());
        if self.block_levers.is_some() && model.blocks().is_none() {
            // Levers per layer replace a chain's schedule; beside one, the schedule
            // would be dropped without a word. Refused before the model changes.
            let n = model.layers().len();
            let plain = match &self.schedule {
                Some(None) => true,
                Some(Some(s)) => *s == Schedule::plain(n),
                None => matches!(config.plan, PlanChoice::Fixed(Plan::None | Plan::PerLayer)),
            };
            if !plain {
                return Err(StepError::InvalidConfig(format!(
                    "block levers for the chain '{}' beside its checkpoint schedule: a chain takes a schedule or a lever per layer, not both; drop the plan (or pass the schedule None) for levers per layer",
                    model.name()
                )));
            }
        }
        set_plan(model, &config, self.schedule, world_size)?;
        if let Some(levers) = self.block_levers {
            let sharded = matches!(self.data_parallel, Some((_, DataParallel::Fsdp(_))))
                || config.offload_params.is_some();
            let store = levers
                .iter()
                .find(|(_, lever)| matches!(lever, BlockLever::Store { .. }));
            if let (true, Some((key, lever))) = (sharded, store) {
                // Refused here, not at the block's first run: its saves would take the
                // gathered weights of its unit.
                return Err(StepError::InvalidConfig(format!(
                    "block {key}: its saves cannot go to a store ({}) under zero: 3, which runs the block inside its unit: the store would keep the gathered weights; recompute the block instead (with its inputs in files, if memory is short)",
                    lever.name()
                )));
            }
            // A chain's layers go under Plan::PerLayer, each under its lever.
            crate::plan::set_block_levers(&mut *model, levers)?;
        }
        let in_files = config.offload_params.is_some();
        let data_parallel = match self.data_parallel {
            None if in_files => Some(DataParallelHandle::offload_params(
                &*model,
                FsdpConfig::default(),
            )?),
            data_parallel => data_parallel
                .map(|(group, mode)| {
                    let mode = mode.with_params_in_files(in_files);
                    DataParallelHandle::for_workload(&group, mode, &*model)
                })
                .transpose()?,
        };
        let params = model.parameters();
        let optimizer = match (&config.optimizer, &data_parallel) {
            (Some(spec), Some(dp)) => Some(dp.optimizer(spec, &params)?),
            (Some(spec), None) => Some(CaseOptimizer::build(spec, &params)?),
            (None, _) => None,
        };
        let scaler = config
            .scaler
            .map(GradScaler::new)
            .transpose()
            .map_err(|e| StepError::InvalidConfig(e.to_string()))?;
        Ok(Trainer {
            model,
            config,
            optimizer,
            scaler,
            data_parallel,
            record_trace: self.record_trace,
            steps: 0,
            lr_scheduler: None,
        })
    }
}

/// Sets `schedule` (`Some(None)`: recompute nothing) or else `config`'s plan on
/// `model`'s layers; a budget plan is profiled on a rank's share of the global batch.
fn set_plan<W: Workload>(
    model: &mut W,
    config: &StepConfig,
    schedule: Option<Option<Schedule>>,
    world_size: usize,
) -> Result<(), StepError> {
    if let Some(schedule) = schedule {
        let n = model.layers().len();
        let schedule = schedule.unwrap_or_else(|| Schedule::plain(n));
        return model
            .layers_mut()
            .set_schedule(schedule)
            .map_err(|e| StepError::InvalidConfig(e.to_string()));
    }
    let example = match config.plan {
        PlanChoice::Fixed(_) => None,
        _ => {
            let share = (model.global_batch() / world_size.max(1) as i64).max(1);
            Some(model.batch(share)?)
        }
    };
    let empty = Batch::input(tch::Tensor::new());
    let device = model.device();
    crate::plan::apply_plan(model, example.as_ref().unwrap_or(&empty), config, device)
}

fn validate(config: &StepConfig) -> Result<(), StepError> {
    let invalid = |m: &str| Err(StepError::InvalidConfig(m.to_owned()));
    let scales = config.scaler.as_ref().is_some_and(|c| c.enabled);
    if scales && config.optimizer.as_ref().is_some_and(|o| o.in_backward) {
        return invalid(crate::optimizer::SCALER_IN_BACKWARD);
    }
    if config.scaler.is_some() && config.offload_grads.is_some() {
        return invalid("offload_grads cannot be combined with a gradient scaler: unscaling needs every gradient at once");
    }
    if config.micro_batches == Some(0) {
        return invalid("micro_batches must be at least 1");
    }
    Ok(())
}

/// A configured training step over a model: owns the optimizer (and its state), the
/// `GradScaler` and the configuration; each [`step`](Self::step) runs forward, loss,
/// backward (through the configuration's hooks, checkpoints and micro-batches) and the
/// optimizer, and returns what it measured. Built by [`TrainerBuilder`].
///
/// Trap: the trainer borrows the model for its lifetime; read it through
/// [`model`](Self::model) (e.g. for an evaluation loss) between steps. Under ZeRO-3
/// the model's weights live in the ranks' shards: call
/// [`restore_full_parameters`](Self::restore_full_parameters) before dropping the
/// trainer (or saving the model its own way), or they are lost (the parameters read
/// NaN); [`save_sharded`](Self::save_sharded) checkpoints the training.
pub struct Trainer<'m, W> {
    model: &'m mut W,
    config: StepConfig,
    optimizer: Option<CaseOptimizer>,
    scaler: Option<GradScaler>,
    data_parallel: Option<DataParallelHandle>,
    record_trace: bool,
    steps: u64,
    lr_scheduler: Option<Box<dyn LRScheduler>>,
}

impl<W: Workload> std::fmt::Debug for Trainer<'_, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("model", &self.model.name())
            .field("config", &self.config)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl Trainer<'static, ()> {
    /// A builder for `config`'s levers (the same as [`TrainerBuilder::new`]), called as
    /// `Trainer::builder(config)`: the builder's [`build`](TrainerBuilder::build) takes
    /// the model. (Declared on `Trainer<'static, ()>`, as `HashMap::new` is on one
    /// hasher, so that the call needs no type for the model.)
    pub fn builder(config: StepConfig) -> TrainerBuilder {
        TrainerBuilder::new(config)
    }
}

impl<'m, W: Workload> Trainer<'m, W> {
    /// One training step on `batch`: gradients are freed first, and the optimizer (if
    /// any) steps at the end or in backward. The measurement's bytes are exact (the
    /// meter's) when memsave's allocator is installed.
    ///
    /// Data parallel ([`TrainerBuilder::data_parallel`]): `batch` is this rank's share;
    /// the gradients are averaged over the ranks (or reduced into the ZeRO shards)
    /// before the optimizer steps, and [`StepMeasurement::bytes_sent`] says what this
    /// rank sent.
    ///
    /// # Errors
    /// [`StepError::OutOfMemory`] when the step does not fit; [`StepError::Torch`] for
    /// other failures. Either way the next step can run on one process; data parallel,
    /// the other ranks are left waiting in a collective until the group's timeout.
    /// [`StepError::NonFiniteStatistics`] when a micro-batch of one example turned
    /// BatchNorm's running statistics NaN: the step ran (its gradients, and the
    /// optimizer's update, stand; it is not counted in [`steps`](Self::steps)) and the
    /// statistics are put back.
    pub fn step(&mut self, batch: &Batch) -> Result<StepMeasurement, StepError> {
        if let (Some(scheduler), Some(opt)) = (&mut self.lr_scheduler, &mut self.optimizer) {
            opt.set_lr(scheduler.lr(self.steps))?;
        }
        let device = self.model.device();
        let m = StepRun::new(device)
            .record_trace(self.record_trace)
            .scaler(self.scaler.as_mut())
            .optimizer(self.optimizer.as_mut())
            .data_parallel(self.data_parallel.as_ref())
            .f_step(&*self.model, batch, &self.config)?;
        self.steps += 1;
        Ok(m)
    }

    /// The model.
    pub fn model(&self) -> &W {
        self.model
    }

    /// The configuration every step follows.
    pub fn config(&self) -> &StepConfig {
        &self.config
    }

    /// Bytes of the optimizer's state (0 without an optimizer).
    pub fn optimizer_state_bytes(&self) -> u64 {
        self.optimizer
            .as_ref()
            .map_or(0, CaseOptimizer::state_bytes)
    }

    /// How the ranks share the steps, when [`TrainerBuilder::data_parallel`] set it:
    /// under ZeRO-3 its `Fsdp` holds the weights (`DataParallelHandle::fsdp`).
    pub fn data_parallel(&self) -> Option<&DataParallelHandle> {
        self.data_parallel.as_ref()
    }

    /// The `GradScaler`, if the configuration scales the loss.
    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    /// Steps run successfully so far (what a learning-rate schedule reads; see
    /// [`set_steps`](Self::set_steps) when resuming).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Sets the count of steps run so far, e.g. to the step a checkpoint was saved at
    /// after loading its optimizer state into a new trainer ([`CaseOptimizer::load`]),
    /// so that a [schedule](Self::set_lr_scheduler) goes on where it stopped instead of
    /// warming up again. ([`load_sharded`](Self::load_sharded) sets it itself.)
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// The optimizer (`None` without one): to change learning rates
    /// ([`CaseOptimizer::set_lr`], [`CaseOptimizer::set_group_lr`]) between steps, or
    /// save and load its state ([`CaseOptimizer::save`], [`CaseOptimizer::load`]).
    pub fn optimizer(&mut self) -> Option<&mut CaseOptimizer> {
        self.optimizer.as_mut()
    }

    /// Puts the full weights back into the model's parameters under ZeRO-3 (nothing to
    /// do otherwise: the model holds them), so that the model holds what training made:
    /// call it before saving the model its own way (`VarStore::save`), evaluating it
    /// outside the trainer, or dropping the trainer (`memsave_dist::Fsdp::f_restore_full_parameters`).
    /// A collective: every rank calls it, between steps.
    ///
    /// Trap: under ZeRO-3 the model's parameters read NaN between steps (each rank keeps
    /// only its shard of the weights), and a trainer dropped without this call leaves
    /// them so: the trained weights are then lost, except in a sharded checkpoint
    /// ([`save_sharded`](Self::save_sharded)). Dropping gathers nothing itself: a
    /// collective in a destructor could report no error and would wait on a rank that
    /// returned early. After the call every rank holds the whole model until the next
    /// step, and changes to the parameters are not seen by the training (which goes on
    /// from the shards).
    pub fn restore_full_parameters(&mut self) -> Result<(), StepError> {
        match self
            .data_parallel
            .as_ref()
            .and_then(DataParallelHandle::fsdp)
        {
            Some(fsdp) => fsdp
                .f_restore_full_parameters()
                .map_err(|e| StepError::lever("zero", e)),
            None => Ok(()),
        }
    }

    /// Saves a sharded checkpoint of ZeRO-3 training in directory `dir`
    /// (`memsave_dist::Fsdp::save_sharded`): each rank writes its shard of the weights
    /// and of the optimizer's state, the step count ([`steps`](Self::steps)) and its RNG
    /// state, and the checkpoint is committed only once every rank's file is complete
    /// (an earlier checkpoint in `dir` stays loadable until then). A collective.
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`] without ZeRO-3 (a whole optimizer saves with
    /// [`CaseOptimizer::save`], the model with its `VarStore`) or without an optimizer;
    /// the checkpoint's own errors otherwise.
    pub fn save_sharded(&mut self, dir: impl AsRef<std::path::Path>) -> Result<(), StepError> {
        let steps = self.steps;
        let (fsdp, opt) = self.sharded_parts("save_sharded")?;
        opt.save_sharded(fsdp, dir.as_ref(), steps)
    }

    /// Loads a checkpoint written by [`save_sharded`](Self::save_sharded) (on the same
    /// number of ranks, for the same model and optimizer kind) into the shards, the
    /// optimizer and the RNG, and sets [`steps`](Self::steps) to its step, so that
    /// training continues as it would have from there. A collective; all ranks load or
    /// none (`memsave_dist::Fsdp::load_sharded`), and a refused checkpoint changes
    /// nothing.
    ///
    /// # Errors
    /// As [`save_sharded`](Self::save_sharded), and the checkpoint's refusals.
    pub fn load_sharded(&mut self, dir: impl AsRef<std::path::Path>) -> Result<(), StepError> {
        let (fsdp, opt) = self.sharded_parts("load_sharded")?;
        let step = opt.load_sharded(fsdp, dir.as_ref())?;
        self.steps = step;
        Ok(())
    }

    /// ZeRO-3's `Fsdp` and the optimizer over its shards, or why `what` cannot run.
    fn sharded_parts(
        &mut self,
        what: &str,
    ) -> Result<(&memsave_dist::Fsdp, &mut CaseOptimizer), StepError> {
        let Some(fsdp) = self
            .data_parallel
            .as_ref()
            .and_then(DataParallelHandle::fsdp)
        else {
            return Err(StepError::invalid(format!(
                "{what}: a sharded checkpoint is ZeRO-3's (DataParallel::Fsdp); without it save the optimizer with CaseOptimizer::save and the model with its VarStore"
            )));
        };
        let Some(opt) = self.optimizer.as_mut() else {
            return Err(StepError::invalid(format!(
                "{what}: the trainer has no optimizer; a sharded checkpoint holds the optimizer's state with the weights"
            )));
        };
        Ok((fsdp, opt))
    }

    /// Sets the learning rate of every parameter group from the next step on
    /// ([`CaseOptimizer::set_lr`]); an error without an optimizer.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), StepError> {
        self.optimizer
            .as_mut()
            .ok_or_else(|| StepError::invalid("set_lr: the trainer has no optimizer"))?
            .set_lr(lr)
    }

    /// Asks `scheduler` for the learning rate before every following step (with the
    /// number of steps run so far, [`steps`](Self::steps)) and sets it on every group;
    /// `None` stops it and leaves the last rate. Traps: it overrides
    /// [`set_lr`](Self::set_lr) at each step; a new trainer counts from 0, so after
    /// loading a saved optimizer state call [`set_steps`](Self::set_steps) with the
    /// step it was saved at, or the schedule starts over.
    pub fn set_lr_scheduler(&mut self, scheduler: Option<Box<dyn LRScheduler>>) {
        self.lr_scheduler = scheduler;
    }
}
