//! Running one configuration for real on a batch of a given size: the peak of the whole
//! step on the device (the parameters, the optimizer's state, the input, the gradients
//! and everything else the step allocates; on ranks, this rank's), and the step time.
use super::choice::Choice;
use crate::lockstep::Ranks;
use crate::state::Snapshot;
use crate::{Candidate, FitError, ParallelMode, PeakBreakdown};
use memsave_checkpoint::Schedule;
use memsave_meter::{Bytes, MemoryLimitGuard};
use memsave_step::config::StepConfig;
use memsave_step::optimizer::{CaseOptimizer, SavedWeights};
use memsave_step::step::{StepEvent, StepMeasurement, StepObserver, StepRun, Unobserved};
use memsave_step::workload::{Batch, Workload};
use memsave_step::{DataParallelHandle, FsdpConfig, OptimizerSpec, StepError};
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tch::{Device, Tensor};

mod roles;
pub(crate) use roles::step_roles_at_peak;

/// What running a configuration measured.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Probe {
    /// Highest allocation over the runs less what the process held outside the
    /// training step (see [`Setup::new`]): the parameters, the optimizer's state, the
    /// input and the step's own count; the largest over the ranks.
    pub peak_bytes: u64,
    /// What the device held at the peak, by kind (this rank's, at its own peak).
    pub breakdown: PeakBreakdown,
    /// Each rank's `peak_bytes`, by rank (one entry on one process).
    pub peak_bytes_by_rank: Vec<u64>,
    /// The fastest run's step time (on ranks, the slowest rank's), seconds.
    pub time_s: f64,
    /// The fastest run's optimizer time after backward, seconds.
    pub optimizer_time_s: f64,
    /// On the CPU, the allocation above the start after every allocation and free of
    /// the first run (the meter's event recorder), when no other recording was on.
    /// This rank's own.
    pub series: Option<Arc<Vec<i64>>>,
    /// Where in `series` the second micro-batch's forward begins, if there is one.
    pub second_micro_batch: Option<usize>,
}

impl Candidate {
    /// `choice`, neither predicted nor measured yet.
    pub(crate) fn unmeasured(choice: Choice) -> Candidate {
        Candidate {
            choice,
            predicted_peak_bytes: None,
            predicted_step_time_s: None,
            predicted_fits: false,
            measured_peak_bytes: None,
            measured_breakdown: None,
            measured_step_time_s: None,
            note: None,
            measured_peak_bytes_by_rank: Vec::new(),
            kept_bytes: 0,
        }
    }

    /// Takes `p`'s measurement at the real size as this candidate's.
    pub(crate) fn measured(&mut self, p: &Probe) {
        self.measured_peak_bytes = Some(p.peak_bytes);
        self.measured_breakdown = Some(p.breakdown);
        self.measured_step_time_s = Some(p.time_s);
        self.measured_peak_bytes_by_rank = p.peak_bytes_by_rank.clone();
    }

    /// Raises this candidate's measured peaks to `p`'s where `p`'s are higher (a run
    /// again, whose time is kept elsewhere).
    pub(crate) fn measured_again(&mut self, p: &Probe) {
        if self.measured_peak_bytes.is_some_and(|b| p.peak_bytes > b) {
            self.measured_breakdown = Some(p.breakdown);
        }
        self.measured_peak_bytes = self.measured_peak_bytes.map(|b| b.max(p.peak_bytes));
        for (b, &q) in self
            .measured_peak_bytes_by_rank
            .iter_mut()
            .zip(&p.peak_bytes_by_rank)
        {
            *b = (*b).max(q);
        }
    }
}

/// Why a probe did not measure.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ProbeError {
    /// An allocation failed, or the measured peak is over the budget: the
    /// configuration does not fit.
    OutOfMemory(String),
    /// Anything else: the workload's step failed.
    Failed(String),
    /// The step ran but spoiled the model: a one-example micro-batch turned running
    /// statistics NaN ([`StepError::NonFiniteStatistics`]). The configuration is not
    /// one to train with; the statistics were put back.
    Unusable(String),
    /// On ranks, agreeing with the others failed (after this rank's step failed, when
    /// the others wait in a collective of the step: the error is this rank's own), or
    /// setting the probe up failed on this rank: the fit ends with this error.
    Fatal(FitError),
}

impl ProbeError {
    /// What went wrong, in one line.
    pub(crate) fn message(&self) -> String {
        match self {
            ProbeError::OutOfMemory(e) | ProbeError::Failed(e) | ProbeError::Unusable(e) => {
                e.clone()
            }
            ProbeError::Fatal(e) => e.to_string(),
        }
    }

    /// The same error, its message prefixed with what was being done (`what`).
    fn context(self, what: &str) -> ProbeError {
        match self {
            ProbeError::OutOfMemory(e) => ProbeError::OutOfMemory(format!("{what}: {e}")),
            ProbeError::Failed(e) => ProbeError::Failed(format!("{what}: {e}")),
            ProbeError::Unusable(e) => ProbeError::Unusable(format!("{what}: {e}")),
            fatal @ ProbeError::Fatal(_) => fatal,
        }
    }

