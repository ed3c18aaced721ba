//! ZeRO-3 through the step engine (`DataParallel::Fsdp`): two ranks (processes over
//! 127.0.0.1, this test binary started again by memsave-dist's launcher) train the
//! residual MLP with each block one fully sharded unit, under the levers the engine
//! composes with it; the weights after two AdamW steps must equal a single-process run
//! of the same configuration within 1e-6 (lossy levers: the run where each rank's share
//! is a micro-batch of its own, see `data_parallel`), and each rank's resident
//! parameter bytes between steps (the meter's), gathered peak and bytes sent must be
//! what the algorithm says. What cannot run is refused before anything is sharded.
use crate::common::Mlp;
use crate::data_parallel::{join_group, out_dir, run_ranks, with_smallest_budget};
use memsave_amp::GradScalerConfig;
use memsave_checkpoint::{CheckpointedSequential, Plan};
use memsave_dist::{InitOptions, ProcessGroup};
use memsave_meter::memory_allocated;
use memsave_step::step::max_abs_diff;
use memsave_step::{
    Batch, CompressDtype, DataParallel, DataParallelHandle, FsdpConfig, GradsAfter, LayerWrapper,
    OffloadSpec, OptimizerKind, OptimizerSpec, PlanChoice, SavedTensors, StatePlacement,
    StatePrecision, StepConfig, StepError, TrainerBuilder, Workload,
};
use serial_test::serial;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const WORLD: i64 = 2;
/// 6 examples a rank: 3 micro-batches of 2.
const BATCH: i64 = 12;
const LAYERS: usize = 3;
/// Odd, so that each block's values are odd and 2 ranks pad every unit by one value.
const HIDDEN: i64 = 15;
const STEPS: usize = 2;
const TOLERANCE: f64 = 1e-6;
const ADAMW_LR: f64 = 1e-2;

/// Values of one block, `up` (h -> 2h) and `down` (2h -> h) with their biases:
/// 2h² + 2h + 2h² + h = 945.
const UNIT_VALUES: u64 = (4 * HIDDEN * HIDDEN + 3 * HIDDEN) as u64;

/// 8 rows an example: a rank's hidden activations (6 x 8 x 30 values) pass the 4 KiB
/// below which compression keeps tensors as they are, its input (6 x 8 x 15) does not.
/// (One process on the global batch would compress the second micro-batch's input, a
/// view at an offset into the batch it holds: a lossy lever's reference must see the
/// same tensors compressed as the ranks do.)
fn model() -> Mlp {
    Mlp::new(LAYERS, HIDDEN, BATCH, 8)
}

fn adamw() -> OptimizerSpec {
    OptimizerSpec {
        kind: OptimizerKind::Adamw,
        lr: Some(ADAMW_LR),
        ..OptimizerSpec::default()
    }
}

/// SGD for the lossy levers: AdamW's first steps move each value by about `lr` times
/// the sign of its gradient, so a gradient near zero that rounds differently on the
/// ranks (summed in another order) moves by up to `2 lr`, which would hide what the
/// comparison is for.
fn sgd() -> OptimizerSpec {
    OptimizerSpec {
        kind: OptimizerKind::Sgd,
        lr: Some(0.1),
        momentum: Some(0.9),
        ..OptimizerSpec::default()
    }
}

/// One configuration run on the ranks under ZeRO-3 and on one process.
struct Case {
    name: &'static str,
    reshard_after_forward: bool,
    config: StepConfig,
    /// Rounding depends on the tensors the lever sees (compress, autocast).
    lossy: bool,
    /// [`TOLERANCE`], but for 8-bit state, whose blocks run over each parameter's shard
    /// where one process blocks each parameter (as ZeRO's in `data_parallel`): AdamW's
    /// update is at most `lr` a value, and its 8-bit moments are off by at most 1/127
    /// of a block's largest, so the weights end within `lr / 5` of one process's.
    tolerance: f64,
    /// The optimizer keeps two f32 moments per shard value in memory.
    f32_adamw_state: bool,
    /// Backward reads the gathered weights (so resharded units are gathered again):
    /// not under autocast, whose backward reads the bf16 copies autograd saved.
    backward_reads_weights: bool,
}

