//! Data parallel steps: the ranks of a `memsave_dist::ProcessGroup` each run the step
//! on their share of the batch, and their gradients are averaged (data parallel,
//! [`DataParallel::Ddp`]), reduced into shards of a sharded optimizer (ZeRO-1/2,
//! [`DataParallel::Zero`]), or reduced into shards of the parameters themselves
//! (ZeRO-3, [`DataParallel::Fsdp`]). A process group is a live object, so this is not
//! part of the serializable [`StepConfig`]: it is handed to a step at run time
//! ([`TrainerBuilder::data_parallel`](crate::TrainerBuilder::data_parallel), or
//! [`StepRun::data_parallel`](crate::StepRun::data_parallel) with a
//! [`DataParallelHandle`]).
//!
//! What each lever does on N ranks:
//!
//! - checkpoint plans (fixed or budget: each rank profiles its own share), residual
//!   updates, autocast, `compress` and `offload` of saved activations act on each
//!   rank's forward and backward as on one process;
//! - micro-batches split each rank's share; under [`DataParallel::Ddp`] the backward of
//!   every micro-batch but the last only accumulates locally (`no_sync`), and the last
//!   one's averages the sums; under ZeRO-2 and ZeRO-3 every micro-batch's backward
//!   reduces its gradients into the shards (they stay at 1/N);
//! - a `GradScaler` scales every rank's loss; the gradients are unscaled after they are
//!   averaged, so every rank sees the same inf/NaN and skips the same steps;
//! - an optimizer steps after backward: whole on every rank under `Ddp` (any placement
//!   and state precision), sharded under ZeRO-1/2 (`memsave_dist::ZeroOptimizer`, with
//!   the same placements and precisions; 8-bit blocks hold one parameter each, as on
//!   one process), over the parameter shards under ZeRO-3 (any rule, precision and
//!   placement; 8-bit blocks run over each parameter's shard), where it may also step in
//!   backward, each shard as its unit's gradients land.
//!
//! **ZeRO-3** (`memsave_dist::Fsdp`, PyTorch's FSDP2) shards each layer of the
//! workload's `CheckpointedSequential` as one unit: [`Workload::layer_parameters`]
//! says which parameters each layer uses, and [`Workload::set_layer_wrapper`] runs
//! each layer's forward inside its unit's (weights gathered before it, freed after it
//! when `reshard_after_forward`, gathered again in backward or in a checkpoint's
//! recomputation). A workload without either is refused, naming it. The step's forward
//! runs inside `Fsdp::forward_with`, whose saved-tensor hook keeps only where the
//! weights autograd saves lie, and hands every other saved tensor to the step's
//! `compress` or `offload` hooks. Gradient accumulation: every micro-batch's backward
//! reduce-scatters its gradients into the shards (FSDP with gradient sync on, not
//! `no_sync`): communication per micro-batch, but a rank never holds more than one
//! unit's full gradients; keeping whole gradients across micro-batches would hold all
//! P of them on every rank, the memory ZeRO-3 is for. The checkpoint plan is set
//! before the layers are sharded (a budget profiles the full weights). Trap: under
//! autocast, autograd saves the weights' low-precision copies, not the gathered weights,
//! so those copies (half the weights' bytes in bf16) stay until backward, which then
//! gathers nothing again.
//!
//! Refused, by [`DataParallel::check`] from the configuration alone (before any rank
//! starts or anything is built), each with the reason: an optimizer `in_backward`
//! except under ZeRO-3 (it would step each parameter from its own rank's gradient
//! before any averaging), under ZeRO-3 with more than one micro-batch (each shard
//! steps at every backward; except with `offload_params`, whose shards are in files and
//! whose gradient sums wait in files until the last micro-batch); `offload_grads` except under ZeRO-1 (it takes the
//! post-accumulate-grad hook of each parameter that DDP, ZeRO-2 and ZeRO-3 reduce
//! with); ZeRO-1/2 without an optimizer; and an enabled `GradScaler` with any ZeRO
//! stage (the sharded step has no unscale or inf/NaN check).
use crate::config::StepConfig;
use crate::error::StepError;
use crate::levers::OptimizerSpec;
use crate::optimizer::{CaseOptimizer, IN_BACKWARD_ZERO, SCALER_WITH_ZERO};
use crate::workload::{LayerWrapper, Workload};
use memsave_dist::{
    DdpConfig, DistributedDataParallel, Fsdp, FsdpConfig, FsdpStats, ProcessGroup, ZeroStage,
};
use memsave_sys::hooks::RawHooks;
use std::sync::Arc;
use tch::Tensor;

