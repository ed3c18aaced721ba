//! Typed errors of the step engine: out of memory is a variant whichever lever it
//! happens in, the cause is kept, and a workload's failing loss comes back as an error
//! from the profiler instead of a panic.
use crate::common::Mlp;
use memsave_meter::MemoryLimitGuard;
use memsave_step::plan::f_profile;
use memsave_step::step::f_step_with;
use memsave_step::{CaseOptimizer, OptimizerKind, OptimizerSpec, StepConfig, StepError, Workload};
use serial_test::serial;
use std::error::Error as _;
use tch::Device;

/// A step that cannot allocate its activations: `OutOfMemory` with libtorch's message
/// as its cause, for the plain step and for one whose optimizer state does not fit.
#[test]
#[serial]
fn an_allocation_that_fails_is_out_of_memory_with_its_cause() {
    let model = Mlp::new(3, 64, 16, 8);
    let x = model.batch(16).unwrap();
    let params = model.parameters();
    let start = memsave_meter::f_memory_allocated(Device::Cpu).unwrap();
    for (name, spec) in [
        ("no optimizer", None),
        (
            "adamw",
            Some(OptimizerSpec {
                kind: OptimizerKind::Adamw,
                ..Default::default()
            }),
        ),
    ] {
        // The optimizer (state made on its first step) is built outside the limit.
        let mut optimizer = spec.map(|s| CaseOptimizer::build(&s, &params).unwrap());
        let err = {
            let _limit = MemoryLimitGuard::f_new(Device::Cpu, start + 4096).unwrap();
            f_step_with(
                &model,
                &x,
                &StepConfig::baseline(),
                Device::Cpu,
                false,
                None,
                optimizer.as_mut(),
            )
            .expect_err("a step over its limit must fail")
        };
        assert!(err.is_out_of_memory(), "{name}: {err:?}");
        assert!(err.source().is_some(), "{name}: the cause is lost: {err:?}");
        assert!(err.to_string().contains("out of memory"), "{name}: {err}");
        memsave_accum::free_grads(&params).unwrap();
    }
}

/// Contradictory options are `InvalidConfig`, not a message to parse.
#[test]
#[serial]
fn offloaded_gradients_with_a_scaler_are_an_invalid_configuration() {
    let model = Mlp::new(2, 16, 8, 1);
    let x = model.batch(8).unwrap();
    let mut config = StepConfig::baseline();
    config.offload_grads = Some(memsave_step::GradsAfter::Restored);
    let mut scaler = memsave_amp::GradScaler::new(Default::default()).unwrap();
    let err = f_step_with(
        &model,
        &x,
        &config,
        Device::Cpu,
        false,
        Some(&mut scaler),
        None,
    )
    .expect_err("refused");
    assert!(matches!(err, StepError::InvalidConfig(_)), "{err:?}");
}

/// The profiler runs the workload's loss inside the checkpoint profiler: a failing
/// loss used to panic out of `f_profile`; now it is the loss's own error.
#[test]
#[serial]
fn a_failing_loss_is_an_error_of_the_profiler_not_a_panic() {
    let mut model = Mlp::new(2, 16, 8, 1);
    model.fail = true;
    let x = model.batch(8).unwrap();
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f_profile(&mut model, &x)));
    let err = outcome
        .expect("f_profile panicked")
        .expect_err("the loss fails");
    assert!(matches!(err, StepError::Torch(_)), "{err:?}");
    assert!(err.to_string().contains("this loss always fails"), "{err}");
    // The layers were put back: the model still steps.
    model.fail = false;
    f_profile(&mut model, &x).expect("profiles once the loss works");
}

/// An empty batch is refused before anything runs, split or not: unsplit it used to
/// step the optimizer on no example (weight decay moved every parameter).
#[test]
#[serial]
fn an_empty_batch_is_refused_split_or_not() {
    let model = Mlp::new(2, 16, 8, 1);
    let empty = model.batch(0).unwrap();
    let params = model.parameters();
    let before: Vec<Vec<f32>> = params
        .iter()
        .map(|p| Vec::<f32>::try_from(p.detach().reshape([-1])).unwrap())
        .collect();
    let spec = OptimizerSpec {
        kind: OptimizerKind::Adamw,
        weight_decay: Some(0.1),
        ..Default::default()
    };
    let mut optimizer = CaseOptimizer::build(&spec, &params).unwrap();
    for micro_batches in [None, Some(2)] {
        let mut config = StepConfig::baseline();
        config.micro_batches = micro_batches;
        let err = f_step_with(
            &model,
            &empty,
            &config,
            Device::Cpu,
            false,
            None,
            Some(&mut optimizer),
        )
        .expect_err("an empty batch is refused");
        assert!(
            matches!(&err, StepError::InvalidConfig(m) if m.contains("empty")),
            "{micro_batches:?}: {err:?}"
        );
        let after: Vec<Vec<f32>> = params
            .iter()
            .map(|p| Vec::<f32>::try_from(p.detach().reshape([-1])).unwrap())
            .collect();
        assert_eq!(after, before, "{micro_batches:?}: the parameters moved");
    }
}
