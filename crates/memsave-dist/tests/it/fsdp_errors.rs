//! Bad input to ZeRO-3 (`Fsdp`): each an `Err` that starts with the rank and names the
//! cause, before any weight changes. Ranks are threads of this process, joined over a
//! file store.
use std::path::Path;
use std::thread;
use std::time::Duration;

use memsave_dist::{DistError, Fsdp, FsdpConfig, InitOptions, ProcessGroup};
use serial_test::{parallel, serial};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

fn options() -> InitOptions {
    InitOptions {
        timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn group_of_one(dir: &Path) -> ProcessGroup {
    ProcessGroup::new_file(&dir.join("store"), 0, 1, &options()).expect("a group of one")
}

#[test]
#[parallel]
fn a_unit_whose_shapes_differ_across_ranks_is_refused_before_any_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let path = path.clone();
            thread::spawn(move || -> Result<(), String> {
                let group = ProcessGroup::new_file(&path, rank, 2, &options())
                    .map_err(|e| e.to_string())?;
                let mut fsdp =
                    Fsdp::new(&group, FsdpConfig::default()).map_err(|e| e.to_string())?;
                // Unit 0 agrees; unit 1's weight is 4x4 on rank 0 and 4x5 on rank 1.
                let agree = Tensor::full([3], rank as f64 + 1.0, (Kind::Float, Device::Cpu))
                    .set_requires_grad(true);
                fsdp.fully_shard(nn::func(|x| x.shallow_clone()), &[agree])
                    .map_err(|e| e.to_string())?;
                let cols = 4 + rank as i64;
                let w = Tensor::full([4, cols], rank as f64 + 1.0, (Kind::Float, Device::Cpu))
                    .set_requires_grad(true);
                let before = Vec::<f32>::try_from(w.reshape([-1])).unwrap();
                let result =
                    fsdp.fully_shard(nn::func(|x| x.shallow_clone()), &[w.shallow_clone()]);
                let after = Vec::<f32>::try_from(w.detach().reshape([-1])).unwrap();
                assert_eq!(before, after, "rank {rank}: the parameter is unchanged");
                assert_eq!(w.size(), [4, cols]);
                assert_eq!(fsdp.len(), 1, "rank {rank}: the unit was not added");
                match result {
                    Ok(_) => Ok(()),
                    Err(e @ DistError::Mismatch { .. }) => Err(e.to_string()),
                    Err(e) => panic!("rank {rank}: another error: {e}"),
                }
            })
        })
        .collect();
    let results: Vec<Result<(), String>> = handles
        .into_iter()
        .map(|h| h.join().expect("no panic"))
        .collect();
    assert_eq!(
        results[0].as_ref().expect_err("refused"),
        "rank 0: parameter shapes differ from rank 1's: unit 1: 1 tensors of 16 values here, 1 tensors of 20 values there"
    );
    assert_eq!(
        results[1].as_ref().expect_err("refused"),
        "rank 1: parameter shapes differ from rank 0's: unit 1: 1 tensors of 20 values here, 1 tensors of 16 values there"
    );
}

