//! Tensors that cross top-level blocks (a U-Net's skips, an encoder's output read by
//! every decoder block): how long each stays alive in backward under an assignment
//! of levers.
//!
//! Such a tensor lives while anything holds it. In backward that is the graphs of the
//! blocks around it: the block that made it, when its saves include it (a `tanh`
//! saves its output), until its own backward; each block that takes it, when its
//! lever holds it (kept, it saves it if an op of it saves its input, as a linear
//! layer does; recomputed, it keeps its inputs for the recomputation; offloaded, the
//! store has a copy and the tensor itself is let go), until its own backward is done.
//! The profiled step with every block recomputed holds every such tensor until the
//! last block that takes it is done; an assignment may let one go sooner (its takers
//! offloaded, or kept without saving it) or later (its maker kept and saving it). The
//! planner adds, per backward segment, the bytes of the crossing tensors alive under
//! the assignment less those alive in the recomputed step.
//!
//! Which block holds which tensor under which lever is measured in each profiled step
//! (see `Profiler::record_io`), not assumed: a store that passes a tensor through
//! holds it as a kept block does.
use crate::block_plan::PlannedLever;
use crate::blocks::TopIo;

/// The levers under which one block's graph holds a crossing tensor, one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Holds(u8);

impl Holds {
    fn bit(lever: PlannedLever) -> u8 {
        match lever {
            PlannedLever::Keep => 1,
            PlannedLever::Recompute => 2,
            PlannedLever::Offload => 4,
            PlannedLever::Compress => 8,
        }
    }

    /// Whether the block holds the tensor under `lever`.
    pub(crate) fn under(self, lever: PlannedLever) -> bool {
        self.0 & Self::bit(lever) != 0
    }

    fn set(&mut self, lever: PlannedLever, held: bool) {
        if held {
            self.0 |= Self::bit(lever);
        } else {
            self.0 &= !Self::bit(lever);
        }
    }
}

/// One tensor a top-level block gives on to later ones.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Crossing {
    /// Its bytes (a figure: interpolated with the batch size, agreed on by ranks).
    pub(crate) bytes: i64,
    /// The block that made it, and the levers under which that block holds it.
    pub(crate) producer: (usize, Holds),
    /// Its place among that block's outputs (each storage once).
    pub(crate) place: usize,
    /// The blocks that take it, each with the levers under which it holds it.
    pub(crate) consumers: Vec<(usize, Holds)>,
    /// The last place in the forward (the step's start 0, block `i`'s start `2i + 1`
    /// and end `2i + 2`) at which the model's own code still held it, as seen in a
    /// profiled step where no block held it (a chain lets go of each block's input
    /// after the block; a U-Net holds its skips to the end of the forward); `None`:
    /// not seen, held through the forward.
    pub(crate) user_until: Option<usize>,
}

impl Crossing {
    /// Every holder, with the last segment (by its place in the recomputed step) in
    /// which it holds the tensor under `lever`: a taker through its own backward
    /// segment, the maker until its own backward begins (that segment's recomputation
    /// makes the output again, which the recomputed step's segment counts already).
    fn holders(&self) -> impl Iterator<Item = (usize, Holds, bool)> + '_ {
        std::iter::once((self.producer.0, self.producer.1, true))
            .chain(self.consumers.iter().map(|&(c, h)| (c, h, false)))
    }
}

