//! Suites with `world_size: N`: every case runs on N ranks, processes on 127.0.0.1
//! started by `memsave_dist`'s launcher, each training on its 1/N of the model's batch.
//!
//! A strategy without `zero` runs data parallel (`memsave_dist::DistributedDataParallel`,
//! gradients averaged in buckets during backward, `no_sync` on the micro-batches of
//! `accumulate` before the last) with its `optimizer` on every rank. With `zero: 1` or
//! `zero: 2` the `optimizer` is a `memsave_dist::ZeroOptimizer` of that stage (stage 2
//! reduces the gradients in buckets during backward, every micro-batch). `checkpoint`
//! and the residual updates apply on every rank as on one process, and so does the
//! optimizer's `placement` (with `disk`, each rank keeps its state in a directory of its
//! own); `autocast`, `grad_scaler`, `compress`, `offload`, `in_backward` are reported
//! unavailable under `world_size` (decided from the suite alone, before any rank
//! starts, by the function `memsave check` uses: [`crate::availability`]).
//!
//! `memsave trace` of a suite with `world_size` runs the case on its ranks the same
//! way and records rank 0's step ([`trace_on_ranks`]).
//!
//! Each rank is the program of [`RunOptions::rank_program`] (the `memsave` binary: its
//! hidden `rank` subcommand calls [`run_rank`]), which writes its figures as JSON
//! ([`RankFigures`]) to a file; the case then reports `world_size`, the largest
//! per-rank `start_bytes` and `peak_bytes`, and per rank (the largest over the ranks)
//! `optimizer_state_bytes`, `gradient_bytes` (what backward left allocated, by the
//! meter) and `bytes_sent_per_step` (what the process group counted). Gradients are not
//! compared with a baseline (each rank holds its own until the step).
//!
//! Traps: the model's batch (its first dimension) must divide by the world size, and
//! each rank's share by `accumulate`'s micro-batches, or the case is unavailable.
//! `threads` applies to each rank: N ranks with 2 threads each use 2N cores.
use crate::models::Model;
use crate::report::{CaseResult, Status, StepTime};
use crate::runner::{apply_plan, selected_cases, Observer, RunError, RunOptions};
use crate::strategies::{resolve, StepConfig};
use crate::suite::{ModelSpec, StrategySpec, Suite, Technique};
use memsave_dist::{
    init_process_group, DdpConfig, DistributedDataParallel, InitOptions, LaunchConfig,
    ProcessGroup, ZeroOptimizer, ZeroStage,
};
use memsave_meter::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
use memsave_optim::{AdamW, Optimizer, Rule, Sgd};
use memsave_step::levers::OptimizerRule;
use memsave_step::{Batch, OptimizerSpec, StatePlacement, Workload};
use memsave_trace::{Phase, Recorder, Session};
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Tensor};

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
    /// Allocated after the last backward minus before the first forward: the
    /// gradients the rank holds when the optimizer steps.
    pub gradient_bytes: u64,
    /// Bytes of optimizer state the rank holds, when there is an optimizer.
    pub optimizer_state_bytes: Option<u64>,
    /// Bytes the rank's process group sent during the step.
    pub bytes_sent_per_step: u64,
    /// Seconds of each measured step.
    pub step_times_s: Vec<f64>,
}

/// Runs every selected case of `suite` on `world_size` ranks.
pub(crate) fn run_cases(
    suite: &Suite,
    options: &RunOptions,
    world_size: usize,
    observer: &mut dyn Observer,
) -> Result<Vec<CaseResult>, RunError> {
    let program = rank_program(options.rank_program.as_deref()).map_err(RunError::Distributed)?;
    let (dir, suite_file) = suite_for_ranks(suite).map_err(RunError::Distributed)?;
    let selected = selected_cases(suite, options);
    observer.started(selected.iter().map(|(_, s)| s.len()).sum());
    let mut cases = Vec::new();
    for (model, strategies) in selected {
        for strategy in strategies {
            observer.case_started(&model.name, &strategy.name);
            let mut case = run_case(
                &program,
                &suite_file,
                dir.path(),
                model,
                strategy,
                options,
                world_size,
            );
            case.is_baseline = strategy.is_baseline();
            case.world_size = Some(world_size);
            observer.case_finished(&case);
            cases.push(case);
        }
    }
    Ok(cases)
}

