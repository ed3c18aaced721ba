//! The search of `fit`: candidates by micro-batch count, lever set and recompute
//! schedule, predicted from small runs, the fastest that fits confirmed by one real
//! step, then raced by runners-up and compared in rounds.
//!
//! This file is the orchestration: [`fit`], [`fit_with`] and the search's state, a
//! method per phase. Each idea has a module of its own:
//! - `candidates`: which lever sets, splits and probe sizes are considered;
//! - `runs`: the runs of the workload (small runs and the predictions from them,
//!   recompute schedules, real-size runs);
//! - `race`: which runners-up race the choice, and the rounds that compare the close
//!   ones;
//! - `infeasible`: the error for a budget nothing fits;
//! - `explain`: the report's why, Pareto front and text;
//! - `tuning`: the numbers that tune the race and the rounds.
mod candidates;
mod explain;
mod infeasible;
mod race;
mod runs;
mod tuning;

pub use self::explain::table;

use self::candidates::{
    div_ceil, grad_lever_sets, in_modes, lever_sets, params_lever_sets, splits, state_lever_sets,
    Levers,
};
use self::explain::{front, why, Confirmed};
use self::race::{
    close_to_fastest, ends_before, fastest_of, fastest_of_run, racers, rounds,
    sort_by_measured_time, sort_by_predicted_time, Rounds,
};
use self::runs::Runs;
use self::tuning::{
    runs_for, CHEAP_SHARE, EXHAUSTIVE_MAX_ROUNDS, EXHAUSTIVE_MIN_ROUNDS, EXHAUSTIVE_OUT_OVER,
    EXHAUSTIVE_RECHECK_WITHIN, EXHAUSTIVE_ROUNDS_S, EXHAUSTIVE_RUN_WITHIN, ONE_RUN_FROM_S, RACE_S,
    RACE_SHARE, RECHECK_MAX, RECHECK_MAX_ROUNDS, RECHECK_MIN_ROUNDS, RECHECK_OUT_OVER, RECHECK_S,
    RECHECK_SHARE, RECHECK_WITHIN, SMALL_GRADIENTS_SHARE,
};
use super::choice::Choice;
use super::coupling::{check_size, split_changes_gradients, Coupling};
use super::lockstep::Ranks;
use super::probe::ProbeError;
use super::state::ModelState;
use super::{Candidate, FitError, FitEvent, FitReport, FitRequest, ParallelMode};
use memsave_checkpoint::Schedule;
use memsave_step::workload::Workload;
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::time::Instant;

/// Finds the fastest configuration of `workload` whose peak fits
/// `request.budget_bytes` with the global batch kept; see the [module](super) docs.
///
/// Warning: on glibc it leaves `malloc`'s mmap threshold at its 32 MiB cap for the
/// rest of the process (see the module docs' traps).
///
/// ```no_run
/// # fn run(model: &mut dyn memsave_step::Workload) -> Result<(), memsave_fit::FitError> {
/// use memsave_fit::{fit, FitRequest};
///
/// let report = fit(model, &FitRequest::new(24 << 20))?;
/// println!("{}", report.to_text());
/// assert!(report.measured_peak_bytes <= 24 << 20);
/// # Ok(()) }
/// ```
pub fn fit(workload: &mut dyn Workload, request: &FitRequest) -> Result<FitReport, FitError> {
    fit_with(workload, request, &mut |_| {})
}

/// [`fit`], telling `progress` what it is doing as it goes (a phase at a time: the
/// small runs of each split, the real-size runs, the rounds), e.g. to show a progress
/// line: with a large global batch a fit can take minutes.
pub fn fit_with(
    workload: &mut dyn Workload,
    request: &FitRequest,
    progress: &mut dyn FnMut(&FitEvent),
) -> Result<FitReport, FitError> {
    let started = Instant::now();
    if request.budget_bytes == 0 {
        return Err(FitError::ZeroBudget);
    }
    if !(0.0..1.0).contains(&request.margin) {
        return Err(FitError::BadMargin(request.margin));
    }
    let global = request
        .global_batch
        .unwrap_or_else(|| workload.global_batch());
    if global < 1 {
        return Err(FitError::BadGlobalBatch(global));
    }
    let ranks = Ranks::new(request.process_group.as_ref());
    let world_size = ranks.world_size();
    if global % world_size as i64 != 0 {
        return Err(FitError::Indivisible {
            global_batch: global,
            world_size,
        });
    }
    // Every probe run moves the model (BatchNorm's running statistics, the random
    // generator, the weights under an optimizer): it is put back as found, whatever
    // the outcome.
    let state = ModelState::save(&*workload).map_err(|e| FitError::Step(e.to_string()))?;
    // A fit that fails leaves the layers' schedule and the blocks' levers as it found
    // them (one that succeeds leaves its choice's).
    let chain = workload.layers().plan_snapshot();
    let blocks = workload.blocks().map(|b| b.levers_snapshot());
    let outcome = search_fit(workload, request, progress, started, global, ranks);
    if outcome.is_err() {
        let _ = workload.layers_mut().restore_plan(chain);
        if let (Some(b), Some(levers)) = (workload.blocks(), blocks) {
            b.restore_levers(levers);
        }
    }
    let restored = state.restore().map_err(|e| FitError::Step(e.to_string()));
    let report = outcome?;
    restored?;
    Ok(report)
}