    /// On ranks, a failure of this rank's own as the fatal error it is there (naming
    /// the rank); on one process the error as it is.
    fn on(self, ranks: &Ranks) -> ProbeError {
        match self {
            ProbeError::OutOfMemory(e) | ProbeError::Failed(e) if ranks.group().is_some() => {
                ProbeError::Fatal(FitError::Step(format!("rank {}: {e}", ranks.rank())))
            }
            other => other,
        }
    }
}

impl From<FitError> for ProbeError {
    fn from(e: FitError) -> Self {
        ProbeError::Fatal(e)
    }
}

/// Whether a step's error is an allocation that failed (libtorch's out-of-memory error,
/// the simulated one included), as `memsave_sys::Error` tells.
fn is_oom(text: &str) -> bool {
    memsave_sys::Error::new(text).is_out_of_memory()
}

/// The most bytes a probe's tensors may hold on the CPU: the machine's memory (its
/// total, or its control group's limit if lower), read once; `None` where the system
/// does not say (off Linux).
///
/// Probes run the workload's own code, so they run without the budget as a simulated
/// capacity: an allocation that fails inside a layer makes tch's short methods panic
/// there, which poisons any lock the layer holds and prints the panic. The budget is
/// checked on the measured peak instead (the counting allocator is exact). This cap
/// only turns a probe that would take more than the machine has (and be ended by the
/// kernel's out-of-memory killer) into an out-of-memory error; a layer then fails as
/// it would outside `fit`.
fn machine_memory() -> Option<u64> {
    static MACHINE: OnceLock<Option<u64>> = OnceLock::new();
    *MACHINE.get_or_init(|| {
        let total = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| {
                info.lines().find_map(|line| {
                    let kib = line.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?;
                    kib.trim().parse::<u64>().ok()
                })
            })
            .map(|kib| kib.saturating_mul(1024));
        // cgroup v2; "max" (no limit) does not parse.
        let group = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .and_then(|max| max.trim().parse::<u64>().ok());
        match (total, group) {
            (Some(t), Some(g)) => Some(t.min(g)),
            (t, g) => t.or(g),
        }
    })
}

/// Times the optimizer's part of a step, and notes where in the allocation recording
/// the second micro-batch begins.
struct Clock {
    optimizer_start: Cell<Option<Instant>>,
    forwards: Cell<usize>,
    second_forward_at: Cell<Option<usize>>,
}

impl StepObserver for Clock {
    fn step_event(&self, event: StepEvent) {
        match event {
            StepEvent::Optimizer => self.optimizer_start.set(Some(Instant::now())),
            StepEvent::Forward => {
                self.forwards.set(self.forwards.get() + 1);
                if self.forwards.get() == 2 {
                    self.second_forward_at
                        .set(Some(memsave_sys::alloc::recording_position()));
                }
            }
            _ => {}
        }
    }
}

/// Runs past this many seconds in all end a probe after its second run: the first run
/// at a size is the slow one, and a long run's time varies less.
const LONG_RUNS_S: f64 = 0.5;

/// Runs `choice` at most `runs` times, only two once they have taken more than
/// [`LONG_RUNS_S`], on `batch` examples split into `micro_batches`, with the
/// choice's schedule on the layers and a fresh optimizer (the workload's, changed by
/// the choice's levers) warmed up by a step of one example per micro-batch; the
/// weights are put back afterwards. With `budget`, a run whose peak above the
/// allocation before the first run is over `budget` ends the probe with
/// [`ProbeError::OutOfMemory`] (on every device: the peak is measured, never enforced
/// by a simulated capacity, which would make the workload's own code fail; see
/// [`machine_memory`] for the one cap in force). With `record` (on the CPU), the first
/// run records its allocations for the prediction.
///
/// On ranks (`ranks` has a group; the choice has its data-parallel mode), every rank
/// runs it on its own `batch` examples with the mode's data parallel set up for the
/// probe, the peak is measured as on one process (see [`Setup::new`]: the rank's
/// parameters or its shard of them, its optimizer state, its input and whatever the
/// mode keeps count), and
/// each run's peak and times are agreed over the ranks before anything is decided on
/// them (see [`crate::lockstep`]), and so is how each step ended (the warm-up's and
/// each run's): a step out of memory (or failed, or spoiled) on one rank ends the
/// probe with that error on every rank, so that all count the configuration alike and
/// go on together (see [`agreed_failure`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn probe(
    workload: &mut dyn Workload,
    optimizer: Option<OptimizerSpec>,
    choice: &Choice,
    batch: i64,
    micro_batches: usize,
    runs: usize,
    budget: Option<u64>,
    record: bool,
    check_statistics: bool,
    ranks: &Ranks,
) -> Result<Probe, ProbeError> {
    let (mut setup, outside) = Setup::new(workload, optimizer, choice, batch, micro_batches, ranks)
        .map_err(|e| e.on(ranks))?;
    setup.check_statistics = check_statistics;
    let warmed = setup.warm_up(&*workload, micro_batches);
    if let Err(e) = agree_step(ranks, warmed) {
        // Put the weights back (a step in backward may have moved some) before failing.
        setup.put_back(&*workload).map_err(|put| put.on(ranks))?;
        return Err(e);
    }
    let cap = machine_cap(setup.device).map_err(|e| e.on(ranks))?;
    let outcome = measure(
        &mut setup, &*workload, runs, budget, record, &outside, ranks,
    );
    drop(cap);
    setup.put_back(&*workload).map_err(|e| e.on(ranks))?;
    outcome
}

