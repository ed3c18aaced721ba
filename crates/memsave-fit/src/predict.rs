//! Predicting a configuration's peak and time at any micro-batch size from two small
//! measured ones, and a layer profile at any size from two measured profiles.
//!
//! Everything a step allocates for a fixed configuration is either independent of the
//! batch (parameters' gradients, optimizer state, RNG states) or proportional to it
//! (activations), so the peak is an affine function of the micro-batch size as long as
//! the same moment of the step holds the peak; the time is affine to a good
//! approximation (a fixed cost per micro-batch plus a cost per example).
use super::probe::Probe;
use memsave_checkpoint::{ChainProfile, LayerProfile};
use std::sync::Arc;

/// What is allocated after each allocation and free of a probe's run.
type Series = Arc<Vec<i64>>;

/// An affine model `a + b·size` of a configuration's peak and per-micro-batch time,
/// fitted on two probes.
///
/// The peak is the most of many affine functions (one per moment of the step: what
/// is allocated right after each allocation or free), so it is convex in the size and
/// a line through two sizes underestimates it beyond them when the moment of the
/// peak moves (gradients dominate small batches, activations large ones). When both
/// probes recorded the allocation after every event and the two steps made the same
/// events (the same operations in the same order), each moment is extrapolated on its
/// own and the peak is their most: exact for a step whose allocations are affine in
/// the batch. Otherwise the line through the two peaks is used.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Affine {
    size1: i64,
    peak1: u64,
    size2: i64,
    peak2: u64,
    /// Seconds per micro-batch (forward and backward) at `size1` and `size2`.
    mb_time1: f64,
    mb_time2: f64,
    /// Seconds of the optimizer after backward (once per step).
    optimizer_time_s: f64,
    /// The smallest micro-batch that was run and did not fit the budget, if any.
    fails_from: Option<i64>,
    /// The two probes' allocation series, when they line up event for event.
    series: Option<(Series, Series)>,
    /// Where the second micro-batch begins in both series, when both agree.
    second: Option<usize>,
    /// What the two probes kept on the device from step to step (the parameters and
    /// the optimizer's state), the less of the two.
    kept: u64,
}

impl Affine {
    /// The model of two probes at micro-batch sizes `size1 <= size2`, each with
    /// `micro_batches` micro-batches of that size (for a probe of uneven micro-batches,
    /// the examples it ran over `size2`: its time per `size2` examples is its time
    /// over that).
    pub(crate) fn fit(
        size1: i64,
        p1: &Probe,
        size2: i64,
        p2: &Probe,
        micro_batches: f64,
    ) -> Affine {
        let n = micro_batches.max(1.0);
        let mb = |p: &Probe| ((p.time_s - p.optimizer_time_s).max(0.0)) / n;
        let series = match (&p1.series, &p2.series) {
            (Some(a), Some(b)) if size1 < size2 && a.len() == b.len() && !a.is_empty() => {
                Some((Arc::clone(a), Arc::clone(b)))
            }
            _ => None,
        };
        let second = match (p1.second_micro_batch, p2.second_micro_batch) {
            (Some(a), Some(b)) if a == b && series.is_some() => Some(a),
            _ => None,
        };
        Affine {
            size1,
            peak1: p1.peak_bytes,
            size2,
            peak2: p2.peak_bytes,
            mb_time1: mb(p1),
            mb_time2: mb(p2),
            optimizer_time_s: p1.optimizer_time_s.min(p2.optimizer_time_s),
            fails_from: None,
            series,
            second,
            kept: p1.breakdown.kept().min(p2.breakdown.kept()),
        }
    }

    /// What the probes kept on the device from step to step: the parameters and the
    /// optimizer's state (measured, the same at every size).
    pub(crate) fn kept(&self) -> u64 {
        self.kept
    }

    /// True when the peak is extrapolated moment by moment (the probes lined up).
    pub(crate) fn is_exact(&self) -> bool {
        self.series.is_some()
    }