/// [`fit_with`] after the request is checked and the model's state saved: the phases
/// in order. Gradients in files cost a write and a read of every gradient per
/// micro-batch: they are considered only when nothing fits without (predicted, then
/// confirmed). On ranks, each lever set in each data-parallel mode, those a mode
/// refuses noted and left out; the search runs on each rank's share of `global`.
fn search_fit(
    workload: &mut dyn Workload,
    request: &FitRequest,
    progress: &mut dyn FnMut(&FitEvent),
    started: Instant,
    global: i64,
    ranks: Ranks,
) -> Result<FitReport, FitError> {
    memsave_meter::install();
    super::allocator::settle();
    let share = global / ranks.world_size() as i64;
    let modes: &[ParallelMode] = if ranks.group().is_some() {
        &ParallelMode::ALL
    } else {
        &[]
    };
    let optimizer = request.optimizer.or_else(|| workload.optimizer());
    let has_optimizer = optimizer.is_some();
    let unfit: Vec<(ParallelMode, String)> = modes
        .iter()
        .filter_map(|&m| Some((m, m.refuses_workload(&*workload)?)))
        .collect();
    let unfit = |m: ParallelMode| {
        unfit
            .iter()
            .find(|(u, _)| *u == m)
            .map(|(_, why)| why.clone())
    };
    let mut search = Search {
        runs: Runs::new(
            workload,
            optimizer,
            request.budget_bytes,
            request.margin,
            share,
            progress,
            ranks,
        ),
        request,
        global: share,
        started,
        candidates: Vec::new(),
        cost_ratio: HashMap::new(),
        run_already: HashSet::new(),
        coupling: None,
        tries: 0,
        fell_back: false,
    };
    search.runs.per_block = request.per_block;
    search.runs.param_units = param_units(request, &*search.runs.workload, modes);
    // Per block, the planner may then compress what a block saves (lossy).
    search.runs.compress_blocks = request.allow.compress;
    let mut passes = Vec::new();
    for sets in [
        lever_sets(request, has_optimizer),
        grad_lever_sets(request, has_optimizer),
        state_lever_sets(request, optimizer, !modes.is_empty()),
        params_lever_sets(optimizer, search.runs.param_units.is_none()),
    ] {
        let (run, refused) = in_modes(sets, modes, optimizer, &unfit);
        for (levers, why) in refused {
            let mut c = Candidate::unmeasured(levers.apply(Choice::new(share, 1)));
            c.note = Some(why);
            search.candidates.push(c);
        }
        passes.push(run);
    }
    let mut chosen = None;
    for (pass, lever_sets) in passes.iter().enumerate() {
        if chosen.is_some() {
            break;
        }
        // (A pass may be empty, the state's for an optimizer without state: the next
        // one still runs.)
        if lever_sets.is_empty() {
            continue;
        }
        let gradients_in_files = pass > 0 && lever_sets[0].offload_grads;
        search.predict_pass(gradients_in_files, lever_sets)?;
        chosen = search.confirm()?;
    }
    if chosen.is_none() && search.runs.workload.device() == tch::Device::Cpu {
        chosen = search.confirm_within_budget()?;
        search.fell_back = chosen.is_some();
    }
    let coupling = search.name_coupling();
    let Some(chosen) = chosen else {
        return Err(search.infeasible()?);
    };
    search.offer_gradient_groups(chosen)?;
    let raced = search.race(chosen)?;
    let mut chosen = search.recheck(chosen)?;
    let mut fastest_measured = None;
    if request.exhaustive {
        (chosen, fastest_measured) = search.exhaustive(chosen)?;
    }
    Ok(search.report(chosen, coupling, raced, fastest_measured))
}

