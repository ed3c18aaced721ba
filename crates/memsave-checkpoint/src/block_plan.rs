//! Planning [`Blocks`]: which top-level blocks to recompute so that a step fits a
//! budget at the least recomputation.
//!
//! [`Blocks::profile`] runs the step twice, every block kept and every block
//! recomputed, and cuts each run into segments at the blocks' starts and ends in the
//! forward and at their recomputations in backward, with the peak of each segment
//! (the meter's exact bytes). A block's *saved bytes* are what it holds after its
//! forward when kept minus what it holds when recomputed. The peak of an assignment
//! is then predicted as the largest, over the recomputed run's segments, of the
//! segment's peak plus the saved bytes of the kept blocks alive in it (those whose
//! forward ended and whose backward has not begun); a block's own forward is taken
//! from the run of its own lever. On a chain this is the usual account of
//! checkpointing. On a graph, a tensor one block gives to others (a skip, an
//! encoder's output) lives in backward as long as any block around it holds it, which
//! depends on their levers: the profile records which block holds which such tensor
//! under each lever, and each backward segment's prediction adds the bytes of those
//! alive under the assignment less those alive in the recomputed run (see
//! [`crate::crossing`]).
//!
//! [`BlocksProfile::solve`] picks the assignment with the least forward time
//! recomputed whose predicted peak fits: by enumeration up to 16 blocks, beyond by a
//! greedy pass (documented there) that never returns a slower assignment than the
//! best uniform one that fits.
use crate::blocks::{BlockKey, BlockLever, Blocks, Event, Profiler};
use crate::crossing::{self, Crossing};
use crate::error::{CheckpointError, Result};
use memsave_meter::Bytes;
use tch::{Device, Tensor};

/// Blocks up to which [`BlocksProfile::solve`] tries every assignment.
const EXACT_UP_TO: usize = 16;

/// Assignments up to which [`BlocksProfile::solve_levers`] tries every one (3^10:
/// ten blocks with three levers measured, seven with four).
const EXACT_ASSIGNMENTS: usize = 59_049;

/// What [`Blocks::profile`] measured: per top-level block its saved bytes and forward
/// time, and the segments of the two profiled steps.
#[derive(Debug, Clone)]
pub struct BlocksProfile {
    keys: Vec<BlockKey>,
    saved: Vec<i64>,
    forward_s: Vec<f64>,
    /// Peak of each block's forward with every block kept / recomputed.
    forward_kept: Vec<i64>,
    forward_recomputed: Vec<i64>,
    /// The recomputed run's other segments: peak, the blocks alive in it, and the
    /// block whose recomputation opened it.
    segments: Vec<(i64, Vec<usize>, Option<usize>)>,
    /// Bytes of each block's outputs (which its recomputation makes again).
    output: Vec<i64>,
    /// Measured step peaks with every block kept / recomputed.
    kept_peak: i64,
    recomputed_peak: i64,
    /// With [`Blocks::profile_with_offload`]: seconds each block's offload adds to the
    /// step (its forward's write, measured, twice for the read in backward).
    offload_s: Option<Vec<f64>>,
    /// With an offload step: per top-level block, the peak of its own backward segment
    /// there (from backward's first read of its saves, every block's saves in the
    /// store) less that of the recomputed step's (from its recomputation), or, where
    /// either was not seen, less the block's output (which recomputing makes again).
    /// Both steps send every block away, so what the other blocks hold then is alike
    /// in both (measured, a segment's rise above its own start instead predicted every
    /// block offloaded 18.75% high on the tests' graph, against 0.15% so).
    offload_backward: Option<Vec<i64>>,
    /// With [`ProfileOptions::compress`]: what the step with every block's saves
    /// compressed measured.
    compressed: Option<CompressedFigures>,
    /// The tensors that cross top-level blocks, and which block holds each under which
    /// lever (see [`crossing`]); empty where the profiled steps did not pass the same.
    crossings: Vec<Crossing>,
    /// The first of `segments` in backward (the loss's).
    backward_from: usize,
}

/// Per top-level block, from the step with every block's saves compressed: the bytes
/// its compressed saves hold between its forward and its backward (above what a
/// recomputed block holds), the peak of its forward, the seconds compression adds
/// (the encode measured, twice for the decode in backward), and its own backward.
#[derive(Debug, Clone, PartialEq)]
struct CompressedFigures {
    saved: Vec<i64>,
    forward: Vec<i64>,
    seconds: Vec<f64>,
    /// Per block, its own backward's peak there above the recomputed step's (see
    /// [`BlocksProfile::own_backward`]).
    backward: Vec<i64>,
}

/// How [`Blocks::profile_with`] profiles: the default is
/// [`Blocks::profile`]'s two steps, with the gradients kept.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ProfileOptions {
    /// A third step with every block's saves in this store (a
    /// [`BlockLever::Store`]), for [`BlocksProfile::solve_levers`].
    pub offload: Option<BlockLever>,
    /// Free each parameter's gradient as soon as backward completes it (a step whose
    /// gradients go to files, or into the optimizer step in backward).
    pub free_gradients: bool,
    /// A step with every block's saves handed to this lossy store (a
    /// [`BlockLever::Store`] that compresses: memsave-hooks' `Compress`), so that
    /// [`BlocksProfile::solve_levers`] may compress a block's saves
    /// ([`PlannedLever::Compress`]) where that is the cheapest way to fit.
    pub compress: Option<BlockLever>,
}

impl ProfileOptions {
    /// The default options with the offload step's store.
    pub fn with_offload(mut self, offload: BlockLever) -> Self {
        self.offload = Some(offload);
        self
    }

    /// The default options with the compressing step's store.
    pub fn with_compress(mut self, compress: BlockLever) -> Self {
        self.compress = Some(compress);
        self
    }

    /// The default options with each gradient freed as it is complete, or not.
    pub fn with_free_gradients(mut self, free: bool) -> Self {
        self.free_gradients = free;
        self
    }
}

/// What the planner gives one top-level block: kept, recomputed, its saved tensors
/// offloaded (with the store [`Blocks::profile_with_offload`] measured), or compressed
/// (with the store of [`ProfileOptions::compress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlannedLever {
    /// What it saves stays in memory.
    Keep,
    /// Recomputed in backward.
    Recompute,
    /// What it saves waits in the store until backward.
    Offload,
    /// What it saves stays in memory, compressed (lossy: gradients change).
    Compress,
}

impl PlannedLever {
    /// False for [`Compress`](Self::Compress), whose gradients differ from the plain
    /// step's.
    pub fn is_lossless(self) -> bool {
        self != PlannedLever::Compress
    }
}

