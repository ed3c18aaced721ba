//! Issue #25: BatchNorm's running statistics after one training step with each
//! configuration `fit` returns, on the zoo's ResNet-18 and MobileNetV2, at several
//! budgets (lossless levers only, and every lossy lever allowed); and with every other
//! configuration each fit considered (its report's candidates: any of them is what it
//! returns at another budget, or on a machine that times them otherwise), which covers
//! int8 compression, bf16 autocast and splits into 2, 3, 4 and 8 micro-batches, alone
//! and with checkpoint schedules, offload and gradients in files.
//!
//! Each step runs on a fresh copy of the model (same parameters, buffers, batch and
//! random stream as the others), through a `Trainer` built from the choice's step
//! configuration and checkpoint schedule, as a user would train with it. What its
//! running statistics must be:
//!
//! - with no lever that changes what the forward computes (checkpoint, offload of
//!   activations or gradients, int8 compression of saved activations): bitwise a plain
//!   step's, itself bitwise one plain forward in training mode. Recomputation, offload
//!   and compression only change what backward reads; a statistic updated twice (by a
//!   recomputed forward) or from other values differs. When the choice is lossless its
//!   gradients are bitwise a plain step's too.
//! - with a split into `k` micro-batches (lossy with BatchNorm, so only under
//!   `Allow::micro_batches`): every BatchNorm updates its statistics once per
//!   micro-batch, with that micro-batch's statistics. Expected: bitwise the split with
//!   no other lever, itself bitwise the plain layers run forward in training mode on
//!   each micro-batch in turn (`memsave_accum`'s `Split::Count`: as even as possible,
//!   larger ones first).
//! - with bf16 autocast: the statistics come from bf16 activations: bitwise the step of
//!   the same autocast (and split) with no other lever.
//!
//! Sizes: 5 classes, a global batch of 8, ResNet-18 on 64x64 images and MobileNetV2
//! on 48x48 (at 32x32 their last stages are 1x1, so a one-example micro-batch gives
//! BatchNorm one value a channel: a NaN running variance on both sides). One budget a model, half the
//! plain step's peak with every lever allowed (a fit takes seconds to tens of seconds
//! in a debug build); the candidates it considers, lossless and lossy, cover the rest. Run with `--nocapture` for the choices, their
//! figures and the configurations checked.
use memsave_fit::{fit, Allow, Choice, FitError, FitRequest};
use memsave_models::{Architecture, MobileNetV2Config, ResNetConfig, ZooWorkload};
use memsave_step::{f_step, Batch, StepConfig, TrainerBuilder, Workload};
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// `fit` measures peaks with the process-wide counting allocator and the tests seed
/// libtorch's global random stream: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const BATCH: i64 = 8;
/// The seed of every model (parameters and batch).
const MODEL_SEED: i64 = 0;
/// The seed of the random stream every step starts from (MobileNetV2's dropout).
const STEP_SEED: i64 = 1;

fn build(arch: &Architecture) -> ZooWorkload {
    tch::manual_seed(MODEL_SEED);
    ZooWorkload::new("m", arch, BATCH, Device::Cpu).unwrap()
}

fn copies(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(Tensor::copy).collect()
}

/// One step of `config` (with the layers' schedule as `schedule` says) on a fresh copy
/// of the model: its buffers and gradients afterwards.
fn step(
    arch: &Architecture,
    config: StepConfig,
    schedule: Option<&memsave_checkpoint::Schedule>,
) -> (Vec<Tensor>, Vec<Tensor>) {
    let mut model = build(arch);
    let batch = model.batch(BATCH).unwrap();
    let mut trainer = TrainerBuilder::new(config)
        .schedule(schedule.cloned())
        .build(&mut model)
        .unwrap();
    tch::manual_seed(STEP_SEED);
    trainer.step(&batch).unwrap();
    let model = trainer.model();
    let grads = model
        .parameters()
        .iter()
        .map(|p| {
            let g = p.grad();
            assert!(g.defined(), "a parameter without a gradient");
            g.copy()
        })
        .collect();
    (copies(&model.buffers()), grads)
}