/// The gradient size from which gradients go to files when the smallest parameters'
/// stay in memory: the smallest parameters, smallest first (all of one size together),
/// as long as they hold at most [`SMALL_GRADIENTS_SHARE`] of all the gradients' bytes;
/// `None` when not even the smallest do, or when every parameter would.
fn small_gradients_threshold(params: &[tch::Tensor]) -> Option<u64> {
    let mut sizes: Vec<u64> = params.iter().map(memsave_sys::tensor::nbytes).collect();
    sizes.sort_unstable();
    let cap = (sizes.iter().sum::<u64>() as f64 * SMALL_GRADIENTS_SHARE) as u64;
    let (mut kept, mut i) = (0u64, 0usize);
    while i < sizes.len() {
        let end = sizes.partition_point(|&b| b <= sizes[i]);
        let group: u64 = sizes[i..end].iter().sum();
        if kept + group > cap {
            break;
        }
        kept += group;
        i = end;
    }
    (i > 0 && i < sizes.len()).then(|| sizes[i])
}

/// The units (name, bytes) the parameters would wait in files as, where they may:
/// on one process (ZeRO-3 on ranks shards them instead), on the CPU (the shards in
/// files are f32 CPU tensors; host memory on CUDA is not done), unless the request
/// keeps them on the device; `None` otherwise. Found once per fit (a model of blocks
/// runs a forward to find them).
fn param_units(
    request: &FitRequest,
    workload: &dyn memsave_step::workload::Workload,
    modes: &[ParallelMode],
) -> Option<Vec<(String, u64)>> {
    // And only for a workload the units can be made of (each parameter in one layer
    // or top-level block, layers that run inside their unit): the others would fail
    // to set up, where they should only not be offered the lever.
    let may = modes.is_empty() && request.offload_params && workload.device() == tch::Device::Cpu;
    may.then(|| memsave_step::parallel::units_of(workload).ok())
        .flatten()
}

/// The search's state: the runs of the workload and every configuration considered
/// so far with what is known of it.
struct Search<'w, 'q> {
    runs: Runs<'w>,
    request: &'q FitRequest,
    global: i64,
    /// When `fit` started: the race and the rounds may take a share of the time spent.
    started: Instant,
    /// Every configuration considered, in the order considered.
    candidates: Vec<Candidate>,
    /// Per lever set, its predicted time over the plain step's, from the first split
    /// it was evaluated at: a lever costs about the same share of the step at any
    /// split.
    cost_ratio: HashMap<Levers, f64>,
    /// Candidates run at their real size already.
    run_already: HashSet<usize>,
    /// How the step couples the samples of a batch, found at the first evaluation of
    /// the plain step (see `crate::coupling`): with coupling, micro-batches change the
    /// step and are a lossy lever. `None` until that evaluation.
    coupling: Option<Option<Coupling>>,
    /// Real steps of chosen configurations run to confirm one.
    tries: usize,
    /// The choice was confirmed among those predicted within the budget but not the
    /// margin ([`Search::confirm_within_budget`]).
    fell_back: bool,
}

/// What the race of runners-up measured.
struct Raced {
    /// Configurations measured at their real size, the choice included.
    measured: usize,
    /// Runners-up that did not fit the budget when run.
    over_budget: usize,
}

impl Search<'_, '_> {
    /// With every gradient in files, the choice's twin that keeps the smallest
    /// parameters' gradients in memory ([`small_gradients_threshold`]), probed as any
    /// configuration is: it then races the choice as a runner-up, and wins only when
    /// it fits the budget when run and measures faster. On one process, with the
    /// parameters and the optimizer's state on the device.
    fn offer_gradient_groups(&mut self, chosen: usize) -> Result<(), FitError> {
        let choice = &self.candidates[chosen].choice;
        // One process: no data-parallel mode either (modes are tried on ranks only).
        let eligible = choice.offload_grads
            && choice.offload_grads_at_least.is_none()
            && !choice.params_in_files
            && !choice.state_in_files
            && self.runs.ranks.group().is_none();
        if !eligible {
            return Ok(());
        }
        let Some(at_least) = small_gradients_threshold(&self.runs.workload.parameters()) else {
            return Ok(());
        };
        let twin = choice
            .clone()
            .with(|c| c.offload_grads_at_least = Some(at_least));
        let (k, m) = (twin.micro_batches, twin.micro_batch);
        let candidate = self.runs.evaluate(&twin, m, k, None)?;
        self.candidates.push(candidate);
        Ok(())
    }

