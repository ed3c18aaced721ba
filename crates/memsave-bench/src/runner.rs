//! Running a suite: every selected model under every strategy, each case isolated
//! (errors and panics are recorded and the suite goes on), with the suite's threads
//! and simulated memory limit in force only while it runs.
//!
//! One model at a time, in two passes over its strategies:
//! 1. **Memory**, one case after another: each case's setup (its plan, `fit` or
//!    `auto_batch` search, optimizer and scaler), its warm-up steps and one measured
//!    step, which gives every byte figure, the trace and the gradients compared with
//!    the baseline's. Nothing of another case is alive then, so the figures are exact
//!    and the same as when each case ran all its steps back to back.
//! 2. **Time**, in rounds: each case measured in pass 1 runs at least `repeats` timed
//!    steps, one per round; a round steps every such strategy of the model once, in
//!    suite order, the next round in reverse order. From 3 `repeats` up, rounds are
//!    added until every strategy's median is steady ([`RunOptions::rounds`], see
//!    [`crate::spread`]: by default within ±2%, at most 50 rounds or 60 s a model). This machine's speed drifts over
//!    seconds, and other processes come and go: timing a strategy's steps back to back
//!    would put one moment's speed on one strategy, and its ratio to the baseline
//!    would depend on where the suite lists it. In rounds every strategy samples the
//!    same moments. [`CaseResult::rounds`] records the number.
//!
//! Before the first step the C allocator is settled
//! ([`memsave_meter::settle_c_allocator`], as `memsave fit` does): otherwise the
//! first steps of a process are timed under page faults that later ones do not pay.
//!
//! What the rounds cost, and where they differ from a case run on its own:
//! - each case runs its warm-up and memory step in pass 1, then `repeats` timed steps
//!   (the memory step, which records the trace, is not timed); with `warmup: 0` and
//!   more than one repeat, pass 1 runs one step before the memory step, so that its
//!   figures are a steady step's (an optimizer's state exists at its start), as they
//!   were when the last of the back-to-back repeats measured them;
//! - each case's state lives through all rounds of its model: its optimizer (and its
//!   state), its scaler, its batch and its checkpoint schedule. A strategy with an
//!   optimizer or a scaler starts the rounds with a fresh one and `warmup` untimed
//!   steps of its own (pass 1's were dropped, so as not to count in the next case's
//!   memory);
//! - except an optimizer stepping in backward (`in_backward`): it holds a hook on
//!   every parameter (libtorch keeps one per tensor), which would step it on the other
//!   cases' gradients, so it is built, warmed up and dropped around its timed step in
//!   every round: its timed step is always its optimizer's first after the warm-up;
//! - the suite's simulated `memory_limit` (and an `auto_batch` budget's limit) is not
//!   in force during the rounds, where several cases' optimizer states are alive at
//!   once; a limit the caller set stays in force;
//! - the model's weights are put back after every step of a strategy with an
//!   optimizer, so that every strategy steps the weights the suite built;
//! - a `checkpoint: {budget, offload/compress}` strategy's stores cannot be taken back
//!   from the layers, so it is planned again (profiled and solved, then given its
//!   schedule from pass 1) whenever another such strategy stepped since its last step;
//! - a case whose timed step fails is reported as an error (its memory figures
//!   dropped);
//! - distributed cases (`world_size`, [`crate::distributed`]) run in processes of
//!   their own: their steps are timed back to back, with no rounds and no settling
//!   of the C allocator.
//!
//! A panic inside a case is caught and recorded, but Rust's panic hook still runs
//! first and prints it to stderr; a binary that wants a quiet terminal installs its
//! own hook (the `memsave` binary does). The library keeps no global or thread-local
//! state for that.
use crate::message::one_line;
use crate::models::Model;
use crate::optimizer::{CaseOptimizer, SavedWeights};
use crate::report::{CaseResult, Report, Status, StepTime, SCHEMA_VERSION};
use crate::spread::{spread, Rounds};
use crate::step::{f_grads, f_step, f_step_with, max_abs_diff, rel_l2_diff};
use crate::strategies::{resolve, PlanChoice, ResidualUpdate, StepConfig, Unavailable};
use crate::suite::{
    AutoBatchSpec, DeviceChoice, FitSpec, ModelSpec, StrategySpec, Suite, Technique,
};
use memsave_amp::GradScaler;
use memsave_checkpoint::{BlockKey, BlockLever, Plan, Schedule};
pub use memsave_step::plan::apply_plan;
use memsave_step::{Batch, Workload};
use regex::Regex;
use std::panic::{self, AssertUnwindSafe};
use tch::{Device, Tensor};

