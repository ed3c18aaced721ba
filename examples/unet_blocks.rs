//! A U-Net of one's own, not a chain, planned by `fit` block by block.
//!
//! A U-Net concatenates each encoder level's features into the decoder level of the
//! same size, so it cannot be written as a chain of one-tensor layers. Its forward is
//! written here as plain tch code whose levels run as named blocks
//! (`memsave::checkpoint::Blocks`): `fit` profiles the blocks, predicts the peak of
//! each keep/recompute assignment, and picks the fastest that fits the budget; a
//! `Trainer` built from its report trains with it. A twin trained plainly (the same
//! seed, the same batch) gives the budget (a fraction of its step's peak) and the
//! weights and BatchNorm statistics the planned run must match bitwise. It exits with
//! an error if a step's peak passes the budget, if the loss did not fall, or if the
//! two runs differ.
//!
//!   cargo run --release --example unet_blocks
//!   cargo run --release --example unet_blocks -- --fraction 0.7 --image 64
use anyhow::{bail, Context, Result};
use clap::Parser;
use memsave::checkpoint::{Blocks, CheckpointError, CheckpointedSequential, Shared};
use memsave::fit::{fit, FitRequest};
use memsave::meter::{install, Bytes};
use memsave::step::{
    var_store_buffers, Batch, OptimizerKind, OptimizerSpec, StepConfig, TrainerBuilder, Workload,
};
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, TchError, Tensor};

#[derive(Parser)]
#[command(about = "Train a U-Net with fit's block-by-block choice")]
struct Args {
    /// Training steps (each run).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Images per step.
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Image height and width (divisible by 2^levels).
    #[arg(long, default_value_t = 32)]
    image: i64,
    /// Down/up levels.
    #[arg(long, default_value_t = 2)]
    levels: usize,
    /// Channels at the first level (doubled at each level down).
    #[arg(long, default_value_t = 16)]
    base: i64,
    /// The budget: what the plain step keeps (parameters, optimizer state, input) and
    /// this fraction of what it allocates above that.
    #[arg(long, default_value_t = 0.75)]
    fraction: f64,
}

/// conv3x3 + BatchNorm + ReLU, twice.
#[derive(Debug)]
struct DoubleConv(nn::SequentialT);

impl DoubleConv {
    fn new(p: &nn::Path, cin: i64, cout: i64) -> DoubleConv {
        let conv = |p: nn::Path, i, o| {
            let c = nn::ConvConfig {
                padding: 1,
                bias: false,
                ..Default::default()
            };
            nn::conv2d(p, i, o, 3, c)
        };
        DoubleConv(
            nn::seq_t()
                .add(conv(p / "c1", cin, cout))
                .add(nn::batch_norm2d(p / "n1", cout, Default::default()))
                .add_fn(|x| x.relu())
                .add(conv(p / "c2", cout, cout))
                .add(nn::batch_norm2d(p / "n2", cout, Default::default()))
                .add_fn(|x| x.relu()),
        )
    }
}

impl ModuleT for DoubleConv {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.0.forward_t(x, train)
    }
}

/// The U-Net's modules, each behind a `Shared` handle that block functions capture.
struct Modules {
    down: Vec<Shared<DoubleConv>>,
    bottom: Shared<DoubleConv>,
    up: Vec<Shared<nn::ConvTranspose2D>>,
    dec: Vec<Shared<DoubleConv>>,
    head: Shared<nn::Conv2D>,
}

/// The forward: plain tch code, each level a block.
fn forward(m: &Modules, b: &Blocks, x: &Tensor) -> Result<Tensor, CheckpointError> {
    let mut h = x.shallow_clone();
    let mut skips = Vec::new();
    for (l, down) in m.down.iter().enumerate() {
        let down = down.clone();
        let f = b.run(&format!("enc{l}"), &[&h], move |xs| {
            vec![down.forward_t(&xs[0], true)]
        })?;
        h = f[0].max_pool2d_default(2);
        skips.push(f[0].shallow_clone());
    }
    let bottom = m.bottom.clone();
    h = b.run("bottom", &[&h], move |xs| {
        vec![bottom.forward_t(&xs[0], true)]
    })?[0]
        .shallow_clone();
    for l in (0..m.dec.len()).rev() {
        let (up, dec) = (m.up[l].clone(), m.dec[l].clone());
        // Two inputs: the level below and the encoder's features of this level.
        h = b.run(&format!("dec{l}"), &[&h, &skips[l]], move |xs| {
            let u = up.forward(&xs[0]);
            vec![dec.forward_t(&Tensor::cat(&[&u, &xs[1]], 1), true)]
        })?[0]
            .shallow_clone();
    }
    let head = m.head.clone();
    Ok(b.run("head", &[&h], move |xs| vec![head.forward(&xs[0])])?[0].shallow_clone())
}

/// The U-Net as a memsave workload: its forward is the chain's one layer, its blocks
/// are what is planned (`Workload::blocks`).
struct UNet {
    vs: nn::VarStore,
    blocks: Blocks,
    layers: CheckpointedSequential,
    data: Batch,
}

