//! Gradients per parameter group (`StepConfig::offload_grads_at_least`): the large
//! parameters' gradients accumulate in files, the small ones' in memory. AdamW stepped
//! in backward from them trains bitwise as AdamW stepped after backward on the same
//! micro-batches, and as with every gradient in files.
use crate::common::Mlp;
use memsave_step::config::{GradsAfter, StepConfig};
use memsave_step::{OptimizerSpec, TrainerBuilder, Workload};
use serial_test::serial;

fn host(model: &Mlp) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap())
        .collect()
}

/// The weights after three steps of 2 micro-batches with AdamW: stepped after
/// backward (`files` None), or in backward with gradients in files, those of
/// parameters under `at_least` bytes in memory.
fn trained(files: Option<Option<u64>>) -> Vec<Vec<f32>> {
    let mut model = Mlp::new(3, 16, 8, 4);
    let mut config = StepConfig::baseline();
    config.micro_batches = Some(2);
    let mut adamw = OptimizerSpec::default();
    if let Some(at_least) = files {
        config.offload_grads = Some(GradsAfter::Dropped);
        config.offload_grads_at_least = at_least;
        adamw.in_backward = true;
    }
    config.optimizer = Some(adamw);
    let mut trainer = TrainerBuilder::new(config).build(&mut model).unwrap();
    let x = trainer.model().batch(8).unwrap();
    for _ in 0..3 {
        trainer.step(&x).unwrap();
    }
    drop(trainer);
    host(&model)
}

#[test]
#[serial]
fn adamw_in_backward_from_gradients_in_files_and_in_memory_by_group_is_plain_adamw() {
    let plain = trained(None);
    // Weights of 16 x 32 floats (2 KiB) in files; biases (64 and 128 B) in memory.
    let by_group = trained(Some(Some(1024)));
    let all_in_files = trained(Some(None));
    let in_memory = trained(Some(Some(u64::MAX)));
    assert!(by_group == plain, "by group differs from plain AdamW");
    assert!(
        all_in_files == plain,
        "all in files differs from plain AdamW"
    );
    assert!(
        in_memory == plain,
        "all kept in memory differs from plain AdamW"
    );
    assert!(
        plain != host(&Mlp::new(3, 16, 8, 4)),
        "the optimizer stepped"
    );
}

/// Levers per layer on a chain replace its schedule: beside a checkpoint plan they are
/// refused (the plan would be dropped without a word); alone, the layers go under
/// `Plan::PerLayer` and each runs under its lever.
#[test]
#[serial]
fn block_levers_on_a_chain_replace_its_schedule_and_are_refused_beside_one() {
    use memsave_checkpoint::{BlockKey, BlockLever, Plan};
    use memsave_step::config::PlanChoice;
    let levers = vec![(BlockKey::new("layer 1", 0), BlockLever::Recompute)];
    let mut model = Mlp::new(3, 16, 8, 4);
    let mut config = StepConfig::baseline();
    config.plan = PlanChoice::Fixed(Plan::EveryLayer);
    let Err(err) = TrainerBuilder::new(config)
        .block_levers(levers.clone())
        .build(&mut model)
    else {
        panic!("block levers beside a schedule were taken");
    };
    let err = err.to_string();
    assert!(err.contains("beside its checkpoint schedule"), "{err}");
    let mut trainer = TrainerBuilder::new(StepConfig::baseline())
        .block_levers(levers)
        .build(&mut model)
        .unwrap();
    let x = trainer.model().batch(8).unwrap();
    trainer.step(&x).unwrap();
    let layers = trainer.model().layers();
    assert_eq!(layers.plan(), Plan::PerLayer);
    let ran: Vec<String> = layers
        .blocks()
        .last_forward()
        .into_iter()
        .map(|r| r.lever)
        .collect();
    assert_eq!(ran, ["keep", "recompute", "keep"]);
}
