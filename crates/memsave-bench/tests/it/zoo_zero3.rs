//! The zoo's chains under ZeRO-3: their variables are not named by layer, so each
//! layer's parameters are found by running it (`CheckpointedSequential::
//! f_layer_parameters`), one unit per layer. Two ranks, each on half the batch, train
//! them as one process does on the two halves as micro-batches (BatchNorm normalizes
//! each half on its own either way). Not MobileNetV2: its classifier's dropout draws
//! other masks on the second rank than on the second micro-batch.
use memsave_bench::models::Model;
use memsave_bench::Suite;
use memsave_checkpoint::Plan;
use memsave_dist::{init_process_group, launch, InitOptions, LaunchConfig, ProcessGroup};
use memsave_step::{
    DataParallel, FsdpConfig, OptimizerKind, OptimizerSpec, PlanChoice, StepConfig, TrainerBuilder,
    Workload,
};
use serial_test::serial;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::{Device, Tensor};

const SUITE: &str = "suite: z
models:
  - {name: resnet, kind: resnet, depth: 18, image: [3, 32, 32], classes: 4, batch: 4}
  - {name: vit, kind: vit, image: [3, 16, 16], patch: 4, dim: 32, layers: 2, heads: 2, mlp: 64, classes: 4, batch: 4}
  - {name: llama, kind: llama, vocab: 64, dim: 32, layers: 2, heads: 2, kv_heads: 1, seq: 8, batch: 4}
  - {name: unet, kind: unet, image: [3, 16, 16], classes: 2, base: 4, levels: 2, batch: 4}
  - {name: encdec, kind: encoder_decoder, vocab: 64, dim: 32, heads: 2, encoder_layers: 2, decoder_layers: 2, source: 8, target: 6, batch: 4}
strategies:
  - baseline
";
const WORLD: i64 = 2;
const STEPS: usize = 2;
/// Summed in another order on the ranks (a reduce-scatter, against accumulation).
const TOLERANCE: f64 = 1e-5;

fn model(name: &str) -> Model {
    let suite = Suite::from_yaml(SUITE, "z.yaml").unwrap();
    let spec = suite.models.iter().find(|m| m.name == name).unwrap();
    tch::manual_seed(0);
    Model::build(spec, Device::Cpu).unwrap()
}

/// The cases: a model, and whether every layer (or block) is recomputed.
const CASES: [(&str, bool); 7] = [
    ("resnet", false),
    ("vit", false),
    ("llama", false),
    ("unet", false),
    ("unet", true),
    ("encdec", false),
    ("encdec", true),
];

fn config(micro_batches: Option<usize>, recompute: bool) -> StepConfig {
    let mut config = StepConfig::baseline();
    if recompute {
        config.plan = PlanChoice::Fixed(Plan::EveryLayer);
    }
    config.optimizer = Some(OptimizerSpec {
        kind: OptimizerKind::Sgd,
        lr: Some(0.01),
        ..OptimizerSpec::default()
    });
    config.micro_batches = micro_batches;
    config
}

