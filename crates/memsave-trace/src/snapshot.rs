//! PyTorch's memory snapshot: the pickle `torch.cuda.memory._snapshot()` returns, for
//! `python -m torch.cuda._memory_viz` and memory_viz.
use crate::error::TraceError;
use crate::trace::{Block, Trace};
use serde::Serialize;

#[derive(Serialize)]
struct Snapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<TraceEntry>>,
}

/// A stack frame; memsave puts the storage's role where Python's frames would be.
#[derive(Serialize, Clone)]
struct Frame {
    filename: String,
    line: i64,
    name: String,
}

#[derive(Serialize)]
struct TraceEntry {
    action: &'static str,
    addr: u64,
    size: u64,
    stream: i64,
    time_us: u64,
    frames: Vec<Frame>,
}

#[derive(Serialize)]
struct Segment {
    device: i64,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: i64,
    segment_type: &'static str,
    is_expandable: bool,
    frames: Vec<Frame>,
    blocks: Vec<SegmentBlock>,
}

#[derive(Serialize)]
struct SegmentBlock {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    frames: Vec<Frame>,
}

/// Innermost first, as PyTorch lists frames: the role (`saved_activation of
/// AddmmBackward0`, `recompute`), for a saved tensor the aten op that saved it and the
/// tensor's own grad_fn, for a recomputation's tensor the block recomputed, then the
/// mark and the phase of the allocation.
fn frames(block: &Block) -> Vec<Frame> {
    let mut frames = vec![Frame {
        filename: format!("memsave:{}", block.category),
        line: 0,
        name: block.role(),
    }];
    if let Some(op) = &block.saved_by {
        frames.push(Frame {
            filename: "saved by".to_owned(),
            line: 0,
            name: op.clone(),
        });
    }
    if let Some(producer) = &block.producer {
        frames.push(Frame {
            filename: "grad_fn".to_owned(),
            line: 0,
            name: format!("the tensor's grad_fn: {producer}"),
        });
    }
    if let Some(label) = &block.recomputation {
        frames.push(Frame {
            filename: "recomputation".to_owned(),
            line: 0,
            name: format!("recomputing {label}"),
        });
    }
    frames.push(Frame {
        filename: format!("phase:{}", block.phase),
        line: 0,
        name: block
            .mark
            .as_deref()
            .map_or_else(|| "no mark".to_owned(), |m| format!("mark: {m}")),
    });
    frames
}

impl Trace {
    /// The trace as PyTorch's memory snapshot, pickled: `device_traces[0]` has an
    /// `alloc` for every allocation (the storages live at the start first, at time 0)
    /// and a `free_requested` plus `free_completed` for every free; `segments` has one
    /// segment per storage live at the end (the CPU allocator has no segments of its
    /// own). The frames name the role (`saved_activation of AddmmBackward0`), the aten
    /// op and the mark.
    ///
    /// Open it with `python -m torch.cuda._memory_viz trace_plot FILE -o out.html`, or
    /// drop it on PyTorch's memory_viz page.
    pub fn to_snapshot_pickle(&self) -> Result<Vec<u8>, TraceError> {
        let mut entries = Vec::with_capacity(self.events.len() * 2);
        for e in &self.events {
            let block = &self.blocks[e.block];
            let entry = |action| TraceEntry {
                action,
                addr: block.addr,
                size: e.bytes.unsigned_abs(),
                stream: 0,
                time_us: e.time_ns / 1000,
                frames: frames(block),
            };
            if e.bytes >= 0 {
                entries.push(entry("alloc"));
            } else {
                entries.push(entry("free_requested"));
                entries.push(entry("free_completed"));
            }
        }
        let segments = self
            .blocks
            .iter()
            .filter(|b| b.free_event.is_none())
            .map(|b| Segment {
                device: 0,
                address: b.addr,
                total_size: b.bytes,
                allocated_size: b.bytes,
                active_size: b.bytes,
                requested_size: b.bytes,
                stream: 0,
                segment_type: "large",
                is_expandable: false,
                frames: frames(b),
                blocks: vec![SegmentBlock {
                    address: b.addr,
                    size: b.bytes,
                    requested_size: b.bytes,
                    state: "active_allocated",
                    frames: frames(b),
                }],
            })
            .collect();
        let snapshot = Snapshot {
            segments,
            device_traces: vec![entries],
        };
        Ok(serde_pickle::to_vec(
            &snapshot,
            serde_pickle::SerOptions::new(),
        )?)
    }
}
