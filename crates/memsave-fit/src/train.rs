//! Training with `fit`'s choice: a [`Trainer`] (or its builder) that carries everything
//! the choice means, built in one call.
use crate::{Choice, FitReport};
use memsave_step::{OptimizerSpec, ProcessGroup, StepError, Trainer, TrainerBuilder, Workload};

impl Choice {
    /// A [`TrainerBuilder`] for this configuration: its [`StepConfig`] with `optimizer`
    /// changed by the choice's optimizer levers ([`step_config`](Self::step_config):
    /// micro-batches, offloaded activations, gradients in files, the step in backward,
    /// the optimizer's state in files, and the allowed lossy levers), and its checkpoint
    /// [`schedule`](Self::schedule) (recompute nothing when it has none), which
    /// [`build`](TrainerBuilder::build) sets on the model's layers, and its
    /// [`block_levers`](Self::block_levers) when it has them (a model of blocks', or a
    /// chain's layer by layer: the layers then go under `Plan::PerLayer`).
    ///
    /// Use it to add to the choice before building (e.g. a per-block
    /// [`record_trace`](TrainerBuilder::record_trace)); [`FitReport::trainer`] builds
    /// the trainer at once with the optimizer the fit stepped.
    ///
    /// Traps: pass the optimizer the workload was fitted with
    /// ([`FitReport::optimizer`]: the request's, else [`Workload::optimizer`]): the
    /// choice's peak was measured with it, and
    /// `in_backward` or 8-bit state only mean something with one. Replacing it or the
    /// levers afterwards (e.g. [`TrainerBuilder::optimizer`], which would drop the
    /// choice's `in_backward` and its state's placement in files) leaves the budget
    /// unchecked. Offloaded activations are
    /// written synchronously, as `fit` measured them, so that the peak stays the
    /// measured one. A choice made on ranks (with a
    /// [`data_parallel`](Self::data_parallel) mode) trains on them: use
    /// [`trainer_builder_on`](Self::trainer_builder_on), which adds the mode; this
    /// builder alone would train on one process.
    ///
    /// [`StepConfig`]: memsave_step::StepConfig
    pub fn trainer_builder(&self, optimizer: Option<OptimizerSpec>) -> TrainerBuilder {
        let builder =
            TrainerBuilder::new(self.step_config(optimizer)).schedule(self.schedule().cloned());
        match self.block_levers() {
            Some(levers) => builder.block_levers(levers),
            None => builder,
        }
    }

    /// [`trainer_builder`](Self::trainer_builder) on the ranks of `group`: with the
    /// choice's [`data_parallel`](Self::data_parallel) mode
    /// ([`TrainerBuilder::data_parallel`]), so that building it and every step are
    /// collectives, each rank stepping on its share of the global batch (a choice
    /// without a mode, made on one process, gets none: it trains on one process).
    pub fn trainer_builder_on(
        &self,
        optimizer: Option<OptimizerSpec>,
        group: &ProcessGroup,
    ) -> TrainerBuilder {
        let builder = self.trainer_builder(optimizer);
        match self.data_parallel {
            Some(mode) => builder.data_parallel(group, mode.data_parallel()),
            None => builder,
        }
    }
}

