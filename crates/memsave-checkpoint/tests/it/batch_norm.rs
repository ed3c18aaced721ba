//! BatchNorm's running statistics under checkpointing (issue #25, item 4): a
//! recomputation must not update them again, so a checkpointed training step leaves them
//! bitwise where a plain step does, under every plan. (PyTorch's checkpoint updates them
//! once per recomputation: twice per step per checkpointed block, more when nested.)
use memsave_checkpoint::{checkpoint1, CheckpointedSequential, Plan};
use serial_test::serial;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

type SharedBn = Arc<Mutex<nn::BatchNorm>>;

/// `layers` blocks of conv 3x3, BatchNorm in training mode and ReLU.
fn conv_bn_net(
    vs: &nn::VarStore,
    layers: usize,
    c: i64,
) -> (CheckpointedSequential, Vec<SharedBn>) {
    let mut seq = CheckpointedSequential::new();
    let mut bns = Vec::new();
    for i in 0..layers {
        let conv_cfg = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        let conv = nn::conv2d(vs.root() / i / "conv", c, c, 3, conv_cfg);
        let bn = Arc::new(Mutex::new(nn::batch_norm2d(
            vs.root() / i / "bn",
            c,
            Default::default(),
        )));
        bns.push(bn.clone());
        seq = seq.add_fn(move |x| {
            let y = conv.forward(x);
            bn.lock().unwrap().forward_t(&y, true).relu()
        });
    }
    (seq, bns)
}

fn stats(bns: &[SharedBn]) -> Vec<Tensor> {
    bns.iter()
        .flat_map(|bn| {
            let bn = bn.lock().unwrap();
            [bn.running_mean.copy(), bn.running_var.copy()]
        })
        .collect()
}

fn set_stats(bns: &[SharedBn], values: &[Tensor]) {
    tch::no_grad(|| {
        for (bn, pair) in bns.iter().zip(values.chunks(2)) {
            let mut bn = bn.lock().unwrap();
            bn.running_mean.copy_(&pair[0]);
            bn.running_var.copy_(&pair[1]);
        }
    });
}

fn step(seq: &CheckpointedSequential, vs: &nn::VarStore, x: &Tensor) -> Vec<Tensor> {
    for p in vs.trainable_variables() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    seq.f_forward(x)
        .unwrap()
        .square()
        .mean(Kind::Float)
        .backward();
    vs.trainable_variables()
        .iter()
        .map(|p| p.grad().copy())
        .collect()
}

#[test]
#[serial]
fn running_statistics_after_a_step_are_bitwise_a_plain_steps_under_every_plan() {
    for (layers, c, batch, image) in [(4usize, 4i64, 3i64, 6i64), (7, 6, 4, 5)] {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(CPU);
        let (mut seq, bns) = conv_bn_net(&vs, layers, c);
        let x = Tensor::randn([batch, c, image, image], (Kind::Float, CPU));
        seq.profile(&x, &vs.trainable_variables(), |y| {
            y.square().mean(Kind::Float)
        })
        .unwrap();
        seq.set_plan(Plan::EveryLayer).unwrap();
        let budget = seq.predict().unwrap().peak_bytes;

        let start = stats(&bns);
        seq.set_plan(Plan::None).unwrap();
        let plain_grads = step(&seq, &vs, &x);
        let plain = stats(&bns);
        assert!(
            plain.iter().zip(&start).any(|(a, b)| !a.equal(b)),
            "a training step updates the statistics"
        );
        for plan in [
            Plan::EveryLayer,
            Plan::Segments(2),
            Plan::Nested,
            Plan::Budget(budget),
        ] {
            set_stats(&bns, &start);
            seq.set_plan(plan).unwrap();
            let grads = step(&seq, &vs, &x);
            for (i, (a, b)) in stats(&bns).iter().zip(&plain).enumerate() {
                assert!(
                    a.equal(b),
                    "{plan} ({layers} layers): statistic {i} differs from a plain step's by {}",
                    (a - b).abs().max().double_value(&[])
                );
            }
            for (a, b) in grads.iter().zip(&plain_grads) {
                assert!(a.allclose(b, 1e-5, 1e-6, false), "{plan}: gradients differ");
            }
        }
    }
}

