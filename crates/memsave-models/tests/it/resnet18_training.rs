//! Issue #25 (what `examples/resnet18_fit.rs` shows, at a small size): the zoo's
//! ResNet-18 trained a few steps with a `Trainer` built from `fit`'s choice at half the
//! plain step's peak: the loss falls, every step's peak is within the budget, and
//! BatchNorm's running statistics (and the parameters) end bitwise equal to a plain run's
//! (the same seed, the same batch, `StepConfig::baseline()` through the `Trainer`).
use memsave_checkpoint::CheckpointedSequential;
use memsave_fit::{fit, FitRequest};
use memsave_models::{Architecture, ResNetConfig, ZooWorkload};
use memsave_step::{
    Batch, OptimizerKind, OptimizerSpec, StepConfig, Trainer, TrainerBuilder, Workload,
};
use std::cell::RefCell;
use tch::{Device, Kind, Tensor};

const BATCH: i64 = 8;
const CLASSES: i64 = 4;
const IMAGE: i64 = 32;
const STEPS: usize = 4;

/// ResNet-18 on images that are a fixed random pattern per class plus noise, trained
/// with SGD; notes the loss of each batch its steps compute.
struct Patterned {
    zoo: ZooWorkload,
    data: Batch,
    losses: RefCell<Vec<(f64, i64)>>,
}

impl Patterned {
    fn new() -> Patterned {
        tch::manual_seed(3);
        let config = ResNetConfig {
            depth: 18,
            classes: CLASSES,
            image: [3, IMAGE, IMAGE],
        };
        let zoo = ZooWorkload::new(
            "resnet18",
            &Architecture::ResNet(config),
            BATCH,
            Device::Cpu,
        )
        .unwrap();
        let opts = (Kind::Float, Device::Cpu);
        let patterns = Tensor::randn([CLASSES, 3, IMAGE, IMAGE], opts);
        let labels = Tensor::arange(BATCH, (Kind::Int64, Device::Cpu)).remainder(CLASSES);
        let input =
            patterns.index_select(0, &labels) + Tensor::randn([BATCH, 3, IMAGE, IMAGE], opts) * 0.5;
        Patterned {
            zoo,
            data: Batch {
                input,
                target: Some(labels),
            },
            losses: RefCell::new(Vec::new()),
        }
    }

    fn take_loss(&self) -> f64 {
        let noted = std::mem::take(&mut *self.losses.borrow_mut());
        let n: i64 = noted.iter().map(|(_, n)| n).sum();
        assert!(n > 0, "the step computed no loss");
        noted.iter().map(|(l, k)| l * *k as f64).sum::<f64>() / n as f64
    }
}

impl Workload for Patterned {
    fn name(&self) -> &str {
        "resnet18"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        self.zoo.layers()
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        self.zoo.layers_mut()
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.zoo.parameters()
    }
    fn buffers(&self) -> Vec<Tensor> {
        self.zoo.buffers()
    }
    fn global_batch(&self) -> i64 {
        BATCH
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        assert!(size <= BATCH, "a batch of {size}");
        self.data.f_narrow(0, size)
    }
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, tch::TchError> {
        let loss = self.zoo.loss(output, target)?;
        self.losses
            .borrow_mut()
            .push((loss.f_double_value(&[])?, output.size()[0]));
        Ok(loss)
    }
    fn optimizer(&self) -> Option<OptimizerSpec> {
        Some(OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr: Some(0.05),
            ..Default::default()
        })
    }
}

/// `STEPS` steps on the model's batch: each one's loss and peak on the device as
/// `fit`'s budget counts it (less what the process holds besides the model's
/// parameters and data: the other model).
fn train(trainer: &mut Trainer<'_, Patterned>) -> Vec<(f64, u64)> {
    let outside = memsave_meter::memory_allocated(tch::Device::Cpu)
        - crate::counted_before_step(trainer.model(), BATCH);
    let x = trainer.model().batch(BATCH).unwrap();
    trainer.model().losses.borrow_mut().clear();
    (0..STEPS)
        .map(|_| {
            let m = trainer.step(&x).unwrap();
            (trainer.model().take_loss(), m.device_peak_bytes() - outside)
        })
        .collect()
}

fn copies(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(Tensor::copy).collect()
}

#[test]
#[serial_test::serial]
fn resnet18_trained_with_fit_s_choice_matches_plain_training_within_the_budget() {
    memsave_meter::install();
    let mut plain = Patterned::new();
    let fresh_stats = copies(&plain.buffers());
    let mut config = StepConfig::baseline();
    config.optimizer = plain.optimizer();
    let plain_steps = train(&mut TrainerBuilder::new(config).build(&mut plain).unwrap());
    // The whole device: what the step begins with (the parameters and the data: SGD
    // keeps no state) and half of what it allocates above that.
    let kept = crate::counted_before_step(&plain, BATCH);
    let budget = kept + (plain_steps[0].1 - kept) / 2;

    let mut model = Patterned::new();
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap();
    let choice = &report.choice;
    assert_ne!(choice.strategy, "baseline", "{}", report.to_text());
    assert!(choice.is_lossless(), "{}", report.to_text());
    let steps = train(&mut report.trainer(&mut model).unwrap());

    let losses: Vec<f64> = steps.iter().map(|s| s.0).collect();
    assert!(
        losses[STEPS - 1] < losses[0],
        "the loss did not fall with {}: {losses:?}",
        choice.strategy
    );
    for (i, (_, peak)) in steps.iter().enumerate() {
        assert!(
            *peak <= budget,
            "step {i} of {} peaked at {peak}, over the budget {budget}",
            choice.strategy
        );
    }
    let stats = plain.buffers();
    assert!(
        stats.iter().zip(&fresh_stats).any(|(a, b)| !a.equal(b)),
        "training moved no running statistic"
    );
    let got = model.buffers();
    assert_eq!(got.len(), stats.len());
    for (i, (a, b)) in got.iter().zip(&stats).enumerate() {
        assert!(
            a.equal(b),
            "running statistic {i} differs from the plain run's under {}",
            choice.strategy
        );
    }
    for (i, (a, b)) in model
        .parameters()
        .iter()
        .zip(&plain.parameters())
        .enumerate()
    {
        assert!(
            a.equal(b),
            "parameter {i} differs from the plain run's under {}",
            choice.strategy
        );
    }
    // The same losses, step by step, as the plain run's.
    let plain_losses: Vec<f64> = plain_steps.iter().map(|s| s.0).collect();
    assert_eq!(losses, plain_losses);
}
