//! `fit` on two ranks (this test binary started again as two processes by
//! memsave-dist's launcher) for a per-rank budget 4/5 of ZeRO-2's measured per-rank
//! peak: every rank returns the same choice, the data-parallel mode chosen with the
//! other levers, and that choice trained on the ranks through `FitReport::trainer_on`
//! peaks within the budget on every rank, measured here with the meter (independently
//! of `fit`'s own figures). Two models: one whose activations dominate (recompute or
//! micro-batches join a mode), one whose weights dominate the step (AdamW: 16 bytes a
//! parameter), which only ZeRO-3 fits.
//!
//! A step that fails on one rank ends the fit there with an error naming the rank,
//! and the other rank's fit ends with an error too instead of waiting past the group's
//! timeout. A configuration out of memory on the ranks (under a memory limit) does not
//! fit, and the fit goes on to another, on every rank.
//!
//! The per-rank budget counts the parameters and the optimizer's state: a rank's
//! peak is the most it allocated during the step less what it held before the
//! trainer was built, the parameters excepted (the batch is a view of the data).
use crate::common::{Mlp, Norm1d};
use memsave_dist::{init_process_group, launch, InitOptions, LaunchConfig, ProcessGroup};
use memsave_fit::{fit, FitRequest, ParallelMode};
use memsave_step::{
    DataParallel, FsdpConfig, OptimizerKind, OptimizerSpec, StepConfig, TrainerBuilder, Workload,
    ZeroStage,
};
use serial_test::serial;
use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

const WORLD: usize = 2;
/// The global batch; each rank's share is half of it.
const BATCH: i64 = 8;

/// The models of the scenarios, by name: `activations`, four residual blocks of width
/// 32 over 64 rows an example (the activations, about 1.3 MB a rank, outweigh the
/// parameters, 64 KB); `weights`, four blocks of width 128 over one row (1 MB of
/// parameters, and with AdamW 4 MB of parameters, gradients and state, against a few
/// KB of activations).
fn model(scenario: &str) -> Mlp {
    let mut m = match scenario {
        "activations" => Mlp::new(4, 32, BATCH, 64),
        "weights" => Mlp::new(4, 128, BATCH, 1),
        other => panic!("no scenario {other}"),
    };
    m.optimizer = Some(OptimizerSpec {
        kind: OptimizerKind::Adamw,
        lr: Some(1e-3),
        ..OptimizerSpec::default()
    });
    m
}

