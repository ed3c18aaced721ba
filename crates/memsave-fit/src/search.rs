//! The search of `fit`: candidates by micro-batch count, lever set and recompute
//! schedule, predicted from small runs, the fastest that fits confirmed by one real
//! step.
use super::choice::Choice;
use super::predict::{profile_at, Affine};
use super::probe::{probe, ProbeError};
use super::state::ModelState;
use super::{Candidate, FitError, FitEvent, FitReport, FitRequest};
use memsave_checkpoint::{predict, ChainProfile, Schedule, Solver};
use memsave_meter::Bytes;
use memsave_step::plan::f_profile;
use memsave_step::workload::Workload;
use std::collections::HashMap;
use std::time::Instant;

/// Runs per small probe; the fastest gives the time, the highest the peak. The first
/// runs at a new size are slow (the allocator maps fresh pages, caches are cold) and
/// the first records every allocation: two would leave one run for the time, which
/// is all a probe whose runs take long keeps (see `probe`).
const PROBE_RUNS: usize = 3;

/// Runs of a configuration at its real size (the confirmation, runners-up whose step is
/// predicted under twice `ONE_RUN_FROM_S`: predictions are off by up to 3x, and the
/// first step of a short one pays for fresh allocations).
const REAL_RUNS: usize = 2;

/// Runners-up predicted within this factor of the choice's time (the larger of its
/// predicted and measured) are measured too.
const RACE_WITHIN: f64 = 1.5;

/// The best predicted of each family (levers and recompute schedule) not raced yet is
/// measured too when predicted within this factor.
const RACE_FAMILY_WITHIN: f64 = 3.0;

/// At most this many runners-up are measured...
const RACE_MAX: usize = 16;

/// ...and one starts only if, by its predicted time, it ends within this many seconds of the race's start, or this
/// share of the time `fit` took before the race if more: `fit` stays quick on large
/// steps.
const RACE_S: f64 = 2.0;
const RACE_SHARE: f64 = 0.25;

/// Configurations measured within this factor of the fastest (at most
/// `RECHECK_MAX` of them, fastest first) are run again in rounds...
const RECHECK_WITHIN: f64 = 1.25;
const RECHECK_MAX: usize = 5;

/// ...at least this many (the slowest left out until they fit, then down to two
/// rounds, none if even two rounds of two do not: one says little more than the race
/// did)...
const RECHECK_MIN_ROUNDS: usize = 3;

/// ...at most this many...
const RECHECK_MAX_ROUNDS: usize = 24;

/// ...each round starting only if it ends within this many seconds of the recheck's
/// start, or this share of the time `fit` took before it if more...
const RECHECK_S: f64 = 2.0;
const RECHECK_SHARE: f64 = 0.25;

/// ...or, for a round that takes at most `CHEAP_ROUND_S`, within this share of the time
/// `fit` took before the recheck: three or four rounds still now and then choose one
/// over another more than 10% faster, eight or more far less often, and rounds of a
/// few short steps cost little next to the small runs before them...
const CHEAP_ROUND_S: f64 = 0.3;
const CHEAP_SHARE: f64 = 0.5;

/// ...and once `RECHECK_MIN_ROUNDS + 1` rounds have run, one whose median so far is over
/// this factor of the fastest's runs no more rounds: the rounds left go to those still
/// close.
const RECHECK_OUT_OVER: f64 = 1.15;

/// With `exhaustive`, the same for the whole grid: those within 1.3x, the choice too,
/// in at least five rounds, more (up to thirty) while `EXHAUSTIVE_ROUNDS_S` lasts,
/// those over 1.2x of the fastest out once six rounds have run (never the choice).
const EXHAUSTIVE_RECHECK_WITHIN: f64 = 1.3;
const EXHAUSTIVE_MIN_ROUNDS: usize = 5;
const EXHAUSTIVE_MAX_ROUNDS: usize = 30;
const EXHAUSTIVE_ROUNDS_S: f64 = 10.0;
const EXHAUSTIVE_OUT_OVER: f64 = 1.2;

/// With `exhaustive`, a configuration predicted over this factor of the budget (or
/// known not to fit, with no prediction) is not run at its real size: runs are not
/// stopped at the budget, and its memory would be taken for real to learn what the
/// prediction already says.
const EXHAUSTIVE_RUN_WITHIN: f64 = 2.0;

/// A configuration's time in a round is the fastest of `REAL_RUNS` steps when its step
/// takes less than this many seconds, one step's otherwise: the first step after
/// another configuration pays for fresh allocations, a few milliseconds that only a
/// short step notices, and a long step's rounds cost the most.
const ONE_RUN_FROM_S: f64 = 0.1;

/// Steps of a configuration whose step takes `step_s`: `REAL_RUNS` under
/// `one_run_from_s` seconds, else one (in a round: see `ONE_RUN_FROM_S`; in the race:
/// see `REAL_RUNS`).
fn runs_for(step_s: f64, one_run_from_s: f64) -> usize {
    if step_s < one_run_from_s {
        REAL_RUNS
    } else {
        1
    }
}

/// How many rounds [`Search::rounds`] runs.
struct Rounds {
    /// At least this many...
    least: usize,
    /// ...and at most this many, each beyond `least` starting only if, by the times
    /// measured so far, it ends before `until`, or before `until_cheap` if it takes
    /// at most [`CHEAP_ROUND_S`].
    most: usize,
    until: Instant,
    until_cheap: Instant,
    /// The `least` rounds too must end before `until`: the slowest are left out (down
    /// to two) until they would, then fewer rounds (down to two), and there are no
    /// rounds if even then they would not. Otherwise they run whatever they take.
    least_within: bool,
    /// Once `least + 1` rounds have run, one whose median so far is over this factor of
    /// the fastest's is out: it keeps that median and runs no more rounds (and is not
    /// returned: its median was scaled among the contenders of its time)...
    out_over: f64,
    /// ...unless it is this one.
    keep: Option<usize>,
}

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
    // Every probe run moves the model (BatchNorm's running statistics, the random
    // generator, the weights under an optimizer): it is put back as found, whatever
    // the outcome.
    let state = ModelState::save(&*workload).map_err(|e| FitError::Step(e.to_string()))?;
    let outcome = search_fit(workload, request, progress, started, global);
    let restored = state.restore().map_err(|e| FitError::Step(e.to_string()));
    let report = outcome?;
    restored?;
    Ok(report)
}

