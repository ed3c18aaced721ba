//! Data parallel steps: the ranks of a `memsave_dist::ProcessGroup` each run the step
//! on their share of the batch, and their gradients are averaged (data parallel,
//! [`DataParallel::Ddp`]) or reduced into shards of a sharded optimizer (ZeRO,
//! [`DataParallel::Zero`]). A process group is a live object, so this is not part of
//! the serializable [`StepConfig`]: it is handed to a step at run time
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
//!   one's averages the sums; under ZeRO-2 every micro-batch's backward reduces its
//!   gradients into the shards (they stay at 1/N);
//! - a `GradScaler` scales every rank's loss; the gradients are unscaled after they are
//!   averaged, so every rank sees the same inf/NaN and skips the same steps;
//! - an optimizer steps after backward: whole on every rank under `Ddp` (any placement
//!   and state precision), sharded under ZeRO (`memsave_dist::ZeroOptimizer`, with the
//!   same placements and precisions; 8-bit blocks hold one parameter each, as on one
//!   process).
//!
//! Refused, by [`DataParallel::check`] from the configuration alone (before any rank
//! starts or anything is built), each with the reason: an optimizer `in_backward`
//! (it would step each parameter from its own rank's gradient before any averaging),
//! `offload_grads` except under ZeRO-1 (it takes the post-accumulate-grad hook of each
//! parameter that DDP and ZeRO-2 reduce with), ZeRO without an optimizer, and an
//! enabled `GradScaler` with ZeRO (the sharded step has no unscale or inf/NaN check).
use crate::config::StepConfig;
use crate::error::StepError;
use crate::levers::OptimizerSpec;
use crate::optimizer::{CaseOptimizer, IN_BACKWARD_ZERO, SCALER_WITH_ZERO};
use memsave_dist::{DdpConfig, DistributedDataParallel, ProcessGroup, ZeroStage};
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
}

impl DataParallel {
    /// Why `config` cannot run data parallel this way, decided from the configuration
    /// alone, so that a harness can refuse a case before starting any rank; each
    /// message names the lever at fault. [`TrainerBuilder::build`](crate::TrainerBuilder::build)
    /// and every data parallel step check it too.
    ///
    /// # Errors
    /// [`StepError::InvalidConfig`] for an optimizer `in_backward`, `offload_grads`
    /// (except under ZeRO-1), ZeRO without an optimizer, and an enabled `GradScaler`
    /// with ZeRO.
    pub fn check(&self, config: &StepConfig) -> Result<(), StepError> {
        let in_backward = config.optimizer.is_some_and(|o| o.in_backward);
        let scales = config.scaler.as_ref().is_some_and(|c| c.enabled);
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
        }
        Ok(())
    }
}

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
#[derive(Debug)]
pub struct DataParallelHandle {
    group: ProcessGroup,
    mode: DataParallel,
    ddp: Option<DistributedDataParallel>,
}

impl DataParallelHandle {
    /// Sets up `mode` over `params` on `group`: under `Ddp`, installs the hooks that
    /// average the gradients and copies rank 0's parameters to every rank (as its
    /// [`DdpConfig`] says); under ZeRO nothing yet (the optimizer does it).
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
        };
        Ok(Self {
            group: group.clone(),
            mode,
            ddp,
        })
    }

    /// The optimizer `spec` asks for over `params`, as this mode runs it: whole under
    /// `Ddp` ([`CaseOptimizer::build`]), sharded over the group under ZeRO
    /// ([`CaseOptimizer::build_sharded`], which copies rank 0's parameters to every
    /// rank). `in_backward` is refused.
    pub fn optimizer(
        &self,
        spec: &OptimizerSpec,
        params: &[Tensor],
    ) -> Result<CaseOptimizer, StepError> {
        match self.mode {
            DataParallel::Ddp(_) => {
                if spec.in_backward {
                    return Err(StepError::invalid(IN_BACKWARD_DDP));
                }
                CaseOptimizer::build(spec, params)
            }
            DataParallel::Zero(stage) => {
                CaseOptimizer::build_sharded(spec, params, &self.group, stage)
            }
        }
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

    /// Turns DDP's reduction in backward on or off (nothing under ZeRO); see
    /// [`SyncGuard`].
    pub(crate) fn set_grad_sync(&self, on: bool) {
        if let Some(ddp) = &self.ddp {
            ddp.set_require_backward_grad_sync(on);
        }
    }

    /// After the step's last backward: reduces what backward left unreduced (DDP's
    /// incomplete buckets), so that every rank holds the averaged gradients. ZeRO
    /// completes its reductions in its optimizer step.
    pub(crate) fn finish_backward(&self) -> Result<(), StepError> {
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
            dp.set_grad_sync(true);
        }
    }
}
