//! A small MLP twice with the same weights, and data for it.
#![allow(dead_code)]
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

pub struct Net {
    pub vs: nn::VarStore,
    pub model: nn::Sequential,
}

pub fn net(seed: i64) -> Net {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let model = nn::seq()
        .add(nn::linear(&root / "l1", 8, 33, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 33, 17, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l3", 17, 2, Default::default()));
    // Weights from the seed alone: tests run on parallel threads that share the global
    // generator, so `manual_seed` then initialise is not reproducible.
    tch::no_grad(|| {
        for (i, mut p) in vs.trainable_variables().into_iter().enumerate() {
            let n = p.numel() as i64;
            let phase = (seed * 31 + i as i64) as f64 * 0.7;
            // tch's default scale: uniform in ±1/sqrt(fan_in) for weights, 0.1 for biases.
            let size = p.size();
            let scale = if size.len() == 2 {
                1.0 / (size[1] as f64).sqrt()
            } else {
                0.1
            };
            let values =
                (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + phase).sin() * scale;
            p.copy_(&values.view(p.size().as_slice()));
        }
    });
    Net { vs, model }
}

impl Net {
    pub fn params(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    pub fn loss(&self, step: i64) -> Tensor {
        let (x, y) = batch(step);
        self.model.forward(&x).mse_loss(&y, tch::Reduction::Mean)
    }

    pub fn backward(&self, step: i64) -> f64 {
        let loss = self.loss(step);
        loss.backward();
        loss.double_value(&[])
    }
}

/// Batch `step` of a fixed regression problem.
pub fn batch(step: i64) -> (Tensor, Tensor) {
    let g = Tensor::arange(64 * 8, (Kind::Float, Device::Cpu)).view([64, 8]);
    let x = ((&g * 0.37 + step as f64 * 1.3).sin() * 2.0).contiguous();
    let y = Tensor::cat(
        &[
            x.sum_dim_intlist(1, true, Kind::Float).sin(),
            x.narrow(1, 0, 1) * x.narrow(1, 1, 1),
        ],
        1,
    );
    (x, y)
}

/// Asserts that the two lists of tensors are bitwise equal.
pub fn assert_bitwise(a: &[Tensor], b: &[Tensor], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.equal(y),
            "{what}: parameter {i} differs; max abs diff {}",
            (x - y).abs().max().double_value(&[])
        );
    }
}
