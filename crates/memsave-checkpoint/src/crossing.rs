//! Tensors that cross top-level blocks (a U-Net's skips, an encoder's output read by
//! every decoder block, a chain's block outputs): how long each stays alive, in the
//! forward and in backward, under an assignment of levers.
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
//! planner adds, per backward segment and at each block's start and end in the
//! forward, the bytes of the crossing tensors alive under the assignment less those
//! alive in the profiled step its figure comes from.
//!
//! Which block holds which tensor under which lever is measured in each profiled step
//! ([`Flow`]), not assumed: a store that passes a tensor through holds it as a kept
//! block does. So is how long the model's own code holds each one: a U-Net keeps its
//! skips to the end of the forward, a chain lets go of a block's input after the
//! block, an op between blocks may save a skip for backward. Tensors the model's code
//! makes and blocks take (a gated skip, a mask or position table every block takes)
//! are followed the same way.
//!
//! Trap: holding is read from reference counts, so a block's function that keeps its
//! input somewhere of its own (a cache in a captured struct) counts as holding it
//! under every lever, and the prediction errs high by that tensor.
use crate::block_plan::PlannedLever;
use crate::blocks::Event;
use memsave_sys::tensor::WeakStorage;
use tch::Tensor;

/// Where a top-level block's input came from: output `o` of top-level block `p`, or
/// the model's own code (a tensor made between blocks, or before them: a gated skip,
/// a mask or a position table every block takes, the batch itself), by the order in
/// which blocks first took such tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// Output `o` (each storage once) of top-level block `p`.
    Block(usize, usize),
    /// The `e`-th tensor of the model's own that a block took.
    Model(usize),
}

/// A point of backward at which a tensor given to blocks was seen alive: the loss's
/// backward, or the start of block `i`'s own (its recomputation, or the first read of
/// its saves).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum BackwardMark {
    /// The loss's backward, before any block's.
    Loss,
    /// Block `i`'s own backward.
    Own(usize),
    /// The end of the step, after backward: held by its caller (the batch) or kept.
    End,
}

/// One tensor given to blocks, as a profiled step saw it.
#[derive(Debug)]
pub(crate) struct Given {
    /// Its storage, to know it again (and whether it is alive).
    storage: WeakStorage,
    /// Bytes of its storage, as far as the tensors seen reach into it.
    pub(crate) bytes: i64,
    /// The place (see [`Flow`]) of the last event of the forward at which it was
    /// alive.
    pub(crate) alive_until: usize,
    /// The points of backward at which it was alive.
    pub(crate) alive_backward: Vec<BackwardMark>,
}

/// What one top-level block took from the blocks before it (or from the model's
/// code) and gave on, and which of those tensors its graph holds after its forward
/// (for backward: a kept block's saves, a recomputed one's inputs, a store's
/// pass-through), as counted by the references to each tensor and its storage before
/// and after its forward.
#[derive(Debug, Default)]
pub(crate) struct TopIo {
    /// Per tensor taken (each storage once): where from, and whether it holds it.
    pub(crate) inputs: Vec<(Source, bool)>,
    /// Per output (each storage once), and whether it holds it.
    pub(crate) outputs: Vec<(Given, bool)>,
}

/// The tensors that cross top-level blocks in one profiled step. Places in the
/// forward: the step's start 0, block `i`'s start `2i + 1` and end `2i + 2`.
#[derive(Debug, Default)]
pub(crate) struct Flow {
    /// Per top-level block, in forward order.
    pub(crate) io: Vec<TopIo>,
    /// The model's own tensors the blocks took, by [`Source::Model`] index.
    pub(crate) model: Vec<Given>,
    position: usize,
    after_forward: bool,
}

/// A top-level block's inputs, seen before its forward (see [`Flow::watch`]): per
/// source, the inputs on its storage.
pub(crate) struct Watch {
    taken: Vec<(Source, Vec<Taken>)>,
}

/// One input: its place among the block's inputs, and the references to it and to
/// its storage before the block's forward.
type Taken = (usize, (u64, u64));

