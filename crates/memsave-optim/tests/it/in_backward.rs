//! The step inside backward: same parameters as the step after backward, no gradient
//! left, errors surfacing from backward, refusals and removable hooks.
//!
//! Every test is serial: the meter counts the whole process.

use crate::common::{assert_bitwise, net};
use memsave_meter::measure;
use memsave_optim::{AdamW, AdamWConfig, OptimError, Options, Sgd, SgdConfig, State};
use serial_test::serial;
use tch::{Device, Kind};

fn config() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    }
}

#[test]
#[serial]
fn stepping_in_backward_gives_the_same_parameters_and_frees_every_gradient() {
    for state in [State::F32, State::Int8Blockwise { block: 64 }] {
        let options = Options {
            state,
            ..Default::default()
        };
        let after = net(31);
        let inside = net(31);
        let mut opt = AdamW::with_options(&after.params(), config(), options.clone()).unwrap();
        let fused = AdamW::with_options(&inside.params(), config(), options)
            .unwrap()
            .step_in_backward(&inside.params())
            .unwrap();
        for step in 0..5 {
            opt.zero_grad(true);
            after.backward(step);
            opt.step();
            inside.loss(step).f_backward().unwrap();
            assert!(
                inside.params().iter().all(|p| !p.grad().defined()),
                "{state:?}: a gradient is left"
            );
            assert_bitwise(
                &inside.params(),
                &after.params(),
                &format!("{state:?} step {step}"),
            );
        }
        assert_eq!(fused.optimizer().step_count(0), 5);
    }
}

#[test]
#[serial]
fn in_backward_holds_no_gradient_bytes_after_backward() {
    memsave_meter::install();
    let after = net(32);
    let inside = net(32);
    let config = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let mut opt = Sgd::new(&after.params(), config).unwrap();
    let fused = Sgd::new(&inside.params(), config)
        .unwrap()
        .step_in_backward(&inside.params())
        .unwrap();
    // Warm up libtorch's caches, then measure one more step of each.
    after.backward(0);
    opt.step();
    opt.zero_grad(true);
    inside.loss(0).backward();
    let numel: i64 = after.params().iter().map(|p| p.numel() as i64).sum();

    let (_, normal) = measure(Device::Cpu, |_| {
        after.backward(1);
        opt.step();
    });
    let (_, fused_m) = measure(Device::Cpu, |_| {
        inside.loss(1).backward();
    });
    // The step after backward keeps every gradient (4 bytes per parameter value);
    // inside backward each is freed once its parameter is updated.
    assert_eq!(normal.end_bytes - normal.start_bytes, 4 * numel as u64);
    assert_eq!(fused_m.end_bytes, fused_m.start_bytes);
    assert!(
        fused_m.peak_bytes <= normal.peak_bytes,
        "{} > {}",
        fused_m.peak_bytes,
        normal.peak_bytes
    );
    assert_bitwise(&inside.params(), &after.params(), "after two steps");
    drop(fused);
}

#[test]
#[serial]
fn an_error_in_the_step_comes_back_from_backward() {
    let n = net(33);
    let fused = AdamW::new(&n.params(), config())
        .unwrap()
        .step_in_backward(&n.params())
        .unwrap();
    let guard = fused.optimizer();
    let e = n.loss(0).f_backward().unwrap_err();
    assert!(e.to_string().contains("the optimizer is in use"), "{e}");
    drop(guard);
    // Nothing was stepped; the next backward works.
    assert_eq!(fused.optimizer().step_count(0), 0);
    n.params()
        .iter()
        .for_each(|p| memsave_sys::tensor::set_grad_none(p).unwrap());
    n.loss(1).f_backward().unwrap();
    assert_eq!(fused.optimizer().step_count(0), 1);
}

#[test]
#[serial]
fn combinations_that_cannot_be_right_are_refused_at_registration() {
    let n = net(34);
    let clipped = Options {
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let e = AdamW::with_options(&n.params(), config(), clipped)
        .unwrap()
        .step_in_backward(&n.params())
        .unwrap_err();
    assert!(matches!(e, OptimError::InBackward(_)), "{e}");
    assert!(e.to_string().contains("max_grad_norm"), "{e}");

    n.backward(0);
    let e = AdamW::new(&n.params(), config())
        .unwrap()
        .step_in_backward(&n.params())
        .unwrap_err();
    assert!(
        e.to_string().contains("parameter 0") && e.to_string().contains("micro-batches"),
        "{e}"
    );

    let other = net(35);
    let e = AdamW::new(&n.params(), config())
        .unwrap()
        .step_in_backward(&other.params()[..1])
        .unwrap_err();
    assert!(
        e.to_string().contains("not a parameter of this optimizer"),
        "{e}"
    );
}

#[test]
#[serial]
fn hooks_are_removed_by_into_inner_and_a_second_registration_is_refused() {
    let n = net(36);
    n.params()
        .iter()
        .for_each(|p| memsave_sys::tensor::set_grad_none(p).unwrap());
    let fused = Sgd::new(&n.params(), SgdConfig::default())
        .unwrap()
        .step_in_backward(&n.params())
        .unwrap();
    let e = Sgd::new(&n.params(), SgdConfig::default())
        .unwrap()
        .step_in_backward(&n.params())
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("already has a post-accumulate-grad hook"),
        "{e}"
    );

    let mut opt = fused.into_inner().unwrap();
    let before: Vec<_> = n.params().iter().map(|p| p.detach().copy()).collect();
    n.backward(0);
    // No hook any more: the gradients stay and nothing moved until step().
    assert!(n.params().iter().all(|p| p.grad().defined()));
    assert_bitwise(&n.params(), &before, "no step in backward");
    opt.step();
    assert!(
        n.params()[0]
            .grad()
            .abs()
            .sum(Kind::Float)
            .double_value(&[])
            > 0.0
    );
    assert!(!n.params()[0].equal(&before[0]));
}
