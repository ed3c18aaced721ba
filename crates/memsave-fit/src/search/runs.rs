//! The search's runs of the workload: each candidate predicted from small runs (an
//! affine model of peak and time in the micro-batch size, per lever set and schedule,
//! from runs at two small sizes, cached), the recompute schedules the solver finds for
//! a split, and real-size runs. Every run's peak is checked against the budget, never
//! enforced (see `crate::probe::probe`). On ranks, every prediction and profile is
//! agreed over them (the largest) before the search uses it (see `crate::lockstep`).
use super::candidates::{div_ceil, lever_key, probe_sizes_for, probe_sizes_of, split_sizes};
use super::tuning::{PROBE_RUNS, REAL_RUNS};
use crate::choice::Choice;
use crate::lockstep::Ranks;
use crate::predict::{profile_at, Affine};
use crate::probe::{probe, Probe, ProbeError};
use crate::{Candidate, FitError, FitEvent};
use memsave_checkpoint::{
    predict, BlocksProfile, ChainProfile, LayerProfile, PlannedLever, ProfileOptions, Schedule,
    Solver,
};
use memsave_meter::Bytes;
use memsave_step::plan::{
    compress_block_lever, disk_block_lever, f_profile, f_profile_blocks_with,
};
use memsave_step::workload::Workload;
use memsave_step::{CompressDtype, OptimizerSpec};
use std::collections::HashMap;

type AffineKey = (String, bool);

/// The workload, the budget, and what running it has taught so far: the affine models,
/// the layer profiles and the small runs, each made once.
pub(super) struct Runs<'w> {
    pub(super) workload: &'w mut dyn Workload,
    /// The optimizer every run steps (the request's, else the workload's).
    pub(super) optimizer: Option<OptimizerSpec>,
    budget: u64,
    /// The request's margin (see [`Runs::target`]).
    margin: f64,
    pub(super) global: i64,
    affines: HashMap<AffineKey, Option<Affine>>,
    profiles: Option<(ChainProfile, i64, ChainProfile, i64)>,
    /// The blocks' profiles at two sizes, once per way of handling the gradients (with
    /// them kept, and with each freed as it is complete: see [`Runs::block_profile`];
    /// `Some(None)`: none could be made).
    #[allow(clippy::type_complexity)]
    block_profiles: [Option<Option<(BlocksProfile, i64, BlocksProfile, i64)>>; 2],
    /// Small runs that did not fit the budget (retried at half the size).
    pub(super) small_over: usize,
    /// Small runs made so far, by configuration, size and micro-batch count.
    probes: HashMap<(String, i64, usize), Option<Probe>>,
    /// Told what the search is doing ([`fit_with`](crate::fit_with)).
    pub(super) progress: &'w mut dyn FnMut(&FitEvent),
    /// Micro-batches change this step (it couples the samples of a batch).
    pub(super) lossy_split: bool,
    /// The ranks every run runs on.
    pub(super) ranks: Ranks,
    /// The blocks' profiles measure compression too, so that the planner may
    /// compress a block's saves (lossy: only when allowed).
    pub(super) compress_blocks: bool,
    /// Each block's lever chosen on its own ([`FitRequest::per_block`](crate::FitRequest::per_block)).
    pub(super) per_block: bool,
    /// The units (name, bytes) the parameters would wait in files as, where they may
    /// (see `param_units`): `None` keeps them on the device.
    pub(super) param_units: Option<Vec<(String, u64)>>,
}

impl<'w> Runs<'w> {
    /// Runs of `workload` stepping `optimizer` on `ranks` for a step of `global`
    /// examples (on ranks, each rank's share) whose peak must be within `budget` bytes,
    /// predicted within the budget less the `margin` (see [`Runs::target`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        workload: &'w mut dyn Workload,
        optimizer: Option<OptimizerSpec>,
        budget: u64,
        margin: f64,
        global: i64,
        progress: &'w mut dyn FnMut(&FitEvent),
        ranks: Ranks,
    ) -> Self {
        Runs {
            workload,
            optimizer,
            budget,
            margin,
            global,
            affines: HashMap::new(),
            profiles: None,
            block_profiles: [None, None],
            small_over: 0,
            probes: HashMap::new(),
            progress,
            lossy_split: false,
            ranks,
            compress_blocks: false,
            per_block: true,
            param_units: None,
        }
    }
}

