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
//! - checkpoint `s..k`, then the rest: `c·n` (what the checkpoint and the `n - 1`
//!   checkpoints nested in it hold themselves from the forward on: an RNG state each,
//!   when their functions draw random numbers) plus the most of the forward's peak
//!   `+ G(t)`, `a[k]` plus what the rest needs, and `c` plus what the recompute of
//!   `s..k` needs (during the recompute the RNG state it will restore is held too; the
//!   checkpoint's output is freed by then, the recompute makes its own). The model
//!   takes `n` as the number of layers in `s..k`, an upper bound on the checkpoints a
//!   schedule can nest there, so that the search and `predict` agree; it is exact when
//!   the layers draw no random numbers (`c` is 0 then: nothing is stashed).
//!
//! `G(t)` for `t <= L` also counts the chain's output `x_L` and the loss value: the caller
//! may hold the output until the whole backward is over, as a variable holding a model's
//! output does, and holds the loss it called backward on (so the loss's own backward
//! counts its output as saved).
//!
//! [`Solver`] finds the cheapest schedule (least recomputation time) whose need fits a
//! budget. It works in exact bytes: for every range `s..t` it keeps the trade-off front
//! of its schedules (least time for each need), built from the fronts of shorter ranges.
//! No rounding of bytes is involved, so a returned plan's predicted peak never exceeds
//! the budget and the smallest feasible budget it reports is met to the byte. What is
//! bounded instead is how many points a front keeps and how many stages the chain has;
//! see [`Solver`] for the limits and what they cost.
mod fronts;
mod model;
mod stages;

use crate::error::{CheckpointError, Result};
use crate::levers::LeverProfile;
use crate::profile::ChainProfile;
use crate::schedule::{Block, Schedule, StoredBoundary};
use fronts::{lookup, Fronts, Point, POINT_BYTES, TOP_FACTOR};
use memsave_meter::Bytes;
use model::Model;
pub use model::{predict, predict_with_levers, Prediction};
use stages::Stages;

/// Chains of more elements (layers and loss) than this are planned over this many
/// stages of consecutive layers. The build takes time cubic in the stages: a few tenths
/// of a second at 128 in a release build.
const MAX_STAGES: usize = 128;

/// What the fronts may take, in bytes; the cap on points per front follows from it.
const FRONT_BYTES: usize = 4 << 20;

/// Fronts keep at least this many points, and at most `MAX_CAP`.
const MIN_CAP: usize = 16;
const MAX_CAP: usize = 1024;

/// Points a front may keep for a chain of `stages` stages.
fn cap_for(stages: usize) -> usize {
    let pairs = (stages + 1) * (stages + 2) / 2 + stages * (TOP_FACTOR - 1);
    (FRONT_BYTES / (pairs * POINT_BYTES)).clamp(MIN_CAP, MAX_CAP)
}

/// The fronts, once built.
struct Tables {
    stages: Stages,
    fronts: Fronts,
}