fn cases() -> Vec<Case> {
    let with = |f: &dyn Fn(&mut StepConfig)| {
        let mut c = StepConfig {
            optimizer: Some(adamw()),
            ..StepConfig::baseline()
        };
        f(&mut c);
        c
    };
    let case = |name, config: StepConfig| Case {
        name,
        reshard_after_forward: true,
        f32_adamw_state: config.optimizer.is_some_and(|o| {
            o.kind == OptimizerKind::Adamw
                && o.state == StatePrecision::F32
                && o.placement == StatePlacement::Device
        }),
        config,
        lossy: false,
        tolerance: TOLERANCE,
        backward_reads_weights: true,
    };
    let disk = OffloadSpec::Disk {
        dir: None,
        max_in_flight: None,
    };
    vec![
        case("plain", with(&|_| {})),
        Case {
            reshard_after_forward: false,
            ..case("keep_weights", with(&|_| {}))
        },
        case(
            "every_layer",
            with(&|c| c.plan = PlanChoice::Fixed(Plan::EveryLayer)),
        ),
        case("accumulate_3", with(&|c| c.micro_batches = Some(3))),
        case(
            "every_layer_accumulate_3",
            with(&|c| {
                c.plan = PlanChoice::Fixed(Plan::EveryLayer);
                c.micro_batches = Some(3);
            }),
        ),
        case(
            "checkpoint_budget_offload",
            with(&|c| {
                c.plan = PlanChoice::BudgetWithLevers {
                    bytes: 1,
                    offload: true,
                    compress: None,
                }
            }),
        ),
        case(
            "in_backward",
            with(&|c| {
                c.optimizer = Some(OptimizerSpec {
                    in_backward: true,
                    ..adamw()
                })
            }),
        ),
        case(
            "in_backward_every_layer",
            with(&|c| {
                c.optimizer = Some(OptimizerSpec {
                    in_backward: true,
                    ..adamw()
                });
                c.plan = PlanChoice::Fixed(Plan::EveryLayer);
            }),
        ),
        case(
            "offload_disk",
            with(&|c| c.saved = Some(SavedTensors::Offload(disk.clone()))),
        ),
        case(
            "offload_disk_accumulate_3",
            with(&|c| {
                c.saved = Some(SavedTensors::Offload(disk.clone()));
                c.micro_batches = Some(3);
            }),
        ),
        Case {
            lossy: true,
            ..case(
                "compress_int8_sgd",
                with(&|c| {
                    c.saved = Some(SavedTensors::Compress(CompressDtype::Int8));
                    c.optimizer = Some(sgd());
                }),
            )
        },
        Case {
            lossy: true,
            backward_reads_weights: false,
            ..case(
                "autocast_bf16_sgd",
                with(&|c| {
                    c.autocast = Some(Kind::BFloat16);
                    c.optimizer = Some(sgd());
                }),
            )
        },
        Case {
            tolerance: ADAMW_LR / 5.0,
            ..case(
                "adamw_int8_state",
                with(&|c| {
                    c.optimizer = Some(OptimizerSpec {
                        state: StatePrecision::Int8,
                        ..adamw()
                    })
                }),
            )
        },
        case(
            "sgd_momentum_disk",
            with(&|c| {
                c.optimizer = Some(OptimizerSpec {
                    placement: StatePlacement::Disk,
                    ..sgd()
                })
            }),
        ),
    ]
}

/// Every layer's weights after the steps, in layer order (each layer's parameters as
/// `layer_parameters` lists them: the units' order).
fn layer_weights(model: &Mlp) -> Vec<Vec<f32>> {
    model
        .layer_parameters()
        .unwrap()
        .unwrap()
        .iter()
        .flatten()
        .map(|p| Vec::<f32>::try_from(&p.detach().reshape([-1])).unwrap())
        .collect()
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
    let mut trainer = TrainerBuilder::new(config)
        .build(&mut model)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    for _ in 0..STEPS {
        trainer
            .step(&x)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    }
    layer_weights(trainer.model())
}

