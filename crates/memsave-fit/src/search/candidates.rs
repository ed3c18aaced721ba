//! What the search considers: the lever sets (a first pass without the gradients in
//! files, a second with), the splits of the global batch into micro-batches, and the
//! small sizes each configuration is probed at. Recompute schedules are the solver's,
//! found per split while predicting (`Runs::recompute`).
use crate::choice::Choice;
use crate::{FitRequest, ParallelMode};
use memsave_step::OptimizerSpec;

/// A set of levers besides micro-batching and recompute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(super) struct Levers {
    /// On ranks, the data-parallel mode.
    pub(super) mode: Option<ParallelMode>,
    pub(super) offload: bool,
    pub(super) offload_grads: bool,
    pub(super) in_backward: bool,
    pub(super) bf16: bool,
    pub(super) compress: bool,
    pub(super) int8_state: bool,
    /// The optimizer's state in files between steps.
    pub(super) state_in_files: bool,
    /// The parameters in files between their uses.
    pub(super) params_in_files: bool,
}

impl Levers {
    /// `choice` with these levers.
    pub(super) fn apply(&self, choice: Choice) -> Choice {
        choice.with(|c| {
            c.data_parallel = self.mode;
            c.offload = self.offload;
            c.offload_grads = self.offload_grads;
            c.in_backward = self.in_backward;
            c.autocast_bf16 = self.bf16;
            c.compress_int8 = self.compress;
            c.int8_state = self.int8_state;
            c.state_in_files = self.state_in_files;
            c.params_in_files = self.params_in_files;
        })
    }

    /// Cheap to probe: neither offload nor compression, whose small runs are slow. The
    /// search probes these first, and the slow ones last, where their cost over the
    /// plain step cannot beat what already fits.
    pub(super) fn is_cheap(&self) -> bool {
        !self.offload && !self.compress
    }

    /// Whether a step of several micro-batches can accumulate under these levers: the
    /// step in backward frees each gradient as soon as it is complete, which
    /// accumulation needs kept, unless it waits in a file (gradients in files; with the
    /// parameters in files, each unit's gradients in a file of its own until the last
    /// micro-batch).
    pub(super) fn accumulates(&self) -> bool {
        !self.in_backward || self.offload_grads || self.params_in_files
    }
}

/// The lever sets to consider: plain and offload, each also with the optimizer step in
/// backward when there is an optimizer; then the allowed lossy ones.
pub(super) fn lever_sets(request: &FitRequest, has_optimizer: bool) -> Vec<Levers> {
    let mut sets = Vec::new();
    let mut push = |l: Levers| {
        sets.push(l);
        if has_optimizer {
            sets.push(Levers {
                in_backward: true,
                ..l
            });
        }
    };
    push(Levers::default());
    push(Levers {
        offload: true,
        ..Levers::default()
    });
    let allow = request.allow;
    if allow.bf16 {
        push(Levers {
            bf16: true,
            ..Levers::default()
        });
    }
    if allow.compress {
        push(Levers {
            compress: true,
            ..Levers::default()
        });
    }
    if allow.int8_state && has_optimizer {
        sets.push(Levers {
            int8_state: true,
            ..Levers::default()
        });
        sets.push(Levers {
            int8_state: true,
            in_backward: true,
            ..Levers::default()
        });
    }
    sets
}

/// The lever sets with the gradients in files (see [`lever_sets`]); with an
/// optimizer only with its step in backward (stepping after backward needs every
/// gradient back in memory at once).
pub(super) fn grad_lever_sets(request: &FitRequest, has_optimizer: bool) -> Vec<Levers> {
    let mut sets: Vec<Levers> = Vec::new();
    for l in lever_sets(request, has_optimizer) {
        let l = Levers {
            offload_grads: true,
            ..l
        };
        if (l.in_backward || !has_optimizer) && !sets.contains(&l) {
            sets.push(l);
        }
    }
    sets
}

/// The lever sets with the optimizer's state in files between steps: those of the two
/// passes before, each with it, for an optimizer that keeps state (AdamW; SGD with
/// momentum) on one process (on ranks, ZeRO shards the state instead). Considered only
/// when nothing fits with the state on the device: every update then reads and writes
/// its parameter's state.
pub(super) fn state_lever_sets(
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
    on_ranks: bool,
) -> Vec<Levers> {
    // An optimizer placed off the device already keeps it there in every pass.
    let keeps_state = optimizer.as_ref().is_some_and(keeps_state);
    if on_ranks || !keeps_state {
        return Vec::new();
    }
    let mut sets: Vec<Levers> = Vec::new();
    for l in lever_sets(request, true)
        .into_iter()
        .chain(grad_lever_sets(request, true))
    {
        let l = Levers {
            state_in_files: true,
            ..l
        };
        if !sets.contains(&l) {
            sets.push(l);
        }
    }
    sets
}

