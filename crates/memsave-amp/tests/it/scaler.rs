//! `GradScaler` against `torch.amp.GradScaler`'s documented rules. The expected scales,
//! trackers and parameters are derived by hand in each test. Every test allocates
//! tensors, so they run serially (the meter's counter and libtorch's thread pool are
//! shared).
use memsave_amp::{
    f_clip_grad_norm_, AmpError, GradScaler, GradScalerConfig, GradScalerState, StepOutcome,
};
use serial_test::serial;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

/// One f32 parameter `p` of length `n`, initialised to zero, and plain SGD on it.
fn one_param(n: i64, lr: f64) -> (nn::VarStore, Tensor, nn::Optimizer) {
    let vs = nn::VarStore::new(CPU);
    let p = vs.root().zeros("p", &[n]);
    let opt = nn::Sgd::default().build(&vs, lr).unwrap();
    (vs, p, opt)
}

fn bits(t: &Tensor) -> Vec<u32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float))
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// `sum(p * g)`: its gradient with respect to `p` is exactly `g`.
fn loss_with_grad(p: &Tensor, g: &[f32]) -> Tensor {
    (p * Tensor::from_slice(g)).sum(Kind::Float)
}

fn free_grad(p: &Tensor) {
    memsave_sys::tensor::set_grad_none(p).unwrap();
}

#[test]
#[serial]
fn defaults_are_pytorchs() {
    let c = GradScalerConfig::default();
    assert_eq!(
        (
            c.init_scale,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval,
            c.enabled
        ),
        (65536.0, 2.0, 0.5, 2000, true)
    );
    let scaler = GradScaler::default();
    assert_eq!(scaler.get_scale(), 65536.0);
    assert_eq!(scaler.f_get_growth_tracker().unwrap(), 0);
}

#[test]
#[serial]
fn scripted_infs_give_pytorchs_scale_trajectory_and_skip_pattern() {
    let config = GradScalerConfig {
        init_scale: 8.0,
        growth_interval: 3,
        ..Default::default()
    };
    let mut scaler = GradScaler::new(config).unwrap();
    let lr = 0.5;
    let (_vs, p, mut opt) = one_param(2, lr);
    let finite = [1.0f32, -2.0];
    let script: [&[f32]; 12] = [
        &finite,
        &finite,
        &[f32::INFINITY, 1.0],
        &finite,
        &finite,
        &finite,
        &[1.0, f32::NEG_INFINITY],
        &[f32::NAN, 1.0],
        &finite,
        &finite,
        &finite,
        &finite,
    ];
    // By hand, with init 8, growth x2 every 3 finite steps, backoff x0.5 on inf/NaN:
    // t0 ok (tracker 1), t1 ok (2), t2 inf -> 4 (0), t3 ok (1), t4 ok (2),
    // t5 ok (3 = interval) -> 8 (0), t6 inf -> 4 (0), t7 NaN -> 2 (0), t8 ok (1),
    // t9 ok (2), t10 ok -> 4 (0), t11 ok (1).
    let expected_scale = [8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0];
    let expected_tracker = [1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 0, 1];
    let expected_skipped = [2usize, 6, 7];

    let mut steps_taken = 0i32;
    for (t, g) in script.iter().enumerate() {
        free_grad(&p);
        let scale_before = scaler.get_scale();
        let before = bits(&p);
        scaler.f_scale(&loss_with_grad(&p, g)).unwrap().backward();
        let outcome = scaler.f_step(&mut opt).unwrap();
        scaler.f_update().unwrap();
        assert_eq!(
            outcome.is_skipped(),
            expected_skipped.contains(&t),
            "step {t}"
        );
        if outcome == StepOutcome::SkippedNonFinite {
            assert_eq!(bits(&p), before, "a skipped step changed p at step {t}");
        } else {
            steps_taken += 1;
            // The scale is a power of two, so unscaling is exact and p moves by lr * g.
            let expected: Vec<f32> = finite
                .iter()
                .map(|g| -(lr as f32) * g * steps_taken as f32)
                .collect();
            assert_eq!(Vec::<f32>::try_from(&p).unwrap(), expected, "step {t}");
            // The gradient the optimizer saw is the true one, not the scaled one.
            assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), finite.to_vec());
        }
        assert_eq!(
            scale_before,
            if t == 0 { 8.0 } else { expected_scale[t - 1] }
        );
        assert_eq!(
            scaler.get_scale(),
            expected_scale[t],
            "scale after step {t}"
        );
        assert_eq!(
            scaler.f_get_growth_tracker().unwrap(),
            expected_tracker[t],
            "tracker after step {t}"
        );
    }
}