/// [`fit_with`] after the request is checked and the model's state saved.
fn search_fit(
    workload: &mut dyn Workload,
    request: &FitRequest,
    progress: &mut dyn FnMut(&FitEvent),
    started: Instant,
    global: i64,
) -> Result<FitReport, FitError> {
    memsave_meter::install();
    super::allocator::settle();
    let target = (request.budget_bytes as f64 * (1.0 - request.margin)).floor() as u64;
    let mut search = Search {
        workload,
        budget: request.budget_bytes,
        target,
        global,
        affines: HashMap::new(),
        profiles: None,
        small_over: 0,
        probes: HashMap::new(),
        progress,
        lossy_split: false,
    };
    let has_optimizer = search.workload.optimizer().is_some();
    let passes = [
        lever_sets(request, has_optimizer),
        grad_lever_sets(request, has_optimizer),
    ];
    let mut candidates: Vec<Candidate> = Vec::new();
    // The fastest predicted time of a configuration that fits, so far (and, if it
    // was run, did: a predicted fit with a note is one that failed its run).
    let best = |cs: &[Candidate]| {
        cs.iter()
            .filter(|c| c.predicted_fits && c.note.is_none())
            .filter_map(|c| c.predicted_step_time_s)
            .fold(f64::INFINITY, f64::min)
    };
    // Per lever set, its predicted time over the plain step's, from the first split
    // it was evaluated at: a lever costs about the same share of the step at any split.
    let mut cost_ratio: HashMap<Levers, f64> = HashMap::new();
    let cheap = |l: &Levers| !l.offload && !l.compress;
    let mut tries = 0;
    let mut chosen = None;
    // Candidates run at their real size already.
    let mut run_already = std::collections::HashSet::new();
    // The first op of the step that couples the samples of a batch, found in the
    // first evaluation of the plain step (one micro-batch): with one, micro-batches
    // change the step and are a lossy lever.
    let mut coupling: Option<Option<String>> = None;
    // Gradients in files cost a write and a read of every gradient per micro-batch:
    // they are considered only when nothing fits without (predicted, then confirmed).
    for (pass, lever_sets) in passes.iter().enumerate() {
        if chosen.is_some() {
            break;
        }
        for k in splits(global) {
            if k > 1
                && coupling.as_ref().is_some_and(Option::is_some)
                && !request.allow.micro_batches
            {
                break; // micro-batches are lossy for this step, and not allowed
            }
            let m = div_ceil(global, k as i64);
            (search.progress)(&FitEvent::Predicting {
                micro_batches: k,
                micro_batch: m,
                gradients_in_files: pass > 0,
            });
            // The step in backward frees each gradient as soon as it is complete, which
            // accumulation over micro-batches needs kept, unless it is kept in files.
            let usable = |l: &&Levers| k == 1 || !l.in_backward || l.offload_grads;
            // The plain step (of the pass: with the gradients in files in the second),
            // then the levers that cost little to probe, then recompute, and last
            // offload and compression (slow to probe), which are skipped where their
            // known cost over the plain step cannot beat what already fits.
            let base = lever_sets[0];
            let plain_choice = base.apply(Choice::new(global, k));
            let plain = if coupling.is_none() {
                let (plain, op) = memsave_sys::ops::sample_coupling_op(|| {
                    search.evaluate(&plain_choice, m, k, None)
                })
                .map_err(|e| FitError::Step(e.to_string()))?;
                search.lossy_split = op.is_some();
                coupling = Some(op);
                plain?
            } else {
                search.evaluate(&plain_choice, m, k, None)?
            };
            let plain_fits = plain.predicted_fits;
            let plain_time = plain.predicted_step_time_s;
            candidates.push(plain);
            let mut evaluate = |search: &mut Search<'_>,
                                candidates: &mut Vec<Candidate>,
                                levers: &Levers|
             -> Result<(), FitError> {
                if !request.exhaustive {
                    if let (Some(r), Some(t)) = (cost_ratio.get(levers), plain_time) {
                        if r * t >= best(candidates) {
                            return Ok(());
                        }
                    }
                }
                let candidate =
                    search.evaluate(&levers.apply(Choice::new(global, k)), m, k, None)?;
                if let (Some(t), Some(p)) = (candidate.predicted_step_time_s, plain_time) {
                    if p > 0.0 {
                        cost_ratio.entry(*levers).or_insert(t / p);
                    }
                }
                candidates.push(candidate);
                Ok(())
            };
            for levers in lever_sets
                .iter()
                .filter(usable)
                .filter(|l| **l != base && cheap(l))
            {
                evaluate(&mut search, &mut candidates, levers)?;
            }
            // Every lever costs time on top of the plain step: once the plain step with
            // this many micro-batches is predicted slower than something that fits, more
            // recompute (or more micro-batches) cannot win.
            let hopeless = plain_time.is_some_and(|t| t > best(&candidates)) && !request.exhaustive;
            if hopeless {
                break;
            }
            if !plain_fits {
                for levers in lever_sets.iter().filter(usable).filter(|l| cheap(l)) {
                    let base = levers.apply(Choice::new(global, k));
                    if let Some(candidate) = search.recompute(&base, m, k)? {
                        candidates.push(candidate);
                    }
                }
            }
            if plain_fits && !request.exhaustive {
                break; // more micro-batches only add per-micro-batch overhead
            }
            for levers in lever_sets.iter().filter(usable).filter(|l| !cheap(l)) {
                evaluate(&mut search, &mut candidates, levers)?;
            }
        }

        let mut order: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].predicted_fits && !run_already.contains(&i))
            .collect();
        sort_by_predicted_time(&mut order, &candidates);
        for &i in &order {
            tries += 1;
            run_already.insert(i);
            (search.progress)(&FitEvent::Confirming {
                strategy: candidates[i].choice.strategy.clone(),
                micro_batches: candidates[i].choice.micro_batches,
                micro_batch: candidates[i].choice.micro_batch,
            });
            match search.run_real(&candidates[i].choice) {
                Ok(p) => {
                    candidates[i].measured_peak_bytes = Some(p.peak_bytes);
                    candidates[i].measured_step_time_s = Some(p.time_s);
                    chosen = Some(i);
                    break;
                }
                Err(ProbeError::OutOfMemory(e)) => {
                    candidates[i].note = Some(format!("did not fit when run: {e}"));
                }
                Err(ProbeError::Failed(e)) => return Err(FitError::Step(e)),
            }
        }
    }
    let coupling = coupling.flatten();
    if let Some(op) = &coupling {
        for c in candidates.iter_mut().filter(|c| c.choice.micro_batches > 1) {
            c.choice.sample_coupling_op = Some(op.clone());
        }
    }
    let Some(mut chosen) = chosen else {
        return Err(search.infeasible(&candidates, request)?);
    };

    // Predicted times come from small runs and are off by tens of percent, more than
    // separates close configurations: runners-up that could be faster are run at
    // their real size too, and the fastest measured within the budget wins. On the CPU
    // (where the meter's peak is exact to the byte) a runner-up predicted within the
    // budget but not within the margin may run too: measured within the budget, it is
    // as safe as the rest.
    let chosen_time = candidates[chosen]
        .predicted_step_time_s
        .unwrap_or(0.0)
        .max(candidates[chosen].measured_step_time_s.unwrap_or(0.0));
    let cpu = search.workload.device() == tch::Device::Cpu;
    let mut racers: Vec<usize> = (0..candidates.len())
        .filter(|i| !run_already.contains(i))
        .filter(|&i| {
            let c = &candidates[i];
            let within = if cpu {
                c.predicted_peak_bytes
                    .is_some_and(|p| p <= request.budget_bytes)
            } else {
                c.predicted_fits
            };
            within
                && c.predicted_step_time_s
                    .is_some_and(|t| t <= chosen_time * RACE_FAMILY_WITHIN)
        })
        .collect();
    sort_by_predicted_time(&mut racers, &candidates);
    let near = |i: usize| {
        candidates[i]
            .predicted_step_time_s
            .is_some_and(|t| t <= chosen_time * RACE_WITHIN)
    };
    let (near_ones, far): (Vec<usize>, Vec<usize>) = racers.into_iter().partition(|&i| near(i));
    let mut racers = race_order(&candidates, chosen, near_ones);
    racers.truncate(RACE_MAX);
    // Then, while the race's time lasts, the best predicted of each family not raced
    // yet up to `RACE_FAMILY_WITHIN`: a prediction from small runs of a step of a few
    // hundredths of a second can be off by 3x (a lever that costs nothing predicted at
    // 0.065 s, measured 0.017 s).
    let mut families: std::collections::HashSet<_> = racers
        .iter()
        .chain([&chosen])
        .map(|&i| family(&candidates[i].choice))
        .collect();
    racers.extend(
        far.into_iter()
            .filter(|&i| families.insert(family(&candidates[i].choice))),
    );
    let mut raced = 1;
    let mut runners_up_over_budget = 0;
    let race_s = RACE_S.max(RACE_SHARE * started.elapsed().as_secs_f64());
    let deadline = Instant::now() + std::time::Duration::from_secs_f64(race_s);
    if !racers.is_empty() {
        (search.progress)(&FitEvent::RunnersUp {
            count: racers.len(),
        });
    }
    for i in racers {
        let predicted = candidates[i].predicted_step_time_s.unwrap_or(0.0);
        let runs = runs_for(predicted, 2.0 * ONE_RUN_FROM_S);
        if !ends_before(predicted * runs as f64, deadline) {
            continue;
        }
        run_already.insert(i);
        match search.run_real_times(&candidates[i].choice, runs) {
            Ok(p) => {
                raced += 1;
                candidates[i].measured_peak_bytes = Some(p.peak_bytes);
                candidates[i].measured_step_time_s = Some(p.time_s);
            }
            Err(ProbeError::OutOfMemory(e)) => {
                runners_up_over_budget += 1;
                candidates[i].note = Some(format!("did not fit when run: {e}"));
            }
            // A runner-up that fails is left out; the choice stands.
            Err(ProbeError::Failed(e)) => candidates[i].note = Some(e),
        }
    }

    // Steps a few percent apart swap places from one run to the next, and a busy
    // machine runs a step a third slower one second than the next: the close ones
    // (the fastest predicted among them, measured first, while the machine may still
    // have been busy with the probes) are compared in rounds, over the same moments of
    // the machine, each by its median over the rounds corrected for the machine's
    // speed in each round.
    let mut close = close_to_fastest(&candidates, RECHECK_WITHIN, chosen);
    sort_by_measured_time(&mut close, &candidates);
    // The one confirmed first stays in (first, so never left out for time): its one
    // measurement came right after the probes, on a machine perhaps still busy.
    if let Some(at) = close.iter().position(|&i| i == chosen) {
        close.remove(at);
        close.insert(0, chosen);
    }
    close.truncate(RECHECK_MAX);
    if close.len() > 1 {
        (search.progress)(&FitEvent::Rounds { count: close.len() });
    }
    let before = started.elapsed().as_secs_f64();
    let recheck_s = RECHECK_S.max(RECHECK_SHARE * before);
    let cheap_s = recheck_s.max(CHEAP_SHARE * before);
    let rechecked = search.rounds(
        &mut candidates,
        close,
        Rounds {
            least: RECHECK_MIN_ROUNDS,
            most: RECHECK_MAX_ROUNDS,
            until: Instant::now() + std::time::Duration::from_secs_f64(recheck_s),
            until_cheap: Instant::now() + std::time::Duration::from_secs_f64(cheap_s),
            least_within: true,
            out_over: RECHECK_OUT_OVER,
            keep: None,
        },
    );
    // The fastest of those still in the rounds at their end (their times are medians
    // over the same rounds; the others' the fastest of a few runs, or a median over
    // fewer rounds: not comparable), else, if every one of them failed when run again,
    // the fastest of all run, however measured.
    match fastest_of(&candidates, &rechecked).or_else(|| fastest_of_run(&candidates, &run_already))
    {
        Some(best) => chosen = best,
        // Every one failed when run again: nothing is known to fit.
        None => return Err(search.infeasible(&candidates, request)?),
    }

    let mut fastest_measured = None;
    if request.exhaustive {
        (search.progress)(&FitEvent::Exhaustive {
            count: (0..candidates.len())
                .filter(|i| !run_already.contains(i))
                .count(),
        });
        for (i, c) in candidates.iter_mut().enumerate() {
            if run_already.contains(&i) {
                continue; // the choice, a runner-up, one that did not fit
            }
            // Runs are not stopped at the budget (their peak is measured): one known
            // not to fit, or predicted far over, would only take its memory for real.
            let far_over = c
                .predicted_peak_bytes
                .is_none_or(|p| p as f64 > EXHAUSTIVE_RUN_WITHIN * request.budget_bytes as f64);
            if far_over {
                c.note.get_or_insert_with(|| {
                    format!(
                        "not run at its real size: predicted over {EXHAUSTIVE_RUN_WITHIN}x the budget"
                    )
                });
                continue;
            }
            match search.run_real(&c.choice) {
                Ok(p) => {
                    c.measured_peak_bytes = Some(p.peak_bytes);
                    c.measured_step_time_s = Some(p.time_s);
                }
                Err(ProbeError::OutOfMemory(_)) => {
                    c.note = Some("over the budget when run at its real size".into())
                }
                Err(ProbeError::Failed(e)) => c.note = Some(e),
            }
        }
        // The check compares the choice with the fastest of the grid: every close one
        // (the choice too) gets the same extra runs.
        let mut close = close_to_fastest(&candidates, EXHAUSTIVE_RECHECK_WITHIN, chosen);
        sort_by_measured_time(&mut close, &candidates);
        let until = Instant::now() + std::time::Duration::from_secs_f64(EXHAUSTIVE_ROUNDS_S);
        let compared = search.rounds(
            &mut candidates,
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
        );
        if candidates[chosen].measured_step_time_s.is_none() {
            // The choice failed when run again: the next best of those fit measured
            // before the check (the check's own measurements do not choose).
            match fastest_of_run(&candidates, &run_already) {
                Some(best) => chosen = best,
                None => return Err(search.infeasible(&candidates, request)?),
            }
        }
        let all: Vec<usize> = (0..candidates.len()).collect();
        fastest_measured = fastest_of(&candidates, &compared)
            .or_else(|| fastest_of(&candidates, &all))
            .map(|i| candidates[i].clone());
    }

    // Leave the workload on the chosen schedule.
    let schedule = candidates[chosen]
        .choice
        .schedule()
        .cloned()
        .unwrap_or_else(|| Schedule::plain(search.workload.layers().len()));
    let _ = search.workload.layers_mut().set_schedule(schedule);

    let c = &candidates[chosen];
    let mut why = why(c, &candidates, target, request, global, raced);
    if let Some(op) = &coupling {
        why.push_str(&format!(
            "; {}",
            coupling_sentence(op, request.allow.micro_batches)
        ));
    }
    Ok(FitReport {
        model: search.workload.name().to_owned(),
        budget_bytes: request.budget_bytes,
        global_batch: global,
        margin: request.margin,
        allow: request.allow,
        sample_coupling_op: coupling.clone(),
        choice: c.choice.clone(),
        predicted_peak_bytes: c.predicted_peak_bytes.unwrap_or(0),
        measured_peak_bytes: c.measured_peak_bytes.unwrap_or(0),
        predicted_step_time_s: c.predicted_step_time_s.unwrap_or(0.0),
        measured_step_time_s: c.measured_step_time_s.unwrap_or(0.0),
        tries,
        small_runs_over_budget: search.small_over,
        runners_up_over_budget,
        why,
        front: front(&candidates),
        candidates,
        fastest_measured,
        fit_time_s: started.elapsed().as_secs_f64(),
    })
}