/// How the ranks of a process group share a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataParallel {
    /// Every rank holds the whole model and optimizer; the gradients are averaged over
    /// the ranks in buckets while the last micro-batch's backward runs
    /// (`memsave_dist::DistributedDataParallel`, which copies rank 0's parameters to
    /// every rank when it is set up).
    Ddp(DdpConfig),
    /// ZeRO: each rank keeps 1/N of the optimizer's state (stage 1) and of the
    /// gradients (stage 2), `memsave_dist::ZeroOptimizer`. Needs an optimizer.
    Zero(ZeroStage),
    /// ZeRO-3, fully sharded data parallel (`memsave_dist::Fsdp`): each rank keeps 1/N
    /// of every parameter too, and of its gradients and optimizer state; each layer's
    /// weights are gathered only while it runs (see [the module docs](self)). The
    /// workload must say which parameters each layer uses. Without an optimizer the
    /// averaged gradients are left in the shards' `.grad`.
    Fsdp(FsdpConfig),
}

impl DataParallel {
    /// This mode with, under ZeRO-3 and `in_files`, each rank's shards in files
    /// ([`FsdpConfig::shards_in_files`]): what [`ParamsOffload`](crate::ParamsOffload)
    /// means on ranks. Other modes as they are.
    pub fn with_params_in_files(self, in_files: bool) -> Self {
        match self {
            DataParallel::Fsdp(config) if in_files => DataParallel::Fsdp(FsdpConfig {
                shards_in_files: true,
                ..config
            }),
            other => other,
        }
    }

