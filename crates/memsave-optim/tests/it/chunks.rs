//! A parameter larger than one chunk (in f32 on the CPU an eighth of it, between 2^12
//! and 2^16 values) is updated a chunk at a time: the same bits as tch's own
//! optimizers, which update it whole, and scratch memory of one chunk, not of the
//! parameter.
use crate::common::assert_bitwise;
use memsave_meter::f_measure;
use memsave_optim::{AdamW, AdamWConfig, Optimizer, Rule, Sgd, SgdConfig};
use serial_test::serial;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Values of a parameter spanning eight chunks, the last one shorter (132,048).
const ROWS: i64 = 131;
const COLS: i64 = 1008;

/// A var store with one `[ROWS, COLS]` parameter of fixed values.
fn store() -> nn::VarStore {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut w = vs.root().zeros("w", &[ROWS, COLS]);
    let values = (Tensor::arange(ROWS * COLS, (Kind::Float, Device::Cpu)) * 0.013).sin();
    tch::no_grad(|| w.copy_(&values.view([ROWS, COLS])));
    vs
}

/// A loss whose gradient differs at every step and every value.
fn backward(vs: &nn::VarStore, step: i64) {
    let w = &vs.trainable_variables()[0];
    let x = (Tensor::arange(ROWS * COLS, (Kind::Float, Device::Cpu)) * 0.007 + step as f64)
        .cos()
        .view([ROWS, COLS]);
    (w * &x).sin().sum(Kind::Float).backward();
}

/// AdamW with weight decay, the configuration these tests step.
fn adamw_config() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.05,
        ..Default::default()
    }
}

/// SGD with Nesterov momentum and weight decay, the configuration these tests step.
fn sgd_config() -> SgdConfig {
    SgdConfig {
        lr: 1e-2,
        momentum: 0.9,
        weight_decay: 1e-3,
        nesterov: true,
        ..Default::default()
    }
}

/// tch's own AdamW of `c` on `vs`.
fn tch_adamw(c: &AdamWConfig, vs: &nn::VarStore) -> nn::Optimizer {
    nn::AdamW {
        beta1: c.betas.0,
        beta2: c.betas.1,
        wd: c.weight_decay,
        eps: c.eps,
        amsgrad: false,
    }
    .build(vs, c.lr)
    .unwrap()
}

/// tch's own SGD of `c` on `vs`.
fn tch_sgd(c: &SgdConfig, vs: &nn::VarStore) -> nn::Optimizer {
    nn::Sgd {
        momentum: c.momentum,
        dampening: c.dampening,
        wd: c.weight_decay,
        nesterov: c.nesterov,
    }
    .build(vs, c.lr)
    .unwrap()
}

/// Steps `opt` on `ours` and `reference` on `theirs` (the same values) four times
/// from the same gradients, checking the parameters bitwise after each step.
fn compare<R: Rule>(
    what: &str,
    opt: &mut Optimizer<R>,
    reference: &mut nn::Optimizer,
    (ours, theirs): (&nn::VarStore, &nn::VarStore),
    set_to_none: bool,
) {
    for step in 0..4 {
        reference.zero_grad();
        backward(theirs, step);
        reference.step();
        opt.zero_grad(set_to_none);
        backward(ours, step);
        opt.step();
        assert_bitwise(
            &ours.trainable_variables(),
            &theirs.trainable_variables(),
            &format!("{what}, step {step}"),
        );
    }
}

#[test]
#[serial_test::parallel]
fn a_parameter_of_several_chunks_matches_tch_bit_for_bit() {
    const { assert!(ROWS * COLS % 16_512 != 0 && ROWS * COLS > 7 * 16_512) };
    let config = adamw_config();
    let (theirs, ours) = (store(), store());
    let mut reference = tch_adamw(&config, &theirs);
    let mut opt = AdamW::new(&ours.trainable_variables(), config).unwrap();
    compare("AdamW", &mut opt, &mut reference, (&ours, &theirs), true);

    let config = sgd_config();
    let (theirs, ours) = (store(), store());
    let mut reference = tch_sgd(&config, &theirs);
    let mut opt = Sgd::new(&ours.trainable_variables(), config).unwrap();
    compare("SGD", &mut opt, &mut reference, (&ours, &theirs), false);
}