/// A set of levers besides micro-batching and recompute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
struct Levers {
    offload: bool,
    offload_grads: bool,
    in_backward: bool,
    bf16: bool,
    compress: bool,
    int8_state: bool,
}

impl Levers {
    fn apply(&self, choice: Choice) -> Choice {
        choice.with(|c| {
            c.offload = self.offload;
            c.offload_grads = self.offload_grads;
            c.in_backward = self.in_backward;
            c.autocast_bf16 = self.bf16;
            c.compress_int8 = self.compress;
            c.int8_state = self.int8_state;
        })
    }
}

/// Sorts candidate indices by predicted step time, fastest first (unknown last); equal
/// times (to a tenth of a microsecond) put fewer micro-batches first. Small probes
/// often cannot tell a micro-batch's fixed cost from noise and predict it as zero, so
/// splits of the same configuration come out equal, but each micro-batch costs a
/// launch of every operation.
fn sort_by_predicted_time(indices: &mut [usize], candidates: &[Candidate]) {
    let key = |i: usize| {
        let t = candidates[i].predicted_step_time_s.unwrap_or(f64::INFINITY);
        let t = if t.is_finite() {
            (t * 1e7).round()
        } else {
            f64::INFINITY
        };
        (t, candidates[i].choice.micro_batches)
    };
    indices.sort_by(|&a, &b| {
        let (ta, ka) = key(a);
        let (tb, kb) = key(b);
        ta.total_cmp(&tb).then(ka.cmp(&kb))
    });
}