impl Flow {
    /// Before top-level block `i`'s forward: where each of its inputs came from, with
    /// the references to each (a block may take a tensor and a view of it).
    pub(crate) fn watch(&mut self, i: usize, inputs: &[&Tensor]) -> Option<Watch> {
        if i != self.io.len() {
            return None;
        }
        let mut taken: Vec<(Source, Vec<Taken>)> = Vec::new();
        for (k, x) in inputs.iter().enumerate().filter(|(_, x)| x.defined()) {
            // A parameter (or a view of one) lives through the step whatever the
            // levers: not followed.
            let parameter = x.requires_grad() && x.is_leaf()
                || memsave_sys::tensor::is_view_of_grad_leaf(x).unwrap_or(false);
            if parameter {
                continue;
            }
            let is = |g: &Given| g.storage.is_storage_of(x).unwrap_or(false);
            // The latest block that gave this storage out (a later one may give on a
            // view of an earlier one's output); else the model's, known or new.
            let from = self.io.iter().enumerate().rev().find_map(|(p, io)| {
                io.outputs
                    .iter()
                    .position(|(g, _)| is(g))
                    .map(|o| Source::Block(p, o))
            });
            let from = match from.or_else(|| self.model.iter().position(is).map(Source::Model)) {
                Some(from) => from,
                None => {
                    let Some(given) = given(x, self.position, 0) else {
                        continue;
                    };
                    self.model.push(given);
                    Source::Model(self.model.len() - 1)
                }
            };
            let Some(refs) = references(x) else {
                continue;
            };
            if let Source::Model(e) = from {
                // Its own elements, not its storage's: a batch sliced from a dataset
                // in memory is not the dataset.
                let bytes = memsave_sys::tensor::nbytes(x) as i64;
                let g = &mut self.model[e];
                g.bytes = g.bytes.max(bytes);
            }
            match taken.iter_mut().find(|(f, _)| *f == from) {
                Some((_, on)) => on.push((k, refs)),
                None => taken.push((from, vec![(k, refs)])),
            }
        }
        Some(Watch { taken })
    }

    /// After the forward of the block [`watch`](Self::watch) saw: which of its inputs
    /// and outputs its graph holds.
    pub(crate) fn record(&mut self, watch: Watch, inputs: &[&Tensor], outputs: &[Tensor]) {
        let inputs_held = watch
            .taken
            .iter()
            .map(|(from, on)| {
                // An output that is the input or a view of it is given on, not held;
                // counted as held (the prediction errs high).
                let held = on.iter().any(|&(k, (handles, storage))| {
                    let x = inputs[k];
                    let given_on = outputs.iter().any(|y| shares_storage(x, y));
                    given_on || references(x).is_none_or(|(h, s)| h > handles || s > storage)
                });
                (*from, held)
            })
            .collect();
        let mut io = TopIo {
            inputs: inputs_held,
            outputs: Vec::new(),
        };
        for y in outputs.iter().filter(|y| y.defined()) {
            if io
                .outputs
                .iter()
                .any(|(g, _)| g.storage.is_storage_of(y).unwrap_or(false))
            {
                continue;
            }
            let (held, bytes) = output_held(y, outputs);
            let Some(given) = given(y, self.position, bytes) else {
                continue;
            };
            io.outputs.push((given, held));
        }
        self.io.push(io);
    }

    /// Notes which tensors given to blocks are still alive at `event`: in the forward
    /// at each top-level block's start and end (its place set from the event,
    /// whatever else runs in between), in backward at the loss's and each block's own
    /// backward.
    pub(crate) fn event(&mut self, event: Event) {
        let at = match event {
            Event::Start(i) if !self.after_forward => Some(2 * i + 1),
            Event::End(i) if !self.after_forward => Some(2 * i + 2),
            _ => None,
        };
        let mark = match event {
            Event::ForwardEnd => Some(BackwardMark::Loss),
            Event::Recompute(i) | Event::Unpack(i) if self.after_forward => {
                Some(BackwardMark::Own(i))
            }
            // The profiler's last event, once backward is done.
            Event::Begin if self.after_forward => Some(BackwardMark::End),
            _ => None,
        };
        self.after_forward |= event == Event::ForwardEnd;
        if at.is_none() && mark.is_none() {
            return;
        }
        if let Some(at) = at {
            self.position = at;
        }
        let all = self
            .io
            .iter_mut()
            .flat_map(|io| io.outputs.iter_mut().map(|(g, _)| g))
            .chain(self.model.iter_mut());
        for g in all {
            if g.storage.is_alive().unwrap_or(true) {
                if let Some(at) = at {
                    g.alive_until = at;
                }
                if let Some(mark) = mark {
                    g.alive_backward.push(mark);
                }
            }
        }
    }

    /// The tensor `source` names, if this step saw it.
    fn given(&self, source: Source) -> Option<&Given> {
        match source {
            Source::Block(p, o) => self.io.get(p)?.outputs.get(o).map(|(g, _)| g),
            Source::Model(e) => self.model.get(e),
        }
    }
}

