//! `fit`: the fastest training configuration whose peak fits a byte budget, with the
//! global batch kept.
//!
//! The answer to "my step needs 30 GiB and I have 24": instead of halving the batch
//! on each out-of-memory error (which changes the global batch, and costs a crash per
//! try), `fit` predicts the peak and the time of every configuration it considers and
//! runs only the one it chooses at its real size, its peak measured to the byte and
//! checked against the budget.
//!
//! Train with the choice in one call: [`FitReport::trainer`] (or
//! [`Choice::trainer_builder`]) gives a `memsave_step::Trainer` with its levers,
//! checkpoint schedule and the workload's optimizer.
//!
//! # What it considers
//! - **micro-batches**: the global batch split into `k` micro-batches as evenly as
//!   possible (sizes differ by at most one), gradients accumulated; the global batch,
//!   and so the training, is unchanged;
//! - **recompute**: the checkpoint schedule of `memsave-checkpoint`'s budget solver
//!   for that micro-batch size, with the least recomputation that fits;
//! - **offload**: saved activations in a file-backed store (`memsave-hooks`);
//! - **optimizer step in backward** (for a workload with an optimizer): each parameter
//!   is updated and its gradient freed as soon as it is complete;
//! - **gradients in files** (`memsave-hooks`' `GradOffload`), only when nothing fits
//!   without them (a second pass, after the first found nothing that fits when run):
//!   the gradients accumulated over micro-batches wait in files instead of memory; with
//!   an optimizer, only together with its step in backward (which then steps each
//!   whole gradient during the last micro-batch's backward), since a step after
//!   backward needs them all back at once. They cost a write and a read of every
//!   gradient per micro-batch, and reach budgets below the gradients' own size. On one
//!   process, beside a choice with every gradient in files, its twin that keeps the
//!   smallest parameters' gradients in memory (biases, norms' weights: up to 2% of
//!   the gradients' bytes; `offload_grads(to=disk, at_least=..)`,
//!   [`Choice::offload_grads_at_least`]) is probed and races it: a file per small
//!   parameter costs more time than its bytes save;
//! - **optimizer state in files** (`placement: disk`, lossless; on one process, for an
//!   optimizer that keeps state: AdamW, SGD with momentum), only when nothing fits
//!   with it on the device (a third pass, over the lever sets of the two before):
//!   each parameter's state is read back for its update and written after it, so the
//!   device holds one parameter's at a time instead of AdamW's twice the parameters;
//!   every file is checked when read back (`memsave-optim`'s `Placement::Disk`);
//! - **parameters in files** (`offload_params(to=disk)`, lossless; on one process, with
//!   an optimizer, unless [`FitRequest::offload_params`] is off), only when nothing
//!   fits with them on the device (a fourth pass, with and without offloaded
//!   activations and the state in files): the step runs as ZeRO-3 over a group of one
//!   whose shards are in files (`memsave_step::ParamsOffload`), each unit (a layer, or
//!   a top-level block) read for its forward, its recomputation and its backward, and
//!   stepped in backward as its gradients land, in chunks of at most
//!   `memsave_dist::SHARD_FILE_CHUNK_VALUES` values; with micro-batches, each unit's
//!   gradients are summed in a file until the last one. The device then holds about
//!   one unit's weights and gradients besides the activations, so budgets below the
//!   parameters' own bytes are reached; a budget nothing fits names the largest unit
//!   and its bytes;
//! - only when allowed ([`Allow`]), the lossy ones: bf16 autocast, int8 compression of
//!   saved activations (for a model of blocks, also per block, mixed with the other
//!   levers by the blocks planner), 8-bit optimizer state.
//!
//! # How it predicts
//! It runs each lever set on two small micro-batches (for accumulation, a step of two
//! micro-batches of that size, so that the gradients already accumulated are
//! counted), and fits the peak and the per-micro-batch time as affine functions of the
//! micro-batch size (activations grow with the batch; gradients, optimizer state and
//! the rest do not). Recompute schedules come from the solver over a layer profile
//! interpolated from profiles at two small sizes; each schedule is then itself run on
//! two small micro-batches. A lever set whose small run does not fit the budget (its
//! measured peak is over it) is retried at half the size.
//!
//! What an offload store keeps in memory depends on the pace of its writer thread, so
//! `fit` runs it synchronously (each saved tensor written before the forward goes on,
//! read back without prefetch): its memory is then the same from run to run.
//!
//! It chooses the fastest predicted configuration whose predicted peak is within the
//! budget less a safety margin ([`FitRequest::margin`], 5% by default, of what the
//! step allocates above the parameters and the optimizer's state), runs one real
//! step of it (its peak measured and checked against the budget) and reports the
//! prediction, the
//! measurement (on the CPU, when no configuration is predicted within the margin,
//! those predicted within the budget itself run in the same way, fastest first: a
//! real-size run measured within the budget needs no margin), and the Pareto front of peak against time. Times predicted from small
//! runs are off by tens of percent, more than separates close configurations, so up
//! to sixteen runners-up predicted within 1.5× of the choice's time (and the best
//! predicted of each other family within 3×: on steps of a few hundredths of a second
//! small runs can be off by that much) are run at their real size too
//! (first one per family of levers and recompute schedule, then more splits of each;
//! for a couple of seconds, or a quarter of the time spent before). Then up to five
//! measured within 1.25× of the fastest (always the one confirmed first, measured
//! right after the small runs) are compared in rounds (at least three, at most
//! twenty-four, for a couple of seconds or a quarter of the time spent before, and
//! while a round takes at most 0.3 s, up to half the time spent before; two if three would
//! take longer, none if two rounds of two would): each round runs each once, forwards
//! and backwards in turn, and each one's time is its median over the rounds after every
//! round's times are scaled by how fast the machine ran in that round (the geometric
//! mean of the round's times against that of all rounds). After four rounds, and after
//! each one from then on, those more than 1.15× the fastest so far drop out, so the
//! close ones get the rounds left. A real-size step measures a third slower one second than the next on a busy
//! machine, so the fastest of a few runs at different moments says more about the
//! moment than about the configuration, and three rounds still now and then pick one
//! more than 10% slower. The fastest so compared is the choice. On the
//! CPU, a runner-up may be one predicted within the budget but not within the
//! margin: it is chosen only measured within the budget (on CUDA, where an allocation
//! past the budget may succeed or fail for real, only those within the margin run).
//!
//! Runs are never made to fail at the budget: the workload's code runs as it would in
//! training. `fit` sets no simulated capacity (the meter's `set_memory_limit`) for
//! them, since an allocation failing inside a layer makes tch's short methods panic
//! there, which poisons any `Mutex` the layer holds (the way to share a module, which
//! is `Send` but not `Sync`, with a checkpoint closure) and prints the panic. A run's
//! peak is measured instead (exact on the CPU) and a run over the budget is a
//! configuration that does not fit. The price: such a run takes its memory for real.
//! `fit` keeps it bounded: the first small runs are at about a quarter of the
//! micro-batch (half with offload, whose activations are in files), a larger one is
//! run only after a smaller one fit, a real-size run only for a
//! configuration predicted within the budget (with `exhaustive`, within twice it), and
//! the whole batch in one micro-batch, for the error of a budget nothing fits, only
//! when runs of one and two examples predict it below the least peak found. The one
//! cap in force on the CPU is the machine's memory (its total, or its control group's
//! limit): a run that would take more fails as it would outside `fit`, instead of the
//! process being killed. A limit set before `fit` stays in force, and applies to the
//! workload's code as set.
//!
//! When the two small runs do not make the same allocations in the same order
//! (libtorch picks kernels, and their scratch buffers, by size), the peak can only be
//! extrapolated along a line, which undershoots when the peak moves from the end of
//! backward to its start as the batch grows; the probes then step up towards the real
//! size, until they line up or the real size itself is measured.
//!
//! # What the budget counts
//! The budget is the whole device: the most bytes it holds at any moment of the step,
//! counting the parameters (and the model's buffers, such as BatchNorm's running
//! statistics), the optimizer's state (made by a warm-up step before the
//! measured ones: AdamW's is twice the parameters, `memsave-optim`'s 8-bit state a
//! quarter of that), the input batch (the storages its tensors are in: a batch sliced
//! from a dataset on the device counts the dataset, once), the gradients and
//! everything else the step allocates. Each report breaks the measured peak down
//! ([`PeakBreakdown`]). Two things are not counted, because `fit` cannot change them:
//! what the process held before `fit` other than the parameters and the batch's
//! storages (another model, tensors of your own: leave room for them), and the copy of
//! the weights `fit` keeps to put them back after each run. Parameters and data made
//! before `memsave_meter::install()`, which the meter never sees, are counted all the
//! same. A step the [`Trainer`](FitReport::trainer) runs reports
//! [`StepMeasurement::device_peak_bytes`](memsave_step::StepMeasurement::device_peak_bytes)
//! (absolute, like `max_memory_allocated`): on the CPU, when the process holds nothing
//! but the model and its data, made after `install()`, the peak `fit` measured, to
//! the byte (on CUDA the caching allocator rounds
//! each block up, to 512 bytes, which the parameters' and the batch's own bytes do not
//! show: a few bytes per tensor more).
//!
//! Warning: `memsave bench`'s `peak_bytes` (like PyTorch's reference on a suite) is
//! measured above what persists from step to step (the parameters, the optimizer's
//! state, the input), for comparison with other tools. To turn such a figure into a
//! budget for `fit`, add the parameters, the optimizer's state and the input (a
//! report's [`breakdown`](FitReport::breakdown) gives them).
//!
//! # On the ranks of a process group
//! With [`FitRequest::on_ranks`], every rank of the group calls [`fit`] on the same
//! model at the same point, and every run of the search runs on all of them, each on
//! its share of the global batch (which must divide among the ranks). The
//! data-parallel mode ([`ParallelMode`]: DDP, ZeRO-1, ZeRO-2, ZeRO-3) is one more
//! lever, probed and measured with the others; a configuration a mode refuses
//! (`memsave_step::DataParallel::check`: the optimizer step in backward except under
//! ZeRO-3 with one micro-batch, gradients in files except under ZeRO-1; ZeRO-3 for a
//! workload that does not say which parameters each layer uses) is left out with the
//! reason as its candidate's note (the report's text lists them). The budget is per
//! rank, and counts as on one process what the rank's device holds: its parameters
//! (its shard of them and the layers' gathered weights under ZeRO-3), its optimizer
//! state (its shard under ZeRO), its input and the step's own.
//!
//! The ranks stay in lockstep: every figure the search decides on (each run's peak
//! and time, each prediction, the layer profiles, and the clock every deadline reads)
//! is agreed first, as the largest over the ranks, so each rank takes the same
//! branches and issues the same collectives, and all return the same choice, whose
//! measured peak on each rank is in [`FitReport::measured_peak_bytes_by_rank`].
//! Train with it on the same ranks: [`FitReport::trainer_on`].
//!
//! A step that fails is agreed too: after every step of a run (the optimizer's warm-up
//! included) each rank tells the others how its step ended, and the worst outcome over
//! the ranks is every rank's, handled as on one process. A configuration out of memory
//! on any rank does not fit, on every rank, and the search goes on with the next; any
//! other failure (the workload's step failed) ends the fit on every rank, with an
//! error naming the rank it failed on, except in the runs that only check the choice
//! (runners-up, `exhaustive`), which leave that configuration out.
//!
//! Trap: the ranks can agree only once each has left the step. A step that fails on
//! some ranks while the others go on into a collective of that step (which the failed
//! ones never join: a failure in forward on one rank while the other all-reduces in
//! backward) leaves both waiting until the group's timeout: then each `fit` returns an
//! error (the failed rank's own, naming it). The agreement is made of broadcasts,
//! which no step issues, so it never mixes its bytes with the step's collective.
//! Ranks that run the same model on equal shares fail alike (at the same allocation,
//! under the same memory limit), so this takes a failure that only some ranks meet.
//!
//! Micro-batches are lossless only when nothing in the step computes a sample's output
//! (or its loss) from other samples of the batch. BatchNorm in training mode does (it
//! normalizes each sample with the whole batch's statistics), and so does any reduction
//! over the batch (`y - y.mean(0)`, a loss divided by a count over the whole batch).
//! `fit` finds either from what the step does: it runs its first step under
//! `memsave_sys::ops::sample_coupling_op`, which names a batch-norm-family op; when that
//! names none, it runs one step of a small batch (a quarter of the batch, as its first
//! small runs, at most 64 examples) whole and split in two, from the same random stream and statistics, and
//! compares the gradients: more than 1e-4 apart (relative L2 over all parameters; 3e-2
//! for f16 or bf16 parameters), the step couples its samples (where the step draws
//! random numbers, dropout, the halves of the batch are checked for interaction instead,
//! each run from the same draws: other draws are not a change of the step). Either way,
//! a split into micro-batches is then a lossy lever like the others, considered only
//! with [`Allow::micro_batches`] ([`Choice::is_lossless`] is then false for it, and the
//! report's `why` says why). Not found: coupling that does not show in the gradients of
//! the batch probed (one that starts only past some batch size, or only on other
//! examples than the workload's first ones), or that moves them less than the tolerance.
//!
//! Traps: the model is left bitwise as `fit` found it: its parameters, its
//! [`buffers`](memsave_step::Workload::buffers) (BatchNorm's running statistics, which every
//! probe run updates; a workload that does not list them gets them back changed) and
//! the CPU random generator's state (CUDA generators are not put back). Its checkpoint
//! schedule is left as the choice's (that is the point) and its gradients are freed.
//! And on glibc, `fit` first allocates and frees one block of just under 32 MiB, which
//! raises `malloc`'s mmap threshold to its cap for the rest of the process, as the
//! first free of a tensor that large would: every configuration is then timed with
//! its tensors' pages reused from the heap, whatever ran before it in the process
//! (how a configuration measured depended on that: two could swap places between fit's
//! rounds and `exhaustive`'s). The process keeps up to 64 MiB of freed heap instead of
//! giving it back.
mod allocator;
mod choice;
mod coupling;
mod lockstep;
mod parallel;
mod predict;
mod probe;
mod search;
mod state;
mod train;

