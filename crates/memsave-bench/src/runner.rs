//! Running a suite: every selected model under every strategy, each case isolated
//! (errors and panics are recorded and the suite goes on), with the suite's threads
//! and simulated memory limit in force only while it runs.
//!
//! A panic inside a case is caught and recorded, but Rust's panic hook still runs
//! first and prints it to stderr; a binary that wants a quiet terminal installs its
//! own hook (the `memsave` binary does). The library keeps no global or thread-local
//! state for that.
use crate::message::one_line;
use crate::models::Model;
use crate::optimizer::{CaseOptimizer, SavedWeights};
use crate::report::{CaseResult, Report, Status, StepTime, SCHEMA_VERSION};
use crate::step::{f_grads, f_step, f_step_with, max_abs_diff, rel_l2_diff};
use crate::strategies::{resolve, ResidualUpdate, StepConfig};
use crate::suite::{
    AutoBatchSpec, DeviceChoice, FitSpec, ModelSpec, StrategySpec, Suite, Technique,
};
use memsave_amp::GradScaler;
use memsave_checkpoint::Plan;
pub use memsave_step::plan::apply_plan;
use memsave_step::{Batch, Workload};
use regex::Regex;
use std::panic::{self, AssertUnwindSafe};
use tch::Device;

/// Overrides of the suite's settings, and which cases to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Only cases whose `model/strategy` matches. A model with `enabled: false` runs
    /// only when the filter names it (its text contains the model's name), so that
    /// `--filter seed-full` opts in and `--filter baseline` does not.
    pub filter: Option<Regex>,
    /// Measured repeats per case instead of the suite's.
    pub repeats: Option<usize>,
    /// Warm-up steps instead of the suite's.
    pub warmup: Option<usize>,
    /// libtorch threads instead of the suite's.
    pub threads: Option<usize>,
    /// Simulated memory limit in bytes instead of the suite's.
    pub memory_limit: Option<u64>,
    /// Ranks instead of the suite's `world_size` (see [`crate::distributed`]).
    pub world_size: Option<usize>,
    /// The program whose hidden `rank` subcommand runs one rank of a distributed case
    /// (default: this process's executable, which must then be the `memsave` binary).
    pub rank_program: Option<std::path::PathBuf>,
}

/// Follows a run, e.g. to show progress. Every method has an empty default.
pub trait Observer {
    /// The run is about to start `total` cases.
    fn started(&mut self, _total: usize) {}
    /// A case begins.
    fn case_started(&mut self, _model: &str, _strategy: &str) {}
    /// A case ended (in any status).
    fn case_finished(&mut self, _case: &CaseResult) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Silent;

impl Observer for Silent {}

/// A run that could not start or finish as a whole (single cases never fail a run).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The suite's device is not available here.
    #[error("device {0}: not available on this machine")]
    DeviceUnavailable(String),
    /// The memory limit cannot be applied.
    #[error("cannot apply the memory limit: {0}")]
    MemoryLimit(String),
    /// A distributed run (`world_size`) cannot start, or a signal interrupted it
    /// (`DistributedError::interrupted_by`).
    #[error("distributed run: {0}")]
    Distributed(#[from] crate::distributed::DistributedError),
}

/// The models and strategies a run will measure, in suite order.
pub fn selected_cases<'s>(
    suite: &'s Suite,
    options: &RunOptions,
) -> Vec<(&'s ModelSpec, Vec<&'s StrategySpec>)> {
    suite
        .models
        .iter()
        .filter(|m| {
            m.enabled
                || options
                    .filter
                    .as_ref()
                    .is_some_and(|re| re.as_str().contains(&m.name))
        })
        .map(|m| {
            let strategies = suite
                .strategies
                .iter()
                .filter(|s| match &options.filter {
                    Some(re) => re.is_match(&format!("{}/{}", m.name, s.name)),
                    None => true,
                })
                .collect();
            (m, strategies)
        })
        .filter(|(_, s): &(_, Vec<_>)| !s.is_empty())
        .collect()
}