    /// Why `config` cannot run data parallel this way, decided from the configuration
    /// alone, so that a harness can refuse a case before starting any rank; each
    /// message names the lever at fault. [`TrainerBuilder::build`](crate::TrainerBuilder::build)
    /// and every data parallel step check it too.
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`] for an optimizer `in_backward` (except under
    /// ZeRO-3 with one micro-batch), `offload_grads` (except under ZeRO-1), ZeRO-1/2
    /// without an optimizer, and an enabled `GradScaler` with any ZeRO stage.
    pub fn check(&self, config: &StepConfig) -> Result<(), StepError> {
        let in_backward = config.optimizer.is_some_and(|o| o.in_backward);
        let scales = config.scaler.as_ref().is_some_and(|c| c.enabled);
        if config.offload_params.is_some() {
            if !matches!(self, DataParallel::Fsdp(_)) {
                return Err(StepError::invalid(OFFLOAD_PARAMS_DATA_PARALLEL));
            }
            check_offload_params(config)?;
        }
        match self {
            DataParallel::Ddp(_) => {
                if in_backward {
                    return Err(StepError::invalid(IN_BACKWARD_DDP));
                }
                if config.offload_grads.is_some() {
                    return Err(StepError::invalid(OFFLOAD_GRADS_DDP));
                }
            }
            DataParallel::Zero(stage) => {
                if config.optimizer.is_none() {
                    return Err(StepError::invalid(ZERO_WITHOUT_OPTIMIZER));
                }
                if in_backward {
                    return Err(StepError::invalid(IN_BACKWARD_ZERO));
                }
                if scales {
                    return Err(StepError::invalid(SCALER_WITH_ZERO));
                }
                if config.offload_grads.is_some() && *stage == ZeroStage::Two {
                    return Err(StepError::invalid(OFFLOAD_GRADS_ZERO2));
                }
            }
            DataParallel::Fsdp(_) => {
                // With the shards in files, each unit's gradients wait in a file until
                // the last micro-batch, which steps it.
                let in_files = config.offload_params.is_some();
                if in_backward && !in_files && config.micro_batches.is_some_and(|m| m > 1) {
                    return Err(StepError::invalid(IN_BACKWARD_FSDP_ACCUMULATION));
                }
                if scales {
                    return Err(StepError::invalid(SCALER_WITH_FSDP));
                }
                if config.offload_grads.is_some() {
                    return Err(StepError::invalid(OFFLOAD_GRADS_FSDP));
                }
            }
        }
        Ok(())
    }
}

/// The units ZeRO-3 and [`ParamsOffload`](crate::ParamsOffload) make of `model`
/// (see [`DataParallelHandle::for_workload`]), by name (`layer 3`, `block enc2`) with
/// the bytes of their parameters, in order; layers without parameters make none. A
/// model of blocks runs one forward of `model.batch(1)` in evaluation mode to find
/// them. For messages: with the parameters in files the device holds the unit that
/// runs, so the largest unit is what it holds at least; and for whether a workload can
/// be run so at all (an `Err` says why not). Removes any layer wrapper the workload
/// has.
///
/// # Errors
/// As [`DataParallelHandle::for_workload`] refuses a workload.
pub fn units_of(model: &dyn Workload) -> Result<Vec<(String, u64)>, StepError> {
    let bytes = |ps: &[Tensor]| -> u64 { ps.iter().map(memsave_sys::tensor::nbytes).sum() };
    Ok(match model.blocks() {
        Some(blocks) => find_block_units(model, blocks)?
            .into_iter()
            .filter(|(_, ps)| !ps.is_empty())
            .map(|(name, ps)| (format!("block {name}"), bytes(&ps)))
            .collect(),
        None => find_layer_units(model)?
            .iter()
            .enumerate()
            .filter(|(_, ps)| !ps.is_empty())
            .map(|(i, ps)| (format!("layer {i}"), bytes(ps)))
            .collect(),
    })
}

/// Why `config`'s `offload_params` cannot run, decided from the configuration alone
/// (on one process as under ZeRO-3): an optimizer stepped after backward (the weights
/// are in files between their uses, so each unit must step as its gradients land),
/// `offload_grads` (it takes the hook that steps each unit), or a `GradScaler`.
/// Accumulation over micro-batches runs: each unit's gradients wait in a file of its
/// own until the last micro-batch's backward steps it.
pub(crate) fn check_offload_params(config: &StepConfig) -> Result<(), StepError> {
    if config.offload_params.is_none() {
        return Ok(());
    }
    if config.optimizer.is_some_and(|o| !o.in_backward) {
        return Err(StepError::invalid(OFFLOAD_PARAMS_AFTER_BACKWARD));
    }
    if config.offload_grads.is_some() {
        return Err(StepError::invalid(OFFLOAD_PARAMS_OFFLOAD_GRADS));
    }
    if config.scaler.as_ref().is_some_and(|c| c.enabled) {
        return Err(StepError::invalid(OFFLOAD_PARAMS_SCALER));
    }
    Ok(())
}

const OFFLOAD_PARAMS_DATA_PARALLEL: &str = "offload_params runs on one process or with zero: 3 (each rank's shards in files); data parallel and zero: 1 or 2 keep every parameter on every rank: use zero: 3";
pub(crate) const OFFLOAD_PARAMS_AFTER_BACKWARD: &str = "offload_params keeps the weights in files between their uses, so the optimizer must step each unit as its gradients land: add in_backward: true to the optimizer";
const OFFLOAD_PARAMS_OFFLOAD_GRADS: &str = "offload_grads cannot run with offload_params: each unit's gradients already step its weights in files as they land; drop offload_grads";
const OFFLOAD_PARAMS_SCALER: &str = "grad_scaler cannot run with offload_params: each unit steps in backward, before any unscale or inf/NaN check; drop grad_scaler";

/// `zero: 3` as the harness's suites spell it, for messages.
const ZERO3: &str = "zero: 3";
const IN_BACKWARD_FSDP_ACCUMULATION: &str = "optimizer in_backward cannot accumulate over micro-batches with zero: 3: each shard steps as soon as its unit's gradients are reduce-scattered, at every micro-batch's backward; drop accumulate, or step after backward (drop in_backward)";
const SCALER_WITH_FSDP: &str = "grad_scaler cannot run with zero: 3: each rank holds only its shard of the gradients, and the step has no unscale or inf/NaN check across the ranks; drop grad_scaler, or run data parallel without zero";
const OFFLOAD_GRADS_FSDP: &str = "offload_grads cannot run with zero: 3: it keeps each gradient in a file as backward produces it, taking the parameter's one post-accumulate-grad hook that reduce-scatters the unit's gradients into the shards; drop offload_grads, or use zero: 1";

const IN_BACKWARD_DDP: &str = "optimizer in_backward cannot run data parallel: it would step each parameter from its own rank's gradient as backward produces it, before the gradient is averaged over the ranks (and it needs the parameter's one post-accumulate-grad hook, which averages the gradient); step the optimizer after backward";
const OFFLOAD_GRADS_DDP: &str = "offload_grads cannot run data parallel: it keeps each gradient in a file as backward produces it, taking the parameter's one post-accumulate-grad hook that averages the gradient over the ranks; drop offload_grads, or use zero: 1 (which reduces the gradients in its step)";
const OFFLOAD_GRADS_ZERO2: &str = "offload_grads cannot run with zero: 2: it keeps each gradient in a file as backward produces it, taking the parameter's one post-accumulate-grad hook that reduces the gradient into the shards; use zero: 1, or drop offload_grads";
const ZERO_WITHOUT_OPTIMIZER: &str = "zero shards the optimizer's state over the ranks: add an optimizer, e.g. with: [{zero: 2}, {optimizer: {kind: adamw}}]";

/// Data parallel set up over a model's parameters, for every step of a run: the
/// process group, the mode, and under [`DataParallel::Ddp`] the
/// `memsave_dist::DistributedDataParallel` whose hooks average the gradients. Under
/// ZeRO the sharding lives in the optimizer: build it with
/// [`optimizer`](Self::optimizer).
///
/// Traps: setting it up is a collective (every rank checks the parameter shapes and
/// takes rank 0's values), so every rank builds it, with the same parameters in the
/// same order, at the same point. A step that fails on one rank (out of memory, ...)
/// leaves the other ranks waiting in their next collective until the group's timeout:
/// unlike on one process, the next step cannot run.
///
/// Under ZeRO-3 it holds the `memsave_dist::Fsdp` that shards the workload's layers
/// ([`fsdp`](Self::fsdp): statistics, the full weights, sharded checkpoints): keep it
/// as long as the model trains, since dropping it removes the hooks that reduce the
/// gradients. The workload's parameters read NaN between steps (the weights live in
/// the shards; read them with `Fsdp::f_full_parameters`), and still after the drop
/// unless `Fsdp::f_restore_full_parameters` (`Trainer::restore_full_parameters`) put
/// the full weights back first.
#[derive(Debug)]
pub struct DataParallelHandle {
    group: ProcessGroup,
    mode: DataParallel,
    ddp: Option<DistributedDataParallel>,
    fsdp: Option<Fsdp>,
    /// [`offload_params`](Self::offload_params)'s group of one: its rendezvous file's
    /// directory (after `fsdp`, so dropped after it).
    _rendezvous: Option<tempfile::TempDir>,
}

impl DataParallelHandle {
    /// Sets up `mode` over `params` on `group`: under `Ddp`, installs the hooks that
    /// average the gradients and copies rank 0's parameters to every rank (as its
    /// [`DdpConfig`] says); under ZeRO-1/2 nothing yet (the optimizer does it). ZeRO-3
    /// shards the model's layers: it is refused here, set it up with
    /// [`for_workload`](Self::for_workload).
    pub fn new(
        group: &ProcessGroup,
        mode: DataParallel,
        params: &[Tensor],
    ) -> Result<Self, StepError> {
        let ddp = match mode {
            DataParallel::Ddp(config) => Some(
                DistributedDataParallel::new(group, params, config)
                    .map_err(|e| StepError::lever("data_parallel", e))?,
            ),
            DataParallel::Zero(_) => None,
            DataParallel::Fsdp(_) => {
                return Err(StepError::invalid(format!(
                    "{ZERO3} shards the workload's layers, not a list of parameters: set it up with DataParallelHandle::for_workload"
                )))
            }
        };
        Ok(Self {
            group: group.clone(),
            mode,
            ddp,
            fsdp: None,
            _rendezvous: None,
        })
    }

    /// Sets up `mode` for `model` on `group`: as [`new`](Self::new) over its
    /// parameters, and under ZeRO-3 shards each layer of its `CheckpointedSequential`
    /// as one unit (the parameters [`Workload::layer_parameters`] gives for it; layers
    /// without parameters are left as they are) and routes every layer's forward
    /// through its unit ([`Workload::set_layer_wrapper`]). A model of blocks
    /// ([`Workload::blocks`]) is sharded one unit per top-level block name instead (all
    /// its calls in one unit), with the parameters found by one forward of
    /// `model.batch(1)` in evaluation mode (`Blocks::f_block_parameters`), and each
    /// top-level block's function runs inside its unit (`Blocks::set_wrapper`). A
    /// collective: every rank sets it up over the same model, and rank 0's weights are
    /// copied to every rank.
    ///
    /// Set the checkpoint plan first: a budget plan profiles the layers, which runs
    /// them outside any step once they are sharded.
    ///
    /// Trap: a unit is a block *name*. A loop that runs one closure over several
    /// modules under one name (`b.run("layer", ..)` for every layer) makes one unit of
    /// all their weights, gathered at every call: correct, but nothing is saved. Name
    /// each its own (`format!("layer{i}")`). The parameters are found on each rank's
    /// own example, and the ranks agree on them before anything is sharded: a forward
    /// whose blocks depend on the data (a router that skips a block) and finds other
    /// units on another rank is refused on every rank, as is a search that fails on
    /// one rank only (instead of the other ranks waiting for the group's timeout).
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`], before anything is sharded and on every rank, when
    /// the workload does not say which parameters each layer uses, gives another
    /// number of lists than it has layers, leaves a parameter out, names one twice or
    /// names a tensor that is not a parameter, or cannot wrap its layers; for a model
    /// of blocks, when two blocks use one parameter or no block uses one (the error
    /// names them); when the ranks found different units; `zero` errors (a parameter
    /// whose shape differs across the ranks, ...) from the sharding.
    pub fn for_workload(
        group: &ProcessGroup,
        mode: DataParallel,
        model: &dyn Workload,
    ) -> Result<Self, StepError> {
        let DataParallel::Fsdp(config) = mode else {
            return Self::new(group, mode, &model.parameters());
        };
        // Every rank finds its units on its own example, then the ranks agree on them
        // (or on one rank's error) before the first collective of the sharding: a
        // rank whose forward ran other blocks, or that failed alone, would otherwise
        // wait in a collective the others never join.
        let found = match model.blocks() {
            Some(blocks) => find_block_units(model, blocks).map(Units::Blocks),
            None => find_layer_units(model).map(Units::Layers),
        };
        let units = agree_units(group, model, found)?;
        let zero = |e| StepError::lever("zero", e);
        let mut fsdp = Fsdp::new(group, config).map_err(zero)?;
        match units {
            Units::Layers(layers) => {
                let mut unit_of = Vec::with_capacity(layers.len());
                for params in &layers {
                    unit_of.push(if params.is_empty() {
                        None
                    } else {
                        Some(fsdp.fully_shard_parameters(params).map_err(zero)?)
                    });
                }
                let units = fsdp.units();
                let wrapper: LayerWrapper =
                    Arc::new(move |layer, forward| match unit_of.get(layer) {
                        Some(&Some(unit)) => units
                            .f_forward(unit, forward)
                            .unwrap_or_else(|e| panic!("{e}")),
                        _ => forward(),
                    });
                model.set_layer_wrapper(Some(wrapper));
            }
            Units::Blocks(blocks_units) => {
                let mut unit_of = std::collections::HashMap::new();
                for (block, list) in &blocks_units {
                    if !list.is_empty() {
                        unit_of.insert(
                            block.clone(),
                            fsdp.fully_shard_parameters(list).map_err(zero)?,
                        );
                    }
                }
                let handles = fsdp.units();
                let wrapper: memsave_checkpoint::BlockWrapper =
                    Arc::new(move |block, xs, f| match unit_of.get(block) {
                        Some(&unit) => handles
                            .f_forward(unit, || f(xs))
                            .unwrap_or_else(|e| panic!("{e}")),
                        None => f(xs),
                    });
                if let Some(blocks) = model.blocks() {
                    blocks.set_wrapper(Some(wrapper));
                }
            }
        }
        Ok(Self {
            group: group.clone(),
            mode,
            ddp: None,
            fsdp: Some(fsdp),
            _rendezvous: None,
        })
    }

    /// The parameters of `model` off the device on one process
    /// ([`ParamsOffload`](crate::ParamsOffload)): ZeRO-3 over a group of one (its
    /// rendezvous file in a temporary directory of its own) with `config`'s options
    /// and the shards in files of a temporary directory, one unit per layer or
    /// top-level block as [`for_workload`](Self::for_workload) makes them. Build the
    /// optimizer with [`optimizer`](Self::optimizer) (it must step in backward).
    ///
    /// # Errors
    /// As [`for_workload`](Self::for_workload); a temporary directory that cannot be
    /// made or written, naming it; a model that is not on the CPU.
    pub fn offload_params(model: &dyn Workload, config: FsdpConfig) -> Result<Self, StepError> {
        if model.device() != tch::Device::Cpu {
            return Err(StepError::invalid(format!(
                "offload_params keeps the parameters of a CPU model in files; '{}' is on {:?}, where keeping them in host memory is not done yet: drop offload_params",
                model.name(),
                model.device()
            )));
        }
        let zero = |e| StepError::lever("offload_params", e);
        let dir = tempfile::Builder::new()
            .prefix("memsave-rendezvous-")
            .tempdir()
            .map_err(|e| {
                StepError::invalid(format!(
                    "offload_params: cannot make a directory in {}: {e}",
                    std::env::temp_dir().display()
                ))
            })?;
        let group = ProcessGroup::new_file(
            &dir.path().join("store"),
            0,
            1,
            &memsave_dist::InitOptions::default(),
        )
        .map_err(zero)?;
        let config = FsdpConfig {
            shards_in_files: true,
            ..config
        };
        let mut handle = Self::for_workload(&group, DataParallel::Fsdp(config), model)?;
        handle._rendezvous = Some(dir);
        Ok(handle)
    }

    /// The optimizer `spec` asks for over `params`, as this mode runs it: whole under
    /// `Ddp` ([`CaseOptimizer::build`]), sharded over the group under ZeRO-1/2
    /// ([`CaseOptimizer::build_sharded`], which copies rank 0's parameters to every
    /// rank), over this rank's parameter shards under ZeRO-3
    /// ([`CaseOptimizer::build_over_shards`]; `params`, the model's, are then the
    /// shards' origin and not stepped). `in_backward` is refused except under ZeRO-3.
    pub fn optimizer(
        &self,
        spec: &OptimizerSpec,
        params: &[Tensor],
    ) -> Result<CaseOptimizer, StepError> {
        match (self.mode, &self.fsdp) {
            (DataParallel::Ddp(_), _) => {
                if spec.in_backward {
                    return Err(StepError::invalid(IN_BACKWARD_DDP));
                }
                CaseOptimizer::build(spec, params)
            }
            (DataParallel::Zero(stage), _) => {
                CaseOptimizer::build_sharded(spec, params, &self.group, stage)
            }
            (DataParallel::Fsdp(_), Some(fsdp)) => CaseOptimizer::build_over_shards(spec, fsdp),
            (DataParallel::Fsdp(_), None) => unreachable!("set up by for_workload"),
        }
    }

    /// Under ZeRO-3, lets the weights go without a word when this handle is dropped
    /// (`Fsdp::discard`: for a caller that puts back a copy of its own, or throws the
    /// model away); nothing in the other modes.
    pub fn discard(&self) {
        if let Some(fsdp) = &self.fsdp {
            fsdp.discard();
        }
    }

    /// ZeRO-3's `Fsdp` (`None` in the other modes): what it holds
    /// (`Fsdp::stats`), the full weights (`Fsdp::f_full_parameters`), sharded
    /// checkpoints.
    pub fn fsdp(&self) -> Option<&Fsdp> {
        self.fsdp.as_ref()
    }

    /// ZeRO-3's figures (`None` in the other modes); a step starts the gathered peak
    /// again, so after a step it is that step's.
    pub fn fsdp_stats(&self) -> Option<FsdpStats> {
        self.fsdp.as_ref().map(Fsdp::stats)
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The mode.
    pub fn mode(&self) -> DataParallel {
        self.mode
    }

    /// Checks a step's configuration and optimizer against the mode (see
    /// [`DataParallel::check`]); the optimizer of a ZeRO step must be this group's
    /// sharded one of the same stage, and a data parallel step's a whole one.
    pub(crate) fn check_step(
        &self,
        config: &StepConfig,
        optimizer: Option<&CaseOptimizer>,
        scales: bool,
    ) -> Result<(), StepError> {
        self.mode.check(config)?;
        let sharded = optimizer.and_then(CaseOptimizer::zero_stage);
        match self.mode {
            DataParallel::Ddp(_) => {
                if optimizer.is_some_and(CaseOptimizer::steps_in_backward) {
                    return Err(StepError::invalid(IN_BACKWARD_DDP));
                }
                if sharded.is_some() {
                    return Err(StepError::invalid("a data parallel step (Ddp) needs a whole optimizer, not a ZeRO one: build it with DataParallelHandle::optimizer"));
                }
            }
            DataParallel::Fsdp(_) => {
                let shards = self.shards();
                if let Some(o) = optimizer {
                    if !o.steps_exactly(&shards) {
                        return Err(StepError::invalid(format!(
                            "a {ZERO3} step needs an optimizer over this rank's {} parameter shards: build it with DataParallelHandle::optimizer",
                            shards.len()
                        )));
                    }
                    if o.steps_in_backward() && !o.steps_shards_in_backward() {
                        return Err(StepError::invalid(format!(
                            "a {ZERO3} optimizer in_backward must be stepped by ZeRO-3 as each shard's gradients land (its own hooks never fire on the shards): build it with DataParallelHandle::optimizer"
                        )));
                    }
                }
                if scales {
                    return Err(StepError::invalid(SCALER_WITH_FSDP));
                }
            }
            DataParallel::Zero(stage) => {
                if sharded != Some(stage) {
                    return Err(StepError::invalid(format!(
                        "a zero step needs the optimizer sharded at stage {} over its group: build it with DataParallelHandle::optimizer",
                        match stage {
                            ZeroStage::One => 1,
                            ZeroStage::Two => 2,
                        }
                    )));
                }
                if scales {
                    return Err(StepError::invalid(SCALER_WITH_ZERO));
                }
            }
        }
        Ok(())
    }

    /// This rank's parameter shards under ZeRO-3 (none otherwise): the tensors the
    /// optimizer steps and whose gradients a step frees first.
    pub(crate) fn shards(&self) -> Vec<Tensor> {
        self.fsdp.as_ref().map(Fsdp::parameters).unwrap_or_default()
    }

    /// Before a step: ZeRO-3's gathered peak starts again, and with the shards in
    /// files what a step that failed half way left (gradient sums in files, units half
    /// reduced) is dropped, so that it does not add to this step's.
    pub(crate) fn start_step(&self) -> Result<(), StepError> {
        if let Some(fsdp) = &self.fsdp {
            if fsdp.shard_dir().is_some() {
                fsdp.f_discard_unfinished_step()
                    .map_err(|e| StepError::lever("offload_params", e))?;
            }
            fsdp.reset_gathered_peak();
        }
        Ok(())
    }

    /// Runs a forward (and its loss) as the mode needs: under ZeRO-3 inside
    /// `Fsdp::forward_with`, handing the saved tensors that are not weights to
    /// `others` (the step's compress or offload hooks); else as it is.
    pub(crate) fn forward<T>(
        &self,
        others: Option<Arc<dyn RawHooks>>,
        f: impl FnOnce() -> T,
    ) -> Result<T, StepError> {
        match &self.fsdp {
            Some(fsdp) => fsdp
                .forward_with(others, f)
                .map_err(|e| StepError::lever("zero", e)),
            None => Ok(f()),
        }
    }

    /// Turns DDP's reduction in backward on or off (nothing under ZeRO); see
    /// [`SyncGuard`].
    pub(crate) fn set_grad_sync(&self, on: bool) -> Result<(), StepError> {
        if let Some(ddp) = &self.ddp {
            ddp.set_require_backward_grad_sync(on);
        }
        // With the shards in files (offload_params), a micro-batch before the last
        // adds its gradients to each unit's gradient file; the last one steps.
        if let Some(fsdp) = &self.fsdp {
            fsdp.set_accumulate(!on)
                .map_err(|e| StepError::lever("offload_params", e))?;
        }
        Ok(())
    }

    /// After the step's last backward: reduces what backward left unreduced (DDP's
    /// incomplete buckets, ZeRO-3's units some of whose parameters got no gradient),
    /// so that every rank holds the averaged gradients. ZeRO-1/2 complete their
    /// reductions in their optimizer step.
    pub(crate) fn finish_backward(&self) -> Result<(), StepError> {
        if let Some(fsdp) = &self.fsdp {
            let zero = |e| StepError::lever("zero", e);
            fsdp.f_finish_backward().map_err(zero)?;
            // Gloo's worker thread may let go of the last reduce-scatter's input (a
            // unit's full gradients) a moment after the call returns; the next
            // collective waits for it, so what backward left is measured without it.
            self.group.barrier().map_err(zero)?;
        }
        match &self.ddp {
            Some(ddp) => ddp
                .f_flush()
                .map_err(|e| StepError::lever("data_parallel", e)),
            None => Ok(()),
        }
    }

    /// Bytes the group has sent so far.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.group.bytes_sent()
    }
}