pub use choice::Choice;
pub use parallel::ParallelMode;
pub use search::{fit, fit_with, table};

use memsave_meter::Bytes;
use memsave_step::{OptimizerSpec, ProcessGroup};
use serde::Serialize;

/// What to fit.
#[derive(Debug, Clone)]
pub struct FitRequest {
    /// The most bytes the device may hold at any moment of the step: the parameters,
    /// the optimizer's state, the input, the gradients and everything else the step
    /// allocates (see the [crate docs](crate#what-the-budget-counts)). On ranks, per
    /// rank.
    pub budget_bytes: u64,
    /// Examples per optimizer step; `None`: the workload's
    /// [`global_batch`](memsave_step::Workload::global_batch).
    pub global_batch: Option<i64>,
    /// The lossy levers the caller accepts.
    pub allow: Allow,
    /// Fraction kept free for prediction errors of what the step allocates above what
    /// it keeps from step to step (the parameters and the optimizer's state, which are
    /// measured, not predicted): a configuration is chosen only if its predicted peak
    /// is within `budget − margin · (budget − kept)`, or, on the CPU when none is,
    /// predicted within the budget and measured within it at its real size (the
    /// meter's peak is exact there).
    pub margin: f64,
    /// Also run every candidate predicted within twice the budget at its real size
    /// (its peak checked against the budget) and report the
    /// fastest that really fits, to check the choice; those within 1.3× of the
    /// fastest, and the choice, are then compared in rounds (as the close ones are
    /// before the choice, see the [module](self) docs; at least five, up to thirty
    /// while ten seconds last, those over 1.2× the fastest out after six or more,
    /// never the choice), and the fastest so compared is the fastest reported.
    /// Slow: a few real steps per candidate.
    pub exhaustive: bool,
    /// Fit on every rank of this group (see [`on_ranks`](Self::on_ranks)); `None`:
    /// one process.
    pub process_group: Option<ProcessGroup>,
    /// The optimizer every step steps (its kind and hyperparameters; `fit` chooses its
    /// state's precision and whether it steps in backward) instead of the workload's
    /// [`optimizer`](memsave_step::Workload::optimizer); `None`: the workload's.
    pub optimizer: Option<OptimizerSpec>,
    /// For a model of blocks, choose each block's lever on its own (the default);
    /// false: every block alike (kept, recomputed or offloaded all together), to
    /// compare the per-block choice with the uniform one.
    pub per_block: bool,
    /// On one process with an optimizer, when nothing fits with the parameters on the
    /// device, may keep them in files between their uses (`offload_params(to=disk)`,
    /// lossless: each unit's weights read while it runs, stepped in backward; the
    /// default). False keeps them on the device: to compare, or where the disk traffic
    /// of every weight at every step is not wanted.
    pub offload_params: bool,
}