/// Whether `strategy` can run on `model` in this build, on one process
/// (`world_size: None`) or on that many ranks, and if not why: the reason `memsave
/// bench` reports such a case `unavailable` with, and the one `memsave check` reports
/// it with, so that the two always agree. It reads only the suite (nothing is built).
///
/// ```
/// use memsave_bench::{availability, Suite};
///
/// let suite = Suite::from_yaml("
/// suite: doc
/// models:
///   - {name: m, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
/// strategies:
///   - {name: scaled, with: [grad_scaler, {optimizer: {kind: adamw, in_backward: true}}]}
/// ", "doc.yaml")?;
/// let why = availability(&suite.models[0], &suite.strategies[0], None).unwrap_err();
/// assert!(why.contains("grad_scaler"), "{why}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn availability(
    model: &ModelSpec,
    strategy: &StrategySpec,
    world_size: Option<usize>,
) -> Result<(), String> {
    match world_size {
        None => resolve(strategy)
            .and_then(|config| crate::models::residual_available(model, config.residual))
            .map_err(String::from),
        Some(n) => crate::distributed::rank_config(model, strategy, n)
            .map(|_| ())
            .map_err(|e| e.reason),
    }
}

/// Runs `suite` without progress reporting.
pub fn run_suite(suite: &Suite, options: &RunOptions) -> Result<Report, RunError> {
    run_suite_with(suite, options, &mut Silent)
}

