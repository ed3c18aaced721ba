//! The real-size runs after the choice: which runners-up race it and in what order,
//! then the rounds that compare the close ones over the same moments of the machine,
//! and how the fastest is told among them.
//!
//! Predictions from small runs are off by tens of percent, more than separates close
//! configurations, and a busy machine runs a real-size step a third slower one second
//! than the next: so the fastest of a few runs says more about the moment than about
//! the configuration, and the close ones are compared by their medians over rounds,
//! each round's times scaled by how fast the machine ran in it.
use super::candidates::family;
use super::tuning::{
    runs_for, CHEAP_ROUND_S, ONE_RUN_FROM_S, RACE_FAMILY_WITHIN, RACE_MAX, RACE_WITHIN,
};
use crate::choice::Choice;
use crate::probe::{Probe, ProbeError};
use crate::{Candidate, FitError};
use std::collections::{HashMap, HashSet};

/// How many rounds [`rounds`] runs. Times are seconds on the search's clock (since
/// `fit` started, agreed over the ranks).
pub(super) struct Rounds {
    /// At least this many...
    pub(super) least: usize,
    /// ...and at most this many, each beyond `least` starting only if, by the times
    /// measured so far, it ends before `until`, or before `until_cheap` if it takes
    /// at most [`CHEAP_ROUND_S`].
    pub(super) most: usize,
    pub(super) until: f64,
    pub(super) until_cheap: f64,
    /// The `least` rounds too must end before `until`: the slowest are left out (down
    /// to two) until they would, then fewer rounds (down to two), and there are no
    /// rounds if even then they would not. Otherwise they run whatever they take.
    pub(super) least_within: bool,
    /// Once `least + 1` rounds have run, one whose median so far is over this factor of
    /// the fastest's is out: it keeps that median and runs no more rounds (and is not
    /// returned: its median was scaled among the contenders of its time)...
    pub(super) out_over: f64,
    /// ...unless it is this one.
    pub(super) keep: Option<usize>,
}