/// The lever sets with the parameters in files between their uses, on one process with
/// an optimizer (it steps each unit in backward, so `in_backward`; with micro-batches
/// each unit's gradients wait in a file): plain and with the saved activations
/// offloaded, each with the
/// optimizer's state on the device and, for an optimizer that keeps state, in files.
/// Considered only when nothing fits with the parameters on the device: every unit's
/// weights are read from its file for its forward and its backward, and written when
/// it steps. None where they may not leave the device (`kept`: on ranks, off the CPU,
/// or the request keeps them; see `param_units`).
pub(super) fn params_lever_sets(optimizer: Option<OptimizerSpec>, kept: bool) -> Vec<Levers> {
    let Some(spec) = optimizer else {
        return Vec::new();
    };
    if kept {
        return Vec::new();
    }
    let keeps_state = keeps_state(&spec);
    let mut sets = Vec::new();
    for offload in [false, true] {
        for state_in_files in [false, true] {
            if state_in_files && !keeps_state {
                continue;
            }
            sets.push(Levers {
                offload,
                in_backward: true,
                state_in_files,
                params_in_files: true,
                ..Levers::default()
            });
        }
    }
    sets
}

/// Whether `spec` keeps state on the device that files could take (AdamW; SGD with
/// momentum; not an optimizer placed off the device already).
fn keeps_state(spec: &OptimizerSpec) -> bool {
    spec.placement == memsave_step::levers::StatePlacement::Device
        && match spec.kind {
            memsave_step::levers::OptimizerKind::Adamw => true,
            memsave_step::levers::OptimizerKind::Sgd => spec.momentum.is_some_and(|m| m != 0.0),
        }
}

/// Each of `sets` in each of `modes` (`sets` as they are when `modes` is empty: one
/// process), split into those the modes run and those a mode refuses (with its
/// reason: `unfit`'s for a mode that cannot run the workload at all, else
/// `DataParallel::check`'s, from the configuration alone).
pub(super) fn in_modes(
    sets: Vec<Levers>,
    modes: &[ParallelMode],
    optimizer: Option<OptimizerSpec>,
    unfit: &dyn Fn(ParallelMode) -> Option<String>,
) -> (Vec<Levers>, Vec<(Levers, String)>) {
    if modes.is_empty() {
        return (sets, Vec::new());
    }
    let mut run = Vec::new();
    let mut refused = Vec::new();
    for levers in sets {
        for &mode in modes {
            let l = Levers {
                mode: Some(mode),
                ..levers
            };
            let config = l.apply(Choice::new(1, 1)).probe_config(optimizer, 1);
            match unfit(mode).or_else(|| mode.refuses(&config)) {
                Some(why) => refused.push((l, why)),
                None => run.push(l),
            }
        }
    }
    (run, refused)
}

/// Micro-batch counts giving distinct largest micro-batches, fewest first.
pub(super) fn splits(global: i64) -> Vec<usize> {
    let mut out = Vec::new();
    let mut last = None;
    for k in 1..=global {
        let m = div_ceil(global, k);
        if last != Some(m) {
            // The fewest micro-batches with this largest size.
            out.push(div_ceil(global, m) as usize);
            last = Some(m);
        }
    }
    out.dedup();
    out
}

/// `a / b` rounded up (`b` at least 1).
pub(super) fn div_ceil(a: i64, b: i64) -> i64 {
    (a + b - 1) / b.max(1)
}

/// The sizes of `k` micro-batches of `global` examples, as even as possible.
pub(super) fn split_sizes(global: i64, k: usize) -> Vec<i64> {
    let k = k.max(1) as i64;
    (0..k)
        .map(|i| global / k + i64::from(i < global % k))
        .collect()
}

/// Two probe sizes below `largest`: about `largest / fraction` and twice that.
/// Small probes are cheap and, when their allocations line up event for event, exact
/// (see `Affine`); offloading ones do not line up (the writer thread's pace decides
/// when memory is freed), so they are probed closer to the real size.
pub(super) fn probe_sizes_of(largest: i64, fraction: i64) -> (i64, i64) {
    let s2 = div_ceil(largest, fraction / 2).max(1);
    let s1 = div_ceil(s2, 2).max(1);
    if s1 == s2 && s2 < largest {
        (s1, s2 + 1)
    } else {
        (s1, s2)
    }
}

/// [`probe_sizes_of`] for `choice`.
pub(super) fn probe_sizes_for(choice: &Choice, largest: i64) -> (i64, i64) {
    probe_sizes_of(largest, if choice.offload { 4 } else { 8 })
}