/// What the saved-tensor hooks of `case` took in the last step of one process trained
/// on rank `rank`'s share alone (its parameters passed through): offloaded bytes and
/// compression's saved bytes, -1 for none.
fn saved_on_one_process(case: &Case, rank: i64) -> (i64, i64) {
    let mut model = model();
    let share = BATCH / WORLD;
    let x = model
        .batch(BATCH)
        .unwrap()
        .f_narrow(rank * share, share)
        .unwrap();
    let mut trainer = TrainerBuilder::new(case.config.clone())
        .build(&mut model)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    let mut saved = (-1, -1);
    for _ in 0..STEPS {
        let m = trainer.step(&x).unwrap();
        saved = (
            m.offloaded_bytes.map_or(-1, |b| b as i64),
            m.compressed_saved_bytes.map_or(-1, |b| b as i64),
        );
    }
    saved
}

/// One rank's run of `case` on its share; writes the full weights (gathered from the
/// shards) and the figures of the last step.
fn run_on_rank(group: &ProcessGroup, case: &Case, out: &Path) {
    let rank = group.rank() as i64;
    let share = BATCH / WORLD;
    let mut model = model();
    let local = model
        .batch(BATCH)
        .unwrap()
        .f_narrow(rank * share, share)
        .unwrap();
    let config = with_smallest_budget(case.config.clone(), &mut model, &local);
    // Before the layers are sharded: the full weights are allocated.
    let base = memory_allocated(Device::Cpu);
    let mode = DataParallel::Fsdp(FsdpConfig {
        reshard_after_forward: case.reshard_after_forward,
        ..Default::default()
    });
    let mut trainer = TrainerBuilder::new(config)
        .data_parallel(group, mode)
        .build(&mut model)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    let mut sent = Vec::new();
    let mut saved = (None, None);
    for _ in 0..STEPS {
        let m = trainer
            .step(&local)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        sent.push(m.bytes_sent.expect("a data parallel step counts its bytes"));
        saved = (m.offloaded_bytes, m.compressed_saved_bytes);
    }
    // Gloo's worker thread may let go of the last reduce-scatter's input a moment after
    // the call returns; the next collective waits for it.
    group.barrier().unwrap();
    let between = memory_allocated(Device::Cpu) as i64 - base as i64;
    let dp = trainer.data_parallel().expect("data parallel");
    let stats = dp.fsdp_stats().expect("ZeRO-3");
    let full = dp.fsdp().unwrap().f_full_parameters().unwrap();
    let weights: Vec<Vec<f32>> = full
        .iter()
        .map(|t| Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
        .collect();
    let mut figures = String::new();
    for (key, value) in [
        ("bytes_sent_first", sent[0] as i64),
        ("bytes_sent_last", sent[STEPS - 1] as i64),
        ("between_steps", between),
        ("parameter_bytes", stats.parameter_bytes as i64),
        ("padding_values", stats.padding_values as i64),
        ("gathered_bytes", stats.gathered_bytes as i64),
        ("gathered_peak_bytes", stats.gathered_peak_bytes as i64),
        ("state_bytes", trainer.optimizer_state_bytes() as i64),
        ("offloaded_bytes", saved.0.map_or(-1, |b| b as i64)),
        ("compressed_saved_bytes", saved.1.map_or(-1, |b| b as i64)),
    ] {
        writeln!(figures, "{key} {value}").unwrap();
    }
    let tag = format!("{}-rank{rank}", case.name);
    std::fs::write(out.join(format!("{tag}.figures")), figures).unwrap();
    write_values(&out.join(format!("{tag}.weights")), &weights);
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

fn figures(path: &Path) -> BTreeMap<String, i64> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("key value");
            (k.to_owned(), v.parse().expect("a number"))
        })
        .collect()
}

#[test]
#[ignore = "a rank of fsdp::zero3_trains_on_two_ranks_as_on_one_process: started by the launcher"]
fn fsdp_worker() {
    memsave_meter::install();
    let out = out_dir();
    let group = join_group();
    for case in cases() {
        run_on_rank(&group, &case, &out);
    }
}

