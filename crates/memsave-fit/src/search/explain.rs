//! The report's words: why the choice (the sentence or two of [`FitReport::why`]), the
//! Pareto front of predicted peak against time, and the report as text for a person
//! ([`FitReport::to_text`], [`table`]).
use super::tuning::{RACE_FAMILY_WITHIN, RACE_WITHIN};
use crate::parallel::REFUSED;
use crate::{Candidate, FitReport, FitRequest};
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

/// How the choice was confirmed, for [`why`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Confirmed {
    /// Configurations run at their real size in the race, the choice included.
    pub(super) raced: usize,
    /// Found among those predicted within the budget but not the margin.
    pub(super) fell_back: bool,
}

/// Why `chosen` among `candidates`: the fastest predicted within the budget less the
/// margin (of what each allocates above what it keeps from step to step), or, when `raced` configurations (the choice included) ran at
/// their real size, the fastest measured; with `fell_back`, found among those
/// predicted within the budget itself, none within the margin having fitted; what faster one would need; and the split
/// (over `world_size` ranks) that keeps the global batch.
pub(super) fn why(
    chosen: &Candidate,
    candidates: &[Candidate],
    request: &FitRequest,
    global: i64,
    world_size: usize,
    confirmed: Confirmed,
) -> String {
    let Confirmed { raced, fell_back } = confirmed;
    let fitting = candidates.iter().filter(|c| c.predicted_fits).count();
    let within = format!(
        "within the budget less a {:.0}% margin of what it allocates above the parameters and the optimizer's state",
        request.margin * 100.0
    );
    let measured = Bytes(chosen.measured_peak_bytes.unwrap_or(0));
    let mut why = if fell_back {
        let none = if fitting == 0 {
            format!("none of the configurations is predicted {within}")
        } else {
            format!("none of the {fitting} configurations predicted {within} fitted when run")
        };
        let mut why = format!(
            "{none}: the fastest predicted within the budget itself that measured within it at its real size ({measured})"
        );
        if raced > 1 {
            why.push_str(&format!(
                ", then the fastest measured of {raced} configurations run at their real size (runners-up predicted within {RACE_WITHIN}x its time, each other family's best within {RACE_FAMILY_WITHIN}x)"
            ));
        }
        why
    } else if raced > 1 {
        let mut why = format!(
            "the fastest measured of {raced} configurations run at their real size: the fastest predicted of {fitting} whose predicted peak is {within} and runners-up predicted within {RACE_WITHIN}x its time (each other family's best within {RACE_FAMILY_WITHIN}x)"
        );
        if !chosen.predicted_fits {
            why.push_str(&format!(
                "; its predicted peak is above the margin, its measured peak {measured} within the budget"
            ));
        }
        why
    } else {
        format!(
            "the fastest predicted of {fitting} configurations whose predicted peak is {within}"
        )
    };
    let t = chosen.predicted_step_time_s.unwrap_or(0.0);
    if let Some(faster) = candidates
        .iter()
        // Not one that failed its run: its prediction is not what it needs.
        .filter(|c| c.note.is_none())
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
    if world_size > 1 {
        why.push_str(&format!(
            "; the global batch of {global} is kept as {world_size} ranks' shares of {}{}",
            global / world_size as i64,
            if chosen.choice.micro_batches > 1 {
                format!(
                    ", each in {} micro-batches with accumulated gradients",
                    chosen.choice.micro_batches
                )
            } else {
                String::new()
            }
        ));
    } else if chosen.choice.micro_batches > 1 {
        why.push_str(&format!(
            "; the global batch of {global} is kept as {} micro-batches with accumulated gradients",
            chosen.choice.micro_batches
        ));
    }
    why
}

