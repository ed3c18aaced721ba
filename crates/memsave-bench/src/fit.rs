//! `memsave fit`: `memsave_fit::fit` on a model of a suite, built as the runner
//! builds it (same seed, same input), optionally with an optimizer; with a world size,
//! on that many local ranks ([`fit_model_on_ranks`]).
use crate::distributed::{launch_ranks, rank_program, suite_for_ranks, DistributedError};
use crate::message::one_line;
use crate::models::Model;
use crate::runner::{resolve_device, RunError};
use crate::suite::{
    ModelSpec, ModelSpecError, OptimizerKind, OptimizerSpec, StatePrecision, Suite, Technique,
};
use memsave_dist::{init_process_group, DistError, InitOptions};
use memsave_fit::{fit_with, Allow, FitEvent};
use memsave_fit::{FitError, FitReport, FitRequest};
use memsave_meter::Bytes;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why `fit` could not run on a suite's model.
#[derive(Debug, thiserror::Error)]
pub enum FitCaseError {
    /// No model of that name in the suite.
    #[error("the suite has no model '{name}' (models: {known})")]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// The suite's model names.
        known: String,
    },
    /// The requested global batch is outside the limits a suite's model is held to.
    #[error("a global batch of {batch}: {source}")]
    GlobalBatch {
        /// The global batch asked for.
        batch: i64,
        /// Why, in the suite's words ([`ModelSpec::with_global_batch`]'s error).
        #[source]
        source: ModelSpecError,
    },
    /// Found before building anything: the least every configuration holds is more
    /// than the budget, or than the memory there is.
    #[error("{0}")]
    TooLarge(String),
    /// The suite's device is not available.
    #[error(transparent)]
    Device(#[from] RunError),
    /// Building the model failed.
    #[error("building the model failed: {0}")]
    Build(String),
    /// `fit` itself gave no answer.
    #[error(transparent)]
    Fit(#[from] FitError),
    /// On ranks: what a rank failed with (its own words after `rank R:`).
    #[error("rank {rank}: {message}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// On ranks: a rank could not read what it was asked (the suite or the request the
    /// parent wrote for it).
    #[error("{0}")]
    RankInput(String),
    /// On ranks: rank 0 could not draw the report's picture.
    #[error("plot: {0}")]
    Plot(String),
    /// On ranks: they could not be started, did not end in time, were interrupted,
    /// or one failed without saying why (see
    /// [`DistributedError::interrupted_by`]).
    #[error(transparent)]
    Ranks(#[from] DistributedError),
}

/// Runs `fit` on the suite's model `model` (built from the suite's seed on the suite's
/// device, under its thread count), with `optimizer` stepped in every step if given.
///
/// Before anything is built, the request is checked against what the suite says of
/// the model: a `global_batch` over the suite's limits is refused, and so is a model
/// whose parameters, optimizer state, batch (input and target) and largest gradient
/// (the least any configuration holds) do not fit the memory available, or whose
/// largest gradient alone does not fit the budget (see [`least_memory`]). A model
/// near the parameter limit otherwise takes minutes to build before failing.
pub fn fit_model(
    suite: &Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
) -> Result<FitReport, FitCaseError> {
    fit_model_with(suite, model, request, optimizer, &mut |_| {})
}

/// [`fit_model`], telling `progress` each phase of the fit as it starts
/// ([`memsave_fit::fit_with`]).
pub fn fit_model_with(
    suite: &Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
    progress: &mut dyn FnMut(&FitEvent),
) -> Result<FitReport, FitCaseError> {
    let spec = checked_spec(suite, model, request, optimizer.as_ref(), 1)?;
    let device = resolve_device(suite.device)?;
    memsave_meter::install();
    if let Some(n) = suite.threads {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    tch::manual_seed(suite.seed as i64);
    let model = std::panic::catch_unwind(|| Model::build(spec, device))
        .map_err(|payload| {
            FitCaseError::Build(format!(
                "the model's constructor panicked: {}",
                one_line(&memsave_sys::checkpoint::panic_message(&*payload))
            ))
        })?
        .map_err(|e| FitCaseError::Build(one_line(&e.to_string())))?;
    let mut workload = model.with_optimizer(optimizer);
    Ok(fit_with(&mut workload, request, progress)?)
}

/// The suite's model `model`, checked against `request` before anything is built (see
/// [`fit_model`]), for a fit on `world_size` ranks (1: one process).
fn checked_spec<'s>(
    suite: &'s Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<&OptimizerSpec>,
    world_size: usize,
) -> Result<&'s ModelSpec, FitCaseError> {
    let spec = suite
        .models
        .iter()
        .find(|m| m.name == model)
        .ok_or_else(|| FitCaseError::UnknownModel {
            name: model.to_owned(),
            known: suite
                .models
                .iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    if let Some(batch) = request.global_batch {
        spec.with_global_batch(batch)
            .map_err(|source| FitCaseError::GlobalBatch { batch, source })?;
    }
    let least = least_memory(spec, request, optimizer);
    check_least(
        &least,
        spec,
        request,
        suite.memory_limit.as_ref().map(|s| s.bytes),
        world_size,
    )?;
    Ok(spec)
}

/// What `memsave fit --world-size N` gives: rank 0's report, as text, as JSON and,
/// when asked, as a picture (its figures are every rank's: the ranks agree on every
/// one, and the report lists each rank's measured peak).
#[derive(Debug, Clone, PartialEq)]
pub struct RanksFit {
    /// [`FitReport::to_text`].
    pub text: String,
    /// The report as JSON.
    pub json: String,
    /// [`crate::fit_svg`] of the report, when asked for.
    pub svg: Option<String>,
    /// Seconds the fit took (rank 0's).
    pub fit_time_s: f64,
}

/// A rank request written without `per_block` asks for the default.
fn per_block_default() -> bool {
    true
}

/// What the ranks of [`fit_model_on_ranks`] are asked (`request.json` next to the
/// suite): the request and the optimizer, in plain values.
#[derive(Debug, Serialize, Deserialize)]
struct RankRequest {
    model: String,
    budget_bytes: u64,
    global_batch: Option<i64>,
    margin: f64,
    exhaustive: bool,
    #[serde(default = "per_block_default")]
    per_block: bool,
    bf16: bool,
    compress: bool,
    int8_state: bool,
    micro_batches: bool,
    optimizer: Option<RankOptimizer>,
    svg: bool,
}

/// The optimizer's kind, hyperparameters and state precision (its placement and
/// whether it steps in backward are fit's to choose).
#[derive(Debug, Serialize, Deserialize)]
struct RankOptimizer {
    sgd: bool,
    lr: Option<f64>,
    betas: Option<(f64, f64)>,
    eps: Option<f64>,
    weight_decay: Option<f64>,
    momentum: Option<f64>,
    state: u8,
}

impl RankOptimizer {
    fn of(o: &OptimizerSpec) -> Self {
        Self {
            sgd: o.kind == OptimizerKind::Sgd,
            lr: o.lr,
            betas: o.betas,
            eps: o.eps,
            weight_decay: o.weight_decay,
            momentum: o.momentum,
            state: match o.state {
                StatePrecision::F32 => 32,
                StatePrecision::Bf16 => 16,
                StatePrecision::Int8 => 8,
            },
        }
    }

    fn spec(&self) -> OptimizerSpec {
        OptimizerSpec {
            kind: if self.sgd {
                OptimizerKind::Sgd
            } else {
                OptimizerKind::Adamw
            },
            lr: self.lr,
            betas: self.betas,
            eps: self.eps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            state: match self.state {
                16 => StatePrecision::Bf16,
                8 => StatePrecision::Int8,
                _ => StatePrecision::F32,
            },
            ..OptimizerSpec::default()
        }
    }
}

/// What a rank wrote (`fit-rank{R}.json`): its error, or (rank 0) the report.
#[derive(Debug, Default, Serialize, Deserialize)]
struct RankOutcome {
    error: Option<String>,
    text: Option<String>,
    json: Option<String>,
    svg: Option<String>,
    fit_time_s: f64,
}

/// [`fit_model`] on `world_size` local ranks (processes started by `memsave_dist`'s
/// launcher, each the `memsave` binary's hidden `fit-rank` subcommand, which calls
/// [`run_fit_rank`]): every rank builds the suite's model, joins the group and runs
/// `memsave_fit::fit` on it with the request [`on_ranks`](FitRequest::on_ranks), so
/// the data-parallel mode is chosen with the other levers and `budget_bytes` is per
/// rank (counting the parameters and the optimizer's state). Rank 0's report comes
/// back; `svg` asks for its picture too.
///
/// The model is checked as [`fit_model`] checks it before any rank starts, and the
/// global batch must divide among the ranks. `rank_program` is the program whose
/// `fit-rank` subcommand runs a rank (default: this process's executable, which must
/// then be the `memsave` binary).
///
/// # Errors
/// What [`fit_model`] refuses; [`FitCaseError::Rank`] with the first failed rank's
/// own error (its `fit` failed, or its step: a rank cannot go on alone);
/// [`FitCaseError::Ranks`] when they could not start, ran past ten minutes, or a
/// signal interrupted them.
pub fn fit_model_on_ranks(
    suite: &Suite,
    model: &str,
    request: &FitRequest,
    optimizer: Option<OptimizerSpec>,
    world_size: usize,
    svg: bool,
    rank_program_path: Option<&Path>,
) -> Result<RanksFit, FitCaseError> {
    let spec = checked_spec(suite, model, request, optimizer.as_ref(), world_size)?;
    let global = request
        .global_batch
        .or_else(|| spec.batch.first().copied())
        .unwrap_or(1);
    if global % world_size.max(1) as i64 != 0 {
        return Err(FitError::Indivisible {
            global_batch: global,
            world_size,
        }
        .into());
    }
    let program = rank_program(rank_program_path)?;
    let (dir, _suite_file) = suite_for_ranks(suite)?;
    let asked = RankRequest {
        model: model.to_owned(),
        budget_bytes: request.budget_bytes,
        global_batch: request.global_batch,
        margin: request.margin,
        exhaustive: request.exhaustive,
        per_block: request.per_block,
        bf16: request.allow.bf16,
        compress: request.allow.compress,
        int8_state: request.allow.int8_state,
        micro_batches: request.allow.micro_batches,
        optimizer: optimizer.as_ref().map(RankOptimizer::of),
        svg,
    };
    let request_file = dir.path().join("request.json");
    std::fs::write(
        &request_file,
        serde_json::to_string(&asked).map_err(DistributedError::Json)?,
    )
    .map_err(|source| DistributedError::Io {
        what: format!("cannot write {}", request_file.display()),
        source,
    })?;
    let args: Vec<OsString> = vec!["fit-rank".into(), dir.path().into()];
    let launched = launch_ranks(&program, &args, world_size);
    let outcome = |rank: usize| read_outcome(dir.path(), rank);
    let first_error = || {
        (0..world_size).find_map(|rank| {
            let message = outcome(rank).ok()?.error?;
            Some(FitCaseError::Rank { rank, message })
        })
    };
    match launched {
        Ok(()) => {}
        Err(e) if e.interrupted_by().is_some() => return Err(e.into()),
        Err(DistributedError::Launch(DistError::RankFailed {
            rank,
            status,
            exit_code,
        })) => {
            return Err(match outcome(rank).ok().and_then(|o| o.error) {
                Some(message) => FitCaseError::Rank { rank, message },
                None => DistributedError::Launch(DistError::RankFailed {
                    rank,
                    status,
                    exit_code,
                })
                .into(),
            })
        }
        Err(e) => return Err(first_error().unwrap_or(e.into())),
    }
    if let Some(e) = first_error() {
        return Err(e);
    }
    let first = outcome(0)?;
    Ok(RanksFit {
        text: first.text.unwrap_or_default(),
        json: first.json.unwrap_or_default(),
        svg: first.svg,
        fit_time_s: first.fit_time_s,
    })
}

/// What rank `rank` wrote into `dir`.
fn read_outcome(dir: &Path, rank: usize) -> Result<RankOutcome, DistributedError> {
    let path = dir.join(format!("fit-rank{rank}.json"));
    std::fs::read_to_string(&path)
        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        .and_then(|text| serde_json::from_str(&text).map_err(|e| e.into()))
        .map_err(|source| DistributedError::Figures { rank, path, source })
}

/// One rank of [`fit_model_on_ranks`] (the hidden `memsave fit-rank DIR`), as the
/// environment names it (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, set by
/// the launcher): reads `suite.yaml` and `request.json` in `dir`, joins the group,
/// fits, and writes `fit-rank{RANK}.json` there (its error, or on rank 0 the report);
/// rank 0 prints each phase of the fit on stderr.
///
/// # Errors
/// [`FitCaseError::Rank`] (after writing it) when this rank's fit failed, so that the
/// launcher ends the others at once; [`FitCaseError::Ranks`] when the group could not
/// be joined or the file written.
pub fn run_fit_rank(dir: &Path) -> Result<(), FitCaseError> {
    memsave_meter::install();
    let options = InitOptions {
        timeout: Duration::from_secs(300),
        ..Default::default()
    };
    let group = init_process_group(&options).map_err(DistributedError::Group)?;
    let rank = group.rank();
    let outcome = fit_this_rank(dir, &group).unwrap_or_else(|e| RankOutcome {
        error: Some(e.to_string()),
        ..RankOutcome::default()
    });
    let path: PathBuf = dir.join(format!("fit-rank{rank}.json"));
    let text = serde_json::to_string(&outcome).map_err(DistributedError::Json)?;
    std::fs::write(&path, text).map_err(|source| DistributedError::Io {
        what: format!("writing {}", path.display()),
        source,
    })?;
    match outcome.error {
        Some(message) => Err(FitCaseError::Rank { rank, message }),
        None => Ok(()),
    }
}

/// This rank's fit, as `dir` asks it.
fn fit_this_rank(
    dir: &Path,
    group: &memsave_step::ProcessGroup,
) -> Result<RankOutcome, FitCaseError> {
    let suite_file = dir.join("suite.yaml");
    let suite =
        Suite::from_file(&suite_file).map_err(|e| FitCaseError::RankInput(e.to_string()))?;
    let request_file = dir.join("request.json");
    let asked: RankRequest = std::fs::read_to_string(&request_file)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| FitCaseError::RankInput(format!("{}: {e}", request_file.display())))?;
    let mut request = FitRequest::new(asked.budget_bytes).on_ranks(group);
    request.global_batch = asked.global_batch;
    request.margin = asked.margin;
    request.exhaustive = asked.exhaustive;
    request.per_block = asked.per_block;
    request.allow = Allow {
        bf16: asked.bf16,
        compress: asked.compress,
        int8_state: asked.int8_state,
        micro_batches: asked.micro_batches,
    };
    let optimizer = asked.optimizer.as_ref().map(RankOptimizer::spec);
    let rank = group.rank();
    let report = fit_model_with(&suite, &asked.model, &request, optimizer, &mut |event| {
        if rank == 0 && event.is_phase() {
            eprintln!("fit: {event}");
        }
    })?;
    if rank != 0 {
        return Ok(RankOutcome::default());
    }
    let json = serde_json::to_string_pretty(&report).map_err(DistributedError::Json)?;
    let svg = asked
        .svg
        .then(|| crate::fit_svg(&report))
        .transpose()
        .map_err(|e| FitCaseError::Plot(e.to_string()))?;
    Ok(RankOutcome {
        error: None,
        text: Some(report.to_text()),
        json: Some(json),
        svg,
        fit_time_s: report.fit_time_s,
    })
}

/// The optimizer `memsave fit` steps when it is not told one: the suite's first
/// `optimizer` technique (alone or in a `with:` list) with its kind and
/// hyperparameters (`lr`, `betas`, `eps`, `weight_decay`, `momentum`), its state in
/// f32, on the device and stepped after backward: the state's precision (with
/// `int8_state` allowed), where the step happens and the gradients' place are fit's
/// to choose. `None` when the suite has no optimizer.
pub fn suite_optimizer(suite: &Suite) -> Option<OptimizerSpec> {
    suite.strategies.iter().find_map(|s| {
        s.techniques.iter().find_map(|t| match t {
            Technique::Optimizer(spec) => Some(OptimizerSpec {
                kind: spec.kind,
                lr: spec.lr,
                betas: spec.betas,
                eps: spec.eps,
                weight_decay: spec.weight_decay,
                momentum: spec.momentum,
                ..OptimizerSpec::default()
            }),
            _ => None,
        })
    })
}

/// The least memory any configuration of a fit holds, in bytes, computed from the
/// suite's model alone (f32 parameters); `None` where a count overflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeastMemory {
    /// The parameters.
    pub parameters: Option<u64>,
    /// The gradient of the largest parameter: whole in memory at some moment of every
    /// step, even with the step in backward or the gradients in files. It counts in
    /// the budget.
    pub largest_gradient: Option<u64>,
    /// The optimizer's state at its smallest allowed precision: a buffer per parameter
    /// for each value the rule keeps (AdamW: two moments; SGD with momentum: one, without
    /// momentum: none), at the bytes of the spec's `state` (4, 2 or 1), or 1 with
    /// `int8_state` allowed (the int8 codes' scales, 4 bytes per 256 values, are left
    /// out: this is a least).
    pub optimizer_state: Option<u64>,
    /// The largest parameter's optimizer state, at the same precision: what the device
    /// holds of the state at least on one process, where `fit` may keep the state in
    /// files and read each parameter's back for its update.
    pub largest_state: Option<u64>,
    /// The copy of the weights `fit` keeps in host memory to put them back after each
    /// run of a step that updates them (with an optimizer).
    pub weights_copy: Option<u64>,
    /// The suite's batch ([`ModelSpec::batch_bytes`]: the input at its dtype's bytes,
    /// and a zoo model's target), and the global batch's when it is larger (new
    /// tensors).
    pub batch: Option<u64>,
    /// The batch `fit` steps on: the global batch's bytes (it counts in the budget).
    pub step_batch: Option<u64>,
    /// On one process with an optimizer, the parameters may wait in files too
    /// (`offload_params`, each unit's weights read while it runs): the device then
    /// holds at least the largest parameter, not all of them.
    pub parameters_may_leave: bool,
    /// The optimizer's state of one chunk of the largest parameter: with the
    /// parameters in files the optimizer steps chunks of at most
    /// `memsave_dist::SHARD_FILE_CHUNK_VALUES` values, each with its own state.
    pub chunk_state: Option<u64>,
}

impl LeastMemory {
    /// Everything the process holds at least: all the fields added up.
    pub fn total(&self) -> Option<u64> {
        [
            self.parameters,
            self.largest_gradient,
            self.optimizer_state,
            self.weights_copy,
            self.batch,
        ]
        .into_iter()
        .try_fold(0u64, |sum, b| sum.checked_add(b?))
    }

    /// What libtorch allocates at least (all but the host copy of the weights).
    pub fn tensors(&self) -> Option<u64> {
        [
            self.parameters,
            self.largest_gradient,
            self.optimizer_state,
            self.batch,
        ]
        .into_iter()
        .try_fold(0u64, |sum, b| sum.checked_add(b?))
    }

    /// What the device holds at least at some moment of any step, all of it in the
    /// budget (which is the whole device, see `memsave_fit`): the parameters, the
    /// optimizer's state (on one process, the largest parameter's: the rest may wait in
    /// files), the batch `fit` steps on and the largest gradient. On `world_size`
    /// ranks, each rank's least: its share of all but the gradient (as ZeRO-3 shards
    /// them).
    pub fn in_budget(&self, world_size: usize) -> Option<u64> {
        self.on_one_device(world_size).tensors()
    }

    /// What one device holds at least (see [`in_budget`](Self::in_budget)), as its
    /// own least: each rank's share of the parameters, the state and the batch `fit`
    /// steps on (on one process, the largest parameter's state), the largest gradient
    /// whole, no copy of the weights.
    fn on_one_device(&self, world_size: usize) -> LeastMemory {
        let n = world_size.max(1) as u64;
        let share = |b: Option<u64>| b.map(|b| b.div_ceil(n));
        LeastMemory {
            parameters: if n == 1 && self.parameters_may_leave {
                self.largest_gradient
            } else {
                share(self.parameters)
            },
            parameters_may_leave: n == 1 && self.parameters_may_leave,
            optimizer_state: if n == 1 && self.parameters_may_leave {
                self.chunk_state
            } else if n == 1 {
                self.largest_state
            } else {
                share(self.optimizer_state)
            },
            weights_copy: Some(0),
            batch: share(self.step_batch),
            step_batch: share(self.step_batch),
            ..*self
        }
    }

    /// The parts of [`total`](Self::total) (with `host_copy`) or of
    /// [`tensors`](Self::tensors), for a message: each one not zero, by name.
    fn parts(&self, host_copy: bool) -> String {
        let mut parts = Vec::new();
        // On one device whose parameters may wait in files, `parameters` is the
        // largest one's (see `on_one_device`).
        let one_in_files = self.parameters_may_leave && self.parameters == self.largest_gradient;
        for (what, bytes) in [
            (
                if one_in_files {
                    "largest parameter"
                } else {
                    "parameters"
                },
                self.parameters,
            ),
            ("optimizer state", self.optimizer_state),
            (
                "a copy of the weights",
                if host_copy {
                    self.weights_copy
                } else {
                    Some(0)
                },
            ),
            ("largest gradient", self.largest_gradient),
            ("batch", self.batch),
        ] {
            match bytes {
                Some(0) => {}
                Some(b) => parts.push(format!("{what} {}", Bytes(b))),
                None => parts.push(format!("{what} over 2^64 bytes")),
            }
        }
        parts.join(", ")
    }
}

/// The least memory a fit of `spec` holds under `request` with `optimizer`.
pub fn least_memory(
    spec: &ModelSpec,
    request: &FitRequest,
    optimizer: Option<&OptimizerSpec>,
) -> LeastMemory {
    const F32: u64 = 4;
    let count = spec.parameter_count();
    let parameters = count.and_then(|n| n.checked_mul(F32));
    // Bytes of state per parameter value.
    let state_per_value = match optimizer {
        None => Some(0),
        Some(o) => {
            let buffers = match o.kind {
                OptimizerKind::Adamw => 2,
                OptimizerKind::Sgd if o.momentum.unwrap_or(0.0) != 0.0 => 1,
                OptimizerKind::Sgd => 0,
            };
            let per_value = if request.allow.int8_state {
                1
            } else {
                match o.state {
                    StatePrecision::F32 => 4,
                    StatePrecision::Bf16 => 2,
                    StatePrecision::Int8 => 1,
                }
            };
            Some(buffers * per_value)
        }
    };
    let optimizer_state = state_per_value.and_then(|v| count.and_then(|n| n.checked_mul(v)));
    let largest_state =
        state_per_value.and_then(|v| spec.largest_parameter().and_then(|n| n.checked_mul(v)));
    let chunk = memsave_dist::SHARD_FILE_CHUNK_VALUES as u64;
    let chunk_state = state_per_value.and_then(|v| {
        spec.largest_parameter()
            .and_then(|n| n.min(chunk).checked_mul(v))
    });
    let weights_copy = match optimizer {
        Some(_) => parameters,
        None => Some(0),
    };
    let global_batch = match request.global_batch {
        Some(b) if spec.batch.first().is_some_and(|&first| b > first) => {
            spec.with_global_batch(b).ok().and_then(|s| s.batch_bytes())
        }
        _ => Some(0),
    };
    let batch = spec
        .batch_bytes()
        .zip(global_batch)
        .and_then(|(a, b)| a.checked_add(b));
    let step_batch = match global_batch {
        Some(0) => spec.batch_bytes(),
        other => other,
    };
    LeastMemory {
        parameters,
        largest_gradient: spec.largest_parameter().and_then(|n| n.checked_mul(F32)),
        optimizer_state,
        largest_state,
        weights_copy,
        batch,
        step_batch,
        parameters_may_leave: optimizer.is_some() && request.offload_params,
        chunk_state,
    }
}

/// Refuses a fit whose least memory is over the budget or the memory there is.
fn check_least(
    least: &LeastMemory,
    spec: &ModelSpec,
    request: &FitRequest,
    memory_limit: Option<u64>,
    world_size: usize,
) -> Result<(), FitCaseError> {
    let name = &spec.name;
    let budget = Bytes(request.budget_bytes);
    let hint = "reduce layers or hidden, or use a machine with more memory";
    if let Some(limit) = memory_limit {
        if least.tensors().is_none_or(|t| t > limit) {
            return Err(FitCaseError::TooLarge(format!(
                "model '{name}' needs at least {} before its first step ({}), more than the suite's memory_limit of {}; {hint} (nothing was built)",
                least.tensors().map_or("over 2^64 bytes".to_owned(), |t| Bytes(t).to_string()),
                least.parts(false),
                Bytes(limit)
            )));
        }
    }
    if let Some((available, what)) = available_memory() {
        if least.total().is_none_or(|t| t > available) {
            let int8 = if least.optimizer_state.unwrap_or(0) > 0 && !request.allow.int8_state {
                "; --allow int8-state keeps the optimizer state in a quarter of that"
            } else {
                ""
            };
            return Err(FitCaseError::TooLarge(format!(
                "model '{name}' needs at least {} before its first step ({}), more than the {} {what}; {hint}{int8} (nothing was built)",
                least.total().map_or("over 2^64 bytes".to_owned(), |t| Bytes(t).to_string()),
                least.parts(true),
                Bytes(available)
            )));
        }
    }
    match least.in_budget(world_size) {
        Some(g) if g <= request.budget_bytes => {}
        g => {
            let shown = g.map_or("over 2^64 bytes".to_owned(), |g| {
                memsave_meter::BytesAtLeast(g).to_string()
            });
            let one = least.on_one_device(world_size);
            let parts = one.parts(false);
            let int8 = if least.optimizer_state.unwrap_or(0) > 0 && !request.allow.int8_state {
                "; --allow int8-state keeps the optimizer state in a quarter"
            } else {
                ""
            };
            let share = if world_size > 1 {
                format!(" (each rank's share of all but the gradient, on {world_size} ranks)")
            } else if least.parameters_may_leave {
                " (of the parameters, the largest; of the optimizer's state, one chunk's: the rest may wait in files)"
                    .to_owned()
            } else if least.largest_state.unwrap_or(0) > 0 {
                " (of the optimizer's state, the largest parameter's: the rest may wait in files)"
                    .to_owned()
            } else {
                String::new()
            };
            return Err(FitCaseError::TooLarge(format!(
                "no configuration fits {budget}: every step of model '{name}' holds at least {shown} on the device ({parts}: the largest parameter's gradient is whole at least once){share}, whatever the levers; give a budget of at least {shown}{int8} (nothing was built)"
            )));
        }
    }
    Ok(())
}

/// The memory this process can still have, and what limits it: the kernel's estimate
/// of available memory (`MemAvailable`), or the room left under this control group's
/// limit if that is less. `None` where neither can be read (not Linux).
pub fn available_memory() -> Option<(u64, &'static str)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let machine = meminfo.as_deref().and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|kb| kb.trim().parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    // cgroup v2 ("max" when unlimited, which does not parse), then v1.
    let group = read("/sys/fs/cgroup/memory.max")
        .zip(read("/sys/fs/cgroup/memory.current"))
        .or_else(|| {
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
                .zip(read("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
        })
        .map(|(limit, used)| limit.saturating_sub(used));
    match (machine, group) {
        (Some(m), Some(g)) if g < m => Some((g, "left under this control group's memory limit")),
        (Some(m), _) => Some((m, "this machine has available")),
        (None, Some(g)) => Some((g, "left under this control group's memory limit")),
        (None, None) => None,
    }
}
