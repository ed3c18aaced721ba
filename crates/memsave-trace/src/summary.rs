//! The text summary of a trace, in the spirit of `torch.cuda.memory_summary()`.
use crate::category::Category;
use crate::trace::{Block, Trace};
use memsave_meter::Bytes;
use std::collections::BTreeMap;
use std::fmt::Write;

impl Trace {
    /// A table of bytes per category at the start, at the peak and at the end, where
    /// the peak happened, the saved activations at the peak by the autograd node that
    /// saved them (`AddmmBackward0`), checkpoint recomputations by block (runs, bytes
    /// allocated and re-saved, time), and the `top` largest storages live at the peak.
    pub fn summary(&self, top: usize) -> String {
        let mut out = String::new();
        let allocations = self.events[self.initial_events..]
            .iter()
            .filter(|e| e.bytes >= 0)
            .count();
        let _ = writeln!(
            out,
            "memsave trace ({:?}): {} events, {} allocations during the recording",
            self.device,
            self.events.len() - self.initial_events,
            allocations
        );
        let Some(peak) = self.peak_event() else {
            let _ = writeln!(out, "  nothing was allocated");
            return out;
        };
        let columns = [
            ("start", self.start_bytes()),
            ("peak", self.bytes_at(peak + 1)),
            ("end", self.end_bytes()),
        ];
        let _ = write!(out, "  {:<18}", "category");
        for (name, _) in &columns {
            let _ = write!(out, "{name:>14}");
        }
        let _ = writeln!(out);
        for category in Category::ALL {
            let _ = write!(out, "  {:<18}", category.as_str());
            for (_, bytes) in &columns {
                let _ = write!(out, "{:>14}", Bytes(bytes[category]).to_string());
            }
            let _ = writeln!(out);
        }
        let _ = write!(out, "  {:<18}", "total");
        for (_, bytes) in &columns {
            let _ = write!(out, "{:>14}", Bytes(bytes.total()).to_string());
        }
        let _ = writeln!(out);
        let event = &self.events[peak];
        let _ = writeln!(
            out,
            "  peak {} ({} bytes) at event {peak}, in the {} phase{}",
            Bytes(event.allocated_after),
            event.allocated_after,
            event.phase,
            event
                .mark
                .map(|m| format!(", mark '{}'", self.marks[m].label))
                .unwrap_or_default()
        );
        let live = self.live_after(peak);
        let mut by_op: BTreeMap<&str, (u64, usize)> = BTreeMap::new();
        for b in live
            .iter()
            .filter(|b| b.category == Category::SavedActivation)
        {
            let entry = by_op.entry(b.op().unwrap_or("unknown")).or_default();
            entry.0 += b.bytes;
            entry.1 += 1;
        }
        if !by_op.is_empty() {
            let _ = writeln!(
                out,
                "  saved activations at the peak, by the autograd node that saved them:"
            );
            for (op, (bytes, count)) in &by_op {
                let _ = writeln!(
                    out,
                    "    {op:<24}{:>14}  ({count} tensors)",
                    Bytes(*bytes).to_string()
                );
            }
        }
        let recomputed = self.recomputation_by_block();
        if !recomputed.is_empty() {
            let _ = writeln!(
                out,
                "  checkpoint recomputation in backward, by block (`recompute` bytes):"
            );
            let _ = writeln!(
                out,
                "    {:<24}{:>6}{:>14}{:>14}{:>12}",
                "block", "runs", "allocated", "re-saved", "time"
            );
            for b in &recomputed {
                let _ = writeln!(
                    out,
                    "    {:<24}{:>6}{:>14}{:>14}{:>9.3} ms",
                    b.label,
                    b.runs,
                    Bytes(b.allocated_bytes).to_string(),
                    Bytes(b.kept_bytes).to_string(),
                    b.duration_ns as f64 / 1e6
                );
            }
        }
        if top > 0 && !live.is_empty() {
            let _ = writeln!(out, "  largest storages live at the peak:");
            for b in live.iter().take(top) {
                let _ = writeln!(out, "    {}", describe(b));
            }
        }
        if self.unplaced_notes > 0 {
            let _ = writeln!(
                out,
                "  {} notes named tensors without a counted storage (created before the meter was installed?)",
                self.unplaced_notes
            );
        }
        out
    }
}

/// `12.00 MiB  saved_activation of AddmmBackward0  [layer 3]`
fn describe(b: &Block) -> String {
    format!(
        "{:>12}  {:<36}  {}",
        Bytes(b.bytes).to_string(),
        b.role(),
        b.mark
            .as_deref()
            .map_or(String::new(), |m| format!("[{m}]"))
    )
}
