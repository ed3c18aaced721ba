//! The trade-off fronts: for every range of stages, the schedules worth keeping as
//! `(exact bytes needed, seconds)` pairs, built bottom-up once for all budgets.
use super::stages::Stages;

/// One schedule of a range, by what it costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Point {
    /// Exact bytes the schedule needs above the range's start.
    pub(super) need: u64,
    /// Seconds it takes.
    pub(super) time_s: f64,
}

/// Bytes of one front point, for the size bound.
pub(super) const POINT_BYTES: usize = std::mem::size_of::<Point>();

/// A range's front holds at most this many points, the top level's (ranges that end
/// with the loss) `TOP_FACTOR` times as many; `cap_for` chooses it.
pub(super) const TOP_FACTOR: usize = 8;

/// Candidates up to this many (and at least 256) are sorted into an exact front; more
/// are thinned into buckets at once.
fn sort_limit(cap: usize) -> usize {
    (8 * cap).max(256)
}

/// The last point of `front` whose need fits `budget`: the fastest schedule that fits.
pub(super) fn lookup(front: &[Point], budget: u64) -> Option<Point> {
    let fitting = front.partition_point(|p| p.need <= budget);
    fitting.checked_sub(1).map(|i| front[i])
}

/// Every range's front, in one buffer.
pub(super) struct Fronts {
    stages: usize,
    /// `(start, len)` into `points` for the range `s..t`, at `s * (stages + 1) + t`.
    spans: Vec<(u32, u32)>,
    points: Vec<Point>,
}

impl Fronts {
    /// The most bytes `build` allocates for `stages` stages with fronts of `cap`
    /// points: the spans, the points, and the working buffers.
    pub(super) fn bound_bytes(stages: usize, cap: usize) -> usize {
        let pairs = (stages + 1) * (stages + 2) / 2;
        let spans = (stages + 1) * (stages + 1) * std::mem::size_of::<(u32, u32)>();
        let points = (pairs + stages * (TOP_FACTOR - 1)) * cap * POINT_BYTES;
        let work =
            (stages + 1) * 8 + (Self::scratch_points(stages, cap) + sort_limit(cap)) * POINT_BYTES;
        spans + points + work
    }

    fn scratch_points(stages: usize, cap: usize) -> usize {
        // The store candidate plus one merge per checkpoint end, each at most the sum of
        // two fronts; thinning starts once sort_limit is passed.
        sort_limit(cap).min((stages + 1) * 2 * TOP_FACTOR * cap) + 2 * TOP_FACTOR * cap + cap
    }

    pub(super) fn get(&self, s: usize, t: usize) -> &[Point] {
        let (start, len) = self.spans[s * (self.stages + 1) + t];
        &self.points[start as usize..(start + len) as usize]
    }

    /// Builds the front of every range `s..t` of `st`, keeping at most `cap` points per
    /// front (`TOP_FACTOR * cap` for the ranges ending with the loss). Each front keeps
    /// its least-memory point and its fastest point exactly; where a front has more
    /// points than its cap, points in between are dropped, which can only cost time,
    /// never memory: every point is the exact need of a real schedule.
    pub(super) fn build(st: &Stages, cap: usize) -> Self {
        let stages = st.len();
        let pairs = (stages + 1) * (stages + 2) / 2;
        let mut fronts = Fronts {
            stages,
            spans: vec![(0, 0); (stages + 1) * (stages + 1)],
            points: Vec::with_capacity((pairs + stages * (TOP_FACTOR - 1)) * cap),
        };
        let mut scratch = Vec::with_capacity(Self::scratch_points(stages, cap));
        let mut sorted = Vec::with_capacity(sort_limit(cap));
        // plain[t]: need of the range s..t run with no checkpoint, for the current s.
        let mut plain = vec![0u64; stages + 1];
        for s in (0..=stages).rev() {
            for t in (s..=stages).rev() {
                plain[t] = if s == t {
                    st.a[t] + st.grads[t]
                } else {
                    (st.forward_peak[s] + st.grads[t])
                        .max(st.backward_peak[s])
                        .max(st.retained[s] + plain[t])
                };
            }
            for (t, &hi) in plain.iter().enumerate().skip(s) {
                let start = fronts.points.len();
                if s == t {
                    fronts.points.push(Point {
                        need: hi,
                        time_s: 0.0,
                    });
                } else {
                    scratch.clear();
                    // Layer s run normally, then the rest.
                    let floor = (st.forward_peak[s] + st.grads[t]).max(st.backward_peak[s]);
                    for p in fronts.get(s + 1, t) {
                        scratch.push(Point {
                            need: floor.max(st.retained[s] + p.need),
                            time_s: p.time_s + st.time_s[s],
                        });
                    }
                    // Checkpoint s..k, then the rest.
                    for cand in st.checkpoint_candidates(s, t) {
                        if cand.floor > hi {
                            // The floor only grows with k, and a need above the plain
                            // run's is never worth its recompute.
                            break;
                        }
                        merge(
                            (fronts.get(cand.k, t), cand.rest_bytes, 0),
                            fronts.get(s, cand.k),
                            cand.inner_bytes,
                            cand.floor,
                            hi,
                            cand.nograd_time_s,
                            &mut scratch,
                        );
                        // The same checkpoint with its input kept by a store: top level
                        // only (a checkpoint nested in another is not rerun from a store).
                        if t != stages {
                            continue;
                        }
                        for store in st.stores[s].iter().flatten() {
                            let c = cand.stored(store, st.a[s]);
                            if c.floor > hi {
                                continue;
                            }
                            merge(
                                (fronts.get(cand.k, t), c.rest_bytes, c.discount),
                                fronts.get(s, cand.k),
                                c.inner_bytes,
                                c.floor,
                                hi,
                                c.time_s,
                                &mut scratch,
                            );
                        }
                    }
                    let cap = if t == stages { TOP_FACTOR * cap } else { cap };
                    reduce(&mut scratch, &mut sorted, hi, cap, &mut fronts.points);
                }
                let len = fronts.points.len() - start;
                fronts.spans[s * (stages + 1) + t] = (start as u32, len as u32);
            }
        }
        fronts
    }
}

