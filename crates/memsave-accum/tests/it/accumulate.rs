//! Accumulated gradients against full-batch gradients, activation bytes against the
//! exact formula, and the scaler's skip. Everything allocates, so every test is serial
//! (the meter's counter is process-wide).
use memsave_accum::{
    f_split, free_grads, AccumConfig, AccumError, GradAccumulator, MicroBatch, Split,
};
use memsave_amp::{GradScaler, StepOutcome};
use proptest::prelude::*;
use serial_test::serial;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

const CPU: Device = Device::Cpu;

/// The seed network: `x = x + Linear(H, H)(x)`, `layers` times.
struct Seed {
    vs: nn::VarStore,
    layers: Vec<nn::Linear>,
}

impl Seed {
    fn new(layers: i64, h: i64, kind: Kind) -> Self {
        tch::manual_seed(7);
        let mut vs = nn::VarStore::new(CPU);
        let layers = (0..layers)
            .map(|i| nn::linear(vs.root() / i, h, h, Default::default()))
            .collect();
        vs.set_kind(kind);
        Self { vs, layers }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut y = x.shallow_clone();
        for layer in &self.layers {
            y = &y + layer.forward(&y);
        }
        y
    }

    fn params(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    fn grads(&self) -> Vec<Tensor> {
        self.params().iter().map(|p| p.grad().copy()).collect()
    }
}

fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor, tch::TchError> {
    pred.f_mse_loss(target, Reduction::Mean)
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    #[serial]
    fn accumulated_gradients_equal_full_batch_gradients(
        batch in 1i64..24,
        count in 1usize..24,
        max_size in 1i64..30,
        by_count in any::<bool>(),
    ) {
        let split = if by_count { Split::Count(count.min(batch as usize)) } else { Split::MaxSize(max_size) };
        let (s, h) = (3, 4);
        let model = Seed::new(3, h, Kind::Double);
        let x = Tensor::randn([batch, s, h], (Kind::Double, CPU));
        let y = Tensor::randn([batch, s, h], (Kind::Double, CPU));

        mse(&model.forward(&x), &y).unwrap().backward();
        let full = model.grads();
        free_grads(&model.params()).unwrap();

        let acc = GradAccumulator::with_split(split);
        let steps = acc
            .f_accumulate(&model.params(), None, batch, |mb: &MicroBatch| {
                mse(&model.forward(&mb.narrow(&x)), &mb.narrow(&y))
            })
            .unwrap();
        prop_assert_eq!(steps.len(), f_split(batch, split).unwrap().len());
        for (a, f) in model.grads().iter().zip(&full) {
            let err = max_abs(&(a - f));
            prop_assert!(err <= 1e-6 * max_abs(f), "{:?}: error {} vs {}", split, err, max_abs(f));
        }
    }

    #[test]
    #[serial_test::parallel]
    fn splits_cover_the_batch_with_weights_summing_to_one(
        batch in 1i64..200,
        count in 1usize..50,
        max_size in 1i64..70,
    ) {
        let count = count.min(batch as usize);
        let by_count = f_split(batch, Split::Count(count)).unwrap();
        prop_assert_eq!(by_count.len(), count);
        let (lo, hi) = (batch / count as i64, (batch + count as i64 - 1) / count as i64);
        prop_assert!(by_count.iter().all(|m| m.len == lo || m.len == hi));
        let by_size = f_split(batch, Split::MaxSize(max_size)).unwrap();
        prop_assert_eq!(by_size.len() as i64, (batch + max_size - 1) / max_size);
        let last = by_size.len() - 1;
        prop_assert!(by_size[..last].iter().all(|m| m.len == max_size));
        prop_assert_eq!(by_size[last].len, batch - max_size * last as i64);
        for plan in [by_count, by_size] {
            let mut next = 0;
            for m in &plan {
                prop_assert_eq!(m.start, next);
                prop_assert!(m.len >= 1);
                prop_assert_eq!(m.weight, m.len as f64 / batch as f64);
                next = m.end();
            }
            prop_assert_eq!(next, batch);
            let total: f64 = plan.iter().map(|m| m.weight).sum();
            prop_assert!((total - 1.0).abs() < 1e-12);
        }
    }
}

#[test]
#[serial]
fn peak_activation_bytes_shrink_with_the_largest_micro_batch() {
    let (b, s, h, l) = (12i64, 5, 16, 4);
    let model = Seed::new(l, h, Kind::Float);
    let x = Tensor::randn([b, s, h], (Kind::Float, CPU));
    let mut opt = nn::Sgd::default().build(&model.vs, 0.0).unwrap();
    let ns = [1usize, 2, 3, 4, 5, 12];
    let mut activations = Vec::new();
    let mut peaks = Vec::new();
    for n in ns {
        let acc = GradAccumulator::with_split(Split::Count(n));
        let step = acc
            .f_step(&mut opt, b, |mb| {
                Ok::<_, tch::TchError>(model.forward(&mb.narrow(&x)).mean(Kind::Float))
            })
            .unwrap();
        // A micro-batch of m samples keeps L-1 new f32 tensors of m*S*H values (the
        // inputs of layers 1..L-1, saved for backward; layer 0's input is a view of
        // the batch, and the output dies once its mean is taken) plus the 4-byte loss.
        for ms in &step.micro_steps {
            assert_eq!(
                ms.retained_after_forward_bytes as i64,
                (l - 1) * ms.micro_batch.len * s * h * 4 + 4
            );
        }
        // So the activation peak is set by the largest micro-batch, ceil(B/N) samples:
        // activation(N) = (L-1)*S*H*4*ceil(B/N) + 4.
        let activation = step
            .micro_steps
            .iter()
            .map(|m| m.retained_after_forward_bytes)
            .max()
            .unwrap() as i64;
        let largest = (b + n as i64 - 1) / n as i64;
        assert_eq!(activation, (l - 1) * s * h * 4 * largest + 4, "N = {n}");
        activations.push(activation);
        peaks.push(step.micro_steps.iter().map(|m| m.peak_bytes).max().unwrap());
    }
    // Hence exactly 1/N of the full batch's, up to the loss scalar, when N divides B.
    for (n, activation) in ns.iter().zip(&activations) {
        if b % *n as i64 == 0 {
            assert_eq!((activation - 4) * *n as i64, activations[0] - 4, "N = {n}");
        }
    }
    // The whole micro-step's peak (activations, backward temporaries, gradients) falls too.
    assert!(peaks.windows(2).all(|w| w[1] <= w[0]), "{peaks:?}");
}

#[test]
#[serial]
fn gradients_are_freed_after_every_step() {
    let model = Seed::new(2, 4, Kind::Float);
    let x = Tensor::randn([6, 2, 4], (Kind::Float, CPU));
    let mut opt = nn::Sgd::default().build(&model.vs, 0.1).unwrap();
    // Stale gradients from before the call do not leak into the step.
    model.forward(&x).sum(Kind::Float).backward();
    let full_loss = tch::no_grad(|| model.forward(&x).square().mean(Kind::Float)).double_value(&[]);
    let acc = GradAccumulator::with_split(Split::Count(4));
    let step = acc
        .f_step(&mut opt, 6, |mb| {
            Ok::<_, tch::TchError>(model.forward(&mb.narrow(&x)).square().mean(Kind::Float))
        })
        .unwrap();
    assert_eq!(step.outcome, StepOutcome::Stepped);
    // The weighted micro-losses (2, 2, 1, 1 samples) add up to the full-batch mean.
    assert!(
        (step.loss - full_loss).abs() <= 1e-6 * full_loss.abs(),
        "{} vs {full_loss}",
        step.loss
    );
    assert!(model.params().iter().all(|p| !p.grad().defined()));
}

#[test]
#[serial]
fn scaled_accumulation_steps_like_unscaled_and_an_inf_skips_the_whole_step() {
    let (b, s, h) = (10i64, 2, 4);
    let x = Tensor::randn([b, s, h], (Kind::Double, CPU));
    let y = Tensor::randn([b, s, h], (Kind::Double, CPU));
    let loss_of = |model: &Seed, x: &Tensor, mb: &MicroBatch| {
        mse(&model.forward(&mb.narrow(x)), &mb.narrow(&y))
    };
    let acc = GradAccumulator::with_split(Split::MaxSize(4));

    let plain = Seed::new(2, h, Kind::Double);
    let mut opt = nn::Sgd::default().build(&plain.vs, 0.1).unwrap();
    acc.f_step(&mut opt, b, |mb| loss_of(&plain, &x, mb))
        .unwrap();

    let scaled = Seed::new(2, h, Kind::Double);
    let mut opt = nn::Sgd::default().build(&scaled.vs, 0.1).unwrap();
    let mut scaler = GradScaler::default();
    let step = acc
        .f_step_scaled(&mut opt, &mut scaler, b, |mb| loss_of(&scaled, &x, mb))
        .unwrap();
    assert_eq!(step.outcome, StepOutcome::Stepped);
    // Scaling by 2^16 and unscaling by 2^-16 are exact: the same parameters, bit for bit.
    for (p, q) in plain.params().iter().zip(scaled.params()) {
        assert!(p.equal(&q));
    }

    // One inf sample, in the second micro-batch (samples 4..8).
    let poisoned = x.copy();
    let _ = poisoned.get(5).get(0).get(0).fill_(f64::INFINITY);
    let before: Vec<Tensor> = scaled.params().iter().map(Tensor::copy).collect();
    let step = acc
        .f_step_scaled(&mut opt, &mut scaler, b, |mb| {
            loss_of(&scaled, &poisoned, mb)
        })
        .unwrap();
    assert_eq!(step.outcome, StepOutcome::SkippedNonFinite);
    assert!(step.micro_steps[0].loss.is_finite() && !step.micro_steps[1].loss.is_finite());
    for (p, q) in before.iter().zip(scaled.params()) {
        assert!(p.equal(&q), "a skipped step changed a parameter");
    }
    assert!(scaled.params().iter().all(|p| !p.grad().defined()));
    assert_eq!(scaler.get_scale(), 32768.0, "one backoff");
}

#[test]
#[serial]
fn clipping_applies_to_the_unscaled_accumulated_gradient() {
    let vs = nn::VarStore::new(CPU);
    let w = vs.root().zeros("w", &[2]);
    let mut opt = nn::Sgd::default().build(&vs, 1.0).unwrap();
    let data = Tensor::from_slice(&[3.0f32, 4.0, 3.0, 4.0, 3.0, 4.0]).view([3, 2]);
    let acc = GradAccumulator::new(AccumConfig {
        split: Split::Count(3),
        max_grad_norm: Some(1.0),
    });
    let mut scaler = GradScaler::default();
    // The mean over samples of <w, [3, 4]> has gradient [3, 4], norm 5, clipped to 1.
    acc.f_step_scaled(&mut opt, &mut scaler, 3, |mb| {
        (mb.narrow(&data) * &w)
            .sum_dim_intlist(1, false, Kind::Float)
            .f_mean(Kind::Float)
    })
    .unwrap();
    let moved = Vec::<f32>::try_from(&w).unwrap();
    assert!(
        (moved[0] + 0.6).abs() < 1e-5 && (moved[1] + 0.8).abs() < 1e-5,
        "{moved:?}"
    );
}

#[test]
#[serial]
fn bad_input_gives_errors_not_panics() {
    let model = Seed::new(1, 2, Kind::Float);
    let x = Tensor::ones([4, 2], (Kind::Float, CPU));
    let mut opt = nn::Sgd::default().build(&model.vs, 0.1).unwrap();
    let mean_loss = |mb: &MicroBatch| -> Result<Tensor, tch::TchError> {
        Ok(model.forward(&mb.narrow(&x)).mean(Kind::Float))
    };
    let cases: [(i64, Split, &str); 4] = [
        (0, Split::Count(1), "batch is empty"),
        (4, Split::Count(0), "0 micro-batches"),
        (4, Split::MaxSize(0), "at least 1 sample"),
        (4, Split::Count(5), "at most one micro-batch per sample"),
    ];
    for (b, split, needle) in cases {
        let err = GradAccumulator::with_split(split)
            .f_step(&mut opt, b, mean_loss)
            .unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }

    let acc = GradAccumulator::with_split(Split::Count(2));
    let err = acc
        .f_step(&mut opt, 4, |mb| {
            Ok::<_, tch::TchError>(model.forward(&mb.narrow(&x)))
        })
        .unwrap_err();
    assert!(
        matches!(err, AccumError::LossNotScalar { index: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("must be a scalar"));

    let err = acc
        .f_step(&mut opt, 4, |mb| {
            if mb.index == 1 {
                return Err(anyhow::anyhow!("data loader ran dry"));
            }
            Ok(model.forward(&mb.narrow(&x)).mean(Kind::Float))
        })
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "micro-batch 1 (samples 2..4): data loader ran dry"
    );
    assert!(model.params().iter().all(|p| !p.grad().defined()));

    let empty = nn::VarStore::new(CPU);
    let mut no_params = nn::Sgd::default().build(&empty, 0.1).unwrap();
    let err = acc.f_step(&mut no_params, 4, mean_loss).unwrap_err();
    assert!(matches!(err, AccumError::NoParameters), "{err}");
}
