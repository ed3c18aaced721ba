//! The memory/time model of a schedule and the budget solver over it.
//!
//! The chain has `n = L + 1` elements: the `L` layers and the loss. `a[e]` is the size of
//! element `e`'s input (`a[n]`: the loss value). Processing a range `s..t` starts with
//! `x_s` held by the caller and ends, after its backward, with the gradient of `x_s`;
//! `G(t)` is the parameter gradients that exist by the time the backward reaches `t`.
//! A schedule needs, above the step's start:
//!
//! - nothing left (`s == t`): `a[t] + G(t)` (the arriving gradient);
//! - layer `s` run normally, then the rest: the most of its forward peak `+ G(t)`, its
//!   retained bytes plus what the rest needs, and its backward: what it saved (its
//!   retained bytes, less its output unless it saved the output, which is freed once
//!   the rest's backward is done) `+ a[s+1]` (the output's gradient) `+ backward peak +
//!   G(s+1)`;
//! - checkpoint `s..k`, then the rest: `c` (what a checkpoint holds itself: the RNG
//!   state) plus the most of the no-grad forward's peak `+ G(t)`, `a[k]` plus what the
//!   rest needs, and `c` plus what the recompute of `s..k` needs (during the recompute
//!   the RNG state it will restore is held too; the checkpoint's output is freed by
//!   then, the recompute makes its own).
//!
//! `G(t)` for `t <= L` also counts the chain's output `x_L`: the caller may hold it until
//! the whole backward is over, as a variable holding a model's output does.
//!
//! [`Solver`] finds the cheapest schedule (least recomputation time) whose need fits a
//! budget by dynamic programming over `(s, t, memory)` with memory in small units,
//! rounded up so that a solution always fits the exact model.
use crate::error::{CheckpointError, Result};
use crate::profile::ChainProfile;
use crate::schedule::{Block, Schedule};
use memsave_meter::Bytes;

/// Resolution of the solver: the baseline's need is split into this many units, fewer
/// for long chains so that the memo table stays around 4 million entries.
fn units_for(elements: usize) -> u64 {
    let cells = ((elements + 1) * (elements + 1)) as u64;
    (4_000_000 / cells).clamp(500, 4000)
}

/// Predicted peak and time of a schedule under a profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Peak bytes above the step's start (parameters and input excluded).
    pub peak_bytes: u64,
    /// Seconds of one forward and backward step.
    pub step_time_s: f64,
    /// Seconds of the same step without checkpointing.
    pub baseline_time_s: f64,
}

impl Prediction {
    /// Step time relative to the baseline (1.0: no recomputation).
    pub fn time_ratio(&self) -> f64 {
        if self.baseline_time_s > 0.0 {
            self.step_time_s / self.baseline_time_s
        } else {
            1.0
        }
    }
}

/// The exact (byte) model of a profiled chain.
struct Model<'a> {
    profile: &'a ChainProfile,
    a: Vec<u64>,
    grads_from: Vec<u64>,
}

impl<'a> Model<'a> {
    fn new(profile: &'a ChainProfile) -> Self {
        let e = &profile.elements;
        let n = e.len();
        let mut a: Vec<u64> = e.iter().map(|p| p.input_bytes).collect();
        a.push(e[n - 1].output_bytes);
        let mut grads_from = vec![0u64; n + 1];
        for i in (0..n).rev() {
            grads_from[i] = grads_from[i + 1] + e[i].param_grad_bytes;
        }
        // From the loss's backward on, the caller may still hold the output x_L.
        let output = a[n - 1];
        for g in &mut grads_from[..n] {
            *g += output;
        }
        Self {
            profile,
            a,
            grads_from,
        }
    }

    /// Bytes layer `l` still holds when its backward starts.
    fn saved_in_backward(&self, l: usize) -> u64 {
        let p = &self.profile.elements[l];
        if p.saves_output {
            p.retained_bytes
        } else {
            p.retained_bytes.saturating_sub(self.a[l + 1])
        }
    }

    fn nograd_peak(&self, s: usize, k: usize) -> u64 {
        (s..k)
            .map(|l| if l > s { self.a[l] } else { 0 } + self.profile.elements[l].nograd_peak_bytes)
            .max()
            .unwrap_or(0)
    }

