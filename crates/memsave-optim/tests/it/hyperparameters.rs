//! Hyper-parameters are checked the same way however they are set (constructor,
//! `set_lr`, `set_group`, a loaded state), and every accepted value survives
//! save and load bit for bit (Trust II, finding 5).
use memsave_optim::{AdamW, AdamWConfig, OptimError, Sgd, SgdConfig};
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

fn param(n: i64) -> Tensor {
    Tensor::arange(n, (Kind::Float, Device::Cpu))
        .sin()
        .set_requires_grad(true)
}

/// Any f64: special values often, else any bit pattern.
fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        prop::sample::select(vec![
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            f64::MAX,
            f64::MIN_POSITIVE,
            5e-324,
            1e-3,
            -1e-3,
            0.999_999_999_999_999_9,
            1.0,
        ]),
        any::<u64>().prop_map(f64::from_bits),
        (0.0f64..1.0),
    ]
}

/// The learning rate of every group, as bits (NaN-safe comparison).
fn lrs_adamw(opt: &AdamW) -> Vec<u64> {
    opt.groups().iter().map(|g| g.lr.to_bits()).collect()
}

fn two_groups() -> AdamW {
    let a = param(3);
    let b = param(5);
    let mut opt = AdamW::new(&[a], AdamWConfig::default()).unwrap();
    opt.add_param_group(
        &[b],
        AdamWConfig {
            lr: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    opt
}

#[test]
#[serial_test::parallel]
fn set_lr_refuses_nan_negative_and_infinite_rates_and_changes_no_group() {
    for bad in [f64::NAN, -1e-3, -0.5, f64::INFINITY, f64::NEG_INFINITY] {
        let mut opt = two_groups();
        let before = lrs_adamw(&opt);
        let err = opt
            .set_lr(bad)
            .expect_err(&format!("set_lr({bad}) was accepted"));
        assert!(matches!(err, OptimError::Config(_)), "{err:?}");
        assert!(err.to_string().contains("lr"), "{err}");
        assert_eq!(lrs_adamw(&opt), before, "set_lr({bad}) changed a group");
        // The constructor says the same.
        let e2 = AdamW::new(
            &[param(2)],
            AdamWConfig {
                lr: bad,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(err.to_string(), e2.to_string());

        let mut sgd = Sgd::new(&[param(2)], SgdConfig::default()).unwrap();
        let err = sgd.set_lr(bad).unwrap_err();
        assert!(matches!(err, OptimError::Config(_)), "{err:?}");
        assert_eq!(sgd.groups()[0].lr, SgdConfig::default().lr);
    }
    let mut opt = two_groups();
    opt.set_lr(0.25).unwrap();
    assert_eq!(lrs_adamw(&opt), vec![0.25f64.to_bits(); 2]);
}

#[test]
#[serial_test::parallel]
fn set_group_validates_like_the_constructor_and_names_a_missing_group() {
    let mut opt = two_groups();
    let bad = AdamWConfig {
        eps: f64::INFINITY,
        ..Default::default()
    };
    let err = opt.set_group(1, bad).unwrap_err();
    let e2 = AdamW::new(&[param(2)], bad).unwrap_err();
    assert_eq!(err.to_string(), e2.to_string());
    assert_eq!(opt.groups()[1].eps, AdamWConfig::default().eps);
    let err = opt.set_group(2, AdamWConfig::default()).unwrap_err();
    assert!(err.to_string().contains("group 2"), "{err}");
    let good = AdamWConfig {
        lr: 0.125,
        weight_decay: 0.0,
        ..Default::default()
    };
    opt.set_group(1, good).unwrap();
    assert_eq!(opt.groups()[1], good);
    assert_eq!(opt.groups()[0], AdamWConfig::default());
}

/// Saves `opt` to a file and loads it into `fresh`; returns the load's result.
fn save_and_load<R: memsave_optim::Rule>(
    opt: &memsave_optim::Optimizer<R>,
    fresh: &mut memsave_optim::Optimizer<R>,
) -> Result<(), OptimError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.json");
    opt.save(&path)?;
    fresh.load(&path)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever the values, an AdamW configuration is either refused (by the
    /// constructor, `set_group` and `set_lr` alike) or saved and loaded back bit for bit.
    #[test]
    #[serial_test::parallel]
    fn adamw_hyper_parameters_are_refused_or_round_trip_exactly(
        lr in any_f64(), b1 in any_f64(), b2 in any_f64(), eps in any_f64(), wd in any_f64(),
    ) {
        let config = AdamWConfig { lr, betas: (b1, b2), eps, weight_decay: wd };
        let built = AdamW::new(&[param(4)], config);
        let mut other = AdamW::new(&[param(4)], AdamWConfig::default()).unwrap();
        let set = other.set_group(0, config);
        prop_assert_eq!(built.is_ok(), set.is_ok());
        if let (Err(a), Err(b)) = (&built, &set) {
            prop_assert_eq!(a.to_string(), b.to_string());
        }
        let mut lr_only = AdamW::new(&[param(4)], AdamWConfig::default()).unwrap();
        let lr_ok = AdamW::new(&[param(4)], AdamWConfig { lr, ..Default::default() }).is_ok();
        prop_assert_eq!(lr_only.set_lr(lr).is_ok(), lr_ok);
        if !lr_ok {
            prop_assert_eq!(lr_only.groups()[0], AdamWConfig::default());
        }
        if let Ok(opt) = built {
            let mut fresh = AdamW::new(&[param(4)], AdamWConfig::default()).unwrap();
            save_and_load(&opt, &mut fresh).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let (a, b) = (opt.groups()[0], fresh.groups()[0]);
            prop_assert_eq!(a.lr.to_bits(), b.lr.to_bits());
            prop_assert_eq!(a.betas.0.to_bits(), b.betas.0.to_bits());
            prop_assert_eq!(a.betas.1.to_bits(), b.betas.1.to_bits());
            prop_assert_eq!(a.eps.to_bits(), b.eps.to_bits());
            prop_assert_eq!(a.weight_decay.to_bits(), b.weight_decay.to_bits());
        }
    }

    /// The same for SGD.
    #[test]
    #[serial_test::parallel]
    fn sgd_hyper_parameters_are_refused_or_round_trip_exactly(
        lr in any_f64(), momentum in any_f64(), dampening in any_f64(), wd in any_f64(),
        nesterov in any::<bool>(),
    ) {
        let config = SgdConfig { lr, momentum, dampening, weight_decay: wd, nesterov };
        let built = Sgd::new(&[param(4)], config);
        let mut other = Sgd::new(&[param(4)], SgdConfig::default()).unwrap();
        let set = other.set_group(0, config);
        prop_assert_eq!(built.is_ok(), set.is_ok());
        if let (Err(a), Err(b)) = (&built, &set) {
            prop_assert_eq!(a.to_string(), b.to_string());
        }
        let mut lr_only = Sgd::new(&[param(4)], SgdConfig::default()).unwrap();
        let lr_ok = Sgd::new(&[param(4)], SgdConfig { lr, ..Default::default() }).is_ok();
        prop_assert_eq!(lr_only.set_lr(lr).is_ok(), lr_ok);
        if let Ok(opt) = built {
            // A momentum buffer makes the saved state carry buffers too.
            let mut fresh = Sgd::new(&[param(4)], SgdConfig::default()).unwrap();
            save_and_load(&opt, &mut fresh).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let (a, b) = (opt.groups()[0], fresh.groups()[0]);
            prop_assert_eq!(a.lr.to_bits(), b.lr.to_bits());
            prop_assert_eq!(a.momentum.to_bits(), b.momentum.to_bits());
            prop_assert_eq!(a.dampening.to_bits(), b.dampening.to_bits());
            prop_assert_eq!(a.weight_decay.to_bits(), b.weight_decay.to_bits());
            prop_assert_eq!(a.nesterov, b.nesterov);
        }
    }
}