#[test]
#[serial]
fn zero3_trains_on_two_ranks_as_on_one_process() {
    let dir = tempfile::tempdir().unwrap();
    run_ranks("fsdp::fsdp_worker", dir.path());
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let n = WORLD as u64;
    // Each unit padded to a multiple of N on its own: 473 values a rank per unit.
    let shard_values = LAYERS as u64 * UNIT_VALUES.div_ceil(n);
    let full_bytes = 4 * LAYERS as u64 * UNIT_VALUES;
    let parameter_bytes = 4 * shard_values + 4; // and the 4-byte zero freed weights view
    let padded_unit_bytes = 4 * n * UNIT_VALUES.div_ceil(n);
    // Every gather and reduce-scatter sends (N-1)/N of a padded unit.
    let one_pass = 4 * (n - 1) * shard_values;
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for case in cases() {
        let whole = run_on_one_process(&case, false);
        // One process stepping in backward would step at every micro-batch.
        let in_backward = case.config.optimizer.is_some_and(|o| o.in_backward);
        let split = if in_backward {
            whole.clone()
        } else {
            run_on_one_process(&case, true)
        };
        let rank0 = read_values(
            &dir.path().join(format!("{}-rank0.weights", case.name)),
            &whole,
        );
        let rank1 = read_values(
            &dir.path().join(format!("{}-rank1.weights", case.name)),
            &whole,
        );
        assert_eq!(
            rank0, rank1,
            "{}: the ranks' full weights differ",
            case.name
        );
        let (d_whole, d_split) = (max_abs_diff(&rank0, &whole), max_abs_diff(&rank0, &split));
        report.push(format!(
            "{:<28} weights vs one process {d_whole:.2e}, vs shares as micro-batches {d_split:.2e}",
            case.name
        ));
        let within = |d: f64| d <= case.tolerance;
        if !within(d_split) || (!case.lossy && !within(d_whole)) {
            failures.push(case.name);
        }
        for rank in 0..WORLD {
            let tag = format!("{}-rank{rank}", case.name);
            let f = figures(&dir.path().join(format!("{tag}.figures")));
            assert_eq!(f["parameter_bytes"], parameter_bytes as i64, "{tag}");
            assert_eq!(
                f["padding_values"],
                (shard_values - (LAYERS as u64 * UNIT_VALUES).div_ceil(n)) as i64,
                "{tag}: values beyond ceil(P/N)"
            );
            assert_eq!(
                f["gathered_bytes"], 0,
                "{tag}: nothing gathered between steps"
            );
            // Resharding: backward prefetch (on by default) holds the unit backward
            // runs and the next one at once when backward gathers units; one unit
            // otherwise (only the forward gathers).
            let gathered_peak = if case.reshard_after_forward && case.backward_reads_weights {
                2 * padded_unit_bytes
            } else if case.reshard_after_forward {
                padded_unit_bytes
            } else {
                LAYERS as u64 * padded_unit_bytes
            };
            assert_eq!(f["gathered_peak_bytes"], gathered_peak as i64, "{tag}");
            // Per micro-batch: every unit all-gathered in forward and again in backward
            // (unless kept, or backward reads no weight), and reduce-scattered with the
            // used-flags of its 4 parameters in each of the N chunks.
            let passes = if case.reshard_after_forward && case.backward_reads_weights {
                3
            } else {
                2
            };
            let micro = case.config.micro_batches.unwrap_or(1) as u64;
            let flags = 4 * (n - 1) * 4 * LAYERS as u64;
            let expected_sent = (micro * (passes * one_pass + flags)) as i64;
            assert_eq!(f["bytes_sent_first"], expected_sent, "{tag}: bytes sent");
            assert_eq!(f["bytes_sent_last"], expected_sent, "{tag}: bytes sent");
            if case.config.saved.is_some() {
                // The step's hooks got the activations, as on one process, and not
                // the gathered weights (ZeRO-3's hook keeps those).
                let (offloaded, compressed) = saved_on_one_process(&case, rank);
                assert!(offloaded > 0 || compressed > 0, "{tag}: nothing to compare");
                assert_eq!(f["offloaded_bytes"], offloaded, "{tag}: offloaded bytes");
                assert_eq!(
                    f["compressed_saved_bytes"], compressed,
                    "{tag}: bytes compression saved"
                );
            }
            if case.f32_adamw_state {
                assert_eq!(
                    f["state_bytes"],
                    8 * shard_values as i64,
                    "{tag}: AdamW state"
                );
                // By the meter: the full weights gave way to the shards, and the state
                // came; nothing else stays between steps.
                assert_eq!(
                    f["between_steps"],
                    parameter_bytes as i64 - full_bytes as i64 + f["state_bytes"],
                    "{tag}: bytes held between steps, less those before sharding"
                );
            }
        }
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

/// A group of one rank over a file rendezvous: enough to see what is refused.
fn group_of_one(dir: &Path) -> ProcessGroup {
    ProcessGroup::new_file(&dir.join("store"), 0, 1, &InitOptions::default()).unwrap()
}

fn zero3() -> DataParallel {
    DataParallel::Fsdp(FsdpConfig::default())
}

fn weights(model: &dyn Workload) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| Vec::<f32>::try_from(&p.detach().reshape([-1])).unwrap())
        .collect()
}