/// Overrides of the suite's settings, and which cases to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Only cases whose `model/strategy` matches. A model with `enabled: false` runs
    /// only when the filter names it (its text contains the model's name), so that
    /// `--filter seed-full` opts in and `--filter baseline` does not.
    pub filter: Option<Regex>,
    /// Timed steps per case instead of the suite's `repeats`: the least number of
    /// rounds (see the [module](self) documentation).
    pub repeats: Option<usize>,
    /// When to add rounds past `repeats` (from 3 of them): until every median is
    /// steady, within caps (see [`crate::spread`]). Not for distributed cases.
    pub rounds: Rounds,
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
    /// A case ended (in any status). A case measured in the first pass ends when its
    /// model's timed rounds have ended, so every case of a model may end at once.
    fn case_finished(&mut self, _case: &CaseResult) {}
    /// A timed step of `model` under `strategy` is about to run: round `round` (from
    /// 0) of at most `rounds` (rounds stop earlier once every median is steady, see
    /// [`crate::spread`]). Not called for distributed cases.
    fn timed_step(&mut self, _model: &str, _strategy: &str, _round: usize, _rounds: usize) {}
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
/// assert!(why.to_string().contains("grad_scaler"), "{why}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn availability(
    model: &ModelSpec,
    strategy: &StrategySpec,
    world_size: Option<usize>,
) -> Result<(), Unavailable> {
    match world_size {
        None => resolve(strategy).and_then(|config| {
            if config.offload_params.is_some() {
                return Err(Unavailable::OffloadParamsNeedsRanks);
            }
            crate::models::residual_available(model, config.residual)?;
            crate::models::plan_available(model, &config)
        }),
        Some(n) => crate::distributed::rank_config(model, strategy, n)
            .map(|_| ())
            .map_err(|e| Unavailable::OnRanks(e.reason)),
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
            memory_limit: options.memory_limit,
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
    let limit = SuiteLimit::new(device, limit)?;
    let settings = Settings {
        device,
        seed: suite.seed,
        warmup: options.warmup.unwrap_or(suite.warmup),
        repeats: options.repeats.unwrap_or(suite.repeats).max(1),
        rounds: options.rounds,
        memory_limit: limit.bytes,
    };
    memsave_meter::settle_c_allocator();
    let selected = selected_cases(suite, options);
    observer.started(selected.iter().map(|(_, s)| s.len()).sum());
    let mut cases = Vec::new();
    for (spec, strategies) in &selected {
        let built = {
            let _limit = limit.hold();
            build_bundled(spec, &settings)
        };
        match built {
            // The model lives for its cases only: it is freed before the next is built.
            Ok((mut model, x)) => {
                let mut bench = Workbench {
                    model: &mut model,
                    x,
                    reference: None,
                };
                cases.extend(run_model(
                    &mut bench, strategies, &settings, &limit, observer,
                ));
            }
            Err(error) => {
                for strategy in strategies {
                    observer.case_started(&spec.name, &strategy.name);
                    let mut case = CaseResult::failed(
                        &spec.name,
                        &strategy.name,
                        Status::Error,
                        format!("building the model failed: {error}"),
                    );
                    case.is_baseline = strategy.is_baseline();
                    observer.case_finished(&case);
                    cases.push(case);
                }
            }
        }
    }
    Ok(report(suite, device, cases))
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
    let limit = SuiteLimit::new(device, limit)?;
    let settings = Settings {
        device,
        seed: suite.seed,
        warmup: options.warmup.unwrap_or(suite.warmup),
        repeats: options.repeats.unwrap_or(suite.repeats).max(1),
        rounds: options.rounds,
        memory_limit: limit.bytes,
    };
    memsave_meter::settle_c_allocator();
    let name = workload.name().to_owned();
    let strategies: Vec<&StrategySpec> = suite
        .strategies
        .iter()
        .filter(|s| match &options.filter {
            Some(re) => re.is_match(&format!("{name}/{}", s.name)),
            None => true,
        })
        .collect();
    let x = {
        let _limit = limit.hold();
        isolated(|| {
            workload
                .batch(workload.global_batch())
                .map_err(|e| CaseError(e.to_string()))
        })
    };
    let cases = match x {
        Ok(x) => {
            let mut bench = Workbench {
                model: workload,
                x,
                reference: None,
            };
            run_model(&mut bench, &strategies, &settings, &limit, &mut Silent)
        }
        Err(error) => strategies
            .iter()
            .map(|s| {
                CaseResult::failed(
                    &name,
                    &s.name,
                    Status::Error,
                    format!("making the input batch failed: {error}"),
                )
            })
            .collect(),
    };
    Ok(report(suite, device, cases))
}

pub(crate) struct Settings {
    device: Device,
    seed: u64,
    warmup: usize,
    /// The least number of timed rounds.
    repeats: usize,
    /// When to add rounds past `repeats`.
    rounds: Rounds,
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

/// The suite's simulated memory limit: in force while a model is built and its cases
/// measured, not while their steps are timed in rounds (see the module documentation).
pub(crate) struct SuiteLimit {
    device: Device,
    bytes: Option<u64>,
}

impl SuiteLimit {
    /// The limit `bytes` on `device`, once applied and lifted to check that it can be.
    fn new(device: Device, bytes: Option<u64>) -> Result<Self, RunError> {
        drop(LimitGuard::set(device, bytes)?);
        Ok(Self { device, bytes })
    }

    /// Puts the limit in force until the guard is dropped.
    fn hold(&self) -> Option<memsave_meter::MemoryLimitGuard> {
        // Cannot fail: `new` applied the same limit on the same device.
        LimitGuard::set(self.device, self.bytes).ok().flatten()
    }
}

/// The order a model's cases are measured in (positions in `strategies`): suite
/// order, except that strategies writing into their input (`inplace_add`, `add_out`)
/// run after all others. `x += f(x)` on a tensor saved for backward makes a reference
/// cycle inside libtorch's autograd graph (through the view the matmul saved and the
/// `grad_fn` the failed backward regenerates for it), so its tensor is never freed;
/// measuring those cases last keeps every other case's `start_bytes` at parameters
/// plus input. Results are reported, and timed rounds run, in suite order.
fn run_order(strategies: &[&StrategySpec]) -> Vec<usize> {
    let writes_input = |s: &StrategySpec| resolve(s).is_ok_and(|c| c.residual.writes_input());
    let mut order: Vec<usize> = (0..strategies.len()).collect();
    order.sort_by_key(|&i| writes_input(strategies[i])); // stable: suite order otherwise
    order
}

/// A model, its input, and the baseline gradients its cases are compared with.
struct Workbench<'m> {
    model: &'m mut dyn Workload,
    x: Batch,
    reference: Option<Vec<Vec<f32>>>,
}

/// A bundled model built from the suite's seed, so a rebuild is identical.
fn build_bundled(spec: &ModelSpec, settings: &Settings) -> Result<(Model, Batch), CaseError> {
    isolated(|| {
        tch::manual_seed(settings.seed as i64);
        let model = Model::build(spec, settings.device).map_err(|e| e.to_string())?;
        let x = model.data();
        Ok((model, x))
    })
}

/// Runs `strategies` (one model's, in suite order) on `bench`: first each case's
/// setup, warm-up and memory step, one case after another in [`run_order`], under
/// the suite's limit; then the timed steps of those measured, in rounds
/// ([`time_in_rounds`]). Returns the results in suite order.
fn run_model(
    bench: &mut Workbench<'_>,
    strategies: &[&StrategySpec],
    settings: &Settings,
    limit: &SuiteLimit,
    observer: &mut dyn Observer,
) -> Vec<CaseResult> {
    let name = bench.model.name().to_owned();
    let mut results: Vec<Option<CaseResult>> = vec![None; strategies.len()];
    let mut measured = Vec::new();
    {
        let _limit = limit.hold();
        for i in run_order(strategies) {
            let strategy = strategies[i];
            observer.case_started(&name, &strategy.name);
            match run_case(bench, strategy, settings) {
                FirstPass::Measured(case, timing) => measured.push(Measured {
                    index: i,
                    case,
                    timing: *timing,
                }),
                FirstPass::Done(mut case) => {
                    case.is_baseline = strategy.is_baseline();
                    observer.case_finished(&case);
                    results[i] = Some(case);
                }
            }
        }
    }
    measured.sort_by_key(|m| m.index);
    time_in_rounds(
        &mut *bench.model,
        strategies,
        &mut measured,
        settings,
        observer,
    );
    for m in measured {
        let mut case = m.case;
        case.is_baseline = strategies[m.index].is_baseline();
        observer.case_finished(&case);
        results[m.index] = Some(case);
    }
    results.into_iter().flatten().collect()
}

/// A case measured in the first pass, waiting for its timed rounds.
struct Measured {
    /// Its strategy's position in the model's strategies.
    index: usize,
    /// Every figure but the time.
    case: CaseResult,
    timing: Timing,
}

/// What a case's timed steps need: its step, its batch (a halved one under
/// `auto_batch`) and the schedule its setup left on the layers (fixed, solved from a
/// budget, or `fit`'s choice), put back before each of its steps.
struct Timing {
    config: StepConfig,
    x: Batch,
    schedule: Schedule,
    /// The lever of each block of the measured step (a model of blocks, or a chain
    /// under per-layer levers: `fit`'s per-block choice among them), put back before
    /// each timed step.
    block_levers: Option<Vec<(BlockKey, BlockLever)>>,
    /// Each block call of the measured step's last forward and its lever's name: every
    /// timed step must run the same, or its time is another configuration's.
    ran: Vec<(BlockKey, String)>,
}

/// Each block call of `model`'s last forward with its lever's name (none for a chain
/// under a schedule).
fn blocks_ran(model: &dyn Workload) -> Vec<(BlockKey, String)> {
    memsave_step::plan::planned_blocks(model).map_or_else(Vec::new, |blocks| {
        blocks
            .last_forward()
            .into_iter()
            .map(|r| (r.key, r.lever))
            .collect()
    })
}

/// How the first pass of a case ended.
enum FirstPass {
    /// Measured; waits for its timed rounds.
    Measured(CaseResult, Box<Timing>),
    /// Did not run, or failed: final.
    Done(CaseResult),
}

/// Sets up and measures one case (see [`measure_case`]) and leaves the model as the
/// next case expects it.
fn run_case(bench: &mut Workbench<'_>, strategy: &StrategySpec, settings: &Settings) -> FirstPass {
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
            return FirstPass::Done(CaseResult::failed(
                &name,
                &strategy.name,
                Status::Unavailable,
                reason.to_string(),
            ))
        }
    };
    if model.blocks().is_some() {
        if let Err(e) = memsave_step::plan::apply_block_plan(model, &config) {
            return FirstPass::Done(CaseResult::failed(
                &name,
                &strategy.name,
                Status::Unavailable,
                e.to_string(),
            ));
        }
    }
    if !model.set_residual(config.residual) {
        model.set_residual(ResidualUpdate::Add);
        return FirstPass::Done(CaseResult::failed(
            &name,
            &strategy.name,
            Status::Unavailable,
            format!(
                "the model '{name}' has no residual blocks to apply {:?} to (the workload's set_residual declined it)",
                config.residual
            ),
        ));
    }
    let outcome = isolated(|| measure_case(model, x, strategy, &config, settings, reference));
    // Leave the model as the next case expects it, whatever happened.
    model.set_residual(ResidualUpdate::Add);
    model.stop_trace();
    let _ = model.layers_mut().set_plan(Plan::None);
    if let Some(blocks) = model.blocks() {
        blocks.set_every(memsave_checkpoint::BlockLever::Keep);
    }
    let _ = memsave_accum::free_grads(&model.parameters());
    match outcome {
        Ok((case, timing)) => FirstPass::Measured(
            CaseResult {
                model: name,
                strategy: strategy.name.clone(),
                ..case
            },
            Box::new(timing),
        ),
        Err(error) => FirstPass::Done(CaseResult::failed(
            &name,
            &strategy.name,
            Status::Error,
            error.0,
        )),
    }
}

