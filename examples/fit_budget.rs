//! `fit` on a model defined here: a small GELU MLP with a cross-entropy loss against
//! class targets, trained with AdamW, planned for a budget of half its plain step's
//! peak. Prints what `fit` chose, why, and the front; then trains with the choice (a
//! `Trainer` built from `fit`'s report in one call) and shows the loss falls with each
//! step's peak within the budget.
//!
//!   cargo run --release --example fit_budget
//!   cargo run --release --example fit_budget -- --fraction 0.3
use anyhow::Result;
use clap::Parser;
use memsave::checkpoint::CheckpointedSequential;
use memsave::fit::{fit, FitRequest};
use memsave::meter::{install, Bytes};
use memsave::step::{Batch, OptimizerKind, OptimizerSpec, StepConfig, TrainerBuilder, Workload};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
#[command(about = "memsave fit on a model defined in this example")]
struct Args {
    /// The budget: what the plain step keeps (parameters, optimizer state, input) and
    /// this fraction of what it allocates above that.
    #[arg(long, default_value_t = 0.5)]
    fraction: f64,
    /// Examples per optimizer step.
    #[arg(long, default_value_t = 32)]
    batch: i64,
    /// Training steps with the choice.
    #[arg(long, default_value_t = 30)]
    steps: usize,
}

/// Eight blocks of `x + W2 gelu(W1 x)` over 64 features, then 10 class scores.
struct Classifier {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    inputs: Tensor,
    labels: Tensor,
}

impl Classifier {
    fn new(batch: i64) -> Classifier {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut layers = CheckpointedSequential::new();
        for i in 0..8 {
            let p = vs.root() / i;
            let up = nn::linear(&p / "up", 64, 256, Default::default());
            let down = nn::linear(&p / "down", 256, 64, Default::default());
            layers = layers.add_fn(move |x| x + down.forward(&up.forward(x).gelu("none")));
        }
        let head = nn::linear(vs.root() / "head", 64, 10, Default::default());
        layers = layers.add_fn(move |x| head.forward(x));
        // Inputs whose class is the sign pattern of their first features: learnable.
        let inputs = Tensor::randn([batch, 64], (Kind::Float, Device::Cpu));
        let labels = inputs.narrow(1, 0, 3).gt(0.0).to_kind(Kind::Int64);
        let labels = labels.select(1, 0) + labels.select(1, 1) * 2 + labels.select(1, 2) * 4;
        Classifier {
            vs,
            layers,
            inputs,
            labels,
        }
    }
}

impl Workload for Classifier {
    fn name(&self) -> &str {
        "classifier"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        &self.layers
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.layers
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }
    fn global_batch(&self) -> i64 {
        self.inputs.size()[0]
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        Ok(Batch {
            input: self.inputs.f_narrow(0, 0, size)?,
            target: Some(self.labels.f_narrow(0, 0, size)?),
        })
    }
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, tch::TchError> {
        let target = target.ok_or_else(|| tch::TchError::Kind("no labels".into()))?;
        output.f_cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Mean, -100, 0.0)
    }
    fn optimizer(&self) -> Option<OptimizerSpec> {
        Some(OptimizerSpec {
            kind: OptimizerKind::Adamw,
            ..Default::default()
        })
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    install();

    // The plain step's peak on the device, on a twin of the model (the same seed): its
    // second step, once AdamW's state exists. Like fit's budget, it counts the whole
    // device less what the process held besides the model's parameters.
    let (plain_peak, kept) = {
        let mut twin = Classifier::new(args.batch);
        let outside = held_besides(&twin)?;
        let x = twin.batch(args.batch)?;
        let spec = twin.optimizer();
        let mut config = StepConfig::baseline();
        config.optimizer = spec;
        let mut plain = TrainerBuilder::new(config).build(&mut twin)?;
        plain.step(&x)?;
        let m = plain.step(&x)?;
        (m.device_peak_bytes() - outside, m.start_bytes - outside)
    };
    // What the step keeps (parameters, AdamW's state, the input) and a fraction of
    // what it allocates above that.
    let budget = kept + ((plain_peak - kept) as f64 * args.fraction) as u64;
    println!(
        "plain step: peak {} on the device, of which the parameters, AdamW's state and the input {}; budget {}",
        Bytes(plain_peak),
        Bytes(kept),
        Bytes(budget)
    );

    let mut model = Classifier::new(args.batch);
    let outside = held_besides(&model)?;
    let x = model.batch(args.batch)?;
    let first = loss(&model)?;
    let report = fit(&mut model, &FitRequest::new(budget))?;
    println!("{}", report.to_text());

    // Train with the choice: its levers, its checkpoint schedule and the model's AdamW.
    let mut trainer = report.trainer(&mut model)?;
    let steps = (0..args.steps)
        .map(|_| {
            let m = trainer.step(&x)?;
            Ok((m.device_peak_bytes() - outside, loss(trainer.model())?))
        })
        .collect::<Result<Vec<_>>>()?;

    println!("training with {}:", report.choice.strategy);
    for (i, (peak, loss)) in steps.iter().enumerate() {
        println!(
            "  step {:>2}  loss {loss:.4}  peak {:>12}",
            i + 1,
            Bytes(*peak).to_string()
        );
    }
    let last = steps[steps.len() - 1].1;
    let highest = steps.iter().map(|(peak, _)| *peak).max().unwrap_or(0);
    println!("loss {first:.4} -> {last:.4}");
    println!(
        "highest peak (the first step, which makes AdamW's state, included): {} of the budget {}",
        Bytes(highest),
        Bytes(budget)
    );
    anyhow::ensure!(last < first, "the loss did not fall");
    anyhow::ensure!(highest <= budget, "a step's peak passed the budget");
    Ok(())
}

/// What the process holds besides `model`'s parameters, buffers and the data its
/// batches are sliced from (a batch counts the storage it is in; here its global batch is all of
/// it): `fit`'s budget does not count it.
fn held_besides(model: &dyn Workload) -> Result<u64> {
    let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let data = model.batch(model.global_batch())?;
    let counted = model.parameters().iter().map(bytes).sum::<u64>()
        + model.buffers().iter().map(bytes).sum::<u64>()
        + bytes(&data.input)
        + data.target.as_ref().map_or(0, bytes);
    Ok(memsave::meter::memory_allocated(tch::Device::Cpu) - counted)
}

/// The loss of the whole batch, without gradients.
fn loss(model: &Classifier) -> Result<f64> {
    let _guard = tch::no_grad_guard();
    let x = model.batch(model.global_batch())?;
    let out = model.layers().f_forward(&x.input)?;
    Ok(model.loss(&out, x.target.as_ref())?.double_value(&[]))
}