    /// Predicts the configurations of one pass (`lever_sets`, with the gradients in
    /// files or not) split after split, fewest micro-batches first, until more
    /// micro-batches cannot win.
    fn predict_pass(
        &mut self,
        gradients_in_files: bool,
        lever_sets: &[Levers],
    ) -> Result<(), FitError> {
        for k in splits(self.global) {
            if self
                .predict_split(gradients_in_files, lever_sets, k)?
                .is_break()
            {
                break;
            }
        }
        Ok(())
    }

    /// Predicts the configurations of `lever_sets` with `k` micro-batches: the plain
    /// step (of the pass: with the gradients in files in the second), then the levers
    /// that cost little to probe, then recompute, and last offload and compression
    /// (slow to probe), which are skipped where their known cost over the plain step
    /// cannot beat what already fits. `Break` when more micro-batches cannot win, or
    /// are lossy for this step and not allowed.
    fn predict_split(
        &mut self,
        gradients_in_files: bool,
        lever_sets: &[Levers],
        k: usize,
    ) -> Result<ControlFlow<()>, FitError> {
        let request = self.request;
        if k > 1
            && self.coupling.as_ref().is_some_and(Option::is_some)
            && !request.allow.micro_batches
        {
            return Ok(ControlFlow::Break(())); // micro-batches are lossy for this step, and not allowed
        }
        let m = div_ceil(self.global, k as i64);
        (self.runs.progress)(&FitEvent::Predicting {
            micro_batches: k,
            micro_batch: m,
            gradients_in_files,
            state_in_files: lever_sets[0].state_in_files,
            parameters_in_files: lever_sets[0].params_in_files,
        });
        let usable = |l: &&Levers| k == 1 || l.accumulates();
        let base = lever_sets[0];
        let plain = self.evaluate_plain(base, k, m)?;
        let plain_fits = plain.predicted_fits;
        let plain_time = plain.predicted_step_time_s;
        self.candidates.push(plain);
        for levers in lever_sets
            .iter()
            .filter(usable)
            .filter(|l| **l != base && l.is_cheap())
        {
            self.evaluate_levers(levers, k, m, plain_time)?;
        }
        // Every lever costs time on top of the plain step: once the plain step with
        // this many micro-batches is predicted slower than something that fits, more
        // recompute (or more micro-batches) cannot win.
        let hopeless = plain_time.is_some_and(|t| t > best_fitting_time(&self.candidates))
            && !request.exhaustive;
        if hopeless {
            return Ok(ControlFlow::Break(()));
        }
        if !plain_fits {
            for levers in lever_sets.iter().filter(usable).filter(|l| l.is_cheap()) {
                let base = levers.apply(Choice::new(self.global, k));
                let candidates = self.runs.recompute(&base, m, k)?;
                self.candidates.extend(candidates);
            }
        }
        if plain_fits && !request.exhaustive {
            return Ok(ControlFlow::Break(())); // more micro-batches only add per-micro-batch overhead
        }
        for levers in lever_sets.iter().filter(usable).filter(|l| !l.is_cheap()) {
            self.evaluate_levers(levers, k, m, plain_time)?;
        }
        Ok(ControlFlow::Continue(()))
    }

    /// The plain step of the pass (`base`'s levers) with `k` micro-batches of at most
    /// `m`; its first evaluation runs under `memsave_sys::ops::sample_coupling_op`, and
    /// when that names no op, the gradients of a split are compared with the whole
    /// batch's, to learn whether the step couples the samples of a batch (see
    /// `crate::coupling`).
    fn evaluate_plain(&mut self, base: Levers, k: usize, m: i64) -> Result<Candidate, FitError> {
        let plain_choice = base.apply(Choice::new(self.global, k));
        if self.coupling.is_none() {
            let (plain, op) = memsave_sys::ops::sample_coupling_op(|| {
                self.runs.evaluate(&plain_choice, m, k, None)
            })
            .map_err(|e| FitError::Step(e.to_string()))?;
            let plain = plain?;
            // Ranks agree on whether any of them ran a coupling op, so that none
            // enters the split check's collective alone.
            let any_op = self.runs.ranks.any(op.is_some())?;
            let coupling = match op {
                Some(op) => Some(Coupling::Op(op)),
                None if any_op => Some(Coupling::Op(
                    "a batch-norm-family op (on another rank)".into(),
                )),
                None => self.split_check()?,
            };
            self.runs.lossy_split = coupling.is_some();
            self.coupling = Some(coupling);
            Ok(plain)
        } else {
            self.runs.evaluate(&plain_choice, m, k, None)
        }
    }