/// Each configuration's median time over rounds run on a machine whose speed changes
/// from round to round: `samples[c][r]` is configuration `c`'s time in round `r`. Each
/// round's times are first scaled by the round's speed: the geometric mean of the
/// rounds' levels (the geometric mean of a round's times) over the round's own level,
/// so a round the machine ran slowly in counts as fast as the others. Rounds are those
/// all configurations ran in (the shortest list).
fn speed_corrected_medians(samples: &[Vec<f64>]) -> Vec<f64> {
    let rounds = samples.iter().map(Vec::len).min().unwrap_or(0);
    let level = |r: usize| samples.iter().map(|s| s[r].ln()).sum::<f64>() / samples.len() as f64;
    let levels: Vec<f64> = (0..rounds).map(level).collect();
    let overall = levels.iter().sum::<f64>() / rounds.max(1) as f64;
    samples
        .iter()
        .map(|s| {
            let corrected: Vec<f64> = (0..rounds)
                .map(|r| s[r] * (overall - levels[r]).exp())
                .collect();
            median(&corrected).unwrap_or(f64::INFINITY)
        })
        .collect()
}

/// The positions in `medians` over `factor` times the least, ascending, save those
/// `keep` marks.
fn out_of_contention(medians: &[f64], keep: &[bool], factor: f64) -> Vec<usize> {
    let least = medians.iter().copied().fold(f64::INFINITY, f64::min);
    (0..medians.len())
        .filter(|&at| !keep[at] && medians[at] > least * factor)
        .collect()
}

/// The median of `times` (the mean of the middle two for an even count), if any.
fn median(times: &[f64]) -> Option<f64> {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    let n = t.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(t[n / 2]),
        _ => Some((t[n / 2 - 1] + t[n / 2]) / 2.0),
    }
}

/// Sorts measured candidate indices by measured step time, fastest first.
fn sort_by_measured_time(indices: &mut [usize], candidates: &[Candidate]) {
    indices.sort_by(|&a, &b| {
        let t = |i: usize| candidates[i].measured_step_time_s.unwrap_or(f64::INFINITY);
        t(a).total_cmp(&t(b))
    });
}

/// Whether something that takes `seconds` from now ends before `deadline`.
fn ends_before(seconds: f64, deadline: Instant) -> bool {
    let now = Instant::now();
    now <= deadline && seconds <= (deadline - now).as_secs_f64()
}

/// The measured candidates whose time is within `factor` of the fastest measured,
/// and `also` if it was measured.
fn close_to_fastest(candidates: &[Candidate], factor: f64, also: usize) -> Vec<usize> {
    let all: Vec<usize> = (0..candidates.len()).collect();
    let Some(best) = fastest_of(candidates, &all).and_then(|i| candidates[i].measured_step_time_s)
    else {
        return Vec::new();
    };
    all.into_iter()
        .filter(|&i| {
            candidates[i]
                .measured_step_time_s
                .is_some_and(|t| t <= best * factor || i == also)
        })
        .collect()
}

/// The fastest measured of the candidates in `run` (those run at their real size
/// before any check), if any still has a measurement.
fn fastest_of_run(
    candidates: &[Candidate],
    run: &std::collections::HashSet<usize>,
) -> Option<usize> {
    let mut run: Vec<usize> = run.iter().copied().collect();
    run.sort_unstable();
    fastest_of(candidates, &run)
}