impl UNet {
    fn new(args: &Args) -> UNet {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let p = vs.root();
        let ch = |l: usize| args.base << l;
        let modules = Modules {
            down: (0..args.levels)
                .map(|l| {
                    let cin = if l == 0 { 3 } else { ch(l - 1) };
                    Shared::new(DoubleConv::new(&(&p / format!("down{l}")), cin, ch(l)))
                })
                .collect(),
            bottom: Shared::new(DoubleConv::new(
                &(&p / "bottom"),
                ch(args.levels - 1),
                ch(args.levels),
            )),
            up: (0..args.levels)
                .map(|l| {
                    let c = nn::ConvTransposeConfig {
                        stride: 2,
                        ..Default::default()
                    };
                    Shared::new(nn::conv_transpose2d(
                        &p / format!("up{l}"),
                        ch(l + 1),
                        ch(l),
                        2,
                        c,
                    ))
                })
                .collect(),
            dec: (0..args.levels)
                .map(|l| Shared::new(DoubleConv::new(&(&p / format!("dec{l}")), 2 * ch(l), ch(l))))
                .collect(),
            head: Shared::new(nn::conv2d(&p / "head", ch(0), 4, 1, Default::default())),
        };
        // Images of 4 classes of quadrants, with noise; the target is each pixel's class.
        let s = args.image;
        let target = Tensor::arange(4, (Kind::Int64, Device::Cpu))
            .view([1, 2, 2])
            .repeat([args.batch, 1, 1])
            .repeat_interleave_self_int(s / 2, 1, None)
            .repeat_interleave_self_int(s / 2, 2, None);
        let input = target
            .unsqueeze(1)
            .to_kind(Kind::Float)
            .repeat([1, 3, 1, 1])
            / 3.0
            + Tensor::randn([args.batch, 3, s, s], (Kind::Float, Device::Cpu)) * 0.5;
        let blocks = Blocks::new();
        let b = blocks.clone();
        let layers = CheckpointedSequential::new().add_fn(move |x| {
            b.forward(|b| forward(&modules, b, x))
                .and_then(|r| r)
                .unwrap_or_else(|e| panic!("{e}"))
        });
        UNet {
            vs,
            blocks,
            layers,
            data: Batch {
                input,
                target: Some(target),
            },
        }
    }
}

impl Workload for UNet {
    fn name(&self) -> &str {
        "unet"
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
    fn blocks(&self) -> Option<&Blocks> {
        Some(&self.blocks)
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }
    fn buffers(&self) -> Vec<Tensor> {
        var_store_buffers(&self.vs)
    }
    fn global_batch(&self) -> i64 {
        self.data.len()
    }
    fn batch(&self, size: i64) -> Result<Batch, TchError> {
        self.data.f_narrow(0, size)
    }
    /// Per-pixel cross-entropy: logits [B, 4, H, W] against classes [B, H, W].
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, TchError> {
        let target = target.ok_or_else(|| TchError::Kind("the U-Net needs targets".into()))?;
        let logits = output.f_permute([0, 2, 3, 1])?.f_reshape([-1, 4])?;
        logits.f_cross_entropy_loss::<Tensor>(
            &target.f_reshape([-1])?,
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
    }
    fn optimizer(&self) -> Option<OptimizerSpec> {
        Some(OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr: Some(0.05),
            ..Default::default()
        })
    }
}

/// Every variable by name (weights and BatchNorm statistics), copied.
fn snapshot(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
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
    Ok(memsave::meter::memory_allocated(Device::Cpu) - counted)
}

fn main() -> Result<()> {
    let args = Args::parse();
    install();

    // The plain run: its highest peak on the device sets the budget (the whole device
    // less what the process holds besides the model's parameters, as fit counts it).
    let mut plain = UNet::new(&args);
    let outside = held_besides(&plain)?;
    let batch = plain.batch(args.batch)?;
    let spec = plain.optimizer();
    let mut trainer = TrainerBuilder::new(StepConfig::baseline())
        .optimizer(spec.context("SGD")?)
        .build(&mut plain)?;
    let (mut plain_peak, mut kept) = (0, 0);
    for _ in 0..args.steps {
        let m = trainer.step(&batch)?;
        plain_peak = plain_peak.max(m.device_peak_bytes() - outside);
        kept = m.start_bytes - outside;
    }
    drop(trainer);
    // What every step keeps (the parameters, the input) and a fraction of the rest.
    let budget = kept + ((plain_peak - kept) as f64 * args.fraction) as u64;
    println!(
        "plain step: peak {} on the device, {} of it the parameters and the input; budget {} (those and {:.0}% of the rest)",
        Bytes(plain_peak),
        Bytes(kept),
        Bytes(budget),
        100.0 * args.fraction
    );

    // fit plans the blocks; a trainer of its choice trains a twin.
    let mut model = UNet::new(&args);
    let report = fit(&mut model, &FitRequest::new(budget))?;
    println!("{}", report.to_text());
    let mut twin = UNet::new(&args);
    let outside = held_besides(&twin)?;
    let mut trainer = report.trainer(&mut twin)?;
    let mut losses = Vec::new();
    for step in 0..args.steps {
        let m = trainer.step(&batch)?;
        let loss = m.loss.unwrap_or(f64::NAN);
        let peak = m.device_peak_bytes() - outside;
        println!(
            "step {step}: loss {loss:.4}, peak {} ({})",
            Bytes(peak),
            if peak <= budget {
                "within the budget"
            } else {
                "OVER the budget"
            }
        );
        if peak > budget {
            bail!("step {step} passed the budget");
        }
        losses.push(loss);
    }
    drop(trainer);
    let fell = matches!((losses.first(), losses.last()), (Some(a), Some(b)) if b < a);
    if !fell {
        bail!("the loss did not fall: {losses:?}");
    }
    let same = snapshot(&plain.vs)
        .iter()
        .zip(snapshot(&twin.vs))
        .all(|((na, a), (nb, b))| *na == nb && a.equal(&b));
    println!(
        "weights and BatchNorm statistics after {} steps: {}",
        args.steps,
        if same {
            "bitwise equal to the plain run's"
        } else {
            "DIFFERENT from the plain run's"
        }
    );
    if !same {
        bail!("the planned run differs from the plain run");
    }
    Ok(())
}