/// Turns DDP's reduction back on when dropped, so that a step that failed between two
/// micro-batches does not leave the next step's backward unreduced.
pub(crate) struct SyncGuard<'a>(pub Option<&'a DataParallelHandle>);

impl Drop for SyncGuard<'_> {
    fn drop(&mut self) {
        if let Some(dp) = self.0 {
            // A drop has no one to tell: a failure here shows at the next step,
            // which starts by dropping what this one left.
            let _ = dp.set_grad_sync(true);
        }
    }
}

/// Each top-level block's parameters (by name, as found), checked against the
/// workload's: every parameter in exactly one block.
fn block_units(
    name: &str,
    params: &[Tensor],
    found: Vec<(String, Vec<Tensor>)>,
) -> Result<Vec<(String, Vec<Tensor>)>, StepError> {
    let mut owner: Vec<Option<&str>> = vec![None; params.len()];
    for (block, list) in &found {
        for p in list {
            let Some(index) = params.iter().position(|q| q.data_ptr() == p.data_ptr()) else {
                continue;
            };
            if let Some(first) = owner[index] {
                return Err(StepError::invalid(format!(
                    "the workload '{name}': the parameter of shape {:?} is used by block \"{first}\" and by block \"{block}\"; {ZERO3} shards each parameter in one unit, and a unit is a top-level block: run both uses in one block",
                    p.size()
                )));
            }
            owner[index] = Some(block.as_str());
        }
    }
    if let Some(index) = owner.iter().position(Option::is_none) {
        return Err(StepError::invalid(format!(
            "the workload '{name}': its parameter {index} (shape {:?}) is used by no block (outside every block, or not through autograd), so {ZERO3}, whose units are the top-level blocks, would not shard it: run the code that uses it inside a block",
            params[index].size()
        )));
    }
    Ok(found)
}