fn parameter_bytes(model: &impl Workload) -> u64 {
    model
        .parameters()
        .iter()
        .map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// The peak of each of `steps` steps of `builder` over `model` on this rank's share,
/// above what the rank held before it less the parameters.
fn rank_peaks<W: Workload>(
    builder: TrainerBuilder,
    model: &mut W,
    share: i64,
    steps: usize,
) -> Vec<u64> {
    let held = memsave_meter::f_memory_allocated(Device::Cpu).unwrap();
    let outside = held - parameter_bytes(model);
    let mut trainer = builder.build(model).unwrap();
    let batch = trainer.model().batch(share).unwrap();
    (0..steps)
        .map(|_| {
            let m = trainer.step(&batch).unwrap();
            m.start_bytes + m.peak_bytes - outside
        })
        .collect()
}

/// The largest of `value` over the ranks.
fn max_over_ranks(group: &ProcessGroup, value: u64) -> u64 {
    let input = Tensor::from_slice(&[value as i64]);
    let output = Tensor::zeros([group.world_size() as i64], (Kind::Int64, Device::Cpu));
    group.all_gather(&output, &input).unwrap();
    Vec::<i64>::try_from(&output)
        .unwrap()
        .into_iter()
        .max()
        .unwrap() as u64
}

fn out_dir() -> PathBuf {
    std::env::var_os("MEMSAVE_TEST_OUT")
        .expect("MEMSAVE_TEST_OUT is set by the launching test")
        .into()
}

#[test]
#[ignore = "a rank of the on_ranks tests that fit: started by the launcher"]
fn fit_worker() {
    tch::set_num_threads(1);
    memsave_meter::install();
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    let share = BATCH / WORLD as i64;
    let scenario = std::env::var("MEMSAVE_TEST_SCENARIO").expect("set by the launching test");
    let mut model = model(&scenario);
    let adamw = model.optimizer.unwrap();
    // ZeRO-2's plain step, measured first: the budget is below its peak.
    let zero2 = TrainerBuilder::new(StepConfig::baseline())
        .optimizer(adamw)
        .data_parallel(&group, DataParallel::Zero(ZeroStage::Two));
    let zero2_peak = max_over_ranks(&group, rank_peaks(zero2, &mut model, share, 2)[1]);
    let budget = zero2_peak * 4 / 5;
    let report = fit(&mut model, &FitRequest::new(budget).on_ranks(&group))
        .unwrap_or_else(|e| panic!("rank {}: {e}", group.rank()));
    let builder = report.choice.trainer_builder_on(Some(adamw), &group);
    let trained = rank_peaks(builder, &mut model, share, 2);
    let refused = report
        .candidates
        .iter()
        .filter(|c| {
            c.note
                .as_deref()
                .is_some_and(|n| n.starts_with("refused by"))
        })
        .count();
    let text = format!(
        "zero2_peak {zero2_peak}\nbudget {budget}\nstrategy {}\nmode {:?}\nworld_size {}\nmeasured_by_rank {:?}\ntrained {:?}\nrefused {refused}\ncandidates {}\n",
        report.choice.strategy,
        report.choice.data_parallel,
        report.world_size,
        report.measured_peak_bytes_by_rank,
        trained,
        report.candidates.len(),
    );
    std::fs::write(out_dir().join(format!("rank{}", group.rank())), text).unwrap();
    if group.rank() == 0 {
        std::fs::write(out_dir().join("report.txt"), report.to_text()).unwrap();
    }
}

#[test]
#[ignore = "a rank of on_ranks::a_step_that_fails_on_one_rank_ends_the_fit_naming_it: started by the launcher"]
fn failing_worker() {
    tch::set_num_threads(1);
    memsave_meter::install();
    let options = InitOptions {
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    let mut model = model("activations");
    // Rank 1's loss fails in forward while rank 0 all-reduces in backward: the ranks
    // cannot agree, and wait until the group's timeout (10 s, to keep the test short).
    model.fail = group.rank() == 1;
    let outcome = fit(&mut model, &FitRequest::new(1 << 30).on_ranks(&group));
    let text = match outcome {
        Ok(report) => format!("ok {}", report.choice.strategy),
        Err(e) => format!("error {e}"),
    };
    std::fs::write(out_dir().join(format!("rank{}", group.rank())), text).unwrap();
}

#[test]
#[ignore = "a rank of on_ranks::a_configuration_out_of_memory_on_the_ranks_does_not_fit_and_fit_goes_on: started by the launcher"]
fn memory_limit_worker() {
    tch::set_num_threads(1);
    memsave_meter::install();
    let options = InitOptions {
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    // One example a rank: no split to check for coupling (its runs, whole and split,
    // would need more than the limit leaves); the weights dominate the step anyway.
    let share = 1;
    let mut model = model("weights");
    let adamw = model.optimizer.unwrap();
    // The per-rank peaks of ZeRO-2's and ZeRO-3's plain steps (AdamW), measured first,
    // each on a model of its own (ZeRO-3 leaves its model's parameters in its shards).
    let peak = |mode| {
        let builder = TrainerBuilder::new(StepConfig::baseline())
            .optimizer(adamw)
            .data_parallel(&group, mode);
        let mut measured = self::model("weights");
        max_over_ranks(&group, rank_peaks(builder, &mut measured, share, 2)[1])
    };
    let zero2 = peak(DataParallel::Zero(ZeroStage::Two));
    let zero3 = peak(DataParallel::Fsdp(FsdpConfig::default()));
    // A memory limit that ZeRO-3's step stays under and ZeRO-2's (DDP's and ZeRO-1's,
    // which hold as much or more) crosses: halfway between the two peaks above what the
    // rank holds now (the parameters, which those peaks count, in it; the probes' copy
    // of them is the rest). The budget is far above: the limit decides.
    let held = memsave_meter::f_memory_allocated(Device::Cpu).unwrap();
    let limit = held + (zero2 + zero3) / 2;
    memsave_meter::f_set_memory_limit(Device::Cpu, Some(limit)).unwrap();
    let mut request = FitRequest::new(1 << 30).on_ranks(&group);
    request.global_batch = Some(share * WORLD as i64);
    let outcome = fit(&mut model, &request);
    memsave_meter::f_set_memory_limit(Device::Cpu, None).unwrap();
    let text = match outcome {
        Ok(report) => {
            let out_of_memory = report
                .candidates
                .iter()
                .filter(|c| {
                    c.note
                        .as_deref()
                        .is_some_and(|n| n.starts_with("a micro-batch of one example does not fit"))
                })
                .count();
            if group.rank() == 0 {
                std::fs::write(out_dir().join("report.txt"), report.to_text()).unwrap();
            }
            format!(
                "ok {:?} {} {out_of_memory} zero2 {zero2} zero3 {zero3} measured {:?}",
                report.choice.data_parallel,
                report.small_runs_over_budget,
                report.measured_peak_bytes_by_rank,
            )
        }
        Err(e) => format!("error {e} (zero2 {zero2} zero3 {zero3})"),
    };
    std::fs::write(out_dir().join(format!("rank{}", group.rank())), text).unwrap();
}

#[test]
#[ignore = "a rank of on_ranks::fit_plans_the_blocks_of_a_model_on_two_ranks: started by the launcher"]
fn blocks_worker() {
    use memsave_checkpoint::Plan;
    use memsave_step::PlanChoice;
    tch::set_num_threads(1);
    memsave_meter::install();
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    // The activations (2048 rows of width 64 a rank, a few tensors a block) outweigh
    // the parameters (about 160 KB).
    let new = || crate::blocks::Graph::new(3, 64, 4096);
    let share = 4096 / WORLD as i64;
    let ddp = |plan| {
        let mut config = StepConfig::baseline();
        config.plan = PlanChoice::Fixed(plan);
        TrainerBuilder::new(config).data_parallel(&group, DataParallel::Ddp(Default::default()))
    };
    let kept = max_over_ranks(&group, rank_peaks(ddp(Plan::None), &mut new(), share, 2)[1]);
    let recomputed = max_over_ranks(
        &group,
        rank_peaks(ddp(Plan::EveryLayer), &mut new(), share, 2)[1],
    );
    let budget = (kept + recomputed) / 2;
    let mut model = new();
    let report = fit(&mut model, &FitRequest::new(budget).on_ranks(&group))
        .unwrap_or_else(|e| panic!("rank {}: {e}", group.rank()));
    let blocks = report
        .candidates
        .iter()
        .filter(|c| c.choice.blocks.is_some())
        .count();
    let text = format!(
        "kept {kept}\nrecomputed {recomputed}\nbudget {budget}\nstrategy {}\nblocks {}\nblock_candidates {blocks}\nmeasured_by_rank {:?}\n",
        report.choice.strategy,
        report.choice.blocks.as_deref().unwrap_or("none"),
        report.measured_peak_bytes_by_rank,
    );
    std::fs::write(out_dir().join(format!("rank{}", group.rank())), text).unwrap();
    if group.rank() == 0 {
        std::fs::write(out_dir().join("report.txt"), report.to_text()).unwrap();
    }
}

/// Starts `worker` (a test of this module) of this binary as two ranks, on
/// `scenario`'s model.
fn run_ranks(out: &Path, worker: &str, scenario: &str) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let worker = format!("on_ranks::{worker}");
    let args: Vec<OsString> = [
        worker.as_str(),
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
        nproc_per_node: WORLD,
        timeout: Some(Duration::from_secs(600)),
        env: vec![
            ("MEMSAVE_TEST_OUT".into(), out.as_os_str().to_owned()),
            ("MEMSAVE_TEST_SCENARIO".into(), scenario.into()),
        ],
        ..Default::default()
    };
    launch(&config, exe.as_os_str(), &args).expect("every rank succeeds");
}

/// `key value` lines of a rank's file.
fn read(out: &Path, name: &str) -> HashMap<String, String> {
    let text = std::fs::read_to_string(out.join(name)).unwrap();
    text.lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn get<'a>(lines: &'a HashMap<String, String>, key: &str) -> &'a str {
    &lines[key]
}

fn numbers(list: &str) -> Vec<u64> {
    list.trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .map(|n| n.parse().unwrap())
        .collect()
}

/// Runs `worker` on two ranks over `scenario`'s model and reads rank 0's report and
/// every rank's `key value` file, asserting that the ranks wrote the same value for
/// each of `agreed`.
fn run_agreeing(
    worker: &str,
    scenario: &str,
    agreed: &[&str],
) -> (String, Vec<HashMap<String, String>>) {
    let dir = tempfile::tempdir().unwrap();
    run_ranks(dir.path(), worker, scenario);
    let report = std::fs::read_to_string(dir.path().join("report.txt")).unwrap();
    let ranks: Vec<_> = (0..WORLD)
        .map(|r| read(dir.path(), &format!("rank{r}")))
        .collect();
    for key in agreed {
        for (r, lines) in ranks.iter().enumerate().skip(1) {
            assert_eq!(
                get(&ranks[0], key),
                get(lines, key),
                "{key}: rank 0 vs rank {r}\n{report}"
            );
        }
    }
    (report, ranks)
}

/// Fits `scenario`'s model on two ranks and checks what every choice must hold; the
/// choice's mode, and rank 0's report.
fn fit_on_two_ranks(scenario: &str) -> (String, String) {
    // The ranks ran the same search: the same budget, choice and candidates.
    let (report, ranks) = run_agreeing(
        "fit_worker",
        scenario,
        &[
            "budget",
            "strategy",
            "mode",
            "measured_by_rank",
            "candidates",
        ],
    );
    let budget: u64 = get(&ranks[0], "budget").parse().unwrap();
    let zero2: u64 = get(&ranks[0], "zero2_peak").parse().unwrap();
    assert!(budget < zero2, "{budget} vs ZeRO-2's {zero2}");
    assert_eq!(get(&ranks[0], "world_size"), "2");
    assert_ne!(
        get(&ranks[0], "strategy"),
        ParallelMode::Zero2.name(),
        "ZeRO-2 alone does not fit below its own peak\n{report}"
    );
    // fit's own figures, one per rank, within the budget.
    let by_rank = numbers(get(&ranks[0], "measured_by_rank"));
    assert_eq!(by_rank.len(), WORLD, "{report}");
    assert!(
        by_rank.iter().all(|&p| p > 0 && p <= budget),
        "{by_rank:?} vs {budget}\n{report}"
    );
    // The choice trained on the ranks: each rank's second step measured here.
    for (r, lines) in ranks.iter().enumerate() {
        let trained = numbers(get(lines, "trained"));
        assert!(
            trained[1] <= budget,
            "rank {r}: trained step peaks {trained:?} over the budget {budget}\n{report}"
        );
    }
    // What a mode refuses is noted (the step in backward under DDP, ZeRO-1 and 2).
    let refused: usize = get(&ranks[0], "refused").parse().unwrap();
    assert!(refused >= 3, "{report}");
    assert!(report.contains("refused by ddp: "), "{report}");
    eprintln!("{report}");
    (get(&ranks[0], "mode").to_owned(), report)
}

#[test]
#[serial]
fn fit_on_two_ranks_joins_a_mode_to_recompute_when_activations_dominate() {
    let (mode, report) = fit_on_two_ranks("activations");
    assert!(mode.starts_with("Some("), "{mode}\n{report}");
}

#[test]
#[serial]
fn fit_on_two_ranks_shards_the_weights_when_they_dominate_the_step() {
    let (mode, report) = fit_on_two_ranks("weights");
    assert_eq!(mode, "Some(Zero3)", "{report}");
}

#[test]
#[serial]
fn a_step_that_fails_on_one_rank_ends_the_fit_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    run_ranks(dir.path(), "failing_worker", "activations");
    let read = |r: usize| std::fs::read_to_string(dir.path().join(format!("rank{r}"))).unwrap();
    let (rank0, rank1) = (read(0), read(1));
    assert!(
        rank1.starts_with("error the workload's step failed: rank 1: ")
            && rank1.contains("this loss always fails"),
        "{rank1}"
    );
    assert!(rank0.starts_with("error "), "rank 0 goes on alone: {rank0}");
    eprintln!("rank 0: {rank0}\nrank 1: {rank1}");
}