#[test]
#[serial]
fn what_zero3_cannot_run_is_refused_from_the_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let group = group_of_one(dir.path());
    let refused: [(&str, StepConfig, &str); 3] = [
        (
            "in_backward with accumulation",
            StepConfig {
                optimizer: Some(OptimizerSpec {
                    in_backward: true,
                    ..adamw()
                }),
                micro_batches: Some(3),
                ..StepConfig::baseline()
            },
            "in_backward",
        ),
        (
            "grad_scaler",
            StepConfig {
                scaler: Some(GradScalerConfig::default()),
                optimizer: Some(adamw()),
                ..StepConfig::baseline()
            },
            "grad_scaler",
        ),
        (
            "offload_grads",
            StepConfig {
                offload_grads: Some(GradsAfter::Restored),
                optimizer: Some(adamw()),
                ..StepConfig::baseline()
            },
            "offload_grads",
        ),
    ];
    for (what, config, names) in refused {
        let err = zero3().check(&config).expect_err(what);
        assert!(
            matches!(err, StepError::InvalidConfig(_)),
            "{what}: {err:?}"
        );
        assert!(err.to_string().contains(names), "{what}: {err}");
        assert!(err.to_string().contains("zero: 3"), "{what}: {err}");
        let mut model = model();
        let before = weights(&model);
        let err = TrainerBuilder::new(config)
            .data_parallel(&group, zero3())
            .build(&mut model)
            .expect_err(what);
        assert!(
            matches!(err, StepError::InvalidConfig(_)),
            "{what}: {err:?}"
        );
        assert_eq!(before, weights(&model), "{what}: the parameters changed");
    }
    // What ZeRO-3 runs with: no optimizer, in_backward with one micro-batch.
    for config in [
        StepConfig::baseline(),
        StepConfig {
            optimizer: Some(OptimizerSpec {
                in_backward: true,
                ..adamw()
            }),
            micro_batches: Some(1),
            ..StepConfig::baseline()
        },
    ] {
        zero3().check(&config).unwrap();
    }
}

/// A change to the MLP's lists of layer parameters.
type Edit = fn(Vec<Vec<Tensor>>) -> Vec<Vec<Tensor>>;

/// A workload delegating to the MLP, whose layer parameters are `layers` of the MLP's
/// (or none at all), and which may not wrap its layers.
struct Attributed {
    inner: Mlp,
    layers: Option<Edit>,
    wraps: bool,
    /// Whether finding the layers' parameters fails (as running the layers can).
    fails: bool,
}

impl Workload for Attributed {
    fn name(&self) -> &str {
        "attributed"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        self.inner.layers()
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        self.inner.layers_mut()
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.inner.parameters()
    }
    fn global_batch(&self) -> i64 {
        self.inner.global_batch()
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        self.inner.batch(size)
    }
    fn layer_parameters(&self) -> Result<Option<Vec<Vec<Tensor>>>, tch::TchError> {
        if self.fails {
            return Err(tch::TchError::Torch(
                "layer 1 ran out of memory finding its parameters".into(),
            ));
        }
        Ok(self
            .layers
            .map(|f| f(self.inner.layer_parameters().unwrap().unwrap())))
    }
    fn set_layer_wrapper(&self, wrapper: Option<LayerWrapper>) -> bool {
        self.wraps && self.inner.set_layer_wrapper(wrapper)
    }
}

