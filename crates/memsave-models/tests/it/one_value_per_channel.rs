//! BatchNorm in training needs more than one value per channel: a micro-batch of one
//! example whose feature map is 1x1 (ResNet-18's last stage on 32x32 images) gives it
//! one, and libtorch's kernel then writes a NaN running variance without an error
//! (PyTorch refuses it in Python, "Expected more than 1 value per channel when
//! training"). Neither the step nor `fit` may leave such a model with NaN statistics.
//! (memsave-fit's `spoiled_splits` checks the error `fit` gives for a budget nothing
//! fits, on a small BatchNorm1d model.)
use memsave_fit::{fit, Allow, Choice, FitRequest};
use memsave_models::{Architecture, ResNetConfig, ZooWorkload};
use memsave_step::{f_step, StepConfig, StepError, TrainerBuilder, Workload};
use tch::{Device, Tensor};

/// Odd: an even split is not the only one, and the smallest micro-batch is what counts.
const BATCH: i64 = 5;

fn resnet18_at_32() -> ZooWorkload {
    tch::manual_seed(0);
    let arch = Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 5,
        image: [3, 32, 32],
    });
    ZooWorkload::new("r", &arch, BATCH, Device::Cpu).unwrap()
}

/// Examples in the smallest micro-batch of `choice` (a split as even as possible).
fn smallest_micro_batch(choice: &Choice) -> i64 {
    BATCH / choice.micro_batches as i64
}

fn all_finite(ts: &[Tensor]) -> bool {
    ts.iter().all(|t| t.isfinite().all().int64_value(&[]) == 1)
}

#[test]
#[serial_test::serial]
fn a_split_into_one_example_micro_batches_is_refused_not_a_nan_statistic() {
    let mut model = resnet18_at_32();
    let batch = model.batch(BATCH).unwrap();
    let mut config = StepConfig::baseline();
    config.micro_batches = Some(BATCH as usize);
    let mut trainer = TrainerBuilder::new(config).build(&mut model).unwrap();
    let outcome = trainer.step(&batch);
    let buffers = trainer.model().buffers();
    assert!(
        all_finite(&buffers),
        "a NaN running statistic ({outcome:?})"
    );
    let e = outcome.expect_err("one value per channel in training");
    assert!(
        matches!(e, StepError::NonFiniteStatistics { micro_batch: 1, .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("one value per channel"), "{e}");
}

#[test]
#[serial_test::serial]
fn two_examples_a_micro_batch_train_with_finite_statistics() {
    let mut model = resnet18_at_32();
    let batch = model.batch(BATCH).unwrap();
    let mut config = StepConfig::baseline();
    config.micro_batches = Some(BATCH as usize / 2);
    let mut trainer = TrainerBuilder::new(config).build(&mut model).unwrap();
    trainer.step(&batch).unwrap();
    assert!(all_finite(&trainer.model().buffers()));
}

#[test]
#[serial_test::serial]
fn fit_runs_one_example_splits_but_never_offers_them() {
    memsave_meter::install();
    let mut model = resnet18_at_32();
    let batch = model.batch(BATCH).unwrap();
    let plain = f_step(
        &model,
        &batch,
        &StepConfig::baseline(),
        Device::Cpu,
        false,
        None,
    )
    .unwrap()
    .peak_bytes;
    drop(batch);
    // Splits allowed (the lossless levers besides), and every configuration predicted
    // to fit run at its real size: those with one example per micro-batch among them.
    // The whole device: the parameters and the data, and 60% of the plain step's own.
    let mut request = FitRequest::new(crate::counted_before_step(&model, BATCH) + plain * 6 / 10);
    request.allow = Allow {
        bf16: false,
        compress: false,
        int8_state: false,
        micro_batches: true,
    };
    request.exhaustive = true;
    let report = fit(&mut model, &request).unwrap_or_else(|e| panic!("fit: {e}"));
    let ones: Vec<_> = report
        .candidates
        .iter()
        .filter(|c| smallest_micro_batch(&c.choice) == 1)
        .collect();
    assert!(!ones.is_empty(), "{}", report.to_text());
    let mut ran = 0;
    for c in ones {
        // Not measured: refused when run (or never run, not fitting).
        assert_eq!(c.measured_peak_bytes, None, "{}", c.choice.strategy);
        if c.note
            .as_ref()
            .is_some_and(|n| n.contains("one value per channel"))
        {
            ran += 1;
        }
    }
    assert!(
        ran > 0,
        "no one-example split was run: {}",
        report.to_text()
    );
    let choice = report.choice.clone();
    assert!(smallest_micro_batch(&choice) >= 2, "{}", report.to_text());
    let mut trainer = report.trainer(&mut model).unwrap();
    let batch = trainer.model().batch(BATCH).unwrap();
    trainer.step(&batch).unwrap();
    assert!(
        all_finite(&trainer.model().buffers()),
        "{} ({}x{}): NaN running statistics",
        choice.strategy,
        choice.micro_batches,
        choice.micro_batch
    );
}