/// What the process holds outside a probe's training step (see [`Setup::new`]), and
/// what the budget counts of the model and the batch before it.
struct Outside {
    /// Allocated before the step's warm-up less what the meter reads of the model's and
    /// the batch's storages ([`Counted::read`]): the peak is measured above it.
    bytes: u64,
    /// The model's and the batch's storages: the [`Counted::unseen`] ones are added to
    /// what the meter measures.
    counted: Counted,
}

impl Outside {
    /// An allocation the meter reads (`memory_allocated`), as the budget counts it:
    /// [`relative`](Self::relative), never below zero.
    fn above(&self, allocated: u64) -> u64 {
        self.relative(allocated).max(0) as u64
    }

    /// An allocation the meter reads, less what the process holds outside the step,
    /// plus what the meter does not see; below zero when the process freed some of
    /// what it held outside (a point of a recorded series).
    fn relative(&self, allocated: u64) -> i64 {
        allocated as i64 + self.counted.unseen as i64 - self.bytes as i64
    }

    /// What the device held at a step's peak, by kind, from the step's measurement:
    /// what it held when the step began is the parameters (on ranks under ZeRO-3, this
    /// rank's shard of them, `shard_bytes`), the input and, the rest, the optimizer's
    /// state; what the step allocated above that is its own.
    fn breakdown(&self, m: &StepMeasurement, shard_bytes: Option<u64>) -> PeakBreakdown {
        let began = self.above(m.start_bytes);
        // Under ZeRO-3 the parameters are this rank's shards; the buffers stay whole.
        let parameters = shard_bytes
            .map_or(self.counted.parameter_bytes, |s| {
                s + self.counted.buffer_bytes
            })
            .min(began);
        let input = self.counted.input_bytes.min(began - parameters);
        PeakBreakdown {
            parameters,
            input,
            optimizer_state: began - parameters - input,
            step: m.peak_bytes,
            step_by_role: None,
        }
    }
}

/// What the budget counts of a probe's step before it begins besides what the meter
/// reads after it: the model's and the batch's storages on `device`, each once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counted {
    /// The parameters' and the buffers' storages (tied weights, views of one buffer:
    /// once; BatchNorm's running statistics count here).
    parameter_bytes: u64,
    /// Of those, the buffers' (not the parameters' already).
    buffer_bytes: u64,
    /// The batch's storages that are not the model's (a slice of a dataset on the
    /// device counts the dataset; input and target sharing a storage count it once).
    input_bytes: u64,
    /// Of those, what the meter sees now (it reads them in what the process holds).
    read: u64,
    /// Of those, what the meter does not see (see [`unseen`]) and the step still holds:
    /// the parameters' are left out where `sharded` (ZeRO-3 frees their storage and
    /// keeps shards the meter sees).
    unseen: u64,
}

/// What a tensor [`counted`] takes is to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Parameter,
    Buffer,
    Input,
}

/// [`Counted`] for a step on `device` of a model with `params` and `buffers` on the
/// batch `x`, with `is_unseen` saying which storages the meter does not see ([`unseen`]
/// outside tests). A storage of no bytes counts nothing, and does not hide another on
/// the same address.
fn counted(
    params: &[Tensor],
    buffers: &[Tensor],
    x: &Batch,
    device: Device,
    sharded: bool,
    is_unseen: impl Fn(&Tensor) -> Result<bool, memsave_sys::Error>,
) -> Result<Counted, memsave_sys::Error> {
    use memsave_sys::tensor::{storage_data_ptr, storage_nbytes};
    let mut seen = std::collections::HashSet::new();
    let mut c = Counted {
        parameter_bytes: 0,
        buffer_bytes: 0,
        input_bytes: 0,
        read: 0,
        unseen: 0,
    };
    let model = params
        .iter()
        .map(|p| (p, Role::Parameter))
        .chain(buffers.iter().map(|b| (b, Role::Buffer)));
    let batch = std::iter::once(&x.input)
        .chain(x.target.as_ref())
        .map(|t| (t, Role::Input));
    for (t, role) in model.chain(batch) {
        if !t.defined() || t.device() != device {
            continue;
        }
        let bytes = storage_nbytes(t)?;
        if bytes == 0 || !seen.insert(storage_data_ptr(t)?) {
            continue;
        }
        match role {
            Role::Parameter => c.parameter_bytes += bytes,
            Role::Buffer => {
                c.parameter_bytes += bytes;
                c.buffer_bytes += bytes;
            }
            Role::Input => c.input_bytes += bytes,
        }
        if !is_unseen(t)? {
            c.read += bytes;
        } else if !(role == Role::Parameter && sharded) {
            c.unseen += bytes;
        }
    }
    Ok(c)
}