/// Sorts candidate indices by predicted step time, fastest first (unknown last); equal
/// times (to a tenth of a microsecond) put fewer micro-batches first. Small probes
/// often cannot tell a micro-batch's fixed cost from noise and predict it as zero, so
/// splits of the same configuration come out equal, but each micro-batch costs a
/// launch of every operation.
pub(super) fn sort_by_predicted_time(indices: &mut [usize], candidates: &[Candidate]) {
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
pub(super) fn sort_by_measured_time(indices: &mut [usize], candidates: &[Candidate]) {
    indices.sort_by(|&a, &b| {
        let t = |i: usize| candidates[i].measured_step_time_s.unwrap_or(f64::INFINITY);
        t(a).total_cmp(&t(b))
    });
}

/// Whether something that takes `seconds` from `now` ends before `deadline` (both
/// seconds on the search's clock).
pub(super) fn ends_before(seconds: f64, now: f64, deadline: f64) -> bool {
    now <= deadline && seconds <= deadline - now
}

/// The measured candidates whose time is within `factor` of the fastest measured,
/// and `also` if it was measured.
pub(super) fn close_to_fastest(candidates: &[Candidate], factor: f64, also: usize) -> Vec<usize> {
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
pub(super) fn fastest_of_run(
    candidates: &[Candidate],
    run: &std::collections::HashSet<usize>,
) -> Option<usize> {
    let mut run: Vec<usize> = run.iter().copied().collect();
    run.sort_unstable();
    fastest_of(candidates, &run)
}

/// The one of `indices` with the least measured time, if any was measured.
pub(super) fn fastest_of(candidates: &[Candidate], indices: &[usize]) -> Option<usize> {
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

/// Rounds in which each of `indices` (fastest measured first) is run again once,
/// in turn (by `run`, at its real size, with the number of steps to take the fastest
/// of); a round runs forwards, the next backwards, so no one always runs right
/// after another. How many, and who drops out: see [`Rounds`]. Each that took part
/// then has as its measured time the median of its times in the rounds, after
/// every round's times are scaled by how fast the machine ran in it
/// ([`speed_corrected_medians`]): this machine's speed swings by a third from one
/// second to the next, and the fastest of a few runs says more about the moment
/// one ran in than about the configuration. One that fails when run again loses
/// its measurement. Returns those still in the rounds at the end with a
/// measurement (none if no round ran).
///
/// `now` reads the search's clock; an error of it, or a [`ProbeError::Fatal`] of a
/// run, ends the rounds with that error.
pub(super) fn rounds(
    candidates: &mut [Candidate],
    mut indices: Vec<usize>,
    rounds: Rounds,
    run: &mut dyn FnMut(&Choice, usize) -> Result<Probe, ProbeError>,
    now: &mut dyn FnMut() -> Result<f64, FitError>,
) -> Result<Vec<usize>, FitError> {
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
        let start = now()?;
        while !ends_before(
            least as f64 * round_s(&indices, candidates),
            start,
            rounds.until,
        ) {
            if indices.len() > 2 {
                indices.pop();
            } else if least > 2 {
                least -= 1;
            } else {
                return Ok(Vec::new());
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
        if indices.len() < 2 {
            break;
        }
        let this_round_s = round_s(&indices, candidates);
        if round >= least {
            let t = now()?;
            let in_time = ends_before(this_round_s, t, rounds.until)
                || (this_round_s <= CHEAP_ROUND_S
                    && ends_before(this_round_s, t, rounds.until_cheap));
            if !in_time {
                break;
            }
        }
        let mut order = indices.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let c = &mut candidates[i];
            let runs = runs_for(c.measured_step_time_s.unwrap_or(0.0), ONE_RUN_FROM_S);
            match run(&c.choice, runs) {
                Ok(p) => {
                    times.entry(i).or_default().push(p.time_s);
                    c.measured_again(&p);
                }
                Err(ProbeError::Fatal(e)) => return Err(e),
                Err(e) => {
                    c.measured_step_time_s = None;
                    c.measured_peak_bytes = None;
                    c.measured_breakdown = None;
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
    Ok(indices)
}

/// The runners-up to run at their real size after `chosen` (run already), in the order
/// to run them. Those not run yet predicted within the budget (on the CPU, where the
/// measured peak is exact to the byte, `cpu`, even past the margin: measured within
/// the budget they are as safe as the rest; elsewhere only within the margin) and
/// within [`RACE_WITHIN`] of the choice's time (the larger of its predicted and
/// measured), at most [`RACE_MAX`] of them in [`race_order`]; then the best predicted
/// of each family not among them within [`RACE_FAMILY_WITHIN`].
pub(super) fn racers(
    candidates: &[Candidate],
    run_already: &HashSet<usize>,
    chosen: usize,
    budget_bytes: u64,
    cpu: bool,
) -> Vec<usize> {
    let chosen_time = candidates[chosen]
        .predicted_step_time_s
        .unwrap_or(0.0)
        .max(candidates[chosen].measured_step_time_s.unwrap_or(0.0));
    let mut racers: Vec<usize> = (0..candidates.len())
        .filter(|i| !run_already.contains(i))
        .filter(|&i| {
            let c = &candidates[i];
            let within = if cpu {
                c.predicted_peak_bytes.is_some_and(|p| p <= budget_bytes)
            } else {
                c.predicted_fits
            };
            within
                && c.predicted_step_time_s
                    .is_some_and(|t| t <= chosen_time * RACE_FAMILY_WITHIN)
        })
        .collect();
    sort_by_predicted_time(&mut racers, candidates);
    let near = |i: usize| {
        candidates[i]
            .predicted_step_time_s
            .is_some_and(|t| t <= chosen_time * RACE_WITHIN)
    };
    let (near_ones, far): (Vec<usize>, Vec<usize>) = racers.into_iter().partition(|&i| near(i));
    let mut racers = race_order(candidates, chosen, near_ones);
    racers.truncate(RACE_MAX);
    // Then, while the race's time lasts, the best predicted of each family not raced
    // yet up to `RACE_FAMILY_WITHIN`: a prediction from small runs of a step of a few
    // hundredths of a second can be off by 3x (a lever that costs nothing predicted at
    // 0.065 s, measured 0.017 s).
    let mut families: HashSet<_> = racers
        .iter()
        .chain([&chosen])
        .map(|&i| family(&candidates[i].choice))
        .collect();
    racers.extend(
        far.into_iter()
            .filter(|&i| families.insert(family(&candidates[i].choice))),
    );
    racers
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
            measured_breakdown: None,
            measured_step_time_s: None,
            note: None,
            measured_peak_bytes_by_rank: Vec::new(),
            kept_bytes: 0,
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
}