#[test]
#[serial]
fn a_configuration_out_of_memory_on_the_ranks_does_not_fit_and_fit_goes_on() {
    // Under a memory limit that only ZeRO-3 stays under, DDP's, ZeRO-1's and ZeRO-2's
    // steps fail out of memory on every rank: the ranks agree that those do not fit,
    // as one process counts a step out of memory, and choose ZeRO-3 (before, the first
    // step out of memory ended the fit on every rank).
    let dir = tempfile::tempdir().unwrap();
    run_ranks(dir.path(), "memory_limit_worker", "none");
    let read = |r: usize| std::fs::read_to_string(dir.path().join(format!("rank{r}"))).unwrap();
    let (rank0, rank1) = (read(0), read(1));
    let report = std::fs::read_to_string(dir.path().join("report.txt")).unwrap_or_default();
    eprintln!("rank 0: {rank0}\nrank 1: {rank1}\n{report}");
    assert_eq!(rank0, rank1, "the ranks disagree");
    let fields: Vec<&str> = rank0.split(' ').collect();
    assert_eq!(fields[0], "ok", "{rank0}");
    assert_eq!(fields[1], "Some(Zero3)", "{rank0}");
    let over: usize = fields[2].parse().unwrap();
    assert!(over > 0, "no step ran out of memory: {rank0}");
    let left_out: usize = fields[3].parse().unwrap();
    assert!(
        left_out >= 3,
        "DDP, ZeRO-1 and ZeRO-2 are not all left out: {rank0}"
    );
}