/// The first pass of one case: its setup (plan, search), its warm-up steps and the
/// one step its memory figures, trace and gradients come from; the time is left to
/// the rounds. The optimizer, the scaler and the weights the optimizer changed do not
/// outlive it.
fn measure_case(
    model: &mut dyn Workload,
    x: &Batch,
    strategy: &StrategySpec,
    config: &StepConfig,
    settings: &Settings,
    reference: &mut Option<Vec<Vec<f32>>>,
) -> Result<(CaseResult, Timing), CaseError> {
    let device = settings.device;
    let mut config = config.clone();
    let config = &mut config;
    let mut tries = None;
    let mut choice = None;
    let mut fit_device_peak_bytes = None;
    let mut x = x.shallow_clone();
    let search = strategy.techniques.iter().find_map(|t| match t {
        Technique::AutoBatch(spec) => Some(Search::Halving(spec.clone())),
        Technique::Fit(spec) => Some(Search::Fit(spec.clone())),
        _ => None,
    });
    match &search {
        Some(Search::Fit(spec)) => {
            let mut request = memsave_fit::FitRequest::new(spec.budget.bytes);
            request.allow = spec.allowed();
            request.per_block = !spec.uniform;
            // `{with: [{fit: ..}, {optimizer: ..}]}`: the optimizer fit steps.
            request.optimizer = config.optimizer;
            let report = memsave_fit::fit(model, &request).map_err(|e| e.to_string())?;
            // fit left the chosen schedule on the layers.
            *config = report.choice.step_config(report.optimizer);
            tries = Some(report.tries);
            choice = Some(report.choice.strategy.clone());
            fit_device_peak_bytes = Some(report.measured_peak_bytes);
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
    // The memory step follows the warm-up, or, without one, a first step when more
    // than one step is timed: its figures are a steady step's (an optimizer's state
    // exists at its start), as they were when the last of the repeats measured them.
    let before = if settings.warmup == 0 && settings.repeats > 1 {
        1
    } else {
        settings.warmup
    };
    for _ in 0..before {
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
    let last = f_step_with(
        model,
        x,
        config,
        device,
        true,
        scaler.as_mut(),
        optimizer.as_mut(),
    )
    .map_err(|e| e.to_string())?;
    let timing = Timing {
        config: config.clone(),
        x: x.shallow_clone(),
        schedule: model.layers().schedule().clone(),
        block_levers: memsave_step::plan::block_levers(&*model),
        ran: blocks_ran(&*model),
    };
    let grads = f_grads(&model.parameters()).map_err(|e| e.to_string())?;
    let mut case = CaseResult {
        model: String::new(),
        strategy: String::new(),
        status: Status::Ok,
        error: None,
        start_bytes: Some(last.start_bytes),
        peak_bytes: Some(last.peak_bytes),
        retained_after_forward_bytes: Some(last.retained_after_forward_bytes),
        step_time_s: None,
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
        parameter_bytes: None,
        gathered_peak_bytes: None,
        global_batch: Some(x.len()),
        tries,
        choice,
        fit_device_peak_bytes,
        rounds: None,
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
    Ok((case, timing))
}

/// The second pass: times `cases` (the cases of one model measured in the first pass,
/// in suite order; `strategies` are the model's) in `settings.repeats` rounds or more
/// (until every median still timed is steady, see [`crate::spread`]), each
/// stepping every case once, forwards in even rounds and backwards in odd ones (see
/// the module documentation). Cases with an optimizer or a scaler first get a fresh
/// one and `settings.warmup` untimed steps, in the same alternating order, and keep
/// it through the rounds; except an optimizer stepping in backward, which holds a hook
/// on every parameter (libtorch keeps one per tensor, and alive during another case's
/// step it would step on that case's gradients): it gets a fresh one, and its warm-up
/// steps, in each round, and is dropped right after its timed step. Sets each case's
/// `step_time_s` and `rounds`, or turns it into an error when a step fails.
fn time_in_rounds(
    model: &mut dyn Workload,
    strategies: &[&StrategySpec],
    cases: &mut [Measured],
    settings: &Settings,
    observer: &mut dyn Observer,
) {
    if cases.is_empty() {
        return;
    }
    let name = model.name().to_owned();
    let n = cases.len();
    let _stream = crate::models::RandomStreamGuard::save();
    let params = model.parameters();
    let mut failed: Vec<Option<String>> = vec![None; n];
    let per_round: Vec<bool> = cases
        .iter()
        .map(|c| c.timing.config.optimizer.is_some_and(|o| o.in_backward))
        .collect();
    let mut states: Vec<CaseState> = Vec::with_capacity(n);
    for ((c, failure), &per_round) in cases.iter().zip(failed.iter_mut()).zip(&per_round) {
        if per_round {
            states.push(CaseState::default());
            continue;
        }
        states.push(
            CaseState::build(&c.timing.config, &params).unwrap_or_else(|e| {
                *failure = Some(format!("before the timed rounds: {e}"));
                CaseState::default()
            }),
        );
    }
    let weights = if cases.iter().any(|c| c.timing.config.optimizer.is_some()) {
        match SavedWeights::save(&params) {
            Ok(w) => Some(RestoreOnDrop(w)),
            Err(e) => {
                for (c, failure) in cases.iter().zip(failed.iter_mut()) {
                    if c.timing.config.optimizer.is_some() {
                        *failure = Some(format!("before the timed rounds: {e}"));
                    }
                }
                None
            }
        }
    } else {
        None
    };
    let order = |round: usize| -> Vec<usize> {
        if round % 2 == 0 {
            (0..n).collect()
        } else {
            (0..n).rev().collect()
        }
    };
    let mut levers = None;
    let mut step = |k: usize, timing: &Timing, state: &mut CaseState| {
        timed_step(
            model,
            k,
            timing,
            state,
            &mut levers,
            weights.as_ref().map(|w| &w.0),
            settings.device,
        )
    };
    for round in 0..settings.warmup {
        for k in order(round) {
            if failed[k].is_none() && states[k].changes_per_step() {
                if let Err(e) = step(k, &cases[k].timing, &mut states[k]) {
                    failed[k] = Some(format!("warm-up before the timed rounds: {e}"));
                }
            }
        }
    }
    let most = settings.rounds.most(settings.repeats);
    let mut times = vec![Vec::with_capacity(settings.repeats); n];
    let started = std::time::Instant::now();
    let mut round = 0;
    loop {
        // Every case still timed steady (or a cap reached): done.
        let spreads = times
            .iter()
            .zip(&failed)
            .filter(|(_, f)| f.is_none())
            .map(|(t, _)| spread(t));
        let elapsed_s = started.elapsed().as_secs_f64();
        if settings
            .rounds
            .enough(round, settings.repeats, elapsed_s, spreads)
        {
            break;
        }
        for k in order(round) {
            if failed[k].is_some() {
                continue;
            }
            let timing = &cases[k].timing;
            let strategy = &strategies[cases[k].index].name;
            let mut ready = Ok(());
            if per_round[k] {
                ready = CaseState::build(&timing.config, &params).map(|s| states[k] = s);
                for _ in 0..settings.warmup {
                    ready = ready.and_then(|()| step(k, timing, &mut states[k]).map(drop));
                }
            }
            let outcome = ready.and_then(|()| {
                observer.timed_step(&name, strategy, round, most);
                step(k, timing, &mut states[k])
            });
            if per_round[k] {
                // Its hooks go with it.
                states[k] = CaseState::default();
            }
            match outcome {
                Ok(seconds) => times[k].push(seconds),
                Err(e) => failed[k] = Some(format!("timed round {}: {e}", round + 1)),
            }
        }
        round += 1;
    }
    // Leave the model as the suite built it.
    drop(states);
    drop(weights);
    model.set_residual(ResidualUpdate::Add);
    let _ = model.layers_mut().set_plan(Plan::None);
    if let Some(blocks) = model.blocks() {
        blocks.set_every(memsave_checkpoint::BlockLever::Keep);
    }
    let _ = memsave_accum::free_grads(&params);
    for ((c, failure), times) in cases.iter_mut().zip(failed).zip(times) {
        match failure {
            Some(error) => {
                c.case = CaseResult::failed(&c.case.model, &c.case.strategy, Status::Error, error)
            }
            None => {
                c.case.step_time_s = StepTime::from_times(times);
                c.case.rounds = Some(round);
            }
        }
    }
}

/// A case's training state through the timed rounds: its own scaler and optimizer,
/// kept from step to step as a training loop keeps them.
#[derive(Default)]
struct CaseState {
    scaler: Option<GradScaler>,
    optimizer: Option<CaseOptimizer>,
}

impl CaseState {
    fn build(config: &StepConfig, params: &[Tensor]) -> Result<Self, CaseError> {
        Ok(Self {
            scaler: config
                .scaler
                .map(GradScaler::new)
                .transpose()
                .map_err(|e| e.to_string())?,
            optimizer: config
                .optimizer
                .map(|spec| CaseOptimizer::build(&spec, params))
                .transpose()
                .map_err(|e| e.to_string())?,
        })
    }

    /// Whether a step changes the state (so it needs warm-up steps of its own).
    fn changes_per_step(&self) -> bool {
        self.scaler.is_some() || self.optimizer.is_some()
    }
}

/// One step of case `k` in the rounds: puts the case's residual update and schedule
/// on the model (planning a `checkpoint` strategy with stores again when `levers`, the
/// case whose stores the layers hold, is another), steps, then puts back `weights`
/// after an optimizer's step and frees the gradients. Returns the step's time.
fn timed_step(
    model: &mut dyn Workload,
    k: usize,
    timing: &Timing,
    state: &mut CaseState,
    levers: &mut Option<usize>,
    weights: Option<&SavedWeights>,
    device: Device,
) -> Result<f64, CaseError> {
    isolated(|| {
        let config = &timing.config;
        if !model.set_residual(config.residual) {
            return Err(CaseError(format!(
                "the workload declined its residual update {:?}",
                config.residual
            )));
        }
        if matches!(config.plan, PlanChoice::BudgetWithLevers { .. }) && *levers != Some(k) {
            *levers = None;
            apply_plan(model, &timing.x, config, device).map_err(|e| e.to_string())?;
            *levers = Some(k);
        }
        model
            .layers_mut()
            .set_schedule(timing.schedule.clone())
            .map_err(|e| e.to_string())?;
        // The measured step's levers, block by block (`fit`'s per-block choice is not
        // the configuration's plan, which keeps every block).
        // (None only for a chain under its schedule, set above.)
        if let Some(levers) = &timing.block_levers {
            memsave_step::plan::set_block_levers(model, levers.clone())
                .map_err(|e| e.to_string())?;
        }
        let m = f_step_with(
            model,
            &timing.x,
            config,
            device,
            false,
            state.scaler.as_mut(),
            state.optimizer.as_mut(),
        )
        .map_err(|e| e.to_string());
        let ran = blocks_ran(&*model);
        let same = if m.is_ok() && ran != timing.ran {
            let differs = timing
                .ran
                .iter()
                .zip(&ran)
                .find(|(a, b)| a != b)
                .map_or_else(
                    || {
                        format!(
                            "{} block calls where it ran {}",
                            ran.len(),
                            timing.ran.len()
                        )
                    },
                    |((key, lever), (_, now))| {
                        format!("block {key} under {now} where it ran under {lever}")
                    },
                );
            Err(CaseError(format!(
                "a timed step ran other levers than the measured step ({differs}): its time would be another configuration's"
            )))
        } else {
            Ok(())
        };
        if let (Some(_), Some(weights)) = (&state.optimizer, weights) {
            weights.restore().map_err(|e| e.to_string())?;
        }
        let _ = memsave_accum::free_grads(&model.parameters());
        same?;
        Ok(m?.time_s)
    })
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
) -> Result<(i64, usize), CaseError> {
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
                return Err(CaseError(format!(
                "auto_batch: even a batch of 1 does not fit the budget of {} after {tries} tries",
                memsave_meter::Bytes(budget)
            )))
            }
            Err((false, e)) => return Err(CaseError(e)),
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
) -> Result<Vec<Vec<f32>>, CaseError> {
    let config = StepConfig::baseline();
    model.set_residual(config.residual);
    model
        .layers_mut()
        .set_plan(Plan::None)
        .map_err(|e| e.to_string())?;
    memsave_step::plan::apply_block_plan(model, &config).map_err(|e| e.to_string())?;
    f_step(model, x, &config, device, false, None).map_err(|e| e.to_string())?;
    Ok(f_grads(&model.parameters()).map_err(|e| e.to_string())?)
}

/// Runs `f`, turning a panic into an error with its message; either way the error is
/// one line a person can act on ([`one_line`]).
fn isolated<T>(f: impl FnOnce() -> Result<T, CaseError>) -> Result<T, CaseError> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| CaseError(one_line(&e.0))),
        Err(payload) => {
            let text = memsave_sys::checkpoint::panic_message(&*payload);
            Err(CaseError(format!("panicked: {}", one_line(&text))))
        }
    }
}

