//! The chain as the dynamic program sees it: stages of consecutive layers, with the
//! byte and time figures of the exact model folded per stage.
use super::model::{Model, StoreTerms};

/// Stage `i` covers elements `bounds[i]..bounds[i + 1]`; the loss is always a stage of
/// its own, the last. Storing a stage runs its layers normally one after the other;
/// checkpoints start and end only at stage bounds.
pub(super) struct Stages {
    pub(super) bounds: Vec<usize>,
    /// Input bytes at each bound (`len + 1` entries).
    pub(super) a: Vec<u64>,
    /// `G` at each bound.
    pub(super) grads: Vec<u64>,
    /// Bytes the stage keeps when its layers run normally.
    pub(super) retained: Vec<u64>,
    /// Most its normal forward reaches above the start, without the `G(t)` term.
    pub(super) forward_peak: Vec<u64>,
    /// Most its backward reaches above the start (gradients included).
    pub(super) backward_peak: Vec<u64>,
    /// Forward plus backward seconds of the stage run normally.
    pub(super) time_s: Vec<f64>,
    /// No-grad seconds of the stage.
    pub(super) nograd_time_s: Vec<f64>,
    /// No-grad peak of the stage's first layer, run with the stage's input held by the
    /// caller.
    pub(super) nograd_first: Vec<u64>,
    /// Most of `a[l] + nograd_peak(l)` over the stage's other layers (0 if none).
    pub(super) nograd_rest: Vec<u64>,
    /// Most of `a[l] + nograd_peak(l)` over all its layers.
    pub(super) nograd_full: Vec<u64>,
    /// Bytes a checkpoint holds itself.
    pub(super) overhead: u64,
    /// `stores[s][j]`: storing the input of a top-level checkpoint starting at stage `s`
    /// with lever `j`, where that is possible.
    pub(super) stores: Vec<Vec<Option<StoreTerms>>>,
}

impl Stages {
    /// Groups the layers into at most `max_stages` stages (the loss one of them), each
    /// group as even as the division allows; one stage per element when the chain fits.
    pub(super) fn new(model: &Model<'_>, max_stages: usize) -> Self {
        let elements = &model.profile.elements;
        let n = elements.len();
        let layers = n - 1;
        let groups = layers.min(max_stages.max(2) - 1);
        let mut bounds: Vec<usize> = (0..groups).map(|i| i * layers / groups).collect();
        bounds.push(layers);
        bounds.push(n);
        bounds.dedup();

        let mut stages = Self {
            a: bounds.iter().map(|&b| model.a[b]).collect(),
            grads: bounds.iter().map(|&b| model.grads_from[b]).collect(),
            retained: Vec::new(),
            forward_peak: Vec::new(),
            backward_peak: Vec::new(),
            time_s: Vec::new(),
            nograd_time_s: Vec::new(),
            nograd_first: Vec::new(),
            nograd_rest: Vec::new(),
            nograd_full: Vec::new(),
            overhead: model.profile.checkpoint_overhead_bytes,
            stores: bounds
                .iter()
                .map(|&b| {
                    (0..model.levers.len())
                        .map(|j| model.store_terms(b, j))
                        .collect()
                })
                .collect(),
            bounds: Vec::new(),
        };
        for w in bounds.windows(2) {
            let (start, end) = (w[0], w[1]);
            let (mut kept, mut fwd, mut bwd) = (0u64, 0u64, 0u64);
            let (mut time_s, mut nograd_time_s) = (0.0, 0.0);
            let mut nograd_rest = 0u64;
            for (l, p) in elements.iter().enumerate().take(end).skip(start) {
                fwd = fwd.max(kept + p.forward_peak_bytes);
                bwd = bwd.max(kept + model.backward_need(l));
                kept += p.retained_bytes;
                time_s += p.forward_time_s + p.backward_time_s;
                nograd_time_s += p.nograd_time_s;
                if l > start {
                    nograd_rest = nograd_rest.max(model.a[l] + p.nograd_peak_bytes);
                }
            }
            let first = &elements[start];
            stages.retained.push(kept);
            stages.forward_peak.push(fwd);
            stages.backward_peak.push(bwd);
            stages.time_s.push(time_s);
            stages.nograd_time_s.push(nograd_time_s);
            stages.nograd_first.push(first.nograd_peak_bytes);
            stages.nograd_rest.push(nograd_rest);
            stages
                .nograd_full
                .push(nograd_rest.max(model.a[start] + first.nograd_peak_bytes));
        }
        stages.bounds = bounds;
        stages
    }