impl BlocksProfile {
    /// The profile at batch size `m` from profiles `pa` and `pb` at sizes `a` and `b`
    /// (`a != b`), each byte figure on the line through the two (bytes grow linearly
    /// with the batch in most layers: what a block saves, its outputs, its
    /// workspace), the times `pb`'s scaled by `m / b`. `None` when the two profiles do
    /// not have the same blocks and segments (a step whose blocks depend on the batch
    /// size).
    pub fn interpolate(
        pa: &BlocksProfile,
        a: i64,
        pb: &BlocksProfile,
        b: i64,
        m: i64,
    ) -> Option<BlocksProfile> {
        let same = pa.keys == pb.keys
            && pa.compressed.is_some() == pb.compressed.is_some()
            && pa.offload_backward.is_some() == pb.offload_backward.is_some()
            && pa.segments.len() == pb.segments.len()
            && pa
                .segments
                .iter()
                .zip(&pb.segments)
                .all(|(x, y)| x.1 == y.1 && x.2 == y.2)
            && pa.backward_from == pb.backward_from;
        if !same {
            return None;
        }
        if a == b {
            return Some(pb.clone());
        }
        // Bytes never fall below zero, however far below `a` the line is followed.
        let line = |fa: i64, fb: i64| -> i64 {
            let v = fa as f64 + (fb - fa) as f64 * (m - a) as f64 / (b - a) as f64;
            (v.round() as i64).max(0)
        };
        // Who holds which crossing tensor may change with the batch size (an op that
        // copies at one size and views at another): then `pb`'s crossings are taken,
        // bytes scaled, and with them `pb`'s own-backward figures (corrected for
        // those crossings when profiled), scaled too.
        let same_crossings = same_crossings(&pa.crossings, &pb.crossings);
        let by_b = |fb: i64| (fb as f64 * m as f64 / b as f64).round() as i64;
        // A difference of two peaks, which may be below zero.
        let signed = |fa: i64, fb: i64| -> i64 {
            if !same_crossings {
                return by_b(fb);
            }
            (fa as f64 + (fb - fa) as f64 * (m - a) as f64 / (b - a) as f64).round() as i64
        };
        let lines = |xa: &[i64], xb: &[i64]| xa.iter().zip(xb).map(|(&x, &y)| line(x, y)).collect();
        let scaled = |v: &[f64]| v.iter().map(|s| s * m as f64 / b as f64).collect();
        let compressed = match (&pa.compressed, &pb.compressed) {
            (Some(ca), Some(cb)) => Some(CompressedFigures {
                saved: lines(&ca.saved, &cb.saved),
                forward: lines(&ca.forward, &cb.forward),
                seconds: scaled(&cb.seconds),
                backward: ca
                    .backward
                    .iter()
                    .zip(&cb.backward)
                    .map(|(&x, &y)| signed(x, y))
                    .collect(),
            }),
            _ => None,
        };
        Some(BlocksProfile {
            keys: pb.keys.clone(),
            saved: lines(&pa.saved, &pb.saved),
            forward_s: pb
                .forward_s
                .iter()
                .map(|s| s * m as f64 / b as f64)
                .collect(),
            forward_kept: lines(&pa.forward_kept, &pb.forward_kept),
            output: lines(&pa.output, &pb.output),
            forward_recomputed: lines(&pa.forward_recomputed, &pb.forward_recomputed),
            segments: pa
                .segments
                .iter()
                .zip(&pb.segments)
                .map(|((x, alive, own), (y, _, _))| (line(*x, *y), alive.clone(), *own))
                .collect(),
            kept_peak: line(pa.kept_peak, pb.kept_peak),
            recomputed_peak: line(pa.recomputed_peak, pb.recomputed_peak),
            offload_s: pb.offload_s.as_deref().map(scaled),
            offload_backward: match (&pa.offload_backward, &pb.offload_backward) {
                (Some(oa), Some(ob)) => {
                    Some(oa.iter().zip(ob).map(|(&x, &y)| signed(x, y)).collect())
                }
                _ => None,
            },
            compressed,
            crossings: if same_crossings {
                pa.crossings
                    .iter()
                    .zip(&pb.crossings)
                    .map(|(x, y)| Crossing {
                        bytes: line(x.bytes, y.bytes),
                        ..y.clone()
                    })
                    .collect()
            } else {
                pb.crossings
                    .iter()
                    .map(|y| Crossing {
                        bytes: by_b(y.bytes),
                        ..y.clone()
                    })
                    .collect()
            },
            backward_from: pb.backward_from,
        })
    }

    /// Every figure of the profile (bytes and seconds) in a fixed order, without its
    /// structure (its blocks and which are alive in each segment): what ranks agree
    /// on, each taking the largest over them, before they plan (see
    /// [`with_figures`](Self::with_figures)). Bytes are exact as `f64` up to 2^53.
    pub fn figures(&self) -> Vec<f64> {
        let bytes = |v: &[i64]| v.iter().map(|&b| b as f64).collect::<Vec<_>>();
        let mut out = Vec::new();
        out.extend(bytes(&self.saved));
        out.extend(&self.forward_s);
        out.extend(bytes(&self.forward_kept));
        out.extend(bytes(&self.forward_recomputed));
        out.extend(bytes(&self.output));
        out.extend(self.segments.iter().map(|(p, _, _)| *p as f64));
        out.push(self.kept_peak as f64);
        out.push(self.recomputed_peak as f64);
        if let Some(off) = &self.offload_s {
            out.extend(off);
        }
        if let Some(ob) = &self.offload_backward {
            out.extend(bytes(ob));
        }
        if let Some(c) = &self.compressed {
            out.extend(bytes(&c.saved));
            out.extend(bytes(&c.forward));
            out.extend(&c.seconds);
            out.extend(bytes(&c.backward));
        }
        out.extend(self.crossings.iter().map(|c| c.bytes as f64));
        out
    }

