//! The built-in stores as levers of the budget planner (memsave-checkpoint): disk
//! offload keeps gradients bitwise equal and the store empty after backward, int8
//! compression keeps them within its stated error, and both fit the planned peak.
use memsave_checkpoint::{BoundaryStore, CheckpointedSequential, Plan, Schedule, StoredBoundary};
use memsave_hooks::{Codec, Compress, DiskOffload};
use memsave_meter::{measure, memory_allocated};
use serial_test::serial;
use std::sync::Arc;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

fn residual_net(vs: &nn::VarStore, layers: usize, h: i64) -> CheckpointedSequential {
    let mut seq = CheckpointedSequential::new().preserve_rng(false);
    for i in 0..layers {
        let lin = nn::linear(vs.root() / i, h, h, Default::default());
        seq = seq.add_fn(move |x| x + lin.forward(x).tanh());
    }
    seq
}

fn loss_of(y: &Tensor) -> Tensor {
    y.square().mean(Kind::Float)
}

fn clear_grads(vs: &nn::VarStore) {
    for p in vs.trainable_variables() {
        memsave_sys::tensor::set_grad_none(&p).unwrap();
    }
}

/// One step's parameter gradients (copied) and its peak above the start.
fn step(seq: &CheckpointedSequential, vs: &nn::VarStore, x: &Tensor) -> (Vec<Tensor>, u64) {
    clear_grads(vs);
    let (_, m) = measure(CPU, |_| {
        let y = seq.f_forward(x).unwrap();
        let loss = loss_of(&y);
        loss.f_backward().unwrap();
        drop(y);
    });
    let grads = vs
        .trainable_variables()
        .iter()
        .map(|p| p.grad().copy())
        .collect();
    clear_grads(vs);
    (grads, m.peak_bytes)
}

fn lever_seq(
    vs: &nn::VarStore,
    x: &Tensor,
    stores: Vec<Arc<dyn BoundaryStore>>,
) -> CheckpointedSequential {
    let mut seq = residual_net(vs, 12, 64).with_levers(stores);
    seq.profile(x, &vs.trainable_variables(), loss_of).unwrap();
    seq
}

/// Every layer its own checkpoint, every input past the first kept by store 0.
fn every_layer_stored(len: usize) -> Schedule {
    let stored = (1..len)
        .map(|layer| StoredBoundary { layer, lever: 0 })
        .collect();
    Schedule::every_layer(len).with_stored(stored).unwrap()
}

/// The gradient of the scalar loss that `backward()` holds while it runs, which the
/// planner's model leaves out.
const LOSS_GRAD_BYTES: u64 = 4;

#[test]
#[serial]
fn disk_offload_keeps_gradients_bitwise_fits_its_prediction_and_leaves_the_store_empty() {
    let vs = nn::VarStore::new(CPU);
    let x = Tensor::randn([32, 64], (Kind::Float, CPU));
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskOffload::new(dir.path()).unwrap().prefetch(0);
    let mut seq = lever_seq(&vs, &x, vec![Arc::new(disk.clone())]);
    let (baseline, _) = step(&seq, &vs, &x);

    seq.set_schedule(every_layer_stored(12)).unwrap();
    assert!(
        seq.explain().contains("stored by offload to disk"),
        "{}",
        seq.explain()
    );
    let predicted = seq.predict().unwrap().peak_bytes;
    let start = memory_allocated(CPU);
    let written = disk.stats().written_bytes; // the profile's calibration wrote too
    let (grads, peak) = step(&seq, &vs, &x);
    assert!(
        peak <= predicted + LOSS_GRAD_BYTES,
        "peak {peak} > predicted {predicted}"
    );
    assert_eq!(disk.stats().written_bytes - written, 11 * 32 * 64 * 4);
    assert!(baseline.iter().zip(&grads).all(|(a, b)| a.equal(b)));
    drop(grads);
    assert_eq!(std::fs::read_dir(disk.dir()).unwrap().count(), 0);
    assert_eq!(memory_allocated(CPU), start);

    // The solver, at the budget of that schedule, finds a plan that fits it.
    seq.set_plan(Plan::Budget(predicted)).unwrap();
    let (grads, peak) = step(&seq, &vs, &x);
    assert!(peak <= predicted + LOSS_GRAD_BYTES, "{}", seq.explain());
    assert!(baseline.iter().zip(&grads).all(|(a, b)| a.equal(b)));
    assert_eq!(std::fs::read_dir(disk.dir()).unwrap().count(), 0);
}

#[test]
#[serial]
fn int8_compression_keeps_gradients_within_its_bound() {
    let vs = nn::VarStore::new(CPU);
    let x = Tensor::randn([32, 64], (Kind::Float, CPU));
    let int8 = Compress::new(Codec::int8());
    let mut seq = lever_seq(&vs, &x, vec![Arc::new(int8.clone())]);
    let (baseline, _) = step(&seq, &vs, &x);
    seq.set_schedule(every_layer_stored(12)).unwrap();
    let predicted = seq.predict().unwrap().peak_bytes;
    let (grads, peak) = step(&seq, &vs, &x);
    assert!(
        peak <= predicted + LOSS_GRAD_BYTES,
        "peak {peak} > predicted {predicted}"
    );
    assert!(int8.stats().saved_bytes() > 0);
    let (mut diff, mut norm) = (0.0, 0.0);
    for (a, b) in baseline.iter().zip(&grads) {
        diff += (a - b).square().sum(Kind::Double).double_value(&[]);
        norm += a.square().sum(Kind::Double).double_value(&[]);
    }
    let rel_l2 = (diff / norm).sqrt();
    // Every one of the 11 boundaries is quantized and each recompute runs on the
    // decoded values, so the error compounds: stated bound 5e-2 (3.3e-2 measured here).
    assert!(rel_l2 > 0.0 && rel_l2 <= 5e-2, "relative L2 {rel_l2}");
}
