//! Sharded checkpoints of ZeRO-3 training: 2 ranks train 20 steps, or 10, save, resume
//! in fresh processes' state (another initialization, another RNG state) and train 10
//! more: the weights must be bitwise equal. A missing, cut or damaged shard file, a
//! directory without a manifest, another model and another world size are refused with
//! an error that starts with the rank and names the cause, before anything changes.
use crate::common;
use crate::fsdp::{flat, layers_of, sharded, units_forward, CONFIG, DIMS};

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memsave_dist::{init_process_group, Fsdp, FsdpConfig, FsdpUnit, InitOptions, ProcessGroup};
use memsave_optim::{AdamW, Optimizer};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

const LOCAL_BATCH: i64 = 6;

struct Run {
    fsdp: Fsdp,
    units: Vec<Arc<Mutex<FsdpUnit>>>,
    opt: Optimizer<memsave_optim::AdamWConfig>,
}

fn build(group: &ProcessGroup, dims: &[i64], seed: i64) -> Run {
    let (_vs, layers) = layers_of(dims, seed);
    let mut fsdp = Fsdp::new(group, FsdpConfig::default()).expect("fsdp");
    let units = sharded(&mut fsdp, layers);
    let opt = AdamW::new(&fsdp.parameters(), CONFIG).expect("optimizer");
    Run { fsdp, units, opt }
}

