//! A Trainer a user steers: learning rates per step (by hand or by a scheduler), the
//! optimizer within reach, and its state saved from one trainer and loaded into another.
use crate::common::Mlp;
use memsave_step::{
    CosineDecay, LRScheduler, OptimizerKind, OptimizerSpec, StepConfig, StepError, TrainerBuilder,
    Workload,
};
use serial_test::serial;
use tch::Tensor;

fn adamw() -> OptimizerSpec {
    OptimizerSpec {
        kind: OptimizerKind::Adamw,
        ..Default::default()
    }
}

fn weights(model: &Mlp) -> Vec<Tensor> {
    model
        .parameters()
        .iter()
        .map(|p| p.detach().copy())
        .collect()
}

/// Warmup then cosine decay over 40 steps.
fn schedule() -> Box<dyn LRScheduler> {
    Box::new(CosineDecay {
        lr: 1e-2,
        min_lr: 1e-4,
        warmup_steps: 5,
        total_steps: 40,
    })
}

/// 20 steps, save, a new trainer over a copy of the weights loads the state and runs
/// 20 more: the weights of 40 uninterrupted steps, bit for bit, under the same
/// schedule.
#[test]
#[serial]
fn save_load_from_the_trainer_continues_bitwise_under_a_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("optimizer.json");
    let config = StepConfig::baseline();

    let mut whole = Mlp::new(2, 8, 4, 3);
    let mut first = Mlp::new(2, 8, 4, 3);
    let mut second = Mlp::new(2, 8, 4, 3);
    let batch = whole.batch(4).unwrap();
    {
        let mut trainer = TrainerBuilder::new(config.clone())
            .optimizer(adamw())
            .build(&mut whole)
            .unwrap();
        trainer.set_lr_scheduler(Some(schedule()));
        for _ in 0..40 {
            trainer.step(&batch).unwrap();
        }
    }
    {
        let mut trainer = TrainerBuilder::new(config.clone())
            .optimizer(adamw())
            .build(&mut first)
            .unwrap();
        trainer.set_lr_scheduler(Some(schedule()));
        for _ in 0..20 {
            trainer.step(&batch).unwrap();
        }
        trainer.optimizer().unwrap().save(&file).unwrap();
    }
    tch::no_grad(|| {
        for (mut to, from) in second.parameters().into_iter().zip(first.parameters()) {
            to.copy_(&from);
        }
    });
    let mut trainer = TrainerBuilder::new(config)
        .optimizer(adamw())
        .build(&mut second)
        .unwrap();
    trainer.optimizer().unwrap().load(&file).unwrap();
    trainer.set_steps(20);
    trainer.set_lr_scheduler(Some(schedule()));
    for _ in 0..20 {
        trainer.step(&batch).unwrap();
    }
    let resumed = weights(trainer.model());
    drop(trainer);
    for (i, (a, b)) in resumed.iter().zip(weights(&whole)).enumerate() {
        assert!(a.equal(&b), "parameter {i} differs after resuming");
    }
}

/// The rate a scheduler or `set_lr` gives is the optimizer's for the next step, and
/// changes the training; bad rates and groups are refused.
#[test]
#[serial]
fn learning_rates_are_set_per_step_and_per_group() {
    let mut a = Mlp::new(2, 8, 4, 3);
    let mut b = Mlp::new(2, 8, 4, 3);
    let batch = a.batch(4).unwrap();
    let mut plain = TrainerBuilder::new(StepConfig::baseline())
        .optimizer(adamw())
        .build(&mut a)
        .unwrap();
    for _ in 0..3 {
        plain.step(&batch).unwrap();
    }
    assert_eq!(plain.optimizer().unwrap().lrs(), [1e-3]);
    drop(plain);

    let mut steered = TrainerBuilder::new(StepConfig::baseline())
        .optimizer(adamw())
        .build(&mut b)
        .unwrap();
    steered.set_lr_scheduler(Some(Box::new(|step: u64| 0.5 / (step + 1) as f64)));
    for _ in 0..3 {
        steered.step(&batch).unwrap();
    }
    // The rate of step 2 (the third).
    assert_eq!(steered.optimizer().unwrap().lrs(), [0.5 / 3.0]);
    steered.set_lr_scheduler(None);
    steered.set_lr(0.25).unwrap();
    let opt = steered.optimizer().unwrap();
    assert_eq!(opt.lrs(), [0.25]);
    opt.set_group_lr(0, 0.125).unwrap();
    assert_eq!(opt.lrs(), [0.125]);
    let e = opt.set_group_lr(1, 0.1).unwrap_err();
    assert!(matches!(e, StepError::InvalidConfig(_)), "{e}");
    assert!(e.to_string().contains("group 1 does not exist"), "{e}");
    let e = opt.set_lr(f64::NAN).unwrap_err();
    assert!(e.to_string().contains("lr must be finite"), "{e}");
    assert_eq!(opt.lrs(), [0.125]);
    drop(steered);
    let changed = weights(&a)
        .iter()
        .zip(weights(&b))
        .any(|(x, y)| !x.equal(&y));
    assert!(changed, "the scheduled rates trained the same weights");
}
