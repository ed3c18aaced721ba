//! A step's measurement carries its loss: the whole batch's for a mean loss, however
//! the step is split or what else it does.
use crate::common::Mlp;
use memsave_step::{StepConfig, Trainer, Workload};
use serial_test::serial;
use tch::Kind;

/// The workload's loss on its whole batch from one plain forward, without a step.
fn plain_loss(model: &Mlp, batch: i64) -> f64 {
    let _no_grad = tch::no_grad_guard();
    let x = model.batch(batch).unwrap();
    let out = model.layers().f_forward(&x.input).unwrap();
    model.loss(&out, None).unwrap().double_value(&[])
}

#[test]
#[serial]
fn the_step_s_loss_is_the_batch_s_under_every_split() {
    memsave_meter::install();
    let batch = 8;
    for micro_batches in [None, Some(2), Some(3), Some(8)] {
        for autocast in [None, Some(Kind::BFloat16)] {
            let mut model = Mlp::new(3, 16, batch, 4);
            let expected = plain_loss(&model, batch);
            let x = model.batch(batch).unwrap();
            let mut config = StepConfig::baseline();
            config.micro_batches = micro_batches;
            config.autocast = autocast;
            // `Trainer::builder` needs no type for the model.
            let mut trainer = Trainer::builder(config).build(&mut model).unwrap();
            let m = trainer.step(&x).unwrap();
            let loss = m.loss.expect("a scalar loss is reported");
            // bf16 activations: the loss to bf16's precision.
            let tolerance = if autocast.is_some() { 2e-2 } else { 1e-6 };
            assert!(
                ((loss - expected) / expected).abs() < tolerance,
                "{micro_batches:?} {autocast:?}: {loss} against {expected}"
            );
        }
    }
}