fn run_case(
    program: &Path,
    suite_file: &Path,
    dir: &Path,
    model: &ModelSpec,
    strategy: &StrategySpec,
    options: &RunOptions,
    world_size: usize,
) -> CaseResult {
    let failed =
        |status, error: String| CaseResult::failed(&model.name, &strategy.name, status, error);
    // Decided here as the ranks decide it, without starting them.
    if let Err(reason) = rank_config(model, strategy, world_size) {
        return failed(Status::Unavailable, reason);
    }
    let out = dir.join(format!("case-{}", unique()));
    if let Err(e) = std::fs::create_dir_all(&out) {
        return failed(Status::Error, format!("cannot make {}: {e}", out.display()));
    }
    let mut args = rank_args(suite_file, &model.name, &strategy.name, &out);
    for (flag, value) in [
        ("--warmup", options.warmup),
        ("--repeats", options.repeats),
        ("--threads", options.threads),
    ] {
        if let Some(v) = value {
            args.push(flag.into());
            args.push(v.to_string().into());
        }
    }
    if let Err(e) = launch_ranks(program, &args, world_size) {
        return failed(Status::Error, format!("the ranks failed: {e}"));
    }
    let mut ranks = Vec::with_capacity(world_size);
    for rank in 0..world_size {
        let path = out.join(format!("rank{rank}.json"));
        let figures = std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|text| serde_json::from_str::<RankFigures>(&text).map_err(|e| e.to_string()));
        match figures {
            Ok(f) => ranks.push(f),
            Err(e) => {
                return failed(
                    Status::Error,
                    format!("rank {rank}: no figures in {}: {e}", path.display()),
                )
            }
        }
    }
    let _ = std::fs::remove_dir_all(&out);
    if let Some(reason) = ranks.iter().find_map(|r| r.unavailable.clone()) {
        return failed(Status::Unavailable, reason);
    }
    let max = |f: fn(&RankFigures) -> u64| ranks.iter().map(f).max();
    let mut case = failed(Status::Ok, String::new());
    case.error = None;
    case.start_bytes = max(|r| r.start_bytes);
    case.peak_bytes = max(|r| r.peak_bytes);
    case.gradient_bytes = max(|r| r.gradient_bytes);
    case.bytes_sent_per_step = max(|r| r.bytes_sent_per_step);
    case.optimizer_state_bytes = ranks.iter().filter_map(|r| r.optimizer_state_bytes).max();
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
pub(crate) fn rank_program(given: Option<&Path>) -> Result<PathBuf, String> {
    match given {
        Some(p) => Ok(p.to_path_buf()),
        None => std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}")),
    }
}

