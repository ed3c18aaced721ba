//! A candidate configuration of `fit`: how the global batch is split and which levers
//! are pulled, and the step configuration it runs as.
use crate::ParallelMode;
use memsave_checkpoint::{Block, BlockKey, BlockLever, Plan, PlannedLever, Schedule};
use memsave_step::config::{GradsAfter, ParamsOffload, PlanChoice, SavedTensors, StepConfig};
use memsave_step::levers::{CompressDtype, OptimizerSpec, StatePlacement, StatePrecision};
use serde::Serialize;
use tch::Kind;

/// One configuration `fit` considers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    /// A short name of the configuration, as the harness would name a strategy.
    pub strategy: String,
    /// On the ranks of a process group: how they share the step (`None` on one
    /// process). A configuration of [`micro_batches`](Self::micro_batches) and
    /// [`micro_batch`](Self::micro_batch) is then each rank's, on its share of the
    /// global batch.
    pub data_parallel: Option<ParallelMode>,
    /// How many micro-batches the global batch is split into (1: no accumulation).
    pub micro_batches: usize,
    /// The largest micro-batch (the split is as even as possible: sizes differ by at
    /// most one).
    pub micro_batch: i64,
    /// The checkpoint schedule (as `CheckpointedSequential`'s `explain` prints it), if
    /// any layer is recomputed.
    pub checkpoint: Option<String>,
    /// Saved activations offloaded to a file-backed store (lossless).
    pub offload: bool,
    /// Gradients kept in files between backward passes (`memsave_hooks::GradOffload`,
    /// lossless): with the optimizer step in backward, each whole gradient is stepped
    /// during the last micro-batch's backward, so no step holds every gradient.
    pub offload_grads: bool,
    /// With [`offload_grads`](Self::offload_grads): the gradients of parameters of fewer
    /// bytes than this accumulate in memory instead
    /// (`StepConfig::offload_grads_at_least`): a file for each small parameter (biases,
    /// norms' weights) costs more time than its bytes save. `fit` offers it for the
    /// smallest parameters, up to 2% of the gradients' bytes, beside its choice with
    /// every gradient in files, and keeps it only where it measures faster within the
    /// budget. `None`: every gradient in files.
    pub offload_grads_at_least: Option<u64>,
    /// The optimizer steps each parameter from inside backward and frees its gradient.
    pub in_backward: bool,
    /// Forward under bf16 autocast (lossy; only when allowed).
    pub autocast_bf16: bool,
    /// Saved activations compressed to int8 (lossy; only when allowed).
    pub compress_int8: bool,
    /// Optimizer state in 8 bits (lossy; only when allowed).
    pub int8_state: bool,
    /// Optimizer state kept in files between steps (`placement: disk`, lossless): each
    /// parameter's state is read back for its update and written after it, so the
    /// device holds one parameter's at a time. Considered when nothing fits with the
    /// state on the device (the budget is the whole device: AdamW's state is twice the
    /// parameters).
    pub state_in_files: bool,
    /// The parameters in files between their uses (`offload_params: {to: disk}`,
    /// lossless; `memsave_step::ParamsOffload::Disk`): each unit's weights (a layer, or
    /// a top-level block) are read for its forward, its recomputation and its
    /// backward, and stepped in backward (so with [`in_backward`](Self::in_backward);
    /// with micro-batches each unit's gradients wait in a file until the last one), so
    /// the device holds about one unit's weights. Considered
    /// on one process, with an optimizer, when nothing fits with the parameters on the
    /// device.
    pub params_in_files: bool,
    /// With more than one micro-batch: how the step couples the samples of a batch,
    /// which makes the split lossy. Either the op that does (a batch-norm-family op in
    /// training mode, as `memsave_sys::ops::sample_coupling_op` names it: each
    /// micro-batch is normalized with its own statistics, so the gradients and the
    /// running statistics differ from the full batch's), or, where no such op runs, how
    /// much a split of a small batch changed the gradients (`y - y.mean(0)`, say; see
    /// the [crate docs](crate) for what is and is not found). `fit` offers such a split
    /// only when [`Allow::micro_batches`](super::Allow::micro_batches) is set. `None`
    /// when nothing coupling was found, or with one micro-batch.
    pub sample_coupling_op: Option<String>,
    /// For a workload of blocks (`Workload::blocks`), or a chain planned layer by
    /// layer (its layers as the blocks `layer i` under `Plan::PerLayer`): the top-level
    /// blocks it recomputes, offloads or compresses, as `recompute enc1#0, dec1#0;
    /// offload bottom#0 (3 of 7 blocks)`; `None` when every block is kept, or for a
    /// chain under the checkpoint solver's [`schedule`](Self::schedule).
    pub blocks: Option<String>,
    #[serde(skip)]
    pub(crate) schedule: Option<Schedule>,
    #[serde(skip)]
    /// Per top-level block: kept, recomputed or offloaded.
    pub(crate) block_levers: Option<Vec<(BlockKey, PlannedLever)>>,
}