    fn nograd_time(&self, s: usize, k: usize) -> f64 {
        self.profile.elements[s..k]
            .iter()
            .map(|p| p.nograd_time_s)
            .sum()
    }

    /// Bytes `blocks` (covering some `s..t`) need above the start; see the module docs.
    fn need(&self, blocks: &[Block], t: usize) -> u64 {
        let Some((first, rest)) = blocks.split_first() else {
            return self.a[t] + self.grads_from[t];
        };
        match first {
            Block::Layer(l) => {
                let p = &self.profile.elements[*l];
                (p.forward_peak_bytes + self.grads_from[t])
                    .max(p.retained_bytes + self.need(rest, t))
                    .max(
                        self.saved_in_backward(*l)
                            + self.a[l + 1]
                            + p.backward_peak_bytes
                            + self.grads_from[l + 1],
                    )
            }
            Block::Checkpoint { start, end, inner } => {
                let c = self.profile.checkpoint_overhead_bytes;
                c + (self.nograd_peak(*start, *end) + self.grads_from[t])
                    .max(self.a[*end] + self.need(rest, t))
                    .max(c + self.need(inner, *end))
            }
        }
    }

    fn time(&self, blocks: &[Block]) -> f64 {
        blocks
            .iter()
            .map(|b| match b {
                Block::Layer(l) => {
                    let p = &self.profile.elements[*l];
                    p.forward_time_s + p.backward_time_s
                }
                Block::Checkpoint { start, end, inner } => {
                    self.nograd_time(*start, *end) + self.time(inner)
                }
            })
            .sum()
    }

    /// The schedule's blocks with the loss appended as the last, normally run element.
    fn with_head(&self, schedule: &Schedule) -> Vec<Block> {
        let mut blocks = schedule.blocks().to_vec();
        blocks.push(Block::Layer(self.profile.layers()));
        blocks
    }

    fn predict(&self, schedule: &Schedule) -> Prediction {
        let n = self.profile.elements.len();
        let blocks = self.with_head(schedule);
        let plain = self.with_head(&Schedule::plain(self.profile.layers()));
        Prediction {
            peak_bytes: self.need(&blocks, n),
            step_time_s: self.time(&blocks),
            baseline_time_s: self.time(&plain),
        }
    }
}

/// Predicts the peak and time of `schedule` for a profiled chain.
pub fn predict(profile: &ChainProfile, schedule: &Schedule) -> Prediction {
    Model::new(profile).predict(schedule)
}

#[derive(Debug, Clone, Copy)]
enum Choice {
    Done,
    Store,
    Checkpoint(usize),
}

/// Dynamic program over `(s, t, memory units)`; memoized, so one solver serves many budgets.
pub struct Solver<'a> {
    model: Model<'a>,
    unit: u64,
    a: Vec<u64>,
    retained: Vec<u64>,
    saved_in_backward: Vec<u64>,
    fwd_peak: Vec<u64>,
    bwd_peak: Vec<u64>,
    grads_from: Vec<u64>,
    nograd_peak: Vec<Vec<u64>>,
    overhead: u64,
    memo: Vec<Option<Option<(f64, Choice)>>>,
    max_units: u64,
}

impl<'a> Solver<'a> {
    /// A solver for the profiled chain.
    pub fn new(profile: &'a ChainProfile) -> Self {
        let model = Model::new(profile);
        let layers = profile.layers();
        let n = profile.elements.len();
        let plain_need = model.predict(&Schedule::plain(layers)).peak_bytes;
        let unit = plain_need.div_ceil(units_for(n)).max(1);
        let up = |b: u64| b.div_ceil(unit);
        let e = &profile.elements;
        let nograd_peak = (0..n)
            .map(|s| {
                (0..=n)
                    .map(|k| up(model.nograd_peak(s, k.max(s))))
                    .collect()
            })
            .collect();
        let max_units = up(plain_need) + 1;
        Self {
            unit,
            a: model.a.iter().map(|&b| up(b)).collect(),
            retained: e.iter().map(|p| up(p.retained_bytes)).collect(),
            saved_in_backward: (0..n).map(|l| up(model.saved_in_backward(l))).collect(),
            fwd_peak: e.iter().map(|p| up(p.forward_peak_bytes)).collect(),
            bwd_peak: e.iter().map(|p| up(p.backward_peak_bytes)).collect(),
            grads_from: model.grads_from.iter().map(|&b| up(b)).collect(),
            nograd_peak,
            overhead: up(profile.checkpoint_overhead_bytes),
            memo: vec![None; (n + 1) * (n + 1) * (max_units as usize + 1)],
            max_units,
            model,
        }
    }

