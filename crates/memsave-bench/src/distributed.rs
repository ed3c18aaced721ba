//! Suites with `world_size: N`: every case runs on N ranks, processes on 127.0.0.1
//! started by `memsave_dist`'s launcher, each training on its 1/N of the model's batch.
//!
//! Each rank runs memsave's one step engine (`memsave_step::step::StepRun`) with data
//! parallel over the ranks' process group (`memsave_step::parallel`): a strategy
//! without `zero` runs data parallel (gradients averaged in buckets during backward,
//! `no_sync` on the micro-batches of `accumulate` before the last) with its `optimizer`
//! whole on every rank; with `zero: 1` or `zero: 2` the `optimizer` is sharded over the
//! ranks at that ZeRO stage (stage 2 reduces the gradients in buckets during backward,
//! every micro-batch); with `zero: 3` each layer of the model is a fully sharded unit
//! (`memsave_step::DataParallel::Fsdp`): every rank keeps 1/N of every weight, gathers
//! a layer's weights around its forward (and again in backward unless
//! `{zero: {stage: 3, reshard_after_forward: false}}`), reduce-scatters its gradients
//! every micro-batch, and steps the `optimizer` (if any; also `in_backward`) over its
//! shards. The zoo's networks do not say which parameters each block uses, so `zero: 3`
//! is unavailable on them. Every other technique acts on each rank as on one process:
//! `checkpoint` (a budget is solved on the rank's share), the residual updates,
//! `autocast`, `grad_scaler` (unscaled after the gradients are averaged, so every rank
//! skips the same steps), `compress`, `offload`, `accumulate`, and the optimizer's
//! `state` and `placement` (with `disk`, each rank keeps its state in a directory of its
//! own).
//!
//! Reported unavailable, with the reason, before any rank starts (decided from the
//! suite alone by the function `memsave check` uses: [`crate::availability`]): what
//! the step engine refuses under data parallel (`memsave_step::DataParallel::check`:
//! optimizer `in_backward` except with `zero: 3` and one micro-batch, `offload_grads`
//! except with `zero: 1`, `grad_scaler` with `zero`, `zero: 1` or `2` without an
//! optimizer), the harness's own searches (`auto_batch`, `fit`), `zero: 3` on a zoo
//! network, and a batch that does not divide among the ranks.
//!
//! `memsave trace` of a suite with `world_size` runs the case on its ranks the same
//! way and records rank 0's step ([`trace_on_ranks`]).
//!
//! Each rank is the program of [`RankSettings::rank_program`] (the `memsave` binary:
//! its hidden `rank` subcommand calls [`run_rank`]), which writes its figures as JSON
//! ([`RankFigures`]) to a file; the case then reports `world_size`, the largest
//! per-rank `start_bytes` and `peak_bytes`, and per rank (the largest over the ranks)
//! `optimizer_state_bytes`, `gradient_bytes` (what backward left allocated, by the
//! meter), `bytes_sent_per_step` (what the process group counted), `parameter_bytes`
//! (the parameters held between steps: every weight, or ZeRO-3's shards),
//! `gathered_peak_bytes` (ZeRO-3 only: the most full weights held at once during the
//! step), and the step's `retained_after_forward_bytes`, `offloaded_bytes` and
//! `compressed_saved_bytes`.
//! Gradients are not compared with a baseline (each rank holds its own until the step).
//!
//! The suite's `memory_limit` (or `--memory-limit`) holds on each rank, checked against
//! what each step allocated at its peak rather than enforced (see [`run_rank`]): a
//! rank above it makes the case an error that says so.
//!
//! Traps: the model's batch (its first dimension) must divide by the world size, and
//! each rank's share by `accumulate`'s micro-batches, or the case is unavailable.
//! `threads` applies to each rank: N ranks with 2 threads each use 2N cores.
use crate::models::Model;
use crate::report::{CaseResult, Status, StepTime};
use crate::strategies::{resolve, StepConfig, Unavailable};
use crate::suite::{ModelSpec, StrategySpec, Suite, Technique, ZeroSpec};
use crate::trace::Phases;
use memsave_amp::GradScaler;
use memsave_dist::{init_process_group, DistError, InitOptions, LaunchConfig, ProcessGroup};
use memsave_step::step::{StepMeasurement, StepObserver, StepRun, Unobserved};
use memsave_step::{
    Batch, CaseOptimizer, DataParallel, DataParallelHandle, DdpConfig, FsdpConfig, StepError,
    Workload, ZeroStage,
};
use memsave_trace::OptimizerRoles;
use memsave_trace::{Phase, Recorder};
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tch::Device;

