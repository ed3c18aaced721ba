//! The report's words: why the choice (the sentence or two of [`FitReport::why`]) and
//! the Pareto front of predicted peak against time. The rest of the text
//! ([`FitReport::to_text`], the table) is the report's own, in the crate root.
//!
//! [`FitReport::why`]: crate::FitReport::why
//! [`FitReport::to_text`]: crate::FitReport::to_text
use super::tuning::{RACE_FAMILY_WITHIN, RACE_WITHIN};
use crate::{Candidate, FitRequest};
use memsave_meter::Bytes;

/// Candidates that no other beats in both predicted peak and time, by peak.
pub(super) fn front(candidates: &[Candidate]) -> Vec<Candidate> {
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
pub(super) fn coupling_sentence(op: &str, allowed: bool) -> String {
    format!(
        "the step runs {op} in training mode, which normalizes each sample with the whole batch's statistics: micro-batches change the gradients and the running statistics, so {}",
        if allowed {
            "they are a lossy lever here (allowed)"
        } else {
            "they were not considered (allow micro_batches to consider them)"
        }
    )
}

/// Why `chosen` among `candidates`: the fastest predicted within `target` (the budget
/// less the margin), or, when `raced` configurations (the choice included) ran at
/// their real size, the fastest measured; what faster one would need; and the split
/// that keeps the global batch.
pub(super) fn why(
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