/// Whether the meter does not see `t`'s storage: a CPU storage allocated before the
/// counting allocator was installed (`memsave_meter::install()` after the model was
/// built). Its bytes still count in the budget: they are added to what the meter reads.
/// Trap: on CUDA every storage is taken as seen; one that did not come from the caching
/// allocator (DLPack, `from_blob`) is then missing from the peak.
fn unseen(t: &Tensor) -> Result<bool, memsave_sys::Error> {
    Ok(t.device() == Device::Cpu
        && memsave_sys::alloc::counting_allocator_active()
        && !memsave_sys::alloc::is_counted(t)?)
}

/// A probe's step, set up: its configuration and batch, and the parameters with their
/// values before the probe (with an optimizer), a fresh optimizer, and on ranks the
/// data parallel of the choice's mode.
struct Setup {
    device: Device,
    config: StepConfig,
    x: Batch,
    params: Vec<Tensor>,
    /// The parameters' values before the probe, put back after it (an optimizer moves
    /// them).
    weights: Option<SavedWeights>,
    optimizer: Option<CaseOptimizer>,
    data_parallel: Option<DataParallelHandle>,
    /// Whether the runs (not the warm-up) check the running statistics
    /// ([`StepRun::check_statistics`]).
    check_statistics: bool,
    /// The buffers (running statistics) as they were before the probe, put back after
    /// the warm-up and after the runs: each probe starts from the model's own
    /// statistics, not from what an earlier one left (a one-example micro-batch leaves
    /// NaN in a BatchNorm's, which would hide the same from the check of a later run).
    buffers: Snapshot,
}

impl Setup {
    /// Sets `choice`'s schedule on the layers and makes the batch of `batch` examples,
    /// the step configuration for `micro_batches`, and its optimizer (on ranks, as the
    /// choice's mode builds it, after setting the mode up), the parameters' gradients
    /// freed. Also what the process holds outside the training step, which the peak is
    /// measured above: allocated once the batch and the copy of the weights are made,
    /// less the parameters' bytes and the batch's (the storages its tensors are in: a
    /// batch sliced from a dataset on the device counts the dataset). The copy `fit`
    /// keeps and whatever else the process held before `fit` are thus not counted; the
    /// parameters, the batch, and everything from the warm-up on (the optimizer's
    /// state, the gradients) are.
    fn new(
        workload: &mut dyn Workload,
        optimizer: Option<OptimizerSpec>,
        choice: &Choice,
        batch: i64,
        micro_batches: usize,
        ranks: &Ranks,
    ) -> Result<(Setup, Outside), ProbeError> {
        let device = workload.device();
        let layers = workload.layers().len();
        let schedule = choice
            .schedule()
            .cloned()
            .unwrap_or_else(|| Schedule::plain(layers));
        workload
            .layers_mut()
            .set_schedule(schedule)
            .map_err(failed)?;
        set_block_levers(workload, choice).map_err(failed)?;
        let config = choice.probe_config(optimizer, micro_batches);
        let params = workload.parameters();
        memsave_accum::free_grads(&params).map_err(failed)?;
        let x = workload
            .batch(batch)
            .map_err(|e| ProbeError::Failed(format!("making a batch of {batch}: {e}")))?;
        // ZeRO-3 leaves the parameters without storage of their own: their values are
        // put back from this copy too.
        let shards = choice.data_parallel == Some(ParallelMode::Zero3) || choice.params_in_files;
        let model_buffers = workload.buffers();
        let counted =
            counted(&params, &model_buffers, &x, device, shards, unseen).map_err(failed)?;
        let buffers = Snapshot::of(model_buffers).map_err(failed)?;
        let weights = if config.optimizer.is_some() || shards {
            Some(SavedWeights::save(&params).map_err(failed)?)
        } else {
            None
        };
        let held = memsave_meter::f_memory_allocated(device).map_err(failed)?;
        let outside = Outside {
            bytes: held.saturating_sub(counted.read),
            counted,
        };
        // Under ZeRO-3 (and with the parameters in files, ZeRO-3 on a group of one
        // when there are no ranks) the workload's layers are sharded.
        let set_up = match (ranks.group(), choice.data_parallel) {
            (None, None) if !choice.params_in_files => None,
            (None, None) => Some(DataParallelHandle::offload_params(
                &*workload,
                FsdpConfig::default(),
            )),
            (Some(group), Some(mode)) => {
                let mode = mode
                    .data_parallel()
                    .with_params_in_files(choice.params_in_files);
                Some(DataParallelHandle::for_workload(group, mode, &*workload))
            }
            (group, mode) => {
                return Err(ProbeError::Failed(format!(
                    "a configuration {} a data-parallel mode probed {} a process group",
                    if mode.is_some() { "with" } else { "without" },
                    if group.is_some() { "with" } else { "without" },
                )))
            }
        };
        let data_parallel = match set_up.transpose() {
            Ok(dp) => dp,
            Err(e) => {
                // Some layers may be sharded already, and their `Fsdp` gone: put the
                // weights back from the copy before saying why.
                let back = unshard(&*workload, &params).and_then(|()| match weights {
                    Some(w) => w.restore().map_err(failed),
                    None => Ok(()),
                });
                return Err(failed_putting_back(e, back));
            }
        };
        let optimizer = config
            .optimizer
            .map(|spec| match &data_parallel {
                Some(dp) => dp.optimizer(&spec, &params),
                None => CaseOptimizer::build(&spec, &params),
            })
            .transpose();
        let mut setup = Setup {
            device,
            config,
            x,
            params,
            weights,
            optimizer: None,
            data_parallel,
            check_statistics: false,
            buffers,
        };
        match optimizer {
            Ok(optimizer) => {
                setup.optimizer = optimizer;
                Ok((setup, outside))
            }
            Err(e) => {
                // The layers may be sharded already: put the weights back (and take
                // any wrapper off) before saying why.
                Err(failed_putting_back(e, setup.put_back(workload)))
            }
        }
    }