/// The buffers after the plain layers ran forward in training mode on each of `k`
/// micro-batches in turn (as evenly as possible, larger ones first), no levers.
fn micro_batch_forwards(arch: &Architecture, k: i64) -> Vec<Tensor> {
    let model = build(arch);
    let batch: Batch = model.batch(BATCH).unwrap();
    let (base, larger) = (BATCH / k, BATCH % k);
    tch::manual_seed(STEP_SEED);
    let _no_grad = tch::no_grad_guard();
    let mut start = 0;
    for i in 0..k {
        let len = base + i64::from(i < larger);
        let mb = batch.f_narrow(start, len).unwrap();
        let _logits = model.layers().f_forward_t(&mb.input, true).unwrap();
        start += len;
    }
    assert_eq!(start, BATCH);
    copies(&model.buffers())
}

fn assert_bitwise(what: &str, got: &[Tensor], expected: &[Tensor]) {
    assert_eq!(got.len(), expected.len(), "{what}: count");
    for (i, (a, b)) in got.iter().zip(expected).enumerate() {
        assert!(a.equal(b), "{what}: tensor {i} differs");
    }
}

fn any_differs(a: &[Tensor], b: &[Tensor]) -> bool {
    a.iter().zip(b).any(|(a, b)| !a.equal(b))
}

/// The step configuration of `choice` without the levers that leave the forward's
/// values alone: its autocast and its split only.
fn forward_levers_only(choice: &Choice) -> StepConfig {
    let mut config = StepConfig::baseline();
    if choice.autocast_bf16 {
        config.autocast = Some(Kind::BFloat16);
    }
    config.micro_batches = (choice.micro_batches > 1).then_some(choice.micro_batches);
    config
}

/// What one step of `choice` must leave in the running statistics (see the module
/// docs), checked against the plain step's `plain` statistics and `plain_grads`.
/// `references` caches the steps of the forward-changing levers alone, by (autocast,
/// micro-batches).
fn check_choice(
    arch: &Architecture,
    what: &str,
    choice: &Choice,
    plain: &[Tensor],
    plain_grads: &[Tensor],
    references: &mut HashMap<(bool, usize), Vec<Tensor>>,
) {
    let (stats, grads) = step(arch, choice.step_config(None), choice.schedule());
    if !choice.autocast_bf16 && choice.micro_batches == 1 {
        // Checkpoint, offload, compression: the forward's values are the plain step's,
        // and each statistic is updated once.
        assert_bitwise(&format!("{what}: running statistics"), &stats, plain);
        if choice.is_lossless() {
            assert_bitwise(&format!("{what}: gradients"), &grads, plain_grads);
        }
        return;
    }
    // The same split and autocast with no other lever.
    let expected = references
        .entry((choice.autocast_bf16, choice.micro_batches))
        .or_insert_with(|| {
            let expected = step(arch, forward_levers_only(choice), None).0;
            assert!(
                any_differs(&expected, plain),
                "{what}: a lossy step's statistics are bitwise a plain step's"
            );
            if choice.micro_batches > 1 && !choice.autocast_bf16 {
                // Once per micro-batch, with its statistics: nothing more.
                let k = choice.micro_batches as i64;
                assert_bitwise(
                    &format!("{what}: a plain split's running statistics against {k} forwards"),
                    &expected,
                    &micro_batch_forwards(arch, k),
                );
            }
            expected
        });
    assert_bitwise(&format!("{what}: running statistics"), &stats, expected);
    if choice.micro_batches > 1 {
        assert!(
            choice.lossy_split(),
            "{what}: a split with BatchNorm called lossless"
        );
    }
}