#[test]
#[parallel]
fn parameters_fully_shard_cannot_take_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let group = group_of_one(dir.path());
    let mut fsdp = Fsdp::new(&group, FsdpConfig::default()).expect("fsdp");
    let id = || nn::func(|x| x.shallow_clone());
    let no_grad = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let err = fsdp
        .fully_shard(id(), &[no_grad])
        .expect_err("no grad")
        .to_string();
    assert!(
        err.starts_with("rank 0: unit 0, parameter 0 (shape [3], Float on Cpu): fully_shard needs contiguous f32 CPU parameters that require grad"),
        "{err}"
    );
    let double = Tensor::zeros([3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    assert!(fsdp.fully_shard(id(), &[double]).is_err());
    let p = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let err = fsdp
        .fully_shard(id(), &[p.shallow_clone(), p.shallow_clone()])
        .expect_err("twice")
        .to_string();
    assert_eq!(
        err,
        "rank 0: unit 0, parameter 1 is the same tensor as parameter 0; each parameter belongs to one unit, once"
    );
    fsdp.fully_shard(id(), &[p.shallow_clone()])
        .expect("once is fine");
    let q = Tensor::zeros([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let err = fsdp
        .fully_shard(id(), &[q, p.shallow_clone()])
        .expect_err("in unit 0")
        .to_string();
    assert_eq!(
        err,
        "rank 0: unit 1, parameter 1 is already in a unit of this Fsdp; each parameter belongs to one unit, once"
    );
    assert_eq!(fsdp.len(), 1);
}

/// Without `Fsdp::forward`, autograd keeps what a unit's forward saved of its weights
/// (a linear layer saves `weight.t()`): resharding frees nothing, and the step is told.
#[test]
#[serial]
fn weights_that_autograd_keeps_after_a_resharding_forward_are_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let group = group_of_one(dir.path());
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut fsdp = Fsdp::new(&group, FsdpConfig::default()).expect("fsdp");
    let mut units = Vec::new();
    for i in 0..2 {
        let lin = nn::linear(vs.root() / i, 4, 4, Default::default());
        let params = [
            lin.ws.shallow_clone(),
            lin.bs.as_ref().unwrap().shallow_clone(),
        ];
        units.push(fsdp.fully_shard(lin, &params).expect("fully_shard"));
    }
    let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    let run = || {
        units[1]
            .forward_t(&units[0].forward_t(&x, true), true)
            .sum(Kind::Float)
    };
    // Inside Fsdp::forward: nothing is held, the step goes on.
    fsdp.forward(run).expect("forward").backward();
    fsdp.f_finish_backward().expect("freed after each forward");
    // Outside: the gradients are still right, but unit 1's weights (its input needs a
    // gradient, so its weight is saved) stayed gathered until backward.
    let loss = run();
    assert_eq!(
        fsdp.stats().gathered_bytes,
        0,
        "freed by Fsdp as far as it can"
    );
    loss.backward();
    let err = fsdp.f_finish_backward().expect_err("reported").to_string();
    assert!(
        err.starts_with(
            "rank 0: units [1]: their gathered weights were still held after their forward"
        ),
        "{err}"
    );
    assert!(
        err.contains("run the forward inside Fsdp::forward, or turn reshard_after_forward off"),
        "{err}"
    );
    // Reported once; the next step is clean again.
    fsdp.forward(run).expect("forward").backward();
    fsdp.f_finish_backward().expect("clean again");
    // A loss with grad outside a step (a validation loss), dropped: the next step's
    // forward inside Fsdp::forward goes on, its update not lost to a wrong report.
    let validation = run();
    drop(validation);
    fsdp.forward(run).expect("forward").backward();
    fsdp.f_finish_backward()
        .expect("a forward before the step's is not the step's");
}

/// A parameter of one unit used in another unit's forward (tied weights) reads the
/// placeholder there: refused when autograd saves it.
#[test]
#[serial]
fn a_parameter_used_outside_its_unit_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let group = group_of_one(dir.path());
    let mut fsdp = Fsdp::new(&group, FsdpConfig::default()).expect("fsdp");
    let w = Tensor::ones([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let own = fsdp
        .fully_shard(nn::func(|x| x.shallow_clone()), &[w.shallow_clone()])
        .expect("unit 0");
    let tied = w.shallow_clone();
    let b = Tensor::zeros([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let other = fsdp
        .fully_shard(nn::func(move |x| x.matmul(&tied)), &[b])
        .expect("unit 1");
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        fsdp.forward(|| other.forward_t(&own.forward_t(&x, true), true))
    }));
    let message = match outcome {
        Err(payload) => memsave_sys::panic_message(&*payload),
        Ok(_) => panic!("the tied weight was saved without a word"),
    };
    assert!(
        message.contains("a fully sharded parameter is used outside its unit's forward"),
        "{message}"
    );
}
