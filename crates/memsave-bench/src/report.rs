//! The results of a suite and their renderings: a terminal table, JSON and CSV.
//!
//! # JSON
//!
//! The JSON is [`Report`] as it is, with byte counts as integers. Schema version 2
//! ([`SCHEMA_VERSION`]) differs from version 1, the schema `pytorch_suite.py` writes
//! (which has no `schema_version`), in:
//! - `schema_version`: 2;
//! - `libtorch_version` (was `libtorch`): the version memsave's C++ bridge was compiled
//!   against, read from the bridge;
//! - per case `is_baseline`: the strategy applies no memory-saving technique, so it is
//!   the model's reference of ratios and gradient differences (decided by the
//!   techniques, not the name);
//! - per case `has_baseline` and `grad_diverged`, which tell apart what a `null`
//!   `grad_max_abs_diff` used to conflate: `has_baseline` is true when the case's
//!   gradients were compared with the baseline's (false for the baseline itself and
//!   for failed cases); `grad_diverged` is true when they were and some difference is
//!   NaN or infinite. `grad_max_abs_diff` is a finite number exactly when
//!   `has_baseline && !grad_diverged`;
//! - per case `peak_phase` (`forward`, `backward` or `optimizer`: when the step's
//!   allocation peaked) and `optimizer_state_bytes` (for a strategy with
//!   `optimizer:`, as `pytorch_suite.py` reports it), `null` when not measured.
//!
//! - per case `world_size`, `gradient_bytes`, `bytes_sent_per_step` and
//!   `parameter_bytes` (what a rank holds of the weights between steps), for a suite
//!   with `world_size` (see the `distributed` module); `null` otherwise. Under `zero: 3`
//!   also `gathered_peak_bytes` (the most full weights a rank held at once). The CSV
//!   does not carry them.
//! - per case `rounds`: how many interleaved rounds `step_time_s` is over (see
//!   [`CaseResult::rounds`]); `null` where the times are back-to-back repeats (a
//!   distributed case) or the file predates the field.
//!
//! [`Report::from_json`] also reads version 1 (`pytorch_suite.py`'s output): the new
//! fields then take their defaults (`schema_version` 1, the flags false).
//!
//! The CSV has the same columns as before, plus `grad_diverged`, `has_baseline`,
//! `peak_phase`, `optimizer_state_bytes` and `rounds` at the end.
use memsave_meter::Bytes;
pub use memsave_step::{PeakPhase, TraceEntry};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// The version of the JSON schema [`Report::to_json`] writes.
pub const SCHEMA_VERSION: u32 = 2;

/// A suite's results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The JSON schema's version ([`SCHEMA_VERSION`]; 1 for a file without one).
    #[serde(default = "schema_version_1")]
    pub schema_version: u32,
    /// The suite's name.
    pub suite: String,
    /// Where it ran (`cpu`, `cuda:0`).
    pub device: String,
    /// The libtorch version memsave's bridge was compiled against
    /// (`memsave_sys::version::libtorch_version`).
    #[serde(alias = "libtorch")]
    pub libtorch_version: String,
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

/// Minimum, median and maximum over the timed steps, in seconds (one per round, see
/// [`CaseResult::rounds`]), and how steady the median is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Fastest repeat.
    pub min: f64,
    /// Median repeat (the upper one of an even count).
    pub median: f64,
    /// Slowest repeat.
    pub max: f64,
    /// The median's spread: half the width of its distribution-free 95% confidence
    /// interval over the median (0.011: ±1.1%; see [`crate::spread`]); `None` below 6
    /// repeats, and in reports without it (older ones, PyTorch's reference).
    #[serde(default)]
    pub spread: Option<f64>,
}