/// The levers of `c` as a key: configurations with the same levers share it (an
/// affine model, a family in the race).
pub(super) fn lever_key(c: &Choice) -> String {
    format!(
        "{}{}{}{}{}{}{}{}{}{}",
        c.data_parallel.map_or("", ParallelMode::name),
        u8::from(c.offload),
        u8::from(c.offload_grads),
        c.offload_grads_at_least
            .map_or(String::new(), |b| format!("<{b}")),
        u8::from(c.in_backward),
        u8::from(c.autocast_bf16),
        u8::from(c.compress_int8),
        u8::from(c.int8_state),
        u8::from(c.state_in_files),
        u8::from(c.params_in_files)
    )
}

/// The configuration `c` is one split of: its levers and recompute schedule.
pub(super) fn family(c: &Choice) -> (String, Option<String>) {
    (
        lever_key(c),
        c.checkpoint.clone().or_else(|| c.blocks.clone()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use memsave_step::levers::{OptimizerKind, StatePlacement};

    /// The state in files: every set of the two passes before with it, for an optimizer
    /// with state on one process; none on ranks, without state, or already off the
    /// device.
    #[test]
    fn the_state_in_files_comes_for_optimizers_that_keep_state_on_one_process() {
        let request = FitRequest::new(1 << 20);
        let adamw = OptimizerSpec::default();
        let sets = state_lever_sets(&request, Some(adamw), false);
        let before = lever_sets(&request, true).len() + grad_lever_sets(&request, true).len();
        assert_eq!(sets.len(), before, "{sets:?}");
        assert!(sets.iter().all(|l| l.state_in_files));
        assert!(state_lever_sets(&request, Some(adamw), true).is_empty());
        assert!(state_lever_sets(&request, None, false).is_empty());
        let sgd = |momentum| OptimizerSpec {
            kind: OptimizerKind::Sgd,
            momentum,
            ..OptimizerSpec::default()
        };
        assert!(state_lever_sets(&request, Some(sgd(None)), false).is_empty());
        assert!(!state_lever_sets(&request, Some(sgd(Some(0.9))), false).is_empty());
        let on_disk = OptimizerSpec {
            placement: StatePlacement::Disk,
            ..adamw
        };
        assert!(state_lever_sets(&request, Some(on_disk), false).is_empty());
    }

    /// The parameters in files: with an optimizer on one process, always stepped in
    /// backward, with and without offloaded activations, the state on the device and
    /// (for an optimizer that keeps state) in files; none without an optimizer, on
    /// ranks, or when the request keeps them on the device.
    #[test]
    fn the_parameters_in_files_come_with_an_optimizer_on_one_process() {
        let adamw = OptimizerSpec::default();
        let sets = params_lever_sets(Some(adamw), false);
        assert_eq!(sets.len(), 4, "{sets:?}");
        assert!(sets.iter().all(|l| l.params_in_files && l.in_backward));
        assert_eq!(sets.iter().filter(|l| l.state_in_files).count(), 2);
        assert_eq!(sets.iter().filter(|l| l.offload).count(), 2);
        assert!(params_lever_sets(Some(adamw), true).is_empty());
        assert!(params_lever_sets(None, false).is_empty());
        let sgd = OptimizerSpec {
            kind: OptimizerKind::Sgd,
            ..OptimizerSpec::default()
        };
        let sets = params_lever_sets(Some(sgd), false);
        assert_eq!(sets.len(), 2, "no state to keep in files: {sets:?}");
        assert!(sets.iter().all(|l| !l.state_in_files));
        let choice = sets[0].apply(Choice::new(8, 1));
        assert!(choice.params_in_files && choice.is_lossless());
        assert_eq!(
            choice.strategy,
            "offload_params(to=disk)+optimizer(in_backward=true)"
        );
        let config = choice.step_config(Some(sgd));
        assert_eq!(
            config.offload_params,
            Some(memsave_step::ParamsOffload::Disk)
        );
    }

    #[test]
    fn gradients_in_files_come_with_the_step_in_backward_when_there_is_an_optimizer() {
        let request = FitRequest::new(1 << 20);
        let without = grad_lever_sets(&request, false);
        assert_eq!(without.len(), 2, "{without:?}");
        assert!(without.iter().all(|l| l.offload_grads && !l.in_backward));
        assert_eq!(without.iter().filter(|l| l.offload).count(), 1);
        let with = grad_lever_sets(&request, true);
        assert_eq!(with.len(), 2, "{with:?}");
        assert!(with.iter().all(|l| l.offload_grads && l.in_backward));
        // The first pass never keeps gradients in files.
        assert!(lever_sets(&request, true).iter().all(|l| !l.offload_grads));
    }
}