/// Parameters ZeRO-3 cannot attribute to exactly one layer each are refused, naming
/// the cause, before anything is sharded (the weights still read as they were).
#[test]
#[serial]
fn a_workload_whose_parameters_are_not_attributable_to_layers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let group = group_of_one(dir.path());
    let same: Edit = |l| l;
    let cases: [(&str, Option<Edit>, bool, &str); 6] = [
        (
            "no layer parameters",
            None,
            true,
            "Workload::layer_parameters",
        ),
        (
            "a parameter in no layer",
            Some(|mut l| {
                l[2].pop();
                l
            }),
            true,
            "is in no layer's list",
        ),
        (
            "a parameter in two layers",
            Some(|mut l| {
                let twice = l[0][0].shallow_clone();
                l[1].push(twice);
                l
            }),
            true,
            "is in layer 0 and again in layer 1",
        ),
        (
            "a tensor that is not a parameter",
            Some(|mut l| {
                l[0].push(Tensor::zeros([2], (Kind::Float, Device::Cpu)));
                l
            }),
            true,
            "not one of its trainable parameters",
        ),
        (
            "fewer lists than layers",
            Some(|mut l| {
                l.pop();
                l
            }),
            true,
            "gives the parameters of 2 layers, but it has 3",
        ),
        (
            "layers it cannot wrap",
            Some(same),
            false,
            "set_layer_wrapper",
        ),
    ];
    for (what, layers, wraps, names) in cases {
        let mut model = Attributed {
            inner: model(),
            layers,
            wraps,
            fails: false,
        };
        let before = weights(&model);
        let err = TrainerBuilder::new(StepConfig::baseline())
            .data_parallel(&group, zero3())
            .build(&mut model)
            .expect_err(what);
        assert!(
            matches!(err, StepError::InvalidConfig(_)),
            "{what}: {err:?}"
        );
        assert!(err.to_string().contains(names), "{what}: {err}");
        assert_eq!(before, weights(&model), "{what}: sharded anyway");
    }
    // A search that fails is ZeRO-3's error as it is (not "does not say which
    // parameters each layer uses").
    let mut failing = Attributed {
        inner: model(),
        layers: Some(same),
        wraps: true,
        fails: true,
    };
    let before = weights(&failing);
    let err = TrainerBuilder::new(StepConfig::baseline())
        .data_parallel(&group, zero3())
        .build(&mut failing)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 1 ran out of memory"), "{err}");
    assert!(!err.contains("does not say"), "{err}");
    assert_eq!(before, weights(&failing), "sharded anyway");
    // The same workload attributing its parameters runs.
    let mut model = Attributed {
        inner: model(),
        layers: Some(same),
        wraps: true,
        fails: false,
    };
    let x = model.batch(BATCH).unwrap();
    let mut trainer = TrainerBuilder::new(StepConfig::baseline())
        .data_parallel(&group, zero3())
        .build(&mut model)
        .unwrap();
    trainer.step(&x).unwrap();
    // Without an optimizer the gradients are left in the shards.
    let dp = trainer.data_parallel().unwrap();
    let shards = dp.fsdp().unwrap().parameters();
    assert_eq!(
        shards.len(),
        4 * LAYERS,
        "one per parameter (one rank holds them all)"
    );
    assert!(shards.iter().all(|s| s.grad().defined()));
    drop(trainer);
    // A handle for ZeRO-3 is set up over a workload, not a parameter list.
    let other = self::model();
    let err = DataParallelHandle::new(&group, zero3(), &other.parameters()).expect_err("refused");
    assert!(err.to_string().contains("for_workload"), "{err}");
}

/// How [`TwoBlocks`] uses its shared weight `w`.
#[derive(Clone, Copy, PartialEq, Debug)]
enum SharedWeight {
    /// In the first block only.
    InOne,
    /// In both blocks.
    InBoth,
    /// Between the blocks, outside both.
    Outside,
    /// In the first block only, and the second block named `renamed` (as a forward
    /// whose blocks depend on its data might name it on one rank).
    Renamed,
    /// In the first block only, and the second block not run (its weights used by no
    /// block).
    Skipped,
}

/// Two named blocks, `first` and `second`, in one layer of the chain, and a weight `w`
/// used as `use_w` says.
struct TwoBlocks {
    vs: nn::VarStore,
    blocks: memsave_checkpoint::Blocks,
    layers: CheckpointedSequential,
    data: Tensor,
}

