//! The step on two ranks (processes over 127.0.0.1, this test binary started again by
//! memsave-dist's launcher) for each lever the single-process step has: the gradients
//! (or, with an optimizer, the weights after its steps) equal a single-process run of
//! the same lever on the global batch within 1e-6, and what data parallel cannot run
//! is refused before anything is built.
//!
//! Two references per case, both computed here on one process: the same configuration
//! on the global batch, and the same with each rank's share as a micro-batch of its own
//! (so that a lever whose rounding depends on the tensors it sees, compress and
//! autocast, sees the same tensors as on the ranks). Lossless levers must match both
//! within 1e-6; lossy ones the second.
use crate::common::Mlp;
use memsave_amp::GradScalerConfig;
use memsave_checkpoint::{CheckpointError, Plan};
use memsave_dist::{init_process_group, launch, InitOptions, LaunchConfig, ProcessGroup};
use memsave_step::step::{f_grads, max_abs_diff};
use memsave_step::{
    CompressDtype, DataParallel, DataParallelHandle, DdpConfig, GradsAfter, OffloadSpec,
    OptimizerKind, OptimizerSpec, PlanChoice, SavedTensors, StatePlacement, StatePrecision,
    StepConfig, StepError, TrainerBuilder, Workload, ZeroStage,
};
use serial_test::serial;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::{Device, Kind};

const WORLD: i64 = 2;
const BATCH: i64 = 8;
const TOLERANCE: f64 = 1e-6;
const ADAMW_LR: f64 = 1e-2;

/// Three residual blocks of width 16 over a batch of 8 × 4 rows.
fn model() -> Mlp {
    Mlp::new(3, 16, BATCH, 4)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Ddp,
    Zero(ZeroStage),
}

impl Mode {
    fn data_parallel(self) -> DataParallel {
        match self {
            Mode::Ddp => DataParallel::Ddp(DdpConfig::default()),
            Mode::Zero(stage) => DataParallel::Zero(stage),
        }
    }
}

/// One lever (or combination) run on the ranks and on one process.
struct Case {
    name: &'static str,
    mode: Mode,
    config: StepConfig,
    /// Steps run before the values are compared (2 with an optimizer: its state
    /// matters in the second).
    steps: usize,
    /// Rounding depends on the tensors the lever sees (compress, autocast).
    lossy: bool,
}

fn sgd(placement: StatePlacement) -> OptimizerSpec {
    OptimizerSpec {
        kind: OptimizerKind::Sgd,
        lr: Some(0.1),
        momentum: Some(0.9),
        placement,
        ..OptimizerSpec::default()
    }
}

fn adamw(placement: StatePlacement, state: StatePrecision) -> OptimizerSpec {
    OptimizerSpec {
        kind: OptimizerKind::Adamw,
        lr: Some(ADAMW_LR),
        placement,
        state,
        ..OptimizerSpec::default()
    }
}