/// Trains `steps` steps, each on a batch drawn from this process's generator (so that
/// resuming needs its state back).
fn train(run: &mut Run, steps: usize) {
    for _ in 0..steps {
        let x = Tensor::randn([LOCAL_BATCH, DIMS[0]], (Kind::Float, Device::Cpu));
        let y = Tensor::randn([LOCAL_BATCH, DIMS[8]], (Kind::Float, Device::Cpu));
        let loss = run
            .fsdp
            .forward(|| {
                let mut h = x.shallow_clone();
                for unit in &run.units {
                    h = units_forward(unit, &h);
                }
                h.mse_loss(&y, tch::Reduction::Mean)
            })
            .expect("forward");
        loss.backward();
        run.fsdp.f_finish_backward().expect("finish_backward");
        run.opt.f_step().expect("step");
        run.opt.zero_grad(true);
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The shards' values, to check that a refused load changed nothing.
fn shard_values(run: &Run) -> Vec<f32> {
    flat(&run.fsdp.parameters())
}

/// Loads `dir` into a fresh run and checks the refusal: every rank errs with a message
/// that starts with its rank and contains `mine` (or, on ranks in `others_see`, the text
/// given there), and nothing changed.
fn refused(group: &ProcessGroup, dir: &Path, dims: &[i64], expect: impl Fn(usize) -> String) {
    let rank = group.rank();
    let mut run = build(group, dims, 7);
    let before = shard_values(&run);
    let err = run
        .fsdp
        .load_sharded(dir, &mut run.opt)
        .expect_err("the checkpoint is refused")
        .to_string();
    let prefix = format!("rank {rank}: checkpoint {}: ", dir.display());
    assert!(err.starts_with(&prefix), "{err}");
    let wanted = expect(rank);
    assert!(
        err.contains(&wanted),
        "rank {rank}: {err}\nshould contain: {wanted}"
    );
    assert_eq!(shard_values(&run), before, "rank {rank}: weights unchanged");
    assert_eq!(run.opt.step_count(0), 0, "rank {rank}: optimizer unchanged");
}

#[test]
#[ignore = "a rank of the sharded checkpoint tests: started by the launcher"]
fn fsdp_checkpoint_worker() {
    let out = common::out_dir();
    let options = InitOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    let rank = group.rank();
    let seed = 100 + rank as i64;

    // Uninterrupted: 20 steps.
    let mut a = build(&group, &DIMS, 1);
    tch::manual_seed(seed);
    train(&mut a, 20);
    let expected = flat(&a.fsdp.f_full_parameters().expect("full"));

    // 10 steps, saved.
    let ckpt = out.join("ckpt");
    let mut b = build(&group, &DIMS, 1);
    tch::manual_seed(seed);
    train(&mut b, 10);
    b.fsdp.save_sharded(&ckpt, &b.opt, 10).expect("save");
    drop(b);

    // Resumed from another initialization and RNG state: 10 more.
    let mut c = build(&group, &DIMS, 7);
    tch::manual_seed(999);
    assert_ne!(
        bits(&flat(&c.fsdp.f_full_parameters().unwrap())),
        bits(&flat(&a.fsdp.f_full_parameters().unwrap())),
        "another initialization"
    );
    let step = c.fsdp.load_sharded(&ckpt, &mut c.opt).expect("load");
    assert_eq!(step, 10);
    assert_eq!(c.opt.step_count(0), 10);
    train(&mut c, 10);
    let resumed = flat(&c.fsdp.f_full_parameters().expect("full"));
    assert_eq!(
        bits(&resumed),
        bits(&expected),
        "rank {rank}: bitwise equal"
    );
    assert_eq!(c.opt.step_count(0), 20);

    // The whole model in one ordinary file on rank 0.
    let full_path = out.join("full.ot");
    c.fsdp.save_full(&full_path).expect("save_full");
    if rank == 0 {
        let loaded = Tensor::load_multi(&full_path).expect("an ordinary tch file");
        assert_eq!(loaded.len(), 16);
        assert_eq!(loaded[0].0, "unit0.param0");
        assert_eq!(loaded[15].0, "unit7.param1");
        let values: Vec<Tensor> = loaded.into_iter().map(|(_, t)| t).collect();
        assert_eq!(bits(&flat(&values)), bits(&expected));
    }

    // Damaged copies, prepared by rank 0.
    let variants = ["flipped", "cut", "missing", "no-manifest"];
    if rank == 0 {
        for v in variants {
            let dir = out.join(v);
            std::fs::create_dir_all(&dir).unwrap();
            for entry in std::fs::read_dir(&ckpt).unwrap() {
                let entry = entry.unwrap();
                std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
            }
            let shard1 = dir.join("rank-1-of-2.shard");
            match v {
                "flipped" => {
                    let mut bytes = std::fs::read(&shard1).unwrap();
                    let middle = bytes.len() / 2;
                    bytes[middle] ^= 0x10;
                    std::fs::write(&shard1, bytes).unwrap();
                }
                "cut" => {
                    let bytes = std::fs::read(&shard1).unwrap();
                    std::fs::write(&shard1, &bytes[..bytes.len() - 3]).unwrap();
                }
                "missing" => std::fs::remove_file(&shard1).unwrap(),
                _ => std::fs::remove_file(dir.join("manifest")).unwrap(),
            }
        }
    }
    group.barrier().expect("barrier");
    let shard1 = |v: &str| out.join(v).join("rank-1-of-2.shard").display().to_string();
    refused(&group, &out.join("flipped"), &DIMS, |r| {
        if r == 1 {
            format!("shard file {} is damaged: its CRC-32 is", shard1("flipped"))
        } else {
            "ranks [1] could not load it (their errors say why); nothing was loaded".to_owned()
        }
    });
    refused(&group, &out.join("cut"), &DIMS, |_| {
        format!("shard file {} is damaged: ", shard1("cut"))
    });
    refused(&group, &out.join("missing"), &DIMS, |_| {
        format!("shard file {} is missing", shard1("missing"))
    });
    refused(&group, &out.join("no-manifest"), &DIMS, |_| {
        "no manifest (".to_owned()
    });
    let mut other = DIMS;
    other[8] = 4;
    refused(&group, &ckpt, &other, |_| {
        "it was written for another model: 8 units of 1284 values there, 8 units of 1301 values here"
            .to_owned()
    });
    std::fs::write(out.join(format!("ok-rank{rank}")), "").expect("write ok");
}

#[test]
#[serial]
fn a_sharded_checkpoint_resumes_bitwise_and_refuses_what_does_not_fit() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::run_ranks("fsdp_checkpoint::fsdp_checkpoint_worker", 2, dir.path())
        .expect("every rank succeeds");
    for rank in 0..2 {
        assert!(dir.path().join(format!("ok-rank{rank}")).is_file());
    }
    // Another world size: one rank in this process.
    let store = tempfile::tempdir().expect("tempdir");
    let group = ProcessGroup::new_file(&store.path().join("store"), 0, 1, &InitOptions::default())
        .expect("a group of one");
    let ckpt = dir.path().join("ckpt");
    refused(&group, &ckpt, &DIMS, |_| {
        "it was written by 2 ranks and this run has 1; resume on 2 ranks".to_owned()
    });
}

/// The files in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read the checkpoint directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

#[test]
#[ignore = "a rank of the sharded checkpoint tests: started by the launcher"]
fn failed_save_and_load_worker() {
    let out = common::out_dir();
    let options = InitOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    let rank = group.rank();
    tch::manual_seed(100 + rank as i64);

    // A save that fails on rank 1 (an optimizer over other tensors) after rank 0 wrote
    // its file keeps the checkpoint saved before it, and leaves no file of its own.
    let ckpt = out.join("ckpt");
    let mut a = build(&group, &DIMS, 1);
    train(&mut a, 2);
    a.fsdp.save_sharded(&ckpt, &a.opt, 2).expect("save");
    let at_2 = shard_values(&a);
    train(&mut a, 1);
    let stranger = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let stranger = AdamW::new(&[stranger], CONFIG).expect("optimizer");
    let opt = if rank == 1 { &stranger } else { &a.opt };
    let err = a
        .fsdp
        .save_sharded(&ckpt, opt, 3)
        .expect_err("the save fails")
        .to_string();
    let wanted = if rank == 1 {
        "the optimizer holds 1 tensors that are not this Fsdp's 16 parameter shards"
    } else {
        "ranks [1] could not write it"
    };
    assert!(err.contains(wanted), "rank {rank}: {err}");
    group.barrier().expect("barrier");
    let first = ["manifest", "rank-0-of-2.shard", "rank-1-of-2.shard"];
    assert_eq!(listing(&ckpt), first, "rank {rank}");
    let mut c = build(&group, &DIMS, 7);
    let step = c
        .fsdp
        .load_sharded(&ckpt, &mut c.opt)
        .expect("the earlier checkpoint still loads");
    assert_eq!((step, c.opt.step_count(0)), (2, 2), "rank {rank}");
    assert_eq!(bits(&shard_values(&c)), bits(&at_2), "rank {rank}");

    // The save that succeeds replaces it, and the earlier files go.
    a.fsdp.save_sharded(&ckpt, &a.opt, 3).expect("save");
    let at_3 = shard_values(&a);
    group.barrier().expect("barrier");
    let second = [
        "manifest",
        "rank-0-of-2.next.shard",
        "rank-1-of-2.next.shard",
    ];
    assert_eq!(listing(&ckpt), second, "rank {rank}");
    let step = c.fsdp.load_sharded(&ckpt, &mut c.opt).expect("load");
    assert_eq!((step, c.opt.step_count(0)), (3, 3), "rank {rank}");
    assert_eq!(bits(&shard_values(&c)), bits(&at_3), "rank {rank}");

    // A load whose optimizer state rank 1 refuses (its optimizer has two parameter
    // groups, the saved one had one) changes no rank: rank 0 loaded its own and puts
    // it back.
    let mut d = build(&group, &DIMS, 7);
    if rank == 1 {
        let shards = d.fsdp.parameters();
        let mut opt = AdamW::new(&shards[..4], CONFIG).expect("optimizer");
        opt.add_param_group(&shards[4..], CONFIG).expect("group");
        d.opt = opt;
    }
    train(&mut d, 1);
    let before = shard_values(&d);
    let err = d
        .fsdp
        .load_sharded(&ckpt, &mut d.opt)
        .expect_err("rank 1 refuses the optimizer state")
        .to_string();
    let wanted = if rank == 1 {
        "the optimizer state in rank 1's shard file: "
    } else {
        "ranks [1] could not load it (their errors say why); nothing was loaded"
    };
    assert!(err.contains(wanted), "rank {rank}: {err}");
    assert_eq!(d.opt.step_count(0), 1, "rank {rank}: optimizer unchanged");
    assert_eq!(d.opt.step_count(7), 1, "rank {rank}: optimizer unchanged");
    assert_eq!(bits(&shard_values(&d)), bits(&before), "rank {rank}");
    // And it still trains, from where it was.
    train(&mut d, 1);
    assert_eq!(d.opt.step_count(0), 2, "rank {rank}");
    std::fs::write(out.join(format!("ok-rank{rank}")), "").expect("write ok");
}

#[test]
#[serial]
fn a_failed_save_keeps_the_earlier_checkpoint_and_a_failed_load_changes_no_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::run_ranks(
        "fsdp_checkpoint::failed_save_and_load_worker",
        2,
        dir.path(),
    )
    .expect("every rank succeeds");
    for rank in 0..2 {
        assert!(dir.path().join(format!("ok-rank{rank}")).is_file());
    }
}
