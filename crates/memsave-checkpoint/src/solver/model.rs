//! The exact (byte) memory/time model of a schedule; see the parent module's docs.
use crate::levers::LeverProfile;
use crate::profile::ChainProfile;
use crate::schedule::{Block, Schedule, StoredBoundary};

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
pub(super) struct Model<'a> {
    pub(super) profile: &'a ChainProfile,
    /// Boundary stores the schedules may use, by index.
    pub(super) levers: &'a [LeverProfile],
    /// `a[e]`: bytes of element `e`'s input; `a[n]`: the loss value.
    pub(super) a: Vec<u64>,
    /// `G(e)`: parameter gradients alive once the backward reaches `e`, plus the held
    /// output for `e < n`.
    pub(super) grads_from: Vec<u64>,
}

/// What storing one boundary adds to the model, in its terms.
#[derive(Debug, Clone, Copy)]
pub(super) struct StoreTerms {
    /// Bytes the stored form keeps until the graph is freed.
    pub(super) resident: u64,
    /// Peak of the store above its start, the stored form included.
    pub(super) store_peak: u64,
    /// Peak of the restore above its start, beyond the restored tensor itself.
    pub(super) restore_extra: u64,
    /// Seconds of the store and the restore.
    pub(super) time_s: f64,
}

impl<'a> Model<'a> {
    pub(super) fn new(profile: &'a ChainProfile) -> Self {
        Self::with_levers(profile, &[])
    }

    pub(super) fn with_levers(profile: &'a ChainProfile, levers: &'a [LeverProfile]) -> Self {
        let e = &profile.elements;
        let n = e.len();
        let mut a: Vec<u64> = e.iter().map(|p| p.input_bytes).collect();
        a.push(e[n - 1].output_bytes);
        let mut grads_from = vec![0u64; n + 1];
        for i in (0..n).rev() {
            grads_from[i] = grads_from[i + 1] + e[i].param_grad_bytes;
        }
        // From the loss's backward on, the caller may still hold the output x_L, and it
        // holds the loss value it called backward on.
        let held = a[n - 1] + a[n];
        for g in &mut grads_from[..n] {
            *g += held;
        }
        Self {
            profile,
            levers,
            a,
            grads_from,
        }
    }

    /// The terms of storing layer `layer`'s input with lever `lever`, where that can
    /// lower memory: past the chain's input, before the loss, after a layer that does not
    /// keep its output itself, and measured.
    pub(super) fn store_terms(&self, layer: usize, lever: usize) -> Option<StoreTerms> {
        let layers = self.profile.layers();
        if layer == 0 || layer >= layers || self.profile.elements[layer - 1].saves_output {
            return None;
        }
        let cost = self
            .levers
            .get(lever)?
            .boundaries
            .get(layer)
            .copied()
            .flatten()?;
        Some(StoreTerms {
            resident: cost.resident_bytes,
            store_peak: cost.store_peak_bytes.max(cost.resident_bytes),
            restore_extra: cost.restore_peak_bytes.saturating_sub(self.a[layer]),
            time_s: cost.store_time_s + cost.restore_time_s,
        })
    }

    /// Bytes layer `l` still holds when its backward starts (the loss's output, the loss
    /// value, is held by the caller).
    pub(super) fn saved_in_backward(&self, l: usize) -> u64 {
        let p = &self.profile.elements[l];
        if p.saves_output || l == self.profile.layers() {
            p.retained_bytes
        } else {
            p.retained_bytes.saturating_sub(self.a[l + 1])
        }
    }