fn cases() -> Vec<Case> {
    let base = StepConfig::baseline;
    let with = |f: &dyn Fn(&mut StepConfig)| {
        let mut c = base();
        f(&mut c);
        c
    };
    let case = |name, mode, config: StepConfig, lossy| Case {
        name,
        mode,
        steps: if config.optimizer.is_some() { 2 } else { 1 },
        config,
        lossy,
    };
    let disk = OffloadSpec::Disk {
        dir: None,
        max_in_flight: None,
    };
    let (ddp, zero1, zero2) = (
        Mode::Ddp,
        Mode::Zero(ZeroStage::One),
        Mode::Zero(ZeroStage::Two),
    );
    use StatePlacement::{Cpu, Device as OnDevice, Disk};
    use StatePrecision::{Bf16, Int8, F32};
    vec![
        case("plain", ddp, base(), false),
        case(
            "offload_disk",
            ddp,
            with(&|c| c.saved = Some(SavedTensors::Offload(disk.clone()))),
            false,
        ),
        case(
            "offload_cpu",
            ddp,
            with(&|c| c.saved = Some(SavedTensors::Offload(OffloadSpec::Cpu))),
            false,
        ),
        case(
            "compress_int8",
            ddp,
            with(&|c| c.saved = Some(SavedTensors::Compress(CompressDtype::Int8))),
            true,
        ),
        case(
            "compress_bf16",
            ddp,
            with(&|c| c.saved = Some(SavedTensors::Compress(CompressDtype::Bf16))),
            true,
        ),
        case(
            "checkpoint_every_layer",
            ddp,
            with(&|c| c.plan = PlanChoice::Fixed(Plan::EveryLayer)),
            false,
        ),
        case(
            "checkpoint_segments",
            ddp,
            with(&|c| c.plan = PlanChoice::Fixed(Plan::Segments(2))),
            false,
        ),
        // The budgets are set to the smallest feasible one where the case runs.
        case(
            "checkpoint_budget",
            ddp,
            with(&|c| c.plan = PlanChoice::Budget(1)),
            false,
        ),
        case(
            "checkpoint_budget_offload",
            ddp,
            with(&|c| {
                c.plan = PlanChoice::BudgetWithLevers {
                    bytes: 1,
                    offload: true,
                    compress: None,
                }
            }),
            false,
        ),
        case(
            "accumulate",
            ddp,
            with(&|c| c.micro_batches = Some(2)),
            false,
        ),
        case(
            "autocast_bf16",
            ddp,
            with(&|c| c.autocast = Some(Kind::BFloat16)),
            true,
        ),
        case(
            "grad_scaler",
            ddp,
            with(&|c| c.scaler = Some(GradScalerConfig::default())),
            false,
        ),
        case(
            "grad_scaler_adamw_accumulate",
            ddp,
            with(&|c| {
                c.scaler = Some(GradScalerConfig::default());
                c.optimizer = Some(adamw(OnDevice, F32));
                c.micro_batches = Some(2);
            }),
            false,
        ),
        case(
            "sgd_device",
            ddp,
            with(&|c| c.optimizer = Some(sgd(OnDevice))),
            false,
        ),
        case(
            "sgd_cpu",
            ddp,
            with(&|c| c.optimizer = Some(sgd(Cpu))),
            false,
        ),
        case(
            "adamw_disk",
            ddp,
            with(&|c| c.optimizer = Some(adamw(Disk, F32))),
            false,
        ),
        case(
            "adamw_int8",
            ddp,
            with(&|c| c.optimizer = Some(adamw(OnDevice, Int8))),
            false,
        ),
        case(
            "adamw_bf16_every_layer_offload",
            ddp,
            with(&|c| {
                c.optimizer = Some(adamw(OnDevice, Bf16));
                c.plan = PlanChoice::Fixed(Plan::EveryLayer);
                c.saved = Some(SavedTensors::Offload(disk.clone()));
            }),
            false,
        ),
        case(
            "zero1_adamw",
            zero1,
            with(&|c| c.optimizer = Some(adamw(OnDevice, F32))),
            false,
        ),
        case(
            "zero2_adamw",
            zero2,
            with(&|c| c.optimizer = Some(adamw(OnDevice, F32))),
            false,
        ),
        case(
            "zero2_sgd_accumulate",
            zero2,
            with(&|c| {
                c.optimizer = Some(sgd(OnDevice));
                c.micro_batches = Some(2);
            }),
            false,
        ),
        case(
            "zero2_adamw_disk",
            zero2,
            with(&|c| c.optimizer = Some(adamw(Disk, F32))),
            false,
        ),
        case(
            "zero2_adamw_bf16",
            zero2,
            with(&|c| c.optimizer = Some(adamw(OnDevice, Bf16))),
            false,
        ),
        case(
            "zero1_adamw_int8",
            zero1,
            with(&|c| c.optimizer = Some(adamw(OnDevice, Int8))),
            false,
        ),
        case(
            "zero2_adamw_int8",
            zero2,
            with(&|c| c.optimizer = Some(adamw(OnDevice, Int8))),
            false,
        ),
        case(
            "zero1_sgd_offload_grads_accumulate",
            zero1,
            with(&|c| {
                c.optimizer = Some(sgd(Cpu));
                c.offload_grads = Some(GradsAfter::Restored);
                c.micro_batches = Some(2);
            }),
            false,
        ),
        case(
            "zero1_sgd_compress_int8",
            zero1,
            with(&|c| {
                c.optimizer = Some(sgd(OnDevice));
                c.saved = Some(SavedTensors::Compress(CompressDtype::Int8));
            }),
            true,
        ),
    ]
}

