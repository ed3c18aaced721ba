//! The exclusivity check costs nanoseconds; the copy it avoids costs a pass over memory.
//!
//! `cargo bench -p memsave-inplace` prints both for a 4 MiB f32 tensor.
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use memsave_inplace::{can_mutate_in_place, f_relu, is_exclusive};
use tch::{Device, Kind, Tensor};

fn bench(c: &mut Criterion) {
    let x = Tensor::rand([1024, 1024], (Kind::Float, Device::Cpu));
    let mut group = c.benchmark_group("4 MiB f32 tensor");
    group.bench_function("is_exclusive", |b| {
        b.iter(|| is_exclusive(black_box(&x)).unwrap())
    });
    group.bench_function("can_mutate_in_place", |b| {
        b.iter(|| can_mutate_in_place(black_box(&x)).unwrap())
    });
    group.bench_function("copy (what the check avoids)", |b| {
        b.iter(|| black_box(&x).copy())
    });
    group.bench_function("relu out of place", |b| b.iter(|| black_box(&x).relu()));
    group.bench_function("f_relu on an exclusive tensor (in place)", |b| {
        let mut y = Some(x.copy());
        b.iter(|| {
            let t = y.take().expect("put back below");
            y = Some(f_relu(t).unwrap());
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