/// ZeRO-3's units of a workload, as one rank found them.
enum Units {
    /// One list per layer of a chain, in layer order (a layer without parameters has
    /// an empty one and no unit).
    Layers(Vec<Vec<Tensor>>),
    /// One list per top-level block name of a model of blocks, in the order found.
    Blocks(Vec<(String, Vec<Tensor>)>),
}

impl Units {
    /// How many units, and a fingerprint of which parameters (by index in
    /// `params`) each holds and, for blocks, each block's name: equal on two ranks
    /// exactly when they found the same units (up to a hash collision).
    fn fingerprint(&self, params: &[Tensor]) -> (i64, i64) {
        use std::hash::{Hash, Hasher};
        let index = |p: &Tensor| params.iter().position(|q| q.data_ptr() == p.data_ptr());
        // SipHash with fixed keys: the same value in every process of one build.
        let mut hasher = std::hash::DefaultHasher::new();
        let count = match self {
            Units::Layers(layers) => {
                for list in layers {
                    list.iter().map(index).collect::<Vec<_>>().hash(&mut hasher);
                }
                layers.len()
            }
            Units::Blocks(blocks) => {
                for (name, list) in blocks {
                    name.hash(&mut hasher);
                    list.iter().map(index).collect::<Vec<_>>().hash(&mut hasher);
                }
                blocks.len()
            }
        };
        (count as i64, hasher.finish() as i64)
    }
}