    /// With an optimizer, a warm-up step of one example per micro-batch that allocates
    /// its state; then the gradients freed. The optimizer's state persists from step to
    /// step, like the parameters: it is there before the measured steps begin, and
    /// counts in their peaks (the budget is the whole device).
    fn warm_up(&mut self, workload: &dyn Workload, micro_batches: usize) -> Result<(), ProbeError> {
        if let Some(optimizer) = self.optimizer.as_mut() {
            let size = micro_batches.max(1) as i64;
            let warm = workload
                .batch(size)
                .map_err(|e| step_error(format!("making a batch of {size}: {e}")))
                .and_then(|warm| {
                    step_caught(
                        workload,
                        &warm,
                        &self.config,
                        self.device,
                        Some(optimizer),
                        self.data_parallel.as_ref(),
                        &Unobserved,
                        false,
                    )
                });
            warm.map_err(|e| e.context("warming up the optimizer"))?;
            self.put_back_buffers()?;
        }
        memsave_accum::free_grads(&self.params).map_err(failed)
    }

    /// Writes the buffers' values from before the probe back, in place.
    fn put_back_buffers(&self) -> Result<(), ProbeError> {
        self.buffers.restore().map_err(failed)
    }

    /// Takes down the data parallel (its hooks; under ZeRO-3 the workload's
    /// parameters, which held nothing of their own, get storage of their own again and
    /// its layers run without a wrapper) and the optimizer, frees the gradients and
    /// puts the weights back as they were before the probe. No collective: a rank
    /// whose step failed puts back alone.
    fn put_back(self, workload: &dyn Workload) -> Result<(), ProbeError> {
        // Best effort: the weights are put back even if the buffers could not be, and
        // the first error is returned at the end.
        let buffers = self.put_back_buffers();
        drop(self.optimizer);
        let sharded = self
            .data_parallel
            .as_ref()
            .and_then(DataParallelHandle::fsdp)
            .is_some();
        // The weights are put back below from the copy taken before the run.
        if let Some(dp) = &self.data_parallel {
            dp.discard();
        }
        drop(self.data_parallel);
        if sharded {
            unshard(workload, &self.params)?;
        }
        let _ = memsave_accum::free_grads(&self.params);
        if let Some(weights) = self.weights {
            weights.restore().map_err(failed)?;
        }
        buffers
    }
}

/// After ZeRO-3 (whose parameters held nothing of their own once their `Fsdp` was
/// dropped): the layers and blocks run without a wrapper, and each parameter gets
/// storage of its own again (zeros, for the caller to put the weights back into).
fn unshard(workload: &dyn Workload, params: &[Tensor]) -> Result<(), ProbeError> {
    workload.set_layer_wrapper(None);
    if let Some(blocks) = workload.blocks() {
        blocks.set_wrapper(None);
    }
    for p in params {
        let own = Tensor::f_zeros(p.size(), (p.kind(), p.device())).map_err(failed)?;
        p.shallow_clone().f_set_data(&own).map_err(failed)?;
    }
    Ok(())
}

/// On the CPU, the machine's memory as a simulated capacity for the probe's runs: the
/// one cap in force (see [`machine_memory`]); none elsewhere or where the system does
/// not say.
pub(crate) fn machine_cap(device: Device) -> Result<Option<MemoryLimitGuard>, ProbeError> {
    // No budget as a simulated capacity (see `machine_memory`): only the machine's.
    Ok(match (device, machine_memory()) {
        (Device::Cpu, Some(machine)) => {
            Some(MemoryLimitGuard::f_new(device, machine).map_err(failed)?)
        }
        _ => None,
    })
}

