//! What a byte is for (`Category`) and when it was allocated (`Phase`).
use std::fmt;
use std::ops::{Index, IndexMut};

/// What an allocation holds, by the role of the tensor in training (the categories of
/// PyTorch's `MemTracker`, plus `input`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    /// A parameter's data (registered with [`Recorder::parameters`](crate::Recorder::parameters)).
    Parameter,
    /// A parameter's `.grad`, or a buffer that became one.
    Gradient,
    /// Optimizer state (registered with [`Recorder::optimizer_state`](crate::Recorder::optimizer_state)
    /// or [`Session::optimizer_state`](crate::Session::optimizer_state)).
    OptimizerState,
    /// A tensor autograd saved for backward, with the op that saved it.
    SavedActivation,
    /// Allocated while a checkpoint's recomputation ran in backward (told with
    /// [`Session::recomputation_start`](crate::Session::recomputation_start)), and
    /// none of the above: what the recomputation re-saves for the block's backward and
    /// the temporaries of its forward. What recomputing costs in memory.
    Recompute,
    /// Allocated and freed inside the recording, and none of the above.
    Temporary,
    /// The step's input (registered with [`Recorder::inputs`](crate::Recorder::inputs)).
    Input,
    /// Everything the recorder cannot place: live before the recording and not
    /// registered, or still live after it with no role. Counted, never dropped.
    Other,
}

impl Category {
    /// Every category, in the order tables and plots show them.
    pub const ALL: [Category; 8] = [
        Category::Parameter,
        Category::Gradient,
        Category::OptimizerState,
        Category::SavedActivation,
        Category::Recompute,
        Category::Temporary,
        Category::Input,
        Category::Other,
    ];

    /// The name PyTorch users know (`saved_activation`).
    pub fn as_str(self) -> &'static str {
        match self {
            Category::Parameter => "parameter",
            Category::Gradient => "gradient",
            Category::OptimizerState => "optimizer_state",
            Category::SavedActivation => "saved_activation",
            Category::Recompute => "recompute",
            Category::Temporary => "temporary",
            Category::Input => "input",
            Category::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The part of a training step an event happened in, as the step says with
/// [`Session::phase`](crate::Session::phase); `Other` before it says anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Phase {
    /// The forward and the loss.
    Forward,
    /// Backward.
    Backward,
    /// The optimizer's step (and a scaler's unscale and update).
    Optimizer,
    /// Anything else (before the first phase is set, or between steps).
    #[default]
    Other,
}

impl Phase {
    /// The name in reports (`forward`).
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Other => "other",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Bytes per category at one moment; [`total`](Self::total) is `memory_allocated`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CategoryBytes([u64; Category::ALL.len()]);

impl CategoryBytes {
    /// The sum over all categories.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// `(category, bytes)` for every category, in [`Category::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Category, u64)> + '_ {
        Category::ALL.iter().map(move |&c| (c, self[c]))
    }

    pub(crate) fn apply(&mut self, category: Category, bytes: i64) {
        let slot = &mut self.0[category.index()];
        *slot = slot.wrapping_add_signed(bytes);
    }
}

impl Index<Category> for CategoryBytes {
    type Output = u64;
    fn index(&self, c: Category) -> &u64 {
        &self.0[c.index()]
    }
}

impl IndexMut<Category> for CategoryBytes {
    fn index_mut(&mut self, c: Category) -> &mut u64 {
        &mut self.0[c.index()]
    }
}