#[test]
#[ignore = "a rank of spoiled_splits_are_left_out_on_every_rank: started by the launcher"]
fn spoiled_split_worker() {
    tch::set_num_threads(1);
    memsave_meter::install();
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    // A global batch of 4: each rank's share of 2 splits into micro-batches of one.
    let mut model = Norm1d::new(4, 64);
    let mut request = FitRequest::new(1 << 30).on_ranks(&group);
    request.allow.micro_batches = true;
    request.exhaustive = true;
    let text = match fit(&mut model, &request) {
        Ok(report) => {
            let spoiled = report
                .candidates
                .iter()
                .filter(|c| {
                    c.note
                        .as_deref()
                        .is_some_and(|n| n.contains("one value per channel"))
                })
                .count();
            format!(
                "ok {} {} {spoiled}",
                report.choice.strategy, report.choice.micro_batches
            )
        }
        Err(e) => format!("error {e}"),
    };
    std::fs::write(out_dir().join(format!("rank{}", group.rank())), text).unwrap();
}

#[test]
#[serial]
fn spoiled_splits_are_left_out_on_every_rank() {
    // The check runs after the step's collectives: the ranks agree on it, as on a
    // peak, and go on with the other configurations (before, each rank's fit ended).
    let dir = tempfile::tempdir().unwrap();
    run_ranks(dir.path(), "spoiled_split_worker", "none");
    let read = |r: usize| std::fs::read_to_string(dir.path().join(format!("rank{r}"))).unwrap();
    let (rank0, rank1) = (read(0), read(1));
    assert_eq!(rank0, rank1, "the ranks disagree");
    let fields: Vec<&str> = rank0.split(' ').collect();
    assert_eq!(fields[0], "ok", "{rank0}");
    assert_eq!(fields[2], "1", "a split on one example a rank: {rank0}");
    let spoiled: usize = fields[3].parse().unwrap();
    assert!(spoiled > 0, "no spoiled split was run: {rank0}");
}

