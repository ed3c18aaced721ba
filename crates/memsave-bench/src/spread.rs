//! How steady a median step time is, and when the timed rounds have run enough.
//!
//! A median of three rounds moves by more than 10% from one run of a suite to the
//! next on a quiet machine: three samples say little. As criterion and hyperfine do,
//! the rounds go on until the medians are steady, measured by the **spread** of each
//! median: the half-width of its distribution-free confidence interval over the
//! median itself. The interval is between two order statistics of the `n` times, the
//! `k`-th fastest and the `k`-th slowest, with `k` the largest whose binomial
//! coverage `1 - 2 P(Binomial(n, 1/2) < k)` is at least 95% whatever the times'
//! distribution (from 6 times; below that no two order statistics reach 95%, and the
//! spread is unknown). It needs no assumption of normality, which step times (a long
//! tail of slow steps when another process runs) do not meet.
//!
//! The rule ([`Rounds::enough`]): at least the least number of rounds asked (the
//! suite's `repeats`); then, while any strategy's spread is above the target or
//! unknown, one more round, up to a number of rounds and a time. One or two rounds
//! asked are a quick look, run as asked.

/// How many timed rounds to run: the target spread of every median and the caps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rounds {
    /// Rounds are added until every median's spread (see the [module](self)) is at
    /// most this fraction (0.02: ±2%); 0 runs the least number of rounds asked, no
    /// more.
    pub target_spread: f64,
    /// The most rounds of a model, whatever the spread.
    pub max_rounds: usize,
    /// No round is added once a model's timed rounds have taken this many seconds.
    pub max_time_s: f64,
}

impl Default for Rounds {
    /// ±2%, at most 50 rounds or 60 s of rounds a model.
    fn default() -> Self {
        Self {
            target_spread: 0.02,
            max_rounds: 50,
            max_time_s: 60.0,
        }
    }
}

/// The least rounds asked from which rounds are added (fewer are run as asked).
pub const ADAPTIVE_FROM: usize = 3;

impl Rounds {
    /// Whether the rounds of a model can stop after `done` rounds, `least` asked,
    /// their times having taken `elapsed_s` seconds so far, with `spreads` each timed
    /// strategy's [`spread`] now.
    pub fn enough(
        &self,
        done: usize,
        least: usize,
        elapsed_s: f64,
        mut spreads: impl Iterator<Item = Option<f64>>,
    ) -> bool {
        if done < least {
            return false;
        }
        if !self.adds_rounds(least) || done >= self.max_rounds || elapsed_s >= self.max_time_s {
            return true;
        }
        spreads.all(|s| s.is_some_and(|s| s <= self.target_spread))
    }

    /// Whether rounds are added past `least` (see the [module](self)).
    pub fn adds_rounds(&self, least: usize) -> bool {
        least >= ADAPTIVE_FROM && self.target_spread > 0.0 && self.max_rounds > least
    }

    /// The most rounds a model with `least` asked may run.
    pub fn most(&self, least: usize) -> usize {
        if self.adds_rounds(least) {
            self.max_rounds
        } else {
            least
        }
    }
}

/// The confidence of the interval [`spread`] measures.
const CONFIDENCE: f64 = 0.95;

/// The median's distribution-free 95% interval among `n` times: from the `k`-th
/// fastest to the `k`-th slowest, `k` as large as the coverage allows (1: the fastest
/// to the slowest). `None` below 6 times, where even the fastest and the slowest
/// cover less than 95%.
fn order(n: usize) -> Option<usize> {
    // P(Binomial(n, 1/2) <= j), summed term by term.
    let mut term = 0.5f64.powi(i32::try_from(n).ok()?);
    let mut below = 0.0;
    let mut k = None;
    for j in 0..n {
        below += term;
        if 1.0 - 2.0 * below < CONFIDENCE {
            break;
        }
        k = Some(j);
        term *= (n - j) as f64 / (j + 1) as f64;
    }
    // The interval from the (j + 1)-th fastest to the (j + 1)-th slowest covers the
    // median with probability 1 - 2 P(B <= j).
    k.map(|j| j + 1).filter(|&k| 2 * k < n)
}

