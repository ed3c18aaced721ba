//! What a measured step reports besides its bytes: where the peak happened and the
//! per-block memory of the forward.
use serde::{Deserialize, Serialize};

/// The phase of a step during which its allocation peaked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeakPhase {
    /// The forward and the loss (of any micro-batch).
    Forward,
    /// Backward (with `in_backward`, the optimizer's updates happen here too).
    Backward,
    /// The optimizer step after backward.
    Optimizer,
}

impl PeakPhase {
    /// The name used in JSON and the table.
    pub fn as_str(self) -> &'static str {
        match self {
            PeakPhase::Forward => "forward",
            PeakPhase::Backward => "backward",
            PeakPhase::Optimizer => "optimizer",
        }
    }
}

/// Bytes allocated around one block of the measured forward (absolute, like
/// `memory_allocated`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// `layer i`.
    pub mark: String,
    /// Allocated before the block ran.
    pub before: u64,
    /// Allocated right after it returned (its input still held by the caller).
    pub after: u64,
}