/// `t` as a tensor given to blocks, of `bytes`, first seen at place `at`; `None`
/// without storage.
fn given(t: &Tensor, at: usize, bytes: i64) -> Option<Given> {
    Some(Given {
        storage: WeakStorage::new(t).ok()?,
        bytes,
        alive_until: at,
        alive_backward: Vec::new(),
    })
}

/// The references to a tensor and to its storage.
fn references(t: &Tensor) -> Option<(u64, u64)> {
    let handles = memsave_sys::tensor::use_count(t).ok()?;
    let storage = memsave_sys::tensor::storage_use_count(t).ok()?;
    Some((handles, storage))
}

/// Whether `a` and `b` are defined and use one storage.
fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
    a.defined()
        && b.defined()
        && WeakStorage::new(a)
            .and_then(|w| w.is_storage_of(b))
            .unwrap_or(false)
}

/// Whether `a` and `b` are the same tensor as far as their data goes: one storage,
/// same place, shape and strides.
fn same_view(a: &Tensor, b: &Tensor) -> bool {
    shares_storage(a, b)
        && a.data_ptr() == b.data_ptr()
        && a.size() == b.size()
        && a.stride() == b.stride()
}

/// Bytes from the start of `t`'s storage to the end of its last element: a storage's
/// bytes, seen through one of its views.
fn extent_bytes(t: &Tensor) -> i64 {
    let last: i64 = t
        .size()
        .iter()
        .zip(t.stride())
        .map(|(&n, s)| (n - 1).max(0) * s.abs())
        .sum();
    let elements = if t.numel() == 0 {
        0
    } else {
        t.storage_offset() + last + 1
    };
    elements * t.kind().elt_size_in_bytes() as i64
}

/// Whether the graph of the block that returned `outputs` holds `y` (one of them,
/// the first on its storage) after its forward, and the bytes of `y`'s storage as
/// the outputs see it. The references the outputs themselves make are expected: a
/// handle per output that is `y`, a storage reference per distinct view of it, and
/// one for the base those views keep alive through their view metadata (held by
/// nothing else when its references are the views'). Any more: the graph holds it.
fn output_held(y: &Tensor, outputs: &[Tensor]) -> (bool, i64) {
    let same = outputs.iter().filter(|z| same_view(y, z)).count() as u64;
    let mut views: Vec<&Tensor> = Vec::new();
    for z in outputs.iter().filter(|z| shares_storage(y, z)) {
        if !views.iter().any(|v| same_view(v, z)) {
            views.push(z);
        }
    }
    let is_view = |t: &Tensor| memsave_sys::tensor::is_view(t).unwrap_or(false);
    let viewing: Vec<&&Tensor> = views.iter().filter(|v| is_view(v)).collect();
    // The base: kept alive by the views alone unless something else holds it too
    // (counted only where it is not itself an output).
    let base_among_outputs = views.iter().any(|v| !is_view(v));
    let base = u64::from(!viewing.is_empty() && !base_among_outputs);
    let base_held = !base_among_outputs
        && viewing.iter().any(|v| {
            memsave_sys::tensor::base_use_count(v)
                .ok()
                .flatten()
                .is_none_or(|n| n > viewing.len() as u64)
        });
    let held =
        base_held || references(y).is_none_or(|(h, s)| h > same || s > views.len() as u64 + base);
    let bytes = views.iter().map(|v| extent_bytes(v)).max().unwrap_or(0);
    (held, bytes)
}

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

/// One tensor that top-level blocks take from an earlier block or from the model's
/// own code.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Crossing {
    /// Its bytes (a figure: interpolated with the batch size, agreed on by ranks).
    pub(crate) bytes: i64,
    /// Where it came from.
    pub(crate) source: Source,
    /// For a block's output, the levers under which the block that made it holds it.
    pub(crate) made: Holds,
    /// The blocks that take it, each with the levers under which it holds it.
    pub(crate) consumers: Vec<(usize, Holds)>,
    /// The last place in the forward (the step's start 0, block `i`'s start `2i + 1`
    /// and end `2i + 2`) at which the model's own code still held it, as seen in a
    /// profiled step where no block held it (a chain lets go of each block's input
    /// after the block; a U-Net holds its skips to the end of the forward); `None`:
    /// not seen, held through the forward.
    pub(crate) user_until: Option<usize>,
    /// The points of backward at which something other than the blocks around it
    /// still held it (an auxiliary loss on an encoder's output, an op between blocks
    /// that saved it, the caller holding the batch), as seen in a profiled step where
    /// no block held it; it is taken as alive up to the latest of them.
    pub(crate) model_backward: Vec<BackwardMark>,
    /// Whether `model_backward` was seen in a step that marks each block's backward
    /// (recomputed or stored blocks), rather than in the kept step, which marks only
    /// the loss's backward and the end.
    pub(crate) seen_per_block: bool,
}

