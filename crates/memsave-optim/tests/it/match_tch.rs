//! In f32 the optimizers match tch's own (libtorch's C++ optimizers) bit for bit.

use crate::common::{assert_bitwise, net};
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
#[serial_test::parallel]
fn adamw_matches_tch_for_100_steps_with_pytorch_defaults() {
    compare_adamw(AdamWConfig::default(), 100);
}

#[test]
#[serial_test::parallel]
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
#[serial_test::parallel]
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
#[serial_test::parallel]
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
#[serial_test::parallel]
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
#[serial_test::parallel]
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
        opt.set_lr(lr).unwrap();
        reference.zero_grad();
        theirs.backward(step);
        reference.step();
        opt.zero_grad(true);
        ours.backward(step);
        opt.step();
        assert_bitwise(&ours.params(), &theirs.params(), &format!("step {step}"));
    }
    // The last rate set, computed as it was (at run time: a release build folds a
    // constant `powi(9)` to a value one ulp away).
    assert_eq!(
        opt.groups()[0].lr,
        1e-2 * 0.8f64.powi(std::hint::black_box(9))
    );
}

/// The transformer example's model in small: token and position embeddings, pre-LN
/// blocks (attention and MLP), a final LayerNorm and a head.
struct TinyLm {
    vs: tch::nn::VarStore,
    forward: Box<dyn Fn(&tch::Tensor) -> tch::Tensor>,
}

const VOCAB: i64 = 16;
const WIDTH: i64 = 16;
const HEADS: i64 = 2;
const SEQ: i64 = 8;

fn tiny_lm() -> TinyLm {
    use tch::nn::{self, Module};
    use tch::{Device, Kind, Tensor};
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let embed = nn::embedding(&root / "embed", VOCAB, WIDTH, Default::default());
    let pos = root.randn("pos", &[SEQ, WIDTH], 0.0, 0.02);
    let mut blocks = Vec::new();
    for i in 0..2 {
        let p = &root / "block" / i;
        blocks.push((
            nn::layer_norm(&p / "ln1", vec![WIDTH], Default::default()),
            nn::linear(&p / "qkv", WIDTH, 3 * WIDTH, Default::default()),
            nn::linear(&p / "proj", WIDTH, WIDTH, Default::default()),
            nn::layer_norm(&p / "ln2", vec![WIDTH], Default::default()),
            nn::linear(&p / "up", WIDTH, 4 * WIDTH, Default::default()),
            nn::linear(&p / "down", 4 * WIDTH, WIDTH, Default::default()),
        ));
    }
    let norm = nn::layer_norm(&root / "norm", vec![WIDTH], Default::default());
    let head = nn::linear(&root / "head", WIDTH, VOCAB, Default::default());
    let forward = move |tokens: &Tensor| {
        let (b, t) = tokens.size2().unwrap();
        let inputs = tokens.narrow(1, 0, t - 1);
        let targets = tokens.narrow(1, 1, t - 1);
        let mut x = embed.forward(&inputs) + pos.narrow(0, 0, t - 1);
        for (ln1, qkv, proj, ln2, up, down) in &blocks {
            let qkv = qkv
                .forward(&ln1.forward(&x))
                .view([b, t - 1, 3, HEADS, WIDTH / HEADS])
                .permute([2, 0, 3, 1, 4]);
            let att = Tensor::scaled_dot_product_attention::<Tensor>(
                &qkv.get(0),
                &qkv.get(1),
                &qkv.get(2),
                None,
                0.0,
                true,
                None,
                false,
            );
            let att = att.transpose(1, 2).contiguous().view([b, t - 1, WIDTH]);
            x = &x + proj.forward(&att);
            x = &x + down.forward(&up.forward(&ln2.forward(&x)).gelu("none"));
        }
        head.forward(&norm.forward(&x))
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&targets.reshape([-1]))
            .to_kind(Kind::Float)
    };
    TinyLm {
        vs,
        forward: Box::new(forward),
    }
}

/// Batch `step`: counting sequences from starts that depend on the step alone.
fn tokens(step: i64) -> tch::Tensor {
    use tch::{Device, Kind, Tensor};
    let start = (Tensor::arange(4, (Kind::Int64, Device::Cpu)) * 5 + step * 3).view([4, 1]);
    (start + Tensor::arange(SEQ, (Kind::Int64, Device::Cpu))).remainder(VOCAB)
}