    /// A fingerprint of the profile's structure (its blocks' keys, and which blocks are
    /// alive in each segment and which recomputation opened it), without its figures:
    /// ranks whose fingerprints differ ran other blocks, and must not plan together.
    pub fn structure_fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        // FNV-1a through `Hash`: the same on every process (std's default hasher is
        // seeded per process).
        struct Fnv(u64);
        impl Hasher for Fnv {
            fn finish(&self) -> u64 {
                self.0
            }
            fn write(&mut self, bytes: &[u8]) {
                for b in bytes {
                    self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        for k in &self.keys {
            k.to_string().hash(&mut h);
        }
        for (_, alive, own) in &self.segments {
            alive.hash(&mut h);
            own.hash(&mut h);
        }
        self.offload_s.is_some().hash(&mut h);
        self.offload_backward.is_some().hash(&mut h);
        self.compressed.is_some().hash(&mut h);
        self.backward_from.hash(&mut h);
        for c in &self.crossings {
            c.structure().hash(&mut h);
        }
        h.finish()
    }

    /// This profile with `figures` (ordered as [`figures`](Self::figures) gives them)
    /// in place of its own; `None` when there are not as many.
    pub fn with_figures(&self, figures: &[f64]) -> Option<BlocksProfile> {
        if figures.len() != self.figures().len() {
            return None;
        }
        let mut at = figures.iter().copied();
        let mut take = |n: usize| -> Vec<f64> { at.by_ref().take(n).collect() };
        let bytes = |v: Vec<f64>| v.into_iter().map(|b| b.round() as i64).collect::<Vec<_>>();
        let n = self.keys.len();
        let saved = bytes(take(n));
        let forward_s = take(n);
        let forward_kept = bytes(take(n));
        let forward_recomputed = bytes(take(n));
        let output = bytes(take(n));
        let peaks = bytes(take(self.segments.len()));
        let ends = bytes(take(2));
        let offload_s = self.offload_s.as_ref().map(|_| take(n));
        let offload_backward = self.offload_backward.as_ref().map(|_| bytes(take(n)));
        let compressed = self.compressed.as_ref().map(|_| CompressedFigures {
            saved: bytes(take(n)),
            forward: bytes(take(n)),
            seconds: take(n),
            backward: bytes(take(n)),
        });
        let crossings = self
            .crossings
            .iter()
            .zip(bytes(take(self.crossings.len())))
            .map(|(c, b)| Crossing {
                bytes: b,
                ..c.clone()
            })
            .collect();
        Some(BlocksProfile {
            keys: self.keys.clone(),
            saved,
            forward_s,
            forward_kept,
            forward_recomputed,
            segments: self
                .segments
                .iter()
                .zip(peaks)
                .map(|((_, alive, own), p)| (p, alive.clone(), *own))
                .collect(),
            output,
            kept_peak: ends[0],
            recomputed_peak: ends[1],
            offload_s,
            offload_backward,
            compressed,
            crossings,
            backward_from: self.backward_from,
        })
    }

    /// The top-level blocks, in forward order.
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// Bytes each top-level block saves for backward when kept (what recomputing it
    /// frees between its forward and its backward).
    pub fn saved_bytes(&self) -> &[i64] {
        &self.saved
    }

    /// Seconds of each top-level block's forward (what recomputing it costs).
    pub fn forward_seconds(&self) -> &[f64] {
        &self.forward_s
    }

    /// The measured step peaks (bytes above the step's start) with every block kept
    /// and with every block recomputed.
    pub fn measured_peaks(&self) -> (i64, i64) {
        (self.kept_peak, self.recomputed_peak)
    }

    /// The predicted step peak (bytes above the step's start) when the top-level
    /// blocks with `recompute[i]` true are recomputed and the others kept.
    ///
    /// # Panics
    /// When `recompute` has not one entry per top-level block.
    pub fn predict(&self, recompute: &[bool]) -> i64 {
        let away = vec![PlannedLever::Recompute; recompute.len()];
        self.predict_levers(&sent_away(recompute, &away))
    }

    /// Bytes block `j` holds between its forward and its backward under `lever`, above
    /// what it holds recomputed (its saves kept, compressed, or none). A block
    /// compressed in a profile that did not measure compression counts as kept.
    fn held(&self, lever: PlannedLever, j: usize) -> i64 {
        match lever {
            PlannedLever::Keep => self.saved[j],
            PlannedLever::Compress => self
                .compressed
                .as_ref()
                .map_or(self.saved[j], |c| c.saved[j]),
            PlannedLever::Recompute | PlannedLever::Offload => 0,
        }
    }

    /// The predicted step peak (bytes above the step's start) under `levers`, one per
    /// top-level block. An offloaded block holds what a recomputed one does between
    /// its forward and its backward (its saved tensors are in the store), and reads
    /// its saves back in its backward instead of recomputing its outputs; a compressed
    /// one holds its compressed saves, measured (which may be more than its kept saves
    /// where it saves tensors that stay alive anyway, as its own output: each gets a
    /// compressed copy).
    ///
    /// # Panics
    /// When `levers` has not one entry per top-level block.
    pub fn predict_levers(&self, levers: &[PlannedLever]) -> i64 {
        assert_eq!(levers.len(), self.keys.len(), "one entry per block");
        let held = |alive: &mut dyn Iterator<Item = usize>| -> i64 {
            alive.map(|j| self.held(levers[j], j)).sum()
        };
        // The levers as the profile counts them, once for every place below.
        let counted = self.measured_levers(levers);
        let crossing = self.crossing_difference(&counted);
        let mut peak = self
            .segments
            .iter()
            .zip(crossing)
            .enumerate()
            .map(|(s, ((p, alive, own), crossing))| {
                // In the forward, segment s > 0 is the one after block s - 1 ended.
                let crossing = crossing
                    + self.forward_crossing(
                        s < self.backward_from,
                        2 * s,
                        &counted,
                        PlannedLever::Recompute,
                    );
                // The profile's segment of a block's backward began with its
                // recomputation, which made its outputs again; an offloaded block
                // reads its saves back instead. A compressed one is counted as its
                // recomputation with its compressed saves still held: high, since it
                // decompresses its saves one node at a time, but a compressed copy of
                // a tensor alive anyway (the block's output) costs its bytes then.
                let own = match own.map(|i| (i, levers[i])) {
                    Some((i, PlannedLever::Offload)) => self
                        .offload_backward
                        .as_ref()
                        .map_or(-self.output[i], |d| d[i]),
                    Some((i, PlannedLever::Compress)) => {
                        self.compressed.as_ref().map_or(0, |c| c.backward[i])
                    }
                    _ => 0,
                };
                p + held(&mut alive.iter().copied()) + own + crossing
            })
            .max()
            .unwrap_or(0);
        for (i, lever) in levers.iter().enumerate() {
            // A block's forward peak in the profiled run where every block had its
            // lever, corrected by what the blocks before it hold under theirs instead.
            let before = held(&mut (0..i));
            let reference = match (lever, &self.compressed) {
                (PlannedLever::Recompute | PlannedLever::Offload, _) => PlannedLever::Recompute,
                (PlannedLever::Compress, Some(_)) => PlannedLever::Compress,
                _ => PlannedLever::Keep,
            };
            let before = before + self.forward_crossing(true, 2 * i + 1, &counted, reference);
            let at = match (lever, &self.compressed) {
                (PlannedLever::Recompute | PlannedLever::Offload, _) => {
                    self.forward_recomputed[i] + before
                }
                (PlannedLever::Compress, Some(c)) => {
                    c.forward[i] + before - c.saved[..i].iter().sum::<i64>()
                }
                (PlannedLever::Keep | PlannedLever::Compress, _) => {
                    self.forward_kept[i] + before - self.saved[..i].iter().sum::<i64>()
                }
            };
            peak = peak.max(at);
        }
        peak
    }
    /// The levers of `recompute` (true: [`BlockLever::Recompute`], false:
    /// [`BlockLever::Keep`]) by key, for [`Blocks::assign`].
    pub fn levers(&self, recompute: &[bool]) -> Vec<(BlockKey, BlockLever)> {
        self.keys
            .iter()
            .zip(recompute)
            .map(|(k, &r)| {
                let lever = if r {
                    BlockLever::Recompute
                } else {
                    BlockLever::Keep
                };
                (k.clone(), lever)
            })
            .collect()
    }

    /// A table of `recompute`: per block its lever, saved bytes and forward time,
    /// then the predicted peak and the recomputed time.
    pub fn explain(&self, recompute: &[bool]) -> String {
        let mut out = String::from("block            lever      saved bytes   forward ms\n");
        for (i, key) in self.keys.iter().enumerate() {
            let lever = if recompute.get(i).copied().unwrap_or(false) {
                "recompute"
            } else {
                "keep"
            };
            out.push_str(&format!(
                "{:<16} {:<10} {:>11}   {:>10.3}\n",
                key.to_string(),
                lever,
                self.saved[i],
                1e3 * self.forward_s[i]
            ));
        }
        out.push_str(&format!(
            "predicted peak {} B; recomputed forward {:.3} ms\n",
            self.predict(recompute),
            1e3 * self.recompute_seconds(recompute)
        ));
        out
    }

    /// Seconds of forward recomputed under `recompute`.
    pub fn recompute_seconds(&self, recompute: &[bool]) -> f64 {
        recompute
            .iter()
            .zip(&self.forward_s)
            .filter(|(r, _)| **r)
            .map(|(_, s)| s)
            .sum()
    }

    /// The assignment (true: recompute) with the least recomputed forward time whose
    /// predicted peak is at most `budget` bytes above the step's start.
    ///
    /// Up to 16 blocks every assignment is tried. Beyond, a greedy pass starts from
    /// every block recomputed and keeps blocks one at a time, the one with the most
    /// forward time per saved byte first, while the prediction fits; every block kept
    /// is tried first, so the result is never slower than the best uniform assignment.
    ///
    /// # Errors
    /// [`CheckpointError::InfeasibleBudget`] with the smallest predicted peak when
    /// nothing fits.
    pub fn solve(&self, budget: u64) -> Result<Vec<bool>> {
        self.solve_costs(
            budget,
            &self.forward_s,
            &vec![PlannedLever::Recompute; self.keys.len()],
        )
    }

    /// The levers with the least added time within `budget` (see
    /// [`solve`](Self::solve)): each block kept, recomputed, or, when the profile
    /// measured them, offloaded ([`Blocks::profile_with_offload`]) or compressed
    /// ([`ProfileOptions::compress`]). An offloaded block frees between its forward and
    /// its backward what a recomputed one does (its saved tensors; the store keeps none
    /// in memory), and its own backward, which reads its saves back instead of making
    /// them again, holds what the profile measured there; a compressed one frees less
    /// (it keeps its compressed saves), at its own cost.
    ///
    /// Every assignment is tried up to 59,049 of them (ten blocks with offload or
    /// compression measured, seven with both; with both, up to ten blocks every
    /// assignment of kept, compressed and the faster way to send away too). Beyond,
    /// the fastest of greedy passes:
    /// the best assignment of kept and sent away as [`solve`](Self::solve) finds it,
    /// a block sent away taking the faster of recompute and offload, or the one whose
    /// own backward holds less; with compression measured, each of those with the
    /// blocks sent away whose compression costs less compressed one at a time, the
    /// largest saving first, while the prediction fits; and every block sent away (or
    /// compressed), then moved to cheaper levers one at a time, the most seconds saved
    /// per byte added first, while the prediction fits. Never slower than the best
    /// assignment of kept and sent away alone.
    ///
    /// # Errors
    /// As [`solve`](Self::solve).
    pub fn solve_levers(&self, budget: u64) -> Result<Vec<PlannedLever>> {
        let n = self.keys.len();
        let budget_i = i64::try_from(budget).unwrap_or(i64::MAX);
        let mut options = vec![PlannedLever::Keep, PlannedLever::Recompute];
        if self.offload_s.is_some() {
            options.push(PlannedLever::Offload);
        }
        if self.compressed.is_some() {
            options.push(PlannedLever::Compress);
        }
        let k = options.len();
        let within = |k: usize| (k as f64).powi(n as i32) <= EXACT_ASSIGNMENTS as f64;
        if k > 2 && within(k) {
            return self.solve_every_assignment(budget, &vec![options; n]);
        }
        // A block sent away: the cheaper of recomputing and offloading, or the one whose
        // own backward holds less (offloaded, backward reads its saves back one node at
        // a time; recomputed, it makes them all again).
        let (recompute, offload) = (PlannedLever::Recompute, PlannedLever::Offload);
        let by_time: Vec<PlannedLever> = (0..n)
            .map(|i| match &self.offload_s {
                Some(off) if off[i] < self.forward_s[i] => offload,
                _ => recompute,
            })
            .collect();
        let by_memory: Vec<PlannedLever> = (0..n)
            .map(|i| match &self.offload_backward {
                Some(d) if d[i] < 0 => offload,
                _ => recompute,
            })
            .collect();
        let mut plans = Vec::new();
        let mut smallest = i64::MAX;
        if self.compressed.is_some() && within(3) {
            // Every assignment of kept, compressed and the faster way to send away.
            let options: Vec<Vec<PlannedLever>> = by_time
                .iter()
                .map(|&away| vec![PlannedLever::Keep, away, PlannedLever::Compress])
                .collect();
            match self.solve_every_assignment(budget, &options) {
                Ok(plan) => plans.push(plan),
                Err(e) => smallest = smallest.min(smallest_of(e)?),
            }
        }
        let aways = if by_time == by_memory {
            vec![by_time]
        } else {
            vec![by_time, by_memory]
        };
        for away in aways {
            let costs: Vec<f64> = away
                .iter()
                .enumerate()
                .map(|(i, &l)| self.lever_seconds(l, i))
                .collect();
            match self.solve_costs(budget, &costs, &away) {
                Ok(r) => {
                    let plan = sent_away(&r, &away);
                    plans.extend(self.with_compression(budget_i, &plan, &away));
                    plans.push(plan);
                }
                Err(e) => smallest = smallest.min(smallest_of(e)?),
            }
        }
        if self.compressed.is_some() {
            let every = vec![PlannedLever::Compress; n];
            smallest = smallest.min(self.predict_levers(&every));
            plans.extend(self.with_compression(budget_i, &every, &every));
        }
        plans
            .into_iter()
            .filter(|l| self.predict_levers(l) <= budget_i)
            .min_by(|a, b| self.added_seconds(a).total_cmp(&self.added_seconds(b)))
            .ok_or(infeasible(budget, smallest))
    }

    /// Every assignment of the levers `options[i]` gives block `i` (as many for each),
    /// the fastest whose prediction is within `budget`.
    fn solve_every_assignment(
        &self,
        budget: u64,
        options: &[Vec<PlannedLever>],
    ) -> Result<Vec<PlannedLever>> {
        let n = self.keys.len();
        let k = options.first().map_or(1, Vec::len);
        let budget_i = i64::try_from(budget).unwrap_or(i64::MAX);
        let mut best: Option<(f64, Vec<PlannedLever>)> = None;
        let mut smallest = i64::MAX;
        let mut levers = vec![PlannedLever::Keep; n];
        for code in 0..k.pow(n as u32) {
            let (mut cost, mut rest) = (0.0, code);
            for (i, lever) in levers.iter_mut().enumerate() {
                *lever = options[i][rest % k];
                rest /= k;
                cost += self.lever_seconds(*lever, i);
            }
            if best.as_ref().is_some_and(|(bc, _)| cost >= *bc) && smallest <= budget_i {
                continue; // no faster, and the smallest is known to fit
            }
            let peak = self.predict_levers(&levers);
            smallest = smallest.min(peak);
            if peak <= budget_i && best.as_ref().is_none_or(|(bc, _)| cost < *bc) {
                best = Some((cost, levers.clone()));
            }
        }
        best.map(|(_, l)| l).ok_or(infeasible(budget, smallest))
    }

    /// `plan` with compression mixed in, when measured: each block `away` says is
    /// sent away compressed instead where that costs less, the largest saving first,
    /// while the prediction fits; and from every block sent away, the moves to a
    /// cheaper lever (sent away to compressed, compressed to kept, sent away to kept),
    /// the most seconds saved per byte added first, each made while the prediction
    /// fits. Both results (none without compression measured).
    fn with_compression(
        &self,
        budget: i64,
        plan: &[PlannedLever],
        away: &[PlannedLever],
    ) -> Vec<Vec<PlannedLever>> {
        let Some(c) = &self.compressed else {
            return Vec::new();
        };
        let fits = |l: &[PlannedLever]| self.predict_levers(l) <= budget;
        let cost = |l: PlannedLever, i: usize| self.lever_seconds(l, i);
        let saving = |i: usize| cost(plan[i], i) - c.seconds[i];
        let mut swapped = plan.to_vec();
        let mut order: Vec<usize> = (0..plan.len())
            .filter(|&i| plan[i] != PlannedLever::Keep && saving(i) > 0.0)
            .collect();
        order.sort_by(|&a, &b| saving(b).total_cmp(&saving(a)));
        for i in order {
            let was = std::mem::replace(&mut swapped[i], PlannedLever::Compress);
            if !fits(&swapped) {
                swapped[i] = was;
            }
        }
        let mut moves: Vec<(usize, PlannedLever, PlannedLever, f64)> = Vec::new();
        for (i, &sent) in away.iter().enumerate() {
            for (from, to) in [
                (sent, PlannedLever::Compress),
                (PlannedLever::Compress, PlannedLever::Keep),
                (sent, PlannedLever::Keep),
            ] {
                let saved = cost(from, i) - cost(to, i);
                if from != to && saved > 0.0 {
                    let added = (self.held(to, i) - self.held(from, i)).max(1) as f64;
                    moves.push((i, from, to, saved / added));
                }
            }
        }
        moves.sort_by(|a, b| b.3.total_cmp(&a.3));
        let mut grown = away.to_vec();
        for (i, from, to, _) in moves {
            if grown[i] == from {
                grown[i] = to;
                if !fits(&grown) {
                    grown[i] = from;
                }
            }
        }
        vec![swapped, grown]
    }

    /// Per segment, the bytes of the tensors crossing blocks alive under `levers` (as
    /// [`measured_levers`](Self::measured_levers) counts them) less those alive in the
    /// recomputed step (see [`crossing`]).
    fn crossing_difference(&self, levers: &[PlannedLever]) -> Vec<i64> {
        if self.crossings.is_empty() {
            return vec![0; self.segments.len()];
        }
        crossing::alive_difference(
            &self.crossings,
            levers,
            &self.own_segments(),
            self.backward_from,
            self.segments.len(),
        )
    }

    /// Per top-level block, its own backward's peak in a profiled step with every
    /// block under the store lever `lever` (from backward's first read of its saves:
    /// `stored`) less that in the recomputed step (from its recomputation:
    /// `recomputed`), where both were seen; less, too, what the other blocks alive
    /// then hold under `lever` and the crossing tensors alive then (each predicted per
    /// assignment). Where either was not seen: an offloaded block's backward as its
    /// recomputation less its outputs, which it does not make again; a compressed
    /// one's as its recomputation with its compressed saves held.
    fn own_backward(
        &self,
        lever: PlannedLever,
        stored: &[Option<i64>],
        recomputed: &[Option<i64>],
    ) -> Vec<i64> {
        let every = vec![lever; self.keys.len()];
        let crossing = self.crossing_difference(&self.measured_levers(&every));
        let own = self.own_segments();
        (0..self.keys.len())
            .map(|i| match (stored.get(i), recomputed.get(i), own[i]) {
                (Some(Some(s)), Some(Some(r)), Some(at)) => {
                    let others: i64 = self.segments[at]
                        .1
                        .iter()
                        .map(|&j| self.held(lever, j))
                        .sum();
                    s - r - others - crossing[at]
                }
                _ => match lever {
                    PlannedLever::Offload => -self.output[i],
                    _ => self.held(lever, i),
                },
            })
            .collect()
    }

    /// Where `in_forward`, at place `at` of the forward (block `i`'s start `2i + 1`,
    /// its end `2i + 2`), the bytes of the crossing tensors alive under `levers` (as
    /// [`measured_levers`](Self::measured_levers) counts them) less those alive in the
    /// profiled step with every block under `reference` (a lever the profile
    /// measured); 0 in backward, and where the profile's forward was not one segment
    /// per block.
    fn forward_crossing(
        &self,
        in_forward: bool,
        at: usize,
        levers: &[PlannedLever],
        reference: PlannedLever,
    ) -> i64 {
        if !in_forward || self.crossings.is_empty() || self.backward_from != self.keys.len() + 1 {
            return 0;
        }
        crossing::forward_difference(&self.crossings, at, levers, reference)
    }

    /// `levers` as the profile counts them: compression, where not measured, as kept
    /// (see [`held`](Self::held)).
    fn measured_levers(&self, levers: &[PlannedLever]) -> Vec<PlannedLever> {
        levers
            .iter()
            .map(|&l| match l {
                PlannedLever::Compress if self.compressed.is_none() => PlannedLever::Keep,
                l => l,
            })
            .collect()
    }

    /// Per top-level block, the segment its recomputation opened (the first, if
    /// several did).
    fn own_segments(&self) -> Vec<Option<usize>> {
        let mut own = vec![None; self.keys.len()];
        for (s, (_, _, by)) in self.segments.iter().enumerate() {
            if let Some(slot) = by.and_then(|i| own.get_mut(i)) {
                slot.get_or_insert(s);
            }
        }
        own
    }

    /// Seconds `lever` adds to block `i` (infinite for a lever not measured).
    fn lever_seconds(&self, lever: PlannedLever, i: usize) -> f64 {
        match lever {
            PlannedLever::Keep => 0.0,
            PlannedLever::Recompute => self.forward_s[i],
            PlannedLever::Offload => self.offload_s.as_ref().map_or(f64::INFINITY, |o| o[i]),
            PlannedLever::Compress => self
                .compressed
                .as_ref()
                .map_or(f64::INFINITY, |c| c.seconds[i]),
        }
    }

    /// Seconds `levers` add to the step: recomputed forwards, offloads and
    /// compressions (infinite for a lever the profile did not measure).
    pub fn added_seconds(&self, levers: &[PlannedLever]) -> f64 {
        levers
            .iter()
            .enumerate()
            .map(|(i, &l)| self.lever_seconds(l, i))
            .sum()
    }

    /// Whether the profile measured compression ([`ProfileOptions::compress`]).
    pub fn measured_compression(&self) -> bool {
        self.compressed.is_some()
    }
    /// Seconds each block's offload adds, when measured.
    pub fn offload_seconds(&self) -> Option<&[f64]> {
        self.offload_s.as_deref()
    }

    /// `solve` with `costs[i]` the time of sending block `i` away, under the lever
    /// `away[i]`.
    fn solve_costs(&self, budget: u64, costs: &[f64], away: &[PlannedLever]) -> Result<Vec<bool>> {
        let n = self.keys.len();
        let budget_i = i64::try_from(budget).unwrap_or(i64::MAX);
        let predict = |r: &[bool]| self.predict_levers(&sent_away(r, away));
        let fits = |r: &[bool]| predict(r) <= budget_i;
        let cost = |r: &[bool]| -> f64 {
            r.iter()
                .zip(costs)
                .filter(|(r, _)| **r)
                .map(|(_, c)| c)
                .sum()
        };
        let mut best: Option<(f64, Vec<bool>)> = None;
        let mut consider = |r: Vec<bool>| {
            if fits(&r) {
                let t = cost(&r);
                if best.as_ref().is_none_or(|(bt, _)| t < *bt) {
                    best = Some((t, r));
                }
            }
        };
        if n <= EXACT_UP_TO {
            for mask in 0u32..(1u32 << n) {
                consider((0..n).map(|i| mask & (1 << i) != 0).collect());
            }
        } else {
            consider(vec![false; n]);
            let mut r = vec![true; n];
            consider(r.clone());
            let mut order: Vec<usize> = (0..n).collect();
            let worth = |i: usize| costs[i] / self.saved[i].max(1) as f64;
            order.sort_by(|&a, &b| worth(b).total_cmp(&worth(a)));
            for i in order {
                r[i] = false;
                if !fits(&r) {
                    r[i] = true;
                }
            }
            consider(r);
        }
        match best {
            Some((_, r)) => Ok(r),
            None => {
                let smallest = if n <= EXACT_UP_TO {
                    (0u32..(1u32 << n))
                        .map(|mask| {
                            predict(&(0..n).map(|i| mask & (1 << i) != 0).collect::<Vec<_>>())
                        })
                        .min()
                        .unwrap_or(0)
                } else {
                    predict(&vec![true; n])
                };
                Err(infeasible(budget, smallest))
            }
        }
    }
}

/// Whether two profiles' crossing tensors are the same but for their bytes.
fn same_crossings(a: &[Crossing], b: &[Crossing]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.structure() == y.structure())
}

/// The levers of an assignment of kept and sent away: block `i` under `away[i]` where
/// `r[i]`, kept elsewhere.
fn sent_away(r: &[bool], away: &[PlannedLever]) -> Vec<PlannedLever> {
    r.iter()
        .zip(away)
        .map(|(&r, &l)| if r { l } else { PlannedLever::Keep })
        .collect()
}

/// The error for `budget` when the smallest predicted peak is `smallest`.
fn infeasible(budget: u64, smallest: i64) -> CheckpointError {
    CheckpointError::InfeasibleBudget {
        budget: Bytes(budget),
        smallest_feasible: Bytes(smallest.max(0) as u64),
    }
}

/// The smallest predicted peak an [`CheckpointError::InfeasibleBudget`] names; any
/// other error as it is.
fn smallest_of(e: CheckpointError) -> Result<i64> {
    match e {
        CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        } => Ok(smallest_feasible.0 as i64),
        e => Err(e),
    }
}