impl Crossing {
    /// A tensor first seen in the kept step, of `bytes`, its maker holding it there
    /// or not (`made_kept`); who else holds it is added as the steps are read.
    fn first_seen(source: Source, bytes: i64, made_kept: bool) -> Crossing {
        let mut made = Holds::default();
        made.set(PlannedLever::Keep, made_kept);
        Crossing {
            bytes,
            source,
            made,
            consumers: Vec::new(),
            user_until: None,
            model_backward: Vec::new(),
            seen_per_block: false,
        }
    }

    /// What two profiles (of two batch sizes, or of two ranks) must agree on for
    /// this tensor: everything but its bytes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn structure(
        &self,
    ) -> (
        Source,
        Holds,
        &[(usize, Holds)],
        Option<usize>,
        &[BackwardMark],
    ) {
        (
            self.source,
            self.made,
            &self.consumers,
            self.user_until,
            &self.model_backward,
        )
    }

    /// Every block that may hold it, with the levers under which it does and whether
    /// it made it.
    fn holders(&self) -> impl Iterator<Item = (usize, Holds, bool)> + '_ {
        let made = match self.source {
            Source::Block(p, _) => Some((p, self.made, true)),
            Source::Model(_) => None,
        };
        made.into_iter()
            .chain(self.consumers.iter().map(|&(c, h)| (c, h, false)))
    }

    /// The first place of the forward at which it exists: after the block that made
    /// it, or (made by the model's code, at a place not seen) after the block before
    /// the first that takes it.
    fn made_at(&self) -> usize {
        match self.source {
            Source::Block(p, _) => 2 * p + 2,
            Source::Model(_) => 2 * self.consumers.iter().map(|c| c.0).min().unwrap_or(0),
        }
    }
}

/// The tensors the kept step's blocks took from one another or from the model's
/// code, and the outputs no later block takes that their block holds when kept,
/// with the levers under which each block holds them per the kept and recomputed
/// steps. Other outputs no later block takes are left out: what holds them (the
/// loss) is the same under every assignment.
pub(crate) fn crossings(kept: &Flow, recomputed: &Flow) -> Vec<Crossing> {
    let mut out: Vec<Crossing> = Vec::new();
    for (c, io) in kept.io.iter().enumerate() {
        for &(source, held) in &io.inputs {
            let Some(given) = kept.given(source) else {
                continue;
            };
            let mut holds = Holds::default();
            holds.set(PlannedLever::Keep, held);
            let at = match out.iter().position(|x| x.source == source) {
                Some(at) => at,
                None => {
                    let made_kept = match source {
                        Source::Block(p, o) => kept.io[p].outputs[o].1,
                        Source::Model(_) => false,
                    };
                    out.push(Crossing::first_seen(source, given.bytes, made_kept));
                    out.len() - 1
                }
            };
            out[at].consumers.push((c, holds));
        }
    }
    // A block's output that no later block takes but that the block itself holds
    // when kept (a skip its `tanh` saves, gated by the model's code between blocks):
    // kept, it lives until the block's own backward; recomputed, only as long as the
    // model's code holds it.
    for (p, io) in kept.io.iter().enumerate() {
        for (o, (given, held)) in io.outputs.iter().enumerate() {
            let source = Source::Block(p, o);
            if *held && !out.iter().any(|x| x.source == source) {
                out.push(Crossing::first_seen(source, given.bytes, true));
            }
        }
    }
    for c in &mut out {
        observe_model(c, PlannedLever::Keep, kept);
    }
    if !add_holds(&mut out, PlannedLever::Recompute, recomputed) {
        out.clear();
    }
    out
}

