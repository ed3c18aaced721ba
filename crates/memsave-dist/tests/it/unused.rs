//! A parameter that gets no gradient on any rank is left alone, as on one process and
//! as PyTorch's DDP with `find_unused_parameters=True` leaves it; one that gets a
//! gradient on some ranks is averaged as usual. Ranks are threads of this process over
//! a file store.
use std::thread;
use std::time::Duration;

use memsave_dist::{
    DdpConfig, DistributedDataParallel, Fsdp, FsdpConfig, InitOptions, ProcessGroup, ZeroOptimizer,
    ZeroStage,
};
use memsave_optim::{AdamW, AdamWConfig};
use serial_test::parallel;
use tch::{Kind, Tensor};

const CONFIG: AdamWConfig = AdamWConfig {
    lr: 0.05,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.1,
};
const INIT: [f32; 2] = [1.0, -2.0];

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t).expect("f32 values")
}

/// Five steps on `rank` of 2, DDP (`None`) or ZeRO at `stage`, of three parameters:
/// the first in every rank's loss, the second in rank 0's only, the third in none.
/// Returns their values and step counts.
fn train_rank(
    rank: usize,
    store: std::path::PathBuf,
    stage: Option<ZeroStage>,
) -> (Vec<Vec<f32>>, Vec<u64>) {
    let options = InitOptions {
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let group = ProcessGroup::new_file(&store, rank, 2, &options).expect("join");
    let params: Vec<Tensor> = (0..3)
        .map(|_| Tensor::from_slice(&INIT).set_requires_grad(true))
        .collect();
    let x = Tensor::from_slice(&[1f32, 2.]);
    let loss = || {
        let mut loss = (&params[0] * &x).sum(Kind::Float);
        if rank == 0 {
            loss += (&params[1] * &x).sum(Kind::Float);
        }
        loss
    };
    let steps: Vec<u64> = match stage {
        None => {
            let ddp =
                DistributedDataParallel::new(&group, &params, DdpConfig::default()).expect("ddp");
            let mut opt = AdamW::new(&params, CONFIG).expect("optimizer");
            for _ in 0..5 {
                ddp.f_backward(&loss()).expect("backward");
                opt.f_step().expect("step");
                opt.f_zero_grad(true).expect("zero_grad");
            }
            (0..3).map(|i| opt.step_count(i)).collect()
        }
        Some(stage) => {
            let mut opt = ZeroOptimizer::new(&group, &params, CONFIG, Default::default(), stage)
                .expect("zero");
            for _ in 0..5 {
                loss().backward();
                opt.f_step().expect("step");
                opt.f_zero_grad(true).expect("zero_grad");
            }
            (0..3).map(|i| opt.step_count(i)).collect()
        }
    };
    (params.iter().map(values).collect(), steps)
}

/// Runs [`train_rank`] on two threads.
fn train(stage: Option<ZeroStage>) -> Vec<(Vec<Vec<f32>>, Vec<u64>)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store");
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            thread::spawn(move || train_rank(rank, store, stage))
        })
        .collect();
    ranks.into_iter().map(|h| h.join().expect("rank")).collect()
}

#[test]
#[parallel]
fn ddp_leaves_a_parameter_no_rank_used_untouched() {
    let out = train(None);
    for (values, steps) in &out {
        // Weight decay and Adam's moments moved it before: to [0.975, -1.950].
        assert_eq!(values[2], INIT, "the unused parameter moved");
        assert_eq!(steps, &[5, 5, 0]);
        assert_ne!(values[1], INIT, "rank 0's gradient reaches both ranks");
    }
    assert_eq!(out[0], out[1], "the ranks agree");
}

#[test]
#[parallel]
fn zero_leaves_a_parameter_no_rank_used_untouched() {
    let ddp = train(None);
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let out = train(Some(stage));
        // Six values over two ranks: rank 0 holds the first parameter and half the
        // second, rank 1 the other half and the third.
        assert_eq!(out[0].1, [5, 5, 0], "{stage:?}: rank 0's step counts");
        assert_eq!(out[1].1, [0, 5, 0], "{stage:?}: rank 1's step counts");
        for (rank, (values, _)) in out.iter().enumerate() {
            assert_eq!(
                values[2], INIT,
                "{stage:?}: rank {rank}: the unused parameter moved"
            );
            assert_eq!(values, &ddp[0].0, "{stage:?}: rank {rank} against DDP");
        }
    }
}

