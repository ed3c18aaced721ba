//! The zoo's ResNet-18 trained with `fit`'s choice at half its plain step's own bytes, and
//! checked against plain training.
//!
//! The images are synthetic: each class has a fixed random pattern, and an image is its
//! class's pattern plus noise, so the loss can fall. The model asks for SGD (no state,
//! so every step's peak is comparable with the budget). The example first trains a
//! twin (the same seed, the same batch) plainly with a `Trainer` of
//! `StepConfig::baseline()`, whose first step's peak on the device sets the budget;
//! then `fit` chooses for its parameters and input and half the rest, and a `Trainer` built from its report trains the model.
//! It prints the choice, each step's loss and peak against the budget, and whether
//! BatchNorm's running statistics (and the parameters) end bitwise equal to the plain
//! run's. It exits with an error if they do not, if the loss did not fall, or if a
//! step's peak passed the budget.
//!
//!   cargo run --release --example resnet18_fit
//!   cargo run --release --example resnet18_fit -- --steps 10 --image 64
use anyhow::{Context, Result};
use clap::Parser;
use memsave::checkpoint::CheckpointedSequential;
use memsave::fit::{fit, FitRequest};
use memsave::meter::{install, Bytes};
use memsave::models::{Architecture, ResNetConfig, ZooWorkload};
use memsave::step::{
    Batch, OptimizerKind, OptimizerSpec, StepConfig, Trainer, TrainerBuilder, Workload,
};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
#[command(about = "Train the zoo's ResNet-18 with fit's choice at half the plain step's peak")]
struct Args {
    /// Training steps (each run).
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Images per step.
    #[arg(long, default_value_t = 16)]
    batch: i64,
    /// Image height and width.
    #[arg(long, default_value_t = 32)]
    image: i64,
    /// Classes.
    #[arg(long, default_value_t = 10)]
    classes: i64,
    /// The budget: what the plain step keeps (parameters, optimizer state, input) and
    /// this fraction of what it allocates above that.
    #[arg(long, default_value_t = 0.5)]
    fraction: f64,
    /// The seed of the model and the images.
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

/// The zoo's ResNet-18 on patterned images, trained with SGD.
struct PatternedResNet {
    zoo: ZooWorkload,
    data: Batch,
}

impl PatternedResNet {
    /// The network, then one pattern per class and `batch` noisy images of them (the
    /// classes in turn), all from `seed`.
    fn new(args: &Args) -> Result<PatternedResNet> {
        tch::manual_seed(args.seed);
        let image = [3, args.image, args.image];
        let config = ResNetConfig {
            depth: 18,
            classes: args.classes,
            image,
        };
        let zoo = ZooWorkload::new(
            "resnet18",
            &Architecture::ResNet(config),
            args.batch,
            Device::Cpu,
        )?;
        let patterns = Tensor::f_randn(
            [args.classes, 3, args.image, args.image],
            (Kind::Float, Device::Cpu),
        )?;
        let labels =
            Tensor::f_arange(args.batch, (Kind::Int64, Device::Cpu))?.f_remainder(args.classes)?;
        let noise = Tensor::f_randn(
            [args.batch, 3, args.image, args.image],
            (Kind::Float, Device::Cpu),
        )?;
        let input = patterns.f_index_select(0, &labels)? + noise * 0.5;
        Ok(PatternedResNet {
            zoo,
            data: Batch {
                input,
                target: Some(labels),
            },
        })
    }
}

impl Workload for PatternedResNet {
    fn name(&self) -> &str {
        "resnet18"
    }
    fn device(&self) -> Device {
        self.zoo.device()
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
    /// BatchNorm's running statistics: `fit` puts them back after its runs.
    fn buffers(&self) -> Vec<Tensor> {
        self.zoo.buffers()
    }
    fn global_batch(&self) -> i64 {
        self.data.len()
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        if size <= self.data.len() {
            return self.data.f_narrow(0, size);
        }
        let repeat = |t: &Tensor| -> Result<Tensor, tch::TchError> {
            let mut reps = vec![1i64; t.dim()];
            reps[0] = (size + self.data.len() - 1) / self.data.len();
            t.f_repeat(&reps)?.f_narrow(0, 0, size)
        };
        Ok(Batch {
            input: repeat(&self.data.input)?,
            target: self.data.target.as_ref().map(repeat).transpose()?,
        })
    }
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, tch::TchError> {
        self.zoo.loss(output, target)
    }
    fn optimizer(&self) -> Option<OptimizerSpec> {
        Some(OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr: Some(0.05),
            ..Default::default()
        })
    }
}

/// Runs `steps` steps of `trainer` on its model's batch; returns each step's loss (the
/// step computes it: no other forward, which in training mode would move BatchNorm's
/// running statistics), peak on the device as `fit`'s budget counts it (less what the
/// process holds besides the model's parameters: the other model, the data) and what
/// the step began with (the parameters and the input).
fn train(trainer: &mut Trainer<'_, PatternedResNet>, steps: usize) -> Result<Vec<(f64, u64, u64)>> {
    // What the process holds besides the model's parameters, buffers and the data its batches
    // are sliced from (a batch counts the storage it is in): the budget does not count it.
    let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let model = trainer.model();
    let data = model.batch(model.global_batch())?;
    let counted = model.parameters().iter().map(bytes).sum::<u64>()
        + model.buffers().iter().map(bytes).sum::<u64>()
        + bytes(&data.input)
        + data.target.as_ref().map_or(0, bytes);
    let outside = memsave::meter::memory_allocated(tch::Device::Cpu) - counted;
    let x = trainer.model().batch(trainer.model().global_batch())?;
    (0..steps)
        .map(|_| {
            let m = trainer.step(&x)?;
            let loss = m.loss.context("the step reported no loss")?;
            Ok((
                loss,
                m.device_peak_bytes() - outside,
                m.start_bytes - outside,
            ))
        })
        .collect()
}

/// Bitwise equality of two lists of tensors.
fn same(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.equal(b))
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.steps >= 2,
        "--steps must be at least 2 (the loss must fall)"
    );
    install();

    // Plain training of a twin: the reference, and the plain step's peak.
    let mut plain = PatternedResNet::new(&args)?;
    let mut config = StepConfig::baseline();
    config.optimizer = plain.optimizer();
    let plain_steps = train(
        &mut TrainerBuilder::new(config).build(&mut plain)?,
        args.steps,
    )?;
    let (plain_peak, kept) = (plain_steps[0].1, plain_steps[0].2);
    // What the step keeps (the parameters, the input) and a fraction of the rest.
    let budget = kept + ((plain_peak - kept) as f64 * args.fraction) as u64;
    println!(
        "resnet18, {} images of 3x{}x{} in {} classes, SGD; plain step's peak {} on the device ({} of it the parameters and the input), budget {}",
        args.batch,
        args.image,
        args.image,
        args.classes,
        Bytes(plain_peak),
        Bytes(kept),
        Bytes(budget)
    );

    let mut model = PatternedResNet::new(&args)?;
    let report = fit(&mut model, &FitRequest::new(budget))?;
    println!(
        "fit's choice: {} ({}; measured {} by fit, {:.1} s to choose)",
        report.choice.strategy,
        if report.choice.is_lossless() {
            "lossless"
        } else {
            "lossy"
        },
        Bytes(report.measured_peak_bytes),
        report.fit_time_s
    );
    let steps = train(&mut report.trainer(&mut model)?, args.steps)?;

    println!("step  loss (choice)  loss (plain)  peak (choice)  of the budget");
    for (i, ((loss, peak, _), (plain_loss, ..))) in steps.iter().zip(&plain_steps).enumerate() {
        println!(
            "{:>4}  {loss:>13.4}  {plain_loss:>12.4}  {:>13}  {:>12.1}%",
            i + 1,
            Bytes(*peak).to_string(),
            100.0 * *peak as f64 / budget as f64
        );
    }
    let stats_equal = same(&model.buffers(), &plain.buffers());
    let params_equal = same(&model.parameters(), &plain.parameters());
    println!(
        "BatchNorm running statistics bitwise equal to the plain run's: {}",
        if stats_equal { "yes" } else { "NO" }
    );
    println!(
        "parameters bitwise equal to the plain run's: {}",
        if params_equal { "yes" } else { "NO" }
    );
    let (first, last) = (steps[0].0, steps[steps.len() - 1].0);
    anyhow::ensure!(
        last < first,
        "the loss did not fall: {first:.4} -> {last:.4}"
    );
    let highest = steps.iter().map(|s| s.1).max().unwrap_or(0);
    anyhow::ensure!(
        highest <= budget,
        "a step peaked at {}, over the budget {}",
        Bytes(highest),
        Bytes(budget)
    );
    anyhow::ensure!(
        stats_equal,
        "BatchNorm's running statistics differ from the plain run's"
    );
    Ok(())
}