impl FitRequest {
    /// A request for `budget_bytes` with the defaults: the workload's global batch,
    /// lossless levers only, a 5% margin, no exhaustive check.
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            global_batch: None,
            allow: Allow::default(),
            margin: 0.05,
            exhaustive: false,
            process_group: None,
            optimizer: None,
            per_block: true,
            offload_params: true,
        }
    }

    /// The same request, fitted on every rank of `group` (each rank calls [`fit`] with
    /// it, on the same model, at the same point: see the [crate docs](crate#on-the-ranks-of-a-process-group)).
    /// The data-parallel mode ([`ParallelMode`]: DDP, ZeRO-1, ZeRO-2, ZeRO-3) is then one
    /// more lever, and the budget is per rank: what each rank's device holds, its
    /// share of the parameters and the optimizer's state included.
    pub fn on_ranks(mut self, group: &ProcessGroup) -> Self {
        self.process_group = Some(group.clone());
        self
    }
}

/// The lossy levers `fit` may use besides the lossless ones (recompute, offload,
/// micro-batches, optimizer step in backward, gradients in files). All off by default.
/// Micro-batches are lossless unless the step couples the samples of a batch
/// (BatchNorm in training mode, a reduction over the batch): then they are lossy and
/// need [`micro_batches`](Self::micro_batches).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Allow {
    /// Forward under bf16 autocast.
    pub bf16: bool,
    /// Saved activations compressed to int8 (blockwise absmax).
    pub compress: bool,
    /// 8-bit blockwise optimizer state.
    pub int8_state: bool,
    /// More than one micro-batch when the step couples the samples of a batch (BatchNorm
    /// in training mode normalizes each sample with the whole batch's statistics, so
    /// micro-batches change the gradients and the running statistics; so does
    /// `y - y.mean(0)`). `fit` finds such coupling itself, from its first runs of the
    /// step (see the [crate docs](crate)); without it, micro-batching is lossless and
    /// always considered, whatever this says.
    pub micro_batches: bool,
}

