//! Benchmark suites for memsave: describe models and memory-saving strategies in YAML
//! and measure every pair side by side.
//!
//! For each model and strategy a suite reports the exact peak memory of a training
//! step, the bytes kept for backward after the forward, the per-layer memory trace,
//! the step time and the largest gradient difference against the baseline, as a
//! table, JSON (schema version 2, see [`report`]), CSV and SVG plots. Strategies are
//! `baseline`, the seed's failing `inplace_add` and `add_out`, `safe_residual`
//! (memsave-inplace), `checkpoint` plans (memsave-checkpoint), `autocast` and
//! `grad_scaler` (memsave-amp's autocast and `GradScaler`), `accumulate`
//! (memsave-accum's `GradAccumulator`), `compress` and `offload` (memsave-hooks'
//! `Compress`, `DiskOffload` and `SaveOnCpu`, which also report `offloaded_bytes` and
//! `compressed_saved_bytes`) and named combinations of them. Each technique
//! runs through the public API of its crate, the API a user would call.
//!
//! Modules: [`suite`] (the YAML format, its limits and its validation, errors at
//! `file:line:column`), [`models`] (the networks), [`strategies`] (what a strategy
//! changes), [`step`] (one measured step), [`runner`] (the suite loop, isolation of
//! failures), [`report`] (table, JSON, CSV), [`message`] (errors as one readable
//! line), [`plot`] (SVG), [`atomic`] (atomic file writes), [`bundled`](mod@bundled) (the suites
//! shipped in the binary). The `memsave` binary is a thin layer over them.
//!
//! ```
//! use memsave_bench::{run_suite, RunOptions, Status, Suite};
//!
//! let yaml = "
//! suite: doc
//! warmup: 0
//! repeats: 1
//! models:
//!   - {name: tiny, kind: residual_linear, layers: 3, hidden: 8, batch: [4]}
//! strategies:
//!   - baseline
//!   - inplace_add
//!   - checkpoint: {every_layer: true}
//! ";
//! let suite = Suite::from_yaml(yaml, "doc.yaml")?;
//! let report = run_suite(&suite, &RunOptions::default())?;
//!
//! let baseline = &report.cases[0];
//! assert_eq!(baseline.strategy, "baseline");
//! // Every layer keeps its f32 input [4, 8] for backward: 3 * 4 * 8 * 4 bytes.
//! assert_eq!(baseline.retained_after_forward_bytes, Some(3 * 4 * 8 * 4));
//! // The seed's `x += f(x)` fails at backward; it is recorded and the suite goes on.
//! assert_eq!(report.cases[1].status, Status::Error);
//! assert_eq!(report.cases[2].strategy, "checkpoint(every_layer=true)");
//! assert_eq!(report.cases[2].grad_max_abs_diff, Some(0.0));
//! println!("{}", report.to_table());
//!
//! // Invalid suites name the place: file, line and column.
//! let err = Suite::from_yaml("suite: x\nrepeats: 0\nmodels: []\nstrategies: []\n", "bad.yaml");
//! assert!(err.unwrap_err().to_string().starts_with("bad.yaml:2:10:"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

pub mod atomic;
pub mod bundled;
pub mod distributed;
pub mod fit;
pub mod message;
pub mod models;
pub mod plot;
pub mod report;
pub mod runner;
pub mod spread;
pub mod strategies;
pub mod suite;
pub mod trace;

pub use atomic::write_atomic;
pub use bundled::{bundled, BundledSuite, BUNDLED};
pub use fit::{
    available_memory, fit_model, fit_model_with, least_memory, FitCaseError, LeastMemory,
};
pub use memsave_step::{optimizer, step};
pub use message::one_line;
pub use plot::{fit_svg, write_plots, DrawError, PlotError};
pub use report::{CaseResult, PeakPhase, Report, Status, StepTime, TraceEntry, SCHEMA_VERSION};
pub use runner::{
    availability, run_suite, run_suite_with, run_workload, selected_cases, Observer, RunError,
    RunOptions, Silent,
};
pub use spread::Rounds;
pub use strategies::{resolve, PlanChoice, ResidualUpdate, SavedTensors, StepConfig, Unavailable};
pub use suite::{
    CheckpointSpec, DeviceChoice, Dtype, FitLever, FitSpec, ModelKind, ModelSpec, ModelSpecError,
    OptimizerKind, OptimizerSpec, ScalerSpec, Size, StatePlacement, StatePrecision, StrategySpec,
    Suite, SuiteError, Technique, ZeroSpec,
};
pub use trace::{trace_case, TraceCaseError, TracedCase};