impl Blocks {
    /// Profiles the step `step` (the model's forward, which runs these blocks inside
    /// [`forward`](Self::forward), and its loss; the loss's `backward` is run here)
    /// twice, every block kept and every block recomputed, for
    /// [`BlocksProfile::predict`] and [`BlocksProfile::solve`]. The gradients of
    /// `params` are set to none before each run and after; running statistics are put
    /// back as they were; the levers are left as they were.
    ///
    /// Traps: the runs draw random numbers (dropout) from the global generators; and
    /// the CPU meter is process-wide, so nothing else should allocate while it runs.
    ///
    /// # Errors
    /// The step's error, a block's, or the backward's.
    pub fn profile<F, E>(&self, params: &[Tensor], step: F) -> Result<BlocksProfile>
    where
        F: FnMut() -> std::result::Result<Tensor, E>,
        E: std::fmt::Display,
    {
        self.profile_with(params, &ProfileOptions::default(), step)
    }

    /// [`profile`](Self::profile), and a third step with every block's saved tensors
    /// handed to `offload` (a [`BlockLever::Store`]: memsave-hooks' disk offload), for
    /// [`BlocksProfile::solve_levers`]: each block's offload costs its forward's extra
    /// time there, twice (the write, and as much again for the read in backward).
    ///
    /// # Errors
    /// As [`profile`](Self::profile); [`CheckpointError::Blocks`] when `offload` is
    /// not a store.
    pub fn profile_with_offload<F, E>(
        &self,
        params: &[Tensor],
        offload: BlockLever,
        step: F,
    ) -> Result<BlocksProfile>
    where
        F: FnMut() -> std::result::Result<Tensor, E>,
        E: std::fmt::Display,
    {
        let options = ProfileOptions {
            offload: Some(offload),
            ..ProfileOptions::default()
        };
        self.profile_with(params, &options, step)
    }