#[test]
#[serial]
fn default_scale_doubles_after_2000_finite_steps_and_halves_on_inf() {
    let mut scaler = GradScaler::default();
    let (_vs, p, mut opt) = one_param(1, 0.0);
    let mut run = |scaler: &mut GradScaler, g: f32| {
        free_grad(&p);
        scaler.scale(&loss_with_grad(&p, &[g])).backward();
        let outcome = scaler.step(&mut opt);
        scaler.update();
        outcome
    };
    for _ in 0..1999 {
        assert_eq!(run(&mut scaler, 1.0), StepOutcome::Stepped);
    }
    assert_eq!(scaler.get_scale(), 65536.0);
    assert_eq!(scaler.f_get_growth_tracker().unwrap(), 1999);
    run(&mut scaler, 1.0);
    assert_eq!(scaler.get_scale(), 131072.0);
    assert_eq!(scaler.f_get_growth_tracker().unwrap(), 0);
    assert_eq!(
        run(&mut scaler, f32::INFINITY),
        StepOutcome::SkippedNonFinite
    );
    assert_eq!(scaler.get_scale(), 65536.0);
}

#[test]
#[serial]
fn growth_that_would_overflow_f32_keeps_the_scale() {
    let config = GradScalerConfig {
        init_scale: 2f64.powi(127),
        growth_interval: 1,
        ..Default::default()
    };
    let mut scaler = GradScaler::new(config).unwrap();
    let (_vs, p, mut opt) = one_param(1, 0.0);
    scaler.scale(&loss_with_grad(&p, &[0.0])).backward();
    assert_eq!(scaler.step(&mut opt), StepOutcome::Stepped);
    scaler.update();
    // 2^128 is not a finite f32: the scale stays, the tracker resets.
    assert_eq!(scaler.get_scale(), 2f64.powi(127));
    assert_eq!(scaler.f_get_growth_tracker().unwrap(), 0);
}

#[test]
#[serial]
fn clipping_after_unscale_sees_true_gradients_and_step_does_not_unscale_again() {
    let mut scaler = GradScaler::default();
    let (vs, p, mut opt) = one_param(2, 1.0);
    scaler.scale(&loss_with_grad(&p, &[3.0, 4.0])).backward();
    assert_eq!(
        Vec::<f32>::try_from(p.grad()).unwrap(),
        vec![3.0 * 65536.0, 4.0 * 65536.0]
    );
    scaler.f_unscale_(&opt).unwrap();
    assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), vec![3.0, 4.0]);
    let norm = f_clip_grad_norm_(&vs.trainable_variables(), 1.0).unwrap();
    assert!((norm - 5.0).abs() < 1e-9, "{norm}");
    assert_eq!(scaler.f_step(&mut opt).unwrap(), StepOutcome::Stepped);
    scaler.f_update().unwrap();
    let moved = Vec::<f32>::try_from(&p).unwrap();
    for (m, e) in moved.iter().zip([-0.6f32, -0.8]) {
        assert!((m - e).abs() < 1e-6, "{moved:?}");
    }

    // tch's own clip works the same way between unscale_ and step.
    free_grad(&p);
    scaler.scale(&loss_with_grad(&p, &[0.0, 30.0])).backward();
    scaler.unscale_(&opt);
    opt.clip_grad_norm(3.0);
    let clipped = Vec::<f32>::try_from(p.grad()).unwrap();
    assert!((clipped[1] - 3.0).abs() < 1e-5, "{clipped:?}");
    assert_eq!(scaler.step(&mut opt), StepOutcome::Stepped);
}