/// The crossing tensors of the kept step's blocks, with the levers under which each
/// holds them per the kept and recomputed steps. Tensors no later block takes (the
/// model's outputs) are left out: what holds them (the loss) is the same under every
/// assignment.
pub(crate) fn crossings(kept: &[TopIo], recomputed: &[TopIo]) -> Vec<Crossing> {
    let mut out: Vec<((usize, usize), Crossing)> = Vec::new();
    for (c, io) in kept.iter().enumerate() {
        for &(p, o, held) in &io.inputs {
            let Some(&(bytes, made_held)) = kept.get(p).and_then(|io| io.outputs.get(o)) else {
                continue;
            };
            let mut holds = Holds::default();
            holds.set(PlannedLever::Keep, held);
            let at = match out.iter().position(|(key, _)| *key == (p, o)) {
                Some(at) => at,
                None => {
                    let mut made = Holds::default();
                    made.set(PlannedLever::Keep, made_held);
                    out.push((
                        (p, o),
                        Crossing {
                            bytes,
                            producer: (p, made),
                            place: o,
                            consumers: Vec::new(),
                            user_until: None,
                        },
                    ));
                    out.len() - 1
                }
            };
            out[at].1.consumers.push((c, holds));
        }
    }
    let mut crossings: Vec<Crossing> = out.into_iter().map(|(_, c)| c).collect();
    for c in &mut crossings {
        let until = kept[c.producer.0].alive_until.get(c.place).copied();
        observe_model(c, PlannedLever::Keep, until);
    }
    if !add_holds(&mut crossings, PlannedLever::Recompute, recomputed) {
        crossings.clear();
    }
    crossings
}

/// Sets, from a profiled step with every block under `lever`, whether each block
/// holds each crossing tensor under it; false (and nothing set) when that step's
/// blocks did not pass the same tensors (then the crossing tensors are not known).
pub(crate) fn add_holds(crossings: &mut [Crossing], lever: PlannedLever, run: &[TopIo]) -> bool {
    // Every crossing tensor found in the step before anything is set.
    let mut found = Vec::new();
    for c in crossings.iter() {
        let (p, o) = (c.producer.0, c.place);
        let taken = c
            .consumers
            .iter()
            .map(|&(k, _)| {
                let inputs = &run.get(k)?.inputs;
                inputs
                    .iter()
                    .find(|&&(q, r, _)| (q, r) == (p, o))
                    .map(|i| i.2)
            })
            .collect::<Option<Vec<bool>>>();
        let made = run.get(p).and_then(|io| io.outputs.get(o)).map(|m| m.1);
        match (made, taken) {
            (Some(made), Some(taken)) => found.push((made, taken)),
            _ => return false,
        }
    }
    for (c, (made, taken)) in crossings.iter_mut().zip(found) {
        c.producer.1.set(lever, made);
        for ((_, holds), held) in c.consumers.iter_mut().zip(taken) {
            holds.set(lever, held);
        }
        let until = run[c.producer.0].alive_until.get(c.place).copied();
        observe_model(c, lever, until);
    }
    true
}

/// Learns how long the model's own code holds `c` in the forward from a profiled
/// step with every block under `lever`, in which it was alive until `until`: only
/// where no block held it there.
fn observe_model(c: &mut Crossing, lever: PlannedLever, until: Option<usize>) {
    let held = c.holders().any(|(_, holds, _)| holds.under(lever));
    if let (false, Some(until)) = (held, until) {
        c.user_until = Some(c.user_until.map_or(until, |u| u.min(until)));
    }
}

/// Whether `c` is alive at place `at` of the forward (see [`Crossing::user_until`])
/// under the levers `lever_of` gives: once made, while the model's code holds it,
/// its maker holds it, or a block that took it and has ended its forward does.
fn alive_in_forward(c: &Crossing, at: usize, lever_of: &dyn Fn(usize) -> PlannedLever) -> bool {
    let p = c.producer.0;
    at >= 2 * p + 2
        && (c.user_until.is_none_or(|u| at <= u)
            || c.producer.1.under(lever_of(p))
            || c.consumers
                .iter()
                .any(|&(k, h)| at >= 2 * k + 2 && h.under(lever_of(k))))
}