/// `config` with a budget plan's bytes set to the smallest budget feasible for `model`
/// on `x` (what the planner says when asked for 1 byte).
pub(crate) fn with_smallest_budget(
    mut config: StepConfig,
    model: &mut Mlp,
    x: &memsave_step::Batch,
) -> StepConfig {
    let smallest = match config.plan {
        PlanChoice::Budget(_) | PlanChoice::BudgetWithLevers { .. } => {
            let err = memsave_step::plan::apply_plan(model, x, &config, Device::Cpu)
                .expect_err("1 byte is not a feasible budget");
            let StepError::Lever { source, .. } = &err else {
                panic!("not the planner's error: {err:?}")
            };
            match source.downcast_ref::<CheckpointError>() {
                Some(CheckpointError::InfeasibleBudget {
                    smallest_feasible, ..
                }) => smallest_feasible.0,
                _ => panic!("not an infeasible budget: {err}"),
            }
        }
        PlanChoice::Fixed(_) => return config,
    };
    match &mut config.plan {
        PlanChoice::Budget(bytes) | PlanChoice::BudgetWithLevers { bytes, .. } => *bytes = smallest,
        PlanChoice::Fixed(_) => unreachable!(),
    }
    config
}

/// The values a case is judged by, after its steps: the weights with an optimizer,
/// else the gradients.
fn values(model: &Mlp, config: &StepConfig) -> Vec<Vec<f32>> {
    if config.optimizer.is_some() {
        weights(model)
    } else {
        f_grads(&model.parameters()).unwrap()
    }
}

fn weights(model: &Mlp) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| Vec::<f32>::try_from(&p.detach().reshape([-1])).unwrap())
        .collect()
}

/// One rank's run of `case` on its share of the batch.
fn run_on_rank(group: &ProcessGroup, case: &Case) -> Vec<Vec<f32>> {
    let rank = group.rank() as i64;
    let share = BATCH / WORLD;
    let mut model = model();
    let local = model
        .batch(BATCH)
        .unwrap()
        .f_narrow(rank * share, share)
        .unwrap();
    let config = with_smallest_budget(case.config.clone(), &mut model, &local);
    let mut trainer = TrainerBuilder::new(config.clone())
        .data_parallel(group, case.mode.data_parallel())
        .build(&mut model)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    for _ in 0..case.steps {
        let m = trainer
            .step(&local)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert!(m.bytes_sent.is_some_and(|b| b > 0), "{}: {m:?}", case.name);
    }
    values(trainer.model(), &config)
}

/// One process on the global batch; with `split`, each rank's share (and each of its
/// micro-batches) is a micro-batch.
fn run_on_one_process(case: &Case, split: bool) -> Vec<Vec<f32>> {
    let mut model = model();
    let x = model.batch(BATCH).unwrap();
    let mut config = case.config.clone();
    if split {
        config.micro_batches = Some(WORLD as usize * config.micro_batches.unwrap_or(1));
    }
    let config = with_smallest_budget(config, &mut model, &x);
    let mut trainer = TrainerBuilder::new(config.clone())
        .build(&mut model)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    for _ in 0..case.steps {
        let m = trainer.step(&x).unwrap();
        assert_eq!(m.bytes_sent, None);
    }
    values(trainer.model(), &config)
}

/// Where the launching test wants the ranks' files (`MEMSAVE_TEST_OUT`).
pub(crate) fn out_dir() -> PathBuf {
    std::env::var_os("MEMSAVE_TEST_OUT")
        .expect("MEMSAVE_TEST_OUT is set by the launching test")
        .into()
}