/// The one of `indices` with the least measured time, if any was measured.
fn fastest_of(candidates: &[Candidate], indices: &[usize]) -> Option<usize> {
    indices
        .iter()
        .copied()
        .filter(|&i| candidates[i].measured_step_time_s.is_some())
        .min_by(|&a, &b| {
            let t = |i: usize| candidates[i].measured_step_time_s.unwrap_or(f64::INFINITY);
            t(a).total_cmp(&t(b))
        })
}

/// `racers` (sorted fastest predicted first) in the order to race them: the first of
/// each family, then the second of each, and so on (the choice counts as its family's
/// first). Predictions within a family are alike, yet on the CPU a split into more,
/// smaller micro-batches is sometimes measured faster (the allocator reuses smaller
/// blocks instead of mapping fresh pages), so splits are raced, after the other ways
/// to fit.
fn race_order(candidates: &[Candidate], chosen: usize, racers: Vec<usize>) -> Vec<usize> {
    let mut seen = HashMap::from([(family(&candidates[chosen].choice), 1usize)]);
    let mut ranked: Vec<(usize, usize)> = racers
        .into_iter()
        .map(|i| {
            let n = seen.entry(family(&candidates[i].choice)).or_insert(0);
            *n += 1;
            (*n, i)
        })
        .collect();
    ranked.sort_by_key(|&(rank, _)| rank); // stable: fastest predicted first in a rank
    ranked.into_iter().map(|(_, i)| i).collect()
}

/// The configuration `c` is one split of: its levers and recompute schedule.
fn family(c: &Choice) -> (String, Option<String>) {
    (lever_key(c), c.checkpoint.clone())
}

