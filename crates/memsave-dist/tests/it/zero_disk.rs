//! ZeRO ranks given one `Placement::Disk` directory keep their shards' state files
//! apart (`rank-R` below it) and train as ranks whose state is in memory.
use crate::common;

use std::time::Duration;

use memsave_dist::{init_process_group, InitOptions, ZeroOptimizer, ZeroStage};
use memsave_optim::{AdamWConfig, Options, Placement, State};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 3;

/// The rank's parameters after `STEPS` ZeRO-2 steps of AdamW on a least-squares loss,
/// with the state in `placement`.
fn train(group: &memsave_dist::ProcessGroup, placement: Placement) -> Vec<f32> {
    tch::manual_seed(3);
    let w = Tensor::randn([16, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let b = Tensor::zeros([8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let params = [w.shallow_clone(), b.shallow_clone()];
    let options = Options {
        state: State::F32,
        placement,
        ..Default::default()
    };
    let mut zero = ZeroOptimizer::new(
        group,
        &params,
        AdamWConfig::default(),
        options,
        ZeroStage::Two,
    )
    .expect("ZeroOptimizer::new");
    // Each rank its own rows of the batch.
    tch::manual_seed(10 + group.rank() as i64);
    let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
    for step in 0..STEPS {
        let loss = (x.matmul(&w) + &b).square().mean(Kind::Float);
        loss.backward();
        zero.f_step()
            .unwrap_or_else(|e| panic!("rank {} step {step}: {e}", group.rank()));
        zero.f_zero_grad(true).expect("zero_grad");
    }
    params
        .iter()
        .flat_map(|p| Vec::<f32>::try_from(p.detach().reshape([-1])).expect("f32 values"))
        .collect()
}

#[test]
#[ignore = "a rank of the shared-directory test: started by the launcher"]
fn zero_disk_worker() {
    let out = common::out_dir();
    let options = InitOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    let shared = out.join("state");
    let on_disk = train(&group, Placement::Disk(shared.clone()));
    let in_memory = train(&group, Placement::Device);
    assert_eq!(on_disk, in_memory, "rank {}", group.rank());
    let own = shared.join(format!("rank-{}", group.rank()));
    assert!(own.join("param-0.state").is_file(), "{}", own.display());
    std::fs::write(out.join(format!("ok-rank{}", group.rank())), "").expect("write ok");
}

#[test]
fn ranks_sharing_a_disk_directory_keep_their_state_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::run_ranks("zero_disk::zero_disk_worker", 2, dir.path()).expect("both ranks train");
    for rank in 0..2 {
        assert!(dir.path().join(format!("ok-rank{rank}")).is_file());
    }
}
