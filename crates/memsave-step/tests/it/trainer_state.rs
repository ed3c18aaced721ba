//! What a ZeRO-3 trainer leaves in the model and on disk: its weights put back into
//! the model before it is dropped (those of one process), NaN rather than plausible
//! zeros when it is dropped without that, and a sharded checkpoint from which a new
//! trainer continues bit for bit. Two ranks are processes over 127.0.0.1 (this test
//! binary started again by memsave-dist's launcher).
use crate::common::Mlp;
use crate::data_parallel::{join_group, out_dir, run_ranks};
use memsave_dist::{InitOptions, ProcessGroup};
use memsave_step::step::max_abs_diff;
use memsave_step::{
    DataParallel, FsdpConfig, OptimizerKind, OptimizerSpec, StepConfig, TrainerBuilder, Workload,
};
use serial_test::serial;
use std::path::Path;

const WORLD: i64 = 2;
const BATCH: i64 = 8;
/// Steps before the checkpoint, and after it.
const BEFORE: usize = 2;
const AFTER: usize = 2;

fn model() -> Mlp {
    Mlp::new(2, 15, BATCH, 4)
}

fn config() -> StepConfig {
    StepConfig {
        optimizer: Some(OptimizerSpec {
            kind: OptimizerKind::Adamw,
            lr: Some(1e-2),
            weight_decay: Some(0.1),
            ..OptimizerSpec::default()
        }),
        ..StepConfig::baseline()
    }
}

fn zero3() -> DataParallel {
    DataParallel::Fsdp(FsdpConfig::default())
}

/// The values the model's own parameters hold (what `VarStore::save` would write).
fn weights(model: &Mlp) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| Vec::<f32>::try_from(&p.detach().reshape([-1])).unwrap())
        .collect()
}

fn write_values(path: &Path, values: &[Vec<f32>]) {
    let bytes: Vec<u8> = values
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

fn read_values(path: &Path, like: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut flat = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
    let out = like
        .iter()
        .map(|v| flat.by_ref().take(v.len()).collect())
        .collect();
    assert!(flat.next().is_none(), "{}: too many values", path.display());
    out
}

#[test]
#[ignore = "a rank of trainer_state::a_zero3_trainer_gives_back_its_weights_and_resumes_from_its_checkpoint: started by the launcher"]
fn trainer_state_worker() {
    let out = out_dir();
    let group = join_group();
    let rank = group.rank() as i64;
    let share = BATCH / WORLD;
    let checkpoint = out.join("checkpoint");
    // Trained, checkpointed after BEFORE steps, given back, trained on, then given back
    // again and dropped.
    let mut trained = model();
    let x = trained
        .batch(BATCH)
        .unwrap()
        .f_narrow(rank * share, share)
        .unwrap();
    {
        let mut trainer = TrainerBuilder::new(config())
            .data_parallel(&group, zero3())
            .build(&mut trained)
            .unwrap();
        for _ in 0..BEFORE {
            trainer.step(&x).unwrap();
        }
        trainer.save_sharded(&checkpoint).unwrap();
        // Given back between steps, training goes on from the shards as before.
        trainer.restore_full_parameters().unwrap();
        for _ in 0..AFTER {
            trainer.step(&x).unwrap();
        }
        trainer.restore_full_parameters().unwrap();
    }
    write_values(&out.join(format!("trained-rank{rank}")), &weights(&trained));
    // A new model and trainer, from the checkpoint, for the same steps after it.
    let mut resumed = model();
    {
        let mut trainer = TrainerBuilder::new(config())
            .data_parallel(&group, zero3())
            .build(&mut resumed)
            .unwrap();
        trainer.load_sharded(&checkpoint).unwrap();
        assert_eq!(trainer.steps(), BEFORE as u64, "the checkpoint's step");
        for _ in 0..AFTER {
            trainer.step(&x).unwrap();
        }
        trainer.restore_full_parameters().unwrap();
    }
    write_values(&out.join(format!("resumed-rank{rank}")), &weights(&resumed));
}

#[test]
#[serial]
fn a_zero3_trainer_gives_back_its_weights_and_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    run_ranks("trainer_state::trainer_state_worker", dir.path());
    // One process, the same steps on the whole batch.
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let mut one = model();
    let x = one.batch(BATCH).unwrap();
    {
        let mut trainer = TrainerBuilder::new(config()).build(&mut one).unwrap();
        for _ in 0..BEFORE + AFTER {
            trainer.step(&x).unwrap();
        }
    }
    tch::set_num_threads(threads);
    let reference = weights(&one);
    assert_ne!(reference, weights(&model()), "training moved the weights");
    for rank in 0..WORLD {
        let trained = read_values(&dir.path().join(format!("trained-rank{rank}")), &reference);
        // Before, the dropped trainer left every parameter reading zero.
        let diff = max_abs_diff(&trained, &reference);
        assert!(
            diff <= 1e-6,
            "rank {rank}: {diff} from one process's weights"
        );
        let resumed = read_values(&dir.path().join(format!("resumed-rank{rank}")), &reference);
        let bits =
            |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
        assert_eq!(
            bits(&resumed),
            bits(&trained),
            "rank {rank}: resumed != trained"
        );
    }
}

#[test]
#[serial]
fn a_zero3_trainer_dropped_without_restoring_leaves_nan_and_refuses_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let group =
        ProcessGroup::new_file(&dir.path().join("store"), 0, 1, &InitOptions::default()).unwrap();
    let mut model = model();
    let x = model.batch(BATCH).unwrap();
    {
        let mut trainer = TrainerBuilder::new(config())
            .data_parallel(&group, zero3())
            .build(&mut model)
            .unwrap();
        trainer.step(&x).unwrap();
    }
    // Not zeros (what a VarStore::save wrote before, with Ok): NaN, which no one takes
    // for weights.
    for (i, w) in weights(&model).iter().enumerate() {
        assert!(w.iter().all(|v| v.is_nan()), "parameter {i}: {:?}", &w[..3]);
    }
    let err = model
        .layers()
        .f_forward(&x.input)
        .expect_err("the layers ran on lost weights")
        .to_string();
    assert!(err.contains("its weights are lost"), "{err}");
}
