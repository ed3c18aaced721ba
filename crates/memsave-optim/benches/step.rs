//! Optimizer step time per state precision against tch's `nn::adamw`, on a model of
//! about 10 M parameters (four 1600x1600 linear layers) with fixed gradients.
use criterion::{criterion_group, criterion_main, Criterion};
use memsave_optim::{AdamW, AdamWConfig, Options, State};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const WIDTH: i64 = 1600;

fn model() -> (nn::VarStore, nn::Sequential) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut seq = nn::seq();
    for i in 0..4 {
        seq = seq.add(nn::linear(vs.root() / i, WIDTH, WIDTH, Default::default()));
    }
    (vs, seq)
}

fn with_gradients() -> (nn::VarStore, nn::Sequential) {
    let (vs, seq) = model();
    let x = Tensor::randn([8, WIDTH], (Kind::Float, Device::Cpu));
    seq.forward(&x).square().mean(Kind::Float).backward();
    (vs, seq)
}

fn step(c: &mut Criterion) {
    let mut group = c.benchmark_group("adamw_step_10m");
    group.sample_size(10);
    {
        let (vs, _seq) = with_gradients();
        let mut opt = nn::adamw(0.9, 0.999, 0.01).build(&vs, 1e-3).unwrap();
        group.bench_function("tch_nn_adamw", |b| b.iter(|| opt.step()));
    }
    for (name, state) in [
        ("f32", State::F32),
        ("bf16", State::Bf16),
        ("int8_blockwise_256", State::Int8Blockwise { block: 256 }),
    ] {
        let (vs, _seq) = with_gradients();
        let options = Options {
            state,
            ..Default::default()
        };
        let mut opt =
            AdamW::with_options(&vs.trainable_variables(), AdamWConfig::default(), options)
                .unwrap();
        group.bench_function(name, |b| b.iter(|| opt.step()));
    }
    group.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