/// Five ZeRO-3 steps on `rank` of 2 of four parameters in two units: unit 0 holds the
/// three of [`train_rank`] (in every rank's loss, in rank 0's only, in none), unit 1 a
/// fourth that no rank runs. The optimizer steps after backward, or `in_backward` as
/// each unit's gradients land (`Fsdp::step_in_backward`). Returns the full parameters
/// and the step count of each of the optimizer's tensors on this rank.
fn fsdp_rank(
    rank: usize,
    store: std::path::PathBuf,
    in_backward: bool,
) -> (Vec<Vec<f32>>, Vec<u64>) {
    let options = InitOptions {
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let group = ProcessGroup::new_file(&store, rank, 2, &options).expect("join");
    let params: Vec<Tensor> = (0..4)
        .map(|_| Tensor::from_slice(&INIT).set_requires_grad(true))
        .collect();
    let mut fsdp = Fsdp::new(&group, FsdpConfig::default()).expect("fsdp");
    fsdp.fully_shard_parameters(&params[..3]).expect("unit 0");
    fsdp.fully_shard_parameters(&params[3..]).expect("unit 1");
    let units = fsdp.units();
    let x = Tensor::from_slice(&[1f32, 2.]);
    let opt = AdamW::new(&fsdp.parameters(), CONFIG).expect("optimizer");
    let (mut after, hooked) = if in_backward {
        (
            None,
            Some(fsdp.step_in_backward(opt).expect("step_in_backward")),
        )
    } else {
        (Some(opt), None)
    };
    for _ in 0..5 {
        let loss = fsdp
            .forward(|| {
                units.f_forward(0, || {
                    let mut loss = (&params[0] * &x).sum(Kind::Float);
                    if rank == 0 {
                        loss += (&params[1] * &x).sum(Kind::Float);
                    }
                    loss
                })
            })
            .expect("forward")
            .expect("unit 0");
        loss.backward();
        fsdp.f_finish_backward().expect("finish_backward");
        if let Some(opt) = after.as_mut() {
            opt.f_step().expect("step");
            opt.f_zero_grad(true).expect("zero_grad");
        }
    }
    let full = fsdp.f_full_parameters().expect("full parameters");
    let opt = match (&after, &hooked) {
        (Some(opt), _) => opt,
        (None, Some(hooked)) => &*hooked.lock().expect("optimizer"),
        (None, None) => unreachable!("one or the other"),
    };
    let steps = (0..opt.params().len()).map(|i| opt.step_count(i)).collect();
    (full.iter().map(values).collect(), steps)
}

#[test]
#[parallel]
fn zero3_leaves_a_parameter_no_rank_used_untouched() {
    let ddp = train(None);
    for in_backward in [false, true] {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = dir.path().join("store");
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                thread::spawn(move || fsdp_rank(rank, store, in_backward))
            })
            .collect();
        let out: Vec<_> = ranks.into_iter().map(|h| h.join().expect("rank")).collect();
        // Unit 0's six values over two ranks: rank 0 holds the first parameter and half
        // the second, rank 1 the other half and the third; unit 1's two, one each.
        let how = if in_backward { "in backward" } else { "after" };
        assert_eq!(out[0].1, [5, 5, 0], "{how}: rank 0's step counts");
        assert_eq!(out[1].1, [5, 0, 0], "{how}: rank 1's step counts");
        for (rank, (values, _)) in out.iter().enumerate() {
            // Weight decay and Adam's moments moved it before: to [0.975, -1.950].
            assert_eq!(
                values[2], INIT,
                "{how}: rank {rank}: the unused parameter moved"
            );
            assert_eq!(
                values[3], INIT,
                "{how}: rank {rank}: the unit no rank ran moved"
            );
            assert_eq!(values[..3], ddp[0].0[..], "{how}: rank {rank} against DDP");
        }
    }
}
