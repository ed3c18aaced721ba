//! `fit` on a model defined here: a small GELU MLP with a cross-entropy loss against
//! class targets, trained with AdamW, planned for a budget of half its plain step's
//! peak. Prints what `fit` chose, why, and the front; then trains a few steps with the
//! choice and shows the loss falls with the peak within the budget.
//!
//!   cargo run --release --example fit_budget
//!   cargo run --release --example fit_budget -- --fraction 0.3
use anyhow::Result;
use clap::Parser;
use memsave::checkpoint::CheckpointedSequential;
use memsave::fit::{fit, FitRequest};
use memsave::meter::{install, Bytes};
use memsave::step::step::f_step_with;
use memsave::step::{Batch, CaseOptimizer, OptimizerKind, OptimizerSpec, StepConfig, Workload};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
#[command(about = "memsave fit on a model defined in this example")]
struct Args {
    /// The budget as a fraction of the plain step's peak.
    #[arg(long, default_value_t = 0.5)]
    fraction: f64,
    /// Examples per optimizer step.
    #[arg(long, default_value_t = 32)]
    batch: i64,
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
    install();
    let mut model = Classifier::new(args.batch);

    // The plain step's peak, optimizer state included: what we want to cut.
    let x = model.batch(args.batch)?;
    let spec = model.optimizer();
    let params = model.parameters();
    let mut config = StepConfig::baseline();
    config.optimizer = spec;
    let mut optimizer = spec
        .map(|s| CaseOptimizer::build(&s, &params))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let plain = f_step_with(
        &model,
        &x,
        &config,
        Device::Cpu,
        false,
        None,
        optimizer.as_mut(),
    )
    .map_err(anyhow::Error::msg)?;
    let plain_peak = plain.peak_bytes + optimizer.as_ref().map_or(0, CaseOptimizer::state_bytes);
    drop(optimizer);
    let budget = (plain_peak as f64 * args.fraction) as u64;
    println!(
        "plain step: peak {} (optimizer state included); budget {}",
        Bytes(plain_peak),
        Bytes(budget)
    );

    let report = fit(&mut model, &FitRequest::new(budget))?;
    println!("{}", report.to_text());

    // Train with the choice (fit left its checkpoint schedule on the layers).
    let config = report.choice.step_config(model.optimizer());
    let params = model.parameters();
    let mut optimizer = config
        .optimizer
        .map(|s| CaseOptimizer::build(&s, &params))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let loss = |m: &Classifier| -> Result<f64> {
        let _guard = tch::no_grad_guard();
        let x = m.batch(m.global_batch())?;
        let out = m.layers().f_forward(&x.input)?;
        Ok(m.loss(&out, x.target.as_ref())?.double_value(&[]))
    };
    let first = loss(&model)?;
    let mut highest = 0;
    for _ in 0..30 {
        let m = f_step_with(
            &model,
            &x,
            &config,
            Device::Cpu,
            false,
            None,
            optimizer.as_mut(),
        )
        .map_err(anyhow::Error::msg)?;
        highest = highest.max(m.start_bytes + m.peak_bytes);
    }
    let last = loss(&model)?;
    println!(
        "30 steps with {}: loss {first:.4} -> {last:.4}",
        report.choice.strategy
    );
    println!(
        "highest allocation while training: {} (parameters, input, optimizer state and the step)",
        Bytes(highest)
    );
    Ok(())
}