/// Runs `suite`, telling `observer` about each case.
pub fn run_suite_with(
    suite: &Suite,
    options: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<Report, RunError> {
    memsave_meter::install();
    if let Some(n) = options.world_size.or(suite.world_size) {
        let device = resolve_device(suite.device)?;
        use crate::distributed::{run_cases, CaseEvent, RankSettings};
        let settings = RankSettings {
            warmup: options.warmup,
            repeats: options.repeats,
            threads: options.threads,
            rank_program: options.rank_program.clone(),
        };
        let selected = selected_cases(suite, options);
        let cases = run_cases(suite, &selected, &settings, n, &mut |event| match event {
            CaseEvent::Started { total } => observer.started(total),
            CaseEvent::CaseStarted { model, strategy } => observer.case_started(model, strategy),
            CaseEvent::CaseFinished(case) => observer.case_finished(case),
        })?;
        return Ok(report(suite, device, cases));
    }
    let device = resolve_device(suite.device)?;
    if let Some(n) = options.threads.or(suite.threads) {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    let limit = options
        .memory_limit
        .or(suite.memory_limit.as_ref().map(|s| s.bytes));
    let _limit = LimitGuard::set(device, limit)?;
    let settings = Settings {
        device,
        seed: suite.seed,
        warmup: options.warmup.unwrap_or(suite.warmup),
        repeats: options.repeats.unwrap_or(suite.repeats).max(1),
        memory_limit: limit,
    };
    let selected = selected_cases(suite, options);
    let jobs = schedule(&selected);
    observer.started(jobs.len());
    let mut results: Vec<Option<CaseResult>> = vec![None; jobs.len()];
    // The current model, its input and its baseline gradients.
    type Built = (Model, Batch, Option<Vec<Vec<f32>>>);
    let mut current: Option<(usize, Result<Built, String>)> = None;
    for job in &jobs {
        let spec = selected[job.model].0;
        if current.as_ref().map(|c| c.0) != Some(job.model) {
            drop(current.take()); // free the previous model before building the next
            let built = build_bundled(spec, &settings).map(|(m, x)| (m, x, None));
            current = Some((job.model, built));
        }
        observer.case_started(&spec.name, &job.strategy.name);
        let mut case = match current.as_mut().map(|c| &mut c.1) {
            Some(Ok((model, x, reference))) => {
                let mut bench = Workbench {
                    model,
                    x: x.shallow_clone(),
                    reference: reference.take(),
                };
                let case = run_case(&mut bench, job.strategy, &settings);
                *reference = bench.reference;
                case
            }
            Some(Err(error)) => CaseResult::failed(
                &spec.name,
                &job.strategy.name,
                Status::Error,
                format!("building the model failed: {error}"),
            ),
            None => unreachable!("a model is built before its cases"),
        };
        case.is_baseline = job.strategy.is_baseline();
        observer.case_finished(&case);
        results[job.position] = Some(case);
    }
    drop(current);
    Ok(report(
        suite,
        device,
        results.into_iter().flatten().collect(),
    ))
}

pub(crate) fn report(suite: &Suite, device: Device, cases: Vec<CaseResult>) -> Report {
    Report {
        schema_version: SCHEMA_VERSION,
        suite: suite.suite.clone(),
        device: device_name(device),
        libtorch_version: memsave_sys::version::libtorch_version().to_owned(),
        threads: usize::try_from(tch::get_num_threads()).unwrap_or(0),
        cases,
    }
}

/// Runs the suite's strategies (and settings: warm-up, repeats, threads, memory
/// limit) on a model of your own instead of the suite's models, which are ignored.
/// The input is `workload.batch(workload.global_batch())`; the suite's `device` must
/// be the workload's (`auto` takes the workload's). `options.filter` matches
/// `name/strategy` with the workload's name.
///
/// Strategies that need what a [`Workload`] does not provide (the residual updates
/// `inplace_add`, `add_out` and `safe_residual` on a model without residual blocks)
/// are reported `unavailable`.
///
/// ```
/// use memsave_bench::{run_workload, RunOptions, Status, Suite};
/// use memsave_checkpoint::CheckpointedSequential;
/// use memsave_step::{Batch, Workload};
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
///
/// // A model defined here: four tanh layers of width 32, batches of 16 rows.
/// struct Mine {
///     vs: nn::VarStore,
///     layers: CheckpointedSequential,
///     data: Tensor,
/// }
///
/// impl Workload for Mine {
///     fn name(&self) -> &str { "mine" }
///     fn device(&self) -> Device { Device::Cpu }
///     fn layers(&self) -> &CheckpointedSequential { &self.layers }
///     fn layers_mut(&mut self) -> &mut CheckpointedSequential { &mut self.layers }
///     fn parameters(&self) -> Vec<Tensor> { self.vs.trainable_variables() }
///     fn global_batch(&self) -> i64 { 16 }
///     fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
///         Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
///     }
/// }
///
/// tch::manual_seed(0);
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut layers = CheckpointedSequential::new();
/// for i in 0..4 {
///     let lin = nn::linear(vs.root() / i, 32, 32, Default::default());
///     layers = layers.add_fn(move |x| lin.forward(x).tanh());
/// }
/// let data = Tensor::rand([16, 32], (Kind::Float, Device::Cpu));
/// let mut mine = Mine { vs, layers, data };
///
/// // The suite's own models are not run here (the same file can serve `memsave bench`).
/// let yaml = "
/// suite: mine
/// warmup: 0
/// repeats: 1
/// models:
///   - {name: bundled, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
/// strategies:
///   - baseline
///   - checkpoint: {every_layer: true}
///   - inplace_add
/// ";
/// let suite = Suite::from_yaml(yaml, "mine.yaml")?;
/// let report = run_workload(&mut mine, &suite, &RunOptions::default())?;
/// assert_eq!(report.cases[0].model, "mine");
/// // Each tanh layer saves its f32 output [16, 32] for backward, the last one is
/// // the model's output: 4 * 16 * 32 * 4 bytes after the forward.
/// assert_eq!(report.cases[0].retained_after_forward_bytes, Some(4 * 16 * 32 * 4));
/// // Per-layer checkpoints keep only the layers' inputs and the output.
/// assert_eq!(report.cases[1].grad_max_abs_diff, Some(0.0));
/// assert_eq!(report.cases[2].status, Status::Unavailable);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn run_workload(
    workload: &mut dyn Workload,
    suite: &Suite,
    options: &RunOptions,
) -> Result<Report, RunError> {
    memsave_meter::install();
    let device = match suite.device {
        DeviceChoice::Auto => workload.device(),
        choice => resolve_device(choice)?,
    };
    if device != workload.device() {
        return Err(RunError::DeviceUnavailable(format!(
            "{} (the suite's device; the workload '{}' is on {})",
            device_name(device),
            workload.name(),
            device_name(workload.device())
        )));
    }
    if let Some(n) = options.threads.or(suite.threads) {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    let limit = options
        .memory_limit
        .or(suite.memory_limit.as_ref().map(|s| s.bytes));
    let _limit = LimitGuard::set(device, limit)?;
    let settings = Settings {
        device,
        seed: suite.seed,
        warmup: options.warmup.unwrap_or(suite.warmup),
        repeats: options.repeats.unwrap_or(suite.repeats).max(1),
        memory_limit: limit,
    };
    let name = workload.name().to_owned();
    let strategies: Vec<&StrategySpec> = suite
        .strategies
        .iter()
        .filter(|s| match &options.filter {
            Some(re) => re.is_match(&format!("{name}/{}", s.name)),
            None => true,
        })
        .collect();
    let x = isolated(|| {
        workload
            .batch(workload.global_batch())
            .map_err(|e| e.to_string())
    });
    let mut cases = Vec::with_capacity(strategies.len());
    // Strategies that write into their input run last, as in `run_suite`.
    let mut order: Vec<usize> = (0..strategies.len()).collect();
    order.sort_by_key(|&i| resolve(strategies[i]).is_ok_and(|c| c.residual.writes_input()));
    let mut results: Vec<Option<CaseResult>> = vec![None; strategies.len()];
    let mut bench = match x {
        Ok(x) => Some(Workbench {
            model: workload,
            x,
            reference: None,
        }),
        Err(error) => {
            for (i, s) in strategies.iter().enumerate() {
                results[i] = Some(CaseResult::failed(
                    &name,
                    &s.name,
                    Status::Error,
                    format!("making the input batch failed: {error}"),
                ));
            }
            None
        }
    };
    if let Some(bench) = bench.as_mut() {
        for i in order {
            let mut case = run_case(bench, strategies[i], &settings);
            case.is_baseline = strategies[i].is_baseline();
            results[i] = Some(case);
        }
    }
    cases.extend(results.into_iter().flatten());
    Ok(report(suite, device, cases))
}

pub(crate) struct Settings {
    device: Device,
    seed: u64,
    warmup: usize,
    repeats: usize,
    /// The suite's simulated capacity, if any (`auto_batch`'s default budget).
    memory_limit: Option<u64>,
}

/// The device a suite's `device` setting names on this machine.
pub fn resolve_device(choice: DeviceChoice) -> Result<Device, RunError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda if tch::Cuda::is_available() => Ok(Device::Cuda(0)),
        DeviceChoice::Cuda => Err(RunError::DeviceUnavailable("cuda".into())),
        DeviceChoice::Auto => Ok(Device::cuda_if_available()),
    }
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".to_owned(),
    }
}

