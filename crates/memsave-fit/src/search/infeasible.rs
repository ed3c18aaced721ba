//! The error for a budget nothing fits: the smallest budget that would do, what reaches
//! it, and what allowing the lossy levers would reach. It runs the configurations with
//! the least memory once, without the budget, to learn their peaks.
use super::candidates::{grad_lever_sets, in_modes, lever_sets, Levers};
use super::runs::Runs;
use crate::choice::Choice;
use crate::predict::Affine;
use crate::probe::{probe, ProbeError};
use crate::{Allow, Candidate, FitError, FitRequest, ParallelMode};
use memsave_checkpoint::Solver;
use memsave_meter::Bytes;
use memsave_step::workload::Workload;

/// The least peak found and the configuration that reaches it, if any.
type Least = Option<(u64, String)>;

/// The error for a budget nothing fits: the smallest budget that would do, and what it
/// takes (see [`least_peaks`]). `Err` only when the workload's step itself failed.
pub(super) fn error(
    runs: &mut Runs<'_>,
    candidates: &[Candidate],
    request: &FitRequest,
) -> Result<FitError, FitError> {
    let (best_allowed, best_lossy) = least_peaks(runs, candidates, request)?;
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
                Bytes(gradient_bytes(&*runs.workload))
            ),
        },
    })
}

/// The least peaks with the allowed levers and with the lossy ones not allowed (to say
/// what allowing them would reach). The configurations with the least memory (one
/// example per micro-batch, each lever set, with and without the solver's least-memory
/// schedule) are run once without the budget to learn their peaks; the allowed ones
/// start from the least predicted peak among `candidates` at one example per
/// micro-batch or predicted to fit.
fn least_peaks(
    runs: &mut Runs<'_>,
    candidates: &[Candidate],
    request: &FitRequest,
) -> Result<(Least, Least), FitError> {
    let k = runs.global as usize;
    let n = if k > 1 { 2 } else { 1 };
    let optimizer = runs.workload.optimizer();
    let has_optimizer = optimizer.is_some();
    let modes: &[ParallelMode] = if runs.ranks.group().is_some() {
        &ParallelMode::ALL
    } else {
        &[]
    };
    let mut everything = FitRequest::new(request.budget_bytes);
    everything.allow = Allow::all();
    let lossy_split = runs.lossy_split;
    let allowed = |l: &Levers, k: usize| {
        (!l.bf16 || request.allow.bf16)
            && (!l.compress || request.allow.compress)
            && (!l.int8_state || request.allow.int8_state)
            && (k == 1 || !lossy_split || request.allow.micro_batches)
    };
    let least_memory = {
        let profile = runs.profile(1)?;
        Solver::new(&profile).f_min_memory().ok()
    };
    let mut best_allowed: Least = candidates
        .iter()
        .filter(|c| c.choice.micro_batches == k || c.predicted_fits)
        .filter_map(|c| Some((c.predicted_peak_bytes?, c.choice.strategy.clone())))
        .min_by_key(|(p, _)| *p);
    let mut best_lossy: Least = None;
    let sets = lever_sets(&everything, has_optimizer)
        .into_iter()
        .chain(grad_lever_sets(&everything, has_optimizer))
        .collect();
    // Those a data-parallel mode refuses cannot run at all.
    let unfit = |m: ParallelMode| m.refuses_workload(&*runs.workload);
    let (sets, _refused) = in_modes(sets, modes, optimizer, &unfit);
    for levers in sets {
        // One example per micro-batch, or, for the optimizer step in backward
        // (which frees the gradients accumulation needs, unless they are in
        // files), the whole batch at once.
        let (k, n, batch) = if levers.in_backward && !levers.offload_grads {
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
            // beats the least peak: one that cannot would take its full memory.
            let cap = if levers.in_backward {
                best_allowed.as_ref().map(|(p, _)| *p)
            } else {
                None
            };
            if let (Some(cap), true) = (cap, batch > 2) {
                if predict_whole_batch(runs, &choice)?.is_none_or(|p| p >= cap) {
                    continue;
                }
            }
            let peak = match probe(
                runs.workload,
                &choice,
                batch,
                n,
                1,
                cap,
                true,
                true,
                &runs.ranks,
            ) {
                Ok(p) => p.peak_bytes,
                // Not a configuration to suggest: it spoils the running statistics.
                Err(ProbeError::OutOfMemory(_) | ProbeError::Unusable(_)) => continue,
                Err(ProbeError::Failed(e)) => return Err(FitError::Step(e)),
                Err(ProbeError::Fatal(e)) => return Err(e),
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
    Ok((best_allowed, best_lossy))
}

/// The peak of `choice` on the whole batch in one micro-batch, predicted from runs
/// of one and two examples without the budget (on ranks, the largest of the ranks'
/// predictions); `None` when they did not run (out of the machine's memory).
fn predict_whole_batch(runs: &mut Runs<'_>, choice: &Choice) -> Result<Option<u64>, FitError> {
    let ranks = runs.ranks.clone();
    let mut at =
        |size: i64| match probe(runs.workload, choice, size, 1, 1, None, true, false, &ranks) {
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

/// The budget to recommend for a configuration whose peak was `peak`: accepted with
/// `margin`, with 2% more for what varies between runs (an offload store's writer
/// thread frees memory at its own pace).
fn budget_for(peak: u64, margin: f64) -> u64 {
    (peak as f64 * 1.02 / (1.0 - margin)).ceil() as u64 + 1
}