    /// Peak of layer `l`'s backward above the range's start, given the layers before it
    /// in the range hold nothing: what it saved, its output's gradient, its own peak and
    /// the gradients alive by then.
    pub(super) fn backward_need(&self, l: usize) -> u64 {
        self.saved_in_backward(l)
            + self.a[l + 1]
            + self.profile.elements[l].backward_peak_bytes
            + self.grads_from[l + 1]
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
    /// Walks the blocks from the end, so a long chain costs no stack. `stored` are the
    /// top-level boundaries kept by stores (empty inside a checkpoint).
    fn need(&self, blocks: &[Block], t: usize, stored: &[StoredBoundary]) -> u64 {
        let mut rest = self.a[t] + self.grads_from[t];
        for block in blocks.iter().rev() {
            let store = match block {
                Block::Checkpoint { start, .. } => stored
                    .iter()
                    .find(|b| b.layer == *start)
                    .and_then(|b| self.store_terms(*start, b.lever)),
                Block::Layer(_) => None,
            };
            rest = match (block, store) {
                (Block::Checkpoint { start, end, inner }, Some(st)) => {
                    // The parent counts the input `a[start]` throughout; while the rest
                    // runs, only its stored form is there instead.
                    let c = self.profile.checkpoint_overhead_bytes;
                    let held = c * (*end - *start) as u64 + self.grads_from[t];
                    (held + self.nograd_peak(*start, *end) + st.resident)
                        .max(held + st.store_peak)
                        .max(
                            (c * (*end - *start) as u64 + self.a[*end] + rest + st.resident)
                                .saturating_sub(self.a[*start]),
                        )
                        .max(2 * c + st.resident + st.restore_extra + self.need(inner, *end, &[]))
                }
                (Block::Layer(l), _) => {
                    let p = &self.profile.elements[*l];
                    (p.forward_peak_bytes + self.grads_from[t])
                        .max(p.retained_bytes + rest)
                        .max(self.backward_need(*l))
                }
                (Block::Checkpoint { start, end, inner }, None) => {
                    let c = self.profile.checkpoint_overhead_bytes;
                    // Upper bound on the checkpoints nested here, each holding `c`
                    // from the forward on; see the parent module's docs.
                    let held = c * (*end - *start) as u64;
                    (held + self.nograd_peak(*start, *end) + self.grads_from[t])
                        .max(held + self.a[*end] + rest)
                        .max(2 * c + self.need(inner, *end, &[]))
                }
            };
        }
        rest
    }

    fn time(&self, blocks: &[Block], stored: &[StoredBoundary]) -> f64 {
        let stores: f64 = stored
            .iter()
            .filter_map(|b| self.store_terms(b.layer, b.lever))
            .map(|st| st.time_s)
            .sum();
        stores
            + blocks
                .iter()
                .map(|b| match b {
                    Block::Layer(l) => {
                        let p = &self.profile.elements[*l];
                        p.forward_time_s + p.backward_time_s
                    }
                    Block::Checkpoint { start, end, inner } => {
                        self.nograd_time(*start, *end) + self.time(inner, &[])
                    }
                })
                .sum::<f64>()
    }

    /// The schedule's blocks with the loss appended as the last, normally run element.
    fn with_head(&self, schedule: &Schedule) -> Vec<Block> {
        let mut blocks = schedule.blocks().to_vec();
        blocks.push(Block::Layer(self.profile.layers()));
        blocks
    }

    pub(super) fn predict(&self, schedule: &Schedule) -> Prediction {
        let n = self.profile.elements.len();
        let blocks = self.with_head(schedule);
        let plain = self.with_head(&Schedule::plain(self.profile.layers()));
        Prediction {
            peak_bytes: self.need(&blocks, n, schedule.stored()),
            step_time_s: self.time(&blocks, schedule.stored()),
            baseline_time_s: self.time(&plain, &[]),
        }
    }
}

/// Predicts the peak and time of `schedule` for a profiled chain. Stored boundaries
/// count as kept here; use [`predict_with_levers`] for a schedule that uses stores.
pub fn predict(profile: &ChainProfile, schedule: &Schedule) -> Prediction {
    Model::new(profile).predict(schedule)
}

/// [`predict`] for a schedule whose boundaries stores may keep, with the stores'
/// measured costs (`levers[i]` is store `i` of the schedule).
pub fn predict_with_levers(
    profile: &ChainProfile,
    levers: &[LeverProfile],
    schedule: &Schedule,
) -> Prediction {
    Model::with_levers(profile, levers).predict(schedule)
}