impl Runs<'_> {
    /// The affine model of `choice` (its levers and schedule) with accumulation or
    /// not, from two probes below `largest`; `None` when even one example per
    /// micro-batch does not fit the budget.
    fn affine(
        &mut self,
        choice: &Choice,
        accumulate: bool,
        largest: i64,
        later: i64,
    ) -> Result<Option<Affine>, FitError> {
        // An offloading configuration with accumulation is run at its own micro-batch
        // sizes, the first and a later one (a step of two micro-batches is cheaper than
        // the whole step, and what follows the second adds nothing): what its store
        // keeps does not line up from size to size to be extrapolated.
        let at_size = choice.offload && accumulate;
        let key = (
            format!(
                "{}|{:?}|{:?}|{}",
                lever_key(choice),
                choice.checkpoint,
                choice.blocks,
                if at_size {
                    format!("{largest}+{later}")
                } else {
                    String::new()
                }
            ),
            accumulate,
        );
        if let Some(a) = self.affines.get(&key) {
            return Ok(a.clone());
        }
        let n = if accumulate { 2 } else { 1 };
        if at_size {
            if let Some(p) = self.run_small(choice, largest + later, 2)? {
                let runs = (largest + later) as f64 / largest as f64;
                let a = Some(Affine::fit(largest, &p, largest, &p, runs));
                self.affines.insert(key, a.clone());
                return Ok(a);
            }
        }
        let (mut s1, mut s2) = if at_size {
            (div_ceil(largest, 2).min((largest - 1).max(1)), largest)
        } else {
            probe_sizes_for(choice, largest)
        };
        // The smallest micro-batch known not to fit the budget.
        let mut fails_from = None;
        // A probe already run at the size `s1` now names.
        let mut carried: Option<(i64, Probe)> = None;
        let affine = loop {
            let p2 = match self.run_small(choice, s2 * n as i64, n)? {
                Some(p) => p,
                None if s2 == 1 => break None,
                None => {
                    // Too big already: everything from here on does not fit; halve.
                    fails_from = Some(s2);
                    let next = (s2 / 2).max(1);
                    (s1, s2) = (div_ceil(next, 2).min(next), next);
                    if s1 == s2 && s2 > 1 {
                        s1 = s2 - 1;
                    }
                    continue;
                }
            };
            let p1 = if s1 == s2 {
                p2.clone()
            } else if let Some((_, p)) = carried.take().filter(|(size, _)| *size == s1) {
                p
            } else {
                match self.run_small(choice, s1 * n as i64, n)? {
                    Some(p) => p,
                    // Smaller but not fitting: memory does not grow with the batch here.
                    None => break None,
                }
            };
            let affine = Affine::fit(s1, &p1, s2, &p2, n as f64).failing_from(fails_from);
            let recorded = p1.series.is_some() && p2.series.is_some();
            let step_up =
                recorded && !affine.is_exact() && s1 < s2 && s2 < largest && fails_from.is_none();
            // Each rank's allocations line up or not on their own: step up when any
            // rank's do not.
            if self.ranks.any(step_up)? {
                // The two runs (both recorded: on the CPU, with no other recording on)
                // did not make the same allocations in the same order
                // (libtorch picks kernels, and their scratch buffers, by size: a few
                // bytes more at one size), so the peak could only be extrapolated
                // along a line, which a peak that moves from the end of backward to
                // its start as the batch grows overshoots downwards. Step up towards
                // the real size, where the runs line up or the real size is measured.
                carried = Some((s2, p2));
                (s1, s2) = (s2, (s2 * 2).min(largest));
                continue;
            }
            break Some(affine);
        };
        self.affines.insert(key, affine.clone());
        Ok(affine)
    }

    /// One small probe, its peak checked against the budget: `None` when it did not fit.
    fn run_small(
        &mut self,
        choice: &Choice,
        batch: i64,
        n: usize,
    ) -> Result<Option<Probe>, FitError> {
        // The same configuration at the same size is run once (accumulation with
        // offload is probed at each split's own size, and those repeat).
        let key = (
            format!(
                "{}|{:?}|{:?}",
                lever_key(choice),
                choice.checkpoint,
                choice.blocks
            ),
            batch,
            n,
        );
        if let Some(known) = self.probes.get(&key) {
            return Ok(known.clone());
        }
        let outcome = match probe(
            self.workload,
            self.optimizer,
            choice,
            batch,
            n,
            PROBE_RUNS,
            Some(self.budget),
            true,
            false,
            &self.ranks,
        ) {
            Ok(p) => Some(p),
            Err(ProbeError::OutOfMemory(_)) => {
                self.small_over += 1;
                None
            }
            // Small runs do not check the statistics: nothing is unusable here.
            Err(ProbeError::Failed(e) | ProbeError::Unusable(e)) => return Err(FitError::Step(e)),
            Err(ProbeError::Fatal(e)) => return Err(e),
        };
        self.probes.insert(key, outcome.clone());
        Ok(outcome)
    }

    /// `choice` run at its real size, the global batch, its peak checked against the
    /// budget (a confirmation, a runner-up, an exhaustive measurement).
    pub(super) fn run_real(&mut self, choice: &Choice) -> Result<Probe, ProbeError> {
        self.run_real_times(choice, REAL_RUNS)
    }

    /// `run_real` with `runs` steps (the fastest gives the time).
    pub(super) fn run_real_times(
        &mut self,
        choice: &Choice,
        runs: usize,
    ) -> Result<Probe, ProbeError> {
        probe(
            self.workload,
            self.optimizer,
            choice,
            self.global,
            choice.micro_batches,
            runs,
            Some(self.budget),
            false,
            true,
            &self.ranks,
        )
    }

    /// The candidate `choice` with `k` micro-batches of at most `m` examples.
    pub(super) fn evaluate(
        &mut self,
        choice: &Choice,
        m: i64,
        k: usize,
        largest: Option<i64>,
    ) -> Result<Candidate, FitError> {
        (self.progress)(&FitEvent::Probing {
            strategy: choice.strategy.clone(),
            micro_batches: k,
            micro_batch: m,
        });
        // A mode that refuses this split (each lever set was checked with one
        // micro-batch) is not run: on ranks, a refused step would end the fit.
        let refused = choice
            .data_parallel
            .and_then(|mode| mode.refuses(&choice.probe_config(self.optimizer, k)));
        if let Some(why) = refused {
            let mut c = Candidate::unmeasured(choice.clone());
            c.note = Some(why);
            return Ok(c);
        }
        let accumulate = k > 1;
        let largest = largest.unwrap_or(if accumulate && !choice.offload {
            div_ceil(self.global, 2)
        } else if accumulate {
            m
        } else {
            self.global
        });
        let later = split_sizes(self.global, k).get(1).copied().unwrap_or(m);
        let affine = self.affine(choice, accumulate, largest, later)?;
        let sizes = split_sizes(self.global, k);
        let mut c = Candidate::unmeasured(choice.clone());
        let Some(a) = affine else {
            c.note = Some(format!(
                "a micro-batch of one example does not fit {}",
                Bytes(self.budget)
            ));
            return Ok(c);
        };
        let over = a.known_over(m);
        let peak = match (over, k > 1) {
            (true, _) => None,
            (false, true) => a.peak_split(m, sizes.get(1).copied().unwrap_or(m)),
            (false, false) => a.peak(m),
        };
        // Each rank predicts from its own runs' allocations: the largest counts (and
        // the least kept, which the margin spares).
        let agreed = self.ranks.max(&[
            peak.map_or(-1.0, |p| p as f64),
            a.time(&sizes),
            -(a.kept() as f64),
        ])?;
        let peak = (agreed[0] >= 0.0).then_some(agreed[0] as u64);
        c.predicted_peak_bytes = peak;
        c.predicted_step_time_s = Some(agreed[1]);
        c.kept_bytes = (-agreed[2]).max(0.0) as u64;
        c.predicted_fits = peak.is_some_and(|p| p <= self.target(c.kept_bytes));
        c.note = if over {
            Some(format!(
                "over {}: a smaller micro-batch already was",
                Bytes(self.budget)
            ))
        } else {
            peak.is_none().then(|| {
                format!(
                    "only micro-batches of one example were measured within {}",
                    Bytes(self.budget)
                )
            })
        };
        Ok(c)
    }

    /// The most a configuration that keeps `kept` bytes from step to step (the
    /// parameters and the optimizer's state, measured) may be predicted to peak at: the
    /// budget less the margin of the rest, which is what predictions can miss.
    pub(super) fn target(&self, kept: u64) -> u64 {
        let room = self.budget.saturating_sub(kept);
        self.budget - (room as f64 * self.margin).ceil() as u64
    }

    /// The layer profile at micro-batch `m`, from two measured profiles.
    pub(super) fn profile(&mut self, m: i64) -> Result<ChainProfile, FitError> {
        if self.profiles.is_none() {
            let (a, b) = probe_sizes_of(div_ceil(self.global, 2), 8);
            (self.progress)(&FitEvent::Profiling { sizes: (a, b) });
            let mut at = |size: i64| -> Result<ChainProfile, FitError> {
                let x = self
                    .workload
                    .batch(size)
                    .map_err(|e| FitError::Step(e.to_string()))?;
                f_profile(self.workload, &x).map_err(|e| FitError::Step(e.to_string()))
            };
            let pa = at(a)?;
            let pb = if a == b { pa.clone() } else { at(b)? };
            let pa = agree_profile(&self.ranks, pa)?;
            let pb = agree_profile(&self.ranks, pb)?;
            self.profiles = Some((pa, a, pb, b));
        }
        let (pa, a, pb, b) = self.profiles.as_ref().expect("profiled above");
        Ok(profile_at(pa, *a, pb, *b, m))
    }

    /// The recompute candidate of `base` at `k` micro-batches of at most `m`: the
    /// solver's schedule with the least recomputation whose real peak is predicted
    /// within the target, adjusted until the prediction from real runs agrees.
    ///
    /// On a chain, with levers chosen per block, a second candidate: the chain's layers
    /// as blocks (`Plan::PerLayer`), each kept, recomputed or offloaded on its own by
    /// the blocks planner, as any model of blocks (on one process, with the parameters
    /// on the device: ZeRO-3's units wrap a chain's layers, not its blocks).
    pub(super) fn recompute(
        &mut self,
        base: &Choice,
        m: i64,
        k: usize,
    ) -> Result<Vec<Candidate>, FitError> {
        if self.workload.blocks().is_some() {
            return Ok(self.recompute_blocks(base, m, k)?.into_iter().collect());
        }
        let mut candidates: Vec<Candidate> =
            self.recompute_chain(base, m, k)?.into_iter().collect();
        let per_layer = self.per_block
            && self.ranks.world_size() == 1
            && base.data_parallel.is_none()
            && !base.params_in_files
            && self.workload.layers().len() > 1;
        if per_layer {
            candidates.extend(self.recompute_blocks(base, m, k)?);
        }
        Ok(candidates)
    }

    /// [`recompute`](Self::recompute)'s chain candidate: the checkpoint solver's.
    fn recompute_chain(
        &mut self,
        base: &Choice,
        m: i64,
        k: usize,
    ) -> Result<Option<Candidate>, FitError> {
        let mut profile = self.profile(m)?;
        if base.offload_grads || base.params_in_files {
            // The gradients do not stay (in files, or each unit's stepped and freed as
            // it lands): the solver's model must not keep them.
            for e in &mut profile.elements {
                e.param_grad_bytes = 0;
            }
        }
        let layers = self.workload.layers().len();
        let plain = Schedule::plain(layers);
        let model_plain = predict(&profile, &plain).peak_bytes;
        // What the real step adds to the solver's model (accumulated gradients,
        // optimizer state...), taken from the plain configuration's prediction.
        let uniform = self.evaluate(base, m, k, None)?;
        let extra = match uniform.predicted_peak_bytes {
            Some(real) => real.saturating_sub(model_plain),
            None => 0,
        };
        let target = self.target(uniform.kept_bytes);
        let mut solver_budget = target.saturating_sub(extra);
        let mut last = None;
        for _ in 0..3 {
            let schedule = match Solver::new(&profile).solve_budget(solver_budget) {
                Ok(s) => s,
                Err(_) => break,
            };
            if schedule == plain {
                solver_budget = model_plain.saturating_sub(1);
                continue;
            }
            let choice = base.clone().with_schedule(Some(schedule));
            let candidate = self.evaluate(&choice, m, k, Some(m))?;
            let fits = candidate.predicted_fits;
            let over = candidate
                .predicted_peak_bytes
                .map(|p| p.saturating_sub(target));
            last = Some(candidate);
            match over {
                _ if fits => break,
                Some(over) => solver_budget = solver_budget.saturating_sub(over + 1),
                None => break,
            }
        }
        if last.is_none() {
            // No schedule within the target: the one with the least memory, for the
            // record (and for the smallest feasible budget).
            if let Ok(schedule) = Solver::new(&profile).f_min_memory() {
                if schedule != plain {
                    let choice = base.clone().with_schedule(Some(schedule));
                    last = Some(self.evaluate(&choice, m, k, Some(m))?);
                }
            }
        }
        Ok(last)
    }
}

