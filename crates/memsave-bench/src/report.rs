//! The results of a suite and their renderings: a terminal table, JSON and CSV.
//!
//! The JSON schema is the one of `pytorch_suite.py`, so both can be compared case by
//! case; byte counts are integers.
use memsave_meter::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// A suite's results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The suite's name.
    pub suite: String,
    /// Where it ran (`cpu`, `cuda:0`).
    pub device: String,
    /// The libtorch version.
    pub libtorch: String,
    /// libtorch intra-op threads.
    pub threads: usize,
    /// One entry per model and strategy, in suite order.
    pub cases: Vec<CaseResult>,
}

/// Whether a case ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Measured.
    Ok,
    /// Failed (libtorch error or panic); the text is in `error`.
    Error,
    /// Not available in this build or on this device; the reason is in `error`.
    Unavailable,
}

impl Status {
    /// The name used in JSON and the table.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Error => "error",
            Status::Unavailable => "unavailable",
        }
    }
}

/// Minimum, median and maximum over the measured repeats, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Fastest repeat.
    pub min: f64,
    /// Median repeat (the upper one of an even count).
    pub median: f64,
    /// Slowest repeat.
    pub max: f64,
}

impl StepTime {
    /// Summarizes `times` (at least one).
    pub fn from_times(mut times: Vec<f64>) -> Option<Self> {
        times.sort_by(f64::total_cmp);
        Some(Self {
            min: *times.first()?,
            median: times[times.len() / 2],
            max: *times.last()?,
        })
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

/// One model under one strategy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseResult {
    /// The model's name.
    pub model: String,
    /// The strategy's name.
    pub strategy: String,
    /// Whether it ran.
    pub status: Status,
    /// The error text (first line) or why it is unavailable.
    pub error: Option<String>,
    /// Allocated at the step's start: parameters and input.
    pub start_bytes: Option<u64>,
    /// Highest allocation during the step minus `start_bytes`.
    pub peak_bytes: Option<u64>,
    /// Allocated right after the forward minus `start_bytes` (the largest over
    /// micro-batches).
    pub retained_after_forward_bytes: Option<u64>,
    /// Step time over the repeats.
    pub step_time_s: Option<StepTime>,
    /// Largest absolute difference of any parameter gradient against the model's
    /// baseline (none for the baseline itself and for failed cases).
    pub grad_max_abs_diff: Option<f64>,
    /// Per-block memory of the last measured forward.
    pub trace: Vec<TraceEntry>,
}

impl CaseResult {
    /// A case that did not produce measurements.
    pub fn failed(model: &str, strategy: &str, status: Status, error: String) -> Self {
        Self {
            model: model.to_owned(),
            strategy: strategy.to_owned(),
            status,
            error: Some(error),
            start_bytes: None,
            peak_bytes: None,
            retained_after_forward_bytes: None,
            step_time_s: None,
            grad_max_abs_diff: None,
            trace: Vec::new(),
        }
    }
}

impl Report {
    /// The case of `model` under the plain `baseline` strategy, if it ran.
    pub fn baseline(&self, model: &str) -> Option<&CaseResult> {
        self.cases
            .iter()
            .find(|c| c.model == model && c.strategy == "baseline" && c.status == Status::Ok)
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serializes")
    }

    /// Parses a report written by [`to_json`](Self::to_json) or `pytorch_suite.py`.
    pub fn from_json(text: &str) -> serde_json::Result<Self> {
        serde_json::from_str(text)
    }

    /// One row per case, without the trace; ratios to the model's baseline.
    pub fn to_csv(&self) -> String {
        let mut out = String::from(
            "model,strategy,status,error,start_bytes,peak_bytes,retained_after_forward_bytes,\
             step_time_min_s,step_time_median_s,step_time_max_s,grad_max_abs_diff,\
             peak_vs_baseline,time_vs_baseline\n",
        );
        for case in &self.cases {
            let (peak_ratio, time_ratio) = self.ratios(case);
            let t = case.step_time_s;
            let fields = [
                csv_field(&case.model),
                csv_field(&case.strategy),
                case.status.as_str().to_owned(),
                csv_field(case.error.as_deref().unwrap_or("")),
                opt(case.start_bytes),
                opt(case.peak_bytes),
                opt(case.retained_after_forward_bytes),
                opt(t.map(|t| t.min)),
                opt(t.map(|t| t.median)),
                opt(t.map(|t| t.max)),
                opt(case.grad_max_abs_diff),
                opt(peak_ratio),
                opt(time_ratio),
            ];
            out.push_str(&fields.join(","));
            out.push('\n');
        }
        out
    }

