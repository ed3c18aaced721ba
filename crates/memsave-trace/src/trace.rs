//! `Trace`: every allocation and free of a recorded step, each storage with its role.
use crate::category::{Category, CategoryBytes, Phase};
use crate::note::{Note, NoteKind};
use memsave_sys::alloc::AllocEvent;
use std::collections::BTreeMap;
use tch::Device;

/// One storage seen by the recording: live when it started, or allocated during it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The storage's address.
    pub addr: u64,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its role, the same for its whole life.
    pub category: Category,
    /// For a saved activation: the autograd node that saved it (`AddmmBackward0`, as
    /// PyTorch names it: the tensor is that node's `_saved_mat1`), known once backward
    /// has unpacked it; `None` for a graph that never ran backward.
    pub saved_for: Option<String>,
    /// For a saved activation: the aten op that was running when it was saved
    /// (`aten::addmm`, whose autograd node is `AddmmBackward0`).
    pub saved_by: Option<String>,
    /// For a saved activation: the `grad_fn` of the tensor itself, the node that will
    /// receive its gradient (`ViewBackward0` for a Linear's flattened input; `leaf` or
    /// `constant` for tensors without one). Not the node that saved it.
    pub producer: Option<String>,
    /// The mark open when it was allocated (for a saved activation: when it was saved).
    pub mark: Option<String>,
    /// The checkpoint recomputation (its label, the block recomputed) running when it
    /// was allocated, the innermost of nested ones; `None` outside recomputations.
    pub recomputation: Option<String>,
    /// The phase it was allocated in.
    pub phase: Phase,
    /// The event that allocated it; `None` when it was live before the recording.
    pub alloc_event: Option<usize>,
    /// The event that freed it; `None` when it outlived the recording.
    pub free_event: Option<usize>,
}

impl Block {
    /// What keeps this storage, for a saved activation: the autograd node that saved it
    /// (`AddmmBackward0`), or, when backward never unpacked it, the aten op that was
    /// running when it was saved (`aten::addmm`).
    pub fn op(&self) -> Option<&str> {
        self.saved_for.as_deref().or(self.saved_by.as_deref())
    }

    /// The storage's role in words, as reports show it: `saved_activation of
    /// AddmmBackward0` (PyTorch's name for the node whose saved tensor it is), else the
    /// category's name (`gradient`).
    pub fn role(&self) -> String {
        match self.op() {
            Some(op) if self.category == Category::SavedActivation => {
                format!("{} of {op}", self.category)
            }
            _ => self.category.to_string(),
        }
    }
}

/// One allocation or free, in the order the meter saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Index of the storage in [`Trace::blocks`].
    pub block: usize,
    /// Bytes allocated (positive) or freed (negative).
    pub bytes: i64,
    /// `memory_allocated` right after the event, as the meter counted it.
    pub allocated_after: u64,
    /// Nanoseconds since the recording started (0 for storages live before it).
    pub time_ns: u64,
    /// The phase the step was in.
    pub phase: Phase,
    /// Index into [`Trace::marks`] of the mark open at the event, if any.
    pub mark: Option<usize>,
}

/// A mark the step set: its label and the number of events before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceMark {
    /// The label given to [`Session::mark`](crate::Session::mark).
    pub label: String,
    /// Events before the mark: the state at the mark is the state after event
    /// `position - 1`.
    pub position: usize,
}

/// One checkpoint recomputation in backward, as the step told the recorder
/// ([`Session::recomputation_start`](crate::Session::recomputation_start) and
/// [`Session::recomputation_end`](crate::Session::recomputation_end)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recomputation {
    /// The label given at its start (the block recomputed: `layer 3`).
    pub label: String,
    /// Events before its start.
    pub start: usize,
    /// Events before its end; `None` when it had not ended when the recording did.
    pub end: Option<usize>,
    /// Nanoseconds from its start to its end (0 when it did not end).
    pub duration_ns: u64,
    /// Bytes allocated while it ran (not counting recomputations nested in it).
    pub allocated_bytes: u64,
    /// Of those, the bytes still live at its end: what it re-saved for the block's
    /// backward (its temporaries were freed inside it), plus what the recomputed
    /// function returned when its end was told before the checkpoint dropped that
    /// (memsave-bench tells it as the block returns).
    pub kept_bytes: u64,
}