/// Applies a simulated memory limit (the meter's [`memsave_meter::MemoryLimitGuard`]),
/// restored when the guard is dropped, also by a panic.
pub(crate) enum LimitGuard {}

impl LimitGuard {
    pub(crate) fn set(
        device: Device,
        limit: Option<u64>,
    ) -> Result<Option<memsave_meter::MemoryLimitGuard>, RunError> {
        limit
            .map(|limit| memsave_meter::MemoryLimitGuard::f_new(device, limit))
            .transpose()
            .map_err(|e| RunError::MemoryLimit(e.to_string()))
    }
}

/// One case to run: which selected model, which strategy, and where its result goes.
struct Job<'s> {
    model: usize,
    strategy: &'s StrategySpec,
    position: usize,
}

/// The order cases run in: suite order, except that strategies writing into their
/// input (`inplace_add`, `add_out`) run after all others. `x += f(x)` on a tensor saved
/// for backward makes a reference cycle inside libtorch's autograd graph (through the
/// view the matmul saved and the `grad_fn` the failed backward regenerates for it),
/// so its tensor is never freed; running those cases last keeps every other case's
/// `start_bytes` at parameters plus input. Results are reported in suite order.
fn schedule<'s>(selected: &[(&'s ModelSpec, Vec<&'s StrategySpec>)]) -> Vec<Job<'s>> {
    let mut jobs = Vec::new();
    let mut position = 0;
    for (model, (_, strategies)) in selected.iter().enumerate() {
        for strategy in strategies {
            jobs.push(Job {
                model,
                strategy,
                position,
            });
            position += 1;
        }
    }
    let writes_input = |s: &StrategySpec| resolve(s).is_ok_and(|c| c.residual.writes_input());
    jobs.sort_by_key(|j| writes_input(j.strategy)); // stable: suite order otherwise
    jobs
}

