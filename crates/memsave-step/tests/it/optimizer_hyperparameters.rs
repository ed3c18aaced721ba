//! An `OptimizerSpec`'s hyperparameters reach the optimizer `CaseOptimizer` builds:
//! two steps on a small tensor with known gradients, compared with AdamW's and SGD's
//! updates computed here in f64 (not by memsave-optim), stepped after backward and in
//! backward. Each hyperparameter is shown to matter: the reference with that one left
//! at its default is far from what the optimizer did. Then through the harness's step
//! (`f_step_with`): the weight change of one SGD step scales with `lr`.

use crate::common::Mlp;
use memsave_optim::{AdamWConfig, SgdConfig};
use memsave_step::levers::OptimizerRule;
use memsave_step::step::f_step_with;
use memsave_step::StepError;
use memsave_step::{CaseOptimizer, OptimizerKind, OptimizerSpec, StepConfig, Workload};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

const START: [f32; 5] = [0.5, -1.25, 2.0, 0.0, -0.75];
/// The gradients of the two steps; the small ones make `eps` count.
const GRADS: [[f32; 5]; 2] = [
    [0.25, -0.5, 0.001, 1.5, -0.002],
    [-0.125, 0.75, 0.003, 1.0, 0.004],
];

/// Steps a tensor holding `START` twice, with `GRADS` as its gradients (the loss
/// `sum(p * g)`), by the optimizer `spec` builds; returns its values.
fn two_steps(spec: &OptimizerSpec) -> Vec<f64> {
    let p = Tensor::from_slice(&START).set_requires_grad(true);
    let mut opt = CaseOptimizer::build(spec, std::slice::from_ref(&p)).unwrap();
    for g in GRADS {
        let g = Tensor::from_slice(&g);
        (&p * &g).sum(Kind::Float).backward();
        opt.step(None).unwrap();
        assert!(!p.grad().defined(), "the step frees the gradient");
    }
    Vec::<f32>::try_from(&p.detach())
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// AdamW by hand: `p *= 1 - lr wd`, moments, bias corrections, `p -= lr m^ / (sqrt(v^) + eps)`.
fn adamw_reference(lr: f64, (b1, b2): (f64, f64), eps: f64, wd: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for (i, &p0) in START.iter().enumerate() {
        let (mut p, mut m, mut v) = (f64::from(p0), 0.0, 0.0);
        for (t, grads) in GRADS.iter().enumerate() {
            let t = t as i32 + 1;
            let g = f64::from(grads[i]);
            p *= 1.0 - lr * wd;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let m_hat = m / (1.0 - b1.powi(t));
            let v_hat = v / (1.0 - b2.powi(t));
            p -= lr * m_hat / (v_hat.sqrt() + eps);
        }
        out.push(p);
    }
    out
}

/// SGD by hand, PyTorch's rule with dampening 0 and no Nesterov: `d = g + wd p`;
/// `b = d` at the first step, `b = momentum b + d` after; `p -= lr b`.
fn sgd_reference(lr: f64, momentum: f64, wd: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for (i, &p0) in START.iter().enumerate() {
        let (mut p, mut b) = (f64::from(p0), 0.0);
        for (t, grads) in GRADS.iter().enumerate() {
            let d = f64::from(grads[i]) + wd * p;
            b = if t == 0 { d } else { momentum * b + d };
            p -= lr * b;
        }
        out.push(p);
    }
    out
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// f32 arithmetic against f64: a few ulps of values of about 2.
const TOLERANCE: f64 = 1e-5;

#[test]
#[serial]
fn adamw_takes_lr_betas_eps_and_weight_decay_from_the_spec() {
    let (lr, betas, eps, wd) = (0.05, (0.5, 0.75), 1e-2, 0.3);
    let expected = adamw_reference(lr, betas, eps, wd);
    // Each hyperparameter at its default instead: far from the expected values, so a
    // spec value that did not reach the optimizer would show.
    let defaults = AdamWConfig::default();
    for (what, other) in [
        ("lr", adamw_reference(defaults.lr, betas, eps, wd)),
        ("betas", adamw_reference(lr, defaults.betas, eps, wd)),
        ("eps", adamw_reference(lr, betas, defaults.eps, wd)),
        (
            "weight_decay",
            adamw_reference(lr, betas, eps, defaults.weight_decay),
        ),
    ] {
        assert!(
            max_diff(&other, &expected) > 100.0 * TOLERANCE,
            "{what} at its default changes nothing: {other:?}"
        );
    }
    for in_backward in [false, true] {
        let spec = OptimizerSpec {
            kind: OptimizerKind::Adamw,
            in_backward,
            lr: Some(lr),
            betas: Some(betas),
            eps: Some(eps),
            weight_decay: Some(wd),
            ..OptimizerSpec::default()
        };
        let got = two_steps(&spec);
        assert!(
            max_diff(&got, &expected) < TOLERANCE,
            "in_backward {in_backward}: {got:?} vs {expected:?}"
        );
    }
}

#[test]
#[serial]
fn sgd_takes_lr_momentum_and_weight_decay_from_the_spec() {
    let (lr, momentum, wd) = (0.2, 0.75, 0.5);
    let expected = sgd_reference(lr, momentum, wd);
    for (what, other) in [
        ("lr", sgd_reference(1e-3, momentum, wd)),
        ("momentum", sgd_reference(lr, 0.0, wd)),
        ("weight_decay", sgd_reference(lr, momentum, 0.0)),
    ] {
        assert!(
            max_diff(&other, &expected) > 100.0 * TOLERANCE,
            "{what} at its default changes nothing: {other:?}"
        );
    }
    for in_backward in [false, true] {
        let spec = OptimizerSpec {
            kind: OptimizerKind::Sgd,
            in_backward,
            lr: Some(lr),
            momentum: Some(momentum),
            weight_decay: Some(wd),
            ..OptimizerSpec::default()
        };
        let got = two_steps(&spec);
        assert!(
            max_diff(&got, &expected) < TOLERANCE,
            "in_backward {in_backward}: {got:?} vs {expected:?}"
        );
    }
}

/// Without hyperparameters the spec builds what the harness always built: lr 1e-3 for
/// both kinds and PyTorch's other defaults, so existing results do not change.
#[test]
#[serial]
fn a_spec_without_hyperparameters_keeps_the_old_fixed_values() {
    let adamw = OptimizerSpec::default().rule().unwrap();
    assert_eq!(
        adamw,
        OptimizerRule::AdamW(AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        })
    );
    let sgd = OptimizerSpec {
        kind: OptimizerKind::Sgd,
        ..OptimizerSpec::default()
    };
    assert_eq!(
        sgd.rule().unwrap(),
        OptimizerRule::Sgd(SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        })
    );
    // And the steps agree with the hand-computed ones at those values.
    let got = two_steps(&OptimizerSpec::default());
    let expected = adamw_reference(1e-3, (0.9, 0.999), 1e-8, 1e-2);
    assert!(max_diff(&got, &expected) < TOLERANCE, "{got:?}");
    let got = two_steps(&sgd);
    assert!(
        max_diff(&got, &sgd_reference(1e-3, 0.0, 0.0)) < TOLERANCE,
        "{got:?}"
    );
}