/// What the recomputations of one block cost, over the recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRecomputation {
    /// The label (the block).
    pub label: String,
    /// How many times it was recomputed.
    pub runs: usize,
    /// Bytes allocated by its recomputations ([`Recomputation::allocated_bytes`]).
    pub allocated_bytes: u64,
    /// Bytes they re-saved ([`Recomputation::kept_bytes`]).
    pub kept_bytes: u64,
    /// Their time, in nanoseconds.
    pub duration_ns: u64,
}

/// Every allocation and free of a recorded step, each storage with its role.
///
/// The first [`initial_events`](Self::initial_events) events are the storages live
/// when the recording started; replaying the events gives `memory_allocated` at every
/// event ([`Event::allocated_after`]), and [`timeline`](Self::timeline) splits it by
/// category, so that the categories add up to it exactly.
#[derive(Debug, Clone)]
pub struct Trace {
    /// The recorded device.
    pub device: Device,
    /// Every storage, in order of first appearance.
    pub blocks: Vec<Block>,
    /// Every event, in order.
    pub events: Vec<Event>,
    /// How many of the first events stand for storages live at the start.
    pub initial_events: usize,
    /// The marks the step set, in order.
    pub marks: Vec<TraceMark>,
    /// Notes about storages the recorder could not find live (a tensor with no
    /// counted storage, such as one created before the meter was installed).
    pub unplaced_notes: usize,
    /// The checkpoint recomputations the step told, in order of their start.
    pub recomputations: Vec<Recomputation>,
}

/// The recomputations running while the notes are replayed: index into
/// `Trace::recomputations` and start time, innermost last.
type Open = Vec<(usize, std::time::Instant)>;

/// Which role wins when a storage gets two: registered roles first, then what
/// backward and autograd tell.
fn rank(category: Category) -> u8 {
    match category {
        Category::Parameter => 0,
        Category::Input => 1,
        Category::OptimizerState => 2,
        Category::Gradient => 3,
        Category::SavedActivation => 4,
        Category::Recompute | Category::Temporary | Category::Other => 5,
    }
}