/// A model, its input, and the baseline gradients its cases are compared with.
struct Workbench<'m> {
    model: &'m mut dyn Workload,
    x: Batch,
    reference: Option<Vec<Vec<f32>>>,
}

/// A bundled model built from the suite's seed, so a rebuild is identical.
fn build_bundled(spec: &ModelSpec, settings: &Settings) -> Result<(Model, Batch), String> {
    isolated(|| {
        tch::manual_seed(settings.seed as i64);
        let model = Model::build(spec, settings.device).map_err(|e| e.to_string())?;
        let x = model.data();
        Ok((model, x))
    })
}

fn run_case(bench: &mut Workbench<'_>, strategy: &StrategySpec, settings: &Settings) -> CaseResult {
    let Workbench {
        model,
        x,
        reference,
    } = bench;
    let model: &mut dyn Workload = &mut **model;
    // Each case of a model starts from the same random stream (dropout draws alike).
    let _stream = crate::models::RandomStreamGuard::save();
    let name = model.name().to_owned();
    let config = match resolve(strategy) {
        Ok(config) => config,
        Err(reason) => {
            return CaseResult::failed(&name, &strategy.name, Status::Unavailable, reason.into())
        }
    };
    if !model.set_residual(config.residual) {
        model.set_residual(ResidualUpdate::Add);
        return CaseResult::failed(
            &name,
            &strategy.name,
            Status::Unavailable,
            format!(
                "the model '{name}' has no residual blocks to apply {:?} to (the workload's set_residual declined it)",
                config.residual
            ),
        );
    }
    let outcome = isolated(|| measure_case(model, x, strategy, &config, settings, reference));
    // Leave the model as the next case expects it, whatever happened.
    model.set_residual(ResidualUpdate::Add);
    model.stop_trace();
    let _ = model.layers_mut().set_plan(Plan::None);
    let _ = memsave_accum::free_grads(&model.parameters());
    match outcome {
        Ok(case) => CaseResult {
            model: name,
            strategy: strategy.name.clone(),
            ..case
        },
        Err(error) => CaseResult::failed(&name, &strategy.name, Status::Error, error),
    }
}