    /// The comparison of a split's gradients with the whole batch's (see
    /// `crate::coupling`), run by each rank on its own examples and agreed: coupling
    /// on any rank is coupling; a failure on any rank ends the fit on every rank.
    fn split_check(&mut self) -> Result<Option<Coupling>, FitError> {
        let Some(size) = check_size(self.global) else {
            return Ok(None);
        };
        let ranks = &self.runs.ranks;
        let outcome = split_changes_gradients(&mut *self.runs.workload, size);
        let (rel, failed) = match &outcome {
            // A NaN difference is coupling too: infinite, to survive the max.
            Ok(Some(rel)) if rel.is_nan() => (f64::INFINITY, 0.0),
            Ok(Some(rel)) => (*rel, 0.0),
            Ok(None) => (-1.0, 0.0),
            Err(_) => (-1.0, 1.0),
        };
        let agreed = ranks.max(&[rel, failed])?;
        if let Err(e) = outcome {
            let e = format!(
                "comparing a split's gradients with the whole batch's: {}",
                e.message()
            );
            return Err(FitError::Step(match ranks.group() {
                Some(_) => format!("rank {}: {e}", ranks.rank()),
                None => e,
            }));
        }
        if agreed[1] > 0.0 {
            return Err(FitError::Step(
                "another rank failed to compare a split's gradients with the whole batch's".into(),
            ));
        }
        Ok((agreed[0] >= 0.0).then(|| Coupling::Gradients {
            examples: size,
            rel_l2: if agreed[0].is_infinite() {
                f64::NAN
            } else {
                agreed[0]
            },
        }))
    }

    /// Predicts `levers` with `k` micro-batches of at most `m`, unless (outside
    /// `exhaustive`) its cost over the plain step's `plain_time`, known from an earlier
    /// split, cannot beat what already fits.
    fn evaluate_levers(
        &mut self,
        levers: &Levers,
        k: usize,
        m: i64,
        plain_time: Option<f64>,
    ) -> Result<(), FitError> {
        if !self.request.exhaustive {
            if let (Some(r), Some(t)) = (self.cost_ratio.get(levers), plain_time) {
                if r * t >= best_fitting_time(&self.candidates) {
                    return Ok(());
                }
            }
        }
        let candidate =
            self.runs
                .evaluate(&levers.apply(Choice::new(self.global, k)), m, k, None)?;
        if let (Some(t), Some(p)) = (candidate.predicted_step_time_s, plain_time) {
            if p > 0.0 {
                self.cost_ratio.entry(*levers).or_insert(t / p);
            }
        }
        self.candidates.push(candidate);
        Ok(())
    }

    /// Runs those predicted to fit and not run yet at their real size, fastest
    /// predicted first, until one's measured peak fits the budget: that one is the
    /// choice. Those that do not fit get a note.
    fn confirm(&mut self) -> Result<Option<usize>, FitError> {
        self.confirm_where(|c| c.predicted_fits)
    }

    /// On the CPU, where the meter's peak is exact to the byte, when nothing predicted
    /// within the margin fits: those predicted within the budget itself, confirmed as
    /// [`confirm`](Self::confirm) does (each measured within the budget, or not
    /// chosen). The margin is there for predictions from small runs that miss; a
    /// real-size run measured within the budget needs none.
    fn confirm_within_budget(&mut self) -> Result<Option<usize>, FitError> {
        let budget = self.request.budget_bytes;
        self.confirm_where(|c| {
            !c.predicted_fits
                && c.note.is_none()
                && c.predicted_peak_bytes.is_some_and(|p| p <= budget)
        })
    }