impl Trace {
    pub(crate) fn build(device: Device, raw: Vec<AllocEvent>, mut notes: Vec<Note>) -> Trace {
        notes.sort_by_key(|n| n.position); // stable: notes at one position keep their order
        let initial_events = raw.iter().take_while(|e| e.time_ns == 0).count();
        let t0 = raw.get(initial_events).map_or(0, |e| e.time_ns);
        let mut trace = Trace {
            device,
            blocks: Vec::new(),
            events: Vec::with_capacity(raw.len()),
            initial_events,
            marks: Vec::new(),
            unplaced_notes: 0,
            recomputations: Vec::new(),
        };
        let mut open: Open = Vec::new();
        // Per block: the recomputation that allocated it.
        let mut allocated_in: Vec<Option<usize>> = Vec::new();
        let mut roles: Vec<Option<Category>> = Vec::new();
        let mut live: BTreeMap<u64, usize> = BTreeMap::new();
        let mut phase = Phase::Other;
        let mut mark: Option<usize> = None;
        let mut next_note = notes.iter().peekable();
        for (i, e) in raw.iter().enumerate() {
            while let Some(note) = next_note.next_if(|n| n.position <= i) {
                trace.apply(note, &live, &mut roles, &mut phase, &mut mark, &mut open);
            }
            let block = if e.bytes >= 0 {
                let id = trace.blocks.len();
                let within = open.last().map(|&(r, _)| r);
                if let Some(r) = within {
                    trace.recomputations[r].allocated_bytes += e.bytes as u64;
                }
                allocated_in.push(within);
                trace.blocks.push(Block {
                    addr: e.addr,
                    bytes: e.bytes as u64,
                    category: Category::Other,
                    saved_for: None,
                    saved_by: None,
                    producer: None,
                    mark: mark.map(|m| trace.marks[m].label.clone()),
                    recomputation: within.map(|r| trace.recomputations[r].label.clone()),
                    phase,
                    alloc_event: (i >= initial_events).then_some(i),
                    free_event: None,
                });
                roles.push(None);
                live.insert(e.addr, id);
                id
            } else {
                match live.remove(&e.addr) {
                    Some(id) => {
                        trace.blocks[id].free_event = Some(i);
                        id
                    }
                    // Cannot happen (the stream opens with every live storage); kept
                    // as its own `other` storage rather than dropped.
                    None => {
                        trace.blocks.push(Block {
                            addr: e.addr,
                            bytes: e.bytes.unsigned_abs(),
                            category: Category::Other,
                            saved_for: None,
                            saved_by: None,
                            producer: None,
                            mark: None,
                            recomputation: None,
                            phase,
                            alloc_event: None,
                            free_event: Some(i),
                        });
                        roles.push(None);
                        allocated_in.push(None);
                        trace.blocks.len() - 1
                    }
                }
            };
            trace.events.push(Event {
                block,
                bytes: e.bytes,
                allocated_after: e.allocated_after,
                time_ns: e.time_ns.saturating_sub(t0),
                phase,
                mark,
            });
        }
        for note in next_note {
            trace.apply(note, &live, &mut roles, &mut phase, &mut mark, &mut open);
        }
        for ((block, role), within) in trace.blocks.iter_mut().zip(roles).zip(&allocated_in) {
            block.category = role.unwrap_or(if within.is_some() {
                Category::Recompute
            } else if block.alloc_event.is_some() && block.free_event.is_some() {
                Category::Temporary
            } else {
                Category::Other
            });
            // Still live at the recomputation's end: re-saved for backward.
            if let Some(r) = *within {
                let end = trace.recomputations[r].end;
                if block
                    .free_event
                    .is_none_or(|f| end.is_none_or(|end| f >= end))
                {
                    trace.recomputations[r].kept_bytes += block.bytes;
                }
            }
        }
        trace
    }

    fn apply(
        &mut self,
        note: &Note,
        live: &BTreeMap<u64, usize>,
        roles: &mut [Option<Category>],
        phase: &mut Phase,
        mark: &mut Option<usize>,
        open: &mut Open,
    ) {
        let find = |ptr: u64| {
            live.range(..=ptr)
                .next_back()
                .map(|(_, &id)| id)
                .filter(|&id| ptr < self.blocks[id].addr + self.blocks[id].bytes.max(1))
        };
        match &note.what {
            NoteKind::Phase(p) => *phase = *p,
            NoteKind::Mark(label) => {
                self.marks.push(TraceMark {
                    label: label.clone(),
                    position: note.position,
                });
                *mark = Some(self.marks.len() - 1);
            }
            NoteKind::Role { ptr, category } => match find(*ptr) {
                Some(id) => {
                    if roles[id].is_none_or(|r| rank(*category) < rank(r)) {
                        roles[id] = Some(*category);
                    }
                }
                None => self.unplaced_notes += 1,
            },
            NoteKind::Saved {
                ptr,
                op,
                producer,
                mark: saved_mark,
            } => match find(*ptr) {
                Some(id) => {
                    let block = &mut self.blocks[id];
                    if block.saved_by.is_none() {
                        block.saved_by = Some(op.clone());
                        block.producer = Some(producer.clone());
                        block.mark = saved_mark.clone().or(block.mark.take());
                    }
                    if roles[id].is_none_or(|r| rank(Category::SavedActivation) < rank(r)) {
                        roles[id] = Some(Category::SavedActivation);
                    }
                }
                None => self.unplaced_notes += 1,
            },
            NoteKind::RecomputeStart { label, at } => {
                self.recomputations.push(Recomputation {
                    label: label.clone(),
                    start: note.position,
                    end: None,
                    duration_ns: 0,
                    allocated_bytes: 0,
                    kept_bytes: 0,
                });
                open.push((self.recomputations.len() - 1, *at));
            }
            NoteKind::RecomputeEnd { at } => {
                // An end without a start is ignored.
                if let Some((r, started)) = open.pop() {
                    let r = &mut self.recomputations[r];
                    r.end = Some(note.position);
                    r.duration_ns =
                        u64::try_from(at.duration_since(started).as_nanos()).unwrap_or(u64::MAX);
                }
            }
            NoteKind::SavedFor { ptr, node } => {
                // Unpacked in backward: the storage is live, and was saved before.
                if let Some(id) = find(*ptr) {
                    let block = &mut self.blocks[id];
                    if block.saved_for.is_none() && block.saved_by.is_some() {
                        block.saved_for = Some(node.clone());
                    }
                }
            }
        }
    }

