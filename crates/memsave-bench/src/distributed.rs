//! Suites with `world_size: N`: every case runs on N ranks, processes on 127.0.0.1
//! started by `memsave_dist`'s launcher, each training on its 1/N of the model's batch.
//!
//! A strategy without `zero` runs data parallel (`memsave_dist::DistributedDataParallel`,
//! gradients averaged in buckets during backward, `no_sync` on the micro-batches of
//! `accumulate` before the last) with its `optimizer` on every rank. With `zero: 1` or
//! `zero: 2` the `optimizer` is a `memsave_dist::ZeroOptimizer` of that stage (stage 2
//! reduces the gradients in buckets during backward, every micro-batch). `checkpoint`
//! and the residual updates apply on every rank as on one process; `autocast`,
//! `grad_scaler`, `compress`, `offload`, `in_backward` and a state placement other than
//! `device` are reported unavailable under `world_size`.
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
use crate::strategies::resolve;
use crate::suite::{ModelSpec, StrategySpec, Suite, Technique};
use memsave_dist::{
    init_process_group, DdpConfig, DistributedDataParallel, InitOptions, LaunchConfig,
    ProcessGroup, ZeroOptimizer, ZeroStage,
};
use memsave_meter::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
use memsave_optim::{AdamW, AdamWConfig, Optimizer, Options, Rule, Sgd, SgdConfig, State};
use memsave_plan::{Batch, OptimizerKind, StatePlacement, StatePrecision, Workload};
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
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
    let source = suite.source.as_deref().ok_or_else(|| {
        RunError::Distributed(
            "the suite was not parsed from YAML (Suite::from_yaml), so its ranks cannot read it"
                .into(),
        )
    })?;
    let program = match &options.rank_program {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| RunError::Distributed(format!("cannot find this executable: {e}")))?,
    };
    let dir = tempfile::Builder::new()
        .prefix("memsave-distributed-")
        .tempdir()
        .map_err(|e| RunError::Distributed(format!("cannot make a temporary directory: {e}")))?;
    let suite_file = dir.path().join("suite.yaml");
    std::fs::write(&suite_file, source).map_err(|e| {
        RunError::Distributed(format!("cannot write {}: {e}", suite_file.display()))
    })?;
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
    let out = dir.join(format!("case-{}", unique()));
    if let Err(e) = std::fs::create_dir_all(&out) {
        return failed(Status::Error, format!("cannot make {}: {e}", out.display()));
    }
    let mut args: Vec<OsString> = vec![
        "rank".into(),
        suite_file.into(),
        "--model".into(),
        model.name.clone().into(),
        "--strategy".into(),
        strategy.name.clone().into(),
        "--out-dir".into(),
        out.clone().into(),
    ];
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
    let config = LaunchConfig {
        nproc_per_node: world_size,
        timeout: Some(Duration::from_secs(600)),
        ..Default::default()
    };
    if let Err(e) = memsave_dist::launch(&config, program.as_os_str(), &args) {
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
}