    /// [`confirm`](Self::confirm) over the candidates `eligible` picks.
    fn confirm_where(
        &mut self,
        eligible: impl Fn(&Candidate) -> bool,
    ) -> Result<Option<usize>, FitError> {
        let mut order: Vec<usize> = (0..self.candidates.len())
            .filter(|&i| eligible(&self.candidates[i]) && !self.run_already.contains(&i))
            .collect();
        sort_by_predicted_time(&mut order, &self.candidates);
        for &i in &order {
            self.tries += 1;
            self.run_already.insert(i);
            let candidate = &mut self.candidates[i];
            (self.runs.progress)(&FitEvent::Confirming {
                strategy: candidate.choice.strategy.clone(),
                micro_batches: candidate.choice.micro_batches,
                micro_batch: candidate.choice.micro_batch,
            });
            match self.runs.run_real(&candidate.choice) {
                Ok(p) => {
                    candidate.measured(&p);
                    return Ok(Some(i));
                }
                Err(ProbeError::OutOfMemory(e)) => {
                    candidate.note = Some(format!("did not fit when run: {e}"));
                }
                Err(ProbeError::Unusable(e)) => candidate.note = Some(e),
                Err(ProbeError::Failed(e)) => return Err(FitError::Step(e)),
                Err(ProbeError::Fatal(e)) => return Err(e),
            }
        }
        Ok(None)
    }

    /// How the step couples the samples of a batch, if it does, named on every
    /// candidate with more than one micro-batch.
    fn name_coupling(&mut self) -> Option<Coupling> {
        let coupling = self.coupling.clone().flatten();
        if let Some(coupling) = &coupling {
            let name = coupling.name();
            for c in self
                .candidates
                .iter_mut()
                .filter(|c| c.choice.micro_batches > 1)
            {
                c.choice.sample_coupling_op = Some(name.clone());
            }
        }
        coupling
    }

    /// The error for a budget nothing fits (see `infeasible::error`).
    fn infeasible(&mut self) -> Result<FitError, FitError> {
        infeasible::error(&mut self.runs, &self.candidates, self.request)
    }

    /// Runs the runners-up of `chosen` ([`racers`]) at their real size, each only if,
    /// by its predicted time, it ends while the race's time lasts. Predicted times come
    /// from small runs and are off by tens of percent, more than separates close
    /// configurations: runners-up that could be faster are run at their real size too,
    /// and the fastest measured within the budget wins. On the CPU (where the meter's
    /// peak is exact to the byte) a runner-up predicted within the budget but not
    /// within the margin may run too: measured within the budget, it is as safe as the
    /// rest.
    fn race(&mut self, chosen: usize) -> Result<Raced, FitError> {
        let cpu = self.runs.workload.device() == tch::Device::Cpu;
        let racers = racers(
            &self.candidates,
            &self.run_already,
            chosen,
            self.request.budget_bytes,
            cpu,
        );
        let mut raced = Raced {
            measured: 1,
            over_budget: 0,
        };
        let now = self.now()?;
        let deadline = now + RACE_S.max(RACE_SHARE * now);
        if !racers.is_empty() {
            (self.runs.progress)(&FitEvent::RunnersUp {
                count: racers.len(),
            });
        }
        for i in racers {
            let predicted = self.candidates[i].predicted_step_time_s.unwrap_or(0.0);
            let runs = runs_for(predicted, 2.0 * ONE_RUN_FROM_S);
            if !ends_before(predicted * runs as f64, self.now()?, deadline) {
                continue;
            }
            self.run_already.insert(i);
            let candidate = &mut self.candidates[i];
            match self.runs.run_real_times(&candidate.choice, runs) {
                Ok(p) => {
                    raced.measured += 1;
                    candidate.measured(&p);
                }
                Err(ProbeError::OutOfMemory(e)) => {
                    raced.over_budget += 1;
                    candidate.note = Some(format!("did not fit when run: {e}"));
                }
                // A runner-up that fails is left out; the choice stands.
                Err(ProbeError::Failed(e) | ProbeError::Unusable(e)) => candidate.note = Some(e),
                Err(ProbeError::Fatal(e)) => return Err(e),
            }
        }
        Ok(raced)
    }

    /// Seconds since `fit` started on the search's clock (agreed over the ranks: the
    /// one that has spent the most).
    fn now(&self) -> Result<f64, FitError> {
        self.runs.ranks.elapsed_s(self.started)
    }