/// The budget solver: the schedule with the least recomputation whose predicted peak fits
/// a budget, over a profiled chain (in the spirit of Rotor, Beaumont et al. 2019).
///
/// The first solve builds a table once (every later budget is a lookup and a walk down
/// the table), exact in bytes, bounded in size and time:
///
/// - chains of up to 127 layers (128 elements with the loss) are planned over every
///   layer; longer ones over 128 stages of consecutive layers (as even as the division
///   allows), which a checkpoint can start or end only between. Their plans still fit
///   the budget, but may recompute more than the best plan over single layers, and
///   their smallest feasible budget may be higher (on 200 uniform residual layers of
///   2,048-byte activations, 960 bytes higher, and plans at the same fraction of the
///   feasible range within 0.1% of the same time);
/// - each range keeps at most a few points of its memory/time trade-off (1024 for short
///   chains, 28 at 128 stages; eight times as many for ranges that end with the loss),
///   always its least-memory and its fastest schedule. Where more points exist, dropped
///   ones can cost recomputation time, never memory;
/// - the table takes at most about 5 MiB, see [`table_bound_bytes`](Self::table_bound_bytes),
///   and its build well under a second in a release build, at any length (the bench
///   `benches/solver.rs` prints the depth curve);
/// - chains of more than [`MAX_LAYERS`](Self::MAX_LAYERS) layers are refused with
///   [`CheckpointError::InvalidPlan`]: use [`Plan::Nested`](crate::Plan::Nested) there.
///
/// ```
/// use memsave_checkpoint::{predict, ChainProfile, LayerProfile, Schedule, Solver};
///
/// let layer = LayerProfile {
///     input_bytes: 1000, output_bytes: 1000, retained_bytes: 1000,
///     forward_peak_bytes: 2000, nograd_peak_bytes: 2000, backward_peak_bytes: 2000,
///     param_grad_bytes: 0, saves_output: false,
///     forward_time_s: 1.0, nograd_time_s: 1.0, backward_time_s: 2.0,
/// };
/// let mut elements = vec![layer.clone(); 20];
/// elements.push(LayerProfile { output_bytes: 4, ..layer });
/// let profile = ChainProfile { elements, checkpoint_overhead_bytes: 0 };
///
/// let plain = predict(&profile, &Schedule::plain(20));
/// let mut solver = Solver::new(&profile);
/// let schedule = solver.solve_budget(plain.peak_bytes / 2).unwrap();
/// let prediction = predict(&profile, &schedule);
/// assert!(prediction.peak_bytes <= plain.peak_bytes / 2);
/// assert!(prediction.step_time_s > plain.step_time_s); // some layers run twice
/// ```
pub struct Solver<'a> {
    model: Model<'a>,
    tables: Option<Tables>,
}

impl<'a> Solver<'a> {
    /// The solver refuses chains of more layers than this (an `InvalidPlan` error).
    pub const MAX_LAYERS: usize = 100_000;

    /// A solver for the profiled chain; cheap, the table is built by the first solve.
    pub fn new(profile: &'a ChainProfile) -> Self {
        Self::with_levers(profile, &[])
    }

    /// A solver that may also keep the input of a top-level checkpoint in a boundary
    /// store (see [`BoundaryStore`](crate::BoundaryStore)), `levers[i]` being store `i`
    /// of the schedules it returns. For each top-level checkpoint it weighs keeping the
    /// input against each store by the store's measured bytes and seconds at that
    /// boundary, and returns the fastest schedule that fits, as without levers. With no
    /// levers it is [`Solver::new`], plan for plan.
    pub fn with_levers(profile: &'a ChainProfile, levers: &'a [LeverProfile]) -> Self {
        Self {
            model: Model::with_levers(profile, levers),
            tables: None,
        }
    }

    /// The most bytes the table of a chain of `layers` layers may take (fronts, their
    /// index and the working buffers of the build).
    pub fn table_bound_bytes(layers: usize) -> usize {
        let stages = (layers + 1).min(MAX_STAGES);
        Fronts::bound_bytes(stages, cap_for(stages))
    }

    fn tables(&mut self) -> Result<&Tables> {
        let layers = self.model.profile.layers();
        if layers > Self::MAX_LAYERS {
            return Err(CheckpointError::InvalidPlan(format!(
                "the budget solver plans chains of at most {} layers, this one has {layers}: \
                 use Plan::Nested or Plan::Segments",
                Self::MAX_LAYERS
            )));
        }
        let model = &self.model;
        Ok(self.tables.get_or_insert_with(|| {
            let stages = Stages::new(model, MAX_STAGES);
            let fronts = Fronts::build(&stages, cap_for(stages.len()));
            Tables { stages, fronts }
        }))
    }