impl TwoBlocks {
    fn new(use_w: SharedWeight) -> TwoBlocks {
        use memsave_checkpoint::Shared;
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let p = vs.root();
        let a = Shared::new(nn::linear(&p / "a", 4, 4, Default::default()));
        let b = Shared::new(nn::linear(&p / "b", 4, 4, Default::default()));
        let w = p.var("w", &[4], nn::Init::Const(0.5));
        let blocks = memsave_checkpoint::Blocks::new();
        let bl = blocks.clone();
        let w = Shared::new(w);
        let layers = CheckpointedSequential::new().add_fn(move |x| {
            let (a, b, w1, w2) = (a.clone(), b.clone(), w.clone(), w.clone());
            bl.forward(|bl| {
                let h = bl.run("first", &[x], move |xs| {
                    let h = a.forward(&xs[0]).tanh();
                    vec![if use_w == SharedWeight::Outside {
                        h
                    } else {
                        w1.with(|w| &h * w)
                    }]
                })?[0]
                    .shallow_clone();
                let h = if use_w == SharedWeight::Outside {
                    w2.with(|w| &h * w)
                } else {
                    h
                };
                if use_w == SharedWeight::Skipped {
                    return Ok(h);
                }
                let w3 = w2.clone();
                let second = if use_w == SharedWeight::Renamed {
                    "renamed"
                } else {
                    "second"
                };
                bl.run(second, &[&h], move |xs| {
                    let y = b.forward(&xs[0]);
                    vec![if use_w == SharedWeight::InBoth {
                        w3.with(|w| &y + w)
                    } else {
                        y
                    }]
                })
                .map(|mut v| v.remove(0))
            })
            .and_then(|r| r)
            .unwrap_or_else(|e| panic!("{e}"))
        });
        TwoBlocks {
            data: Tensor::randn([4, 4], (Kind::Float, Device::Cpu)),
            vs,
            blocks,
            layers,
        }
    }
}

impl Workload for TwoBlocks {
    fn name(&self) -> &str {
        "two-blocks"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        &self.layers
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.layers
    }
    fn blocks(&self) -> Option<&memsave_checkpoint::Blocks> {
        Some(&self.blocks)
    }
    fn parameters(&self) -> Vec<Tensor> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by(|x, y| x.0.cmp(&y.0));
        named.into_iter().map(|(_, t)| t).collect()
    }
    fn global_batch(&self) -> i64 {
        4
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    }
}

/// ZeRO-3 shards a model of blocks one unit per top-level block: on one rank it trains
/// as the plain step does (every block kept, or recomputed); a weight two blocks use,
/// or one used outside every block, is refused naming the blocks or the parameter,
/// before anything is sharded.
#[test]
#[serial]
fn a_model_of_blocks_is_sharded_one_unit_per_block() {
    let dir = tempfile::tempdir().unwrap();
    let group = group_of_one(dir.path());
    let sgd = OptimizerSpec {
        kind: OptimizerKind::Sgd,
        lr: Some(0.1),
        ..OptimizerSpec::default()
    };
    for plan in [Plan::None, Plan::EveryLayer] {
        let mut config = StepConfig::baseline();
        config.optimizer = Some(sgd);
        config.plan = PlanChoice::Fixed(plan);
        let mut plain = TwoBlocks::new(SharedWeight::InOne);
        let batch = plain.batch(4).unwrap();
        let mut trainer = TrainerBuilder::new(config.clone())
            .build(&mut plain)
            .unwrap();
        for _ in 0..2 {
            trainer.step(&batch).unwrap();
        }
        drop(trainer);
        let mut sharded = TwoBlocks::new(SharedWeight::InOne);
        let mut trainer = TrainerBuilder::new(config)
            .data_parallel(&group, zero3())
            .build(&mut sharded)
            .unwrap();
        for _ in 0..2 {
            trainer.step(&batch).unwrap();
        }
        let fsdp = trainer.data_parallel().unwrap().fsdp().unwrap();
        assert_eq!(fsdp.len(), 2, "{plan:?}: one unit per block");
        trainer.restore_full_parameters().unwrap();
        drop(trainer);
        assert_eq!(weights(&sharded), weights(&plain), "{plan:?}");
        assert_ne!(
            weights(&plain),
            weights(&TwoBlocks::new(SharedWeight::InOne))
        );
    }
    // A block whose saves go to files (a per-block offload lever) is refused under
    // ZeRO-3 when the trainer is built, naming the block, before anything is sharded:
    // the store would take the gathered weights autograd saves.
    let mut config = StepConfig::baseline();
    config.optimizer = Some(sgd);
    let mut sharded = TwoBlocks::new(SharedWeight::InOne);
    let offload = memsave_step::plan::disk_block_lever();
    let e = TrainerBuilder::new(config.clone())
        .block_levers(vec![
            (
                memsave_checkpoint::BlockKey::new("first", 0),
                offload.clone(),
            ),
            (
                memsave_checkpoint::BlockKey::new("second", 0),
                offload.clone(),
            ),
        ])
        .data_parallel(&group, zero3())
        .build(&mut sharded)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("block first#0") && e.contains("cannot go to a store"),
        "{e}"
    );
    assert_eq!(
        weights(&sharded),
        weights(&TwoBlocks::new(SharedWeight::InOne))
    );
    // A store set on the blocks after the trainer is built is refused at the block's
    // run, naming it; the weights are as they were.
    let batch = sharded.batch(4).unwrap();
    let mut trainer = TrainerBuilder::new(config)
        .data_parallel(&group, zero3())
        .build(&mut sharded)
        .unwrap();
    trainer
        .model()
        .blocks
        .set_levers(vec![(
            memsave_checkpoint::BlockKey::new("first", 0),
            offload,
        )])
        .unwrap();
    let e = trainer.step(&batch).unwrap_err().to_string();
    assert!(
        e.contains("block first#0") && e.contains("cannot go to a store"),
        "{e}"
    );
    trainer.restore_full_parameters().unwrap();
    drop(trainer);
    assert_eq!(
        weights(&sharded),
        weights(&TwoBlocks::new(SharedWeight::InOne))
    );
    for (use_w, needle) in [
        (
            SharedWeight::InBoth,
            "is used by block \"first\" and by block \"second\"",
        ),
        (SharedWeight::Outside, "is used by no block"),
    ] {
        let model = TwoBlocks::new(use_w);
        let before = weights(&model);
        let e = DataParallelHandle::for_workload(&group, zero3(), &model).unwrap_err();
        assert!(e.to_string().contains(needle), "{use_w:?}: {e}");
        assert_eq!(weights(&model), before, "{use_w:?}: nothing was sharded");
    }
}