    fn key(&self, s: usize, t: usize, m: u64) -> usize {
        let n = self.a.len();
        (s * n + t) * (self.max_units as usize + 1) + m as usize
    }

    fn opt(&mut self, s: usize, t: usize, m: u64) -> Option<f64> {
        let m = m.min(self.max_units);
        let key = self.key(s, t, m);
        if let Some(done) = self.memo[key] {
            return done.map(|(c, _)| c);
        }
        let best = self.solve(s, t, m);
        self.memo[key] = Some(best);
        best.map(|(c, _)| c)
    }

    fn solve(&mut self, s: usize, t: usize, m: u64) -> Option<(f64, Choice)> {
        if s == t {
            return (self.a[t] + self.grads_from[t] <= m).then_some((0.0, Choice::Done));
        }
        let layers = self.model.profile.layers();
        let mut best: Option<(f64, Choice)> = None;
        let consider = |cost: f64, choice: Choice, best: &mut Option<(f64, Choice)>| {
            if best.is_none_or(|(c, _)| cost < c) {
                *best = Some((cost, choice));
            }
        };
        let r = self.retained[s];
        if self.fwd_peak[s] + self.grads_from[t] <= m
            && self.saved_in_backward[s] + self.a[s + 1] + self.bwd_peak[s] + self.grads_from[s + 1]
                <= m
            && r <= m
        {
            if let Some(rest) = self.opt(s + 1, t, m - r) {
                let p = &self.model.profile.elements[s];
                consider(
                    p.forward_time_s + p.backward_time_s + rest,
                    Choice::Store,
                    &mut best,
                );
            }
        }
        // k == t would checkpoint the whole range with nothing after it: the recompute
        // would follow the forward at once, which saves nothing.
        for k in s + 1..t.min(layers + 1) {
            let ak = self.a[k].max(1);
            let c = self.overhead;
            if c + self.nograd_peak[s][k] + self.grads_from[t] > m || c + ak > m {
                continue;
            }
            let Some(rest) = self.opt(k, t, m - c - ak) else {
                continue;
            };
            // The recompute holds a second RNG state: the one it restores afterwards.
            if 2 * c > m {
                continue;
            }
            let Some(inner) = self.opt(s, k, m - 2 * c) else {
                continue;
            };
            consider(
                self.model.nograd_time(s, k) + rest + inner,
                Choice::Checkpoint(k),
                &mut best,
            );
        }
        best
    }

    fn build(&self, s: usize, t: usize, m: u64) -> Vec<Block> {
        let m = m.min(self.max_units);
        let choice = self.memo[self.key(s, t, m)]
            .flatten()
            .map(|(_, c)| c)
            .expect("build follows solved states");
        match choice {
            Choice::Done => Vec::new(),
            Choice::Store => {
                let mut blocks = vec![Block::Layer(s)];
                blocks.extend(self.build(s + 1, t, m - self.retained[s]));
                blocks
            }
            Choice::Checkpoint(k) => {
                let (ak, c) = (self.a[k].max(1), self.overhead);
                let mut blocks = vec![Block::Checkpoint {
                    start: s,
                    end: k,
                    inner: self.build(s, k, m - 2 * c),
                }];
                blocks.extend(self.build(k, t, m - c - ak));
                blocks
            }
        }
    }

    fn schedule_for_units(&mut self, m: u64) -> Option<Schedule> {
        let n = self.a.len() - 1;
        self.opt(0, n, m)?;
        let mut blocks = self.build(0, n, m);
        // The loss always comes last and runs normally; it is not part of the model.
        debug_assert_eq!(
            blocks.last(),
            Some(&Block::Layer(self.model.profile.layers()))
        );
        blocks.pop();
        Some(
            Schedule::new(blocks, self.model.profile.layers())
                .expect("solver builds covering schedules"),
        )
    }