/// The lever sets to consider: plain and offload, each also with the optimizer step in
/// backward when there is an optimizer; then the allowed lossy ones.
fn lever_sets(request: &FitRequest, has_optimizer: bool) -> Vec<Levers> {
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
fn grad_lever_sets(request: &FitRequest, has_optimizer: bool) -> Vec<Levers> {
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

/// Micro-batch counts giving distinct largest micro-batches, fewest first.
fn splits(global: i64) -> Vec<usize> {
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

fn div_ceil(a: i64, b: i64) -> i64 {
    (a + b - 1) / b.max(1)
}

/// The sizes of `k` micro-batches of `global` examples, as even as possible.
fn split_sizes(global: i64, k: usize) -> Vec<i64> {
    let k = k.max(1) as i64;
    (0..k)
        .map(|i| global / k + i64::from(i < global % k))
        .collect()
}

/// Two probe sizes below `largest`: about `largest / fraction` and twice that.
/// Small probes are cheap and, when their allocations line up event for event, exact
/// (see `Affine`); offloading ones do not line up (the writer thread's pace decides
/// when memory is freed), so they are probed closer to the real size.
fn probe_sizes_of(largest: i64, fraction: i64) -> (i64, i64) {
    let s2 = div_ceil(largest, fraction / 2).max(1);
    let s1 = div_ceil(s2, 2).max(1);
    if s1 == s2 && s2 < largest {
        (s1, s2 + 1)
    } else {
        (s1, s2)
    }
}

/// [`probe_sizes_of`] for `choice`.
fn probe_sizes_for(choice: &Choice, largest: i64) -> (i64, i64) {
    probe_sizes_of(largest, if choice.offload { 4 } else { 8 })
}

type AffineKey = (String, bool);

struct Search<'w> {
    workload: &'w mut dyn Workload,
    budget: u64,
    target: u64,
    global: i64,
    affines: HashMap<AffineKey, Option<Affine>>,
    profiles: Option<(ChainProfile, i64, ChainProfile, i64)>,
    small_over: usize,
    /// Small runs made so far, by configuration, size and micro-batch count.
    probes: HashMap<(String, i64, usize), Option<super::probe::Probe>>,
    /// Told what the search is doing ([`fit_with`]).
    progress: &'w mut dyn FnMut(&FitEvent),
    /// Micro-batches change this step (it couples the samples of a batch).
    lossy_split: bool,
}

impl Search<'_> {
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
                "{}|{:?}|{}",
                lever_key(choice),
                choice.checkpoint,
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
        let mut carried: Option<(i64, super::probe::Probe)> = None;
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
            if recorded && !affine.is_exact() && s1 < s2 && s2 < largest && fails_from.is_none() {
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
    ) -> Result<Option<super::probe::Probe>, FitError> {
        // The same configuration at the same size is run once (accumulation with
        // offload is probed at each split's own size, and those repeat).
        let key = (
            format!("{}|{:?}", lever_key(choice), choice.checkpoint),
            batch,
            n,
        );
        if let Some(known) = self.probes.get(&key) {
            return Ok(known.clone());
        }
        let outcome = match probe(
            self.workload,
            choice,
            batch,
            n,
            PROBE_RUNS,
            Some(self.budget),
            true,
        ) {
            Ok(p) => Some(p),
            Err(ProbeError::OutOfMemory(_)) => {
                self.small_over += 1;
                None
            }
            Err(ProbeError::Failed(e)) => return Err(FitError::Step(e)),
        };
        self.probes.insert(key, outcome.clone());
        Ok(outcome)
    }

    /// Rounds in which each of `indices` (fastest measured first) is run again once,
    /// in turn; a round runs forwards, the next backwards, so no one always runs right
    /// after another. How many, and who drops out: see [`Rounds`]. Each that took part
    /// then has as its measured time the median of its times in the rounds, after
    /// every round's times are scaled by how fast the machine ran in it
    /// ([`speed_corrected_medians`]): this machine's speed swings by a third from one
    /// second to the next, and the fastest of a few runs says more about the moment
    /// one ran in than about the configuration. One that fails when run again loses
    /// its measurement. Returns those still in the rounds at the end with a
    /// measurement (none if no round ran).
    fn rounds(
        &mut self,
        candidates: &mut [Candidate],
        mut indices: Vec<usize>,
        rounds: Rounds,
    ) -> Vec<usize> {
        let round_s = |indices: &[usize], candidates: &[Candidate]| {
            indices
                .iter()
                .filter_map(|&i| candidates[i].measured_step_time_s)
                .map(|t| t * runs_for(t, ONE_RUN_FROM_S) as f64)
                .sum::<f64>()
        };
        let mut least = rounds.least;
        if rounds.least_within {
            // Fewer contenders first, then fewer rounds (down to two), then none.
            while !ends_before(least as f64 * round_s(&indices, candidates), rounds.until) {
                if indices.len() > 2 {
                    indices.pop();
                } else if least > 2 {
                    least -= 1;
                } else {
                    return Vec::new();
                }
            }
        }
        let mut times: HashMap<usize, Vec<f64>> = HashMap::new();
        // Those out of the rounds, with their medians when they went out.
        let mut out: Vec<(usize, f64)> = Vec::new();
        for round in 0..rounds.most {
            indices.retain(|&i| candidates[i].measured_step_time_s.is_some());
            if round > least && indices.len() > 1 {
                let samples: Vec<Vec<f64>> = indices.iter().map(|i| times[i].clone()).collect();
                let medians = speed_corrected_medians(&samples);
                let keep: Vec<bool> = indices.iter().map(|&i| Some(i) == rounds.keep).collect();
                for at in out_of_contention(&medians, &keep, rounds.out_over)
                    .into_iter()
                    .rev()
                {
                    out.push((indices.remove(at), medians[at]));
                }
            }
            let this_round_s = round_s(&indices, candidates);
            let in_time = ends_before(this_round_s, rounds.until)
                || (this_round_s <= CHEAP_ROUND_S && ends_before(this_round_s, rounds.until_cheap));
            if indices.len() < 2 || (round >= least && !in_time) {
                break;
            }
            let mut order = indices.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let c = &mut candidates[i];
                let runs = runs_for(c.measured_step_time_s.unwrap_or(0.0), ONE_RUN_FROM_S);
                match self.run_real_times(&c.choice, runs) {
                    Ok(p) => {
                        times.entry(i).or_default().push(p.time_s);
                        c.measured_peak_bytes = c.measured_peak_bytes.map(|b| b.max(p.peak_bytes));
                    }
                    Err(e) => {
                        c.measured_step_time_s = None;
                        c.measured_peak_bytes = None;
                        c.note = Some(format!("failed when run again: {}", e.message()));
                    }
                }
            }
        }
        indices.retain(|i| times.contains_key(i) && candidates[*i].measured_step_time_s.is_some());
        let samples: Vec<Vec<f64>> = indices.iter().map(|i| times[i].clone()).collect();
        // Those out keep the median they went out with (reported, never chosen: each
        // was scaled among the contenders of its time, not of the end).
        out.extend(
            indices
                .iter()
                .copied()
                .zip(speed_corrected_medians(&samples)),
        );
        for &(i, time) in &out {
            candidates[i].measured_step_time_s = Some(time);
        }
        indices
    }

    /// `choice` run at its real size, the global batch, its peak checked against the
    /// budget (a confirmation, a runner-up, an exhaustive measurement).
    fn run_real(&mut self, choice: &Choice) -> Result<super::probe::Probe, ProbeError> {
        self.run_real_times(choice, REAL_RUNS)
    }

    /// `run_real` with `runs` steps (the fastest gives the time).
    fn run_real_times(
        &mut self,
        choice: &Choice,
        runs: usize,
    ) -> Result<super::probe::Probe, ProbeError> {
        probe(
            self.workload,
            choice,
            self.global,
            choice.micro_batches,
            runs,
            Some(self.budget),
            false,
        )
    }

    /// The candidate `choice` with `k` micro-batches of at most `m` examples.
    fn evaluate(
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
        Ok(match affine {
            Some(a) if a.known_over(m) => Candidate {
                choice: choice.clone(),
                predicted_peak_bytes: None,
                predicted_step_time_s: Some(a.time(&split_sizes(self.global, k))),
                predicted_fits: false,
                measured_peak_bytes: None,
                measured_step_time_s: None,
                note: Some(format!(
                    "over {}: a smaller micro-batch already was",
                    Bytes(self.budget)
                )),
            },
            Some(a) => {
                let sizes = split_sizes(self.global, k);
                let later = sizes.get(1).copied().unwrap_or(m);
                let peak = if k > 1 {
                    a.peak_split(m, later)
                } else {
                    a.peak(m)
                };
                Candidate {
                    choice: choice.clone(),
                    predicted_peak_bytes: peak,
                    predicted_step_time_s: Some(a.time(&split_sizes(self.global, k))),
                    predicted_fits: peak.is_some_and(|p| p <= self.target),
                    measured_peak_bytes: None,
                    measured_step_time_s: None,
                    note: peak.is_none().then(|| {
                        format!(
                            "only micro-batches of one example were measured within {}",
                            Bytes(self.budget)
                        )
                    }),
                }
            }
            None => Candidate {
                choice: choice.clone(),
                predicted_peak_bytes: None,
                predicted_step_time_s: None,
                predicted_fits: false,
                measured_peak_bytes: None,
                measured_step_time_s: None,
                note: Some(format!(
                    "a micro-batch of one example does not fit {}",
                    Bytes(self.budget)
                )),
            },
        })
    }

    /// The layer profile at micro-batch `m`, from two measured profiles.
    fn profile(&mut self, m: i64) -> Result<ChainProfile, FitError> {
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
            self.profiles = Some((pa, a, pb, b));
        }
        let (pa, a, pb, b) = self.profiles.as_ref().expect("profiled above");
        Ok(profile_at(pa, *a, pb, *b, m))
    }

    /// The recompute candidate of `base` at `k` micro-batches of at most `m`: the
    /// solver's schedule with the least recomputation whose real peak is predicted
    /// within the target, adjusted until the prediction from real runs agrees.
    fn recompute(
        &mut self,
        base: &Choice,
        m: i64,
        k: usize,
    ) -> Result<Option<Candidate>, FitError> {
        let mut profile = self.profile(m)?;
        if base.offload_grads {
            // The gradients do not stay: the solver's model must not keep them.
            for e in &mut profile.elements {
                e.param_grad_bytes = 0;
            }
        }
        let layers = self.workload.layers().len();
        let plain = Schedule::plain(layers);
        let model_plain = predict(&profile, &plain).peak_bytes;
        // What the real step adds to the solver's model (accumulated gradients,
        // optimizer state...), taken from the plain configuration's prediction.
        let extra = match self.evaluate(base, m, k, None)?.predicted_peak_bytes {
            Some(real) => real.saturating_sub(model_plain),
            None => 0,
        };
        let mut solver_budget = self.target.saturating_sub(extra);
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
                .map(|p| p.saturating_sub(self.target));
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

    /// The error for a budget nothing fits: the smallest budget that would do, and
    /// what it takes. The configurations with the least memory (one example per
    /// micro-batch, each lever set, with and without the solver's least-memory
    /// schedule) are run once without the budget to learn their peaks; the lossy
    /// levers not allowed are run too, to say what allowing them would reach.
    fn infeasible(
        &mut self,
        candidates: &[Candidate],
        request: &FitRequest,
    ) -> Result<FitError, FitError> {
        let k = self.global as usize;
        let n = if k > 1 { 2 } else { 1 };
        let has_optimizer = self.workload.optimizer().is_some();
        let mut everything = FitRequest::new(request.budget_bytes);
        everything.allow = super::Allow::all();
        let lossy_split = self.lossy_split;
        let allowed = |l: &Levers, k: usize| {
            (!l.bf16 || request.allow.bf16)
                && (!l.compress || request.allow.compress)
                && (!l.int8_state || request.allow.int8_state)
                && (k == 1 || !lossy_split || request.allow.micro_batches)
        };
        let least_memory = {
            let profile = self.profile(1)?;
            Solver::new(&profile).f_min_memory().ok()
        };
        let mut best_allowed: Option<(u64, String)> = candidates
            .iter()
            .filter(|c| c.choice.micro_batches == k || c.predicted_fits)
            .filter_map(|c| Some((c.predicted_peak_bytes?, c.choice.strategy.clone())))
            .min_by_key(|(p, _)| *p);
        let mut best_lossy: Option<(u64, String)> = None;
        let sets = lever_sets(&everything, has_optimizer)
            .into_iter()
            .chain(grad_lever_sets(&everything, has_optimizer));
        for levers in sets {
            // One example per micro-batch, or, for the optimizer step in backward
            // (which frees the gradients accumulation needs, unless they are in
            // files), the whole batch at once.
            let (k, n, batch) = if levers.in_backward && !levers.offload_grads {
                (1, 1, self.global)
            } else {
                (k, n, n as i64)
            };
            let plain = levers.apply(Choice::new(self.global, k));
            let mut choices = vec![plain.clone()];
            if let (Some(s), false) = (&least_memory, levers.offload || levers.compress) {
                choices.push(plain.with_schedule(Some(s.clone())));
            }
            for choice in choices {
                // The whole batch at once is worth running only below the least peak
                // found so far. Runs are not stopped at a peak (a simulated capacity
                // would make the workload's own code fail), so the whole batch is first
                // predicted from runs of one and two examples, and run only when that
                // beats the least peak: one that cannot would take its full memory.
                let cap = if levers.in_backward {
                    best_allowed.as_ref().map(|(p, _)| *p)
                } else {
                    None
                };
                if let (Some(cap), true) = (cap, batch > 2) {
                    if self.predict_whole_batch(&choice)?.is_none_or(|p| p >= cap) {
                        continue;
                    }
                }
                let peak = match probe(self.workload, &choice, batch, n, 1, cap, true) {
                    Ok(p) => p.peak_bytes,
                    Err(ProbeError::OutOfMemory(_)) => continue,
                    Err(ProbeError::Failed(e)) => return Err(FitError::Step(e)),
                };
                let slot = if allowed(&levers, k) {
                    &mut best_allowed
                } else {
                    &mut best_lossy
                };
                if slot.as_ref().is_none_or(|(p, _)| peak < *p) {
                    *slot = Some((peak, choice.strategy.clone()));
                }
            }
        }
        let need = |peak: u64| Bytes(budget_for(peak, request.margin));
        let mut hint = String::new();
        if let (Some((lossy, how)), Some((lossless, _))) = (&best_lossy, &best_allowed) {
            if lossy < lossless {
                hint = format!(
                    "allowing lossy levers would need {} ({how}); ",
                    need(*lossy)
                );
            }
        }
        Ok(match best_allowed {
            Some((peak, how)) => FitError::Infeasible {
                budget_bytes: request.budget_bytes,
                smallest_bytes: budget_for(peak, request.margin),
                how: format!("{how}, predicted peak {}", Bytes(peak)),
                hint: format!(
                    "{hint}give a budget of at least {} (the peak and the margin)",
                    need(peak)
                ),
            },
            None => FitError::Infeasible {
                budget_bytes: request.budget_bytes,
                smallest_bytes: request.budget_bytes,
                how: "none: not even one example per micro-batch ran".into(),
                hint: format!(
                    "{hint}give a larger budget (the parameters' gradients alone take {})",
                    Bytes(self.gradient_bytes())
                ),
            },
        })
    }
}