fn write_values(path: &Path, values: &[Vec<f32>]) {
    let bytes: Vec<u8> = values
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

fn read_values(path: &Path, like: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut flat = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
    let out: Vec<Vec<f32>> = like
        .iter()
        .map(|v| flat.by_ref().take(v.len()).collect())
        .collect();
    assert!(flat.next().is_none(), "{}: too many values", path.display());
    out
}

#[test]
#[ignore = "a rank of data_parallel::every_lever_runs_on_two_ranks_as_on_one_process: started by the launcher"]
fn data_parallel_worker() {
    let out = out_dir();
    let group = join_group();
    for case in cases() {
        let values = run_on_rank(&group, &case);
        write_values(
            &out.join(format!("{}-rank{}", case.name, group.rank())),
            &values,
        );
    }
}

/// A rank's group, with one libtorch thread (the ranks share the machine's cores).
pub(crate) fn join_group() -> ProcessGroup {
    tch::set_num_threads(1);
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    init_process_group(&options).expect("join the group")
}

/// Starts the ignored test `worker` (its path, e.g. `fsdp::fsdp_worker`) of this
/// binary as [`WORLD`] ranks, writing their files into `out`.
pub(crate) fn run_ranks(worker: &str, out: &Path) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let args: Vec<OsString> = [
        worker,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let config = LaunchConfig {
        nproc_per_node: WORLD as usize,
        timeout: Some(Duration::from_secs(300)),
        env: vec![("MEMSAVE_TEST_OUT".into(), out.as_os_str().to_owned())],
        ..Default::default()
    };
    launch(&config, exe.as_os_str(), &args).expect("every rank succeeds");
}

#[test]
#[serial]
fn every_lever_runs_on_two_ranks_as_on_one_process() {
    let dir = tempfile::tempdir().unwrap();
    run_ranks("data_parallel::data_parallel_worker", dir.path());
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for case in cases() {
        let whole = run_on_one_process(&case, false);
        let split = run_on_one_process(&case, true);
        let rank0 = read_values(&dir.path().join(format!("{}-rank0", case.name)), &whole);
        let rank1 = read_values(&dir.path().join(format!("{}-rank1", case.name)), &whole);
        // Every rank holds the same averaged gradients (or gathered weights).
        assert_eq!(rank0, rank1, "{}: the ranks differ", case.name);
        let (d_whole, d_split) = (max_abs_diff(&rank0, &whole), max_abs_diff(&rank0, &split));
        let what = if case.config.optimizer.is_some() {
            "weights"
        } else {
            "gradients"
        };
        report.push(format!(
            "{:<36} {what:<9} vs one process {d_whole:.2e}, vs shares as micro-batches {d_split:.2e}",
            case.name
        ));
        let within = |d: f64| d <= TOLERANCE;
        if !within(d_split) || (!case.lossy && !within(d_whole)) {
            failures.push(case.name);
        }
        // Not a vacuous comparison: the values are not all zero.
        assert!(
            whole.iter().flatten().any(|v| *v != 0.0),
            "{}: nothing to compare",
            case.name
        );
    }
    tch::set_num_threads(threads);
    eprintln!("{}", report.join("\n"));
    assert!(
        failures.is_empty(),
        "beyond their tolerance: {failures:?}\n{}",
        report.join("\n")
    );
}

/// A group of one rank over a file rendezvous: enough to build a data parallel trainer
/// and see what it refuses.
fn group_of_one(dir: &Path) -> ProcessGroup {
    ProcessGroup::new_file(&dir.join("store"), 0, 1, &InitOptions::default()).unwrap()
}

#[test]
#[serial]
fn what_cannot_run_data_parallel_is_refused_before_anything_is_built() {
    let dir = tempfile::tempdir().unwrap();
    let group = group_of_one(dir.path());
    let in_backward = OptimizerSpec {
        in_backward: true,
        ..OptimizerSpec::default()
    };
    let refused: [(&str, Mode, StepConfig, &str); 7] = [
        (
            "in_backward with ddp",
            Mode::Ddp,
            StepConfig {
                optimizer: Some(in_backward),
                ..StepConfig::baseline()
            },
            "in_backward",
        ),
        (
            "in_backward with zero",
            Mode::Zero(ZeroStage::One),
            StepConfig {
                optimizer: Some(in_backward),
                ..StepConfig::baseline()
            },
            "in_backward",
        ),
        (
            "offload_grads with ddp",
            Mode::Ddp,
            StepConfig {
                offload_grads: Some(GradsAfter::Restored),
                ..StepConfig::baseline()
            },
            "offload_grads",
        ),
        (
            "offload_grads with zero 2",
            Mode::Zero(ZeroStage::Two),
            StepConfig {
                offload_grads: Some(GradsAfter::Restored),
                optimizer: Some(OptimizerSpec::default()),
                ..StepConfig::baseline()
            },
            "offload_grads",
        ),
        (
            "grad_scaler with zero",
            Mode::Zero(ZeroStage::Two),
            StepConfig {
                scaler: Some(GradScalerConfig::default()),
                optimizer: Some(OptimizerSpec::default()),
                ..StepConfig::baseline()
            },
            "grad_scaler",
        ),
        (
            "zero 1 without an optimizer",
            Mode::Zero(ZeroStage::One),
            StepConfig::baseline(),
            "add an optimizer",
        ),
        (
            "zero 2 without an optimizer",
            Mode::Zero(ZeroStage::Two),
            StepConfig::baseline(),
            "add an optimizer",
        ),
    ];
    for (what, mode, config, names) in refused {
        // From the configuration alone, as a harness asks before starting ranks.
        let err = mode.data_parallel().check(&config).expect_err(what);
        assert!(
            matches!(err, StepError::InvalidConfig(_)),
            "{what}: {err:?}"
        );
        assert!(err.to_string().contains(names), "{what}: {err}");
        // The builder: refused before the plan, the hooks or the optimizer.
        let mut model = model();
        let before = weights(&model);
        let err = TrainerBuilder::new(config.clone())
            .data_parallel(&group, mode.data_parallel())
            .build(&mut model)
            .expect_err(what);
        assert!(
            matches!(err, StepError::InvalidConfig(_)),
            "{what}: {err:?}"
        );
        assert!(err.to_string().contains(names), "{what}: {err}");
        assert_eq!(before, weights(&model), "{what}: the parameters changed");
    }
}

/// A step handed a data parallel handle with an optimizer it cannot run refuses it
/// before the forward: no gradient freed, nothing communicated.
#[test]
#[serial]
fn a_step_refuses_an_optimizer_its_data_parallel_mode_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let group = group_of_one(dir.path());
    let model = model();
    let params = model.parameters();
    let x = model.batch(BATCH).unwrap();
    let ddp = DataParallelHandle::new(&group, Mode::Ddp.data_parallel(), &params).unwrap();
    // Stage 1: DDP's hooks hold the parameters' post-accumulate-grad hook slots.
    let zero = DataParallelHandle::new(&group, Mode::Zero(ZeroStage::One).data_parallel(), &params)
        .unwrap();
    let spec = OptimizerSpec::default();
    let config = StepConfig {
        optimizer: Some(spec),
        ..StepConfig::baseline()
    };
    // A whole optimizer under ZeRO, and a sharded one under DDP.
    let mut whole = memsave_step::CaseOptimizer::build(&spec, &params).unwrap();
    let mut sharded = zero.optimizer(&spec, &params).unwrap();
    assert_eq!(sharded.zero_stage(), Some(ZeroStage::One));
    // A gradient left from before: a refused step does not free it.
    model
        .layers()
        .f_forward(&x.input)
        .unwrap()
        .sum(Kind::Float)
        .backward();
    let grads = f_grads(&params).unwrap();
    for (handle, optimizer, names) in [
        (&zero, &mut whole, "sharded at stage 1"),
        (&ddp, &mut sharded, "whole optimizer"),
    ] {
        let err = memsave_step::StepRun::new(Device::Cpu)
            .optimizer(Some(optimizer))
            .data_parallel(Some(handle))
            .f_step(&model, &x, &config)
            .expect_err("refused");
        assert!(matches!(err, StepError::InvalidConfig(_)), "{err:?}");
        assert!(err.to_string().contains(names), "{err}");
        assert_eq!(f_grads(&params).unwrap(), grads);
    }
}