impl Runs<'_> {
    /// The blocks' profile at micro-batch `m`, from two measured profiles (see
    /// `BlocksProfile::interpolate`; on ranks, each figure the largest over them);
    /// `None` when the two do not line up, or not on every rank. With
    /// `free_gradients`, profiled with each gradient
    /// freed as soon as backward completes it: the step of a base whose gradients go
    /// to files or into the optimizer step holds none of them, and a profile that
    /// holds them all puts the peak where no block's lever moves it.
    fn block_profile(
        &mut self,
        m: i64,
        free_gradients: bool,
    ) -> Result<Option<BlocksProfile>, FitError> {
        let slot = usize::from(free_gradients);
        if self.block_profiles[slot].is_none() {
            // At half and the whole batch: a block's bytes are affine in the batch
            // from a few examples on, not from one (kernels pick their workspace by
            // size), and the whole batch is what most splits run. The plain step runs
            // there: where it fails (out of memory on a device), halve both sizes.
            let mut b = self.global;
            // Without the compressing step if it fails: a lossy lever allowed must not
            // take the lossless ones' plans away.
            let mut compress = self.compress_blocks;
            let profiles = loop {
                let a = div_ceil(b, 2);
                (self.progress)(&FitEvent::Profiling { sizes: (a, b) });
                let mut options = ProfileOptions::default()
                    .with_offload(disk_block_lever())
                    .with_free_gradients(free_gradients);
                if compress {
                    options = options.with_compress(compress_block_lever(CompressDtype::Int8));
                }
                if self.workload.blocks().is_none() {
                    // A chain: its layers are profiled as blocks.
                    self.workload
                        .layers_mut()
                        .set_plan(memsave_checkpoint::Plan::PerLayer)
                        .map_err(|e| FitError::Step(e.to_string()))?;
                }
                let at = |size: i64| -> Result<BlocksProfile, memsave_step::StepError> {
                    f_profile_blocks_with(&*self.workload, &self.workload.batch(size)?, &options)
                };
                let both = at(a).and_then(|pa| {
                    let pb = if a == b { pa.clone() } else { at(b)? };
                    Ok((pa, pb))
                });
                // Ranks go on together: halving where any rank failed.
                let failed = self.ranks.any(both.is_err())?;
                match both {
                    Ok((pa, pb)) if !failed => break Some((pa, a, pb, b)),
                    _ if compress => compress = false,
                    _ if b > 1 => b = a,
                    _ => break None,
                }
            };
            let profiles = match profiles {
                Some((pa, a, pb, b)) => {
                    match (
                        agree_blocks(&self.ranks, pa)?,
                        agree_blocks(&self.ranks, pb)?,
                    ) {
                        (Some(pa), Some(pb)) => Some((pa, a, pb, b)),
                        _ => None,
                    }
                }
                None => None,
            };
            self.block_profiles[slot] = Some(profiles);
        }
        let Some((pa, a, pb, b)) = self.block_profiles[slot].as_ref().expect("profiled above")
        else {
            return Ok(None);
        };
        Ok(BlocksProfile::interpolate(pa, *a, pb, *b, m))
    }

    /// [`recompute`](Self::recompute) for a workload of blocks: the blocks planner's
    /// assignment with the least recomputed forward time whose real peak is predicted
    /// within the target, adjusted until the prediction from real runs agrees.
    fn recompute_blocks(
        &mut self,
        base: &Choice,
        m: i64,
        k: usize,
    ) -> Result<Option<Candidate>, FitError> {
        let Some(profile) = self.block_profile(m, base.offload_grads || base.in_backward)? else {
            return Ok(None);
        };
        let n = profile.keys().len();
        let model_plain = profile.predict(&vec![false; n]).max(0);
        // What the real step adds to the planner's model (gradients accumulated over
        // micro-batches, the optimizer's scratch...), or takes from it, from the plain
        // configuration's prediction; none known when one example of it does not fit.
        let plain = self.evaluate(base, m, k, None)?;
        let extra = match plain.predicted_peak_bytes {
            Some(real) => i64::try_from(real).unwrap_or(i64::MAX) - model_plain,
            None => 0,
        };
        let target = self.target(plain.kept_bytes);
        // Under the offload lever every kept block's saves go to files already: the
        // others are recomputed (their inputs in files too); otherwise each block is
        // kept, recomputed or offloaded, whichever costs least.
        // Under ZeRO-3 (and with the parameters in files, ZeRO-3 on one process) a
        // block's saves cannot go to a store (it would keep the gathered weights):
        // kept or recomputed only, as under the offload lever.
        let zero3 = base.data_parallel == Some(crate::ParallelMode::Zero3) || base.params_in_files;
        let per_block = self.per_block;
        let solve = |budget: u64| -> Option<Vec<PlannedLever>> {
            if !per_block {
                // Every block alike: the fastest uniform lever predicted within.
                let mut levers = vec![PlannedLever::Recompute];
                if !(base.offload || zero3) && profile.offload_seconds().is_some() {
                    levers.push(PlannedLever::Offload);
                }
                if !(base.offload || zero3) && profile.measured_compression() {
                    levers.push(PlannedLever::Compress);
                }
                let budget = i64::try_from(budget).unwrap_or(i64::MAX);
                return levers
                    .into_iter()
                    .map(|l| vec![l; n])
                    .filter(|plan| profile.predict_levers(plan) <= budget)
                    .min_by(|a, b| {
                        profile
                            .added_seconds(a)
                            .total_cmp(&profile.added_seconds(b))
                    });
            }
            if base.offload || zero3 {
                let r = profile.solve(budget).ok()?;
                Some(
                    r.into_iter()
                        .map(|r| {
                            if r {
                                PlannedLever::Recompute
                            } else {
                                PlannedLever::Keep
                            }
                        })
                        .collect(),
                )
            } else {
                profile.solve_levers(budget).ok()
            }
        };
        let mut solver_budget = u64::try_from(
            i64::try_from(target)
                .unwrap_or(i64::MAX)
                .saturating_sub(extra),
        )
        .unwrap_or(0);
        let mut last = None;
        let mut tried = Vec::new();
        for _ in 0..3 {
            let Some(plan) = solve(solver_budget) else {
                break;
            };
            if plan.iter().all(|l| *l == PlannedLever::Keep) {
                solver_budget = u64::try_from(model_plain - 1).unwrap_or(0);
                continue;
            }
            if tried.contains(&plan) {
                break;
            }
            tried.push(plan.clone());
            let levers = profile.keys().iter().cloned().zip(plan).collect();
            let choice = base.clone().with_block_levers(levers);
            let candidate = self.evaluate(&choice, m, k, Some(m))?;
            let fits = candidate.predicted_fits;
            let over = candidate
                .predicted_peak_bytes
                .map(|p| p.saturating_sub(target));
            last = Some(candidate);
            match over {
                _ if fits => break,
                Some(over) => solver_budget = solver_budget.saturating_sub(over + 1),
                // Over the budget already at a smaller size: ask for a tenth less.
                None => solver_budget -= solver_budget / 10,
            }
        }
        if last.is_none() {
            // Nothing within the target: every block recomputed, for the record (and
            // for the smallest feasible budget).
            let levers = profile
                .keys()
                .iter()
                .cloned()
                .map(|k| (k, PlannedLever::Recompute))
                .collect();
            let choice = base.clone().with_block_levers(levers);
            last = Some(self.evaluate(&choice, m, k, Some(m))?);
        }
        Ok(last)
    }
}