    /// [`profile`](Self::profile) as `options` say: with an offload step
    /// ([`profile_with_offload`](Self::profile_with_offload)), and with each
    /// parameter's gradient kept as backward accumulates it (as a plain step does) or
    /// freed as soon as it is complete (as a step does whose gradients go to files or
    /// straight into the optimizer: profiled with them kept, the backward segments
    /// carry every gradient made so far, and no lever seems to lower a peak they set).
    ///
    /// # Errors
    /// As [`profile_with_offload`](Self::profile_with_offload); with
    /// `free_gradients`, [`CheckpointError::Torch`] when a parameter has a
    /// post-accumulate-grad hook already (libtorch keeps one per tensor).
    pub fn profile_with<F, E>(
        &self,
        params: &[Tensor],
        options: &ProfileOptions,
        mut step: F,
    ) -> Result<BlocksProfile>
    where
        F: FnMut() -> std::result::Result<Tensor, E>,
        E: std::fmt::Display,
    {
        for (what, lever) in [
            ("offload", &options.offload),
            ("compress", &options.compress),
        ] {
            if let Some(lever) = lever {
                if !matches!(lever, BlockLever::Store { .. }) {
                    return Err(CheckpointError::Blocks(format!(
                        "a profile's {what} step takes a store lever, not {}",
                        lever.name()
                    )));
                }
            }
        }
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let free = options.free_gradients;
        let outcome = {
            let _levers = LeversBack::save(self);
            memsave_sys::checkpoint::with_running_stats_preserved(|| {
                let kept = self.profile_run(params, device, BlockLever::Keep, free, &mut step)?;
                let recomputed =
                    self.profile_run(params, device, BlockLever::Recompute, free, &mut step)?;
                Ok::<_, CheckpointError>((kept, recomputed))
            })
            .map_err(|e| CheckpointError::Torch(e.to_string()))
        };
        let (kept, recomputed) = outcome??;
        let recomputed_retained: Vec<i64> = recomputed.top.iter().map(|(_, r, _)| *r).collect();
        let recomputed_own = recomputed.own_backward_peaks(|e| match e {
            Event::Recompute(i) => Some(i),
            _ => None,
        });
        let mut profile = build(kept, recomputed)?;
        // Seconds a store adds to each block: its forward's extra time, twice (the
        // write or encode, and as much again to read back in backward).
        let added = |run: &Run, profile: &BlocksProfile| -> Vec<f64> {
            run.top
                .iter()
                .zip(&profile.forward_s)
                .map(|((_, _, s), kept)| 2.0 * (s - kept).max(0.0))
                .collect()
        };
        let unpacked = |run: &Run| {
            run.own_backward_peaks(|e| match e {
                Event::Unpack(i) => Some(i),
                _ => None,
            })
        };
        let mut known = true;
        let mut offload_own = None;
        if let Some(offload) = &options.offload {
            let run = self.profile_store_run(params, device, offload, free, &mut step, &profile)?;
            profile.offload_s = Some(added(&run, &profile));
            offload_own = Some(unpacked(&run));
            known &= crossing::add_holds(&mut profile.crossings, PlannedLever::Offload, &run.flow);
        }
        let mut compress_own = None;
        if let Some(compress) = &options.compress {
            let run =
                self.profile_store_run(params, device, compress, free, &mut step, &profile)?;
            compress_own = Some(unpacked(&run));
            known &= crossing::add_holds(&mut profile.crossings, PlannedLever::Compress, &run.flow);
            profile.compressed = Some(CompressedFigures {
                saved: run
                    .top
                    .iter()
                    .zip(&recomputed_retained)
                    .map(|((_, c, _), r)| (c - r).max(0))
                    .collect(),
                forward: run.forward_peaks(),
                seconds: added(&run, &profile),
                backward: Vec::new(),
            });
        }
        if !known {
            profile.crossings.clear();
        }
        if let Some(stored) = offload_own {
            let own = profile.own_backward(PlannedLever::Offload, &stored, &recomputed_own);
            profile.offload_backward = Some(own);
        }
        if let Some(stored) = compress_own {
            let own = profile.own_backward(PlannedLever::Compress, &stored, &recomputed_own);
            if let Some(c) = profile.compressed.as_mut() {
                c.backward = own;
            }
        }
        Ok(profile)
    }