#[test]
#[ignore = "a rank of fsdp::ranks_that_find_other_units_are_refused_on_every_rank: started by the launcher"]
fn other_units_worker() {
    let out = out_dir();
    let group = join_group();
    for case in [SharedWeight::Renamed, SharedWeight::Skipped] {
        // Rank 0's forward runs the blocks `first` and `second`; rank 1's does not.
        let use_w = if group.rank() == 0 {
            SharedWeight::InOne
        } else {
            case
        };
        let model = TwoBlocks::new(use_w);
        let before = weights(&model);
        let text = match DataParallelHandle::for_workload(&group, zero3(), &model) {
            Ok(_) => "sharded".to_owned(),
            Err(e) => e.to_string(),
        };
        let kept = weights(&model) == before;
        std::fs::write(
            out.join(format!("{case:?}-rank{}", group.rank())),
            format!("{kept}\n{text}"),
        )
        .unwrap();
    }
}

/// ZeRO-3 over a model of blocks finds each rank's units on its own example: ranks
/// whose forwards ran other blocks (another name, or a block left out) are refused on
/// every rank before anything is sharded, naming the ranks, instead of waiting in
/// collectives the other ranks never join.
#[test]
#[serial]
fn ranks_that_find_other_units_are_refused_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    run_ranks("fsdp::other_units_worker", dir.path());
    let read = |case: SharedWeight, rank: usize| {
        std::fs::read_to_string(dir.path().join(format!("{case:?}-rank{rank}"))).unwrap()
    };
    // Both ranks found two units, but not the same ones.
    for rank in 0..2 {
        let text = read(SharedWeight::Renamed, rank);
        assert!(
            text.starts_with("true\n"),
            "rank {rank}: weights changed: {text}"
        );
        assert!(
            text.contains("found 2 units to shard")
                && text.contains("found 2 (or other names")
                && text.contains("the same units"),
            "rank {rank}: {text}"
        );
    }
    // Rank 1's own error names its unused weight; rank 0 is told rank 1 failed.
    let rank0 = read(SharedWeight::Skipped, 0);
    let rank1 = read(SharedWeight::Skipped, 1);
    assert!(rank0.starts_with("true\n"), "{rank0}");
    assert!(rank1.starts_with("true\n"), "{rank1}");
    assert!(
        rank0.contains("rank 1 could not find its units to shard"),
        "{rank0}"
    );
    assert!(rank1.contains("is used by no block"), "{rank1}");
}