/// Fits `arch` at each fraction of the plain step's peak with its `Allow`, and checks the
/// running statistics of one step of the choice and of every other configuration `fit`
/// considered (any of which it could have returned at another budget or on another
/// machine). Returns the choices' strategies.
fn check(name: &str, arch: &Architecture, budgets: &[(f64, Allow)]) -> Vec<String> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    memsave_meter::install();
    let fresh = copies(&build(arch).buffers());
    assert!(!fresh.is_empty(), "{name}: no running statistics");
    let plain_peak = {
        let model = build(arch);
        let batch = model.batch(BATCH).unwrap();
        tch::manual_seed(STEP_SEED);
        f_step(
            &model,
            &batch,
            &StepConfig::baseline(),
            Device::Cpu,
            false,
            None,
        )
        .unwrap()
        .peak_bytes
    };
    let (plain, plain_grads) = step(arch, StepConfig::baseline(), None);
    assert!(
        any_differs(&plain, &fresh),
        "{name}: a plain step moved no statistic"
    );
    assert_bitwise(
        &format!("{name}: a plain step's running statistics against one forward"),
        &plain,
        &micro_batch_forwards(arch, 1),
    );
    let mut references = HashMap::new();
    let mut checked = HashSet::new();
    let mut strategies = Vec::new();
    for &(fraction, allow) in budgets {
        let mut model = build(arch);
        // The whole device: the parameters and the data, and a fraction of the plain
        // step's own bytes.
        let budget =
            crate::counted_before_step(&model, BATCH) + (plain_peak as f64 * fraction) as u64;
        let mut request = FitRequest::new(budget);
        request.allow = allow;
        let started = Instant::now();
        let result = fit(&mut model, &request);
        let wall = started.elapsed().as_secs_f64();
        drop(model);
        let kind = if allow == LOSSLESS {
            "lossless"
        } else {
            "all levers"
        };
        let report = match result {
            Ok(report) => report,
            Err(e @ FitError::Infeasible { .. }) => {
                println!("{name} at {fraction} of {plain_peak} B = {budget} B ({kind}): {e} (fit {wall:.1} s)");
                strategies.push(format!("{fraction}: infeasible"));
                continue;
            }
            Err(e) => panic!("{name} at {fraction}: {e}"),
        };
        let choice = &report.choice;
        println!(
            "{name} at {fraction} of {plain_peak} B = {budget} B ({kind}): {} ({}x{}), measured {} B, fit {wall:.1} s",
            choice.strategy,
            choice.micro_batches,
            choice.micro_batch,
            report.measured_peak_bytes
        );
        assert!(report.measured_peak_bytes <= budget, "{}", report.to_text());
        if allow == LOSSLESS {
            assert!(choice.is_lossless(), "{}", report.to_text());
        }
        let what = format!("{name} at {fraction}: {}", choice.strategy);
        check_choice(arch, &what, choice, &plain, &plain_grads, &mut references);
        strategies.push(format!("{fraction}: {}", choice.strategy));
        for candidate in &report.candidates {
            let c = &candidate.choice;
            if allow == LOSSLESS {
                assert!(c.is_lossless(), "{name}: {} considered", c.strategy);
            }
            let key = (c.strategy.clone(), c.micro_batches, c.checkpoint.clone());
            if checked.insert(key) {
                let what = format!(
                    "{name}: candidate {} ({}x{})",
                    c.strategy, c.micro_batches, c.micro_batch
                );
                check_choice(arch, &what, c, &plain, &plain_grads, &mut references);
            }
        }
    }
    let mut checked: Vec<_> = checked.into_iter().collect();
    checked.sort();
    println!("{name}: {} configurations checked:", checked.len());
    for (strategy, k, _) in &checked {
        println!("  {strategy} ({k} micro-batches)");
    }
    strategies
}

fn resnet18() -> Architecture {
    Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 5,
        image: [3, 64, 64],
    })
}

fn mobilenet_v2() -> Architecture {
    Architecture::MobileNetV2(MobileNetV2Config {
        classes: 5,
        image: [3, 48, 48],
    })
}

/// Lossless levers only, at these fractions of the plain step's peak.
const LOSSLESS: Allow = Allow {
    bf16: false,
    compress: false,
    int8_state: false,
    micro_batches: false,
};

#[test]
#[serial_test::serial]
fn resnet18_fit_choices_update_running_statistics_once_or_as_documented() {
    let s = check("resnet18", &resnet18(), &[(0.5, Allow::all())]);
    println!("{s:?}");
}

#[test]
#[serial_test::serial]
fn mobilenet_v2_fit_choices_update_running_statistics_once_or_as_documented() {
    let s = check("mobilenet_v2", &mobilenet_v2(), &[(0.5, Allow::all())]);
    println!("{s:?}");
}