    /// The cheapest schedule whose predicted peak fits `budget_bytes`, or an error naming
    /// the smallest budget that can be met (to the byte: solving for it succeeds).
    pub fn solve_budget(&mut self, budget_bytes: u64) -> Result<Schedule> {
        let layers = self.model.profile.layers();
        let plain = Schedule::plain(layers);
        if self.model.predict(&plain).peak_bytes <= budget_bytes {
            return Ok(plain);
        }
        let tables = self.tables()?;
        let last = tables.stages.len();
        let top = tables.fronts.get(0, last);
        if lookup(top, budget_bytes).is_none() {
            return Err(CheckpointError::InfeasibleBudget {
                budget: Bytes(budget_bytes),
                smallest_feasible: Bytes(top[0].need),
            });
        }
        let mut blocks = Vec::new();
        let mut stored = Vec::new();
        tables.walk(0, last, budget_bytes, &mut blocks, &mut stored);
        // The loss always comes last and runs normally; it is not part of the schedule.
        let head = blocks.pop();
        debug_assert_eq!(head, Some(Block::Layer(layers)));
        Ok(Schedule::new(blocks, layers)
            .and_then(|s| s.with_stored(stored))
            .expect("the solver builds covering schedules"))
    }

    /// The schedule with the smallest predicted peak the solver can find, or an error for
    /// a chain longer than [`MAX_LAYERS`](Self::MAX_LAYERS).
    pub fn f_min_memory(&mut self) -> Result<Schedule> {
        match self.solve_budget(0) {
            Err(CheckpointError::InfeasibleBudget {
                smallest_feasible, ..
            }) => self.solve_budget(smallest_feasible.0),
            other => other,
        }
    }

    /// The schedule with the smallest predicted peak the solver can find.
    ///
    /// # Panics
    /// For a chain longer than [`MAX_LAYERS`](Self::MAX_LAYERS); use [`f_min_memory`](Self::f_min_memory)
    /// for a `Result`.
    pub fn min_memory(&mut self) -> Schedule {
        self.f_min_memory().unwrap_or_else(|e| panic!("{e}"))
    }
}

/// What runs first in a range.
#[derive(Debug, Clone, Copy)]
enum Choice {
    Store,
    Checkpoint(usize),
    /// Checkpoint to `k`, its input kept by lever `j`.
    StoredCheckpoint(usize, usize),
}

impl Tables {
    /// The fastest first step of `s..t` within `budget`, by the fronts of what follows.
    fn choose(&self, s: usize, t: usize, budget: u64) -> Option<Choice> {
        let st = &self.stages;
        let mut best: Option<(f64, Choice)> = None;
        let mut consider = |time_s: f64, choice: Choice| {
            if best.is_none_or(|(b, _)| time_s < b) {
                best = Some((time_s, choice));
            }
        };
        let floor = (st.forward_peak[s] + st.grads[t]).max(st.backward_peak[s]);
        if floor <= budget {
            let rest = budget
                .checked_sub(st.retained[s])
                .and_then(|m| lookup(self.fronts.get(s + 1, t), m));
            if let Some(rest) = rest {
                consider(rest.time_s + st.time_s[s], Choice::Store);
            }
        }
        for cand in st.checkpoint_candidates(s, t) {
            if cand.floor > budget {
                break;
            }
            let fits = |front: &[Point], used: u64| {
                budget.checked_sub(used).and_then(|m| lookup(front, m))
            };
            if let (Some(rest), Some(inner)) = (
                fits(self.fronts.get(cand.k, t), cand.rest_bytes),
                fits(self.fronts.get(s, cand.k), cand.inner_bytes),
            ) {
                consider(
                    rest.time_s + inner.time_s + cand.nograd_time_s,
                    Choice::Checkpoint(cand.k),
                );
            }
            if t != st.len() {
                continue;
            }
            for (j, store) in st.stores[s].iter().enumerate() {
                let Some(c) = store.map(|store| cand.stored(&store, st.a[s])) else {
                    continue;
                };
                if c.floor > budget {
                    continue;
                }
                let rest = (budget + c.discount)
                    .checked_sub(c.rest_bytes)
                    .and_then(|m| lookup(self.fronts.get(cand.k, t), m));
                if let (Some(rest), Some(inner)) =
                    (rest, fits(self.fronts.get(s, cand.k), c.inner_bytes))
                {
                    consider(
                        rest.time_s + inner.time_s + c.time_s,
                        Choice::StoredCheckpoint(cand.k, j),
                    );
                }
            }
        }
        best.map(|(_, choice)| choice)
    }