/// `fit` on two ranks plans the blocks of a model of blocks (each rank profiles them,
/// and the ranks agree on each figure): at a per-rank budget halfway between the
/// plain step's and every block recomputed (both under DDP), the ranks choose the
/// same configuration, with blocks recomputed, within the budget on each rank.
#[test]
#[serial]
fn fit_plans_the_blocks_of_a_model_on_two_ranks() {
    let (report, ranks) = run_agreeing(
        "blocks_worker",
        "blocks",
        &[
            "budget",
            "strategy",
            "blocks",
            "measured_by_rank",
            "block_candidates",
        ],
    );
    let kept: u64 = get(&ranks[0], "kept").parse().unwrap();
    let recomputed: u64 = get(&ranks[0], "recomputed").parse().unwrap();
    assert!(recomputed < kept, "{recomputed} vs {kept}");
    let budget: u64 = get(&ranks[0], "budget").parse().unwrap();
    let candidates: usize = get(&ranks[0], "block_candidates").parse().unwrap();
    assert!(
        candidates > 0,
        "no candidate with per-block levers\n{report}"
    );
    assert!(
        get(&ranks[0], "blocks").starts_with("recompute "),
        "the choice recomputes blocks\n{report}"
    );
    let by_rank = numbers(get(&ranks[0], "measured_by_rank"));
    assert!(
        by_rank.iter().all(|&p| p > 0 && p <= budget),
        "{by_rank:?} vs {budget}\n{report}"
    );
    eprintln!("{report}");
}