    /// One more profiled step with every block's saves in `store`, which must run the
    /// blocks `profile` ran.
    fn profile_store_run<F, E>(
        &self,
        params: &[Tensor],
        device: Device,
        store: &BlockLever,
        free_gradients: bool,
        step: &mut F,
        profile: &BlocksProfile,
    ) -> Result<Run>
    where
        F: FnMut() -> std::result::Result<Tensor, E>,
        E: std::fmt::Display,
    {
        let outcome = {
            let _levers = LeversBack::save(self);
            memsave_sys::checkpoint::with_running_stats_preserved(|| {
                self.profile_run(params, device, store.clone(), free_gradients, step)
            })
            .map_err(|e| CheckpointError::Torch(e.to_string()))
        };
        let run = outcome??;
        let keys = run.top.iter().map(|(k, _, _)| k);
        if run.top.len() != profile.keys.len() || keys.zip(&profile.keys).any(|(a, b)| a != b) {
            return Err(CheckpointError::BlocksChanged(format!(
                "the step with every block's saves in '{}' ran other blocks than the kept one",
                store.name()
            )));
        }
        Ok(run)
    }

    fn profile_run<F, E>(
        &self,
        params: &[Tensor],
        device: Device,
        lever: BlockLever,
        free_gradients: bool,
        step: &mut F,
    ) -> Result<Run>
    where
        F: FnMut() -> std::result::Result<Tensor, E>,
        E: std::fmt::Display,
    {
        let clear = || {
            for p in params {
                memsave_sys::tensor::set_grad_none(p)
                    .map_err(|e| CheckpointError::Torch(e.to_string()))?;
            }
            Ok::<_, CheckpointError>(())
        };
        {
            let mut state = self.lock();
            state.every = lever;
            state.levers.clear();
            state.planned = None;
        }
        clear()?;
        // Removed (dropped) when the run ends, however it ends.
        let _freeing = if free_gradients {
            params
                .iter()
                .filter(|p| p.requires_grad())
                .map(|p| {
                    memsave_sys::grad_hooks::register_post_accumulate_grad_hook(
                        p,
                        Box::new(|t: &Tensor| Ok(memsave_sys::tensor::set_grad_none(t)?)),
                    )
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| {
                    CheckpointError::Torch(format!("freeing each gradient during the profile: {e}"))
                })?
        } else {
            Vec::new()
        };
        self.lock().profiler = Some(Profiler::begin(device)?);
        let outcome = (|| {
            let loss =
                step().map_err(|e| CheckpointError::Torch(format!("the profiled step: {e}")))?;
            if let Some(p) = self.lock().profiler.as_mut() {
                p.event(Event::ForwardEnd);
            }
            loss.f_backward().map_err(|e| {
                CheckpointError::Torch(format!("the profiled step's backward: {e}"))
            })?;
            Ok::<_, CheckpointError>(())
        })();
        let profiler = self.lock().profiler.take();
        clear()?;
        outcome?;
        let mut profiler =
            profiler.ok_or_else(|| CheckpointError::Blocks("the profile was lost".into()))?;
        profiler.event(Event::Begin);
        let records = self.last_forward();
        let top: Vec<(BlockKey, i64, f64)> = records
            .iter()
            .filter(|r| r.depth == 0)
            .map(|r| (r.key.clone(), r.retained_bytes, r.forward_s))
            .collect();
        let output = records
            .iter()
            .filter(|r| r.depth == 0)
            .map(|r| r.output_bytes as i64)
            .collect();
        Ok(Run {
            top,
            output,
            segments: profiler.segments,
            flow: profiler.flow,
        })
    }
}

/// Puts the blocks' levers back as they were, and takes out any profiler, when
/// dropped: after a profile, also one that failed or panicked.
pub(crate) struct LeversBack<'a> {
    blocks: &'a Blocks,
    every: BlockLever,
    levers: std::collections::HashMap<BlockKey, BlockLever>,
    planned: Option<Vec<BlockKey>>,
}