    /// The same model, knowing that micro-batches of `size` or more did not fit.
    pub(crate) fn failing_from(mut self, size: Option<i64>) -> Affine {
        self.fails_from = size;
        self
    }

    /// True when micro-batches of `size` are known not to fit (one that size or
    /// smaller was run over the budget).
    pub(crate) fn known_over(&self, size: i64) -> bool {
        self.fails_from.is_some_and(|f| size >= f)
    }

    /// The predicted peak with micro-batches of at most `size` examples, rounded up;
    /// `None` beyond a single probed size (nothing to extrapolate from).
    pub(crate) fn peak(&self, size: i64) -> Option<u64> {
        self.peak_split(size, size)
    }

    /// The predicted peak when the first micro-batch has `first` examples and the
    /// later ones at most `later` (an uneven split puts the larger ones first). The
    /// first micro-batch runs before any gradient exists, the later ones with all of
    /// them, so each part of the probes is extrapolated to its own size when the
    /// probes say where the second micro-batch began; else `first` is used for all.
    pub(crate) fn peak_split(&self, first: i64, later: i64) -> Option<u64> {
        let size = first.max(later);
        if size == self.size2 || (self.size1 == self.size2 && size < self.size2) {
            return Some(self.peak2);
        }
        if self.size1 == self.size2 {
            return None;
        }
        let slope = (self.peak2 as f64 - self.peak1 as f64) / (self.size2 - self.size1) as f64;
        let slope = slope.max(0.0);
        let line = self.peak2 as f64 + slope * (size - self.size2) as f64;
        let Some((a, b)) = self.series.as_ref() else {
            return Some(line.max(0.0).ceil() as u64);
        };
        let at = |size: i64, range: std::ops::Range<usize>| {
            let t = (size - self.size1) as f64 / (self.size2 - self.size1) as f64;
            a[range.clone()]
                .iter()
                .zip(&b[range])
                .map(|(&x, &y)| x as f64 + (y - x) as f64 * t)
                .fold(0.0, f64::max)
        };
        let moments = match self.second {
            Some(cut) if cut <= a.len() => at(first, 0..cut).max(at(later, cut..a.len())),
            _ => at(size, 0..a.len()).max(line),
        };
        Some(moments.max(0.0).ceil() as u64)
    }

    /// The predicted step time for micro-batches of the given sizes: a fixed cost per
    /// micro-batch plus a cost per example, both at least zero (a line through two
    /// noisy timings can cross zero, which would make more micro-batches look faster),
    /// plus the optimizer once.
    pub(crate) fn time(&self, sizes: &[i64]) -> f64 {
        let (fixed, per_example) = if self.size1 == self.size2 {
            (0.0, self.mb_time2 / self.size2.max(1) as f64)
        } else {
            let slope =
                ((self.mb_time2 - self.mb_time1) / (self.size2 - self.size1) as f64).max(0.0);
            let fixed = self.mb_time2 - slope * self.size2 as f64;
            if fixed < 0.0 {
                (0.0, self.mb_time2 / self.size2 as f64)
            } else {
                (fixed, slope)
            }
        };
        sizes
            .iter()
            .map(|&s| fixed + per_example * s as f64)
            .sum::<f64>()
            + self.optimizer_time_s
    }
}

