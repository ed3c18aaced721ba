//! ResNet and MobileNetV2: tch's checkpoints load and give tch's outputs, parameter
//! counts are torchvision's, bad configurations are refused with their key, a few SGD
//! steps lower the loss, BatchNorm's running statistics move in training only, a step
//! with every block checkpointed equals the baseline, and the baseline step's peak is
//! torchvision's.
//!
//! The expected numbers (parameter counts, running-statistics sizes, peak bytes) were
//! computed in Python with torch 2.13.0 and torchvision 0.28.0 (`torchvision.models.
//! resnet18(num_classes=...)`, ...; peaks with a counting CPU allocator over forward,
//! cross-entropy and backward, gradients None at the start, one or two threads as each
//! case says).
//!
//! Tests run one at a time (a process-wide lock): the meter counts every allocation of
//! the process, and the memory test must see only its own.
use memsave_checkpoint::Plan;
use memsave_models::{
    Architecture, MobileNetV2Config, ModelError, Network, ResNetConfig, ZooWorkload,
};
use memsave_step::{f_step, StepConfig, Workload};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn resnet(depth: i64, classes: i64, image: [i64; 3]) -> Architecture {
    Architecture::ResNet(ResNetConfig {
        depth,
        classes,
        image,
    })
}

fn mobilenet(classes: i64, image: [i64; 3]) -> Architecture {
    Architecture::MobileNetV2(MobileNetV2Config { classes, image })
}

/// Runs the blocks in order.
fn run(net: &Network, x: &Tensor, train: bool) -> Tensor {
    net.layers
        .iter()
        .fold(x.shallow_clone(), |x, layer| layer.forward_t(&x, train))
}

/// Name -> shape of every variable of a store.
fn shapes(vs: &nn::VarStore) -> BTreeMap<String, Vec<i64>> {
    vs.variables()
        .into_iter()
        .map(|(name, t)| (name, t.size()))
        .collect()
}