fn values(tensors: &[Tensor]) -> Vec<f32> {
    tensors
        .iter()
        .flat_map(|t| Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
        .collect()
}

fn out_dir() -> PathBuf {
    std::env::var_os("MEMSAVE_TEST_OUT")
        .expect("MEMSAVE_TEST_OUT is set by the launching test")
        .into()
}

fn tag(name: &str, recompute: bool) -> String {
    format!("{name}{}", if recompute { "-recompute" } else { "" })
}

fn run_on_rank(group: &ProcessGroup, name: &str, recompute: bool, out: &Path) {
    let rank = group.rank() as i64;
    let mut model = model(name);
    let share = model.global_batch() / WORLD;
    let local = model
        .batch(model.global_batch())
        .unwrap()
        .f_narrow(rank * share, share)
        .unwrap();
    let mode = DataParallel::Fsdp(FsdpConfig::default());
    let mut trainer = TrainerBuilder::new(config(None, recompute))
        .data_parallel(group, mode)
        .build(&mut model)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    for _ in 0..STEPS {
        trainer
            .step(&local)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    group.barrier().unwrap();
    let dp = trainer.data_parallel().expect("data parallel");
    let units = dp.fsdp().expect("ZeRO-3").len();
    // The units' order: each layer's parameters, layer after layer.
    let full = dp.fsdp().unwrap().f_full_parameters().unwrap();
    let bytes: Vec<u8> = values(&full).iter().flat_map(|v| v.to_le_bytes()).collect();
    let tag = tag(name, recompute);
    std::fs::write(out.join(format!("{tag}-rank{rank}")), bytes).unwrap();
    std::fs::write(out.join(format!("{tag}-units")), units.to_string()).unwrap();
    trainer.restore_full_parameters().unwrap();
}

#[test]
#[ignore = "a rank of zoo_zero3::zoo_chains_train_under_zero3_as_one_process: started by the launcher"]
fn zoo_zero3_worker() {
    memsave_meter::install();
    tch::set_num_threads(1);
    let options = InitOptions {
        timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    let out = out_dir();
    for (name, recompute) in CASES {
        run_on_rank(&group, name, recompute, &out);
    }
}

#[test]
#[serial]
fn zoo_chains_train_under_zero3_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let args: Vec<OsString> = [
        "zoo_zero3::zoo_zero3_worker",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let launch_config = LaunchConfig {
        nproc_per_node: WORLD as usize,
        timeout: Some(Duration::from_secs(300)),
        env: vec![("MEMSAVE_TEST_OUT".into(), dir.path().as_os_str().to_owned())],
        ..Default::default()
    };
    launch(&launch_config, exe.as_os_str(), &args).expect("every rank succeeds");
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let mut report = Vec::new();
    for (name, recompute) in CASES {
        let tag = tag(name, recompute);
        let mut one = model(name);
        // The units' order: a chain's layers, or a network's top-level blocks, as
        // found; their parameters in the model's order.
        let layers: Vec<Vec<Tensor>> = match one.blocks() {
            Some(blocks) => {
                let example = one.batch(1).unwrap();
                blocks
                    .f_block_parameters(&one.parameters(), || {
                        one.layers().f_forward_t(&example.input, false)
                    })
                    .unwrap()
                    .into_iter()
                    .map(|(_, list)| list)
                    .collect()
            }
            None => one
                .layer_parameters()
                .unwrap()
                .expect("a zoo chain's layers"),
        };
        let with_params = layers.iter().filter(|l| !l.is_empty()).count();
        let units: usize = std::fs::read_to_string(dir.path().join(format!("{tag}-units")))
            .unwrap()
            .parse()
            .unwrap();
        // One unit per layer (or block) that has parameters, and more than one.
        assert_eq!(units, with_params, "{tag}");
        assert!(units > 1, "{tag}: {units} unit");
        let ordered: Vec<Tensor> = layers.iter().flatten().map(Tensor::shallow_clone).collect();
        let before = values(&ordered);
        let batch = one.batch(one.global_batch()).unwrap();
        let mut trainer = TrainerBuilder::new(config(Some(WORLD as usize), recompute))
            .build(&mut one)
            .unwrap();
        for _ in 0..STEPS {
            trainer.step(&batch).unwrap();
        }
        let expected = values(&ordered);
        assert!(
            expected.iter().zip(&before).any(|(a, b)| a != b),
            "{tag}: the steps changed nothing"
        );
        let read = |rank: i64| -> Vec<f32> {
            std::fs::read(dir.path().join(format!("{tag}-rank{rank}")))
                .unwrap()
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let (rank0, rank1) = (read(0), read(1));
        assert_eq!(rank0.len(), expected.len(), "{tag}");
        let max_diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| f64::from((x - y).abs()))
                .fold(0.0, f64::max)
        };
        assert!(
            rank0 == rank1,
            "{tag}: the ranks' weights differ by up to {:.2e}",
            max_diff(&rank0, &rank1)
        );
        let largest = expected
            .iter()
            .map(|v| f64::from(v.abs()))
            .fold(0.0, f64::max);
        assert!(largest < 100.0, "{tag}: the steps diverged ({largest:.2e})");
        let diff = max_diff(&rank0, &expected);
        report.push(format!(
            "{tag}: {units} units, max |ranks - one process| {diff:.2e}"
        ));
        assert!(diff <= TOLERANCE, "{}", report.join("\n"));
    }
    tch::set_num_threads(threads);
    eprintln!("{}", report.join("\n"));
}