impl Allow {
    /// Every lossy lever.
    pub fn all() -> Allow {
        Allow {
            bf16: true,
            compress: true,
            int8_state: true,
            micro_batches: true,
        }
    }
}

/// A configuration as `fit` saw it: predicted, and measured when it was run at its
/// real size (the choice, or every candidate with `exhaustive`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// The configuration.
    pub choice: Choice,
    /// Predicted peak of the whole step on the device (see the [crate docs](crate)),
    /// if it could be predicted.
    pub predicted_peak_bytes: Option<u64>,
    /// Predicted step time, seconds.
    pub predicted_step_time_s: Option<f64>,
    /// The predicted peak is within the budget less the margin.
    pub predicted_fits: bool,
    /// Measured peak at the real size, if run.
    pub measured_peak_bytes: Option<u64>,
    /// What the device held at its measured peak, by kind (on ranks, this rank's at
    /// its own peak), if run.
    pub measured_breakdown: Option<PeakBreakdown>,
    /// Measured step time at the real size, if run: the faster of two steps, or for
    /// the configurations compared in rounds (the close ones; with `exhaustive`, those
    /// within 1.3× of the fastest), the median over the rounds corrected for the
    /// machine's speed in each (see the [module](self) docs).
    pub measured_step_time_s: Option<f64>,
    /// Why it has no prediction or measurement, if so (a data-parallel mode's refusal
    /// among them: `refused by ddp: ...`).
    pub note: Option<String>,
    /// Each rank's measured peak at the real size, by rank, if run (one entry on one
    /// process); [`measured_peak_bytes`](Self::measured_peak_bytes) is the largest.
    pub measured_peak_bytes_by_rank: Vec<u64>,
    /// What its small runs kept on the device from step to step (the parameters and
    /// the optimizer's state; on ranks the least over them): measured, not predicted,
    /// so the margin spares it.
    #[serde(skip)]
    pub(crate) kept_bytes: u64,
}

