//! The error for a budget nothing fits: the smallest budget that would do, what reaches
//! it, and what allowing the lossy levers would reach. It runs the configurations with
//! the least memory once, without the budget, to learn their peaks.
use super::candidates::{
    div_ceil, grad_lever_sets, in_modes, lever_sets, params_lever_sets, split_sizes,
    state_lever_sets, Levers,
};
use super::runs::Runs;
use super::tuning::WHOLE_BATCH_WITHIN;
use crate::choice::Choice;
use crate::predict::Affine;
use crate::probe::{probe, ProbeError};
use crate::{Allow, Candidate, FitError, FitRequest, ParallelMode};
use memsave_checkpoint::Solver;
use memsave_meter::{Bytes, BytesAtLeast};
use memsave_step::workload::Workload;

/// The least peak found and the configuration that reaches it, if any.
type Least = Option<(u64, String, u64)>;

/// [`Least`] among the configurations that take lossy levers not allowed, with the
/// names of those levers (see [`lossy_levers`]).
type LossyLeast = Option<(u64, String, u64, String)>;

/// What one example per micro-batch does to BatchNorm here, for the hint.
const ONE_EXAMPLE_SPOILS: &str = "one example per micro-batch turns running statistics NaN \
     here (BatchNorm given one value per channel), so such splits are not counted; ";

/// The error for a budget nothing fits: the smallest budget that would do, and what it
/// takes (see [`least_peaks`]). `Err` only when the workload's step itself failed.
pub(super) fn error(
    runs: &mut Runs<'_>,
    candidates: &[Candidate],
    request: &FitRequest,
) -> Result<FitError, FitError> {
    let (best_allowed, best_lossy, one_example_spoils) = least_peaks(runs, candidates, request)?;
    if one_example_spoils && runs.global == 1 {
        // The whole batch (each rank's share) is one example: no budget helps.
        return Ok(FitError::BatchOfOne {
            world_size: runs.ranks.world_size(),
        });
    }
    let need = |peak: u64, kept: u64| BytesAtLeast(budget_for(peak, kept, request.margin));
    let mut hint = if one_example_spoils {
        ONE_EXAMPLE_SPOILS.to_owned()
    } else {
        String::new()
    };
    if let (Some((lossy, how, kept, names)), Some((lossless, ..))) = (&best_lossy, &best_allowed) {
        if lossy < lossless {
            hint.push_str(&format!(
                "allowing {names} would need {} ({how}); ",
                need(*lossy, *kept)
            ));
        }
    }
    if best_allowed
        .as_ref()
        .is_some_and(|(_, how, _)| how.contains("offload_params"))
    {
        // The least keeps the parameters in files: name the unit that sets its floor.
        let largest = runs
            .param_units
            .as_ref()
            // The first of the largest (max_by_key keeps the last).
            .and_then(|units| units.iter().rev().max_by_key(|(_, b)| *b).cloned());
        if let Some((unit, bytes)) = largest {
            hint.push_str(&format!(
                "with the parameters in files the device still holds one unit's weights while it runs, and its gradients in its backward: the largest, {unit}, takes {} of weights and as much of gradients, besides the input and the activations; ",
                Bytes(bytes)
            ));
        }
    }
    Ok(match best_allowed {
        Some((peak, how, kept)) => FitError::Infeasible {
            budget_bytes: request.budget_bytes,
            smallest_bytes: budget_for(peak, kept, request.margin),
            how: format!("{how}, predicted peak {}", Bytes(peak)),
            hint: format!(
                "{hint}give a budget of at least {} (the peak and the margin)",
                need(peak, kept)
            ),
        },
        None => FitError::Infeasible {
            budget_bytes: request.budget_bytes,
            smallest_bytes: request.budget_bytes,
            how: "none: not even one example per micro-batch ran".into(),
            hint: format!(
                "{hint}give a larger budget (the parameters' gradients alone take {})",
                Bytes(gradient_bytes(&*runs.workload))
            ),
        },
    })
}