    /// Number of stages (the loss included).
    pub(super) fn len(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Bytes a checkpoint of stages `s..k` leaves for the rest of the chain to run in:
    /// its output plus what its checkpoints hold themselves from the forward on, one per
    /// layer at most (see the model).
    pub(super) fn checkpoint_rest_bytes(&self, s: usize, k: usize) -> u64 {
        self.checkpoint_held(s, k) + self.a[k]
    }

    /// Bytes held beside the recompute of a checkpoint: its own state and the one its
    /// recompute restores afterwards.
    pub(super) fn checkpoint_inner_bytes(&self) -> u64 {
        2 * self.overhead
    }

    fn checkpoint_held(&self, s: usize, k: usize) -> u64 {
        self.overhead * (self.bounds[k] - self.bounds[s]) as u64
    }

    /// The checkpoints of `s..k` for `k` in `s + 1..t`, in order of `k`; their floors
    /// only grow with `k`. (`k == t` would checkpoint the whole range with nothing
    /// after it: the recompute follows the forward at once, which saves nothing.)
    pub(super) fn checkpoint_candidates(
        &self,
        s: usize,
        t: usize,
    ) -> impl Iterator<Item = Candidate> + '_ {
        let mut nograd_peak = self.nograd_first[s].max(self.nograd_rest[s]);
        let mut nograd_time_s = 0.0;
        (s + 1..t).map(move |k| {
            if k > s + 1 {
                nograd_peak = nograd_peak.max(self.nograd_full[k - 1]);
            }
            nograd_time_s += self.nograd_time_s[k - 1];
            Candidate {
                k,
                floor: self.checkpoint_held(s, k) + nograd_peak + self.grads[t],
                nograd_peak,
                rest_bytes: self.checkpoint_rest_bytes(s, k),
                inner_bytes: self.checkpoint_inner_bytes(),
                nograd_time_s,
            }
        })
    }
}

/// Checkpoint stages `s..k`, then run the rest: what it costs besides the fronts of
/// `k..t` (the rest) and `s..k` (the recompute).
pub(super) struct Candidate {
    pub(super) k: usize,
    /// Need of the checkpoint's forward: held bytes, its no-grad peak and `G(t)`.
    pub(super) floor: u64,
    /// The no-grad peak part of `floor`.
    pub(super) nograd_peak: u64,
    /// Bytes the rest runs beside ([`Stages::checkpoint_rest_bytes`]).
    pub(super) rest_bytes: u64,
    /// Bytes the recompute runs beside ([`Stages::checkpoint_inner_bytes`]).
    pub(super) inner_bytes: u64,
    /// No-grad seconds of the checkpoint's forward.
    pub(super) nograd_time_s: f64,
}

impl Candidate {
    /// The candidate with its input stored (`a_s`: the input's bytes): the forward holds
    /// the stored form too (or the store's own peak, before the segment runs), the rest
    /// runs with the stored form instead of the input (the parent counts the input, so
    /// its bytes are discounted there), the recompute beside the stored form and what
    /// the restore needs beyond the tensor it restores.
    pub(super) fn stored(&self, st: &StoreTerms, a_s: u64) -> StoredCandidate {
        let held = self.floor - self.nograd_peak;
        StoredCandidate {
            floor: (self.floor + st.resident).max(held + st.store_peak),
            rest_bytes: self.rest_bytes + st.resident,
            discount: a_s,
            inner_bytes: self.inner_bytes + st.resident + st.restore_extra,
            time_s: self.nograd_time_s + st.time_s,
        }
    }
}

/// A checkpoint candidate whose input a store keeps: the rest's need is
/// `rest_bytes + need - discount` (never below 0).
pub(super) struct StoredCandidate {
    pub(super) floor: u64,
    pub(super) rest_bytes: u64,
    pub(super) discount: u64,
    pub(super) inner_bytes: u64,
    pub(super) time_s: f64,
}