/// `profile` with each of its figures the largest over the ranks; `None` on every rank
/// when the ranks' profiles differ in structure (other blocks ran: see
/// `BlocksProfile::structure_fingerprint`) or in their number of figures.
fn agree_blocks(ranks: &Ranks, profile: BlocksProfile) -> Result<Option<BlocksProfile>, FitError> {
    if ranks.group().is_none() {
        return Ok(Some(profile));
    }
    let figures = profile.figures();
    let print = profile.structure_fingerprint();
    // Each a whole number below 2^32, exact in an f64; compared as largest and least.
    let mine = [
        figures.len() as f64,
        (print >> 32) as f64,
        (print & 0xffff_ffff) as f64,
    ];
    let mut both = mine.to_vec();
    both.extend(mine.iter().map(|v| -v));
    let agreed = ranks.max(&both)?;
    let same = (0..mine.len()).all(|i| agreed[i] == mine[i] && -agreed[i + mine.len()] == mine[i]);
    if !same {
        return Ok(None);
    }
    let agreed = ranks.max(&figures)?;
    Ok(profile.with_figures(&agreed))
}

/// `profile` with each of its figures the largest over the ranks (each rank profiles
/// its own layers: the solver must see the same profile everywhere).
fn agree_profile(ranks: &Ranks, mut profile: ChainProfile) -> Result<ChainProfile, FitError> {
    if ranks.group().is_none() {
        return Ok(profile);
    }
    const FIELDS: usize = 11;
    let mut values: Vec<f64> = Vec::with_capacity(profile.elements.len() * FIELDS + 1);
    for e in &profile.elements {
        values.extend([
            e.input_bytes as f64,
            e.output_bytes as f64,
            e.retained_bytes as f64,
            e.forward_peak_bytes as f64,
            e.nograd_peak_bytes as f64,
            e.backward_peak_bytes as f64,
            e.param_grad_bytes as f64,
            f64::from(u8::from(e.saves_output)),
            e.forward_time_s,
            e.nograd_time_s,
            e.backward_time_s,
        ]);
    }
    values.push(profile.checkpoint_overhead_bytes as f64);
    let agreed = ranks.max(&values)?;
    for (e, v) in profile.elements.iter_mut().zip(agreed.chunks(FIELDS)) {
        *e = LayerProfile {
            input_bytes: v[0] as u64,
            output_bytes: v[1] as u64,
            retained_bytes: v[2] as u64,
            forward_peak_bytes: v[3] as u64,
            nograd_peak_bytes: v[4] as u64,
            backward_peak_bytes: v[5] as u64,
            param_grad_bytes: v[6] as u64,
            saves_output: v[7] > 0.0,
            forward_time_s: v[8],
            nograd_time_s: v[9],
            backward_time_s: v[10],
        };
    }
    profile.checkpoint_overhead_bytes = agreed[agreed.len() - 1] as u64;
    Ok(profile)
}