    /// Appends the blocks of the fastest schedule of `s..t` within `budget`; the fronts
    /// guarantee one exists when the caller's lookup found a fitting point.
    fn walk(
        &self,
        mut s: usize,
        t: usize,
        mut budget: u64,
        out: &mut Vec<Block>,
        stored: &mut Vec<StoredBoundary>,
    ) {
        let st = &self.stages;
        while s < t {
            let choice = self
                .choose(s, t, budget)
                .expect("a fitting front point has a fitting first step");
            match choice {
                Choice::Store => {
                    out.extend((st.bounds[s]..st.bounds[s + 1]).map(Block::Layer));
                    budget -= st.retained[s];
                    s += 1;
                }
                Choice::Checkpoint(k) => {
                    let mut inner = Vec::new();
                    let inner_budget = budget - st.checkpoint_inner_bytes();
                    self.walk(s, k, inner_budget, &mut inner, &mut Vec::new());
                    out.push(Block::Checkpoint {
                        start: st.bounds[s],
                        end: st.bounds[k],
                        inner,
                    });
                    budget -= st.checkpoint_rest_bytes(s, k);
                    s = k;
                }
                Choice::StoredCheckpoint(k, j) => {
                    let cand = st
                        .checkpoint_candidates(s, t)
                        .find(|c| c.k == k)
                        .expect("the chosen checkpoint is a candidate");
                    let store = st.stores[s][j].expect("the chosen store is measured");
                    let c = cand.stored(&store, st.a[s]);
                    let mut inner = Vec::new();
                    self.walk(s, k, budget - c.inner_bytes, &mut inner, &mut Vec::new());
                    out.push(Block::Checkpoint {
                        start: st.bounds[s],
                        end: st.bounds[k],
                        inner,
                    });
                    stored.push(StoredBoundary {
                        layer: st.bounds[s],
                        lever: j,
                    });
                    budget = budget + c.discount - c.rest_bytes;
                    s = k;
                }
            }
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
    fn grouped_stages_give_plans_that_fit_and_checkpoint_only_at_stage_bounds() {
        let p = chain(20, 1000);
        let model = Model::new(&p);
        let stages = Stages::new(&model, 6);
        assert_eq!(stages.bounds, vec![0, 4, 8, 12, 16, 20, 21]);
        let fronts = Fronts::build(&stages, 16);
        let tables = Tables { stages, fronts };
        let top = tables.fronts.get(0, 6);
        let plain = predict(&p, &Schedule::plain(20)).peak_bytes;
        assert_eq!(top.last().unwrap().need, plain);
        fn bounds_ok(blocks: &[Block]) -> bool {
            blocks.iter().all(|b| match b {
                Block::Layer(_) => true,
                Block::Checkpoint { start, end, inner } => {
                    start % 4 == 0 && end % 4 == 0 && bounds_ok(inner)
                }
            })
        }
        for budget in (top[0].need..=plain).step_by(997) {
            let mut blocks = Vec::new();
            tables.walk(0, 6, budget, &mut blocks, &mut Vec::new());
            assert_eq!(blocks.pop(), Some(Block::Layer(20)));
            let s = Schedule::new(blocks, 20).unwrap();
            assert!(predict(&p, &s).peak_bytes <= budget, "{s} at {budget}");
            assert!(bounds_ok(s.blocks()), "{s}");
        }
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