/// The runs of a set-up probe (see [`probe`]): the peak over them all above what the
/// process holds outside the step (`outside`), with its breakdown, the fastest one's times, and the first one's
/// allocations when `record` asks. Each run's peak, times and the time the runs have
/// taken are agreed over the ranks before the budget or the time is checked.
fn measure(
    setup: &mut Setup,
    workload: &dyn Workload,
    runs: usize,
    budget: Option<u64>,
    record: bool,
    outside: &Outside,
    ranks: &Ranks,
) -> Result<Probe, ProbeError> {
    let mut best: Option<Probe> = None;
    let mut breakdown = PeakBreakdown::default();
    let mut by_rank = vec![0u64; ranks.world_size()];
    let mut series = None;
    let mut second = None;
    let runs_started = Instant::now();
    let mut runs_s = 0.0;
    for run in 0..runs.max(1) {
        if run >= 2 && runs_s > LONG_RUNS_S {
            break;
        }
        // Every rank's outcome (a spoiled run, out of memory, another failure) is agreed
        // with its figures below, so that every rank counts the configuration the same.
        let done = run_once(setup, workload, record && run == 0, outside);
        let (peak, time_s, optimizer_time_s) = match &done {
            Ok(Run {
                step: m,
                optimizer_time_s,
                recorded,
            }) => {
                if let Some((events, second_at)) = recorded {
                    series = Some(events.clone());
                    second = *second_at;
                }
                let peak = outside.above(m.start_bytes + m.peak_bytes);
                if peak > breakdown.total() {
                    let shards = setup
                        .data_parallel
                        .as_ref()
                        .and_then(DataParallelHandle::fsdp_stats)
                        .map(|s| s.parameter_bytes);
                    breakdown = outside.breakdown(m, shards);
                }
                (peak, m.time_s, *optimizer_time_s)
            }
            Err(_) => (0, 0.0, 0.0),
        };
        let all = ranks.gather_after_step(&[
            peak as f64,
            time_s,
            optimizer_time_s,
            runs_started.elapsed().as_secs_f64(),
            outcome_code(&done),
        ]);
        let all = match all {
            Ok(all) => all,
            Err(e) => return Err(unagreed(ranks, done.err(), e)),
        };
        let codes: Vec<f64> = all.iter().map(|r| r[4]).collect();
        if let Some(e) = agreed_failure(ranks, &codes, done.err()) {
            return Err(e);
        }
        for (b, r) in by_rank.iter_mut().zip(&all) {
            *b = (*b).max(r[0] as u64);
        }
        let slowest = |i: usize| all.iter().map(|r| r[i]).fold(0.0, f64::max);
        let (time_s, optimizer_time_s) = (slowest(1), slowest(2));
        runs_s = slowest(3);
        let peak = by_rank.iter().copied().max().unwrap_or(0);
        if let Some(budget) = budget.filter(|b| peak > *b) {
            // Over already: the runs left would only take the time (and memory).
            return Err(ProbeError::OutOfMemory(format!(
                "the peak {} is above the budget {}",
                Bytes(peak),
                Bytes(budget)
            )));
        }
        if best.as_ref().is_none_or(|b| time_s < b.time_s) {
            best = Some(Probe {
                peak_bytes: 0,
                breakdown: PeakBreakdown::default(),
                peak_bytes_by_rank: Vec::new(),
                time_s,
                optimizer_time_s,
                series: None,
                second_micro_batch: None,
            });
        }
    }
    let best = best.ok_or_else(|| ProbeError::Failed("no run".into()))?;
    Ok(Probe {
        peak_bytes: by_rank.iter().copied().max().unwrap_or(0),
        breakdown,
        peak_bytes_by_rank: by_rank,
        series,
        second_micro_batch: second,
        ..best
    })
}

/// What a rank's step came to, as a number the ranks agree on: the largest over them
/// is the outcome on every rank (a failure beats a spoiled run, which beats success).
fn outcome_code<T>(outcome: &Result<T, ProbeError>) -> f64 {
    outcome.as_ref().err().map_or(0.0, error_code)
}

/// [`outcome_code`] of a step that failed with `e`.
fn error_code(e: &ProbeError) -> f64 {
    match e {
        ProbeError::Unusable(_) => 1.0,
        ProbeError::OutOfMemory(_) => 2.0,
        ProbeError::Failed(_) => 3.0,
        ProbeError::Fatal(_) => 4.0,
    }
}

/// `outcome` (a step's: the warm-up's, a run's), agreed over the ranks: a step that
/// failed on any rank failed on every rank, as the worst outcome over them (see
/// [`agreed_failure`]). On one process, `outcome` as it is.
fn agree_step<T>(ranks: &Ranks, outcome: Result<T, ProbeError>) -> Result<T, ProbeError> {
    match ranks.gather_after_step(&[outcome_code(&outcome)]) {
        Ok(all) => {
            let codes: Vec<f64> = all.iter().map(|r| r[0]).collect();
            match outcome {
                Ok(t) => agreed_failure(ranks, &codes, None).map_or(Ok(t), Err),
                Err(e) => Err(agreed_failure(ranks, &codes, Some(e)).unwrap_or_else(|| {
                    ProbeError::Fatal(FitError::Group("a step's outcome was lost".into()))
                })),
            }
        }
        Err(e) => Err(unagreed(ranks, outcome.err(), e)),
    }
}