/// The least peaks with the allowed levers and with the lossy ones not allowed (to say
/// what allowing them would reach), and whether one example per micro-batch spoiled the
/// running statistics (then only larger micro-batches count). The configurations with the least memory (one
/// example per micro-batch, each lever set, with and without the solver's least-memory
/// schedule) are run once without the budget to learn their peaks; the allowed ones
/// start from the least predicted peak among `candidates` at one example per
/// micro-batch or predicted to fit.
fn least_peaks(
    runs: &mut Runs<'_>,
    candidates: &[Candidate],
    request: &FitRequest,
) -> Result<(Least, LossyLeast, bool), FitError> {
    let k = runs.global as usize;
    let n = if k > 1 { 2 } else { 1 };
    let optimizer = runs.optimizer;
    let has_optimizer = optimizer.is_some();
    let modes: &[ParallelMode] = if runs.ranks.group().is_some() {
        &ParallelMode::ALL
    } else {
        &[]
    };
    let mut everything = FitRequest::new(request.budget_bytes);
    everything.allow = Allow::all();
    let lossy_split = runs.lossy_split;
    let allowed = |l: &Levers, k: usize| lossy_levers(l, k, lossy_split, request.allow).is_empty();
    let least_memory = {
        let profile = runs.profile(1)?;
        Solver::new(&profile).f_min_memory().ok()
    };
    // The least predicted peak among the candidates whose micro-batches hold at least
    // `examples` examples each (the smallest of an uneven split too).
    let global = runs.global;
    let predicted = |examples: i64| -> Least {
        candidates
            .iter()
            .filter(|c| c.choice.micro_batches == k || c.predicted_fits)
            .filter(|c| {
                split_sizes(global, c.choice.micro_batches)
                    .last()
                    .is_some_and(|&smallest| smallest >= examples)
            })
            .filter_map(|c| {
                Some((
                    c.predicted_peak_bytes?,
                    c.choice.strategy.clone(),
                    c.kept_bytes,
                ))
            })
            .min_by_key(|(p, ..)| *p)
    };
    let mut best_allowed: Least = predicted(1);
    // What the runs below found with the allowed levers, and whether one example per
    // micro-batch spoiled the running statistics.
    let mut probed_allowed: Least = None;
    let mut one_example_spoils = false;
    let mut best_lossy: Least = None;
    // The lossy levers `best_lossy` takes, for the hint.
    let mut lossy_names = String::new();
    let sets = lever_sets(&everything, has_optimizer)
        .into_iter()
        .chain(grad_lever_sets(&everything, has_optimizer))
        .chain(state_lever_sets(&everything, optimizer, !modes.is_empty()))
        .chain(params_lever_sets(optimizer, runs.param_units.is_none()))
        .collect();
    // Those a data-parallel mode refuses cannot run at all.
    let unfit = |m: ParallelMode| m.refuses_workload(&*runs.workload);
    let (sets, _refused) = in_modes(sets, modes, optimizer, &unfit);
    // Where a split changes the step (BatchNorm) and is not allowed, the least memory
    // of the allowed levers is the whole batch at once; the split is run too, to say
    // what allowing micro-batches would reach.
    let splits_allowed = !lossy_split || request.allow.micro_batches;
    // Levers that cannot accumulate (see `Levers::accumulates`): the whole batch at
    // once only.
    let shapes = |l: &Levers| match (!l.accumulates(), splits_allowed) {
        (true, _) => vec![true],
        (false, true) => vec![false],
        (false, false) => vec![true, false],
    };
    let shaped: Vec<(Levers, bool)> = sets
        .into_iter()
        .flat_map(|l| shapes(&l).into_iter().map(move |whole| (l, whole)))
        .collect();
    for (levers, whole) in shaped {
        // One example per micro-batch, or the whole batch at once.
        let (k, n, batch) = if whole {
            (1, 1, runs.global)
        } else {
            (k, n, n as i64)
        };
        let plain = levers.apply(Choice::new(runs.global, k));
        let mut choices = vec![plain.clone()];
        if let (Some(s), false) = (&least_memory, levers.offload || levers.compress) {
            choices.push(plain.with_schedule(Some(s.clone())));
        }
        for choice in choices {
            // The whole batch at once is worth running only below the least peak
            // found so far. Runs are not stopped at a peak (a simulated capacity
            // would make the workload's own code fail), so the whole batch is first
            // predicted from runs of one and two examples, and run only when that
            // is within `WHOLE_BATCH_WITHIN` of the least peak: one far above it
            // would take its full memory.
            let cap = if whole {
                best_allowed.as_ref().map(|(p, ..)| *p)
            } else {
                None
            };
            if let (Some(cap), true) = (cap, batch > 2) {
                // Predictions from one and two examples are off by tens of percent
                // (on unet-64px with saves and gradients in files: 21.39 MiB
                // predicted, 16.18 MiB measured), so a near miss runs too.
                let within = cap as f64 * WHOLE_BATCH_WITHIN;
                if predict_whole_batch(runs, &choice)?.is_none_or(|p| p as f64 >= within) {
                    continue;
                }
            }
            // One example per micro-batch first; where that spoils the running
            // statistics, two.
            let mut at = Some((choice, batch, k));
            while let Some((choice, batch, k)) = at.take() {
                let peak = match probe(
                    runs.workload,
                    runs.optimizer,
                    &choice,
                    batch,
                    n,
                    1,
                    cap,
                    true,
                    true,
                    &runs.ranks,
                ) {
                    Ok(p) => p,
                    Err(ProbeError::OutOfMemory(_)) => continue,
                    // Not a configuration to suggest: it spoils the running statistics.
                    Err(ProbeError::Unusable(_)) => {
                        // Said only of what the levers allowed may run.
                        one_example_spoils |= allowed(&levers, k);
                        // As many micro-batches as leave at least two examples in
                        // each, probed at the largest's size.
                        let two = (runs.global / 2) as usize;
                        if batch == n as i64 && n > 1 && two > 1 {
                            let largest = div_ceil(runs.global, two as i64);
                            let wider = levers
                                .apply(Choice::new(runs.global, two))
                                .with_schedule(choice.schedule().cloned());
                            at = Some((wider, largest * n as i64, two));
                        }
                        continue;
                    }
                    Err(ProbeError::Failed(e)) => return Err(FitError::Step(e)),
                    Err(ProbeError::Fatal(e)) => return Err(e),
                };
                // What it keeps from step to step, the least over the ranks (as
                // `Runs::evaluate` agrees it): the peak is agreed already.
                let kept = peak.breakdown.kept() as f64;
                let kept = (-runs.ranks.max(&[-kept])?[0]).max(0.0) as u64;
                let peak = peak.peak_bytes;
                let found = Some((peak, choice.strategy.clone(), kept));
                let slots = if allowed(&levers, k) {
                    vec![&mut best_allowed, &mut probed_allowed]
                } else {
                    if best_lossy.as_ref().is_none_or(|(p, ..)| peak < *p) {
                        let names = lossy_levers(&levers, k, lossy_split, request.allow);
                        lossy_names = format!("lossy levers ({})", names.join(", "));
                    }
                    vec![&mut best_lossy]
                };
                for slot in slots {
                    if slot.as_ref().is_none_or(|(p, ..)| peak < *p) {
                        *slot = found.clone();
                    }
                }
            }
        }
    }
    if one_example_spoils {
        // The candidates of one example per micro-batch were predicted, never run:
        // they would spoil the statistics too. Only larger micro-batches count.
        best_allowed = [probed_allowed, predicted(2)]
            .into_iter()
            .flatten()
            .min_by_key(|(p, ..)| *p);
    }
    let best_lossy = best_lossy.map(|(peak, how, kept)| (peak, how, kept, lossy_names));
    Ok((best_allowed, best_lossy, one_example_spoils))
}