/// What `fit`'s budget counts, as [`FitReport::budget_counts`] says it.
pub const BUDGET_COUNTS: &str = "the most bytes the device holds at any moment of the step (per rank on ranks): the parameters (and the model's buffers), the optimizer's state, the input (the storages the batch is in), the gradients and everything else the step allocates; not the copy of the weights fit keeps to put them back, nor what else the process held before fit";

/// What the device held at a step's peak, by kind; the four add up to the peak `fit`
/// measures against the budget (see the [crate docs](crate)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PeakBreakdown {
    /// The parameters and the model's buffers (BatchNorm's running statistics), each
    /// storage once (on ranks under ZeRO-3, this rank's shard of the parameters: the
    /// gathered weights are the step's).
    pub parameters: u64,
    /// What else stayed on the device from the step before: the optimizer's state (on
    /// ranks, this rank's part of it, and whatever the data-parallel mode keeps
    /// between steps).
    pub optimizer_state: u64,
    /// The batch: the storages its tensors are in, each once (a slice of a dataset on
    /// the device counts the dataset; a storage that is a parameter's counts there).
    pub input: u64,
    /// What the step had allocated when it peaked: gradients, saved activations,
    /// scratch (on ranks under ZeRO-3, the gathered weights).
    pub step: u64,
    /// The step's own bytes by role, from one more step recorded allocation by
    /// allocation (`memsave-trace`) and read at its peak: on one process on the CPU,
    /// for the report's choice; `None` elsewhere.
    pub step_by_role: Option<StepRoles>,
}

