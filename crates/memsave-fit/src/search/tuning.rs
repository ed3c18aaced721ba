//! The numbers that tune the search: how many times a configuration runs, which
//! runners-up race the choice, how long the rounds that compare the close ones last,
//! and what `exhaustive` runs. In one place because they work together (the docs read
//! as one chain: the race, then the rounds, then `exhaustive`'s rounds) and because the
//! crate's docs and [`FitRequest::exhaustive`](crate::FitRequest::exhaustive)'s quote
//! them: change one, change those docs too.
//!
//! Each one's note says what it trades: time spent measuring against the chance of
//! choosing a slower configuration on a machine whose speed swings by a third from one
//! second to the next.

/// Runs per small probe; the fastest gives the time, the highest the peak. The first
/// runs at a new size are slow (the allocator maps fresh pages, caches are cold) and
/// the first records every allocation: two would leave one run for the time, which
/// is all a probe whose runs take long keeps (see `probe`).
pub(super) const PROBE_RUNS: usize = 3;

/// Runs of a configuration at its real size (the confirmation, runners-up whose step is
/// predicted under twice `ONE_RUN_FROM_S`: predictions are off by up to 3x, and the
/// first step of a short one pays for fresh allocations).
pub(super) const REAL_RUNS: usize = 2;

/// Runners-up predicted within this factor of the choice's time (the larger of its
/// predicted and measured) are measured too.
pub(super) const RACE_WITHIN: f64 = 1.5;

/// The best predicted of each family (levers and recompute schedule) not raced yet is
/// measured too when predicted within this factor.
pub(super) const RACE_FAMILY_WITHIN: f64 = 3.0;

/// When nothing fits, a lever set's whole batch at once (where micro-batches are lossy
/// and not allowed) runs to learn its peak when the peak predicted from one and two
/// examples is under this factor of the least peak found so far: those predictions are
/// off by tens of percent, and a run far above the least would only take memory.
pub(super) const WHOLE_BATCH_WITHIN: f64 = 1.5;

/// With the gradients in files, the choice's twin keeps the gradients of the smallest
/// parameters in memory, up to this share of all the gradients' bytes: a file each
/// for biases and norms' weights cost a fifth of a step of the zoo's encoder–decoder
/// and ViT at a quarter of their checkpoint peak, for about 1% more bytes.
pub(super) const SMALL_GRADIENTS_SHARE: f64 = 0.02;

/// At most this many runners-up are measured...
pub(super) const RACE_MAX: usize = 16;

/// ...and one starts only if, by its predicted time, it ends within this many seconds of the race's start, or this
/// share of the time `fit` took before the race if more: `fit` stays quick on large
/// steps.
pub(super) const RACE_S: f64 = 2.0;
pub(super) const RACE_SHARE: f64 = 0.25;

/// Configurations measured within this factor of the fastest (at most
/// `RECHECK_MAX` of them, fastest first) are run again in rounds...
pub(super) const RECHECK_WITHIN: f64 = 1.25;
pub(super) const RECHECK_MAX: usize = 5;

/// ...at least this many (the slowest left out until they fit, then down to two
/// rounds, none if even two rounds of two do not: one says little more than the race
/// did)...
pub(super) const RECHECK_MIN_ROUNDS: usize = 3;

/// ...at most this many...
pub(super) const RECHECK_MAX_ROUNDS: usize = 24;

/// ...each round starting only if it ends within this many seconds of the recheck's
/// start, or this share of the time `fit` took before it if more...
pub(super) const RECHECK_S: f64 = 2.0;
pub(super) const RECHECK_SHARE: f64 = 0.25;

/// ...or, for a round that takes at most `CHEAP_ROUND_S`, within this share of the time
/// `fit` took before the recheck: three or four rounds still now and then choose one
/// over another more than 10% faster, eight or more far less often, and rounds of a
/// few short steps cost little next to the small runs before them...
pub(super) const CHEAP_ROUND_S: f64 = 0.3;
pub(super) const CHEAP_SHARE: f64 = 0.5;

/// ...and once `RECHECK_MIN_ROUNDS + 1` rounds have run, one whose median so far is over
/// this factor of the fastest's runs no more rounds: the rounds left go to those still
/// close.
pub(super) const RECHECK_OUT_OVER: f64 = 1.15;

/// With `exhaustive`, the same for the whole grid: those within 1.3x, the choice too,
/// in at least five rounds, more (up to thirty) while `EXHAUSTIVE_ROUNDS_S` lasts,
/// those over 1.2x of the fastest out once six rounds have run (never the choice).
pub(super) const EXHAUSTIVE_RECHECK_WITHIN: f64 = 1.3;
pub(super) const EXHAUSTIVE_MIN_ROUNDS: usize = 5;
pub(super) const EXHAUSTIVE_MAX_ROUNDS: usize = 30;
pub(super) const EXHAUSTIVE_ROUNDS_S: f64 = 10.0;
pub(super) const EXHAUSTIVE_OUT_OVER: f64 = 1.2;

/// With `exhaustive`, a configuration predicted over this factor of the budget (or
/// known not to fit, with no prediction) is not run at its real size: runs are not
/// stopped at the budget, and its memory would be taken for real to learn what the
/// prediction already says.
pub(super) const EXHAUSTIVE_RUN_WITHIN: f64 = 2.0;

/// A configuration's time in a round is the fastest of `REAL_RUNS` steps when its step
/// takes less than this many seconds, one step's otherwise: the first step after
/// another configuration pays for fresh allocations, a few milliseconds that only a
/// short step notices, and a long step's rounds cost the most.
pub(super) const ONE_RUN_FROM_S: f64 = 0.1;

/// Steps of a configuration whose step takes `step_s`: `REAL_RUNS` under
/// `one_run_from_s` seconds, else one (in a round: see `ONE_RUN_FROM_S`; in the race:
/// see `REAL_RUNS`).
pub(super) fn runs_for(step_s: f64, one_run_from_s: f64) -> usize {
    if step_s < one_run_from_s {
        REAL_RUNS
    } else {
        1
    }
}