impl FitReport {
    /// The choice, why, and the front, for a person to read.
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "{}: budget {}, global batch {}\nchoice: {}\n  predicted peak {}, measured {} ({:+.1}%)\n  predicted step {:.3} s, measured {:.3} s\n  tries {}\nwhy: {}\n",
            self.model,
            Bytes(self.budget_bytes),
            self.global_batch,
            self.choice.strategy,
            Bytes(self.predicted_peak_bytes),
            Bytes(self.measured_peak_bytes),
            percent(self.predicted_peak_bytes, self.measured_peak_bytes),
            self.predicted_step_time_s,
            self.measured_step_time_s,
            self.tries,
            self.why,
        );
        if let Some(blocks) = &self.choice.blocks {
            out.push_str(&format!("blocks: {blocks}\n"));
        }
        let b = &self.breakdown;
        if b.total() > 0 {
            out.push_str(&format!(
                "  at the peak{}: parameters {}, optimizer state {}, input {}, the step's own (gradients, activations, scratch) {}\n",
                if self.world_size > 1 { " (this rank)" } else { "" },
                Bytes(b.parameters),
                Bytes(b.optimizer_state),
                Bytes(b.input),
                Bytes(b.step)
            ));
            if let Some(r) = &b.step_by_role {
                out.push_str(&format!(
                    "  the step's own, by role (a traced step): gradients {}, saved activations {}, recomputed {}, other {}\n",
                    Bytes(r.gradients),
                    Bytes(r.saved_activations),
                    Bytes(r.recomputed),
                    Bytes(r.other)
                ));
            }
        }
        if self.world_size > 1 {
            let by_rank: Vec<String> = self
                .measured_peak_bytes_by_rank
                .iter()
                .enumerate()
                .map(|(rank, b)| format!("rank {rank} {}", Bytes(*b)))
                .collect();
            out.push_str(&format!(
                "on {} ranks, budget per rank; measured peak per rank: {}\n",
                self.world_size,
                by_rank.join(", ")
            ));
        }
        out.push_str("\nPareto front (predicted):\n");
        out.push_str(&table(&self.front));
        out.push_str("\nEvery configuration considered:\n");
        out.push_str(&table(&self.candidates));
        let refused: Vec<String> = self
            .candidates
            .iter()
            .filter_map(|c| {
                let note = c.note.as_ref().filter(|n| n.starts_with(REFUSED))?;
                Some(format!("  {}: {note}\n", c.choice.strategy))
            })
            .collect();
        if !refused.is_empty() {
            out.push_str("\nNot considered (a data-parallel mode cannot run them):\n");
            out.push_str(&refused.concat());
        }
        if let Some(f) = &self.fastest_measured {
            out.push_str(&format!(
                "\nexhaustive: fastest measured within the budget: {} ({:.3} s); the choice measured {:.3} s ({:.2}x)\n",
                f.choice.strategy,
                f.measured_step_time_s.unwrap_or(f64::NAN),
                self.measured_step_time_s,
                self.measured_step_time_s / f.measured_step_time_s.unwrap_or(f64::NAN)
            ));
        }
        out
    }
}

fn percent(predicted: u64, measured: u64) -> f64 {
    if measured == 0 {
        0.0
    } else {
        (predicted as f64 / measured as f64 - 1.0) * 100.0
    }
}

/// Candidates as a table.
pub fn table(candidates: &[Candidate]) -> String {
    let mut rows = vec![[
        "strategy".to_owned(),
        "micro".to_owned(),
        "pred peak".to_owned(),
        "pred time".to_owned(),
        "fits".to_owned(),
        "meas peak".to_owned(),
        "meas time".to_owned(),
    ]];
    for c in candidates {
        rows.push([
            c.choice.strategy.clone(),
            format!("{}x{}", c.choice.micro_batches, c.choice.micro_batch),
            c.predicted_peak_bytes
                .map_or("-".into(), |b| Bytes(b).to_string()),
            c.predicted_step_time_s
                .map_or("-".into(), |t| format!("{t:.3} s")),
            if c.predicted_fits { "yes" } else { "no" }.to_owned(),
            c.measured_peak_bytes
                .map_or("-".into(), |b| Bytes(b).to_string()),
            c.measured_step_time_s
                .map_or("-".into(), |t| format!("{t:.3} s")),
        ]);
    }
    let widths: Vec<usize> = (0..7)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, w))| {
                if i == 0 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