/// The spread of the median of `times`: half the width of its 95% distribution-free
/// confidence interval over the median (0.011: ±1.1%); `None` below 6 times, or for a
/// median of 0.
pub fn spread(times: &[f64]) -> Option<f64> {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let k = order(n)?;
    let median = sorted[n / 2];
    if median <= 0.0 || !median.is_finite() {
        return None;
    }
    let (lo, hi) = (sorted[k - 1], sorted[n - k]);
    Some((hi - lo) / 2.0 / median)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_as_narrow_as_the_binomial_allows() {
        // Below 6, even min..max covers less than 95% (n = 5: 1 - 2/32 = 93.75%).
        for n in 0..6 {
            assert_eq!(order(n), None, "{n}");
        }
        // 6..8: the fastest to the slowest (n = 6: 1 - 2/64 = 96.9%; n = 8: the 2nd
        // to the 7th would cover 1 - 2 * 9/256 = 93.0%, too little).
        for n in 6..=8 {
            assert_eq!(order(n), Some(1), "{n}");
        }
        // n = 9: P(B <= 1) = 10/512 = 1.95%, so the 2nd to the 8th cover 96.1%.
        assert_eq!(order(9), Some(2));
        // n = 20: P(B <= 5) = 2.07%, P(B <= 6) = 5.77%: the 6th to the 15th.
        assert_eq!(order(20), Some(6));
        // n = 50: P(B <= 17) = 1.64%, P(B <= 18) = 3.25%: the 18th to the 33rd.
        assert_eq!(order(50), Some(18));
    }

    #[test]
    fn the_spread_is_the_interval_s_half_width_over_the_median() {
        assert_eq!(spread(&[1.0, 1.0, 1.0, 1.0, 1.0]), None);
        // Six times: min..max, around the upper median 10.
        let six = [10.0, 9.0, 11.0, 10.0, 12.0, 10.0];
        assert_eq!(spread(&six), Some((12.0 - 9.0) / 2.0 / 10.0));
        // Nine: the 2nd fastest (2.0) to the 2nd slowest (8.0), median 5.0; the
        // outliers 0.0 and 100.0 do not count.
        let nine = [5.0, 100.0, 3.0, 4.0, 6.0, 7.0, 8.0, 2.0, 0.0];
        assert_eq!(spread(&nine), Some((8.0 - 2.0) / 2.0 / 5.0));
        assert_eq!(spread(&[0.0; 8]), None);
    }

    #[test]
    fn rounds_stop_when_every_median_is_steady_or_a_cap_is_reached() {
        let rounds = Rounds {
            target_spread: 0.02,
            max_rounds: 10,
            max_time_s: 30.0,
        };
        let steady = || [Some(0.01), Some(0.02)].into_iter();
        let unsteady = || [Some(0.01), Some(0.03)].into_iter();
        let unknown = || [Some(0.01), None].into_iter();
        // Never fewer than asked.
        assert!(!rounds.enough(2, 3, 100.0, steady()));
        // Steady: done.
        assert!(rounds.enough(6, 3, 1.0, steady()));
        // One median over the target, or not known yet: one more round.
        assert!(!rounds.enough(6, 3, 1.0, unsteady()));
        assert!(!rounds.enough(3, 3, 1.0, unknown()));
        // Up to the caps.
        assert!(rounds.enough(10, 3, 1.0, unsteady()));
        assert!(rounds.enough(7, 3, 30.0, unknown()));
        // A quick look (1 or 2 rounds asked), or no target: as asked.
        assert!(rounds.enough(1, 1, 0.0, unknown()));
        assert!(rounds.enough(2, 2, 0.0, unsteady()));
        let fixed = Rounds {
            target_spread: 0.0,
            ..rounds
        };
        assert!(fixed.enough(3, 3, 0.0, unsteady()));
        assert_eq!(fixed.most(3), 3);
        assert_eq!(rounds.most(3), 10);
        assert_eq!(rounds.most(2), 2);
        // No case timed (all failed): nothing to wait for.
        assert!(rounds.enough(3, 3, 0.0, std::iter::empty()));
    }
}