    /// Compares the close ones in rounds and returns the new choice. Steps a few
    /// percent apart swap places from one run to the next, and a busy machine runs a
    /// step a third slower one second than the next: the close ones (the fastest
    /// predicted among them, measured first, while the machine may still have been
    /// busy with the probes) are compared in rounds, over the same moments of the
    /// machine, each by its median over the rounds corrected for the machine's speed in
    /// each round.
    fn recheck(&mut self, chosen: usize) -> Result<usize, FitError> {
        let mut close = close_to_fastest(&self.candidates, RECHECK_WITHIN, chosen);
        sort_by_measured_time(&mut close, &self.candidates);
        // The one confirmed first stays in (first, so never left out for time): its one
        // measurement came right after the probes, on a machine perhaps still busy.
        if let Some(at) = close.iter().position(|&i| i == chosen) {
            close.remove(at);
            close.insert(0, chosen);
        }
        close.truncate(RECHECK_MAX);
        if close.len() > 1 {
            (self.runs.progress)(&FitEvent::Rounds { count: close.len() });
        }
        let before = self.now()?;
        let recheck_s = RECHECK_S.max(RECHECK_SHARE * before);
        let cheap_s = recheck_s.max(CHEAP_SHARE * before);
        let (started, ranks) = (self.started, self.runs.ranks.clone());
        let runs = &mut self.runs;
        let rechecked = rounds(
            &mut self.candidates,
            close,
            Rounds {
                least: RECHECK_MIN_ROUNDS,
                most: RECHECK_MAX_ROUNDS,
                until: before + recheck_s,
                until_cheap: before + cheap_s,
                least_within: true,
                out_over: RECHECK_OUT_OVER,
                keep: None,
            },
            &mut |choice, n| runs.run_real_times(choice, n),
            &mut || ranks.elapsed_s(started),
        )?;
        // The fastest of those still in the rounds at their end (their times are medians
        // over the same rounds; the others' the fastest of a few runs, or a median over
        // fewer rounds: not comparable), else, if every one of them failed when run again,
        // the fastest of all run, however measured.
        match fastest_of(&self.candidates, &rechecked)
            .or_else(|| fastest_of_run(&self.candidates, &self.run_already))
        {
            Some(best) => Ok(best),
            // Every one failed when run again: nothing is known to fit.
            None => Err(self.infeasible()?),
        }
    }

    /// `exhaustive`: runs every other candidate at its real size and compares the close
    /// ones, the choice too, in rounds. Returns the choice (another only if it failed
    /// when run again) and the fastest measured within the budget.
    fn exhaustive(&mut self, mut chosen: usize) -> Result<(usize, Option<Candidate>), FitError> {
        (self.runs.progress)(&FitEvent::Exhaustive {
            count: (0..self.candidates.len())
                .filter(|i| !self.run_already.contains(i))
                .count(),
        });
        self.run_the_rest()?;
        // The check compares the choice with the fastest of the grid: every close one
        // (the choice too) gets the same extra runs.
        let mut close = close_to_fastest(&self.candidates, EXHAUSTIVE_RECHECK_WITHIN, chosen);
        sort_by_measured_time(&mut close, &self.candidates);
        let until = self.now()? + EXHAUSTIVE_ROUNDS_S;
        let (started, ranks) = (self.started, self.runs.ranks.clone());
        let runs = &mut self.runs;
        let compared = rounds(
            &mut self.candidates,
            close,
            Rounds {
                least: EXHAUSTIVE_MIN_ROUNDS,
                most: EXHAUSTIVE_MAX_ROUNDS,
                until,
                until_cheap: until,
                least_within: false,
                out_over: EXHAUSTIVE_OUT_OVER,
                keep: Some(chosen),
            },
            &mut |choice, n| runs.run_real_times(choice, n),
            &mut || ranks.elapsed_s(started),
        )?;
        if self.candidates[chosen].measured_step_time_s.is_none() {
            // The choice failed when run again: the next best of those fit measured
            // before the check (the check's own measurements do not choose).
            match fastest_of_run(&self.candidates, &self.run_already) {
                Some(best) => chosen = best,
                None => return Err(self.infeasible()?),
            }
        }
        let all: Vec<usize> = (0..self.candidates.len()).collect();
        let fastest_measured = fastest_of(&self.candidates, &compared)
            .or_else(|| fastest_of(&self.candidates, &all))
            .map(|i| self.candidates[i].clone());
        Ok((chosen, fastest_measured))
    }