/// Why a case failed, as the one line its report shows (a case's error is text in the
/// report: it may come from libtorch, a lever, the workload's own code or a panic).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
struct CaseError(String);

impl From<String> for CaseError {
    fn from(message: String) -> Self {
        CaseError(message)
    }
}

impl From<&str> for CaseError {
    fn from(message: &str) -> Self {
        CaseError(message.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::Suite;
    use memsave_checkpoint::BlockLever;

    /// A timed step of a case runs the measured step's levers block by block (`fit`'s
    /// per-block choice is not the configuration's plan, which keeps every block: the
    /// rounds used to time every block kept), and refuses to time other levers.
    #[test]
    fn a_timed_step_runs_the_measured_step_s_block_levers() {
        let yaml = "suite: t\nmodels:\n  - {name: u, kind: unet, image: [2, 16, 16], classes: 3, base: 4, levels: 2, batch: 2}\nstrategies:\n  - baseline\n";
        let suite = Suite::from_yaml(yaml, "t.yaml").unwrap();
        let mut model = Model::build(&suite.models[0], Device::Cpu).unwrap();
        let x = model.batch(2).unwrap();
        let config = StepConfig::baseline();
        memsave_step::plan::apply_block_plan(&model, &config).unwrap();
        f_step(&model, &x, &config, Device::Cpu, false, None).unwrap();
        let keys = model.blocks().unwrap().keys();
        assert!(keys.len() > 2, "{keys:?}");
        // A per-block choice: the first two blocks recomputed, the others kept.
        let chosen: Vec<(BlockKey, BlockLever)> = keys[..2]
            .iter()
            .map(|k| (k.clone(), BlockLever::Recompute))
            .collect();
        memsave_step::plan::set_block_levers(&mut model, chosen).unwrap();
        f_step(&model, &x, &config, Device::Cpu, false, None).unwrap();
        let mut timing = Timing {
            config: config.clone(),
            x: x.shallow_clone(),
            schedule: model.layers().schedule().clone(),
            block_levers: memsave_step::plan::block_levers(&model),
            ran: blocks_ran(&model),
        };
        let levers: Vec<&str> = timing.ran.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(levers[..3], ["recompute", "recompute", "keep"]);
        let params = model.parameters();
        let mut state = CaseState::build(&config, &params).unwrap();
        let mut stores = None;
        timed_step(
            &mut model,
            0,
            &timing,
            &mut state,
            &mut stores,
            None,
            Device::Cpu,
        )
        .unwrap();
        assert_eq!(blocks_ran(&model), timing.ran);
        // A timed step that would run other levers than the measured one is refused.
        timing.ran[0].1 = "keep".into();
        let err = timed_step(
            &mut model,
            0,
            &timing,
            &mut state,
            &mut stores,
            None,
            Device::Cpu,
        )
        .unwrap_err()
        .0;
        assert!(
            err.contains("other levers than the measured step")
                && err.contains(&format!(
                    "block {} under recompute where it ran under keep",
                    keys[0]
                )),
            "{err}"
        );
    }
}
