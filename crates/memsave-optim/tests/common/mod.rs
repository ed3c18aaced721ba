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