    /// `exhaustive`: every candidate not run yet (the choice, a runner-up, one that did
    /// not fit) run at its real size, save those known not to fit or predicted over
    /// [`EXHAUSTIVE_RUN_WITHIN`] times the budget.
    fn run_the_rest(&mut self) -> Result<(), FitError> {
        let budget_bytes = self.request.budget_bytes;
        for (i, c) in self.candidates.iter_mut().enumerate() {
            if self.run_already.contains(&i) {
                continue; // the choice, a runner-up, one that did not fit
            }
            // Runs are not stopped at the budget (their peak is measured): one known
            // not to fit, or predicted far over, would only take its memory for real.
            let far_over = c
                .predicted_peak_bytes
                .is_none_or(|p| p as f64 > EXHAUSTIVE_RUN_WITHIN * budget_bytes as f64);
            if far_over {
                c.note.get_or_insert_with(|| {
                    format!(
                        "not run at its real size: predicted over {EXHAUSTIVE_RUN_WITHIN}x the budget"
                    )
                });
                continue;
            }
            match self.runs.run_real(&c.choice) {
                Ok(p) => c.measured(&p),
                Err(ProbeError::OutOfMemory(_)) => {
                    c.note = Some("over the budget when run at its real size".into())
                }
                Err(ProbeError::Failed(e) | ProbeError::Unusable(e)) => c.note = Some(e),
                Err(ProbeError::Fatal(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// The report of `chosen`, the workload left on its schedule.
    fn report(
        self,
        chosen: usize,
        coupling: Option<Coupling>,
        raced: Raced,
        fastest_measured: Option<Candidate>,
    ) -> FitReport {
        let Search {
            runs,
            request,
            global,
            started,
            candidates,
            tries,
            fell_back,
            ..
        } = self;
        // The step's own bytes at the peak, by role: one more step of the choice,
        // traced (on one process on the CPU; a failure leaves them out).
        let mut breakdown = candidates[chosen].measured_breakdown.unwrap_or_default();
        if candidates[chosen].measured_peak_bytes.is_some() {
            let choice = &candidates[chosen].choice;
            breakdown.step_by_role = crate::probe::step_roles_at_peak(
                runs.workload,
                runs.optimizer,
                choice,
                runs.global,
                choice.micro_batches,
                &runs.ranks,
            );
        }
        // Leave the workload on the chosen schedule.
        let schedule = candidates[chosen]
            .choice
            .schedule()
            .cloned()
            .unwrap_or_else(|| Schedule::plain(runs.workload.layers().len()));
        let _ = runs.workload.layers_mut().set_schedule(schedule);
        let _ = crate::probe::set_block_levers(&mut *runs.workload, &candidates[chosen].choice);

        let c = &candidates[chosen];
        let world_size = runs.ranks.world_size();
        let global = global * world_size as i64;
        let mut why = why(
            c,
            &candidates,
            request,
            global,
            world_size,
            Confirmed {
                raced: raced.measured,
                fell_back,
            },
        );
        if let Some(coupling) = &coupling {
            why.push_str(&format!(
                "; {}",
                coupling.sentence(request.allow.micro_batches)
            ));
        }
        FitReport {
            model: runs.workload.name().to_owned(),
            budget_bytes: request.budget_bytes,
            budget_counts: crate::BUDGET_COUNTS,
            global_batch: global,
            margin: request.margin,
            allow: request.allow,
            sample_coupling_op: coupling.as_ref().map(Coupling::name),
            choice: c.choice.clone(),
            optimizer: runs.optimizer,
            predicted_peak_bytes: c.predicted_peak_bytes.unwrap_or(0),
            measured_peak_bytes: c.measured_peak_bytes.unwrap_or(0),
            breakdown,
            world_size,
            measured_peak_bytes_by_rank: c.measured_peak_bytes_by_rank.clone(),
            predicted_step_time_s: c.predicted_step_time_s.unwrap_or(0.0),
            measured_step_time_s: c.measured_step_time_s.unwrap_or(0.0),
            tries,
            small_runs_over_budget: runs.small_over,
            runners_up_over_budget: raced.over_budget,
            why,
            front: front(&candidates),
            candidates,
            fastest_measured,
            fit_time_s: started.elapsed().as_secs_f64(),
        }
    }
}

/// The fastest predicted time of a configuration that fits, so far (and, if it was
/// run, did: a predicted fit with a note is one that failed its run).
fn best_fitting_time(candidates: &[Candidate]) -> f64 {
    candidates
        .iter()
        .filter(|c| c.predicted_fits && c.note.is_none())
        .filter_map(|c| c.predicted_step_time_s)
        .fold(f64::INFINITY, f64::min)
}
