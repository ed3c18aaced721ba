//! A `GradScaler` together with an optimizer stepping in backward is refused before
//! anything runs: each hook would step its parameter from a gradient multiplied by the
//! loss scale (65,536 by default), with no unscaling and no inf/NaN check in between.
//! Checked on the measured step (`f_step_with`) and on `CaseOptimizer::step` itself, for
//! both update rules and several model widths; a disabled scaler, which scales nothing,
//! is still accepted.

use crate::common::Mlp;
use memsave_amp::{GradScaler, GradScalerConfig};
use memsave_step::step::f_step_with;
use memsave_step::StepError;
use memsave_step::{CaseOptimizer, OptimizerKind, OptimizerSpec, StepConfig, Workload};
use serial_test::serial;
use tch::{Device, Tensor};

const REFUSAL: &str = "a GradScaler cannot be combined with an optimizer stepping in backward (in_backward): each parameter's step would see its gradient multiplied by the loss scale; drop the scaler or step the optimizer after backward";

const WIDTHS: [i64; 3] = [8, 32, 96];
const KINDS: [OptimizerKind; 2] = [OptimizerKind::Adamw, OptimizerKind::Sgd];

/// The parameters' bits, copied to the host.
fn bits(params: &[Tensor]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| {
            Vec::<f32>::try_from(&p.detach().reshape([-1]))
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .collect()
}

fn in_backward(kind: OptimizerKind) -> OptimizerSpec {
    OptimizerSpec {
        kind,
        in_backward: true,
        ..OptimizerSpec::default()
    }
}

fn scaler(enabled: bool) -> GradScaler {
    GradScaler::new(GradScalerConfig {
        enabled,
        ..GradScalerConfig::default()
    })
    .unwrap()
}

#[test]
#[serial]
fn the_step_refuses_a_scaler_with_an_optimizer_in_backward_before_the_forward() {
    for width in WIDTHS {
        for kind in KINDS {
            let model = Mlp::new(2, width, 4, 3);
            let x = model.batch(model.global_batch()).unwrap();
            let params = model.parameters();
            let spec = in_backward(kind);
            let mut opt = CaseOptimizer::build(&spec, &params).unwrap();
            let before = bits(&params);
            // The strategy names the scaler, or only the caller passes one: the loss is
            // scaled either way.
            let with_scaler = StepConfig {
                scaler: Some(GradScalerConfig::default()),
                optimizer: Some(spec),
                ..StepConfig::baseline()
            };
            let scaler_passed_only = StepConfig {
                scaler: None,
                ..with_scaler.clone()
            };
            for config in [&with_scaler, &scaler_passed_only] {
                let mut scaler = scaler(true);
                let state = scaler.state_dict().unwrap();
                let err = f_step_with(
                    &model,
                    &x,
                    config,
                    Device::Cpu,
                    false,
                    Some(&mut scaler),
                    Some(&mut opt),
                )
                .expect_err("a scaler with an optimizer in backward must be refused");
                assert!(
                    matches!(&err, StepError::InvalidConfig(m) if m == REFUSAL),
                    "width {width}, {kind:?}: {err:?}"
                );
                assert_eq!(bits(&params), before, "width {width}, {kind:?}: stepped");
                for p in &params {
                    assert!(!p.grad().defined(), "width {width}: backward ran");
                }
                assert_eq!(scaler.state_dict().unwrap(), state, "the scaler changed");
            }
            // The optimizer is left as it was: it still steps in backward without one.
            let plain = StepConfig {
                scaler: None,
                ..with_scaler.clone()
            };
            f_step_with(&model, &x, &plain, Device::Cpu, false, None, Some(&mut opt)).unwrap();
            assert_ne!(
                bits(&params),
                before,
                "width {width}, {kind:?}: not stepped"
            );
        }
    }
}

#[test]
#[serial]
fn case_optimizer_step_refuses_an_enabled_scaler_in_backward() {
    for width in WIDTHS {
        for kind in KINDS {
            let model = Mlp::new(2, width, 4, 3);
            let params = model.parameters();
            let mut opt = CaseOptimizer::build(&in_backward(kind), &params).unwrap();
            assert!(opt.steps_in_backward());
            let before = bits(&params);
            // Stepped from its hooks, then from a gradient offload's `on_complete`.
            for offloaded in [false, true] {
                if offloaded {
                    let on_complete = opt.param_stepper(&params).unwrap();
                    assert!(on_complete.is_some());
                    assert!(opt.steps_in_backward(), "offloaded still steps in backward");
                }
                let mut enabled = scaler(true);
                let state = enabled.state_dict().unwrap();
                let err = opt
                    .step(Some(&mut enabled))
                    .expect_err("an enabled scaler must be refused");
                assert!(
                    matches!(&err, StepError::InvalidConfig(m) if m == REFUSAL),
                    "width {width}, {kind:?}, offloaded {offloaded}: {err:?}"
                );
                assert_eq!(enabled.state_dict().unwrap(), state, "the scaler changed");
                // A disabled scaler scales nothing: nothing to refuse.
                opt.step(Some(&mut scaler(false))).unwrap();
                opt.step(None).unwrap();
                assert_eq!(bits(&params), before);
            }
        }
    }
    let model = Mlp::new(2, 8, 4, 3);
    let after = CaseOptimizer::build(&OptimizerSpec::default(), &model.parameters()).unwrap();
    assert!(!after.steps_in_backward());
}

#[test]
#[serial]
fn a_disabled_scaler_with_an_optimizer_in_backward_steps_as_without_one() {
    for width in WIDTHS {
        for kind in KINDS {
            let stepped = |scaler: Option<&mut GradScaler>| {
                let model = Mlp::new(2, width, 4, 3); // same seed, same weights and data
                let x = model.batch(model.global_batch()).unwrap();
                let params = model.parameters();
                let spec = in_backward(kind);
                let mut opt = CaseOptimizer::build(&spec, &params).unwrap();
                let config = StepConfig {
                    optimizer: Some(spec),
                    ..StepConfig::baseline()
                };
                let before = bits(&params);
                f_step_with(
                    &model,
                    &x,
                    &config,
                    Device::Cpu,
                    false,
                    scaler,
                    Some(&mut opt),
                )
                .unwrap();
                let after = bits(&params);
                assert_ne!(after, before, "width {width}, {kind:?}: not stepped");
                after
            };
            let plain = stepped(None);
            assert_eq!(stepped(Some(&mut scaler(false))), plain, "width {width}");
        }
    }
}