/// What a step had allocated above the parameters, the optimizer's state and the input
/// when it peaked, by role (`memsave-trace`'s categories); the four add up to that
/// traced step's own bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StepRoles {
    /// Parameters' gradients (accumulated, or about to be stepped in backward). With
    /// gradients in files, one on its way to its file counts as `other` (the recorder's
    /// gradient hooks are the store's then).
    pub gradients: u64,
    /// Tensors autograd saved for backward (in memory: an offloaded one is in its file).
    pub saved_activations: u64,
    /// What a block's recomputation allocated in backward and still held (for a model
    /// of blocks; a chain's recomputed layers count as saved activations and other).
    pub recomputed: u64,
    /// Everything else: scratch, the loss, outputs not saved, stores' buffers.
    pub other: u64,
}

impl PeakBreakdown {
    /// The peak: the four together.
    pub fn total(&self) -> u64 {
        self.parameters + self.optimizer_state + self.input + self.step
    }

    /// What stays on the device from step to step and is measured, not predicted: the
    /// parameters and the optimizer's state (the margin spares it).
    pub fn kept(&self) -> u64 {
        self.parameters + self.optimizer_state
    }
}

/// The answer of [`fit`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitReport {
    /// The workload's name.
    pub model: String,
    /// The budget asked for.
    pub budget_bytes: u64,
    /// What the budget counts, in words (the JSON says it beside the figure):
    /// [`BUDGET_COUNTS`].
    pub budget_counts: &'static str,
    /// Examples per optimizer step, kept by every candidate.
    pub global_batch: i64,
    /// The margin applied to predictions.
    pub margin: f64,
    /// The lossy levers allowed.
    pub allow: Allow,
    /// How the step couples the samples of a batch, if it does: the first
    /// batch-norm-family op in training mode it runs, or, with none, a description of
    /// how much a split changed the gradients (see the [crate docs](crate)).
    /// Micro-batches are then lossy, and considered only with [`Allow::micro_batches`].
    pub sample_coupling_op: Option<String>,
    /// The chosen configuration.
    pub choice: Choice,
    /// The optimizer the fit stepped (the request's, else the workload's), before the
    /// choice's levers change it: what [`trainer`](Self::trainer) builds the choice
    /// with.
    #[serde(skip)]
    pub optimizer: Option<OptimizerSpec>,
    /// Its predicted peak.
    pub predicted_peak_bytes: u64,
    /// Its peak measured by the confirming step at its real size (on ranks, the
    /// largest over them).
    pub measured_peak_bytes: u64,
    /// What the device held at this process's measured peak, by kind: parameters,
    /// optimizer state, input, and what the step allocated (gradients, activations,
    /// scratch). On ranks, this rank's.
    pub breakdown: PeakBreakdown,
    /// Ranks the fit ran on (1: one process).
    pub world_size: usize,
    /// Its measured peak on each rank, by rank (one entry on one process).
    pub measured_peak_bytes_by_rank: Vec<u64>,
    /// Its predicted step time, seconds.
    pub predicted_step_time_s: f64,
    /// Its measured step time, seconds.
    pub measured_step_time_s: f64,
    /// Real steps of chosen configurations run to confirm one (1 when the first choice
    /// fit; each extra one is a choice that did not).
    pub tries: usize,
    /// Small runs (while predicting) that did not fit the budget and were retried at
    /// half the micro-batch.
    pub small_runs_over_budget: usize,
    /// Runners-up (see the module docs) that did not fit the budget when run at their
    /// real size; they are left out, the choice stands.
    pub runners_up_over_budget: usize,
    /// Why this configuration, in a sentence or two.
    pub why: String,
    /// Configurations no other beats in both predicted peak and time, by peak.
    pub front: Vec<Candidate>,
    /// Every configuration considered, in the order considered.
    pub candidates: Vec<Candidate>,
    /// With `exhaustive`: the fastest configuration measured within the budget.
    pub fastest_measured: Option<Candidate>,
    /// Seconds `fit` took (the exhaustive runs included).
    pub fit_time_s: f64,
}