fn trainable_count(vs: &nn::VarStore) -> i64 {
    vs.trainable_variables()
        .iter()
        .map(Tensor::numel)
        .sum::<usize>() as i64
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str) -> TempFile {
        TempFile(std::env::temp_dir().join(format!(
            "memsave-models-vision-{}-{tag}.ot",
            std::process::id()
        )))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Builds tch's model with `make`, moves its running statistics off their initial
/// values, saves its store, loads it into ours built from `arch`, and checks the
/// variables (names and shapes) are the same and the eval-mode logits agree within
/// `tolerance` (and the train-mode ones too when `compare_train`).
fn check_against_tch(
    tag: &str,
    arch: &Architecture,
    make: impl FnOnce(&nn::Path) -> Box<dyn ModuleT>,
    tolerance: f64,
    compare_train: bool,
) {
    tch::manual_seed(7);
    let tch_vs = nn::VarStore::new(Device::Cpu);
    let theirs = make(&tch_vs.root());
    let x = Tensor::randn([2, 3, 64, 64], (Kind::Float, Device::Cpu));
    let _ = tch::no_grad(|| theirs.forward_t(&(&x * 2.0 + 0.5), true));
    let file = TempFile::new(tag);
    tch_vs.save(&file.0).unwrap();

    tch::manual_seed(8);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let ours = arch.build(&vs.root()).unwrap();
    assert_eq!(shapes(&vs), shapes(&tch_vs), "{tag}: variables differ");
    vs.load(&file.0).unwrap();

    let (a, b) = tch::no_grad(|| (theirs.forward_t(&x, false), run(&ours, &x, false)));
    assert_eq!(b.size(), [2, 10]);
    let diff = max_abs_diff(&a, &b);
    assert!(diff <= tolerance, "{tag}: eval logits differ by {diff}");
    if compare_train {
        let (a, b) = tch::no_grad(|| (theirs.forward_t(&x, true), run(&ours, &x, true)));
        let diff = max_abs_diff(&a, &b);
        assert!(diff <= tolerance, "{tag}: train logits differ by {diff}");
    }
}

#[test]
#[serial_test::serial]
fn resnet18_loads_tchs_checkpoint_and_gives_its_logits() {
    let _g = serial();
    check_against_tch(
        "resnet18",
        &resnet(18, 10, [3, 64, 64]),
        |p| Box::new(tch::vision::resnet::resnet18(p, 10)),
        0.0,
        true,
    );
}

#[test]
#[serial_test::serial]
fn resnet50_loads_tchs_checkpoint_and_gives_its_logits() {
    let _g = serial();
    check_against_tch(
        "resnet50",
        &resnet(50, 10, [3, 64, 64]),
        |p| Box::new(tch::vision::resnet::resnet50(p, 10)),
        0.0,
        true,
    );
}

#[test]
#[serial_test::serial]
fn mobilenet_v2_loads_tchs_checkpoint_and_gives_its_logits() {
    let _g = serial();
    // tch pools with two means and applies ReLU6 out of place: equal up to rounding.
    check_against_tch(
        "mobilenet_v2",
        &mobilenet(10, [3, 64, 64]),
        |p| Box::new(tch::vision::mobilenet::v2(p, 10)),
        1e-6,
        false,
    );
}

/// Parameter counts at 1000 classes, from torchvision 0.28.0, and tch's variables.
#[test]
#[serial_test::serial]
fn parameter_counts_and_names_are_torchvisions_and_tchs() {
    let _g = serial();
    type Make = fn(&nn::Path) -> Box<dyn ModuleT>;
    let cases: [(Architecture, i64, Make); 6] = [
        (resnet(18, 1000, [3, 224, 224]), 11_689_512, |p| {
            Box::new(tch::vision::resnet::resnet18(p, 1000))
        }),
        (resnet(34, 1000, [3, 224, 224]), 21_797_672, |p| {
            Box::new(tch::vision::resnet::resnet34(p, 1000))
        }),
        (resnet(50, 1000, [3, 224, 224]), 25_557_032, |p| {
            Box::new(tch::vision::resnet::resnet50(p, 1000))
        }),
        (resnet(101, 1000, [3, 224, 224]), 44_549_160, |p| {
            Box::new(tch::vision::resnet::resnet101(p, 1000))
        }),
        (resnet(152, 1000, [3, 224, 224]), 60_192_808, |p| {
            Box::new(tch::vision::resnet::resnet152(p, 1000))
        }),
        (mobilenet(1000, [3, 224, 224]), 3_504_872, |p| {
            Box::new(tch::vision::mobilenet::v2(p, 1000))
        }),
    ];
    for (arch, expected, make) in cases {
        let vs = nn::VarStore::new(Device::Cpu);
        arch.build(&vs.root()).unwrap();
        assert_eq!(trainable_count(&vs), expected, "{arch:?}");
        let ours = shapes(&vs);
        drop(vs);
        let tch_vs = nn::VarStore::new(Device::Cpu);
        let _theirs = make(&tch_vs.root());
        assert_eq!(
            ours,
            shapes(&tch_vs),
            "{arch:?}: variables differ from tch's"
        );
    }
    // Fewer classes change only the final layer (torchvision's counts at 10 classes).
    for (arch, expected) in [
        (resnet(18, 10, [3, 32, 32]), 11_181_642),
        (resnet(50, 10, [3, 32, 32]), 23_528_522),
        (mobilenet(10, [3, 32, 32]), 2_236_682),
    ] {
        let vs = nn::VarStore::new(Device::Cpu);
        arch.build(&vs.root()).unwrap();
        assert_eq!(trainable_count(&vs), expected, "{arch:?}");
    }
}

/// One layer per block: stem, residual blocks, head (and MobileNetV2's first and last
/// convolutions).
#[test]
#[serial_test::serial]
fn one_layer_per_block() {
    let _g = serial();
    for (arch, expected) in [
        (resnet(18, 3, [3, 32, 32]), 1 + 8 + 1),
        (resnet(34, 3, [3, 32, 32]), 1 + 16 + 1),
        (resnet(50, 3, [3, 32, 32]), 1 + 16 + 1),
        (mobilenet(3, [3, 32, 32]), 1 + 17 + 1 + 1),
    ] {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = arch.build(&vs.root()).unwrap();
        assert_eq!(net.layers.len(), expected, "{arch:?}");
        assert_eq!(net.example_shape, vec![3, 32, 32]);
    }
}

fn config_error(arch: &Architecture) -> (&'static str, String) {
    match arch.validate() {
        Err(ModelError::Config { key, message }) => (key, message),
        other => panic!("{arch:?}: expected a configuration error, got {other:?}"),
    }
}

#[test]
#[serial_test::serial]
fn bad_configurations_are_refused_with_their_key() {
    let _g = serial();
    let cases = [
        (
            resnet(20, 10, [3, 64, 64]),
            "depth",
            "18, 34, 50, 101 or 152, got 20",
        ),
        (resnet(0, 10, [3, 64, 64]), "depth", "got 0"),
        (resnet(18, 0, [3, 64, 64]), "classes", "at least 1, got 0"),
        (resnet(50, -3, [3, 64, 64]), "classes", "got -3"),
        (
            resnet(18, 10, [0, 64, 64]),
            "image",
            "at least 1 channel, got 0",
        ),
        (
            resnet(18, 10, [3, 31, 64]),
            "image",
            "at least 32 (ResNet's total stride), got 31x64",
        ),
        (
            resnet(152, 10, [3, 64, 16]),
            "image",
            "at least 32 (ResNet's total stride), got 64x16",
        ),
        (mobilenet(0, [3, 64, 64]), "classes", "at least 1, got 0"),
        (
            mobilenet(10, [-1, 64, 64]),
            "image",
            "at least 1 channel, got -1",
        ),
        (
            mobilenet(10, [3, 8, 8]),
            "image",
            "at least 32 (MobileNetV2's total stride), got 8x8",
        ),
    ];
    for (arch, key, fragment) in cases {
        let (got_key, message) = config_error(&arch);
        assert_eq!(got_key, key, "{arch:?}: {message}");
        assert!(message.contains(fragment), "{arch:?}: {message:?}");
        assert!(!message.contains('\n'), "{message:?}");
        // Building and the workload refuse it the same way, before allocating anything.
        let vs = nn::VarStore::new(Device::Cpu);
        let err = arch.build(&vs.root()).unwrap_err();
        assert_eq!(err.to_string(), format!("{key}: {message}"));
        assert!(vs.variables().is_empty());
        let err = ZooWorkload::new("bad", &arch, 2, Device::Cpu).unwrap_err();
        assert!(matches!(err, ModelError::Config { key: k, .. } if k == key));
    }
    // The smallest accepted image, and any channel count.
    for arch in [
        resnet(18, 1, [1, 32, 32]),
        resnet(101, 1, [5, 32, 33]),
        mobilenet(1, [1, 32, 32]),
    ] {
        arch.validate().unwrap();
    }
}

/// Loss of the workload's batch in training mode.
fn train_loss(w: &ZooWorkload, batch: &memsave_step::Batch) -> Tensor {
    let logits = w.layers().f_forward_t(&batch.input, true).unwrap();
    w.loss(&logits, batch.target.as_ref()).unwrap()
}

/// SGD with momentum (as a training loop would run it) on one fixed batch: eight
/// steps bring the loss well below its start. The learning rates are ones at which
/// torchvision's models, from their own initialization, do the same.
#[test]
#[serial_test::serial]
fn sgd_steps_through_the_workload_lower_the_loss() {
    let _g = serial();
    for (arch, lr) in [
        (resnet(18, 4, [1, 32, 40]), 0.01),
        (resnet(50, 4, [3, 32, 32]), 0.002),
        (mobilenet(4, [3, 32, 32]), 0.01),
    ] {
        tch::manual_seed(3);
        let w = ZooWorkload::new("zoo", &arch, 8, Device::Cpu).unwrap();
        let batch = w.batch(8).unwrap();
        let mut opt = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(w.var_store(), lr)
        .unwrap();
        let mut losses = Vec::new();
        for _ in 0..8 {
            let loss = train_loss(&w, &batch);
            assert_eq!(loss.size(), Vec::<i64>::new());
            losses.push(loss.double_value(&[]));
            opt.backward_step(&loss);
        }
        let logits = tch::no_grad(|| w.layers().f_forward_t(&batch.input, true).unwrap());
        assert_eq!(logits.size(), [8, 4]);
        let (first, last) = (losses[0], *losses.last().unwrap());
        assert!(
            first.is_finite() && last.is_finite(),
            "{arch:?}: {losses:?}"
        );
        println!("{arch:?}: losses {losses:?}");
        assert!(last < 0.8 * first, "{arch:?}: losses {losses:?}");
    }
}

/// The running means and variances, by name.
fn running_stats(vs: &nn::VarStore) -> BTreeMap<String, Tensor> {
    vs.variables()
        .into_iter()
        .filter(|(name, _)| name.ends_with(".running_mean") || name.ends_with(".running_var"))
        .map(|(name, t)| (name, t.copy()))
        .collect()
}

#[test]
#[serial_test::serial]
fn running_statistics_move_in_a_train_step_only() {
    let _g = serial();
    // (architecture, BatchNorm layers, running-statistics elements as torchvision's
    // buffers less num_batches_tracked)
    for (arch, norms, elements) in [
        (resnet(18, 10, [3, 32, 32]), 20, 9_600),
        (resnet(50, 10, [3, 32, 32]), 53, 53_120),
        (mobilenet(10, [3, 32, 32]), 52, 34_112),
    ] {
        tch::manual_seed(5);
        let w = ZooWorkload::new("zoo", &arch, 4, Device::Cpu).unwrap();
        let batch = w.batch(4).unwrap();
        let before = running_stats(w.var_store());
        assert_eq!(before.len(), 2 * norms, "{arch:?}");
        let numel: usize = before.values().map(Tensor::numel).sum();
        assert_eq!(numel as i64, elements, "{arch:?}");
        assert_eq!(w.buffers().len(), 2 * norms, "{arch:?}");

        let _ = tch::no_grad(|| w.layers().f_forward_t(&batch.input, false).unwrap());
        for (name, now) in running_stats(w.var_store()) {
            assert!(now.equal(&before[&name]), "{arch:?}: {name} moved in eval");
        }

        train_loss(&w, &batch).backward();
        for (name, now) in running_stats(w.var_store()) {
            assert!(!now.equal(&before[&name]), "{arch:?}: {name} did not move");
        }
    }
}

/// A step with every block checkpointed gives the baseline's loss, gradients and
/// running statistics: the recomputation replays MobileNetV2's dropout mask and
/// BatchNorm updates its running statistics once.
#[test]
#[serial_test::serial]
fn checkpointing_every_block_changes_nothing_but_memory() {
    let _g = serial();
    for arch in [resnet(18, 6, [3, 32, 32]), mobilenet(6, [3, 32, 32])] {
        let step = |plan: Plan| {
            tch::manual_seed(11);
            let mut w = ZooWorkload::new("zoo", &arch, 4, Device::Cpu).unwrap();
            w.layers_mut().set_plan(plan).unwrap();
            let batch = w.batch(4).unwrap();
            tch::manual_seed(12);
            let loss = train_loss(&w, &batch);
            loss.backward();
            let grads: Vec<Tensor> = w.parameters().iter().map(Tensor::grad).collect();
            (loss, grads, running_stats(w.var_store()))
        };
        let (loss, grads, stats) = step(Plan::None);
        let (loss_ckpt, grads_ckpt, stats_ckpt) = step(Plan::EveryLayer);
        assert!(loss.equal(&loss_ckpt), "{arch:?}");
        assert_eq!(grads.len(), grads_ckpt.len());
        for (g, g_ckpt) in grads.iter().zip(&grads_ckpt) {
            assert!(
                g.defined() && g.equal(g_ckpt),
                "{arch:?}: a gradient differs"
            );
        }
        for (name, t) in &stats {
            assert!(t.equal(&stats_ckpt[name]), "{arch:?}: {name} differs");
        }
    }
}

/// The baseline step's peak (forward, loss, backward; gradients None at the start),
/// against torchvision's with the same number of threads (two threads change
/// MobileNetV2's by a few kilobytes).
#[test]
#[serial_test::serial]
fn baseline_peak_is_torchvisions() {
    let _g = serial();
    memsave_meter::install();
    let threads = tch::get_num_threads();
    let cases = [
        (1, "resnet18", resnet(18, 10, [3, 64, 64]), 8, 56_289_136u64),
        (1, "resnet50", resnet(50, 10, [3, 64, 64]), 4, 112_557_776),
        (1, "mobilenet_v2", mobilenet(10, [3, 64, 64]), 8, 55_067_760),
        (1, "resnet18", resnet(18, 5, [3, 32, 48]), 2, 45_514_308),
        (1, "mobilenet_v2", mobilenet(5, [3, 32, 48]), 2, 12_316_740),
        (2, "resnet18", resnet(18, 10, [3, 64, 64]), 8, 56_289_136),
        (2, "mobilenet_v2", mobilenet(10, [3, 64, 64]), 8, 55_069_808),
        (2, "mobilenet_v2", mobilenet(5, [3, 32, 48]), 2, 12_325_188),
    ];
    let mut report = Vec::new();
    for (threads, name, arch, batch, torchvision) in cases {
        tch::set_num_threads(threads);
        tch::manual_seed(0);
        let w = ZooWorkload::new(name, &arch, batch, Device::Cpu).unwrap();
        let x = w.batch(batch).unwrap();
        let peaks: Vec<u64> = (0..2)
            .map(|_| {
                f_step(&w, &x, &StepConfig::baseline(), Device::Cpu, false, None)
                    .unwrap()
                    .peak_bytes
            })
            .collect();
        report.push(format!(
            "{name} batch {batch} {:?} {threads} thread(s): ours {peaks:?}, torchvision {torchvision}",
            x.input.size()
        ));
        for peak in peaks {
            let off = (peak as f64 - torchvision as f64).abs() / torchvision as f64;
            assert!(off <= 1e-3, "{}", report.join("\n"));
        }
    }
    tch::set_num_threads(threads);
    println!("{}", report.join("\n"));
}
