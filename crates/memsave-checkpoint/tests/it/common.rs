//! Shared test helpers: the seed's residual network and gradient comparison.
#![allow(dead_code)]
use memsave_checkpoint::CheckpointedSequential;
use memsave_sys::tensor::set_grad_none;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// `x = x + linear(x)` for `layers` Linear(h, h) layers (the seed network), with an
/// optional dropout on the residual branch.
pub fn residual_net(
    vs: &nn::VarStore,
    layers: usize,
    h: i64,
    dropout: f64,
) -> CheckpointedSequential {
    let mut seq = CheckpointedSequential::new();
    for i in 0..layers {
        let lin = nn::linear(vs.root() / i, h, h, Default::default());
        seq = seq.add_fn(move |x| {
            let branch = lin.forward(x);
            let branch = if dropout > 0.0 {
                branch.dropout(dropout, true)
            } else {
                branch
            };
            x + branch
        });
    }
    seq
}

pub fn clear_grads(vs: &nn::VarStore) {
    for p in vs.trainable_variables() {
        set_grad_none(&p).unwrap();
    }
}

/// One step (forward, mean of squares, backward); returns the parameter gradients (copied).
pub fn step_grads(seq: &CheckpointedSequential, vs: &nn::VarStore, x: &Tensor) -> Vec<Tensor> {
    clear_grads(vs);
    let loss = seq.f_forward(x).unwrap().square().mean(Kind::Float);
    loss.f_backward().unwrap();
    vs.trainable_variables()
        .iter()
        .map(|p| p.grad().copy())
        .collect()
}

/// Largest |a - b| relative to the largest |a|.
pub fn max_rel_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst: f64 = 0.0;
    for (x, y) in a.iter().zip(b) {
        let scale = x.abs().max().double_value(&[]).max(1e-12);
        let diff = (x - y).abs().max().double_value(&[]);
        worst = worst.max(diff / scale);
    }
    worst
}

pub fn rand(shape: &[i64]) -> Tensor {
    Tensor::rand(shape, (Kind::Float, Device::Cpu))
}