/// What [`fit_with`] is doing, told as each phase starts. Its `Display` is a line for a
/// person (`predicting 4 micro-batches of 1250 from small runs`).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum FitEvent {
    /// Predicting every configuration with this split from small runs.
    Predicting {
        /// Micro-batches per step.
        micro_batches: usize,
        /// Examples in the largest micro-batch.
        micro_batch: i64,
        /// The second pass, with the gradients in files (nothing fit without).
        gradients_in_files: bool,
        /// The third pass, with the optimizer's state in files (nothing fit without).
        state_in_files: bool,
        /// The fourth pass, with the parameters in files (nothing fit without).
        parameters_in_files: bool,
    },
    /// Within a split: predicting one configuration from its small runs.
    Probing {
        /// Its name.
        strategy: String,
        /// Micro-batches per step.
        micro_batches: usize,
        /// Examples in the largest micro-batch.
        micro_batch: i64,
    },
    /// Profiling the layers (forward and backward of each, outside the budget) at
    /// these two sizes, once, for the recompute schedules.
    Profiling {
        /// The two batch sizes.
        sizes: (i64, i64),
    },
    /// Running the fastest predicted configuration not run yet at its real size, to
    /// confirm that its measured peak fits the budget.
    Confirming {
        /// Its name.
        strategy: String,
        /// Micro-batches per step.
        micro_batches: usize,
        /// Examples in the largest micro-batch.
        micro_batch: i64,
    },
    /// Running runners-up at their real size (those that end within the race's time).
    RunnersUp {
        /// How many are considered.
        count: usize,
    },
    /// Comparing the close ones in rounds.
    Rounds {
        /// How many.
        count: usize,
    },
    /// `exhaustive`: running every other candidate at its real size.
    Exhaustive {
        /// How many.
        count: usize,
    },
}