    /// Peak and median time of `case` relative to its model's baseline.
    pub fn ratios(&self, case: &CaseResult) -> (Option<f64>, Option<f64>) {
        let Some(base) = self.baseline(&case.model) else {
            return (None, None);
        };
        let peak = match (case.peak_bytes, base.peak_bytes) {
            (Some(p), Some(b)) if b > 0 => Some(p as f64 / b as f64),
            _ => None,
        };
        let time = match (case.step_time_s, base.step_time_s) {
            (Some(t), Some(b)) if b.median > 0.0 => Some(t.median / b.median),
            _ => None,
        };
        (peak, time)
    }

    /// The terminal table: human sizes, ratios to the baseline, status, and the
    /// errors below it.
    pub fn to_table(&self) -> String {
        let header = [
            "model",
            "strategy",
            "status",
            "peak",
            "×base",
            "retained",
            "time",
            "×base",
            "grad diff",
        ];
        let dash = || "-".to_owned();
        let mut rows: Vec<[String; 9]> = Vec::new();
        for case in &self.cases {
            let (peak_ratio, time_ratio) = self.ratios(case);
            rows.push([
                case.model.clone(),
                case.strategy.clone(),
                case.status.as_str().to_owned(),
                case.peak_bytes.map_or_else(dash, |b| Bytes(b).to_string()),
                peak_ratio.map_or_else(dash, |r| format!("{r:.2}x")),
                case.retained_after_forward_bytes
                    .map_or_else(dash, |b| Bytes(b).to_string()),
                case.step_time_s
                    .map_or_else(dash, |t| format_seconds(t.median)),
                time_ratio.map_or_else(dash, |r| format!("{r:.2}x")),
                case.grad_max_abs_diff.map_or_else(dash, format_diff),
            ]);
        }
        let mut widths = header.map(|h| h.chars().count());
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "suite {} on {} (libtorch {}, {} threads)",
            self.suite, self.device, self.libtorch, self.threads
        );
        let line = |out: &mut String, cells: Vec<&str>| {
            let mut text = String::new();
            for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
                let pad = w - cell.chars().count();
                if i < 3 {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad));
                } else {
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                }
                text.push_str("  ");
            }
            let _ = writeln!(out, "{}", text.trim_end());
        };
        line(&mut out, header.to_vec());
        for row in &rows {
            line(&mut out, row.iter().map(String::as_str).collect());
        }
        for case in self.cases.iter().filter(|c| c.error.is_some()) {
            let _ = writeln!(
                out,
                "{} / {} ({}): {}",
                case.model,
                case.strategy,
                case.status.as_str(),
                case.error.as_deref().unwrap_or("")
            );
        }
        out
    }
}

/// `0.471 s`, or `12.3 ms` below a second.
fn format_seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 0.1 {
        format!("{s:.3} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// `0` for an exact match, else one significant digit and an exponent.
fn format_diff(d: f64) -> String {
    if d == 0.0 {
        "0".to_owned()
    } else {
        format!("{d:.1e}")
    }
}

fn opt<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(String::new, |v| v.to_string())
}

/// RFC 4180: quote a field holding a comma, quote or line break; double the quotes.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a, b"), "\"a, b\"");
        assert_eq!(csv_field("say \"x\""), "\"say \"\"x\"\"\"");
    }

    #[test]
    fn median_is_the_upper_middle() {
        let t = StepTime::from_times(vec![3.0, 1.0, 2.0, 4.0]).unwrap();
        assert_eq!((t.min, t.median, t.max), (1.0, 3.0, 4.0));
        assert!(StepTime::from_times(Vec::new()).is_none());
    }
}
