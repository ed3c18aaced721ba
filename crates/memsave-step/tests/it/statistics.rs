//! A step with a one-example micro-batch that turns BatchNorm's running statistics NaN
//! fails with `NonFiniteStatistics`, puts the statistics back bitwise, and keeps the
//! step's gradients (restored from files too).
use crate::common::Norm1d;
use memsave_step::config::GradsAfter;
use memsave_step::{StepConfig, StepError, StepRun, Workload};
use serial_test::serial;
use tch::{Device, Tensor};

#[test]
#[serial]
fn one_value_per_channel_is_refused_with_the_statistics_put_back_and_the_gradients_kept() {
    memsave_meter::install();
    for offload_grads in [None, Some(GradsAfter::Restored)] {
        let model = Norm1d::new(4, 8);
        let x = model.batch(4).unwrap();
        let before: Vec<Tensor> = model.buffers().iter().map(Tensor::copy).collect();
        let mut config = StepConfig::baseline();
        config.offload_grads = offload_grads;
        config.micro_batches = Some(4);
        let e = StepRun::new(Device::Cpu)
            .f_step(&model, &x, &config)
            .expect_err("one value per channel");
        assert!(
            matches!(
                e,
                StepError::NonFiniteStatistics {
                    buffers: 1,
                    micro_batch: 1,
                    split: true
                }
            ),
            "{offload_grads:?}: {e:?}"
        );
        for (b, a) in before.iter().zip(model.buffers()) {
            assert!(b.equal(&a), "{offload_grads:?}: a statistic not put back");
        }
        for p in model.parameters() {
            assert!(
                p.grad().defined(),
                "{offload_grads:?}: the step's gradients are lost"
            );
        }
        // Two examples a micro-batch: a step as any other.
        config.micro_batches = Some(2);
        StepRun::new(Device::Cpu)
            .f_step(&model, &x, &config)
            .unwrap_or_else(|e| panic!("{offload_grads:?}: 2x2: {e}"));
        // Unchecked, the same split leaves the NaN the check reports.
        config.micro_batches = Some(4);
        StepRun::new(Device::Cpu)
            .check_statistics(false)
            .f_step(&model, &x, &config)
            .unwrap();
        let nan = model
            .buffers()
            .iter()
            .any(|b| b.isnan().any().int64_value(&[]) == 1);
        assert!(nan, "{offload_grads:?}: no NaN without the check");
    }
}

/// Issue "Trust III" item 10: an unsplit batch of one example spoils the statistics as
/// a one-example micro-batch does, and no split helps: the error says the batch must
/// have 2 or more examples (it spoke of micro-batches).
#[test]
#[serial]
fn a_batch_of_one_is_told_to_grow_not_to_split() {
    memsave_meter::install();
    let model = Norm1d::new(1, 8);
    let x = model.batch(1).unwrap();
    let e = StepRun::new(Device::Cpu)
        .f_step(&model, &x, &StepConfig::baseline())
        .expect_err("one value per channel");
    let text = e.to_string();
    assert!(
        matches!(e, StepError::NonFiniteStatistics { split: false, .. }),
        "{e:?}"
    );
    assert!(
        text.starts_with("a batch of 1 example")
            && text.contains("the batch must have 2 or more examples")
            && !text.contains("micro-batch"),
        "{text}"
    );
}