impl<'a> LeversBack<'a> {
    pub(crate) fn save(blocks: &'a Blocks) -> Self {
        let state = blocks.lock();
        LeversBack {
            blocks,
            every: state.every.clone(),
            levers: state.levers.clone(),
            planned: state.planned.clone(),
        }
    }
}

impl Drop for LeversBack<'_> {
    fn drop(&mut self) {
        let mut state = self.blocks.lock();
        state.every = self.every.clone();
        state.levers = std::mem::take(&mut self.levers);
        state.planned = self.planned.take();
        state.profiler = None;
    }
}

/// One profiled step: its top-level blocks (key, bytes retained, forward seconds) and
/// its segments.
struct Run {
    top: Vec<(BlockKey, i64, f64)>,
    output: Vec<i64>,
    segments: Vec<(Event, i64)>,
    /// The tensors that crossed top-level blocks, and who held them.
    flow: crossing::Flow,
}

impl Run {
    fn peak(&self) -> i64 {
        self.segments.iter().map(|(_, p)| *p).max().unwrap_or(0)
    }

    /// Peak of each top-level block's own backward segment, opened by the event `own`
    /// names it by (its recomputation, or the first read of its stored saves); `None`
    /// for a block whose segment was not seen.
    fn own_backward_peaks(&self, own: impl Fn(Event) -> Option<usize>) -> Vec<Option<i64>> {
        let mut peaks = vec![None; self.top.len()];
        for (event, peak) in &self.segments {
            if let Some(i) = own(*event).filter(|&i| i < peaks.len()) {
                peaks[i] = Some(peaks[i].map_or(*peak, |p: i64| p.max(*peak)));
            }
        }
        peaks
    }