impl Choice {
    pub(crate) fn new(global_batch: i64, micro_batches: usize) -> Choice {
        let k = micro_batches.max(1) as i64;
        let mut c = Choice {
            strategy: String::new(),
            data_parallel: None,
            micro_batches: micro_batches.max(1),
            micro_batch: (global_batch + k - 1) / k,
            checkpoint: None,
            offload: false,
            offload_grads: false,
            offload_grads_at_least: None,
            in_backward: false,
            autocast_bf16: false,
            compress_int8: false,
            int8_state: false,
            state_in_files: false,
            params_in_files: false,
            sample_coupling_op: None,
            blocks: None,
            schedule: None,
            block_levers: None,
        };
        c.rename();
        c
    }

    /// The checkpoint schedule the configuration follows, if any.
    pub fn schedule(&self) -> Option<&Schedule> {
        self.schedule.as_ref()
    }

    pub(crate) fn with_schedule(mut self, schedule: Option<Schedule>) -> Choice {
        self.checkpoint = schedule.as_ref().map(|s| s.to_string());
        self.schedule = schedule;
        self.rename();
        self
    }

    /// The levers this choice sets, by key, on a workload of blocks or a chain's
    /// layers (`None`: every block kept, or a chain under its schedule): offloaded blocks write what they save to files
    /// ([`disk_block_lever`](memsave_step::plan::disk_block_lever)), compressed ones
    /// keep it in int8 ([`compress_block_lever`](memsave_step::plan::compress_block_lever),
    /// lossy: only with [`Allow::compress`](crate::Allow::compress)); with
    /// [`offload`](Self::offload), each recomputed block keeps its inputs in files until
    /// its recomputation ([`BlockLever::RecomputeStoringInputs`] with
    /// [`disk_boundary_store`](memsave_step::plan::disk_boundary_store)). The stores
    /// make their directories at the first write.
    pub fn block_levers(&self) -> Option<Vec<(BlockKey, BlockLever)>> {
        let levers = self.block_levers.as_ref()?;
        let recompute = if self.offload {
            BlockLever::RecomputeStoringInputs {
                store: memsave_step::plan::disk_boundary_store(),
            }
        } else {
            BlockLever::Recompute
        };
        let offload = memsave_step::plan::disk_block_lever();
        let compress = memsave_step::plan::compress_block_lever(CompressDtype::Int8);
        Some(
            levers
                .iter()
                .map(|(k, l)| {
                    let lever = match l {
                        PlannedLever::Keep => BlockLever::Keep,
                        PlannedLever::Recompute => recompute.clone(),
                        PlannedLever::Offload => offload.clone(),
                        PlannedLever::Compress => compress.clone(),
                    };
                    (k.clone(), lever)
                })
                .collect(),
        )
    }