/// AdamW's one temporary, the denominator, is one chunk: an eighth of the parameter
/// (132,048 values) rounded up to 64 values, 16,512 f32 values or 66,048 bytes, next
/// to the parameter's 528,192, plus its 0-dim numbers.
#[test]
#[serial]
fn the_scratch_of_an_f32_step_is_one_chunk() {
    memsave_meter::install();
    let vs = store();
    let mut opt = AdamW::new(&vs.trainable_variables(), AdamWConfig::default()).unwrap();
    backward(&vs, 0);
    opt.step(); // the state exists from here on
    backward(&vs, 1);
    let (_, m) = f_measure(Device::Cpu, |_| opt.step()).unwrap();
    const CHUNK_BYTES: u64 = 16_512 * 4;
    assert!(
        m.peak_bytes >= CHUNK_BYTES && m.peak_bytes <= CHUNK_BYTES + 1024,
        "the step's peak above its start: {} bytes",
        m.peak_bytes
    );
}

/// A bf16 parameter with f32 state goes to f32 a chunk at a time through the scratch:
/// each step gives the bits of tch's own optimizer stepping the same values in f32,
/// whole, rounded to bf16 (its f32 copy is set to our parameter before each step, so
/// both start from the same values; the moments, f32 in both, see the same gradients),
/// with weight decay, Nesterov momentum and a non-contiguous gradient.
#[test]
#[serial_test::parallel]
fn a_bf16_parameter_of_several_chunks_matches_tch_in_f32() {
    use memsave_optim::{Options, State};
    let options = Options {
        state: State::F32,
        ..Default::default()
    };
    for rule in ["AdamW", "SGD"] {
        let reference_store = nn::VarStore::new(Device::Cpu);
        let mut reference = reference_store.root().zeros("w", &[ROWS, COLS]);
        let ours = store().trainable_variables()[0]
            .detach()
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let params = [ours.shallow_clone()];
        let (mut step_ours, mut step_reference): (Box<dyn FnMut()>, nn::Optimizer) = match rule {
            "AdamW" => {
                let c = adamw_config();
                let tch_opt = tch_adamw(&c, &reference_store);
                let mut opt = AdamW::with_options(&params, c, options.clone()).unwrap();
                (Box::new(move || opt.step()), tch_opt)
            }
            _ => {
                let c = sgd_config();
                let tch_opt = tch_sgd(&c, &reference_store);
                let mut opt = Sgd::with_options(&params, c, options.clone()).unwrap();
                (Box::new(move || opt.step()), tch_opt)
            }
        };
        for step in 0..3 {
            tch::no_grad(|| reference.copy_(&ours.to_kind(Kind::Float)));
            let before = ours.copy();
            let g = ((Tensor::arange(ROWS * COLS, (Kind::Float, Device::Cpu)) * 0.007
                + step as f64)
                .cos()
                * 3.0)
                .to_kind(Kind::BFloat16)
                .view([ROWS, COLS]);
            // Step 1's gradient is column-major: reshaped, a copy.
            let g = if step == 1 {
                g.transpose(0, 1).contiguous().transpose(0, 1)
            } else {
                g
            };
            for (p, g) in [
                (&ours, g.shallow_clone()),
                (&reference, g.to_kind(Kind::Float)),
            ] {
                memsave_sys::tensor::set_grad_none(p).unwrap();
                memsave_sys::tensor::set_grad(p, &g).unwrap();
            }
            step_ours();
            step_reference.step();
            let what = format!("{rule}, step {step}");
            assert!(!ours.equal(&before), "{what}: the parameter moved");
            assert_bitwise(
                &[ours.shallow_clone()],
                &[reference.to_kind(Kind::BFloat16)],
                &what,
            );
        }
    }
}