#[test]
#[serial]
fn a_checkpointed_batch_norm_updates_its_statistics_once() {
    let vs = nn::VarStore::new(CPU);
    let bn = Arc::new(Mutex::new(nn::batch_norm1d(
        vs.root(),
        5,
        Default::default(),
    )));
    let x = Tensor::randn([8, 5], (Kind::Float, CPU)).set_requires_grad(true);
    let expected = {
        let bn = bn.lock().unwrap();
        let mean = x.detach().mean_dim(0, false, Kind::Float);
        let var = x.detach().var_dim(0, true, false);
        (
            &bn.running_mean * 0.9 + mean * 0.1,
            &bn.running_var * 0.9 + var * 0.1,
        )
    };
    let layer = bn.clone();
    let y = checkpoint1(&x, move |x| {
        let y = layer.lock().unwrap().forward_t(x, true);
        y.tanh()
    })
    .unwrap();
    y.sum(Kind::Float).backward();
    let bn = bn.lock().unwrap();
    assert!(bn.running_mean.allclose(&expected.0, 1e-6, 1e-7, false));
    assert!(bn.running_var.allclose(&expected.1, 1e-6, 1e-7, false));
}

/// `layers` blocks of conv 3x3 and BatchNorm added as `ModuleT`s (`add_t`), and the
/// store's running statistics.
fn conv_bn_net_t(vs: &nn::VarStore, layers: usize, c: i64) -> CheckpointedSequential {
    let mut seq = CheckpointedSequential::new();
    for i in 0..layers {
        let conv_cfg = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        let block = nn::seq_t()
            .add(nn::conv2d(vs.root() / i / "conv", c, c, 3, conv_cfg))
            .add(nn::batch_norm2d(
                vs.root() / i / "bn",
                c,
                Default::default(),
            ))
            .add_fn(|x| x.relu());
        seq = seq.add_t(block);
    }
    seq
}

fn buffers(vs: &nn::VarStore) -> Vec<Tensor> {
    let mut named: Vec<_> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| !t.requires_grad())
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, t)| t.copy()).collect()
}

#[test]
#[serial]
fn add_t_layers_get_the_train_flag_in_forward_and_recomputation() {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(CPU);
    let mut seq = conv_bn_net_t(&vs, 4, 3);
    let x = Tensor::randn([4, 3, 6, 6], (Kind::Float, CPU)) * 3.0 + 1.0;
    let before = buffers(&vs);
    // Eval: BatchNorm uses (and keeps) the running statistics, so nothing moves.
    let eval = tch::no_grad(|| seq.f_forward_t(&x, false)).unwrap();
    for (a, b) in before.iter().zip(buffers(&vs)) {
        assert!(a.equal(&b), "an eval forward moved a running statistic");
    }
    // Train under a checkpoint plan: statistics move, output differs from eval's, and
    // a plain step's statistics are reproduced bitwise.
    let plain = {
        let y = seq.f_forward_t(&x, true).unwrap();
        assert!(
            !y.allclose(&eval, 1e-3, 1e-3, false),
            "train and eval agree"
        );
        y.square().mean(Kind::Float).backward();
        buffers(&vs)
    };
    tch::no_grad(|| {
        let mut named: Vec<_> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| !t.requires_grad())
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for ((_, mut t), v) in named.into_iter().zip(&before) {
            t.copy_(v);
        }
    });
    seq.set_plan(Plan::EveryLayer).unwrap();
    let y = seq.f_forward_t(&x, true).unwrap();
    y.square().mean(Kind::Float).backward();
    for (a, b) in plain.iter().zip(buffers(&vs)) {
        assert!(
            a.equal(&b),
            "a checkpointed step moved the statistics differently"
        );
    }
    assert!(!plain[0].equal(&before[0]) || !plain[1].equal(&before[1]));
}

#[test]
#[serial]
fn profile_leaves_running_statistics_unchanged() {
    tch::manual_seed(4);
    let vs = nn::VarStore::new(CPU);
    let mut seq = conv_bn_net_t(&vs, 3, 2);
    let x = Tensor::randn([4, 2, 5, 5], (Kind::Float, CPU)) + 2.0;
    let before = buffers(&vs);
    let params = vs.trainable_variables();
    seq.profile(&x, &params, |y| y.square().mean(Kind::Float))
        .unwrap();
    for (a, b) in before.iter().zip(buffers(&vs)) {
        assert!(a.equal(&b), "profiling moved a running statistic");
    }
}
