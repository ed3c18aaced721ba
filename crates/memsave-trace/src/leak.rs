//! `detect_leak` with names: what each step left behind, by category, op and mark.
use crate::category::Category;
use crate::error::TraceError;
use crate::recorder::{Recorder, Session};
use crate::trace::Trace;
use memsave_meter::Bytes;
use std::collections::BTreeMap;
use std::fmt;

/// Storages of one kind that stayed behind: same category, op and mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftBehind {
    /// Their category.
    pub category: Category,
    /// For saved activations, what saved them: the autograd node (`TanhBackward0`)
    /// when backward has unpacked them, else the aten op that was running (`aten::tanh`;
    /// a leaked graph usually never runs backward).
    pub op: Option<String>,
    /// The mark open when they were allocated (or saved).
    pub mark: Option<String>,
    /// Their bytes in all.
    pub bytes: u64,
    /// How many storages.
    pub count: usize,
}

/// What a run of steps left behind (see [`detect_leak`]).
#[derive(Debug, Clone)]
pub struct LeakTrace {
    /// The meter's report: bytes after each step.
    pub report: memsave_meter::LeakReport,
    /// Storages allocated after the first step and still live at the end, grouped,
    /// largest first (the first step may build lasting state such as optimizer
    /// buffers, so it is not counted).
    pub left_behind: Vec<LeftBehind>,
    /// The whole recording.
    pub trace: Trace,
}

impl fmt::Display for LeakTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.report)?;
        for l in &self.left_behind {
            write!(
                f,
                "\n  {:>12}  {:<36}  {}  ({} storages)",
                Bytes(l.bytes).to_string(),
                match &l.op {
                    Some(op) => format!("{} of {op}", l.category),
                    None => l.category.to_string(),
                },
                l.mark.as_deref().unwrap_or("-"),
                l.count
            )?;
        }
        Ok(())
    }
}

/// Why [`detect_leak`] stopped: the recorder failed, or a step did.
#[derive(Debug, thiserror::Error)]
pub enum LeakError<E> {
    /// The recording could not be made.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A step returned this error (the run stops at the first).
    #[error("a step failed: {0}")]
    Step(E),
}

/// Category, op and mark: what a [`LeftBehind`] groups by.
type GroupKey = (Category, Option<String>, Option<String>);

/// Runs `step(i, session)` for `i` in `0..steps` under one recording, and reports the
/// bytes after each step (as `memsave_meter::detect_leak` does) and what stayed
/// behind, by category, op and mark. Each step is marked `step i` before it runs;
/// marks the step sets itself name the storages more precisely.
///
/// The classic leak, `total_loss = total_loss + loss`, shows as one `saved_activation`
/// group per op of the loss's graph, growing by one storage per step.
pub fn detect_leak<E>(
    recorder: Recorder,
    steps: usize,
    mut step: impl FnMut(usize, &Session) -> Result<(), E>,
) -> Result<LeakTrace, LeakError<E>> {
    let (result, trace) = recorder.record(|session| {
        let mut ends = Vec::new();
        for i in 0..steps {
            session.mark(format!("step {i}"));
            step(i, session)?;
            ends.push(memsave_sys::alloc::recording_position());
        }
        Ok(ends)
    })?;
    let ends = result.map_err(LeakError::Step)?;
    let allocated_at = |position: usize| {
        position
            .checked_sub(1)
            .and_then(|i| trace.events.get(i))
            .map_or(0, |e| e.allocated_after)
    };
    let report = memsave_meter::LeakReport {
        start_bytes: allocated_at(trace.initial_events),
        after_step_bytes: ends.iter().map(|&p| allocated_at(p)).collect(),
    };
    let mut groups: BTreeMap<GroupKey, (u64, usize)> = BTreeMap::new();
    if let Some(&first_end) = ends.first() {
        for b in trace.left_behind_since(first_end) {
            let entry = groups
                .entry((b.category, b.op().map(str::to_owned), b.mark.clone()))
                .or_default();
            entry.0 += b.bytes;
            entry.1 += 1;
        }
    }
    let mut left_behind: Vec<LeftBehind> = groups
        .into_iter()
        .map(|((category, op, mark), (bytes, count))| LeftBehind {
            category,
            op,
            mark,
            bytes,
            count,
        })
        .collect();
    left_behind.sort_by_key(|b| std::cmp::Reverse(b.bytes));
    Ok(LeakTrace {
        report,
        left_behind,
        trace,
    })
}
