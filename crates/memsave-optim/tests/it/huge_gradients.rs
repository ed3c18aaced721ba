//! One huge or infinite gradient entry in 8-bit blockwise state: the rest of its block
//! must stay finite and step as with f32 state (Trust II, finding 2).
//!
//! With f32 state, a gradient of 1e22 overflows the second moment of its own entry to
//! inf (`1e-3 * 1e22 * 1e22 > f32::MAX`), so that entry's update is `m / inf = 0`, and
//! every other entry steps as usual. The 8-bit code divides a block by its largest
//! magnitude; an infinite one used to make the whole block decode as `0 * inf = NaN`.
use memsave_optim::{AdamW, AdamWConfig, Options, Sgd, SgdConfig, State};
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

const LR: f64 = 1e-3;

/// A parameter of `n` values from `seed` (in [-1, 1]).
fn param(n: i64, seed: u64) -> Tensor {
    let idx = Tensor::arange(n, (Kind::Float, Device::Cpu));
    (idx * 0.61 + seed as f64 * 0.37)
        .sin()
        .set_requires_grad(true)
}

/// A gradient of `n` values for `step` (magnitudes from about 1e-3 to 1).
fn grad(n: i64, seed: u64, step: u64) -> Tensor {
    let idx = Tensor::arange(n, (Kind::Float, Device::Cpu));
    let s = (&idx * 0.83 + (seed + step * 7) as f64 * 0.11).sin();
    let m = (idx * 0.29 + step as f64).cos().abs() + 1e-3;
    s * m
}

/// Gives `p` the gradient `g` through backward (so the optimizer sees a real `.grad`).
fn set_grad(p: &Tensor, g: &Tensor) {
    memsave_sys::tensor::set_grad_none(p).unwrap();
    (p * g).sum(Kind::Float).backward();
}

/// Which rule a run uses.
#[derive(Clone, Copy, Debug)]
enum Rule {
    AdamW,
    SgdMomentum,
}

/// Runs `steps` steps on a parameter of `n` values with state `state`; at step
/// `huge_at` the gradient of entry `k` is `huge`. Returns the parameter and the state
/// tensors after the last step.
#[allow(clippy::too_many_arguments)]
fn run(
    rule: Rule,
    state: State,
    n: i64,
    seed: u64,
    k: i64,
    huge: f64,
    huge_at: u64,
    steps: u64,
) -> (Vec<f32>, Vec<Tensor>) {
    let p = param(n, seed);
    let options = Options {
        state,
        ..Default::default()
    };
    let params = [p.shallow_clone()];
    enum Opt {
        A(AdamW),
        S(Sgd),
    }
    let mut opt = match rule {
        Rule::AdamW => Opt::A(
            AdamW::with_options(
                &params,
                AdamWConfig {
                    lr: LR,
                    ..Default::default()
                },
                options,
            )
            .unwrap(),
        ),
        Rule::SgdMomentum => Opt::S(
            Sgd::with_options(
                &params,
                SgdConfig {
                    lr: LR,
                    momentum: 0.9,
                    ..Default::default()
                },
                options,
            )
            .unwrap(),
        ),
    };
    for step in 1..=steps {
        let g = grad(n, seed, step);
        if step == huge_at {
            let _ = g.get(k).fill_(huge);
        }
        set_grad(&p, &g);
        match &mut opt {
            Opt::A(o) => o.f_step().unwrap(),
            Opt::S(o) => o.f_step().unwrap(),
        }
    }
    let tensors = match &opt {
        Opt::A(o) => o.state_tensors(),
        Opt::S(o) => o.state_tensors(),
    };
    (Vec::<f32>::try_from(&p.detach()).unwrap(), tensors)
}