#[test]
#[serial]
fn misuse_is_reported_with_pytorchs_rules() {
    let mut scaler = GradScaler::default();
    let (vs, p, mut opt) = one_param(2, 0.1);
    assert!(matches!(
        scaler.f_unscale_(&opt),
        Err(AmpError::NotScaled { op: "unscale_" })
    ));
    assert!(matches!(
        scaler.f_update(),
        Err(AmpError::NotScaled { op: "update" })
    ));

    scaler.scale(&loss_with_grad(&p, &[1.0, 1.0])).backward();
    scaler.unscale_(&opt);
    let err = scaler.f_unscale_(&opt).unwrap_err();
    assert!(matches!(err, AmpError::AlreadyUnscaled), "{err}");
    assert!(err.to_string().contains("since the last update()"));
    // The same parameters passed as a list are the same optimizer.
    assert!(matches!(
        scaler.f_unscale_params_(&vs.trainable_variables()),
        Err(AmpError::AlreadyUnscaled)
    ));
    scaler.step(&mut opt);
    assert!(matches!(
        scaler.f_step(&mut opt),
        Err(AmpError::AlreadyStepped)
    ));
    assert!(matches!(
        scaler.f_unscale_(&opt),
        Err(AmpError::UnscaleAfterStep)
    ));
    scaler.update();
    assert!(matches!(scaler.f_update(), Err(AmpError::NoInfChecks)));

    free_grad(&p);
    assert!(matches!(
        scaler.f_step(&mut opt),
        Err(AmpError::NoGradients)
    ));
    // Nothing was unscaled: after a backward the same iteration can still step.
    scaler.scale(&loss_with_grad(&p, &[1.0, 1.0])).backward();
    assert_eq!(scaler.step(&mut opt), StepOutcome::Stepped);

    let half = nn::VarStore::new(CPU);
    let q = half.root().zeros("q", &[2]).to_kind(Kind::Half).detach();
    let q = q.set_requires_grad(true);
    let mut scaler = GradScaler::default();
    scaler
        .scale(&q.to_kind(Kind::Float).sum(Kind::Float))
        .backward();
    assert!(matches!(
        scaler.f_unscale_params_(&[q]),
        Err(AmpError::Fp16Gradients)
    ));

    for bad in [
        GradScalerConfig {
            growth_factor: 1.0,
            ..Default::default()
        },
        GradScalerConfig {
            backoff_factor: 1.0,
            ..Default::default()
        },
        GradScalerConfig {
            growth_interval: 0,
            ..Default::default()
        },
        GradScalerConfig {
            init_scale: f64::NAN,
            ..Default::default()
        },
    ] {
        let err = GradScaler::new(bad).unwrap_err();
        assert!(matches!(err, AmpError::InvalidConfig(_)), "{err}");
    }
}

#[test]
#[serial]
fn a_disabled_scaler_passes_through() {
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: false,
        ..Default::default()
    })
    .unwrap();
    let (_vs, p, mut opt) = one_param(1, 1.0);
    let loss = loss_with_grad(&p, &[f32::INFINITY]);
    let scaled = scaler.scale(&loss);
    assert_eq!(scaled.data_ptr(), loss.data_ptr());
    scaled.backward();
    scaler.unscale_(&opt);
    scaler.unscale_(&opt);
    assert_eq!(scaler.step(&mut opt), StepOutcome::Stepped);
    scaler.update();
    assert_eq!(scaler.get_scale(), 1.0);
    assert_eq!(scaler.state_dict().unwrap(), None);
}

#[test]
#[serial]
fn state_round_trips_through_json_with_pytorchs_keys() {
    let config = GradScalerConfig {
        init_scale: 1024.0,
        growth_interval: 5,
        ..Default::default()
    };
    let mut scaler = GradScaler::new(config).unwrap();
    let (_vs, p, mut opt) = one_param(1, 0.0);
    for g in [1.0, 1.0, f32::INFINITY, 1.0, 1.0] {
        free_grad(&p);
        scaler.scale(&loss_with_grad(&p, &[g])).backward();
        scaler.step(&mut opt);
        scaler.update();
    }
    // 1024, inf at the third step -> 512, then two finite steps: tracker 2.
    let state = scaler.state_dict().unwrap().unwrap();
    assert_eq!(
        state,
        GradScalerState {
            scale: 512.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 5,
            growth_tracker: 2,
        }
    );
    let json = serde_json::to_value(state).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                           "growth_interval": 5, "_growth_tracker": 2})
    );

    let loaded: GradScalerState = serde_json::from_value(json).unwrap();
    let mut restored = GradScaler::default();
    restored.load_state_dict(Some(&loaded)).unwrap();
    assert_eq!(restored.get_scale(), 512.0);
    assert_eq!(restored.f_get_growth_tracker().unwrap(), 2);
    // Three more finite steps reach the interval of 5: the scale doubles.
    for _ in 0..3 {
        free_grad(&p);
        restored.scale(&loss_with_grad(&p, &[1.0])).backward();
        restored.step(&mut opt);
        restored.update();
    }
    assert_eq!(restored.get_scale(), 1024.0);
    assert_eq!(restored.f_get_growth_tracker().unwrap(), 0);

    assert!(matches!(
        restored.load_state_dict(None),
        Err(AmpError::EmptyState)
    ));
}
