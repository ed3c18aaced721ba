//! `Schedule`: an executable checkpointing plan, a sequence of blocks covering the chain.
use crate::error::{CheckpointError, Result};
use std::fmt;

/// One step of a schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Block {
    /// Run this layer normally, keeping what its backward needs.
    Layer(usize),
    /// Run layers `start..end` without keeping activations; in backward, recompute them
    /// following `inner` (which may hold further checkpoints).
    Checkpoint {
        /// First layer of the range.
        start: usize,
        /// One past the last layer of the range.
        end: usize,
        /// How the recompute runs the range.
        inner: Vec<Block>,
    },
}

/// A top-level checkpoint whose input a boundary store keeps until the recompute (see
/// [`BoundaryStore`](crate::BoundaryStore)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StoredBoundary {
    /// The layer whose input is stored: the start of a top-level checkpoint, above 0.
    pub layer: usize,
    /// Which store keeps it: an index into the chain's levers.
    pub lever: usize,
}

/// A sequence of blocks covering layers `0..len` in order, and the boundaries that
/// stores keep (none unless levers are in use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    blocks: Vec<Block>,
    stored: Vec<StoredBoundary>,
}

impl Schedule {
    /// A schedule from blocks; checks that they cover `0..len` exactly, recursively.
    pub fn new(blocks: Vec<Block>, len: usize) -> Result<Self> {
        check_cover(&blocks, 0, len)?;
        Ok(Self {
            blocks,
            stored: Vec::new(),
        })
    }

    /// This schedule with the inputs of some top-level checkpoints kept by stores. Each
    /// boundary must start a top-level checkpoint past layer 0 (the chain's input is the
    /// caller's), at most once.
    pub fn with_stored(mut self, mut stored: Vec<StoredBoundary>) -> Result<Self> {
        stored.sort();
        for (i, b) in stored.iter().enumerate() {
            let starts_checkpoint = self
                .blocks
                .iter()
                .any(|block| matches!(block, Block::Checkpoint { start, .. } if *start == b.layer));
            if b.layer == 0 || !starts_checkpoint || (i > 0 && stored[i - 1].layer == b.layer) {
                return Err(CheckpointError::InvalidPlan(format!(
                    "boundary {} can be stored only once, and only where a top-level checkpoint \
                     past layer 0 starts",
                    b.layer
                )));
            }
        }
        self.stored = stored;
        Ok(self)
    }

    /// The boundaries stores keep, by layer.
    pub fn stored(&self) -> &[StoredBoundary] {
        &self.stored
    }

    /// The store keeping layer `layer`'s input, if any.
    pub fn lever_at(&self, layer: usize) -> Option<usize> {
        self.stored
            .binary_search_by_key(&layer, |b| b.layer)
            .ok()
            .map(|i| self.stored[i].lever)
    }

    /// Every layer run normally.
    pub fn plain(len: usize) -> Self {
        Self {
            blocks: (0..len).map(Block::Layer).collect(),
            stored: Vec::new(),
        }
    }

    /// Every layer its own checkpoint.
    pub fn every_layer(len: usize) -> Self {
        Self {
            blocks: (0..len)
                .map(|i| Block::Checkpoint {
                    start: i,
                    end: i + 1,
                    inner: vec![Block::Layer(i)],
                })
                .collect(),
            stored: Vec::new(),
        }
    }

    /// `checkpoint_sequential(segments)`: `len / segments` layers a segment, all but the
    /// last segment checkpointed, the remaining layers run normally.
    pub fn segments(len: usize, segments: usize) -> Result<Self> {
        if segments == 0 || segments > len.max(1) {
            return Err(CheckpointError::InvalidPlan(format!(
                "segments must be between 1 and the number of layers ({len}), got {segments}"
            )));
        }
        let size = len / segments;
        let mut blocks = Vec::new();
        let mut start = 0;
        for _ in 0..segments - 1 {
            blocks.push(Block::Checkpoint {
                start,
                end: start + size,
                inner: (start..start + size).map(Block::Layer).collect(),
            });
            start += size;
        }
        blocks.extend((start..len).map(Block::Layer));
        Ok(Self {
            blocks,
            stored: Vec::new(),
        })
    }

    /// Recursive halving (see [`Plan::Nested`](crate::Plan::Nested)).
    pub fn nested(len: usize) -> Self {
        Self {
            blocks: nested_blocks(0, len),
            stored: Vec::new(),
        }
    }