impl StepTime {
    /// Summarizes `times` (at least one).
    pub fn from_times(mut times: Vec<f64>) -> Option<Self> {
        times.sort_by(f64::total_cmp);
        Some(Self {
            min: *times.first()?,
            median: times[times.len() / 2],
            max: *times.last()?,
            spread: crate::spread::spread(&times),
        })
    }
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
    /// Step time over the timed steps (`repeats` of them: one per round).
    pub step_time_s: Option<StepTime>,
    /// True when the strategy applies no memory-saving technique: the model's
    /// reference of ratios and gradient differences.
    #[serde(default)]
    pub is_baseline: bool,
    /// True when the gradients were compared with the model's baseline gradients
    /// (false for a baseline case itself and for failed cases).
    #[serde(default)]
    pub has_baseline: bool,
    /// Largest absolute difference of any parameter gradient against the model's
    /// baseline, when they were compared and every difference is finite.
    pub grad_max_abs_diff: Option<f64>,
    /// True when the gradients were compared and some difference is NaN or infinite
    /// (`grad_max_abs_diff` is then `None`).
    #[serde(default)]
    pub grad_diverged: bool,
    /// Per-block memory of the measured step's forward.
    pub trace: Vec<TraceEntry>,
    /// The phase of the measured step during which the allocation reached its
    /// peak: with every-layer checkpointing it is usually backward's end, among the
    /// gradients (where stepping in backward helps); without, backward's start.
    #[serde(default)]
    pub peak_phase: Option<PeakPhase>,
    /// Bytes of optimizer state held after the measured step, for a strategy
    /// with `optimizer:`.
    #[serde(default)]
    pub optimizer_state_bytes: Option<u64>,
    /// Bytes written to the offload store (or copied to host memory) by an `offload`
    /// strategy in the measured step.
    #[serde(default)]
    pub offloaded_bytes: Option<u64>,
    /// Bytes saved by a `compress` strategy's codec in the measured step
    /// (original minus stored, scales included).
    #[serde(default)]
    pub compressed_saved_bytes: Option<u64>,
    /// Relative L2 error of all parameter gradients against the model's baseline,
    /// `|g - g_base| / |g_base|`, when they were compared.
    #[serde(default)]
    pub grad_rel_l2: Option<f64>,
    /// The number of ranks the case ran on, for a suite with `world_size`. Then
    /// `start_bytes` and `peak_bytes` are the largest over the ranks, and
    /// `optimizer_state_bytes`, `gradient_bytes` and `bytes_sent_per_step` are per rank
    /// (the largest over the ranks).
    #[serde(default)]
    pub world_size: Option<usize>,
    /// Gradient bytes a rank holds after the step's backward, by the meter (what the
    /// backward left allocated), for a suite with `world_size`.
    #[serde(default)]
    pub gradient_bytes: Option<u64>,
    /// Bytes a rank sent in the last measured step, as `memsave_dist`'s process group
    /// counted its collectives, for a suite with `world_size`.
    #[serde(default)]
    pub bytes_sent_per_step: Option<u64>,
    /// Bytes of parameters a rank holds between steps, for a suite with `world_size`:
    /// every weight under data parallel and ZeRO-1/2, this rank's shards (padding and a
    /// 4-byte placeholder included) under ZeRO-3.
    #[serde(default)]
    pub parameter_bytes: Option<u64>,
    /// Under ZeRO-3: the most bytes of gathered (full) weights a rank held at once
    /// during the measured step; `None` otherwise.
    #[serde(default)]
    pub gathered_peak_bytes: Option<u64>,
    /// Examples per optimizer step the case trained on: the model's batch, except
    /// under `auto_batch`, which halves it until the step fits.
    #[serde(default)]
    pub global_batch: Option<i64>,
    /// Real steps run to find a configuration that fits (`auto_batch`: the batch sizes
    /// tried, every one but the last out of memory; `fit`: its confirming steps).
    #[serde(default)]
    pub tries: Option<usize>,
    /// The configuration a `fit` strategy chose (`memsave_fit::Choice::strategy`),
    /// listed below the table.
    #[serde(default)]
    pub choice: Option<String>,
    /// The peak `fit` measured for its choice, on the whole device as its budget counts
    /// it (the parameters, the optimizer's state and the input included, unlike
    /// `peak_bytes`), listed with the choice.
    #[serde(default)]
    pub fit_device_peak_bytes: Option<u64>,
    /// How many rounds `step_time_s` was timed in: in each round every strategy of the
    /// model that was measured ran one timed step, in suite order, the order reversed
    /// every other round, so that a machine whose speed drifts over seconds slows all
    /// of them alike and the ratios to the baseline compare like with like. `None`
    /// where the timed steps ran back to back (a distributed case, whose ranks run in
    /// processes of their own) or the report predates the field.
    #[serde(default)]
    pub rounds: Option<usize>,
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
            is_baseline: false,
            has_baseline: false,
            grad_max_abs_diff: None,
            grad_diverged: false,
            trace: Vec::new(),
            peak_phase: None,
            optimizer_state_bytes: None,
            offloaded_bytes: None,
            compressed_saved_bytes: None,
            grad_rel_l2: None,
            world_size: None,
            gradient_bytes: None,
            bytes_sent_per_step: None,
            parameter_bytes: None,
            gathered_peak_bytes: None,
            global_batch: None,
            tries: None,
            choice: None,
            fit_device_peak_bytes: None,
            rounds: None,
        }
    }

    /// Records `diff`, the largest absolute gradient difference against the baseline
    /// (NaN or infinite when the gradients diverged).
    pub fn set_grad_diff(&mut self, diff: f64) {
        self.has_baseline = true;
        self.grad_diverged = !diff.is_finite();
        self.grad_max_abs_diff = diff.is_finite().then_some(diff);
    }
}