    pub(crate) fn with_block_levers(mut self, levers: Vec<(BlockKey, PlannedLever)>) -> Choice {
        let named = |which: PlannedLever| -> Vec<String> {
            levers
                .iter()
                .filter(|(_, l)| *l == which)
                .map(|(k, _)| k.to_string())
                .collect()
        };
        let (recomputed, offloaded, compressed) = (
            named(PlannedLever::Recompute),
            named(PlannedLever::Offload),
            named(PlannedLever::Compress),
        );
        let mut parts = Vec::new();
        if !recomputed.is_empty() {
            let inputs = if self.offload {
                " (their inputs in files)"
            } else {
                ""
            };
            parts.push(format!("recompute {}{inputs}", recomputed.join(", ")));
        }
        if !offloaded.is_empty() {
            parts.push(format!("offload {}", offloaded.join(", ")));
        }
        if !compressed.is_empty() {
            parts.push(format!("compress to int8 {}", compressed.join(", ")));
        }
        self.blocks = (!parts.is_empty()).then(|| {
            format!(
                "{} ({} of {} blocks)",
                parts.join("; "),
                recomputed.len() + offloaded.len() + compressed.len(),
                levers.len()
            )
        });
        self.block_levers = Some(levers);
        self.rename();
        self
    }

    pub(crate) fn with(mut self, f: impl FnOnce(&mut Choice)) -> Choice {
        f(&mut self);
        self.rename();
        self
    }

    /// True when every lever is lossless: gradients bitwise equal to plain training
    /// on the same micro-batches, and the split into micro-batches itself changes
    /// nothing but rounding (false when the step couples the samples of a batch: see
    /// [`sample_coupling_op`](Self::sample_coupling_op)).
    ///
    /// What `fit` checks for the split: a batch-norm-family op in the step, and the
    /// gradients of one step of a small batch split in two against the whole batch's
    /// (relative L2 within 1e-4). Coupling that does not show in the gradients of the
    /// batch it probed (only at larger sizes, or on other examples) is not found, and
    /// a split is then called lossless; a step's random draws (dropout), which a split
    /// draws otherwise, are not counted as a change. Set by hand, a choice knows only
    /// what its `sample_coupling_op` says.
    pub fn is_lossless(&self) -> bool {
        !(self.autocast_bf16
            || self.compress_int8
            || self.int8_state
            || self.lossy_split()
            || self.compresses_blocks())
    }

    /// True when the planner compresses what some block saves
    /// ([`PlannedLever::Compress`]; lossy).
    pub fn compresses_blocks(&self) -> bool {
        self.block_levers
            .iter()
            .flatten()
            .any(|(_, l)| !l.is_lossless())
    }

    /// True when the split into micro-batches changes the step: more than one, and the
    /// step couples the samples of a batch ([`sample_coupling_op`](Self::sample_coupling_op)).
    pub fn lossy_split(&self) -> bool {
        self.micro_batches > 1 && self.sample_coupling_op.is_some()
    }

    fn rename(&mut self) {
        let mut parts = Vec::new();
        if let Some(mode) = self.data_parallel {
            parts.push(mode.name().to_owned());
        }
        if let Some(s) = &self.schedule {
            parts.push(format!("checkpoint({} recomputed)", recomputed(s)));
        }
        if let Some(levers) = &self.block_levers {
            let count = |which| levers.iter().filter(|(_, l)| *l == which).count();
            let (r, o, c) = (
                count(PlannedLever::Recompute),
                count(PlannedLever::Offload),
                count(PlannedLever::Compress),
            );
            match (r, o, c) {
                (0, 0, 0) => {}
                (r, 0, 0) => parts.push(format!(
                    "checkpoint({r} of {} blocks recomputed)",
                    levers.len()
                )),
                (r, o, 0) => parts.push(format!(
                    "blocks(recompute={r},offload={o} of {})",
                    levers.len()
                )),
                (r, o, c) => parts.push(format!(
                    "blocks(recompute={r},offload={o},compress={c} of {})",
                    levers.len()
                )),
            }
        }
        if self.micro_batches > 1 {
            parts.push(format!("accumulate(micro_batches={})", self.micro_batches));
        }
        if self.offload {
            parts.push("offload(to=disk)".to_owned());
        }
        match (self.offload_grads, self.offload_grads_at_least) {
            (true, Some(least)) => parts.push(format!(
                "offload_grads(to=disk, at_least={})",
                memsave_meter::Bytes(least)
            )),
            (true, None) => parts.push("offload_grads(to=disk)".to_owned()),
            (false, _) => {}
        }
        if self.params_in_files {
            parts.push("offload_params(to=disk)".to_owned());
        }
        if self.compress_int8 {
            parts.push("compress(dtype=int8)".to_owned());
        }
        if self.autocast_bf16 {
            parts.push("autocast(dtype=bf16)".to_owned());
        }
        if self.in_backward {
            parts.push("optimizer(in_backward=true)".to_owned());
        }
        if self.int8_state {
            parts.push("optimizer(state=int8)".to_owned());
        }
        if self.state_in_files {
            parts.push("optimizer(placement=disk)".to_owned());
        }
        self.strategy = if parts.is_empty() {
            "baseline".to_owned()
        } else {
            parts.join("+")
        };
    }