/// Appends to `out` the front of "run the part with `first` (needing `shift_first` more,
/// less `discount_first`, never below 0), and the part with `second` (`shift_second`
/// more)", never below `floor`, up to `hi`: walking both fronts by the next smallest need
/// gives every schedule worth keeping.
#[allow(clippy::too_many_arguments)] // one tight loop; a struct would only rename them
fn merge(
    (first, shift_first, discount_first): (&[Point], u64, u64),
    second: &[Point],
    shift_second: u64,
    floor: u64,
    hi: u64,
    extra_time_s: f64,
    out: &mut Vec<Point>,
) {
    let (mut i, mut j) = (0, 0);
    loop {
        let need = floor
            .max((shift_first + first[i].need).saturating_sub(discount_first))
            .max(shift_second + second[j].need);
        if need > hi {
            return;
        }
        out.push(Point {
            need,
            time_s: first[i].time_s + second[j].time_s + extra_time_s,
        });
        let next_first = first.get(i + 1).map(|p| shift_first + p.need);
        let next_second = second.get(j + 1).map(|p| shift_second + p.need);
        match (next_first, next_second) {
            (None, None) => return,
            (Some(_), None) => i += 1,
            (None, Some(_)) => j += 1,
            (Some(x), Some(y)) => {
                if x <= y {
                    i += 1;
                }
                if y <= x {
                    j += 1;
                }
            }
        }
    }
}

/// Turns candidate schedules into a front of at most `cap` points appended to `out`:
/// the exact Pareto front when there are few candidates and it fits; otherwise the
/// least-memory point and, in each of `cap - 1` equal slices of the need up to `hi`,
/// the fastest candidate, as long as it is faster than every point before it.
fn reduce(
    candidates: &mut [Point],
    sorted: &mut Vec<Point>,
    hi: u64,
    cap: usize,
    out: &mut Vec<Point>,
) {
    if candidates.is_empty() {
        return;
    }
    if candidates.len() <= sort_limit(cap) {
        candidates.sort_unstable_by(|x, y| x.need.cmp(&y.need).then(x.time_s.total_cmp(&y.time_s)));
        sorted.clear();
        for &p in candidates.iter() {
            if sorted
                .last()
                .is_none_or(|last: &Point| p.time_s < last.time_s)
            {
                sorted.push(p);
            }
        }
        if sorted.len() <= cap {
            out.extend_from_slice(sorted);
            return;
        }
        thin(sorted, hi, cap, out);
    } else {
        thin(candidates, hi, cap, out);
    }
}

/// The bucket thinning of `reduce`, over candidates in any order.
fn thin(candidates: &[Point], hi: u64, cap: usize, out: &mut Vec<Point>) {
    let better = |p: &Point, q: &Point| (p.time_s, p.need) < (q.time_s, q.need);
    let mut least = candidates[0];
    for p in candidates {
        if p.need < least.need || (p.need == least.need && p.time_s < least.time_s) {
            least = *p;
        }
    }
    let buckets = cap.max(2) - 1;
    let start = out.len();
    out.push(least);
    // The buckets live in `out` itself, after the least point, then get compacted.
    let empty = Point {
        need: u64::MAX,
        time_s: f64::INFINITY,
    };
    out.resize(start + 1 + buckets, empty);
    let span = hi.saturating_sub(least.need) as f64 + 1.0;
    let scale = buckets as f64 / span;
    for p in candidates {
        let b = (((p.need.saturating_sub(least.need)) as f64 * scale) as usize).min(buckets - 1);
        let slot = &mut out[start + 1 + b];
        if better(p, slot) {
            *slot = *p;
        }
    }
    let mut kept = start + 1;
    for b in 0..buckets {
        let p = out[start + 1 + b];
        if p.need != u64::MAX && p.time_s < out[kept - 1].time_s {
            out[kept] = p;
            kept += 1;
        }
    }
    out.truncate(kept);
}