fn measure_case(
    model: &mut dyn Workload,
    x: &Batch,
    strategy: &StrategySpec,
    config: &StepConfig,
    settings: &Settings,
    reference: &mut Option<Vec<Vec<f32>>>,
) -> Result<CaseResult, String> {
    let device = settings.device;
    let mut config = config.clone();
    let config = &mut config;
    let mut tries = None;
    let mut choice = None;
    let mut x = x.shallow_clone();
    let search = strategy.techniques.iter().find_map(|t| match t {
        Technique::AutoBatch(spec) => Some(Search::Halving(spec.clone())),
        Technique::Fit(spec) => Some(Search::Fit(spec.clone())),
        _ => None,
    });
    match &search {
        Some(Search::Fit(spec)) => {
            let mut request = memsave_fit::FitRequest::new(spec.budget.bytes);
            request.allow.bf16 = spec.allow.iter().any(|l| l == "bf16");
            request.allow.compress = spec.allow.iter().any(|l| l == "compress");
            request.allow.int8_state = spec.allow.iter().any(|l| l == "int8_state");
            request.allow.micro_batches = spec.allow.iter().any(|l| l == "micro_batches");
            let report = memsave_fit::fit(model, &request).map_err(|e| e.to_string())?;
            // fit left the chosen schedule on the layers.
            *config = report.choice.step_config(None);
            tries = Some(report.tries);
            choice = Some(report.choice.strategy.clone());
        }
        Some(Search::Halving(spec)) => {
            apply_plan(model, &x, config, device).map_err(|e| e.to_string())?;
            let budget = spec.budget.as_ref().map(|b| b.bytes).or(settings.memory_limit).ok_or(
                "auto_batch needs a budget: give one ({policy: halving, budget: 40MiB}) or set the suite's memory_limit",
            )?;
            let (size, count) = halve_until_fits(model, &x, config, device, budget)?;
            x = x.f_narrow(0, size).map_err(|e| e.to_string())?;
            tries = Some(count);
        }
        None => apply_plan(model, &x, config, device).map_err(|e| e.to_string())?,
    }
    let x = &x;
    let config: &StepConfig = config;
    let _limit = match (&search, settings.memory_limit) {
        (Some(Search::Halving(AutoBatchSpec { budget: Some(b) })), _) => {
            let start = memsave_meter::f_memory_allocated(device).map_err(|e| e.to_string())?;
            LimitGuard::set(device, Some(start + b.bytes)).map_err(|e| e.to_string())?
        }
        _ => None,
    };
    // One scaler and one optimizer for the whole case, as in a training loop; the
    // weights the optimizer changes are put back when the case ends, however it ends.
    let mut scaler = config
        .scaler
        .map(GradScaler::new)
        .transpose()
        .map_err(|e| e.to_string())?;
    let _weights = match config.optimizer {
        Some(_) => Some(RestoreOnDrop(
            SavedWeights::save(&model.parameters()).map_err(|e| e.to_string())?,
        )),
        None => None,
    };
    let mut optimizer = config
        .optimizer
        .map(|spec| CaseOptimizer::build(&spec, &model.parameters()))
        .transpose()
        .map_err(|e| e.to_string())?;
    for _ in 0..settings.warmup {
        f_step_with(
            model,
            x,
            config,
            device,
            false,
            scaler.as_mut(),
            optimizer.as_mut(),
        )
        .map_err(|e| e.to_string())?;
    }
    let mut times = Vec::with_capacity(settings.repeats);
    let mut last = None;
    for i in 0..settings.repeats {
        let record_trace = i + 1 == settings.repeats;
        let m = f_step_with(
            model,
            x,
            config,
            device,
            record_trace,
            scaler.as_mut(),
            optimizer.as_mut(),
        )
        .map_err(|e| e.to_string())?;
        times.push(m.time_s);
        last = Some(m);
    }
    let last = last.ok_or("no measured repeat")?;
    let grads = f_grads(&model.parameters()).map_err(|e| e.to_string())?;
    let mut case = CaseResult {
        model: String::new(),
        strategy: String::new(),
        status: Status::Ok,
        error: None,
        start_bytes: Some(last.start_bytes),
        peak_bytes: Some(last.peak_bytes),
        retained_after_forward_bytes: Some(last.retained_after_forward_bytes),
        step_time_s: StepTime::from_times(times),
        is_baseline: false,
        has_baseline: false,
        grad_max_abs_diff: None,
        grad_diverged: false,
        trace: last.trace,
        peak_phase: Some(last.peak_phase),
        optimizer_state_bytes: optimizer.as_ref().map(CaseOptimizer::state_bytes),
        offloaded_bytes: last.offloaded_bytes,
        compressed_saved_bytes: last.compressed_saved_bytes,
        grad_rel_l2: None,
        world_size: None,
        gradient_bytes: None,
        bytes_sent_per_step: None,
        global_batch: Some(x.len()),
        tries,
        choice,
    };
    if optimizer.is_some() {
        // The step freed the gradients: nothing to compare.
    } else if matches!(search, Some(Search::Halving(_))) {
        // Another batch: the gradients are not comparable with the baseline's.
    } else if strategy.is_baseline() {
        *reference = Some(grads);
    } else {
        if reference.is_none() {
            *reference = Some(baseline_grads(model, x, device)?);
        }
        if let Some(r) = reference.as_ref() {
            case.set_grad_diff(max_abs_diff(&grads, r));
            case.grad_rel_l2 = Some(rel_l2_diff(&grads, r)).filter(|d| d.is_finite());
        }
    }
    Ok(case)
}