/// Trains two copies of the tiny LM 100 steps, one with tch's optimizer and one with
/// ours, and checks they agree within 1e-6 relative per parameter (in fact bitwise).
fn compare_on_tiny_lm(
    reference: impl FnOnce(&tch::nn::VarStore) -> tch::nn::Optimizer,
    ours_opt: impl FnOnce(&[tch::Tensor]) -> Box<dyn FnMut()>,
    zero_grad: impl Fn(&tch::nn::VarStore),
    what: &str,
) {
    let theirs = tiny_lm();
    let mut ours = tiny_lm();
    // The same starting weights (tests share the global generator, so seeding twice
    // would not give them).
    ours.vs.copy(&theirs.vs).unwrap();
    let mut reference = reference(&theirs.vs);
    let mut step_ours = ours_opt(&ours.vs.trainable_variables());
    for step in 0..100 {
        reference.zero_grad();
        (theirs.forward)(&tokens(step)).backward();
        reference.step();
        zero_grad(&ours.vs);
        (ours.forward)(&tokens(step)).backward();
        step_ours();
    }
    let mut theirs_vars = theirs.vs.variables().into_iter().collect::<Vec<_>>();
    let mut ours_vars = ours.vs.variables().into_iter().collect::<Vec<_>>();
    theirs_vars.sort_by(|a, b| a.0.cmp(&b.0));
    ours_vars.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(theirs_vars.len(), ours_vars.len());
    for ((name, t), (_, o)) in theirs_vars.iter().zip(&ours_vars) {
        let scale = t.abs().max().double_value(&[]).max(1e-12);
        let diff = (t - o).abs().max().double_value(&[]);
        assert!(
            diff / scale <= 1e-6,
            "{what}, {name}: relative difference {}",
            diff / scale
        );
    }
    assert_bitwise(
        &ours.vs.trainable_variables(),
        &theirs.vs.trainable_variables(),
        what,
    );
}

fn free_grads(vs: &tch::nn::VarStore) {
    for p in vs.trainable_variables() {
        memsave_sys::tensor::set_grad_none(&p).unwrap();
    }
}

#[test]
#[serial_test::parallel]
fn adamw_matches_tch_for_100_steps_on_the_transformer_example_model() {
    let config = AdamWConfig::default();
    compare_on_tiny_lm(
        |vs| {
            tch::nn::adamw(config.betas.0, config.betas.1, config.weight_decay)
                .build(vs, config.lr)
                .unwrap()
        },
        |params| {
            let mut opt = AdamW::new(params, config).unwrap();
            Box::new(move || opt.step())
        },
        free_grads,
        "transformer, AdamW after 100 steps",
    );
}

#[test]
#[serial_test::parallel]
fn sgd_matches_tch_for_100_steps_on_the_transformer_example_model() {
    let config = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-4,
        ..Default::default()
    };
    compare_on_tiny_lm(
        |vs| {
            tch::nn::Sgd {
                momentum: config.momentum,
                dampening: config.dampening,
                wd: config.weight_decay,
                nesterov: config.nesterov,
            }
            .build(vs, config.lr)
            .unwrap()
        },
        |params| {
            let mut opt = Sgd::new(params, config).unwrap();
            Box::new(move || opt.step())
        },
        free_grads,
        "transformer, SGD with Nesterov momentum after 100 steps",
    );
}

/// One warmed-up AdamW step of tch's `nn::AdamW` and of memsave's on the same
/// parameters and gradients, measured by the meter above what was allocated before it:
/// libtorch holds the square root of the second moment and its quotient by the bias
/// correction at once (two copies of the largest parameter, plus 12 bytes of numbers);
/// memsave holds one copy of the largest parameter (the denominator, written in place)
/// and its six 4-byte numbers, and passes `1 - beta2` and `-step_size` to addcmul_ and
/// addcdiv_ as libtorch does instead of as two more copies.
#[test]
#[serial_test::serial]
fn an_adamw_step_holds_no_more_than_tchs() {
    use memsave_meter::f_measure;
    use tch::{nn, Device, Kind, Tensor};
    memsave_meter::install();
    let largest = 40 * 25;
    let build = || {
        let vs = nn::VarStore::new(Device::Cpu);
        let _ = vs.root().zeros("w", &[40, 25]);
        let _ = vs.root().zeros("b", &[25]);
        for p in vs.trainable_variables() {
            (&p * Tensor::ones_like(&p)).sum(Kind::Float).backward();
        }
        vs
    };
    let theirs = build();
    let mut reference = nn::AdamW::default().build(&theirs, 1e-3).unwrap();
    reference.step();
    let (_, tch_step) = f_measure(Device::Cpu, |_| reference.step()).unwrap();
    let ours = build();
    let mut opt = AdamW::new(&ours.trainable_variables(), AdamWConfig::default()).unwrap();
    opt.step();
    let (_, our_step) = f_measure(Device::Cpu, |_| opt.step()).unwrap();
    assert_eq!(tch_step.peak_bytes, 2 * 4 * largest + 12);
    assert_eq!(our_step.peak_bytes, 4 * largest + 6 * 4);
    assert!(our_step.peak_bytes <= tch_step.peak_bytes);
    assert_bitwise(
        &ours.trainable_variables(),
        &theirs.trainable_variables(),
        "two steps",
    );
}