/// The error every rank takes when some rank's step did not succeed (`codes`: each
/// rank's [`outcome_code`], by rank; `own`: this rank's error, if its step failed):
/// the worst over the ranks, so that all count the configuration alike and go on
/// together (a configuration out of memory on any rank does not fit). A rank whose own
/// error is that one keeps it (on ranks, its message names the rank); the others are
/// told which rank. `None` when every rank's step succeeded.
fn agreed_failure(ranks: &Ranks, codes: &[f64], own: Option<ProbeError>) -> Option<ProbeError> {
    let worst = codes.iter().copied().fold(0.0, f64::max);
    if worst <= 0.0 {
        return None;
    }
    let first = codes.iter().position(|&c| c == worst).unwrap_or(0);
    let named = |e: String| match ranks.group() {
        Some(_) => format!("rank {}: {e}", ranks.rank()),
        None => e,
    };
    Some(match own {
        Some(e) if error_code(&e) == worst => match e {
            ProbeError::OutOfMemory(e) => ProbeError::OutOfMemory(named(e)),
            ProbeError::Failed(e) => ProbeError::Failed(named(e)),
            other => other,
        },
        _ if worst < 2.0 => ProbeError::Unusable(
            "another rank's step turned running statistics NaN (BatchNorm given one value \
             per channel)"
                .to_owned(),
        ),
        _ if worst < 3.0 => ProbeError::OutOfMemory(format!(
            "rank {first}'s step ran out of memory (rank {first} tells how)"
        )),
        _ => ProbeError::Failed(format!(
            "rank {first}'s step failed (rank {first} tells why)"
        )),
    })
}

/// The error of a rank that could not agree on a step's outcome (`agreeing` failed):
/// its own step's error if it failed (on ranks the error that ends the fit, naming the
/// rank: the others may still wait in a collective of the step), else the group's.
fn unagreed(ranks: &Ranks, own: Option<ProbeError>, agreeing: FitError) -> ProbeError {
    match own {
        Some(e @ (ProbeError::OutOfMemory(_) | ProbeError::Failed(_))) => e.on(ranks),
        Some(ProbeError::Unusable(e)) => ProbeError::Failed(e).on(ranks),
        _ => ProbeError::Fatal(agreeing),
    }
}

/// One run of a probe's step.
struct Run {
    step: StepMeasurement,
    /// Its optimizer time after backward, seconds.
    optimizer_time_s: f64,
    /// When it was recorded: the allocation above the start after every event, and
    /// where in it the second micro-batch's forward begins (see [`Probe`]).
    recorded: Option<(Arc<Vec<i64>>, Option<usize>)>,
}

/// Runs the set-up step once, recording its allocations when `record` asks and the
/// device is the CPU (and no other recording is on).
fn run_once(
    setup: &mut Setup,
    workload: &dyn Workload,
    record: bool,
    outside: &Outside,
) -> Result<Run, ProbeError> {
    let recording = record
        && setup.device == Device::Cpu
        && memsave_sys::alloc::start_recording().unwrap_or(false);
    let clock = Clock {
        optimizer_start: Cell::new(None),
        forwards: Cell::new(0),
        second_forward_at: Cell::new(None),
    };
    let m = step_caught(
        workload,
        &setup.x,
        &setup.config,
        setup.device,
        setup.optimizer.as_mut(),
        setup.data_parallel.as_ref(),
        &clock,
        setup.check_statistics,
    );
    let recorded = recording.then(|| {
        let events = memsave_sys::alloc::stop_recording();
        let initial = events.iter().take_while(|e| e.time_ns == 0).count();
        let second = clock
            .second_forward_at
            .get()
            .map(|at| at.saturating_sub(initial));
        let series = Arc::new(
            events
                .iter()
                .filter(|e| e.time_ns != 0)
                .map(|e| outside.relative(e.allocated_after))
                .collect::<Vec<i64>>(),
        );
        (series, second)
    });
    let m = m?;
    let end = Instant::now();
    let optimizer_time_s = clock
        .optimizer_start
        .get()
        .map(|t| end.duration_since(t).as_secs_f64().min(m.time_s))
        .unwrap_or(0.0);
    Ok(Run {
        step: m,
        optimizer_time_s,
        recorded,
    })
}

/// One step of `workload` (on ranks, this rank's part of the data parallel step). The
/// workload's code may panic (tch's short methods do on any error, and a failed
/// operation on a scalar panics even in its `f_` form): the panic is caught as the
/// error it is.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step_caught(
    workload: &dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
    optimizer: Option<&mut CaseOptimizer>,
    data_parallel: Option<&DataParallelHandle>,
    observer: &dyn StepObserver,
    check_statistics: bool,
) -> Result<StepMeasurement, ProbeError> {
    panic::catch_unwind(AssertUnwindSafe(|| {
        StepRun::new(device)
            .optimizer(optimizer)
            .observer(observer)
            .data_parallel(data_parallel)
            .check_statistics(check_statistics)
            .f_step(workload, x, config)
            .map_err(|e| match e {
                StepError::NonFiniteStatistics { .. } => ProbeError::Unusable(e.to_string()),
                e => step_error(e.to_string()),
            })
    }))
    .unwrap_or_else(|payload| {
        Err(step_error(format!(
            "panicked: {}",
            memsave_sys::checkpoint::panic_message(&*payload)
        )))
    })
}