impl<R: Rule> RankOptimizer for Optimizer<R> {
    fn step(&mut self) -> Result<(), String> {
        self.f_step().map_err(|e| e.to_string())?;
        self.f_zero_grad(true).map_err(|e| e.to_string())
    }
    fn state_bytes(&self) -> u64 {
        Optimizer::state_bytes(self)
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

fn measure(
    group: &ProcessGroup,
    seed: u64,
    spec: &ModelSpec,
    strategy: &StrategySpec,
    warmup: usize,
    repeats: usize,
) -> Result<RankFigures, Outcome> {
    let (rank, n) = (group.rank(), group.world_size());
    let unavailable = |reason: String| Err(Outcome::Unavailable(reason));
    if let Some(name) = strategy.techniques.iter().find_map(unsupported) {
        return unavailable(format!("{name} is not supported with world_size yet"));
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
    let config = match resolve(&rest) {
        Ok(c) => c,
        Err(reason) => return unavailable(reason),
    };
    if let Some(o) = config.optimizer {
        if o.in_backward {
            return unavailable("optimizer in_backward is not supported with world_size (each parameter's one post-accumulate-grad hook reduces its gradient)".into());
        }
        if o.placement != StatePlacement::Device {
            return unavailable(
                "optimizer placement other than device is not supported with world_size yet".into(),
            );
        }
    }
    if zero.is_some() && config.optimizer.is_none() {
        return unavailable("zero shards the optimizer's state: add an optimizer, e.g. with: [{zero: 2}, {optimizer: {kind: adamw}}]".into());
    }
    let device = Device::Cpu;
    tch::manual_seed(seed as i64);
    let mut model = Model::build(spec, device).map_err(failed)?;
    let global = model.global_batch();
    if global % n as i64 != 0 {
        return unavailable(format!(
            "the batch of {global} examples does not divide by world_size {n}"
        ));
    }
    let local_len = global / n as i64;
    let micro = config.micro_batches.unwrap_or(1) as i64;
    if local_len % micro != 0 {
        return unavailable(format!(
            "a rank's {local_len} examples do not divide into {micro} micro-batches"
        ));
    }
    let whole = model.batch(global).map_err(failed)?;
    let local = whole
        .f_narrow(rank as i64 * local_len, local_len)
        .map_err(failed)?;
    drop(whole);
    apply_plan(&mut model, &local, &config, device)?;
    if !model.set_residual(config.residual) {
        return unavailable(format!(
            "the model has no residual blocks for {:?}",
            config.residual
        ));
    }
    let params = model.parameters();
    let options = |state: StatePrecision| Options {
        state: match state {
            StatePrecision::F32 => State::F32,
            StatePrecision::Bf16 => State::Bf16,
            StatePrecision::Int8 => State::Int8Blockwise { block: 256 },
        },
        ..Default::default()
    };
    let mut ddp = None;
    let mut optimizer: Option<Box<dyn RankOptimizer>> = match (config.optimizer, zero) {
        (Some(o), Some(stage)) => Some(match o.kind {
            OptimizerKind::Adamw => Box::new(
                ZeroOptimizer::new(
                    group,
                    &params,
                    AdamWConfig::default(),
                    options(o.state),
                    stage,
                )
                .map_err(failed)?,
            ),
            OptimizerKind::Sgd => Box::new(
                ZeroOptimizer::new(
                    group,
                    &params,
                    SgdConfig::default(),
                    options(o.state),
                    stage,
                )
                .map_err(failed)?,
            ),
        }),
        (o, _) => {
            ddp = Some(
                DistributedDataParallel::new(group, &params, DdpConfig::default())
                    .map_err(failed)?,
            );
            match o {
                Some(o) => Some(match o.kind {
                    OptimizerKind::Adamw => Box::new(
                        AdamW::with_options(&params, AdamWConfig::default(), options(o.state))
                            .map_err(failed)?,
                    ),
                    OptimizerKind::Sgd => Box::new(
                        Sgd::with_options(&params, SgdConfig::default(), options(o.state))
                            .map_err(failed)?,
                    ),
                }),
                None => None,
            }
        }
    };
    let per_micro = local_len / micro;
    let mut last = None;
    let mut times = Vec::with_capacity(repeats);
    for i in 0..warmup + repeats {
        let start = memory_allocated(device);
        reset_peak_memory_stats(device);
        let sent = group.bytes_sent();
        let began = Instant::now();
        for m in 0..micro {
            let batch = local.f_narrow(m * per_micro, per_micro).map_err(failed)?;
            let loss = micro_loss(&model, &batch, micro)?;
            match &ddp {
                Some(ddp) if m + 1 < micro => ddp.no_sync(|| loss.f_backward()).map_err(failed)?,
                Some(ddp) => ddp.f_backward(&loss).map_err(failed)?,
                None => loss.f_backward().map_err(failed)?,
            }
        }
        let gradient_bytes = memory_allocated(device).saturating_sub(start);
        match optimizer.as_mut() {
            Some(o) => o.step()?,
            None => memsave_accum::free_grads(&params).map_err(failed)?,
        }
        let elapsed = began.elapsed().as_secs_f64();
        let peak_bytes = max_memory_allocated(device).saturating_sub(start);
        let bytes_sent_per_step = group.bytes_sent() - sent;
        if i >= warmup {
            times.push(elapsed);
            last = Some((start, peak_bytes, gradient_bytes, bytes_sent_per_step));
        }
    }
    let (start_bytes, peak_bytes, gradient_bytes, bytes_sent_per_step) =
        last.ok_or_else(|| failed("no measured step"))?;
    Ok(RankFigures {
        rank,
        world_size: n,
        unavailable: None,
        start_bytes,
        peak_bytes,
        gradient_bytes,
        optimizer_state_bytes: optimizer.as_ref().map(|o| o.state_bytes()),
        bytes_sent_per_step,
        step_times_s: times,
    })
}

/// The loss of one micro-batch, weighted so that the micro-batches add up to the mean
/// over the rank's examples.
fn micro_loss(model: &Model, batch: &Batch, micro: i64) -> Result<Tensor, Outcome> {
    let out = model.layers().f_forward(&batch.input).map_err(failed)?;
    let loss = model.loss(&out, batch.target.as_ref()).map_err(failed)?;
    loss.f_div_scalar(micro as f64).map_err(failed)
}
