//! The built-in stores as levers of the budget planner (memsave-checkpoint): disk
//! offload keeps gradients bitwise equal and the store empty after backward, int8
//! compression keeps them within its stated error, and both plans fit their budget.
use memsave_checkpoint::{BoundaryStore, CheckpointError, CheckpointedSequential, Plan};
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

fn smallest_feasible(seq: &mut CheckpointedSequential) -> u64 {
    match seq.set_plan(Plan::Budget(1)) {
        Err(CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        }) => smallest_feasible.0,
        other => panic!("a 1-byte budget must be infeasible, got {other:?}"),
    }
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

#[test]
#[serial]
fn disk_offload_lowers_the_floor_keeps_gradients_bitwise_and_leaves_the_store_empty() {
    let vs = nn::VarStore::new(CPU);
    let x = Tensor::randn([32, 64], (Kind::Float, CPU));
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskOffload::new(dir.path()).unwrap().prefetch(0);
    let mut seq = lever_seq(&vs, &x, vec![Arc::new(disk.clone())]);
    let (baseline, _) = step(&seq, &vs, &x);

    let mut recompute_only = residual_net(&vs, 12, 64);
    recompute_only
        .profile(&x, &vs.trainable_variables(), loss_of)
        .unwrap();
    let floor = smallest_feasible(&mut recompute_only);
    let smallest = smallest_feasible(&mut seq);
    assert!(smallest < floor, "{smallest} vs recompute-only {floor}");

    for budget in [smallest, (smallest + floor) / 2] {
        seq.set_plan(Plan::Budget(budget)).unwrap();
        assert!(!seq.schedule().stored().is_empty(), "{}", seq.explain());
        assert!(seq.explain().contains("stored by offload to disk"));
        let start = memory_allocated(CPU);
        let written = disk.stats().written_bytes;
        let (grads, peak) = step(&seq, &vs, &x);
        assert!(peak <= budget, "peak {peak} > budget {budget}\n{}", seq.explain());
        assert!(disk.stats().written_bytes > written);
        assert!(
            baseline.iter().zip(&grads).all(|(a, b)| a.equal(b)),
            "gradients differ at {budget}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert_eq!(memory_allocated(CPU), start);
    }
}

#[test]
#[serial]
fn int8_compression_keeps_gradients_within_its_bound_and_fits_the_budget() {
    let vs = nn::VarStore::new(CPU);
    let x = Tensor::randn([32, 64], (Kind::Float, CPU));
    let int8 = Compress::new(Codec::int8());
    let mut seq = lever_seq(&vs, &x, vec![Arc::new(int8.clone())]);
    let (baseline, _) = step(&seq, &vs, &x);
    let smallest = smallest_feasible(&mut seq);
    seq.set_plan(Plan::Budget(smallest)).unwrap();
    assert!(!seq.schedule().stored().is_empty(), "{}", seq.explain());
    let (grads, peak) = step(&seq, &vs, &x);
    assert!(peak <= smallest, "peak {peak} > budget {smallest}");
    assert!(int8.stats().saved_bytes() > 0);
    let (mut diff, mut norm) = (0.0, 0.0);
    for (a, b) in baseline.iter().zip(&grads) {
        diff += (a - b).square().sum(Kind::Double).double_value(&[]);
        norm += a.square().sum(Kind::Double).double_value(&[]);
    }
    let rel_l2 = (diff / norm).sqrt();
    // The bound for int8 saved activations.
    assert!(rel_l2 > 0.0 && rel_l2 <= 3e-2, "relative L2 {rel_l2}");
}
