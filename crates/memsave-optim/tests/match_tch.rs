//! In f32 the optimizers match tch's own (libtorch's C++ optimizers) bit for bit.
mod common;

use common::{assert_bitwise, net};
use memsave_optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use tch::nn::OptimizerConfig;

fn compare_adamw(config: AdamWConfig, steps: i64) {
    let theirs = net(1);
    let ours = net(1);
    let mut reference = tch::nn::AdamW {
        beta1: config.betas.0,
        beta2: config.betas.1,
        wd: config.weight_decay,
        eps: config.eps,
        amsgrad: false,
    }
    .build(&theirs.vs, config.lr)
    .unwrap();
    let mut opt = AdamW::new(&ours.params(), config).unwrap();
    for step in 0..steps {
        reference.zero_grad();
        theirs.backward(step);
        reference.step();
        opt.zero_grad(true);
        ours.backward(step);
        opt.step();
        assert_bitwise(
            &ours.params(),
            &theirs.params(),
            &format!("AdamW {config:?}, step {step}"),
        );
    }
}

fn compare_sgd(config: SgdConfig, steps: i64) {
    let theirs = net(2);
    let ours = net(2);
    let mut reference = tch::nn::Sgd {
        momentum: config.momentum,
        dampening: config.dampening,
        wd: config.weight_decay,
        nesterov: config.nesterov,
    }
    .build(&theirs.vs, config.lr)
    .unwrap();
    let mut opt = Sgd::new(&ours.params(), config).unwrap();
    for step in 0..steps {
        reference.zero_grad();
        theirs.backward(step);
        reference.step();
        opt.zero_grad(false);
        ours.backward(step);
        opt.step();
        assert_bitwise(
            &ours.params(),
            &theirs.params(),
            &format!("SGD {config:?}, step {step}"),
        );
    }
}

#[test]
fn adamw_matches_tch_for_100_steps_with_pytorch_defaults() {
    compare_adamw(AdamWConfig::default(), 100);
}

#[test]
fn adamw_matches_tch_without_weight_decay_and_other_betas() {
    compare_adamw(
        AdamWConfig {
            lr: 3e-2,
            betas: (0.8, 0.99),
            eps: 1e-6,
            weight_decay: 0.0,
        },
        30,
    );
}

#[test]
fn sgd_matches_tch_plain() {
    compare_sgd(
        SgdConfig {
            lr: 0.05,
            ..Default::default()
        },
        30,
    );
}

#[test]
fn sgd_matches_tch_with_momentum_dampening_and_weight_decay() {
    compare_sgd(
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 1e-3,
            nesterov: false,
        },
        30,
    );
}

#[test]
fn sgd_matches_tch_with_nesterov() {
    compare_sgd(
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 1e-2,
            nesterov: true,
        },
        30,
    );
}

#[test]
fn learning_rate_changes_match_tch() {
    let theirs = net(3);
    let ours = net(3);
    let mut reference = tch::nn::adamw(0.9, 0.999, 0.01)
        .build(&theirs.vs, 1e-2)
        .unwrap();
    let mut opt = AdamW::new(
        &ours.params(),
        AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        },
    )
    .unwrap();
    for step in 0..10 {
        let lr = 1e-2 * 0.8f64.powi(step as i32);
        reference.set_lr(lr);
        opt.set_lr(lr);
        reference.zero_grad();
        theirs.backward(step);
        reference.step();
        opt.zero_grad(true);
        ours.backward(step);
        opt.step();
        assert_bitwise(&ours.params(), &theirs.params(), &format!("step {step}"));
    }
    assert_eq!(opt.groups()[0].lr, 1e-2 * 0.8f64.powi(9));
}
