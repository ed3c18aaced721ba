//! `Plan`: which layers of a chain keep their activations and which are recomputed.
use memsave_meter::Bytes;
use std::fmt;

/// How a [`CheckpointedSequential`](crate::CheckpointedSequential) trades memory for
/// recomputation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// No checkpointing: every layer keeps what its backward needs (the baseline).
    None,
    /// Every layer is its own checkpoint (per-layer `torch.utils.checkpoint`).
    EveryLayer,
    /// `k` segments as `torch.utils.checkpoint.checkpoint_sequential`: segments of
    /// `len / k` layers, all but the last checkpointed, the rest run normally.
    Segments(usize),
    /// Recursive halving: the first half of every range is a checkpoint whose recompute
    /// is planned the same way. Memory grows with the logarithm of the depth, at the
    /// cost of about `log2(len)` extra forwards per layer.
    Nested,
    /// The schedule with the least recomputation whose predicted peak (above the step's
    /// start) fits this many bytes, solved by dynamic programming over a measured
    /// profile of each layer (in the spirit of Rotor, Beaumont et al. 2019). The model
    /// assumes the caller holds the model's output until backward is over.
    Budget(u64),
    /// Every layer under its own lever, set on the chain's
    /// [`blocks`](crate::CheckpointedSequential::blocks) (`layer i`, call 0): kept,
    /// recomputed, its inputs in a store, or its saves handed to hooks, layer by
    /// layer, as for any model of [`Blocks`](crate::Blocks) (what `fit` plans per
    /// block). Every layer is kept until levers are set.
    PerLayer,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Plan::None => write!(f, "none"),
            Plan::EveryLayer => write!(f, "every_layer"),
            Plan::Segments(k) => write!(f, "segments({k})"),
            Plan::Nested => write!(f, "nested"),
            Plan::Budget(b) => write!(f, "budget({})", Bytes(*b)),
            Plan::PerLayer => write!(f, "per_layer"),
        }
    }
}