/// A temporary directory holding the suite's YAML as `suite.yaml`, for its ranks to
/// read (removed when the directory is dropped).
pub(crate) fn suite_for_ranks(suite: &Suite) -> Result<(tempfile::TempDir, PathBuf), String> {
    let source = suite.source.as_deref().ok_or(
        "the suite was not parsed from YAML (Suite::from_yaml), so its ranks cannot read it",
    )?;
    let dir = tempfile::Builder::new()
        .prefix("memsave-distributed-")
        .tempdir()
        .map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let suite_file = dir.path().join("suite.yaml");
    std::fs::write(&suite_file, source)
        .map_err(|e| format!("cannot write {}: {e}", suite_file.display()))?;
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
/// on) and then this process, with 128 + the signal's number as shells do: a run the
/// user interrupted does not go on to its next case.
fn launch_ranks(program: &Path, args: &[OsString], world_size: usize) -> Result<(), String> {
    let config = LaunchConfig {
        nproc_per_node: world_size,
        timeout: Some(Duration::from_secs(600)),
        ..Default::default()
    };
    match memsave_dist::launch(&config, program.as_os_str(), args) {
        Ok(()) => Ok(()),
        Err(e @ memsave_dist::DistError::Interrupted { signal, .. }) => {
            eprintln!("error: {e}");
            std::process::exit(128 + signal)
        }
        Err(e) => Err(e.to_string()),
    }
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
pub fn run_rank(suite: &Suite, args: &RankArgs) -> Result<(), String> {
    memsave_meter::install();
    if let Some(n) = args.threads.or(suite.threads) {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let group = init_process_group(&options).map_err(|e| e.to_string())?;
    let (rank, world_size) = (group.rank(), group.world_size());
    let model = suite
        .models
        .iter()
        .find(|m| m.name == args.model)
        .ok_or_else(|| format!("no model '{}' in the suite", args.model))?;
    let strategy = suite
        .strategies
        .iter()
        .find(|s| s.name == args.strategy)
        .ok_or_else(|| format!("no strategy '{}' in the suite", args.strategy))?;
    let warmup = args.warmup.unwrap_or(suite.warmup);
    let repeats = args.repeats.unwrap_or(suite.repeats).max(1);
    if let Some(request) = &args.trace {
        return trace_rank(
            &group,
            suite.seed,
            model,
            strategy,
            warmup,
            request,
            &args.out_dir,
        );
    }
    let figures = match measure(&group, suite.seed, model, strategy, warmup, repeats) {
        Ok(f) => f,
        Err(Outcome::Unavailable(reason)) => RankFigures {
            rank,
            world_size,
            unavailable: Some(reason),
            start_bytes: 0,
            peak_bytes: 0,
            gradient_bytes: 0,
            optimizer_state_bytes: None,
            bytes_sent_per_step: 0,
            step_times_s: Vec::new(),
        },
        Err(Outcome::Failed(error)) => return Err(error),
    };
    let path = args.out_dir.join(format!("rank{rank}.json"));
    let text = serde_json::to_string(&figures).map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// The rank's side of `memsave trace` (see [`RankTrace`]).
fn trace_rank(
    group: &ProcessGroup,
    seed: u64,
    spec: &ModelSpec,
    strategy: &StrategySpec,
    warmup: usize,
    request: &RankTrace,
    out_dir: &Path,
) -> Result<(), String> {
    let outcome_text = |o: Outcome| match o {
        Outcome::Unavailable(reason) | Outcome::Failed(reason) => reason,
    };
    let mut case = RankCase::build(group, seed, spec, strategy).map_err(outcome_text)?;
    for _ in 0..warmup {
        case.step(group, None).map_err(outcome_text)?;
    }
    if group.rank() != 0 {
        return case.step(group, None).map(|_| ()).map_err(outcome_text);
    }
    let state = case
        .optimizer
        .as_ref()
        .map(|o| o.state_tensors())
        .unwrap_or_default();
    let (step, trace) = Recorder::new(Device::Cpu)
        .parameters(&case.params)
        .inputs(&[case.local.input.shallow_clone()])
        .optimizer_state(&state)
        .record(|session| {
            let layers = session.clone();
            case.model
                .ctx
                .set_block_observer(Some(Arc::new(move |i| layers.mark(format!("layer {i}")))));
            let step = case.step(group, Some(session));
            case.model.ctx.set_block_observer(None);
            step
        })
        .map_err(|e| e.to_string())?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out_dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| format!("writing {}: {e}", path.display()))
    };
    write("trace-summary.txt", trace.summary(request.top).as_bytes())?;
    if request.html {
        write(
            "trace.html",
            trace.to_html(&request.title, request.top).as_bytes(),
        )?;
    }
    if request.snapshot {
        write(
            "trace.pickle",
            &trace.to_snapshot_pickle().map_err(|e| e.to_string())?,
        )?;
    }
    if request.svg {
        write("trace.svg", trace.timeline_svg().as_bytes())?;
    }
    if let Err(e) = step {
        write("trace-step-error.txt", outcome_text(e).as_bytes())?;
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
/// [`crate::availability`]) is an error with the reason, found before any rank starts.
pub fn trace_on_ranks(
    suite: &Suite,
    model: &ModelSpec,
    strategy: &StrategySpec,
    world_size: usize,
    request: &RankTrace,
    rank_program: Option<&Path>,
) -> Result<RanksTrace, String> {
    rank_config(model, strategy, world_size)?;
    let program = self::rank_program(rank_program)?;
    let (dir, suite_file) = suite_for_ranks(suite)?;
    let out = dir.path().join("trace");
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot make {}: {e}", out.display()))?;
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
    launch_ranks(&program, &args, world_size).map_err(|e| format!("the ranks failed: {e}"))?;
    let read = |name: &str| -> Result<Vec<u8>, String> {
        let path = out.join(name);
        std::fs::read(&path).map_err(|e| format!("rank 0 wrote no {}: {e}", path.display()))
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

enum Outcome {
    Unavailable(String),
    Failed(String),
}

impl From<String> for Outcome {
    fn from(e: String) -> Self {
        Outcome::Failed(e)
    }
}

fn failed(e: impl std::fmt::Display) -> Outcome {
    Outcome::Failed(e.to_string())
}

/// The optimizer of a rank: a whole one (data parallel) or a ZeRO shard.
trait RankOptimizer {
    fn step(&mut self) -> Result<(), String>;
    fn state_bytes(&self) -> u64;
    fn state_tensors(&self) -> Vec<Tensor>;
}

impl<R: Rule> RankOptimizer for Optimizer<R> {
    fn step(&mut self) -> Result<(), String> {
        self.f_step().map_err(|e| e.to_string())?;
        self.f_zero_grad(true).map_err(|e| e.to_string())
    }
    fn state_bytes(&self) -> u64 {
        Optimizer::state_bytes(self)
    }
    fn state_tensors(&self) -> Vec<Tensor> {
        Optimizer::state_tensors(self)
    }
}

impl<R: Rule> RankOptimizer for ZeroOptimizer<R> {
    fn step(&mut self) -> Result<(), String> {
        self.f_step().map_err(|e| e.to_string())?;
        self.f_zero_grad(true).map_err(|e| e.to_string())
    }
    fn state_bytes(&self) -> u64 {
        ZeroOptimizer::state_bytes(self)
    }
    fn state_tensors(&self) -> Vec<Tensor> {
        ZeroOptimizer::state_tensors(self)
    }
}

/// Whether a technique can run on ranks, and why not.
fn unsupported(technique: &Technique) -> Option<&'static str> {
    match technique {
        Technique::Autocast(_) => Some("autocast"),
        Technique::GradScaler(_) => Some("grad_scaler"),
        Technique::Compress(_) => Some("compress"),
        Technique::Offload(_) => Some("offload"),
        Technique::OffloadGrads => Some("offload_grads"),
        Technique::AutoBatch(_) => Some("auto_batch"),
        Technique::Fit(_) => Some("fit"),
        _ => None,
    }
}

/// The step every rank of a case runs and its ZeRO stage, or why `strategy` cannot
/// run on `model` over `world_size` ranks (the case is then `unavailable`). It reads
/// only the suite, so `memsave check` and the parent of the ranks decide as the ranks do.
pub(crate) fn rank_config(
    model: &ModelSpec,
    strategy: &StrategySpec,
    world_size: usize,
) -> Result<(StepConfig, Option<ZeroStage>), String> {
    let n = world_size.max(1);
    if let Some(name) = strategy.techniques.iter().find_map(unsupported) {
        return Err(format!("{name} is not supported with world_size yet"));
    }
    let zero = strategy.techniques.iter().find_map(|t| match t {
        Technique::Zero(1) => Some(ZeroStage::One),
        Technique::Zero(_) => Some(ZeroStage::Two),
        _ => None,
    });
    let rest = StrategySpec {
        name: strategy.name.clone(),
        techniques: strategy
            .techniques
            .iter()
            .filter(|t| !matches!(t, Technique::Zero(_)))
            .cloned()
            .collect(),
    };
    let config = resolve(&rest)?;
    crate::models::residual_available(model, config.residual)?;
    if let Some(o) = config.optimizer {
        if o.in_backward {
            return Err("optimizer in_backward is not supported with world_size (each parameter's one post-accumulate-grad hook reduces its gradient)".into());
        }
    }
    if zero.is_some() && config.optimizer.is_none() {
        return Err("zero shards the optimizer's state: add an optimizer, e.g. with: [{zero: 2}, {optimizer: {kind: adamw}}]".into());
    }
    let global = model.batch.first().copied().unwrap_or(0);
    if global % n as i64 != 0 {
        return Err(format!(
            "the batch of {global} examples does not divide by world_size {n}"
        ));
    }
    let local_len = global / n as i64;
    let micro = config.micro_batches.unwrap_or(1) as i64;
    if local_len % micro != 0 {
        return Err(format!(
            "a rank's {local_len} examples do not divide into {micro} micro-batches"
        ));
    }
    Ok((config, zero))
}

fn measure(
    group: &ProcessGroup,
    seed: u64,
    spec: &ModelSpec,
    strategy: &StrategySpec,
    warmup: usize,
    repeats: usize,
) -> Result<RankFigures, Outcome> {
    let mut case = RankCase::build(group, seed, spec, strategy)?;
    let mut last = None;
    let mut times = Vec::with_capacity(repeats);
    for i in 0..warmup + repeats {
        let step = case.step(group, None)?;
        if i >= warmup {
            times.push(step.time_s);
            last = Some(step);
        }
    }
    let last = last.ok_or_else(|| failed("no measured step"))?;
    Ok(RankFigures {
        rank: group.rank(),
        world_size: group.world_size(),
        unavailable: None,
        start_bytes: last.start_bytes,
        peak_bytes: last.peak_bytes,
        gradient_bytes: last.gradient_bytes,
        optimizer_state_bytes: case.optimizer.as_ref().map(|o| o.state_bytes()),
        bytes_sent_per_step: last.bytes_sent,
        step_times_s: times,
    })
}

/// One rank's side of a case, built: the model, the rank's share of the batch, data
/// parallel or ZeRO, the optimizer (and the directory of its state on disk).
struct RankCase {
    model: Model,
    params: Vec<Tensor>,
    local: Batch,
    micro: i64,
    ddp: Option<DistributedDataParallel>,
    // Dropped before the directory its state files are in.
    optimizer: Option<Box<dyn RankOptimizer>>,
    _state_dir: Option<tempfile::TempDir>,
}

/// What one step of a rank measured.
struct RankStep {
    start_bytes: u64,
    peak_bytes: u64,
    gradient_bytes: u64,
    bytes_sent: u64,
    time_s: f64,
}

impl RankCase {
    fn build(
        group: &ProcessGroup,
        seed: u64,
        spec: &ModelSpec,
        strategy: &StrategySpec,
    ) -> Result<RankCase, Outcome> {
        let (rank, n) = (group.rank(), group.world_size());
        let (config, zero) = rank_config(spec, strategy, n).map_err(Outcome::Unavailable)?;
        let device = Device::Cpu;
        tch::manual_seed(seed as i64);
        let mut model = Model::build(spec, device).map_err(failed)?;
        let global = model.global_batch();
        let local_len = global / n as i64;
        let micro = config.micro_batches.unwrap_or(1) as i64;
        let whole = model.batch(global).map_err(failed)?;
        let local = whole
            .f_narrow(rank as i64 * local_len, local_len)
            .map_err(failed)?;
        drop(whole);
        apply_plan(&mut model, &local, &config, device).map_err(failed)?;
        if !model.set_residual(config.residual) {
            return Err(Outcome::Unavailable(format!(
                "the model has no residual blocks for {:?}",
                config.residual
            )));
        }
        let params = model.parameters();
        // Each rank is a process with a directory of its own: ranks never share the
        // files of their state (ZeroOptimizer also keeps each rank in `rank-R` below
        // a directory it is given).
        let state_dir = match config.optimizer.map(|o| o.placement) {
            Some(StatePlacement::Disk) => Some(
                tempfile::Builder::new()
                    .prefix(&format!("memsave-rank{rank}-optimizer-"))
                    .tempdir()
                    .map_err(|e| {
                        failed(format!(
                            "cannot make a directory for the optimizer state: {e}"
                        ))
                    })?,
            ),
            _ => None,
        };
        let options = |o: &OptimizerSpec| o.options(state_dir.as_ref().map(|d| d.path()));
        let mut ddp = None;
        let rule = config
            .optimizer
            .map(|o| o.rule().map(|rule| (o, rule)))
            .transpose()
            .map_err(failed)?;
        let optimizer: Option<Box<dyn RankOptimizer>> = match (rule, zero) {
            (Some((o, rule)), Some(stage)) => Some(match rule {
                OptimizerRule::AdamW(c) => Box::new(
                    ZeroOptimizer::new(group, &params, c, options(&o), stage).map_err(failed)?,
                ),
                OptimizerRule::Sgd(c) => Box::new(
                    ZeroOptimizer::new(group, &params, c, options(&o), stage).map_err(failed)?,
                ),
            }),
            (o, _) => {
                ddp = Some(
                    DistributedDataParallel::new(group, &params, DdpConfig::default())
                        .map_err(failed)?,
                );
                match o {
                    Some((o, rule)) => Some(match rule {
                        OptimizerRule::AdamW(c) => {
                            Box::new(AdamW::with_options(&params, c, options(&o)).map_err(failed)?)
                        }
                        OptimizerRule::Sgd(c) => {
                            Box::new(Sgd::with_options(&params, c, options(&o)).map_err(failed)?)
                        }
                    }),
                    None => None,
                }
            }
        };
        Ok(RankCase {
            model,
            params,
            local,
            micro,
            ddp,
            optimizer,
            _state_dir: state_dir,
        })
    }

    /// One training step of the rank's share, its phases told to `session` when it is
    /// recorded.
    fn step(
        &mut self,
        group: &ProcessGroup,
        session: Option<&Session>,
    ) -> Result<RankStep, Outcome> {
        let device = Device::Cpu;
        let phase = |p: Phase| {
            if let Some(s) = session {
                s.phase(p);
            }
        };
        let mark = |m: &str| {
            if let Some(s) = session {
                s.mark(m);
            }
        };
        let per_micro = self.local.len() / self.micro;
        let start = memory_allocated(device);
        reset_peak_memory_stats(device);
        let sent = group.bytes_sent();
        let began = Instant::now();
        for m in 0..self.micro {
            let batch = self
                .local
                .f_narrow(m * per_micro, per_micro)
                .map_err(failed)?;
            phase(Phase::Forward);
            let loss = micro_loss(&self.model, &batch, self.micro)?;
            mark(crate::trace::END_OF_FORWARD);
            phase(Phase::Backward);
            mark("backward");
            match &self.ddp {
                Some(ddp) if m + 1 < self.micro => {
                    ddp.no_sync(|| loss.f_backward()).map_err(failed)?
                }
                Some(ddp) => ddp.f_backward(&loss).map_err(failed)?,
                None => loss.f_backward().map_err(failed)?,
            }
        }
        let gradient_bytes = memory_allocated(device).saturating_sub(start);
        phase(Phase::Optimizer);
        mark("optimizer");
        match self.optimizer.as_mut() {
            Some(o) => o.step()?,
            None => memsave_accum::free_grads(&self.params).map_err(failed)?,
        }
        if let (Some(s), Some(o)) = (session, self.optimizer.as_ref()) {
            s.optimizer_state(&o.state_tensors());
        }
        phase(Phase::Other);
        Ok(RankStep {
            time_s: began.elapsed().as_secs_f64(),
            peak_bytes: max_memory_allocated(device).saturating_sub(start),
            start_bytes: start,
            gradient_bytes,
            bytes_sent: group.bytes_sent() - sent,
        })
    }
}

/// The loss of one micro-batch, weighted so that the micro-batches add up to the mean
/// over the rank's examples.
fn micro_loss(model: &Model, batch: &Batch, micro: i64) -> Result<Tensor, Outcome> {
    let out = model.layers().f_forward(&batch.input).map_err(failed)?;
    let loss = model.loss(&out, batch.target.as_ref()).map_err(failed)?;
    loss.f_div_scalar(micro as f64).map_err(failed)
}