/// At place `at` of the forward, the bytes of the crossing tensors alive under
/// `levers` less those alive with every block under `reference` (the profiled step
/// whose figure the prediction starts from).
pub(crate) fn forward_difference(
    crossings: &[Crossing],
    at: usize,
    levers: &[PlannedLever],
    reference: PlannedLever,
) -> i64 {
    let assigned = |b: usize| levers.get(b).copied().unwrap_or(PlannedLever::Keep);
    let uniform = |_: usize| reference;
    crossings
        .iter()
        .map(|c| {
            let a = alive_in_forward(c, at, &assigned) as i64;
            let r = alive_in_forward(c, at, &uniform) as i64;
            c.bytes * (a - r)
        })
        .sum()
}

/// Per segment of the recomputed step, the bytes of the crossing tensors alive under
/// `levers` less those alive in the recomputed step; 0 before `backward_from` (in the
/// forward the model's own code may hold them, as a U-Net's list of skips does).
/// `own[i]` is the segment that block `i`'s recomputation opened, if one did (a block
/// without one holds what it holds to the end).
pub(crate) fn alive_difference(
    crossings: &[Crossing],
    levers: &[PlannedLever],
    own: &[Option<usize>],
    backward_from: usize,
    segments: usize,
) -> Vec<i64> {
    let mut diff = vec![0i64; segments + 1];
    if segments == 0 {
        return Vec::new();
    }
    let last_segment = segments as i64 - 1;
    let last = |c: &Crossing, lever_of: &dyn Fn(usize) -> PlannedLever| -> i64 {
        c.holders()
            .filter(|&(b, holds, _)| holds.under(lever_of(b)))
            .map(|(b, _, made)| match own.get(b).copied().flatten() {
                Some(s) if made => s as i64 - 1,
                Some(s) => s as i64,
                None => last_segment,
            })
            .max()
            .unwrap_or(-1)
    };
    let recomputed = |_: usize| PlannedLever::Recompute;
    let assigned = |b: usize| levers.get(b).copied().unwrap_or(PlannedLever::Keep);
    for c in crossings {
        let (a, r) = (last(c, &assigned), last(c, &recomputed));
        // Alive in segments s <= a under the levers, s <= r recomputed.
        let (from, to, sign) = if a > r { (r, a, 1) } else { (a, r, -1) };
        let from = (from + 1).max(backward_from as i64);
        if from <= to {
            diff[from as usize] += sign * c.bytes;
            diff[to as usize + 1] -= sign * c.bytes;
        }
    }
    let mut running = 0;
    diff.truncate(segments);
    diff.iter_mut()
        .map(|d| {
            running += *d;
            running
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use PlannedLever::{Keep, Offload, Recompute};

    /// Block 0 makes a 10-byte tensor that block 2 takes (a skip over block 1);
    /// block 0 holds it kept (its last op saves its output), block 2 kept or
    /// recomputed, not offloaded. Segments: three of the forward's, the loss's
    /// backward (4), then the blocks' own backward segments, 2 (5), 1 (6) and 0 (7).
    fn skip() -> (Vec<Crossing>, Vec<Option<usize>>) {
        let mut made = Holds::default();
        made.set(Keep, true);
        let mut taken = Holds::default();
        taken.set(Keep, true);
        taken.set(Recompute, true);
        let c = Crossing {
            bytes: 10,
            producer: (0, made),
            place: 0,
            consumers: vec![(2, taken)],
            user_until: None,
        };
        (vec![c], vec![Some(7), Some(6), Some(5)])
    }

    #[test]
    fn a_tensor_lives_while_a_block_around_it_holds_it() {
        let (c, own) = skip();
        let at = |levers: &[PlannedLever]| alive_difference(&c, levers, &own, 4, 8);
        // Recomputed, it lives through block 2's backward (segment 5), as profiled.
        assert_eq!(at(&[Recompute; 3]), vec![0; 8]);
        // Its maker kept: until block 0's own backward begins (through segment 6).
        assert_eq!(at(&[Keep, Keep, Offload]), vec![0, 0, 0, 0, 0, 0, 10, 0]);
        // Nothing holds it: gone from the start of backward.
        assert_eq!(
            at(&[Recompute, Recompute, Offload]),
            vec![0, 0, 0, 0, -10, -10, 0, 0]
        );
    }
}
