//! The step under a GradScaler: skipped for every parameter on an inf/NaN gradient, as
//! PyTorch's `scaler.step(optimizer)` does.

use crate::common::{assert_bitwise, net};
use memsave_amp::{GradScaler, GradScalerConfig, StepOutcome};
use memsave_optim::{AdamW, AdamWConfig, Options, State};
use tch::{Kind, Tensor};

fn snapshot(params: &[Tensor]) -> Vec<Tensor> {
    params.iter().map(|p| p.detach().copy()).collect()
}

#[test]
#[serial_test::parallel]
fn a_nan_gradient_skips_the_step_for_every_parameter_and_leaves_the_state_bitwise() {
    for state in [State::F32, State::Bf16, State::Int8Blockwise { block: 64 }] {
        let net = net(3);
        let params = net.params();
        let options = Options {
            state,
            ..Default::default()
        };
        let mut opt = AdamW::with_options(&params, AdamWConfig::default(), options).unwrap();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();

        // A finite step first, so there is state to keep intact.
        opt.zero_grad(true);
        scaler.scale(&net.loss(0)).backward();
        assert_eq!(
            opt.f_step_scaled(&mut scaler).unwrap(),
            StepOutcome::Stepped
        );
        scaler.update();
        let saved_before = opt.state_dict().unwrap();
        let before = snapshot(&params);

        // One NaN in the last parameter's gradient: nothing may move, not even the first.
        opt.zero_grad(true);
        scaler.scale(&net.loss(1)).backward();
        let last = params.last().unwrap().grad();
        let _ = last.get(0).fill_(f64::NAN);
        let outcome = opt.f_step_scaled(&mut scaler).unwrap();
        assert_eq!(outcome, StepOutcome::SkippedNonFinite, "{state:?}");
        assert_bitwise(&params, &before, "params after a skipped step");
        assert_eq!(
            opt.step_count(0),
            1,
            "{state:?}: the skipped step is not counted"
        );
        let saved_after = opt.state_dict().unwrap();
        assert_eq!(
            serde_json::to_string(&saved_after).unwrap(),
            serde_json::to_string(&saved_before).unwrap(),
            "{state:?}: the state changed on a skipped step"
        );
        // The scale backs off after the skipped step.
        scaler.update();
        opt.zero_grad(true);
        let scaled = scaler.scale(&Tensor::ones([], (Kind::Float, tch::Device::Cpu)));
        assert_eq!(scaled.double_value(&[]), 65536.0 * 0.5, "{state:?}");
    }
}

#[test]
#[serial_test::parallel]
fn finite_gradients_step_as_without_a_scaler() {
    let scaled_net = net(5);
    let plain_net = net(5);
    let mut scaled_opt = AdamW::new(&scaled_net.params(), AdamWConfig::default()).unwrap();
    let mut plain_opt = AdamW::new(&plain_net.params(), AdamWConfig::default()).unwrap();
    // A power-of-two scale: scaling and unscaling are exact, so the steps agree bitwise.
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    })
    .unwrap();
    for step in 0..3 {
        scaled_opt.zero_grad(true);
        scaler.scale(&scaled_net.loss(step)).backward();
        assert_eq!(
            scaled_opt.f_step_scaled(&mut scaler).unwrap(),
            StepOutcome::Stepped
        );
        scaler.update();
        plain_opt.zero_grad(true);
        plain_net.backward(step);
        plain_opt.step();
    }
    assert_bitwise(&scaled_net.params(), &plain_net.params(), "scaled vs plain");
}

/// Under a GradScaler the gradients of the scaled loss are `scale` times too large; a
/// step inside backward would take them as they are (Trust II, finding 5).
#[test]
#[serial_test::parallel]
fn an_optimizer_stepped_under_a_scaler_refuses_to_step_in_backward_before_any_step() {
    for state in [State::F32, State::Int8Blockwise { block: 64 }] {
        let net = net(7);
        let params = net.params();
        let options = Options {
            state,
            ..Default::default()
        };
        let mut opt = AdamW::with_options(&params, AdamWConfig::default(), options).unwrap();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        opt.zero_grad(true);
        scaler.scale(&net.loss(0)).backward();
        assert_eq!(
            opt.f_step_scaled(&mut scaler).unwrap(),
            StepOutcome::Stepped
        );
        scaler.update();
        opt.zero_grad(true);
        let before = snapshot(&params);
        let err = opt
            .step_in_backward(&params)
            .expect_err("step_in_backward after f_step_scaled was accepted");
        assert!(
            matches!(err, memsave_optim::OptimError::InBackward(_)),
            "{err:?}"
        );
        assert!(err.to_string().contains("GradScaler"), "{err}");
        // No hook was left behind: a scaled backward moves nothing.
        scaler.scale(&net.loss(1)).backward();
        assert_bitwise(&params, &before, "params after a refused step_in_backward");
    }
}

#[test]
#[serial_test::parallel]
fn the_step_under_a_scaler_is_refused_while_the_optimizer_steps_in_backward() {
    let net = net(8);
    let params = net.params();
    let opt = AdamW::new(&params, AdamWConfig::default()).unwrap();
    let hooked = opt.step_in_backward(&params).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let scaler_before = serde_json::to_string(&scaler.state_dict().unwrap()).unwrap();
    let err = hooked
        .optimizer()
        .f_step_scaled(&mut scaler)
        .expect_err("f_step_scaled on an optimizer stepping in backward was accepted");
    assert!(
        matches!(err, memsave_optim::OptimError::InBackward(_)),
        "{err:?}"
    );
    assert!(err.to_string().contains("GradScaler"), "{err}");
    assert_eq!(
        serde_json::to_string(&scaler.state_dict().unwrap()).unwrap(),
        scaler_before,
        "the scaler was touched"
    );
    // Given back, the optimizer steps under the scaler again.
    let mut opt = hooked.into_inner().unwrap();
    opt.zero_grad(true);
    scaler.scale(&net.loss(0)).backward();
    assert_eq!(
        opt.f_step_scaled(&mut scaler).unwrap(),
        StepOutcome::Stepped
    );
}