/// The lossy levers `levers` with `k` micro-batches take that `allow` does not (none:
/// the configuration is allowed), by the
/// names of [`Allow`]'s fields with `-` for `_` (as `memsave fit --allow` takes them),
/// e.g. `micro-batches` for a split of a step that couples its samples.
fn lossy_levers(levers: &Levers, k: usize, lossy_split: bool, allow: Allow) -> Vec<&'static str> {
    let used = [
        (lossy_split && k > 1, allow.micro_batches, "micro-batches"),
        (levers.bf16, allow.bf16, "bf16"),
        (levers.compress, allow.compress, "compress"),
        (levers.int8_state, allow.int8_state, "int8-state"),
    ];
    used.iter()
        .filter(|(takes, allowed, _)| *takes && !*allowed)
        .map(|(_, _, name)| *name)
        .collect()
}

/// The peak of `choice` on the whole batch in one micro-batch, predicted from runs
/// of one and two examples without the budget (on ranks, the largest of the ranks'
/// predictions); `None` when they did not run (out of the machine's memory).
fn predict_whole_batch(runs: &mut Runs<'_>, choice: &Choice) -> Result<Option<u64>, FitError> {
    let ranks = runs.ranks.clone();
    let mut at = |size: i64| match probe(
        runs.workload,
        runs.optimizer,
        choice,
        size,
        1,
        1,
        None,
        true,
        false,
        &ranks,
    ) {
        Ok(p) => Ok(Some(p)),
        Err(ProbeError::OutOfMemory(_)) => Ok(None),
        Err(ProbeError::Failed(e) | ProbeError::Unusable(e)) => Err(FitError::Step(e)),
        Err(ProbeError::Fatal(e)) => Err(e),
    };
    let (Some(p1), Some(p2)) = (at(1)?, at(2)?) else {
        return Ok(None);
    };
    let peak = Affine::fit(1, &p1, 2, &p2, 1.0).peak(runs.global);
    let agreed = ranks.max(&[peak.map_or(-1.0, |p| p as f64)])?[0];
    Ok((agreed >= 0.0).then_some(agreed as u64))
}

/// Bytes of the gradients of every parameter (a lower bound of any step's peak
/// without the optimizer step in backward).
fn gradient_bytes(workload: &dyn Workload) -> u64 {
    workload
        .parameters()
        .iter()
        .map(|p| p.numel() as u64 * p.kind().elt_size_in_bytes() as u64)
        .sum()
}

/// The budget to recommend for a configuration whose peak was `peak`, of which it
/// keeps `kept` from step to step (which the margin spares: see `Runs::target`):
/// accepted with `margin`, with 2% more for what varies between runs (an offload
/// store's writer thread frees memory at its own pace).
fn budget_for(peak: u64, kept: u64, margin: f64) -> u64 {
    let peak = peak as f64 * 1.02;
    let kept = (kept as f64).min(peak);
    // Past 2^64 bytes the cast saturates, and so does the byte added.
    (((peak - margin * kept) / (1.0 - margin)).ceil() as u64).saturating_add(1)
}