impl Search<'_> {
    /// The peak of `choice` on the whole batch in one micro-batch, predicted from runs
    /// of one and two examples without the budget; `None` when they did not run (out
    /// of the machine's memory).
    fn predict_whole_batch(&mut self, choice: &Choice) -> Result<Option<u64>, FitError> {
        let mut at = |size: i64| match probe(self.workload, choice, size, 1, 1, None, true) {
            Ok(p) => Ok(Some(p)),
            Err(ProbeError::OutOfMemory(_)) => Ok(None),
            Err(ProbeError::Failed(e)) => Err(FitError::Step(e)),
        };
        let (Some(p1), Some(p2)) = (at(1)?, at(2)?) else {
            return Ok(None);
        };
        Ok(Affine::fit(1, &p1, 2, &p2, 1.0).peak(self.global))
    }

    /// Bytes of the gradients of every parameter (a lower bound of any step's peak
    /// without the optimizer step in backward).
    fn gradient_bytes(&self) -> u64 {
        self.workload
            .parameters()
            .iter()
            .map(|p| p.numel() as u64 * p.kind().elt_size_in_bytes() as u64)
            .sum()
    }
}

/// The budget to recommend for a configuration whose peak was `peak`: accepted with
/// `margin`, with 2% more for what varies between runs (an offload store's writer
/// thread frees memory at its own pace).
fn budget_for(peak: u64, margin: f64) -> u64 {
    (peak as f64 * 1.02 / (1.0 - margin)).ceil() as u64 + 1
}

fn lever_key(c: &Choice) -> String {
    format!(
        "{}{}{}{}{}{}",
        u8::from(c.offload),
        u8::from(c.offload_grads),
        u8::from(c.in_backward),
        u8::from(c.autocast_bf16),
        u8::from(c.compress_int8),
        u8::from(c.int8_state)
    )
}

/// Candidates that no other beats in both predicted peak and time, by peak.
fn front(candidates: &[Candidate]) -> Vec<Candidate> {
    let known: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.predicted_peak_bytes.is_some() && c.predicted_step_time_s.is_some())
        .collect();
    let mut front: Vec<Candidate> = known
        .iter()
        .filter(|c| {
            let (p, t) = (
                c.predicted_peak_bytes.unwrap_or(0),
                c.predicted_step_time_s.unwrap_or(0.0),
            );
            !known.iter().any(|o| {
                let (op, ot) = (
                    o.predicted_peak_bytes.unwrap_or(0),
                    o.predicted_step_time_s.unwrap_or(0.0),
                );
                (op <= p && ot <= t) && (op < p || ot < t)
            })
        })
        .map(|c| (*c).clone())
        .collect();
    front.sort_by_key(|c| c.predicted_peak_bytes);
    front
}

/// Why micro-batches are lossy for a step that runs `op`, in one sentence, and whether
/// they were considered.
fn coupling_sentence(op: &str, allowed: bool) -> String {
    format!(
        "the step runs {op} in training mode, which normalizes each sample with the whole batch's statistics: micro-batches change the gradients and the running statistics, so {}",
        if allowed {
            "they are a lossy lever here (allowed)"
        } else {
            "they were not considered (allow micro_batches to consider them)"
        }
    )
}