    /// The recomputations by block (label), in order of each block's first one: how
    /// many ran, what they allocated and re-saved, and their time.
    pub fn recomputation_by_block(&self) -> Vec<BlockRecomputation> {
        let mut out: Vec<BlockRecomputation> = Vec::new();
        for r in &self.recomputations {
            let i = match out.iter().position(|b| b.label == r.label) {
                Some(i) => i,
                None => {
                    out.push(BlockRecomputation {
                        label: r.label.clone(),
                        runs: 0,
                        allocated_bytes: 0,
                        kept_bytes: 0,
                        duration_ns: 0,
                    });
                    out.len() - 1
                }
            };
            let b = &mut out[i];
            b.runs += 1;
            b.allocated_bytes += r.allocated_bytes;
            b.kept_bytes += r.kept_bytes;
            b.duration_ns += r.duration_ns;
        }
        out
    }

    /// Bytes per category after each event: `timeline()[i].total()` is
    /// `events[i].allocated_after`.
    pub fn timeline(&self) -> Vec<CategoryBytes> {
        let mut now = CategoryBytes::default();
        self.events
            .iter()
            .map(|e| {
                now.apply(self.blocks[e.block].category, e.bytes);
                now
            })
            .collect()
    }

    /// Bytes per category after the first `position` events (0: nothing).
    pub fn bytes_at(&self, position: usize) -> CategoryBytes {
        let mut now = CategoryBytes::default();
        for e in &self.events[..position.min(self.events.len())] {
            now.apply(self.blocks[e.block].category, e.bytes);
        }
        now
    }

    /// Bytes per category when the recording started.
    pub fn start_bytes(&self) -> CategoryBytes {
        self.bytes_at(self.initial_events)
    }

    /// Bytes per category when the recording ended.
    pub fn end_bytes(&self) -> CategoryBytes {
        self.bytes_at(self.events.len())
    }

    /// Bytes per category at the first mark with this label.
    pub fn bytes_at_mark(&self, label: &str) -> Option<CategoryBytes> {
        self.marks
            .iter()
            .find(|m| m.label == label)
            .map(|m| self.bytes_at(m.position))
    }

    /// The event after which `memory_allocated` was highest (the first such), or
    /// `None` for an empty trace.
    pub fn peak_event(&self) -> Option<usize> {
        let max = self.events.iter().map(|e| e.allocated_after).max()?;
        self.events.iter().position(|e| e.allocated_after == max)
    }

    /// The highest `memory_allocated` during the recording (0 for an empty trace).
    pub fn peak_bytes(&self) -> u64 {
        self.events
            .iter()
            .map(|e| e.allocated_after)
            .max()
            .unwrap_or(0)
    }

    /// The storages live right after event `event`, largest first.
    pub fn live_after(&self, event: usize) -> Vec<&Block> {
        // The storages live at the start are blocks 0.. in the order of their events.
        let mut live: Vec<&Block> = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(id, b)| {
                b.alloc_event.unwrap_or(*id) <= event && b.free_event.is_none_or(|f| f > event)
            })
            .map(|(_, b)| b)
            .collect();
        live.sort_by_key(|b| std::cmp::Reverse(b.bytes));
        live
    }

    /// The storages allocated at or after `position` and still live at the end,
    /// largest first: what a step left behind.
    pub fn left_behind_since(&self, position: usize) -> Vec<&Block> {
        let mut left: Vec<&Block> = self
            .blocks
            .iter()
            .filter(|b| b.free_event.is_none() && b.alloc_event.is_some_and(|a| a >= position))
            .collect();
        left.sort_by_key(|b| std::cmp::Reverse(b.bytes));
        left
    }
}