    /// The step configuration of this choice, with `optimizer` (the workload's)
    /// changed by the choice's optimizer levers. The checkpoint schedule is not in it:
    /// set [`schedule`](Self::schedule) on the layers (`fit` leaves it set).
    /// Offloaded gradients that no optimizer consumed are put back into `.grad` after
    /// the step.
    pub fn step_config(&self, optimizer: Option<OptimizerSpec>) -> StepConfig {
        let mut config = self.probe_config(optimizer, self.micro_batches);
        if self.offload_grads {
            config.offload_grads = Some(GradsAfter::Restored);
        }
        config
    }

    /// [`step_config`](Self::step_config) for a batch split into `micro_batches` (2
    /// when probing an accumulating choice on a small batch).
    pub(crate) fn probe_config(
        &self,
        optimizer: Option<OptimizerSpec>,
        micro_batches: usize,
    ) -> StepConfig {
        let mut config = StepConfig::baseline();
        // The schedule is set on the layers directly; the plan stays "none" here.
        config.plan = PlanChoice::Fixed(Plan::None);
        config.micro_batches = (micro_batches > 1).then_some(micro_batches);
        if self.autocast_bf16 {
            config.autocast = Some(Kind::BFloat16);
        }
        if self.offload {
            config.saved = Some(SavedTensors::OffloadSynchronous);
        } else if self.compress_int8 {
            config.saved = Some(SavedTensors::Compress(CompressDtype::Int8));
        }
        config.offload_grads = self.offload_grads.then_some(GradsAfter::Dropped);
        config.offload_grads_at_least = self.offload_grads_at_least.filter(|_| self.offload_grads);
        config.offload_params = self.params_in_files.then_some(ParamsOffload::Disk);
        config.optimizer = optimizer.map(|mut o| {
            o.in_backward = self.in_backward;
            if self.int8_state {
                o.state = StatePrecision::Int8;
            }
            if self.state_in_files {
                o.placement = StatePlacement::Disk;
            }
            o
        });
        config
    }
}

/// Layer forwards recomputed per step by `s`.
pub(crate) fn recomputed(s: &Schedule) -> usize {
    let layers: usize = s
        .blocks()
        .iter()
        .map(|b| match b {
            Block::Layer(_) => 1,
            Block::Checkpoint { start, end, .. } => end - start,
        })
        .sum();
    s.forward_count().saturating_sub(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_choice_that_compresses_a_block_is_lossy_and_says_so() {
        let keys = [BlockKey::new("enc", 0), BlockKey::new("dec", 0)];
        let choice = Choice::new(8, 1).with_block_levers(vec![
            (keys[0].clone(), PlannedLever::Keep),
            (keys[1].clone(), PlannedLever::Compress),
        ]);
        assert!(choice.compresses_blocks());
        assert!(!choice.is_lossless());
        assert_eq!(
            choice.blocks.as_deref(),
            Some("compress to int8 dec#0 (1 of 2 blocks)")
        );
        assert!(
            choice.strategy.contains("compress=1 of 2"),
            "{}",
            choice.strategy
        );
        let levers = choice.block_levers().unwrap();
        assert!(matches!(levers[0].1, BlockLever::Keep));
        match &levers[1].1 {
            BlockLever::Store { name, lossless, .. } => {
                assert_eq!((name.as_str(), *lossless), ("compress to int8", false))
            }
            other => panic!("{}", other.name()),
        }
        // Kept, recomputed and offloaded blocks are lossless.
        let lossless = Choice::new(8, 1).with_block_levers(vec![
            (keys[0].clone(), PlannedLever::Recompute),
            (keys[1].clone(), PlannedLever::Offload),
        ]);
        assert!(lossless.is_lossless() && !lossless.compresses_blocks());
    }
}