/// Sets, from a profiled step with every block under `lever`, whether each block
/// holds each crossing tensor under it; false (and nothing set) when that step's
/// blocks did not pass the same tensors (then the crossing tensors are not known).
pub(crate) fn add_holds(crossings: &mut [Crossing], lever: PlannedLever, run: &Flow) -> bool {
    // Every crossing tensor found in the step before anything is set.
    let mut found = Vec::new();
    for c in crossings.iter() {
        let taken = c
            .consumers
            .iter()
            .map(|&(k, _)| {
                let inputs = &run.io.get(k)?.inputs;
                inputs.iter().find(|(s, _)| *s == c.source).map(|i| i.1)
            })
            .collect::<Option<Vec<bool>>>();
        let made = match c.source {
            Source::Block(p, o) => run.io.get(p).and_then(|io| io.outputs.get(o)).map(|m| m.1),
            // The same tensor of the model's: taken first by the same block, as large.
            Source::Model(e) => run
                .model
                .get(e)
                .filter(|g| g.bytes == c.bytes)
                .map(|_| false),
        };
        match (made, taken) {
            (Some(made), Some(taken)) => found.push((made, taken)),
            _ => return false,
        }
    }
    for (c, (made, taken)) in crossings.iter_mut().zip(found) {
        c.made.set(lever, made);
        for ((_, holds), held) in c.consumers.iter_mut().zip(taken) {
            holds.set(lever, held);
        }
        observe_model(c, lever, run);
    }
    true
}

/// Learns how long the model's own code holds `c`, in the forward and in backward,
/// from a profiled step with every block under `lever`: only where no block held it
/// there.
fn observe_model(c: &mut Crossing, lever: PlannedLever, run: &Flow) {
    if c.holders().any(|(_, holds, _)| holds.under(lever)) {
        return;
    }
    let Some(given) = run.given(c.source) else {
        return;
    };
    let until = given.alive_until;
    c.user_until = Some(c.user_until.map_or(until, |u| u.max(until)));
    if lever == PlannedLever::Keep {
        // Kept blocks mark no backward of their own: alive at the loss's backward
        // and gone by the end, it may have lived to any point between; taken as the
        // end (the prediction errs high), unless a step with marks saw it.
        if !c.seen_per_block {
            let mut marks = given.alive_backward.clone();
            if marks.contains(&BackwardMark::Loss) {
                marks.push(BackwardMark::End);
            }
            c.model_backward = marks;
        }
    } else if !c.seen_per_block {
        c.model_backward = given.alive_backward.clone();
        c.seen_per_block = true;
    }
}

/// Whether `c` is alive at place `at` of the forward (see [`Crossing::user_until`])
/// under the levers `lever_of` gives: once made, while the model's code holds it,
/// its maker holds it, or a block that took it and has ended its forward does.
fn alive_in_forward(c: &Crossing, at: usize, lever_of: &dyn Fn(usize) -> PlannedLever) -> bool {
    at >= c.made_at()
        && (c.user_until.is_none_or(|u| at <= u)
            || c.holders()
                .any(|(b, holds, made)| (made || at >= 2 * b + 2) && holds.under(lever_of(b))))
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
        // What the model holds it through, whatever the levers.
        let model = c
            .model_backward
            .iter()
            .map(|mark| match *mark {
                BackwardMark::Loss => backward_from as i64,
                BackwardMark::Own(i) => own
                    .get(i)
                    .copied()
                    .flatten()
                    .map_or(last_segment, |s| s as i64),
                BackwardMark::End => last_segment,
            })
            .max()
            .unwrap_or(-1);
        c.holders()
            .filter(|&(b, holds, _)| holds.under(lever_of(b)))
            .map(|(b, _, made)| match own.get(b).copied().flatten() {
                Some(s) if made => s as i64 - 1,
                Some(s) => s as i64,
                None => last_segment,
            })
            .max()
            .unwrap_or(-1)
            .max(model)
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
        let mut taken = Holds::default();
        taken.set(Keep, true);
        taken.set(Recompute, true);
        let c = Crossing {
            consumers: vec![(2, taken)],
            ..Crossing::first_seen(Source::Block(0, 0), 10, true)
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

    #[test]
    fn what_the_model_holds_in_backward_holds_it_under_every_assignment() {
        let (mut c, own) = skip();
        // An op of the model's own, between blocks, saved it: alive until block 2's
        // backward began (segment 5), whoever else lets it go.
        c[0].model_backward = vec![BackwardMark::Loss, BackwardMark::Own(2)];
        let at = |levers: &[PlannedLever]| alive_difference(&c, levers, &own, 4, 8);
        assert_eq!(at(&[Recompute, Recompute, Offload]), vec![0; 8]);
        assert_eq!(at(&[Keep, Keep, Offload]), vec![0, 0, 0, 0, 0, 0, 10, 0]);
        // Held past the end of backward (the caller's batch): alive throughout under
        // every assignment, as in the recomputed step.
        c[0].model_backward = vec![BackwardMark::End];
        let at = |levers: &[PlannedLever]| alive_difference(&c, levers, &own, 4, 8);
        assert_eq!(at(&[Recompute, Recompute, Offload]), vec![0; 8]);
        assert_eq!(at(&[Keep, Keep, Offload]), vec![0; 8]);
    }
}