/// How a strategy searches for a configuration that fits.
enum Search {
    /// `auto_batch: {policy: halving}`.
    Halving(AutoBatchSpec),
    /// `fit: {budget}`.
    Fit(FitSpec),
}

/// HF accelerate's `find_executable_batch_size`: runs a step of the first `size`
/// examples under the capacity `budget` above the current allocation, halving `size`
/// on each out-of-memory error. Returns the size that fitted and the steps tried.
fn halve_until_fits(
    model: &mut dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    budget: u64,
) -> Result<(i64, usize), String> {
    let mut size = x.len();
    let mut tries = 0;
    let params = model.parameters();
    loop {
        tries += 1;
        let xs = x.f_narrow(0, size).map_err(|e| e.to_string())?;
        let weights = match config.optimizer {
            Some(_) => Some(RestoreOnDrop(
                SavedWeights::save(&params).map_err(|e| e.to_string())?,
            )),
            None => None,
        };
        let outcome = {
            let start = memsave_meter::f_memory_allocated(device).map_err(|e| e.to_string())?;
            let _limit =
                LimitGuard::set(device, Some(start + budget)).map_err(|e| e.to_string())?;
            let mut optimizer = config
                .optimizer
                .map(|spec| CaseOptimizer::build(&spec, &params))
                .transpose()
                .map_err(|e| e.to_string())?;
            // A failed scalar operation in tch panics instead of returning the error.
            panic::catch_unwind(AssertUnwindSafe(|| {
                f_step_with(model, &xs, config, device, false, None, optimizer.as_mut())
                    .map_err(|e| (e.is_out_of_memory(), e.to_string()))
            }))
            .unwrap_or_else(|payload| {
                let message = memsave_sys::checkpoint::panic_message(&*payload).to_string();
                Err((memsave_sys::is_out_of_memory_message(&message), message))
            })
        };
        drop(weights);
        let _ = memsave_accum::free_grads(&params);
        match outcome {
            Ok(_) => return Ok((size, tries)),
            Err((true, _)) if size > 1 => size /= 2,
            Err((true, _)) => {
                return Err(format!(
                "auto_batch: even a batch of 1 does not fit the budget of {} after {tries} tries",
                memsave_meter::Bytes(budget)
            ))
            }
            Err((false, e)) => return Err(e),
        }
    }
}

/// Puts a case's starting weights back when the case ends (also on an error or a
/// panic), so the next case sees the model the suite built.
struct RestoreOnDrop(SavedWeights);

impl Drop for RestoreOnDrop {
    fn drop(&mut self) {
        let _ = self.0.restore();
    }
}

/// The gradients of one unmeasured baseline step, for a suite without a baseline case.
fn baseline_grads(
    model: &mut dyn Workload,
    x: &Batch,
    device: Device,
) -> Result<Vec<Vec<f32>>, String> {
    let config = StepConfig::baseline();
    model.set_residual(config.residual);
    model
        .layers_mut()
        .set_plan(Plan::None)
        .map_err(|e| e.to_string())?;
    f_step(model, x, &config, device, false, None).map_err(|e| e.to_string())?;
    f_grads(&model.parameters()).map_err(|e| e.to_string())
}

/// Runs `f`, turning a panic into an error with its message; either way the error is
/// one line a person can act on ([`one_line`]).
fn isolated<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| one_line(&e)),
        Err(payload) => {
            let text = memsave_sys::checkpoint::panic_message(&*payload);
            Err(format!("panicked: {}", one_line(&text)))
        }
    }
}
