//! Criterion benches of the saved-tensor codecs and the disk store: pack (encode) and
//! unpack (decode) throughput in bytes of the original f32 tensor per second, which
//! criterion prints as GB/s (GiB/s).
//!
//!   cargo bench -p memsave-hooks --bench codecs
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use memsave_hooks::{Codec, DiskOffload, SavedTensorHooks};
use std::hint::black_box;
use tch::{Device, Kind, Tensor};

/// One seed-network activation: `[5000, 512]` f32, 10,240,000 bytes.
fn activation() -> Tensor {
    Tensor::randn([5000, 512], (Kind::Float, Device::Cpu))
}

fn codecs(c: &mut Criterion) {
    let x = activation();
    let bytes = (x.numel() * 4) as u64;
    let mut group = c.benchmark_group("codec");
    group.throughput(Throughput::Bytes(bytes));
    group.sample_size(20);
    for codec in [Codec::Bf16, Codec::Fp16, Codec::fp8(), Codec::int8()] {
        group.bench_function(format!("{}/pack", codec.name()), |b| {
            b.iter(|| black_box(codec.f_encode(&x).unwrap()))
        });
        let encoded = codec.f_encode(&x).unwrap().unwrap();
        group.bench_function(format!("{}/unpack", codec.name()), |b| {
            b.iter(|| black_box(encoded.f_decode().unwrap()))
        });
    }
    group.finish();
}

fn disk(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("memsave-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let x = activation();
    let store = DiskOffload::new(&dir).unwrap().prefetch(0);
    let mut group = c.benchmark_group("disk");
    group.throughput(Throughput::Bytes((x.numel() * 4) as u64));
    group.sample_size(10);
    group.bench_function("pack_and_flush", |b| {
        b.iter(|| {
            let packed = store.pack(&x).unwrap();
            store.flush().unwrap();
            black_box(packed)
        })
    });
    let packed = store.pack(&x).unwrap();
    store.flush().unwrap();
    group.bench_function("unpack", |b| {
        b.iter(|| black_box(store.unpack(&packed).unwrap()))
    });
    group.finish();
    drop((packed, store));
    let _ = std::fs::remove_dir(&dir);
}

criterion_group!(benches, codecs, disk);
criterion_main!(benches);