/// How far one step of `rule` can move a parameter at most, as a multiple of the
/// learning rate, in the first few steps, for either state precision.
///
/// AdamW: `|m_hat| / sqrt(v_hat)` is at most about 2 in the first four steps with the
/// default betas (it is 1 at the first); an 8-bit moment is within 6% of its value,
/// or 0. SGD with momentum 0.9 and gradients of at most 1: the buffer is below 10.
/// The weight decay moves both runs alike.
fn max_step_in_lrs(rule: Rule) -> f64 {
    match rule {
        Rule::AdamW => 2.5,
        Rule::SgdMomentum => 10.0,
    }
}

/// Checks every entry but `k`: finite, and within `steps` maximal steps of each run
/// of the f32 run; and every 8-bit block scale finite.
#[allow(clippy::too_many_arguments)]
fn check(
    rule: Rule,
    n: i64,
    block: usize,
    seed: u64,
    k: i64,
    huge: f64,
    huge_at: u64,
    steps: u64,
) -> Result<f64, TestCaseError> {
    let (p32, _) = run(rule, State::F32, n, seed, k, huge, huge_at, steps);
    let (p8, tensors) = run(
        rule,
        State::Int8Blockwise { block },
        n,
        seed,
        k,
        huge,
        huge_at,
        steps,
    );
    for t in tensors.iter().filter(|t| t.kind() == Kind::Float) {
        let scales = Vec::<f32>::try_from(t).unwrap();
        prop_assert!(
            scales.iter().all(|s| s.is_finite()),
            "{rule:?} n={n} block={block}: a block scale is not finite: {scales:?}"
        );
    }
    let tol = 2.0 * max_step_in_lrs(rule) * LR * steps as f64;
    let mut worst = 0f64;
    for i in 0..n as usize {
        if i as i64 == k {
            continue;
        }
        prop_assert!(
            p8[i].is_finite(),
            "{rule:?} n={n} block={block} huge={huge:e} at {k}: entry {i} is {} with 8-bit state ({} with f32 state)",
            p8[i],
            p32[i]
        );
        let d = (f64::from(p8[i]) - f64::from(p32[i])).abs();
        worst = worst.max(d);
        prop_assert!(
            d <= tol,
            "{rule:?} n={n} block={block} huge={huge:e} at {k}: entry {i} is {} with 8-bit state, {} with f32 state",
            p8[i],
            p32[i]
        );
    }
    Ok(worst)
}

#[test]
#[serial_test::parallel]
fn a_gradient_of_1e22_leaves_the_rest_of_its_block_finite_for_several_sizes() {
    for rule in [Rule::AdamW, Rule::SgdMomentum] {
        for (n, block, k) in [
            (64, 64, 0),
            (64, 64, 63),
            (130, 64, 70),
            (1000, 64, 999),
            (1000, 256, 300),
            (77, 7, 15),
        ] {
            let worst = check(rule, n, block, 3, k, 1e22, 1, 4).unwrap();
            eprintln!("{rule:?} n={n} block={block} k={k}: max |8-bit - f32| over the other entries {worst:e}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    #[serial_test::parallel]
    fn one_huge_or_infinite_gradient_leaves_every_other_entry_finite_and_near_the_f32_run(
        n in 1i64..600,
        block in prop::sample::select(vec![1usize, 7, 64, 100, 256]),
        seed in 0u64..1000,
        k_frac in 0.0f64..1.0,
        exponent in 20.0f64..38.5,
        negative in any::<bool>(),
        infinite in prop::bool::weighted(0.25),
        huge_at in 1u64..3,
        sgd in any::<bool>(),
    ) {
        let k = ((n as f64 * k_frac) as i64).min(n - 1);
        let magnitude = if infinite {
            f64::INFINITY
        } else {
            10f64.powf(exponent).min(f64::from(f32::MAX))
        };
        let huge = if negative { -magnitude } else { magnitude };
        let rule = if sgd { Rule::SgdMomentum } else { Rule::AdamW };
        check(rule, n, block, seed, k, huge, huge_at, 4)?;
    }
}