#[test]
fn invalid_specs_are_refused_before_any_step() {
    let p = Tensor::from_slice(&START).set_requires_grad(true);
    let params = std::slice::from_ref(&p);
    for (spec, needle) in [
        (
            OptimizerSpec {
                momentum: Some(0.9),
                ..OptimizerSpec::default()
            },
            "momentum is an option of sgd",
        ),
        (
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                betas: Some((0.9, 0.99)),
                ..OptimizerSpec::default()
            },
            "betas and eps are options of adamw",
        ),
        (
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                eps: Some(1e-6),
                ..OptimizerSpec::default()
            },
            "betas and eps are options of adamw",
        ),
        (
            OptimizerSpec {
                lr: Some(-0.1),
                ..OptimizerSpec::default()
            },
            "lr must be finite and >= 0, got -0.1",
        ),
        (
            OptimizerSpec {
                betas: Some((0.9, 1.0)),
                ..OptimizerSpec::default()
            },
            "betas must be in [0, 1)",
        ),
        (
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                weight_decay: Some(f64::NAN),
                ..OptimizerSpec::default()
            },
            "weight_decay must be finite",
        ),
    ] {
        let e = match CaseOptimizer::build(&spec, params) {
            Ok(_) => panic!("built {spec:?}"),
            Err(e) => e,
        };
        assert!(
            matches!(e, StepError::InvalidConfig(_)),
            "{spec:?}: not an invalid configuration: {e:?}"
        );
        assert!(
            e.to_string().contains(needle),
            "{spec:?}: expected '{needle}' in {e}"
        );
    }
}

/// The weights after one SGD step of the harness (`f_step_with`, the step `memsave
/// bench` measures) on a fresh model, minus the starting weights.
fn harness_step_change(lr: f64) -> Vec<f64> {
    let model = Mlp::new(2, 8, 4, 3);
    let params = model.parameters();
    let flat = |ps: &[Tensor]| -> Vec<f64> {
        ps.iter()
            .flat_map(|p| Vec::<f32>::try_from(&p.detach().reshape([-1])).unwrap())
            .map(f64::from)
            .collect()
    };
    let before = flat(&params);
    let spec = OptimizerSpec {
        kind: OptimizerKind::Sgd,
        lr: Some(lr),
        ..OptimizerSpec::default()
    };
    let config = StepConfig {
        optimizer: Some(spec),
        ..StepConfig::baseline()
    };
    let mut opt = CaseOptimizer::build(&spec, &params).unwrap();
    let x = model.batch(model.global_batch()).unwrap();
    f_step_with(
        &model,
        &x,
        &config,
        Device::Cpu,
        false,
        None,
        Some(&mut opt),
    )
    .unwrap();
    let after = flat(&params);
    after.iter().zip(&before).map(|(a, b)| a - b).collect()
}

#[test]
#[serial]
fn the_harness_step_moves_the_weights_in_proportion_to_lr() {
    let small = harness_step_change(0.1);
    let large = harness_step_change(0.4);
    let largest = small.iter().fold(0.0f64, |m, d| m.max(d.abs()));
    assert!(largest > 1e-4, "the step changed nothing: {largest}");
    // Plain SGD from the same weights and gradients: 4 times the lr, 4 times the step.
    for (s, l) in small.iter().zip(&large) {
        assert!((l - 4.0 * s).abs() < 1e-5, "{l} vs 4 x {s}");
    }
}