impl FitEvent {
    /// Whether this event starts a phase (a split, the confirming run, the runners-up,
    /// the rounds, the exhaustive runs) rather than a step within one: a log shows the
    /// phases, a progress line can show every event.
    pub fn is_phase(&self) -> bool {
        !matches!(self, FitEvent::Probing { .. } | FitEvent::Profiling { .. })
    }
}

impl std::fmt::Display for FitEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        match self {
            FitEvent::Predicting {
                micro_batches,
                micro_batch,
                gradients_in_files,
                state_in_files,
                parameters_in_files,
            } => write!(
                f,
                "predicting {micro_batches} micro-batch{} of {micro_batch} from small runs{}",
                if *micro_batches == 1 { "" } else { "es" },
                if *parameters_in_files {
                    " (parameters in files)"
                } else if *state_in_files {
                    " (optimizer state in files)"
                } else if *gradients_in_files {
                    " (gradients in files)"
                } else {
                    ""
                }
            ),
            FitEvent::Probing {
                strategy,
                micro_batches,
                micro_batch,
            } => write!(
                f,
                "predicting {strategy} ({micro_batches}x{micro_batch}) from small runs"
            ),
            FitEvent::Profiling { sizes: (a, b) } => write!(
                f,
                "profiling the layers at {a} and {b} examples for recompute schedules"
            ),
            FitEvent::Confirming {
                strategy,
                micro_batches,
                micro_batch,
            } => write!(
                f,
                "running {strategy} ({micro_batches}x{micro_batch}) at its real size under the budget"
            ),
            FitEvent::RunnersUp { count } => write!(
                f,
                "running up to {count} runner{}-up at their real size",
                plural(*count)
            ),
            FitEvent::Rounds { count } => {
                write!(f, "comparing the {count} closest in rounds")
            }
            FitEvent::Exhaustive { count } => write!(
                f,
                "exhaustive: running {count} more configuration{} at their real size",
                plural(*count)
            ),
        }
    }
}

/// Why `fit` gave no configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// A budget of 0 bytes.
    #[error("the budget must be more than 0 bytes")]
    ZeroBudget,
    /// A global batch of 0 or less.
    #[error("the global batch must be at least 1 (got {0})")]
    BadGlobalBatch(i64),
    /// A margin outside `0..1`.
    #[error("the margin must be at least 0 and below 1 (got {0})")]
    BadMargin(f64),
    /// Nothing fits.
    #[error("no configuration fits {budget}: the least memory found is {how}; {hint}", budget = Bytes(*budget_bytes))]
    Infeasible {
        /// The budget asked for.
        budget_bytes: u64,
        /// The smallest predicted peak (less the margin: the smallest budget `fit`
        /// would accept) among the allowed levers.
        smallest_bytes: u64,
        /// The configuration that reaches it.
        how: String,
        /// What it would take: a larger budget, or lossy levers if not allowed.
        hint: String,
    },
    /// The workload's step failed (not for lack of memory; on ranks, on the rank the
    /// message names, or on every rank where the ranks could not agree on how the step
    /// ended: see the [crate docs](crate#on-the-ranks-of-a-process-group)).
    #[error("the workload's step failed: {0}")]
    Step(String),
    /// The batch (on ranks, each rank's share) is one example, and a step on one
    /// example turns running statistics NaN (BatchNorm given one value per channel in
    /// training): no budget and no lever helps.
    #[error("a batch of one example{} turns running statistics NaN (BatchNorm given one value per channel in training), whatever the budget: the batch must have 2 or more examples{}", if *world_size > 1 { " per rank" } else { "" }, if *world_size > 1 { format!(" per rank (a global batch of at least {})", 2 * world_size) } else { String::new() })]
    BatchOfOne {
        /// Ranks in the group (1: one process).
        world_size: usize,
    },
    /// On ranks: the global batch does not divide among them.
    #[error("the global batch of {global_batch} does not divide among {world_size} ranks: give a multiple of {world_size}")]
    Indivisible {
        /// The global batch.
        global_batch: i64,
        /// Ranks in the group.
        world_size: usize,
    },
    /// On ranks: a collective that keeps the ranks in lockstep failed (another rank
    /// ended, or the group's timeout passed); the message starts with `rank R:`.
    #[error("{0}")]
    Group(String),
}