    /// The blocks, in order.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Number of layer forwards one step runs: normal ones plus recomputations.
    pub fn forward_count(&self) -> usize {
        fn count(blocks: &[Block]) -> usize {
            blocks
                .iter()
                .map(|b| match b {
                    Block::Layer(_) => 1,
                    Block::Checkpoint { start, end, inner } => (end - start) + count(inner),
                })
                .sum()
        }
        count(&self.blocks)
    }
}

fn nested_blocks(start: usize, end: usize) -> Vec<Block> {
    let len = end - start;
    if len <= 2 {
        return (start..end).map(Block::Layer).collect();
    }
    let mid = start + len.div_ceil(2);
    let mut blocks = vec![Block::Checkpoint {
        start,
        end: mid,
        inner: nested_blocks(start, mid),
    }];
    blocks.extend(nested_blocks(mid, end));
    blocks
}

fn check_cover(blocks: &[Block], start: usize, end: usize) -> Result<()> {
    let mut next = start;
    for block in blocks {
        match block {
            Block::Layer(i) if *i == next => next += 1,
            Block::Checkpoint {
                start: s,
                end: e,
                inner,
            } if *s == next && e > s => {
                check_cover(inner, *s, *e)?;
                next = *e;
            }
            other => {
                return Err(CheckpointError::InvalidPlan(format!(
                    "schedule block {other:?} does not continue at layer {next}"
                )))
            }
        }
    }
    if next != end {
        return Err(CheckpointError::InvalidPlan(format!(
            "schedule covers layers {start}..{next}, expected {start}..{end}"
        )));
    }
    Ok(())
}

fn write_blocks(
    f: &mut fmt::Formatter<'_>,
    blocks: &[Block],
    stored: &[StoredBoundary],
) -> fmt::Result {
    for (i, block) in blocks.iter().enumerate() {
        if i > 0 {
            write!(f, " ")?;
        }
        match block {
            Block::Layer(l) => write!(f, "{l}")?,
            Block::Checkpoint { start, end, inner } => {
                write!(f, "ckpt[{start}..{end}]")?;
                if let Some(b) = stored.iter().find(|b| b.layer == *start) {
                    write!(f, "<store {}>", b.lever)?;
                }
                write!(f, "{{")?;
                write_blocks(f, inner, &[])?;
                write!(f, "}}")?;
            }
        }
    }
    Ok(())
}

/// `0 1 ckpt[2..4]{2 3}`: layer numbers run normally, checkpointed ranges with the
/// schedule of their recompute in braces; `ckpt[2..4]<store 0>{2 3}` when store 0 keeps
/// the checkpoint's input.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_blocks(f, &self.blocks, &self.stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_match_checkpoint_sequential() {
        // 10 layers, 3 segments: size 3, checkpoints [0..3] and [3..6], then 6..10 plain.
        let s = Schedule::segments(10, 3).unwrap();
        assert_eq!(s.to_string(), "ckpt[0..3]{0 1 2} ckpt[3..6]{3 4 5} 6 7 8 9");
        assert_eq!(Schedule::segments(4, 1).unwrap().to_string(), "0 1 2 3");
        assert!(Schedule::segments(4, 0).is_err());
        assert!(Schedule::segments(4, 5).is_err());
    }

    #[test]
    fn nested_halves_recursively_and_covers_the_chain() {
        let s = Schedule::nested(5);
        assert_eq!(s.to_string(), "ckpt[0..3]{ckpt[0..2]{0 1} 2} 3 4");
        for len in 0..40 {
            let s = Schedule::nested(len);
            Schedule::new(s.blocks().to_vec(), len).unwrap();
        }
    }

    #[test]
    fn forward_count_counts_recomputation() {
        assert_eq!(Schedule::plain(4).forward_count(), 4);
        assert_eq!(Schedule::every_layer(4).forward_count(), 8);
        assert_eq!(Schedule::segments(10, 3).unwrap().forward_count(), 16);
    }

    #[test]
    fn malformed_schedules_are_rejected() {
        assert!(Schedule::new(vec![Block::Layer(1)], 2).is_err());
        assert!(Schedule::new(vec![Block::Layer(0)], 2).is_err());
        let bad_inner = Block::Checkpoint {
            start: 0,
            end: 2,
            inner: vec![Block::Layer(0)],
        };
        assert!(Schedule::new(vec![bad_inner], 2).is_err());
    }
}