/// A step's failure as a probe's error: out of memory when its message says so.
fn step_error(message: String) -> ProbeError {
    if is_oom(&message) {
        ProbeError::OutOfMemory(message)
    } else {
        ProbeError::Failed(message)
    }
}

/// Anything but a step failing, as a probe's error.
fn failed(e: impl std::fmt::Display) -> ProbeError {
    ProbeError::Failed(e.to_string())
}

/// The error `e` of a setup that failed partway, with the outcome `back` of putting
/// the weights back after it: `e` alone when they are back, both when not.
fn failed_putting_back(e: impl std::fmt::Display, back: Result<(), ProbeError>) -> ProbeError {
    match back {
        Ok(()) => failed(e),
        Err(b) => ProbeError::Failed(format!(
            "{e}; and the weights could not be put back: {}",
            b.message()
        )),
    }
}

/// Sets `choice`'s block levers: on a workload of blocks (every block kept when it has
/// none), or on a chain's layers, which then go under `Plan::PerLayer`; nothing for a
/// chain without them (its schedule is set).
pub(crate) fn set_block_levers(
    workload: &mut dyn Workload,
    choice: &Choice,
) -> Result<(), memsave_step::StepError> {
    match choice.block_levers() {
        Some(levers) => memsave_step::plan::set_block_levers(workload, levers),
        None if workload.blocks().is_some() => {
            memsave_step::plan::set_block_levers(workload, Vec::new())
        }
        None => Ok(()),
    }
}

#[cfg(test)]
mod counted_tests {
    use super::{counted, Counted};
    use memsave_step::workload::Batch;
    use tch::{Device, Kind, Tensor};

    fn zeros(n: i64) -> Tensor {
        Tensor::zeros([n], (Kind::Float, Device::Cpu))
    }

    fn none_unseen(_: &Tensor) -> Result<bool, memsave_sys::Error> {
        Ok(false)
    }

    /// Each storage once, by what it is: tied and view parameters once at their
    /// storage's bytes, buffers with them, a batch sliced from one dataset (input and
    /// target) once, a batch that is a parameter's storage as the parameter.
    #[test]
    fn each_storage_counts_once_at_its_bytes() {
        let weight = zeros(100);
        let bias = zeros(10);
        // The same weight twice (tied) and a view of it: 400 + 40 bytes.
        let params = [
            weight.shallow_clone(),
            bias.shallow_clone(),
            weight.narrow(0, 0, 5),
        ];
        let running_mean = zeros(4);
        let data = zeros(64);
        let x = Batch {
            input: data.narrow(0, 0, 8),
            target: Some(data.narrow(0, 8, 8)),
        };
        let c = counted(&params, &[], &x, Device::Cpu, false, none_unseen).unwrap();
        assert_eq!((c.parameter_bytes, c.input_bytes), (440, 256));
        let c = counted(
            &params,
            &[running_mean],
            &x,
            Device::Cpu,
            false,
            none_unseen,
        )
        .unwrap();
        assert_eq!((c.parameter_bytes, c.input_bytes, c.read), (456, 256, 712));
        // A batch that is a parameter's storage adds nothing.
        let aliasing = Batch {
            input: weight.narrow(0, 10, 4),
            target: Some(zeros(3)),
        };
        let c = counted(&params, &[], &aliasing, Device::Cpu, false, none_unseen).unwrap();
        assert_eq!((c.parameter_bytes, c.input_bytes), (440, 12));
        // An empty tensor counts nothing.
        let empty = Batch::input(zeros(0));
        let c = counted(&params, &[], &empty, Device::Cpu, false, none_unseen).unwrap();
        assert_eq!(c.input_bytes, 0);
    }

    /// What the meter does not see is added, not read; under ZeRO-3 (`sharded`) an
    /// unseen parameter is neither (sharding frees it), while an unseen buffer or
    /// batch still is.
    #[test]
    fn unseen_storages_are_added_and_sharded_parameters_are_not() {
        let weight = zeros(100);
        let seen_weight = zeros(10);
        let buffer = zeros(4);
        let x = Batch::input(zeros(8));
        let hidden = [weight.data_ptr(), buffer.data_ptr(), x.input.data_ptr()];
        let is_unseen = |t: &Tensor| Ok(hidden.contains(&t.data_ptr()));
        let params = [weight.shallow_clone(), seen_weight.shallow_clone()];
        let buffers = [buffer.shallow_clone()];
        let whole = counted(&params, &buffers, &x, Device::Cpu, false, is_unseen).unwrap();
        assert_eq!(
            whole,
            Counted {
                parameter_bytes: 456,
                buffer_bytes: 16,
                input_bytes: 32,
                read: 40,
                unseen: 400 + 16 + 32,
            }
        );
        let sharded = counted(&params, &buffers, &x, Device::Cpu, true, is_unseen).unwrap();
        assert_eq!((sharded.read, sharded.unseen), (40, 16 + 32));
    }
}