fn why(
    chosen: &Candidate,
    candidates: &[Candidate],
    target: u64,
    request: &FitRequest,
    global: i64,
    raced: usize,
) -> String {
    let fitting = candidates.iter().filter(|c| c.predicted_fits).count();
    let mut why = format!(
        "the fastest predicted of {fitting} configurations whose predicted peak is within {} (the budget less a {:.0}% margin)",
        Bytes(target),
        request.margin * 100.0
    );
    if raced > 1 {
        why = format!(
            "the fastest measured of {raced} configurations run at their real size: the fastest predicted of {fitting} whose predicted peak is within {} (the budget less a {:.0}% margin) and runners-up predicted within {RACE_WITHIN}x its time (each other family's best within {RACE_FAMILY_WITHIN}x)",
            Bytes(target),
            request.margin * 100.0
        );
        if !chosen.predicted_fits {
            why.push_str(&format!(
                "; its predicted peak is above the margin, its measured peak {} within the budget",
                Bytes(chosen.measured_peak_bytes.unwrap_or(0))
            ));
        }
    }
    let t = chosen.predicted_step_time_s.unwrap_or(0.0);
    if let Some(faster) = candidates
        .iter()
        .filter(|c| !c.predicted_fits && c.predicted_step_time_s.is_some_and(|ct| ct < t))
        .min_by(|a, b| {
            a.predicted_step_time_s
                .unwrap_or(0.0)
                .total_cmp(&b.predicted_step_time_s.unwrap_or(0.0))
        })
    {
        why.push_str(&format!(
            "; faster would be {} ({:.3} s) but it needs {}",
            faster.choice.strategy,
            faster.predicted_step_time_s.unwrap_or(0.0),
            faster
                .predicted_peak_bytes
                .map_or("more".to_owned(), |b| Bytes(b).to_string())
        ));
    }
    if chosen.choice.micro_batches > 1 {
        why.push_str(&format!(
            "; the global batch of {global} is kept as {} micro-batches with accumulated gradients",
            chosen.choice.micro_batches
        ));
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(k: usize, offload: bool, time: f64) -> Candidate {
        Candidate {
            choice: Choice::new(64, k).with(|c| c.offload = offload),
            predicted_peak_bytes: Some(1),
            predicted_step_time_s: Some(time),
            predicted_fits: true,
            measured_peak_bytes: None,
            measured_step_time_s: None,
            note: None,
        }
    }

    #[test]
    fn equal_predicted_times_put_fewer_micro_batches_first() {
        // Sums of per-micro-batch times differ in their last bits from split to split.
        let cs = vec![
            candidate(8, false, 0.1 + 1e-15),
            candidate(2, false, 0.1),
            candidate(4, false, 0.1 - 1e-15),
            candidate(1, false, 0.2),
        ];
        let mut order = vec![0, 1, 2, 3];
        sort_by_predicted_time(&mut order, &cs);
        assert_eq!(order, vec![1, 2, 0, 3]);
    }

    #[test]
    fn the_fastest_measured_is_found_and_failed_runs_are_out() {
        let measured = |k: usize, predicted: f64, measured: Option<f64>| Candidate {
            measured_step_time_s: measured,
            ..candidate(k, false, predicted)
        };
        let cs = vec![
            measured(2, 2.0, Some(1.1)),
            measured(3, 2.0, Some(1.0)),
            measured(4, 1.0, Some(1.3)),
            measured(5, 0.5, None), // failed when run again
        ];
        assert_eq!(fastest_of(&cs, &[0, 1, 2, 3]), Some(1));
        assert_eq!(close_to_fastest(&cs, 1.25, 0), vec![0, 1]);
        assert_eq!(close_to_fastest(&cs, 1.25, 2), vec![0, 1, 2]);
        assert_eq!(close_to_fastest(&cs, 1.25, 3), vec![0, 1]); // not measured: out
        assert_eq!(fastest_of(&cs, &[3]), None);
    }

    #[test]
    fn a_round_the_whole_machine_ran_slowly_in_counts_as_the_others() {
        // Round 1 ran at half speed for both; B is 1.1x A in every round.
        let t = speed_corrected_medians(&[vec![1.0, 2.0, 1.0], vec![1.1, 2.2, 1.1]]);
        let cube_root_2 = 2f64.powf(1.0 / 3.0);
        assert!((t[0] - cube_root_2).abs() < 1e-12, "{t:?}");
        assert!((t[1] - 1.1 * cube_root_2).abs() < 1e-12, "{t:?}");
    }

    #[test]
    fn one_slow_run_of_one_configuration_does_not_change_the_ratio() {
        // B is 1.05x A, but its run in round 1 was slow (1.6): the median of the
        // corrected times keeps the 1.05 (the fastest of each would too, but not a
        // mean, and the fastest would be moved by one fast moment instead).
        let t = speed_corrected_medians(&[vec![1.0, 1.0, 1.0], vec![1.05, 1.6, 1.05]]);
        assert!((t[1] / t[0] - 1.05).abs() < 1e-12, "{t:?}");
        // A ragged list: rounds are those all ran in.
        let t = speed_corrected_medians(&[vec![1.0, 1.0], vec![2.0, 2.0, 9.0]]);
        assert!((t[1] / t[0] - 2.0).abs() < 1e-12, "{t:?}");
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn those_far_behind_go_out_of_the_rounds_but_never_the_kept_one() {
        // Least 1.0: over 1.15 are 1.2 (position 1) and 1.3 (position 3, kept);
        // 1.15 itself is not over.
        let out = out_of_contention(&[1.0, 1.2, 1.15, 1.3], &[false, false, false, true], 1.15);
        assert_eq!(out, vec![1]);
        let out = out_of_contention(&[2.0, 1.0, 3.0], &[false; 3], 1.15);
        assert_eq!(out, vec![0, 2]);
        assert!(out_of_contention(&[], &[], 1.15).is_empty());
    }

    #[test]
    fn the_race_takes_each_family_s_best_before_more_splits() {
        let cs = vec![
            candidate(4, false, 0.1), // chosen
            candidate(8, false, 0.1),
            candidate(2, false, 0.1),
            candidate(2, true, 0.12),
            candidate(4, true, 0.12),
            candidate(1, true, 0.13),
        ];
        let mut racers = vec![1, 2, 3, 4, 5];
        sort_by_predicted_time(&mut racers, &cs);
        assert_eq!(racers, vec![2, 1, 3, 4, 5]);
        // Offload's best first (the plain family has the choice), then the second of
        // each family by predicted time, then the third.
        assert_eq!(race_order(&cs, 0, racers), vec![3, 2, 4, 1, 5]);
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
