//! Criterion benches of memsave's overheads: a meter query, checkpointing a small
//! function against running it plainly, early stop off against on, the in-place exclusivity check against the copy
//! it avoids, and one GradScaler step.
//!
//!   cargo bench --bench overhead
use criterion::{criterion_group, criterion_main, Criterion};
use memsave::amp::GradScaler;
use memsave::checkpoint::{checkpoint1, Checkpoint};
use memsave::meter::{measure, memory_allocated};
use std::hint::black_box;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

fn meter(c: &mut Criterion) {
    memory_allocated(CPU);
    c.bench_function("meter/memory_allocated", |b| {
        b.iter(|| black_box(memory_allocated(CPU)))
    });
    c.bench_function("meter/measure_empty_scope", |b| {
        b.iter(|| black_box(measure(CPU, |_| ())))
    });
}

fn checkpoint_overhead(c: &mut Criterion) {
    let mut group = c.benchmark_group("checkpoint");
    let vs = nn::VarStore::new(CPU);
    let lin = nn::linear(vs.root(), 64, 64, Default::default());
    let x = Tensor::rand([32, 64], (Kind::Float, CPU)).set_requires_grad(true);
    group.bench_function("plain_forward_backward", |b| {
        b.iter(|| {
            let y = &x + lin.forward(&x);
            y.sum(Kind::Float).backward();
        })
    });
    for (name, options) in [
        ("checkpointed_forward_backward", Checkpoint::new()),
        (
            "checkpointed_forward_backward_no_rng",
            Checkpoint::new().preserve_rng(false),
        ),
    ] {
        let lin = nn::linear(vs.root() / name, 64, 64, Default::default());
        group.bench_function(name, |b| {
            b.iter(|| {
                let l = lin.shallow_clone_module();
                let y = options
                    .run(&[&x], move |xs| vec![&xs[0] + l.forward(&xs[0])])
                    .unwrap();
                y[0].sum(Kind::Float).backward();
            })
        });
    }
    group.bench_function("checkpoint1_forward_only", |b| {
        b.iter(|| black_box(checkpoint1(&x, |x| x.relu()).unwrap()))
    });
    group.finish();
}

/// The seed's network (x = x + Linear(x), ten layers of 512) with `checkpoint()` around
/// each layer: early stop off (the default, safe for any function) against on (the
/// recomputation unwinds once the last saved tensor is rebuilt).
fn early_stop(c: &mut Criterion) {
    let mut group = c.benchmark_group("early_stop");
    group.sample_size(20);
    let vs = nn::VarStore::new(CPU);
    let layers: Vec<nn::Linear> = (0..10)
        .map(|i| nn::linear(vs.root() / i, 512, 512, Default::default()))
        .collect();
    let x = Tensor::rand([1000, 512], (Kind::Float, CPU)).set_requires_grad(true);
    for (name, stop) in [("seed_residual_off", false), ("seed_residual_on", true)] {
        let options = Checkpoint::new().early_stop(stop);
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut h = x.shallow_clone();
                for lin in &layers {
                    let l = lin.shallow_clone_module();
                    h = options
                        .run(&[&h], move |xs| vec![&xs[0] + l.forward(&xs[0])])
                        .unwrap()
                        .remove(0);
                }
                h.sum(Kind::Float).backward();
            })
        });
    }
    group.finish();
}

fn inplace_check(c: &mut Criterion) {
    let mut group = c.benchmark_group("inplace");
    let x = Tensor::rand([1024, 1024], (Kind::Float, CPU));
    group.bench_function("is_exclusive", |b| {
        b.iter(|| black_box(memsave::inplace::is_exclusive(&x).unwrap()))
    });
    group.bench_function("copy_4MiB_avoided", |b| b.iter(|| black_box(x.copy())));
    let fx = Tensor::rand([1024, 1024], (Kind::Float, CPU));
    group.bench_function("residual_add_in_place", |b| {
        b.iter_batched(
            || x.copy(),
            |t| black_box(memsave::inplace::residual_add(t, &fx)),
            criterion::BatchSize::LargeInput,
        )
    });
    group.bench_function("residual_add_out_of_place", |b| {
        b.iter_batched(
            || x.copy(),
            |t| black_box(&t + &fx),
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
}

fn grad_scaler(c: &mut Criterion) {
    let vs = nn::VarStore::new(CPU);
    let lin = nn::linear(vs.root(), 256, 256, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-3).unwrap();
    let mut scaler = GradScaler::default();
    let x = Tensor::rand([8, 256], (Kind::Float, CPU));
    c.bench_function("grad_scaler/scale_backward_step_update", |b| {
        b.iter(|| {
            opt.zero_grad();
            let loss = lin.forward(&x).square().mean(Kind::Float);
            scaler.f_scale(&loss).unwrap().backward();
            black_box(scaler.f_step(&mut opt).unwrap());
            scaler.f_update().unwrap();
        })
    });
}

/// A module handle that shares the parameters (tch modules are not Clone).
trait ShallowClone {
    fn shallow_clone_module(&self) -> Self;
}

impl ShallowClone for nn::Linear {
    fn shallow_clone_module(&self) -> Self {
        nn::Linear {
            ws: self.ws.shallow_clone(),
            bs: self.bs.as_ref().map(Tensor::shallow_clone),
        }
    }
}

criterion_group!(
    benches,
    meter,
    checkpoint_overhead,
    early_stop,
    inplace_check,
    grad_scaler
);
criterion_main!(benches);