/// What one rank measured in a case's last measured step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// Set when the case cannot run this way: why (then every figure is 0).
    pub unavailable: Option<String>,
    /// Allocated at the step's start (parameters, input, optimizer state).
    pub start_bytes: u64,
    /// Highest allocation during the step minus `start_bytes`.
    pub peak_bytes: u64,
    /// Allocated after the last backward (and the gradients' reduction) minus before
    /// the first forward: the gradients the rank holds when the optimizer steps.
    pub gradient_bytes: u64,
    /// Bytes of optimizer state the rank holds, when there is an optimizer.
    pub optimizer_state_bytes: Option<u64>,
    /// Bytes the rank's process group sent during the step.
    pub bytes_sent_per_step: u64,
    /// Seconds of each measured step.
    pub step_times_s: Vec<f64>,
    /// Allocated right after the forward minus `start_bytes` (the largest over the
    /// micro-batches).
    #[serde(default)]
    pub retained_after_forward_bytes: u64,
    /// Bytes the rank's offload hooks wrote, with `offload`.
    #[serde(default)]
    pub offloaded_bytes: Option<u64>,
    /// Bytes the rank's compression saved, with `compress`.
    #[serde(default)]
    pub compressed_saved_bytes: Option<u64>,
    /// Bytes of parameters the rank holds between steps: every weight (data parallel,
    /// ZeRO-1/2), or under ZeRO-3 its shard of every unit with the padding and the
    /// 4-byte zero freed weights read from (`memsave_dist::FsdpStats::parameter_bytes`).
    #[serde(default)]
    pub parameter_bytes: u64,
    /// Under ZeRO-3: the most bytes of gathered (full) weights the rank held at once
    /// during the last measured step; `None` in the other modes, which gather nothing.
    #[serde(default)]
    pub gathered_peak_bytes: Option<u64>,
    /// Set when a step's allocation (its `start_bytes` plus its peak) went above the
    /// memory limit (`memory_limit`, `--memory-limit`): what it reached, in words. The
    /// case is then an error, as on one process.
    #[serde(default)]
    pub over_memory_limit: Option<String>,
}

impl RankFigures {
    /// The figures of a rank that cannot run the case: every figure 0.
    fn unavailable(rank: usize, world_size: usize, reason: String) -> Self {
        Self {
            rank,
            world_size,
            unavailable: Some(reason),
            start_bytes: 0,
            peak_bytes: 0,
            gradient_bytes: 0,
            optimizer_state_bytes: None,
            bytes_sent_per_step: 0,
            step_times_s: Vec::new(),
            retained_after_forward_bytes: 0,
            offloaded_bytes: None,
            compressed_saved_bytes: None,
            parameter_bytes: 0,
            gathered_peak_bytes: None,
            over_memory_limit: None,
        }
    }
}

/// Why a case cannot run on ranks, decided from the suite alone, before any rank
/// starts (the check `memsave check` and the parent of the ranks make); the reason names the technique.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct RanksUnavailable {
    /// What cannot run and why.
    pub reason: String,
}