    /// The cheapest schedule whose predicted peak fits `budget_bytes`, or an error naming
    /// the smallest budget that can be met.
    pub fn solve_budget(&mut self, budget_bytes: u64) -> Result<Schedule> {
        let layers = self.model.profile.layers();
        let plain = Schedule::plain(layers);
        if self.model.predict(&plain).peak_bytes <= budget_bytes {
            return Ok(plain);
        }
        let units = budget_bytes / self.unit;
        if let Some(schedule) = self.schedule_for_units(units) {
            return Ok(schedule);
        }
        let n = self.a.len() - 1;
        let (mut lo, mut hi) = (units, self.max_units);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if self.opt(0, n, mid).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Err(CheckpointError::InfeasibleBudget {
            budget: Bytes(budget_bytes),
            // A budget of `hi` whole units is the least this solver meets; the exact need
            // of its schedule may be a little lower, but a budget below is refused.
            smallest_feasible: Bytes(hi * self.unit),
        })
    }

    /// The schedule with the smallest predicted peak the solver can find.
    pub fn min_memory(&mut self) -> Schedule {
        match self.solve_budget(0) {
            Ok(s) => s,
            Err(CheckpointError::InfeasibleBudget {
                smallest_feasible, ..
            }) => self
                .solve_budget(smallest_feasible.0)
                .expect("the smallest feasible budget is feasible"),
            Err(_) => Schedule::plain(self.model.profile.layers()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::LayerProfile;

    /// A residual-linear-like chain: each layer keeps only its output (`act` bytes).
    fn chain(layers: usize, act: u64) -> ChainProfile {
        let layer = LayerProfile {
            input_bytes: act,
            output_bytes: act,
            retained_bytes: act,
            forward_peak_bytes: 2 * act,
            nograd_peak_bytes: 2 * act,
            backward_peak_bytes: 2 * act,
            param_grad_bytes: 0,
            saves_output: false,
            forward_time_s: 1.0,
            nograd_time_s: 1.0,
            backward_time_s: 2.0,
        };
        let head = LayerProfile {
            output_bytes: 4,
            retained_bytes: act,
            ..layer.clone()
        };
        let mut elements = vec![layer; layers];
        elements.push(head);
        ChainProfile {
            elements,
            checkpoint_overhead_bytes: 16,
        }
    }

    #[test]
    fn a_budget_above_the_baseline_gives_the_plain_schedule() {
        let p = chain(6, 100);
        let plain_peak = predict(&p, &Schedule::plain(6)).peak_bytes;
        let s = Solver::new(&p)
            .solve_budget(plain_peak + plain_peak / 40)
            .unwrap();
        assert_eq!(s, Schedule::plain(6));
    }

    #[test]
    fn solutions_fit_their_budget_and_cost_falls_as_the_budget_grows() {
        let p = chain(10, 1000);
        let mut solver = Solver::new(&p);
        let plain = predict(&p, &Schedule::plain(10));
        let mut last_time = f64::INFINITY;
        let mut feasible = 0;
        for budget in (4_000..=plain.peak_bytes).step_by(500) {
            if let Ok(s) = solver.solve_budget(budget) {
                let pred = predict(&p, &s);
                assert!(pred.peak_bytes <= budget, "{s}: {pred:?} > {budget}");
                assert!(pred.step_time_s <= last_time + 1e-9);
                last_time = pred.step_time_s;
                feasible += 1;
            }
        }
        assert!(feasible > 5);
        let at_baseline = solver.solve_budget(plain.peak_bytes).unwrap();
        assert_eq!(predict(&p, &at_baseline).step_time_s, plain.step_time_s);
        assert!(plain.step_time_s <= last_time);
    }

    #[test]
    fn an_infeasible_budget_names_the_smallest_feasible_one() {
        let p = chain(8, 1000);
        let mut solver = Solver::new(&p);
        let err = solver.solve_budget(10).unwrap_err();
        let CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        } = err
        else {
            panic!("{err}");
        };
        let s = solver.solve_budget(smallest_feasible.0).unwrap();
        assert!(predict(&p, &s).peak_bytes <= smallest_feasible.0);
        assert!(solver.solve_budget(smallest_feasible.0 - 1).is_err());
    }

    #[test]
    fn the_least_memory_schedule_beats_every_segment_count() {
        let p = chain(16, 1000);
        let best = Solver::new(&p).min_memory();
        let best_peak = predict(&p, &best).peak_bytes;
        for k in 1..=16 {
            let seg = Schedule::segments(16, k).unwrap();
            assert!(best_peak <= predict(&p, &seg).peak_bytes, "segments({k})");
        }
    }
}