impl FitReport {
    /// A [`Trainer`] over `model` with the chosen configuration, in one call: the
    /// choice's [`trainer_builder`](Choice::trainer_builder) with the optimizer the fit
    /// stepped ([`FitReport::optimizer`]: the request's, else `model`'s own
    /// [`optimizer`](Workload::optimizer)), built. Each
    /// [`step`](Trainer::step) then trains as the choice's measured step did, with its
    /// peak within the budget for a batch of [`global_batch`](Self::global_batch)
    /// examples.
    ///
    /// ```
    /// use memsave_checkpoint::CheckpointedSequential;
    /// use memsave_fit::{fit, FitRequest};
    /// use memsave_step::{
    ///     Batch, OptimizerKind, OptimizerSpec, StepConfig, TrainerBuilder, Workload,
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
    ///     fn global_batch(&self) -> i64 { 16 }
    ///     fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
    ///         Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    ///     }
    ///     fn optimizer(&self) -> Option<OptimizerSpec> {
    ///         Some(OptimizerSpec { kind: OptimizerKind::Sgd, lr: Some(0.1), ..Default::default() })
    ///     }
    /// }
    ///
    /// memsave_meter::install();
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let mut layers = CheckpointedSequential::new();
    /// for i in 0..4 {
    ///     let lin = nn::linear(vs.root() / i, 64, 64, Default::default());
    ///     layers = layers.add_fn(move |x| x + lin.forward(x).tanh());
    /// }
    /// let data = Tensor::rand([16, 32, 64], (Kind::Float, Device::Cpu));
    /// let mut model = Mlp { vs, layers, data };
    ///
    /// // The budget is the whole device: the parameters, the data the batches are
    /// // slices of (a batch counts the storage it is in), the optimizer's state, the
    /// // step's own. Not counted: whatever else the process holds.
    /// let params: u64 = model.parameters().iter().map(|p| p.numel() as u64 * 4).sum();
    /// let data = model.data.numel() as u64 * 4;
    /// let outside = memsave_meter::memory_allocated(Device::Cpu) - params - data;
    /// // Half the plain step's peak (a trainer of the baseline, no optimizer: it only
    /// // measures).
    /// let budget = {
    ///     let mut plain = TrainerBuilder::new(StepConfig::baseline()).build(&mut model)?;
    ///     let batch = plain.model().batch(16)?;
    ///     (plain.step(&batch)?.device_peak_bytes() - outside) / 2
    /// };
    /// let report = fit(&mut model, &FitRequest::new(budget))?;
    /// let mut trainer = report.trainer(&mut model)?;
    /// let batch = trainer.model().batch(report.global_batch)?;
    /// for step in 0..3 {
    ///     // Every step, the first (which makes the optimizer's state) too.
    ///     let peak = trainer.step(&batch)?.device_peak_bytes() - outside;
    ///     assert!(peak <= budget, "step {step}: {peak}");
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// Traps: the budget holds for batches of the fitted size (the split into
    /// micro-batches is a count: a larger batch makes larger micro-batches), and for the
    /// model `fit` ran on or one built the same way. The budget counts the whole device
    /// (see the [crate docs](crate#what-the-budget-counts)) but not what the process
    /// holds besides the model and the storages its batches are in (other models,
    /// tensors of your own): a step's
    /// [`device_peak_bytes`](memsave_step::StepMeasurement::device_peak_bytes) is
    /// within the budget plus that. Without `memsave_meter::install()` the step
    /// measurements are not exact.
    ///
    /// # Errors
    /// What [`TrainerBuilder::build`] refuses: [`StepError::InvalidConfig`] when the
    /// choice's schedule is for another number of layers than `model` has (another
    /// model than the one fitted), or the optimizer's state cannot be built; and
    /// [`StepError::InvalidConfig`] for a report of a fit on ranks (use
    /// [`trainer_on`](Self::trainer_on)).
    pub fn trainer<'m, W: Workload>(&self, model: &'m mut W) -> Result<Trainer<'m, W>, StepError> {
        if self.world_size > 1 || self.choice.data_parallel.is_some() {
            return Err(StepError::InvalidConfig(format!(
                "this choice was fitted on {} ranks ({}): build its trainer on them with FitReport::trainer_on",
                self.world_size,
                self.choice.strategy
            )));
        }
        self.choice.trainer_builder(self.optimizer).build(model)
    }

    /// [`trainer`](Self::trainer) for a fit on the ranks of `group` (the one the fit
    /// ran on, or one of as many ranks): the choice's
    /// [`trainer_builder_on`](Choice::trainer_builder_on), built. Every rank calls it
    /// at the same point (building is a collective) and steps on its share of the
    /// global batch, [`global_batch`](Self::global_batch) / `world_size` examples; each
    /// rank's peak then stays within the budget, which counts its parameters and its
    /// optimizer state too, as on one process (see the [crate docs](crate#on-the-ranks-of-a-process-group)).
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`] when `group` has another number of ranks than the
    /// fit ran on (the budget was measured for that many), and what
    /// [`trainer`](Self::trainer) refuses.
    pub fn trainer_on<'m, W: Workload>(
        &self,
        model: &'m mut W,
        group: &ProcessGroup,
    ) -> Result<Trainer<'m, W>, StepError> {
        if group.world_size() != self.world_size {
            return Err(StepError::InvalidConfig(format!(
                "this choice was fitted on {} rank{}, the group has {}: fit again on this group",
                self.world_size,
                if self.world_size == 1 { "" } else { "s" },
                group.world_size()
            )));
        }
        self.choice
            .trainer_builder_on(self.optimizer, group)
            .build(model)
    }
}