/// The units every rank found (`found`, this rank's), agreed over `group` before
/// anything is sharded: this rank's error, or an error on every rank when another
/// rank's search failed or found other units (naming the ranks and their counts).
/// One all-gather of three numbers per rank.
fn agree_units(
    group: &ProcessGroup,
    model: &dyn Workload,
    found: Result<Units, StepError>,
) -> Result<Units, StepError> {
    let (count, print) = match &found {
        Ok(units) => units.fingerprint(&model.parameters()),
        Err(_) => (0, 0),
    };
    let mine = [i64::from(found.is_ok()), count, print];
    let n = group.world_size();
    let input = Tensor::from_slice(&mine);
    let output = Tensor::zeros([3 * n as i64], (tch::Kind::Int64, tch::Device::Cpu));
    group
        .all_gather(&output, &input)
        .map_err(|e| StepError::lever("zero", e))?;
    let all = Vec::<i64>::try_from(&output)?;
    let ranks: Vec<&[i64]> = all.chunks(3).collect();
    let units = found?;
    let name = model.name();
    if let Some(r) = ranks.iter().position(|v| v[0] == 0) {
        return Err(StepError::invalid(format!(
            "the workload '{name}': rank {r} could not find its units to shard ({ZERO3}; its own error says why), so no rank shards"
        )));
    }
    if let Some(r) = ranks.iter().position(|v| v[1..] != mine[1..]) {
        return Err(StepError::invalid(format!(
            "the workload '{name}': on their own examples, rank {} found {} units to shard ({ZERO3}) and rank {r} found {} (or other names or parameters in them); the ranks must shard the same units: make the forward run the same blocks whatever the data",
            group.rank(),
            mine[1],
            ranks[r][1]
        )));
    }
    Ok(units)
}