fn schema_version_1() -> u32 {
    1
}

impl Report {
    /// The first case of `model` that is a baseline ([`CaseResult::is_baseline`]) and
    /// ran, whatever its name.
    pub fn baseline(&self, model: &str) -> Option<&CaseResult> {
        self.cases
            .iter()
            .find(|c| c.model == model && c.is_baseline && c.status == Status::Ok)
    }

    /// Pretty JSON in the current schema ([`SCHEMA_VERSION`], whatever version the
    /// report was read from).
    pub fn to_json(&self) -> String {
        let current = Report {
            schema_version: SCHEMA_VERSION,
            ..self.clone()
        };
        serde_json::to_string_pretty(&current).expect("a report always serializes")
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
             peak_vs_baseline,time_vs_baseline,grad_diverged,has_baseline,peak_phase,\
             optimizer_state_bytes,rounds\n",
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
                case.grad_diverged.to_string(),
                case.has_baseline.to_string(),
                opt(case.peak_phase.map(PeakPhase::as_str)),
                opt(case.optimizer_state_bytes),
                opt(case.rounds),
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

    /// How the step times of the table were taken, for the line below it: the number
    /// of interleaved rounds (per number, the models it applies to when they differ),
    /// which cases' repeats ran back to back, and what the ± beside a time means when
    /// one has it. `None` without a timed case.
    pub fn rounds_line(&self) -> Option<String> {
        let timed = || self.cases.iter().filter(|c| c.step_time_s.is_some());
        let mut counts: Vec<usize> = timed().filter_map(|c| c.rounds).collect();
        counts.sort_unstable();
        counts.dedup();
        let back_to_back = timed().any(|c| c.rounds.is_none());
        let mut parts = Vec::new();
        for &n in &counts {
            let mut models: Vec<&str> = timed()
                .filter(|c| c.rounds == Some(n))
                .map(|c| c.model.as_str())
                .collect();
            models.dedup();
            let rounds = if n == 1 { "round" } else { "rounds" };
            parts.push(if counts.len() == 1 {
                format!("the median of {n} {rounds}")
            } else {
                format!("the median of {n} {rounds} ({})", models.join(", "))
            });
        }
        if back_to_back {
            parts.push("back-to-back repeats for the cases timed without rounds (distributed: their ranks run in processes of their own)".to_owned());
        }
        if parts.is_empty() {
            return None;
        }
        let how = if counts.is_empty() {
            String::new()
        } else {
            "; each round times every strategy of a model once, in suite order, reversed every other round".to_owned()
        };
        let spread = if timed().any(|c| c.step_time_s.is_some_and(|t| t.spread.is_some())) {
            "; ±: half the width of the median's 95% confidence interval (order statistics), over the median"
        } else {
            ""
        };
        Some(format!("time: {}{how}{spread}", parts.join("; ")))
    }

    /// The terminal table: human sizes, ratios to the baseline, status, then a line
    /// saying how many rounds the times are the median of ([`rounds_line`](Self::rounds_line))
    /// and the errors below it.
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
            "offloaded",
            "compressed",
            "rel L2",
            "grad diff",
            "peak at",
            "opt state",
            "batch",
        ];
        let dash = || "-".to_owned();
        let mut rows: Vec<[String; 15]> = Vec::new();
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
                case.step_time_s.map_or_else(dash, |t| match t.spread {
                    Some(s) => format!("{} ±{:.1}%", format_seconds(t.median), s * 100.0),
                    None => format_seconds(t.median),
                }),
                time_ratio.map_or_else(dash, |r| format!("{r:.2}x")),
                case.offloaded_bytes
                    .map_or_else(dash, |b| Bytes(b).to_string()),
                case.compressed_saved_bytes
                    .map_or_else(dash, |b| Bytes(b).to_string()),
                case.grad_rel_l2.map_or_else(dash, format_diff),
                match (case.grad_max_abs_diff, case.grad_diverged) {
                    (_, true) => "diverged".to_owned(),
                    (Some(d), false) => format_diff(d),
                    (None, false) => dash(),
                },
                case.peak_phase.map_or_else(dash, |p| p.as_str().to_owned()),
                case.optimizer_state_bytes
                    .map_or_else(dash, |b| Bytes(b).to_string()),
                match (case.global_batch, case.tries) {
                    (Some(b), Some(1)) => format!("{b} (1 try)"),
                    (Some(b), Some(t)) => format!("{b} ({t} tries)"),
                    (Some(b), None) => b.to_string(),
                    (None, _) => dash(),
                },
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
            self.suite, self.device, self.libtorch_version, self.threads
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
        if let Some(rounds) = self.rounds_line() {
            let _ = writeln!(out, "{rounds}");
        }
        if self.cases.iter().any(|c| c.world_size.is_some()) {
            distributed_table(&mut out, &self.cases);
        }
        for case in &self.cases {
            if let Some(choice) = &case.choice {
                let measured = case.fit_device_peak_bytes.map_or(String::new(), |b| {
                    format!(
                        ", measured by fit at {} on the device (its budget is the whole device; the table's peak is above the parameters, the optimizer's state and the input)",
                        Bytes(b)
                    )
                });
                let _ = writeln!(
                    out,
                    "{} / {}: chose {choice}{measured}",
                    case.model, case.strategy
                );
            }
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

/// The per-rank figures of a distributed run, below the main table.
fn distributed_table(out: &mut String, cases: &[CaseResult]) {
    let header = [
        "model",
        "strategy",
        "ranks",
        "peak/rank",
        "opt state/rank",
        "grads/rank",
        "params/rank",
        "gathered peak/rank",
        "sent/step/rank",
    ];
    let dash = || "-".to_owned();
    let bytes = |b: Option<u64>| b.map_or_else(dash, |b| Bytes(b).to_string());
    let rows: Vec<[String; 9]> = cases
        .iter()
        .filter(|c| c.world_size.is_some())
        .map(|c| {
            [
                c.model.clone(),
                c.strategy.clone(),
                c.world_size.map_or_else(dash, |n| n.to_string()),
                bytes(c.peak_bytes),
                bytes(c.optimizer_state_bytes),
                bytes(c.gradient_bytes),
                bytes(c.parameter_bytes),
                bytes(c.gathered_peak_bytes),
                bytes(c.bytes_sent_per_step),
            ]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let _ = writeln!(out, "per rank:");
    let mut line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            let pad = " ".repeat(w - cell.chars().count());
            if i < 2 {
                text.push_str(cell);
                text.push_str(&pad);
            } else {
                text.push_str(&pad);
                text.push_str(cell);
            }
            text.push_str("  ");
        }
        let _ = writeln!(out, "{}", text.trim_end());
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
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
    fn a_nan_difference_is_diverged_not_missing() {
        let mut case = CaseResult::failed("m", "s", Status::Ok, String::new());
        assert!(!case.has_baseline && !case.grad_diverged);
        case.set_grad_diff(f64::NAN);
        assert!(case.has_baseline && case.grad_diverged);
        assert_eq!(case.grad_max_abs_diff, None);
        case.set_grad_diff(f64::INFINITY);
        assert!(case.grad_diverged);
        case.set_grad_diff(0.5);
        assert!(case.has_baseline && !case.grad_diverged);
        assert_eq!(case.grad_max_abs_diff, Some(0.5));
    }

    #[test]
    fn version_1_reports_still_parse() {
        // The shape `pytorch_suite.py` writes: no schema_version, `libtorch`, no flags.
        let v1 = r#"{"suite": "seed", "device": "cpu", "libtorch": "2.13.0", "threads": 2,
            "cases": [{"model": "m", "strategy": "baseline", "status": "ok", "error": null,
            "start_bytes": 1, "peak_bytes": 2, "retained_after_forward_bytes": 3,
            "step_time_s": {"min": 1.0, "median": 1.0, "max": 1.0},
            "grad_max_abs_diff": null, "trace": []}]}"#;
        let report = Report::from_json(v1).unwrap();
        assert_eq!(report.schema_version, 1);
        assert_eq!(report.libtorch_version, "2.13.0");
        assert!(!report.cases[0].is_baseline && !report.cases[0].grad_diverged);
        let v2: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(v2["schema_version"], 2);
        assert!(v2.get("libtorch").is_none());
        assert_eq!(v2["libtorch_version"], "2.13.0");
    }

    #[test]
    fn the_table_says_how_many_rounds_the_times_are_over() {
        let timed = |model: &str, rounds: Option<usize>| {
            let mut case = CaseResult::failed(model, "s", Status::Ok, String::new());
            case.step_time_s = StepTime::from_times(vec![1.0]);
            case.rounds = rounds;
            case
        };
        let mut report = Report {
            schema_version: SCHEMA_VERSION,
            suite: "x".into(),
            device: "cpu".into(),
            libtorch_version: "2.13.0".into(),
            threads: 2,
            cases: vec![timed("a", Some(3)), timed("b", Some(3))],
        };
        let line = "time: the median of 3 rounds; each round times every strategy of a model once, in suite order, reversed every other round";
        assert_eq!(report.rounds_line().as_deref(), Some(line));
        assert!(report.to_table().contains(line));
        // Untimed cases (failed) say nothing; distributed cases ran back to back.
        report
            .cases
            .push(CaseResult::failed("c", "s", Status::Error, "e".into()));
        assert_eq!(report.rounds_line().as_deref(), Some(line));
        report.cases.push(timed("d", None));
        let mixed = report.rounds_line().unwrap();
        assert!(mixed.starts_with("time: the median of 3 rounds; back-to-back repeats for the cases timed without rounds"), "{mixed}");
        report.cases = vec![timed("a", Some(1)), timed("b", Some(2))];
        assert!(report
            .rounds_line()
            .unwrap()
            .starts_with("time: the median of 1 round (a); the median of 2 rounds (b);"));
        report.cases.clear();
        assert_eq!(report.rounds_line(), None);
        // An older report's cases read as timed without rounds.
        let old: CaseResult = serde_json::from_str(
            r#"{"model": "m", "strategy": "s", "status": "ok",
            "error": null, "start_bytes": 1, "peak_bytes": 2, "retained_after_forward_bytes": 3,
            "step_time_s": {"min": 1.0, "median": 1.0, "max": 1.0}, "grad_max_abs_diff": null,
            "trace": []}"#,
        )
        .unwrap();
        assert_eq!(old.rounds, None);
    }

    #[test]
    fn median_is_the_upper_middle() {
        let t = StepTime::from_times(vec![3.0, 1.0, 2.0, 4.0]).unwrap();
        assert_eq!((t.min, t.median, t.max), (1.0, 3.0, 4.0));
        assert!(StepTime::from_times(Vec::new()).is_none());
    }
}
