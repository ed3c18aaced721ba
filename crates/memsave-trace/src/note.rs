//! What a recorded step says about its tensors while it runs (phases, marks, roles,
//! saves), noted by the [`Recorder`](crate::Recorder) against the allocator's event
//! stream and read by [`Trace`](crate::Trace) when it sorts the events into blocks.
use crate::category::{Category, Phase};
use std::time::Instant;

/// Something the step said, at a position of the event stream (before event `position`).
#[derive(Debug, Clone)]
pub(crate) struct Note {
    pub position: usize,
    pub what: NoteKind,
}

#[derive(Debug, Clone)]
pub(crate) enum NoteKind {
    Phase(Phase),
    Mark(String),
    /// The storage holding `ptr` has this role from now on (and, retroactively, since
    /// its allocation).
    Role {
        ptr: u64,
        category: Category,
    },
    /// Autograd saved the tensor at `ptr` for backward.
    Saved {
        ptr: u64,
        op: String,
        producer: String,
        mark: Option<String>,
    },
    /// A checkpoint's recomputation of `label` (a block) started, at `at`: what is
    /// allocated until its end is `recompute`. Recomputations may nest.
    RecomputeStart {
        label: String,
        at: Instant,
    },
    /// The innermost recomputation running ended, at `at`.
    RecomputeEnd {
        at: Instant,
    },
    /// Backward unpacked the saved tensor at `ptr` while running `node`, the autograd
    /// node that saved it.
    SavedFor {
        ptr: u64,
        node: String,
    },
}
