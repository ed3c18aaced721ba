//! Issue #25 ("Real architectures"): `fit` on the zoo's ResNet-18, MobileNetV2, ViT and
//! LLaMA at half the plain step's peak finds a lossless configuration whose measured
//! peak is within the budget. On the BatchNorm nets the step couples samples, so a
//! split into micro-batches is never offered as lossless (and `fit` must name the op);
//! the transformers normalize each sample on its own (layer norm, RMS norm), so there
//! a split is lossless and no coupling op may be reported. Each fit also leaves the
//! parameters, buffers and random stream bitwise as they were.
//!
//! Sizes are small real configurations (the whole architecture, few classes, 32x32
//! images or 32 tokens, two transformer blocks) so that the file runs in a couple of
//! minutes in a debug build on two cores. Run with `--nocapture` for the figures.
use memsave_fit::{fit, FitReport, FitRequest};
use memsave_models::{
    Architecture, LlamaConfig, MobileNetV2Config, ResNetConfig, VitConfig, ZooWorkload,
};
use memsave_step::{f_step, StepConfig, Workload};
use std::sync::Mutex;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// `fit` measures peaks with the process-wide counting allocator and the tests seed
/// libtorch's global random stream: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Fits `arch` (global batch `batch`) at half its plain step's peak and checks what
/// every model must satisfy; returns the report. With `FIT_ZOO_REPORT` set in the
/// environment, prints the report's text (every configuration considered).
fn fit_at_half(name: &str, arch: &Architecture, batch: i64) -> FitReport {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    memsave_meter::install();
    tch::manual_seed(0);
    let mut model = ZooWorkload::new(name, arch, batch, Device::Cpu).unwrap();
    let x = model.batch(batch).unwrap();
    let plain = f_step(
        &model,
        &x,
        &StepConfig::baseline(),
        Device::Cpu,
        false,
        None,
    )
    .unwrap();
    drop(x);
    // The budget is the whole device: the parameters and the data, and half of what
    // the plain step allocates above them.
    let budget = crate::counted_before_step(&model, batch) + plain.peak_bytes / 2;
    let params: Vec<Tensor> = model.parameters().iter().map(Tensor::copy).collect();
    let buffers: Vec<Tensor> = model.buffers().iter().map(Tensor::copy).collect();
    tch::manual_seed(7);
    let started = Instant::now();
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap_or_else(|e| {
        panic!(
            "{name}: fit at half the plain peak {}: {e}",
            plain.peak_bytes
        )
    });
    let wall = started.elapsed().as_secs_f64();
    println!(
        "{name}: plain peak {} B, budget {budget} B, choice {} ({}x{}), measured peak {} B, fit {wall:.1} s",
        plain.peak_bytes,
        report.choice.strategy,
        report.choice.micro_batches,
        report.choice.micro_batch,
        report.measured_peak_bytes
    );
    if std::env::var_os("FIT_ZOO_REPORT").is_some() {
        println!("{}", report.to_text());
    }
    let after_fit = Tensor::randn([16], (Kind::Float, Device::Cpu));
    tch::manual_seed(7);
    let expected = Tensor::randn([16], (Kind::Float, Device::Cpu));
    assert!(
        after_fit.equal(&expected),
        "{name}: fit moved the random stream"
    );
    for (i, (a, b)) in model.parameters().iter().zip(&params).enumerate() {
        assert!(a.equal(b), "{name}: parameter {i} changed");
    }
    let now = model.buffers();
    assert_eq!(now.len(), buffers.len());
    for (i, (a, b)) in now.iter().zip(&buffers).enumerate() {
        assert!(a.equal(b), "{name}: buffer {i} changed");
    }
    let choice = &report.choice;
    assert!(choice.is_lossless(), "{name}: {}", report.to_text());
    assert!(
        report.measured_peak_bytes <= budget,
        "{name}: measured {} over the budget {budget}\n{}",
        report.measured_peak_bytes,
        report.to_text()
    );
    report
}

/// BatchNorm couples the samples: `fit` names the op and never calls a split lossless.
fn assert_coupled(report: &FitReport) {
    assert!(report.sample_coupling_op.is_some(), "{}", report.to_text());
    let choice = &report.choice;
    assert!(
        choice.micro_batches == 1 || !choice.is_lossless(),
        "{}",
        report.to_text()
    );
    assert_eq!(choice.micro_batches, 1, "{}", report.to_text());
}

/// Layer norm and RMS norm normalize each sample alone: no coupling op, and a split
/// (if chosen) is lossless.
fn assert_uncoupled(report: &FitReport) {
    assert_eq!(report.sample_coupling_op, None, "{}", report.to_text());
    assert_eq!(report.choice.sample_coupling_op, None);
}

#[test]
#[serial_test::serial]
fn fit_on_resnet18_keeps_the_model_and_never_calls_a_split_lossless() {
    let arch = Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 5,
        image: [3, 32, 32],
    });
    let report = fit_at_half("resnet18", &arch, 8);
    assert_coupled(&report);
}

#[test]
#[serial_test::serial]
fn fit_on_mobilenet_v2_at_half_the_plain_peak_is_lossless_and_within_budget() {
    let arch = Architecture::MobileNetV2(MobileNetV2Config {
        classes: 5,
        image: [3, 32, 32],
    });
    let report = fit_at_half("mobilenet_v2", &arch, 8);
    assert_coupled(&report);
}

#[test]
#[serial_test::serial]
fn fit_on_vit_at_half_the_plain_peak_is_lossless_and_within_budget() {
    let arch = Architecture::Vit(VitConfig {
        image: [3, 32, 32],
        patch: 4,
        dim: 64,
        layers: 2,
        heads: 4,
        mlp: 256,
        classes: 10,
    });
    let report = fit_at_half("vit", &arch, 8);
    assert_uncoupled(&report);
}

#[test]
#[serial_test::serial]
fn fit_on_llama_at_half_the_plain_peak_is_lossless_and_within_budget() {
    let arch = Architecture::Llama(LlamaConfig {
        vocab: 512,
        dim: 128,
        layers: 2,
        heads: 4,
        kv_heads: 4,
        hidden: None,
        seq: 32,
        ..LlamaConfig::default()
    });
    let report = fit_at_half("llama", &arch, 8);
    assert_uncoupled(&report);
}