    /// Peak of each top-level block's forward.
    fn forward_peaks(&self) -> Vec<i64> {
        let mut peaks = vec![0; self.top.len()];
        for (event, peak) in &self.segments {
            if let Event::Start(i) = event {
                peaks[*i] = peaks[*i].max(*peak);
            }
        }
        peaks
    }
}

fn build(kept: Run, recomputed: Run) -> Result<BlocksProfile> {
    let keys: Vec<BlockKey> = kept.top.iter().map(|(k, _, _)| k.clone()).collect();
    let keys_r: Vec<BlockKey> = recomputed.top.iter().map(|(k, _, _)| k.clone()).collect();
    if keys != keys_r {
        return Err(CheckpointError::BlocksChanged(
            "the two profiled steps ran different blocks: profile a step whose blocks do not depend on the data or the lever".into(),
        ));
    }
    let saved: Vec<i64> = kept
        .top
        .iter()
        .zip(&recomputed.top)
        .map(|((_, k, _), (_, r, _))| (k - r).max(0))
        .collect();
    let forward_s = kept.top.iter().map(|(_, _, s)| *s).collect();
    let mut segments = Vec::new();
    let mut finished: Vec<usize> = Vec::new();
    let mut freed: Vec<usize> = Vec::new();
    let mut backward_from = None;
    for (event, peak) in &recomputed.segments {
        match *event {
            Event::Start(_) | Event::Unpack(_) => {}
            Event::Begin => segments.push((*peak, finished.clone(), None)),
            Event::ForwardEnd => {
                backward_from.get_or_insert(segments.len());
                segments.push((*peak, finished.clone(), None));
            }
            Event::End(i) => {
                finished.push(i);
                segments.push((*peak, finished.clone(), None));
            }
            Event::Recompute(i) => {
                freed.push(i);
                let alive = finished
                    .iter()
                    .copied()
                    .filter(|j| !freed.contains(j))
                    .collect();
                segments.push((*peak, alive, Some(i)));
            }
        }
    }
    Ok(BlocksProfile {
        forward_kept: kept.forward_peaks(),
        forward_recomputed: recomputed.forward_peaks(),
        kept_peak: kept.peak(),
        recomputed_peak: recomputed.peak(),
        keys,
        saved,
        forward_s,
        crossings: crossing::crossings(&kept.flow, &recomputed.flow),
        backward_from: backward_from.unwrap_or(segments.len()),
        segments,
        output: recomputed.output,
        offload_s: None,
        offload_backward: None,
        compressed: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use PlannedLever::{Compress, Keep, Offload, Recompute};

    /// `n` blocks that each hold 100 bytes kept and 25 compressed until a backward
    /// where all of them are alive at once (one segment of nothing else), recomputing
    /// each costs a second and compressing it a tenth: what fits is what the blocks
    /// hold.
    fn flat(n: usize) -> BlocksProfile {
        BlocksProfile {
            keys: (0..n).map(|i| BlockKey::new(format!("b{i}"), 0)).collect(),
            saved: vec![100; n],
            forward_s: vec![1.0; n],
            forward_kept: vec![0; n],
            forward_recomputed: vec![0; n],
            segments: vec![(0, (0..n).collect(), None)],
            output: vec![0; n],
            kept_peak: 100 * n as i64,
            recomputed_peak: 0,
            offload_s: None,
            offload_backward: None,
            compressed: Some(CompressedFigures {
                saved: vec![25; n],
                forward: vec![0; n],
                seconds: vec![0.1; n],
                backward: vec![25; n],
            }),
            crossings: Vec::new(),
            backward_from: 0,
        }
    }

    fn count(levers: &[PlannedLever], which: PlannedLever) -> usize {
        levers.iter().filter(|l| **l == which).count()
    }

    #[test]
    fn compressed_blocks_hold_their_compressed_saves() {
        let p = flat(3);
        assert_eq!(p.predict_levers(&[Keep, Compress, Recompute]), 125);
        assert_eq!(p.predict_levers(&[Compress; 3]), 75);
        assert_eq!(p.predict_levers(&[Keep; 3]), 300);
        assert!((p.added_seconds(&[Keep, Compress, Recompute]) - 1.1).abs() < 1e-12);
    }

    #[test]
    fn the_exact_solver_compresses_where_that_is_cheaper_than_recomputing() {
        // Within 200 bytes: one kept and two compressed (150 bytes, 0.2 s) beats two
        // kept and one recomputed (200 bytes, 1 s).
        let plan = flat(3).solve_levers(200).unwrap();
        assert_eq!(
            (count(&plan, Keep), count(&plan, Compress)),
            (1, 2),
            "{plan:?}"
        );
    }

    #[test]
    fn the_greedy_solver_compresses_where_that_is_cheaper_than_recomputing() {
        // 12 blocks within 600 bytes: four kept and eight compressed (600 bytes, 0.8
        // s); kept and recomputed only, six recomputed (6 s).
        let plan = flat(12).solve_levers(600).unwrap();
        assert_eq!(
            (count(&plan, Keep), count(&plan, Compress)),
            (4, 8),
            "{plan:?}"
        );
        // Below what every block compressed holds, some are recomputed.
        let plan = flat(12).solve_levers(250).unwrap();
        assert!(flat(12).predict_levers(&plan) <= 250, "{plan:?}");
        assert!(count(&plan, Recompute) >= 2, "{plan:?}");
    }

    /// `n` blocks whose own backward peaks at 1000 bytes recomputed and at 500
    /// offloaded (backward reads the saves back one node at a time), recomputing
    /// faster (1 s) than offloading (2 s); nothing else holds anything.
    fn tall(n: usize) -> BlocksProfile {
        BlocksProfile {
            keys: (0..n).map(|i| BlockKey::new(format!("b{i}"), 0)).collect(),
            saved: vec![100; n],
            forward_s: vec![1.0; n],
            forward_kept: vec![0; n],
            forward_recomputed: vec![0; n],
            segments: (0..n).map(|i| (1000, Vec::new(), Some(i))).collect(),
            output: vec![0; n],
            kept_peak: 1000,
            recomputed_peak: 1000,
            offload_s: Some(vec![2.0; n]),
            offload_backward: Some(vec![-500; n]),
            compressed: None,
            crossings: Vec::new(),
            backward_from: 0,
        }
    }

    #[test]
    fn offload_is_chosen_where_only_its_own_backward_fits_though_it_is_slower() {
        for n in [3, 12] {
            let p = tall(n);
            assert_eq!(p.predict_levers(&vec![Recompute; n]), 1000);
            assert_eq!(p.predict_levers(&vec![Offload; n]), 500);
            assert_eq!(p.solve_levers(600).unwrap(), vec![Offload; n], "{n} blocks");
            // With room for the recomputation, the faster lever: nothing (kept).
            assert_eq!(p.solve_levers(1000).unwrap(), vec![Keep; n], "{n} blocks");
        }
    }

    #[test]
    fn a_budget_below_every_assignment_names_the_smallest() {
        // Something else holds 10 bytes in the backward whatever the levers.
        let mut p = flat(3);
        p.segments[0].0 = 10;
        match p.solve_levers(5).map(|_| ()).unwrap_err() {
            CheckpointError::InfeasibleBudget {
                smallest_feasible, ..
            } => assert_eq!(smallest_feasible, Bytes(10)),
            e => panic!("{e}"),
        }
    }
}
