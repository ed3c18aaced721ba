//! `memory_summary`: a readable report in the spirit of `torch.cuda.memory_summary()`.
use crate::bytes::Bytes;
use crate::stats::{f_live_allocations, f_max_memory_allocated, f_memory_allocated, memory_limit};
use memsave_sys::alloc;
use std::fmt::Write;
use tch::Device;

/// How many of the largest live allocations the summary lists.
const LARGEST: usize = 5;

/// Current and peak bytes, the limit, live allocations and the largest of them.
pub fn memory_summary(device: Device) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "memsave memory summary ({device:?})");
    let current = match f_memory_allocated(device) {
        Ok(b) => b,
        Err(e) => {
            let _ = writeln!(out, "  unavailable: {e}");
            return out;
        }
    };
    let row = |out: &mut String, name: &str, value: String| {
        let _ = writeln!(out, "  {name:<22}{value:>14}");
    };
    row(&mut out, "allocated", Bytes(current).to_string());
    row(
        &mut out,
        "peak allocated",
        f_max_memory_allocated(device).map_or_else(|_| "?".to_owned(), |b| Bytes(b).to_string()),
    );
    row(
        &mut out,
        "limit",
        memory_limit(device).map_or_else(|| "none".to_owned(), |l| Bytes(l).to_string()),
    );
    row(
        &mut out,
        "live allocations",
        f_live_allocations(device).map_or_else(|_| "?".to_owned(), |n| n.to_string()),
    );
    if device == Device::Cpu {
        let largest = alloc::largest_allocations(LARGEST);
        if !largest.is_empty() {
            let _ = writeln!(out, "  largest live allocations:");
            for (i, bytes) in largest.iter().enumerate() {
                let _ = writeln!(out, "    {}. {:>12}", i + 1, Bytes(*bytes).to_string());
            }
        }
    }
    out
}