/// The profile of the chain at micro-batch `size`, from profiles measured at `size1`
/// and `size2` (bytes and times interpolated or extrapolated linearly, bytes rounded
/// up and never negative).
pub(crate) fn profile_at(
    p1: &ChainProfile,
    size1: i64,
    p2: &ChainProfile,
    size2: i64,
    size: i64,
) -> ChainProfile {
    if size1 == size2 {
        return p2.clone();
    }
    let t = (size - size1) as f64 / (size2 - size1) as f64;
    let bytes = |a: u64, b: u64| (a as f64 + (b as f64 - a as f64) * t).max(0.0).ceil() as u64;
    let secs = |a: f64, b: f64| (a + (b - a) * t).max(0.0);
    let elements = p1
        .elements
        .iter()
        .zip(&p2.elements)
        .map(|(a, b)| LayerProfile {
            input_bytes: bytes(a.input_bytes, b.input_bytes),
            output_bytes: bytes(a.output_bytes, b.output_bytes),
            retained_bytes: bytes(a.retained_bytes, b.retained_bytes),
            forward_peak_bytes: bytes(a.forward_peak_bytes, b.forward_peak_bytes),
            nograd_peak_bytes: bytes(a.nograd_peak_bytes, b.nograd_peak_bytes),
            backward_peak_bytes: bytes(a.backward_peak_bytes, b.backward_peak_bytes),
            param_grad_bytes: b.param_grad_bytes,
            saves_output: b.saves_output,
            forward_time_s: secs(a.forward_time_s, b.forward_time_s),
            nograd_time_s: secs(a.nograd_time_s, b.nograd_time_s),
            backward_time_s: secs(a.backward_time_s, b.backward_time_s),
        })
        .collect();
    ChainProfile {
        elements,
        checkpoint_overhead_bytes: p2.checkpoint_overhead_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(peak_bytes: u64, time_s: f64) -> Probe {
        Probe {
            peak_bytes,
            breakdown: crate::PeakBreakdown::default(),
            peak_bytes_by_rank: vec![peak_bytes],
            time_s,
            optimizer_time_s: 0.0,
            series: None,
            second_micro_batch: None,
        }
    }

    #[test]
    fn peak_extrapolates_the_line_through_two_probes() {
        // 1000 fixed bytes and 100 per example.
        let a = Affine::fit(2, &probe(1200, 0.2), 4, &probe(1400, 0.4), 1.0);
        assert_eq!(a.peak(10), Some(2000));
        assert_eq!(a.peak(4), Some(1400));
        let single = Affine::fit(3, &probe(900, 0.1), 3, &probe(900, 0.1), 1.0);
        assert_eq!(single.peak(3), Some(900));
        assert_eq!(single.peak(4), None);
        assert!((a.time(&[10]) - 1.0).abs() < 1e-12);
        assert!((a.time(&[5, 5]) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn moments_are_extrapolated_one_by_one() {
        // Two moments: 1000 fixed bytes (gradients), and 100 per example
        // (activations). At sizes 2 and 4 the gradients hold the peak (1000), so the
        // line through the peaks is flat; at 20 the activations take 2000.
        let with = |size: i64, peak| Probe {
            series: Some(Arc::new(vec![100 * size, 1000])),
            ..probe(peak, 0.1)
        };
        let a = Affine::fit(2, &with(2, 1000), 4, &with(4, 1000), 1.0);
        assert!(a.is_exact());
        assert_eq!(a.peak(20), Some(2000));
        // Runs that did not make the same events: the line through the peaks.
        let unaligned = Probe {
            series: Some(Arc::new(vec![1, 2, 3])),
            ..probe(1000, 0.1)
        };
        let b = Affine::fit(2, &with(2, 1000), 4, &unaligned, 1.0);
        assert!(!b.is_exact());
        assert_eq!(b.peak(20), Some(1000));
    }

    #[test]
    fn micro_batches_after_the_first_are_extrapolated_to_their_own_size() {
        // First micro-batch: 100 per example; the second: 1000 fixed (gradients) plus
        // 100 per example. An uneven split of 7 + 6 peaks at 1000 + 600 in the second.
        let with = |size: i64| Probe {
            series: Some(Arc::new(vec![100 * size, 1000 + 100 * size])),
            second_micro_batch: Some(1),
            ..probe(1000 + 100 * size as u64, 0.1)
        };
        let a = Affine::fit(2, &with(2), 4, &with(4), 2.0);
        assert_eq!(a.peak_split(7, 6), Some(1600));
        assert_eq!(a.peak(7), Some(1700));
    }
}
