//! Issue #25: BatchNorm's running statistics after one training step are bitwise a
//! plain step's under every checkpoint plan (None, EveryLayer, Segments, Nested,
//! Budget), on the zoo's ResNet-18 and MobileNetV2 (whose dropout the recomputation
//! must replay too). The expected values are the plain step's, computed by running the
//! model without any plan.
use memsave_checkpoint::Plan;
use memsave_models::{Architecture, MobileNetV2Config, ResNetConfig, ZooWorkload};
use memsave_step::Workload;
use std::sync::Mutex;
use tch::{Device, Tensor};

/// The tests seed libtorch's global random stream: one at a time.
static SEEDED: Mutex<()> = Mutex::new(());

fn build(arch: &Architecture) -> ZooWorkload {
    tch::manual_seed(0);
    ZooWorkload::new("m", arch, 4, Device::Cpu).unwrap()
}

/// One training step under `plan` from the same model, batch and random stream; the
/// buffers and the gradients afterwards.
fn step(arch: &Architecture, plan: Option<Plan>) -> (Vec<Tensor>, Vec<Tensor>) {
    let mut model = build(arch);
    let batch = model.batch(4).unwrap();
    if let Some(plan) = plan {
        if let Plan::Budget(_) = plan {
            memsave_step::plan::f_profile(&mut model, &batch).unwrap();
        }
        model.layers_mut().set_plan(plan).unwrap();
        assert_ne!(
            model.layers().schedule().forward_count(),
            model.layers().len(),
            "{plan:?} recomputes nothing"
        );
    }
    tch::manual_seed(1);
    let out = model.layers().f_forward_t(&batch.input, true).unwrap();
    let loss = model.loss(&out, batch.target.as_ref()).unwrap();
    loss.backward();
    let buffers = model.buffers().iter().map(Tensor::copy).collect();
    let grads = model.parameters().iter().map(|p| p.grad().copy()).collect();
    (buffers, grads)
}

fn check(arch: &Architecture) {
    let _one_at_a_time = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
    let fresh: Vec<Tensor> = build(arch).buffers().iter().map(Tensor::copy).collect();
    let (plain, plain_grads) = step(arch, None);
    assert!(!plain.is_empty());
    assert!(
        plain.iter().zip(&fresh).any(|(a, b)| !a.equal(b)),
        "a plain step moved no running statistic"
    );
    // The smallest budget the solver can meet (it recomputes to get there), as it
    // reports when asked for nothing.
    let mut model = build(arch);
    let batch = model.batch(4).unwrap();
    memsave_step::plan::f_profile(&mut model, &batch).unwrap();
    let budget = match model.layers_mut().set_plan(Plan::Budget(0)) {
        Err(memsave_checkpoint::CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        }) => smallest_feasible.0,
        other => panic!("a zero budget: {other:?}"),
    };
    drop(model);
    for plan in [
        Plan::None,
        Plan::EveryLayer,
        Plan::Segments(3),
        Plan::Nested,
        Plan::Budget(budget),
    ] {
        let (stats, grads) = step(arch, (plan != Plan::None).then_some(plan));
        assert_eq!(stats.len(), plain.len());
        for (i, (a, b)) in stats.iter().zip(&plain).enumerate() {
            assert!(a.equal(b), "{plan:?}: running statistic {i} differs");
        }
        for (i, (a, b)) in grads.iter().zip(&plain_grads).enumerate() {
            assert!(a.equal(b), "{plan:?}: gradient {i} differs");
        }
    }
}

#[test]
#[serial_test::serial]
fn resnet18_running_statistics_are_a_plain_steps_under_every_plan() {
    let arch = Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 5,
        image: [3, 32, 32],
    });
    check(&arch);
}

#[test]
#[serial_test::serial]
fn mobilenet_v2_running_statistics_are_a_plain_steps_under_every_plan() {
    let arch = Architecture::MobileNetV2(MobileNetV2Config {
        classes: 5,
        image: [3, 32, 32],
    });
    check(&arch);
}
