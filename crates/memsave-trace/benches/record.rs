//! What recording costs: one training step of the seed network (10 layers of
//! `x = x + Linear(512, 512)(x)` on `[50, 100, 512]`), plain and under
//! `Recorder::record` with parameters, input, phases and a mark per layer. The target
//! is a recorded step within 1.2x of the plain one.
use criterion::{criterion_group, criterion_main, Criterion};
use memsave_trace::{Phase, Recorder, Session};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

struct Seed {
    vs: nn::VarStore,
    layers: Vec<nn::Linear>,
    x: Tensor,
}

fn seed() -> Seed {
    memsave_meter::install();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let layers = (0..10)
        .map(|i| nn::linear(vs.root() / i, 512, 512, Default::default()))
        .collect();
    let x = Tensor::rand([50, 100, 512], (Kind::Float, Device::Cpu));
    Seed { vs, layers, x }
}

fn step(seed: &Seed, session: Option<&Session>) {
    for p in seed.vs.trainable_variables() {
        let mut p = p;
        p.zero_grad();
    }
    if let Some(s) = session {
        s.phase(Phase::Forward);
    }
    let mut h = seed.x.shallow_clone();
    for (i, layer) in seed.layers.iter().enumerate() {
        if let Some(s) = session {
            s.mark(format!("layer {i}"));
        }
        h = &h + layer.forward(&h);
    }
    let loss = h.square().mean(Kind::Float);
    if let Some(s) = session {
        s.phase(Phase::Backward);
    }
    loss.backward();
}

fn bench(c: &mut Criterion) {
    tch::set_num_threads(2);
    let seed = seed();
    let params = seed.vs.trainable_variables();
    let mut group = c.benchmark_group("seed step");
    group.sample_size(10);
    group.bench_function("plain", |b| b.iter(|| step(&seed, None)));
    group.bench_function("recorded", |b| {
        b.iter(|| {
            Recorder::new(Device::Cpu)
                .parameters(&params)
                .inputs(&[seed.x.shallow_clone()])
                .record(|s| step(&seed, Some(s)))
                .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