impl RanksUnavailable {
    fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

/// Why a distributed run, a rank or a traced case failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// The case cannot run on ranks (found before any rank started).
    #[error(transparent)]
    Unavailable(#[from] RanksUnavailable),
    /// The suite has no YAML source for its ranks to read.
    #[error("the suite was not parsed from YAML (Suite::from_yaml), so its ranks cannot read it")]
    NoSource,
    /// A file or directory of the run could not be made, written or read.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the path.
        what: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The launcher or the ranks failed; [`interrupted_by`](Self::interrupted_by) says
    /// whether a signal ended them.
    #[error("the ranks failed: {0}")]
    Launch(#[source] DistError),
    /// A rank could not join its group or its group failed.
    #[error("{0}")]
    Group(#[source] DistError),
    /// A rank wrote no readable figures.
    #[error("rank {rank}: no figures in {}: {source}", path.display())]
    Figures {
        /// The rank.
        rank: usize,
        /// The file it should have written.
        path: PathBuf,
        /// Why it cannot be read.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The suite has no model or strategy of the name a rank was given.
    #[error("no {what} '{name}' in the suite")]
    Unknown {
        /// `model` or `strategy`.
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// The model could not be built.
    #[error(transparent)]
    Build(#[from] crate::models::BuildError),
    /// libtorch failed outside the step (the rank's share of the batch).
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// A rank's step, or the building of its optimizer or data parallel, failed.
    #[error(transparent)]
    Step(#[from] StepError),
    /// The figures could not be written as JSON.
    #[error("rank figures: {0}")]
    Json(#[from] serde_json::Error),
    /// Recording rank 0's step failed.
    #[error(transparent)]
    Trace(#[from] memsave_trace::TraceError),
}

impl DistributedError {
    /// The signal (SIGINT, SIGTERM, SIGHUP) that interrupted the launcher, which sent
    /// it on to every rank and ended them: the caller should end too, with 128 + the
    /// signal as shells do, rather than go on to its next case.
    pub fn interrupted_by(&self) -> Option<i32> {
        match self {
            DistributedError::Launch(DistError::Interrupted { signal, .. }) => Some(*signal),
            _ => None,
        }
    }

    fn io(what: String) -> impl FnOnce(std::io::Error) -> DistributedError {
        move |source| DistributedError::Io { what, source }
    }
}

/// How the ranks of a distributed run measure: the run's overrides of the suite's
/// settings, and the program of a rank.
#[derive(Debug, Clone, Default)]
pub struct RankSettings {
    /// Warm-up steps instead of the suite's.
    pub warmup: Option<usize>,
    /// Measured steps instead of the suite's.
    pub repeats: Option<usize>,
    /// libtorch threads (per rank) instead of the suite's.
    pub threads: Option<usize>,
    /// The program whose hidden `rank` subcommand runs one rank (default: this
    /// process's executable, which must then be the `memsave` binary).
    pub rank_program: Option<PathBuf>,
    /// Memory limit in bytes instead of the suite's `memory_limit` (see [`run_rank`]).
    pub memory_limit: Option<u64>,
}

/// A point of a distributed run, told to the caller's progress.
#[derive(Debug)]
pub enum CaseEvent<'a> {
    /// The run is about to start `total` cases.
    Started {
        /// Cases in the run.
        total: usize,
    },
    /// A case begins.
    CaseStarted {
        /// The model's name.
        model: &'a str,
        /// The strategy's name.
        strategy: &'a str,
    },
    /// A case ended (in any status).
    CaseFinished(&'a CaseResult),
}

/// Runs the `selected` cases of `suite` on `world_size` ranks each, telling `progress`.
///
/// # Errors
/// When the run cannot start (no program, no temporary directory), and
/// [`DistributedError::Launch`] when a signal interrupted a case's ranks (see
/// [`DistributedError::interrupted_by`]): the run ends there. Any other failure of a
/// case is that case's `error`, and the run goes on.
pub(crate) fn run_cases(
    suite: &Suite,
    selected: &[(&ModelSpec, Vec<&StrategySpec>)],
    settings: &RankSettings,
    world_size: usize,
    progress: &mut dyn FnMut(CaseEvent<'_>),
) -> Result<Vec<CaseResult>, DistributedError> {
    let program = rank_program(settings.rank_program.as_deref())?;
    let (dir, suite_file) = suite_for_ranks(suite)?;
    progress(CaseEvent::Started {
        total: selected.iter().map(|(_, s)| s.len()).sum(),
    });
    let ranks = Ranks {
        program: &program,
        suite_file: &suite_file,
        dir: dir.path(),
        settings,
        world_size,
    };
    let mut cases = Vec::new();
    for (model, strategies) in selected {
        for strategy in strategies {
            progress(CaseEvent::CaseStarted {
                model: &model.name,
                strategy: &strategy.name,
            });
            let mut case = match ranks.run_case(model, strategy) {
                Ok(case) => case,
                Err(e) if e.interrupted_by().is_some() => return Err(e),
                Err(DistributedError::Unavailable(why)) => {
                    CaseResult::failed(&model.name, &strategy.name, Status::Unavailable, why.reason)
                }
                Err(e) => {
                    CaseResult::failed(&model.name, &strategy.name, Status::Error, e.to_string())
                }
            };
            case.is_baseline = strategy.is_baseline();
            case.world_size = Some(world_size);
            progress(CaseEvent::CaseFinished(&case));
            cases.push(case);
        }
    }
    Ok(cases)
}

/// What every case of a distributed run launches with.
struct Ranks<'r> {
    program: &'r Path,
    suite_file: &'r Path,
    dir: &'r Path,
    settings: &'r RankSettings,
    world_size: usize,
}

impl Ranks<'_> {
    /// One case on the ranks: refused before they start when [`rank_config`] refuses
    /// it, else their figures combined.
    fn run_case(
        &self,
        model: &ModelSpec,
        strategy: &StrategySpec,
    ) -> Result<CaseResult, DistributedError> {
        rank_config(model, strategy, self.world_size)?;
        let out = self.dir.join(format!("case-{}", unique()));
        std::fs::create_dir_all(&out).map_err(DistributedError::io(format!(
            "cannot make {}",
            out.display()
        )))?;
        let mut args = rank_args(self.suite_file, &model.name, &strategy.name, &out);
        let text = |v: Option<usize>| v.map(|v| v.to_string());
        for (flag, value) in [
            ("--warmup", text(self.settings.warmup)),
            ("--repeats", text(self.settings.repeats)),
            ("--threads", text(self.settings.threads)),
            (
                "--memory-limit",
                self.settings.memory_limit.map(|b| b.to_string()),
            ),
        ] {
            if let Some(v) = value {
                args.push(flag.into());
                args.push(v.into());
            }
        }
        launch_ranks(self.program, &args, self.world_size)?;
        let ranks = (0..self.world_size)
            .map(|rank| read_figures(&out, rank))
            .collect::<Result<Vec<_>, _>>()?;
        let _ = std::fs::remove_dir_all(&out);
        if let Some(reason) = ranks.iter().find_map(|r| r.unavailable.clone()) {
            return Err(RanksUnavailable::new(reason).into());
        }
        if let Some(over) = ranks.iter().find_map(|r| r.over_memory_limit.clone()) {
            return Ok(CaseResult::failed(
                &model.name,
                &strategy.name,
                Status::Error,
                over,
            ));
        }
        Ok(combine(&model.name, &strategy.name, &ranks))
    }
}

/// The figures rank `rank` wrote in `out`.
fn read_figures(out: &Path, rank: usize) -> Result<RankFigures, DistributedError> {
    let path = out.join(format!("rank{rank}.json"));
    let figures = std::fs::read_to_string(&path)
        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        .and_then(|text| serde_json::from_str::<RankFigures>(&text).map_err(|e| e.into()));
    figures.map_err(|source| DistributedError::Figures { rank, path, source })
}

/// The case's figures from its ranks': the largest over the ranks, and each step's
/// time that of its slowest rank.
fn combine(model: &str, strategy: &str, ranks: &[RankFigures]) -> CaseResult {
    let max = |f: fn(&RankFigures) -> u64| ranks.iter().map(f).max();
    let max_some = |f: fn(&RankFigures) -> Option<u64>| ranks.iter().filter_map(f).max();
    let mut case = CaseResult::failed(model, strategy, Status::Ok, String::new());
    case.error = None;
    case.start_bytes = max(|r| r.start_bytes);
    case.peak_bytes = max(|r| r.peak_bytes);
    case.retained_after_forward_bytes = max(|r| r.retained_after_forward_bytes);
    case.gradient_bytes = max(|r| r.gradient_bytes);
    case.bytes_sent_per_step = max(|r| r.bytes_sent_per_step);
    case.optimizer_state_bytes = max_some(|r| r.optimizer_state_bytes);
    case.offloaded_bytes = max_some(|r| r.offloaded_bytes);
    case.compressed_saved_bytes = max_some(|r| r.compressed_saved_bytes);
    case.parameter_bytes = max(|r| r.parameter_bytes);
    case.gathered_peak_bytes = max_some(|r| r.gathered_peak_bytes);
    // The slowest rank sets the pace of each step.
    let repeats = ranks
        .iter()
        .map(|r| r.step_times_s.len())
        .min()
        .unwrap_or(0);
    let times: Vec<f64> = (0..repeats)
        .map(|i| ranks.iter().map(|r| r.step_times_s[i]).fold(0.0, f64::max))
        .collect();
    case.step_time_s = StepTime::from_times(times);
    case
}

/// The program whose hidden `rank` subcommand runs one rank: `given`, or this
/// process's executable (which must then be the `memsave` binary).
pub(crate) fn rank_program(given: Option<&Path>) -> Result<PathBuf, DistributedError> {
    match given {
        Some(p) => Ok(p.to_path_buf()),
        None => std::env::current_exe()
            .map_err(DistributedError::io("cannot find this executable".into())),
    }
}

/// A temporary directory holding the suite's YAML as `suite.yaml`, for its ranks to
/// read (removed when the directory is dropped).
pub(crate) fn suite_for_ranks(
    suite: &Suite,
) -> Result<(tempfile::TempDir, PathBuf), DistributedError> {
    let source = suite.source.as_deref().ok_or(DistributedError::NoSource)?;
    let dir = tempfile::Builder::new()
        .prefix("memsave-distributed-")
        .tempdir()
        .map_err(DistributedError::io(
            "cannot make a temporary directory".into(),
        ))?;
    let suite_file = dir.path().join("suite.yaml");
    std::fs::write(&suite_file, source).map_err(DistributedError::io(format!(
        "cannot write {}",
        suite_file.display()
    )))?;
    Ok((dir, suite_file))
}

/// The arguments of `memsave rank` for one case, writing into `out`.
fn rank_args(suite_file: &Path, model: &str, strategy: &str, out: &Path) -> Vec<OsString> {
    vec![
        "rank".into(),
        suite_file.into(),
        "--model".into(),
        model.into(),
        "--strategy".into(),
        strategy.into(),
        "--out-dir".into(),
        out.into(),
    ]
}

/// Starts `world_size` ranks of `program args` on this machine and waits for them
/// (at most ten minutes).
///
/// A SIGINT, SIGTERM or SIGHUP while they run ends the ranks (the launcher passes it
/// on); the error then says so ([`DistributedError::interrupted_by`]), so that the
/// caller ends too, with 128 + the signal's number as shells do: a run the user
/// interrupted does not go on to its next case.
pub(crate) fn launch_ranks(
    program: &Path,
    args: &[OsString],
    world_size: usize,
) -> Result<(), DistributedError> {
    let config = LaunchConfig {
        nproc_per_node: world_size,
        timeout: Some(Duration::from_secs(600)),
        ..Default::default()
    };
    memsave_dist::launch(&config, program.as_os_str(), args).map_err(DistributedError::Launch)
}

fn unique() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed).to_string()
}

/// What a rank is asked to run (the hidden `memsave rank` subcommand's arguments).
#[derive(Debug, Clone)]
pub struct RankArgs {
    /// The model's name in the suite.
    pub model: String,
    /// The strategy's name in the suite.
    pub strategy: String,
    /// Where to write `rank{RANK}.json`.
    pub out_dir: PathBuf,
    /// Warm-up steps instead of the suite's.
    pub warmup: Option<usize>,
    /// Measured steps instead of the suite's.
    pub repeats: Option<usize>,
    /// libtorch threads instead of the suite's.
    pub threads: Option<usize>,
    /// Memory limit in bytes instead of the suite's `memory_limit`.
    pub memory_limit: Option<u64>,
    /// Record one step instead of measuring (`memsave trace` of a case with
    /// `world_size`): see [`RankTrace`].
    pub trace: Option<RankTrace>,
}

/// What `memsave trace` asks of the ranks of a case: each runs the suite's warm-up
/// steps and one more step, which rank 0 records allocation by allocation and writes
/// to the output directory as `trace-summary.txt` (the summary with the `top` largest
/// tensors), and as asked `trace.html`, `trace.pickle` (PyTorch's snapshot) and
/// `trace.svg`; with `trace-step-error.txt` when the recorded step failed.
#[derive(Debug, Clone)]
pub struct RankTrace {
    /// How many of the largest tensors at the peak to list.
    pub top: usize,
    /// The HTML page's title.
    pub title: String,
    /// Write `trace.html`.
    pub html: bool,
    /// Write `trace.pickle`.
    pub snapshot: bool,
    /// Write `trace.svg`.
    pub svg: bool,
}

/// Runs one case of `suite` as the rank the environment names (`RANK`, `WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`, set by the launcher) and writes its
/// [`RankFigures`] to `rank{RANK}.json` in `args.out_dir`.
///
/// The memory limit (`args.memory_limit`, else the suite's `memory_limit`) is checked
/// against what each step allocated at its peak (its `start_bytes` plus its
/// `peak_bytes`), not enforced as a simulated capacity: an allocation failing on one
/// rank would leave the others waiting in a collective of the step. A rank over it
/// says so in its figures ([`RankFigures::over_memory_limit`]) and the case is an
/// error, as a step out of memory is on one process.
pub fn run_rank(suite: &Suite, args: &RankArgs) -> Result<(), DistributedError> {
    memsave_meter::install();
    if let Some(n) = args.threads.or(suite.threads) {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let group = init_process_group(&options).map_err(DistributedError::Group)?;
    let (rank, world_size) = (group.rank(), group.world_size());
    let unknown = |what, name: &str| DistributedError::Unknown {
        what,
        name: name.to_owned(),
    };
    let model = suite
        .models
        .iter()
        .find(|m| m.name == args.model)
        .ok_or_else(|| unknown("model", &args.model))?;
    let strategy = suite
        .strategies
        .iter()
        .find(|s| s.name == args.strategy)
        .ok_or_else(|| unknown("strategy", &args.strategy))?;
    let warmup = args.warmup.unwrap_or(suite.warmup);
    let repeats = args.repeats.unwrap_or(suite.repeats).max(1);
    if let Some(request) = &args.trace {
        let case = RankCase::build(&group, suite.seed, model, strategy)?;
        return trace_rank(&group, case, warmup, request, &args.out_dir);
    }
    let figures = match RankCase::build(&group, suite.seed, model, strategy) {
        Ok(case) => {
            let limit = args
                .memory_limit
                .or(suite.memory_limit.as_ref().map(|l| l.bytes));
            measure(&group, case, warmup, repeats, limit)?
        }
        Err(DistributedError::Unavailable(why)) => {
            RankFigures::unavailable(rank, world_size, why.reason)
        }
        Err(e) => return Err(e),
    };
    let path = args.out_dir.join(format!("rank{rank}.json"));
    let text = serde_json::to_string(&figures)?;
    std::fs::write(&path, text).map_err(DistributedError::io(format!("writing {}", path.display())))
}

/// The rank's side of `memsave trace` (see [`RankTrace`]).
fn trace_rank(
    group: &ProcessGroup,
    mut case: RankCase,
    warmup: usize,
    request: &RankTrace,
    out_dir: &Path,
) -> Result<(), DistributedError> {
    for _ in 0..warmup {
        case.step(&Unobserved)?;
    }
    if group.rank() != 0 {
        case.step(&Unobserved)?;
        return Ok(());
    }
    let state = case
        .optimizer
        .as_ref()
        .map(CaseOptimizer::state_tensors)
        .unwrap_or_default();
    // ZeRO-3's shards are the parameters this rank holds (the model's read from a
    // shared zero between gathers).
    let mut params = case.model.parameters();
    params.extend(
        case.data_parallel
            .fsdp()
            .map(|f| f.parameters())
            .unwrap_or_default(),
    );
    let (step, trace) = Recorder::new(Device::Cpu)
        .parameters(&params)
        .inputs(&[case.local.input.shallow_clone()])
        .optimizer_state(&state)
        .record(|session| {
            let backward = Arc::new(std::sync::atomic::AtomicBool::new(false));
            case.model
                .ctx
                .set_block_observer(Some(crate::trace::block_observer(
                    session,
                    backward.clone(),
                )));
            if let Some(o) = case.optimizer.as_mut() {
                o.set_observer(Some(Arc::new(OptimizerRoles(session.clone()))));
            }
            let phases = Phases {
                session,
                params: params.iter().map(|p| p.shallow_clone()).collect(),
                backward,
            };
            let step = case.step(&phases);
            case.model.ctx.set_block_observer(None);
            if let Some(o) = case.optimizer.as_mut() {
                o.set_observer(None);
                session.optimizer_state(&o.state_tensors());
            }
            session.phase(Phase::Other);
            step
        })?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out_dir.join(name);
        std::fs::write(&path, bytes)
            .map_err(DistributedError::io(format!("writing {}", path.display())))
    };
    write("trace-summary.txt", trace.summary(request.top).as_bytes())?;
    if request.html {
        write(
            "trace.html",
            trace.to_html(&request.title, request.top).as_bytes(),
        )?;
    }
    if request.snapshot {
        write("trace.pickle", &trace.to_snapshot_pickle()?)?;
    }
    if request.svg {
        write("trace.svg", trace.timeline_svg().as_bytes())?;
    }
    if let Err(e) = step {
        write("trace-step-error.txt", e.to_string().as_bytes())?;
    }
    Ok(())
}

/// A case recorded on its ranks by [`trace_on_ranks`]: rank 0's trace, as written.
#[derive(Debug, Clone)]
pub struct RanksTrace {
    /// The ranks the case ran on.
    pub world_size: usize,
    /// Rank 0's summary, with the largest tensors at its peak.
    pub summary: String,
    /// The HTML page, if asked.
    pub html: Option<String>,
    /// PyTorch's memory snapshot (pickle), if asked.
    pub snapshot: Option<Vec<u8>>,
    /// The timeline as SVG, if asked.
    pub svg: Option<String>,
    /// The recorded step's error on rank 0, if it failed.
    pub step_error: Option<String>,
}

/// Records one step of `model` under `strategy` on `world_size` ranks (processes of
/// `rank_program`, default this executable, which must be the `memsave` binary), as
/// `memsave trace` does for a suite with `world_size`: rank 0's step is recorded after
/// the suite's warm-up steps. A case the ranks cannot run (see
/// [`crate::availability`]) is [`DistributedError::Unavailable`], found before any rank
/// starts.
pub fn trace_on_ranks(
    suite: &Suite,
    model: &ModelSpec,
    strategy: &StrategySpec,
    world_size: usize,
    request: &RankTrace,
    rank_program: Option<&Path>,
) -> Result<RanksTrace, DistributedError> {
    rank_config(model, strategy, world_size)?;
    let program = self::rank_program(rank_program)?;
    let (dir, suite_file) = suite_for_ranks(suite)?;
    let out = dir.path().join("trace");
    std::fs::create_dir_all(&out).map_err(DistributedError::io(format!(
        "cannot make {}",
        out.display()
    )))?;
    let mut args = rank_args(&suite_file, &model.name, &strategy.name, &out);
    args.extend(["--trace-top".into(), request.top.to_string().into()]);
    args.extend(["--trace-title".into(), request.title.clone().into()]);
    for (flag, on) in [
        ("--trace-html", request.html),
        ("--trace-snapshot", request.snapshot),
        ("--trace-svg", request.svg),
    ] {
        if on {
            args.push(flag.into());
        }
    }
    launch_ranks(&program, &args, world_size)?;
    let read = |name: &str| -> Result<Vec<u8>, DistributedError> {
        let path = out.join(name);
        std::fs::read(&path).map_err(DistributedError::io(format!(
            "rank 0 wrote no {}",
            path.display()
        )))
    };
    let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    let step_error = out
        .join("trace-step-error.txt")
        .exists()
        .then(|| read("trace-step-error.txt").map(text))
        .transpose()?;
    Ok(RanksTrace {
        world_size,
        summary: text(read("trace-summary.txt")?),
        html: request
            .html
            .then(|| read("trace.html").map(text))
            .transpose()?,
        snapshot: request.snapshot.then(|| read("trace.pickle")).transpose()?,
        svg: request
            .svg
            .then(|| read("trace.svg").map(text))
            .transpose()?,
        step_error,
    })
}

/// Techniques of the harness itself, which have no step to run on ranks, and why.
fn harness_only(technique: &Technique) -> Option<&'static str> {
    match technique {
        Technique::AutoBatch(_) => Some("auto_batch is not supported with world_size: it searches for a batch that fits one process, by halving the batch on each out-of-memory error"),
        Technique::Fit(_) => Some("fit is not supported with world_size: it plans and measures its candidates on one process"),
        _ => None,
    }
}

/// Why ZeRO-3 cannot shard a zoo network, if it cannot: its units are the layers of a
/// chain or the top-level blocks of a network of blocks, each with parameters of its
/// own (found by running each: `CheckpointedSequential::f_layer_parameters`,
/// `Blocks::f_block_parameters`).
fn zero3_refuses(architecture: &memsave_models::Architecture) -> Option<&'static str> {
    use memsave_models::Architecture;
    match architecture {
        Architecture::Llama(c) if c.tied => Some(
            "ties its output head to the embedding: one weight in the first and the last layer, and a unit shards each weight once",
        ),
        _ => None,
    }
}

/// The step every rank of a case runs and how the ranks share it, or why `strategy`
/// cannot run on `model` over `world_size` ranks (the case is then `unavailable`). It
/// reads only the suite, so `memsave check` and the parent of the ranks decide as the
/// ranks do, before any rank starts.
pub(crate) fn rank_config(
    model: &ModelSpec,
    strategy: &StrategySpec,
    world_size: usize,
) -> Result<(StepConfig, DataParallel), RanksUnavailable> {
    let n = world_size.max(1);
    if let Some(reason) = strategy.techniques.iter().find_map(harness_only) {
        return Err(RanksUnavailable::new(reason));
    }
    let mode = strategy
        .techniques
        .iter()
        .find_map(|t| match t {
            Technique::Zero(ZeroSpec { stage: 1, .. }) => Some(DataParallel::Zero(ZeroStage::One)),
            Technique::Zero(ZeroSpec { stage: 2, .. }) => Some(DataParallel::Zero(ZeroStage::Two)),
            Technique::Zero(spec) => Some(DataParallel::Fsdp(FsdpConfig {
                reshard_after_forward: spec.reshard_after_forward,
                ..FsdpConfig::default()
            })),
            _ => None,
        })
        .or_else(|| {
            // The parameters in files: ZeRO-3 with its shards in files, on every rank
            // (a group of one on one process).
            let in_files = strategy
                .techniques
                .iter()
                .any(|t| matches!(t, Technique::OffloadParams));
            in_files.then(|| DataParallel::Fsdp(FsdpConfig::default()))
        })
        .unwrap_or(DataParallel::Ddp(DdpConfig::default()));
    if matches!(mode, DataParallel::Fsdp(_)) {
        if let Some(reason) = model.kind.architecture().and_then(zero3_refuses) {
            return Err(RanksUnavailable::new(format!(
                "zero: 3 shards one unit per layer (or block), but the model '{}' ({}) {reason}; use zero: 2",
                model.name,
                model.kind.as_str()
            )));
        }
    }
    let rest = StrategySpec {
        name: strategy.name.clone(),
        techniques: strategy
            .techniques
            .iter()
            .filter(|t| !matches!(t, Technique::Zero(_)))
            .cloned()
            .collect(),
    };
    let config = match resolve(&rest) {
        // Its advice, offload_grads, runs on ranks only under zero: 1, which refuses
        // in_backward: the mode's own refusal (checked with one micro-batch) says what
        // works on ranks.
        Err(Unavailable::InBackwardWithAccumulation) => {
            let mut one = rest.clone();
            one.techniques
                .retain(|t| !matches!(t, Technique::Accumulate { .. }));
            let mut config = resolve(&one).map_err(|e| RanksUnavailable::new(e.to_string()))?;
            config.micro_batches = Some(2);
            return Err(RanksUnavailable::new(match mode.check(&config) {
                Err(StepError::InvalidConfig(reason)) => reason,
                _ => Unavailable::InBackwardWithAccumulation.to_string(),
            }));
        }
        other => other.map_err(|e| RanksUnavailable::new(e.to_string()))?,
    };
    crate::models::residual_available(model, config.residual)
        .map_err(|e| RanksUnavailable::new(e.to_string()))?;
    let mode = mode.with_params_in_files(config.offload_params.is_some());
    mode.check(&config).map_err(|e| match e {
        StepError::InvalidConfig(reason) => RanksUnavailable::new(reason),
        other => RanksUnavailable::new(other.to_string()),
    })?;
    let global = model.batch.first().copied().unwrap_or(0);
    if global % n as i64 != 0 {
        return Err(RanksUnavailable::new(format!(
            "the batch of {global} examples does not divide by world_size {n}"
        )));
    }
    let local_len = global / n as i64;
    let micro = config.micro_batches.unwrap_or(1) as i64;
    if local_len % micro != 0 {
        return Err(RanksUnavailable::new(format!(
            "a rank's {local_len} examples do not divide into {micro} micro-batches"
        )));
    }
    Ok((config, mode))
}

/// The case's warm-up and measured steps on this rank; the figures of the last, and
/// whether any step went above `limit` (see [`run_rank`]).
fn measure(
    group: &ProcessGroup,
    mut case: RankCase,
    warmup: usize,
    repeats: usize,
    limit: Option<u64>,
) -> Result<RankFigures, DistributedError> {
    let mut last: Option<StepMeasurement> = None;
    let mut times = Vec::with_capacity(repeats);
    let mut reached = 0;
    for i in 0..warmup + repeats {
        let step = case.step(&Unobserved)?;
        reached = reached.max(step.start_bytes + step.peak_bytes);
        if i >= warmup {
            times.push(step.time_s);
            last = Some(step);
        }
    }
    let mut figures = RankFigures::unavailable(group.rank(), group.world_size(), String::new());
    figures.unavailable = None;
    figures.over_memory_limit = limit.filter(|&l| reached > l).map(|l| {
        format!(
            "out of memory: rank {} allocated {} at its step's peak, above the memory limit of {} (on ranks the limit is checked against each step's peak, not enforced)",
            group.rank(),
            memsave_meter::Bytes(reached),
            memsave_meter::Bytes(l)
        )
    });
    if let Some(last) = last {
        figures.start_bytes = last.start_bytes;
        figures.peak_bytes = last.peak_bytes;
        figures.retained_after_forward_bytes = last.retained_after_forward_bytes;
        figures.gradient_bytes = last.after_backward_bytes;
        figures.bytes_sent_per_step = last.bytes_sent.unwrap_or(0);
        figures.offloaded_bytes = last.offloaded_bytes;
        figures.compressed_saved_bytes = last.compressed_saved_bytes;
    }
    figures.optimizer_state_bytes = case.optimizer.as_ref().map(CaseOptimizer::state_bytes);
    let fsdp = case.data_parallel.fsdp_stats();
    figures.parameter_bytes = match fsdp {
        Some(stats) => stats.parameter_bytes,
        None => case
            .model
            .parameters()
            .iter()
            .map(memsave_sys::tensor::nbytes)
            .sum(),
    };
    figures.gathered_peak_bytes = fsdp.map(|stats| stats.gathered_peak_bytes);
    figures.step_times_s = times;
    Ok(figures)
}

/// One rank's side of a case, built: the model with its plan, the rank's share of the
/// batch, the step's configuration, data parallel over the group, and the scaler and
/// optimizer (whole, or this rank's ZeRO shard).
struct RankCase {
    model: Model,
    local: Batch,
    config: StepConfig,
    scaler: Option<GradScaler>,
    optimizer: Option<CaseOptimizer>,
    data_parallel: DataParallelHandle,
}

impl Drop for RankCase {
    /// A case's model is thrown away: under ZeRO-3 its weights go without a word.
    fn drop(&mut self) {
        self.data_parallel.discard();
    }
}

impl RankCase {
    fn build(
        group: &ProcessGroup,
        seed: u64,
        spec: &ModelSpec,
        strategy: &StrategySpec,
    ) -> Result<RankCase, DistributedError> {
        let (rank, n) = (group.rank(), group.world_size());
        let (config, mode) = rank_config(spec, strategy, n)?;
        let device = Device::Cpu;
        tch::manual_seed(seed as i64);
        let mut model = Model::build(spec, device)?;
        let global = model.global_batch();
        let local_len = global / n as i64;
        let local = model
            .batch(global)?
            .f_narrow(rank as i64 * local_len, local_len)?;
        memsave_step::plan::apply_plan(&mut model, &local, &config, device)?;
        if !model.set_residual(config.residual) {
            return Err(RanksUnavailable::new(format!(
                "the model has no residual blocks for {:?}",
                config.residual
            ))
            .into());
        }
        let params = model.parameters();
        let data_parallel = DataParallelHandle::for_workload(group, mode, &model)?;
        // The case's model is thrown away if what follows fails: under ZeRO-3 its
        // weights go without a word.
        let discarding = |e| {
            data_parallel.discard();
            e
        };
        let optimizer = config
            .optimizer
            .map(|o| data_parallel.optimizer(&o, &params))
            .transpose()
            .map_err(discarding)?;
        let scaler = config
            .scaler
            .map(GradScaler::new)
            .transpose()
            .map_err(|e| discarding(StepError::lever("grad_scaler", e)))?;
        Ok(RankCase {
            model,
            local,
            config,
            scaler,
            optimizer,
            data_parallel,
        })
    }

    /// One step of the rank's share through memsave's step engine, told to
    /// `observer`.
    fn step(&mut self, observer: &dyn StepObserver) -> Result<StepMeasurement, StepError> {
        StepRun::new(Device::Cpu)
            .scaler(self.scaler.as_mut())
            .optimizer(self.optimizer.as_mut())
            .observer(observer)
            .data_parallel(Some(&self.data_parallel))
            .f_step(&self.model, &self.local, &self.config)
    }
}