/// The parameters of each top-level block of a model of blocks (see
/// [`DataParallelHandle::for_workload`]), checked: every parameter in exactly one
/// block.
fn find_block_units(
    model: &dyn Workload,
    blocks: &memsave_checkpoint::Blocks,
) -> Result<Vec<(String, Vec<Tensor>)>, StepError> {
    let params = model.parameters();
    let example = model.batch(1)?;
    let found = blocks
        .f_block_parameters(&params, || {
            model.layers().f_forward_t(&example.input, false)
        })
        .map_err(|e| StepError::lever("zero", e))?;
    block_units(model.name(), &params, found)
}

/// The parameters of each layer of a chain, checked (see [`layer_units`]), and
/// whether the workload can run its layers inside their units.
fn find_layer_units(model: &dyn Workload) -> Result<Vec<Vec<Tensor>>, StepError> {
    let layers = layer_units(model)?;
    if !model.set_layer_wrapper(None) {
        return Err(StepError::invalid(format!(
            "the workload '{}' cannot run its layers inside their units ({ZERO3} gathers a layer's weights around its forward): implement Workload::set_layer_wrapper",
            model.name()
        )));
    }
    Ok(layers)
}

/// The parameters of each layer of `model`, checked against its parameters: every
/// parameter in exactly one layer, nothing else, one list per layer.
fn layer_units(model: &dyn Workload) -> Result<Vec<Vec<Tensor>>, StepError> {
    let name = model.name();
    let Some(layers) = model.layer_parameters()? else {
        return Err(StepError::invalid(format!(
            "the workload '{name}' does not say which parameters each layer uses, so {ZERO3} cannot shard it one unit per layer: implement Workload::layer_parameters (and set_layer_wrapper)"
        )));
    };
    let count = model.layers().len();
    if layers.len() != count {
        return Err(StepError::invalid(format!(
            "the workload '{name}' gives the parameters of {} layers, but it has {count}",
            layers.len()
        )));
    }
    let params = model.parameters();
    let mut owner: Vec<Option<usize>> = vec![None; params.len()];
    for (layer, list) in layers.iter().enumerate() {
        for p in list {
            let shape = p.size();
            let Some(index) = params
                .iter()
                .position(|q| q.data_ptr() == p.data_ptr() && q.size() == shape)
            else {
                return Err(StepError::invalid(format!(
                    "the workload '{name}': layer {layer} names a tensor of shape {shape:?} that is not one of its trainable parameters"
                )));
            };
            if let Some(first) = owner[index] {
                return Err(StepError::invalid(format!(
                    "the workload '{name}': the parameter of shape {shape:?} is in layer {first} and again in layer {layer}; {ZERO3} shards each parameter in one unit"
                )));
            }
            owner[index] = Some(layer);
        }
    }
    if let Some(index) = owner.iter().position(Option::is_none) {
        return Err(StepError::invalid(format!(
            "the workload '{name}': its parameter {index} (shape {:?}) is in no layer's list, so {ZERO3} would not shard it",
            params[index].size()
        )));
    }
    Ok(layers)
}
