//! When nothing fits, `fit`'s error names the least peak it found and the budget that
//! would do. On a U-Net (BatchNorm: micro-batches are lossy, so every allowed
//! configuration runs the whole batch at once), the whole batch's peak predicted from
//! runs of one and two examples overstates saves and gradients in files by about a
//! quarter; the error named offload alone instead, and a budget a quarter too large.
//! The expected value is a trainer's own step under that configuration.
use memsave_fit::{fit, FitError, FitRequest};
use memsave_models::{Architecture, UNetConfig, ZooWorkload};
use memsave_step::{GradsAfter, SavedTensors, StepConfig, TrainerBuilder, Workload};
use tch::Device;

const BATCH: i64 = 4;

fn unet() -> ZooWorkload {
    memsave_meter::install();
    tch::manual_seed(0);
    let arch = Architecture::UNet(UNetConfig {
        image: [3, 16, 16],
        classes: 4,
        base: 8,
        levels: 3,
    });
    ZooWorkload::new("unet-16px", &arch, BATCH, Device::Cpu).unwrap()
}

#[test]
#[serial_test::serial]
fn the_least_a_refusal_names_is_not_above_saves_and_gradients_in_files() {
    // The whole device as fit counts it, for a trainer's step with the activations'
    // saves and the gradients in files (saves written synchronously, as fit runs them).
    let mut model = unet();
    let before = crate::counted_before_step(&model, BATCH);
    let mut config = StepConfig::baseline();
    config.saved = Some(SavedTensors::OffloadSynchronous);
    config.offload_grads = Some(GradsAfter::Dropped);
    let mut trainer = TrainerBuilder::new(config).build(&mut model).unwrap();
    let batch = trainer.model().batch(BATCH).unwrap();
    trainer.step(&batch).unwrap();
    let measured = before + trainer.step(&batch).unwrap().peak_bytes;
    drop(trainer);

    // A budget halfway from the model and its batch to that: nothing fits.
    let mut model = unet();
    let budget = before + (measured - before) / 2;
    let err = fit(&mut model, &FitRequest::new(budget)).unwrap_err();
    let FitError::Infeasible {
        smallest_bytes,
        how,
        ..
    } = &err
    else {
        panic!("not an infeasible budget: {err}");
    };
    // The smallest budget named adds 2% and the 5% margin to the least peak found: at
    // most a tenth above what the trainer measured (the overstated least was 35% above).
    assert!(
        (*smallest_bytes as f64) <= measured as f64 * 1.10,
        "{smallest_bytes} B named ({how}) against {measured} B measured: {err}"
    );
}
