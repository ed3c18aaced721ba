//! A small pre-LN transformer language model trained on synthetic tokens with all of
//! memsave's utilities at once, through one `Trainer` (memsave-step): checkpointed
//! layers, bf16 autocast, a GradScaler, gradient accumulation and memsave-optim's
//! AdamW. Prints the loss falling and the peak memory of each step, then each utility's
//! share of the saving, all measured with the meter. Last, it trains the same model
//! again from the same seed on the same batches: with the optimizer's state in f32,
//! bf16 and 8-bit blockwise codes, and plainly in f32 against its saved activations
//! stored as int8 (memsave-hooks' `Compress`), and compares the held-out losses.
//!
//!   cargo run --release --example transformer_training
//!   cargo run --release --example transformer_training -- --steps 60 --layers 6
use anyhow::Result;
use clap::Parser;
use memsave::amp::GradScalerConfig;
use memsave::checkpoint::{CheckpointedSequential, Plan};
use memsave::meter::{install, Bytes};
use memsave::step::{
    Batch, CompressDtype, OptimizerKind, OptimizerSpec, PlanChoice, SavedTensors, StatePrecision,
    StepConfig, Trainer, TrainerBuilder, Workload,
};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
#[command(
    about = "Train a tiny transformer LM with checkpointing, autocast, GradScaler and accumulation"
)]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    hidden: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: i64,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16)]
    batch: i64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 32)]
    seq: i64,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 2)]
    micro_batches: usize,
}

const VOCAB: i64 = 32;
const DEVICE: Device = Device::Cpu;

/// Which utilities a step uses.
#[derive(Clone, Copy)]
struct Utilities {
    checkpoint: bool,
    autocast: bool,
    micro_batches: usize,
}

impl Utilities {
    /// The step configuration: these utilities, a GradScaler (with `scaler`) and AdamW
    /// (learning rate 3e-3) with its state at `state`.
    fn config(self, scaler: bool, state: StatePrecision) -> StepConfig {
        let mut config = StepConfig::baseline();
        if self.checkpoint {
            config.plan = PlanChoice::Fixed(Plan::EveryLayer);
        }
        if self.autocast {
            config.autocast = Some(Kind::BFloat16);
        }
        config.micro_batches = (self.micro_batches > 1).then_some(self.micro_batches);
        if scaler {
            config.scaler = Some(GradScalerConfig::default());
        }
        config.optimizer = Some(OptimizerSpec {
            kind: OptimizerKind::Adamw,
            lr: Some(3e-3),
            state,
            ..Default::default()
        });
        config
    }
}

/// The language model as a memsave workload: its layers (token and position
/// embeddings, the pre-LN blocks, final norm and head) in a CheckpointedSequential,
/// and one batch kept for `batch` (the trainer steps on the batches given to it).
struct Lm {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Batch,
}

fn block(p: nn::Path, hidden: i64, heads: i64) -> impl Fn(&Tensor) -> Tensor + Send + 'static {
    let ln1 = nn::layer_norm(&p / "ln1", vec![hidden], Default::default());
    let qkv = nn::linear(&p / "qkv", hidden, 3 * hidden, Default::default());
    let proj = nn::linear(&p / "proj", hidden, hidden, Default::default());
    let ln2 = nn::layer_norm(&p / "ln2", vec![hidden], Default::default());
    let up = nn::linear(&p / "up", hidden, 4 * hidden, Default::default());
    let down = nn::linear(&p / "down", 4 * hidden, hidden, Default::default());
    move |x: &Tensor| {
        let (b, t, c) = x.size3().expect("[batch, seq, hidden]");
        let h = ln1.forward(x);
        let qkv = qkv
            .forward(&h)
            .view([b, t, 3, heads, c / heads])
            .permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let att = Tensor::scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, true, None, false,
        );
        let att = att.transpose(1, 2).contiguous().view([b, t, c]);
        let x = x + proj.forward(&att);
        let h = ln2.forward(&x);
        &x + down.forward(&up.forward(&h).gelu("none"))
    }
}

impl Lm {
    /// A fresh model from seed 0 (its kept batch drawn right after, from the same
    /// stream).
    fn new(args: &Args) -> Lm {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(DEVICE);
        let root = vs.root();
        let embed = nn::embedding(&root / "embed", VOCAB, args.hidden, Default::default());
        let pos = root.randn("pos", &[args.seq, args.hidden], 0.0, 0.02);
        let mut layers =
            CheckpointedSequential::new().add_fn(move |tokens| embed.forward(tokens) + &pos);
        for i in 0..args.layers {
            layers = layers.add_fn(block(&root / "block" / i, args.hidden, args.heads));
        }
        let norm = nn::layer_norm(&root / "norm", vec![args.hidden], Default::default());
        let head = nn::linear(&root / "head", args.hidden, VOCAB, Default::default());
        layers = layers.add_fn(move |x| head.forward(&norm.forward(x)));
        let data = batch(args);
        Lm { vs, layers, data }
    }
}

impl Workload for Lm {
    fn name(&self) -> &str {
        "transformer-lm"
    }
    fn device(&self) -> Device {
        DEVICE
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
        self.data.len()
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        self.data.f_narrow(0, size)
    }
    /// Mean next-token cross-entropy, in f32.
    fn loss(&self, logits: &Tensor, target: Option<&Tensor>) -> Result<Tensor, tch::TchError> {
        let target = target.ok_or_else(|| tch::TchError::Kind("no next tokens".into()))?;
        logits
            .f_to_kind(Kind::Float)?
            .f_reshape([-1, VOCAB])?
            .f_cross_entropy_loss::<Tensor>(
                &target.f_reshape([-1])?,
                None,
                tch::Reduction::Mean,
                -100,
                0.0,
            )
    }
}

/// Sequences that mostly count upwards modulo the vocabulary: each next token is the
/// previous one plus one with probability 3/4, else uniformly random. Learnable, with
/// an entropy floor (about 1.39 nats per token) as natural text has, so that the final
/// losses of two optimizers are compared at a level that means something. The input is
/// each sequence's first `seq` tokens, the target its last `seq`.
fn batch(args: &Args) -> Batch {
    let mut tokens = Vec::with_capacity(args.seq as usize + 1);
    tokens.push(Tensor::randint(VOCAB, [args.batch], (Kind::Int64, DEVICE)));
    for t in 1..=args.seq as usize {
        let next = (&tokens[t - 1] + 1).remainder(VOCAB);
        let jump = Tensor::randint(VOCAB, [args.batch], (Kind::Int64, DEVICE));
        let keep = Tensor::rand([args.batch], (Kind::Float, DEVICE)).lt(0.75);
        tokens.push(next.where_self(&keep, &jump));
    }
    let tokens = Tensor::stack(&tokens, 1);
    Batch {
        input: tokens.narrow(1, 0, args.seq).contiguous(),
        target: Some(tokens.narrow(1, 1, args.seq).contiguous()),
    }
}

/// The model's loss on `batch` in f32, without gradients.
fn loss(model: &Lm, batch: &Batch) -> Result<f64> {
    let _guard = tch::no_grad_guard();
    let logits = model.layers().f_forward(&batch.input)?;
    Ok(model
        .loss(&logits, batch.target.as_ref())?
        .double_value(&[]))
}

/// Trains `args.steps` steps on fresh batches (the loss printed on a few, before their
/// step, with `verbose`).
fn train(args: &Args, trainer: &mut Trainer<'_, Lm>, verbose: bool) -> Result<()> {
    for step in 0..args.steps {
        let x = batch(args);
        let before = if verbose && (step % 5 == 0 || step + 1 == args.steps) {
            Some(loss(trainer.model(), &x)?)
        } else {
            None
        };
        let m = trainer.step(&x)?;
        if let Some(l) = before {
            println!("step {step:>3}  loss {l:.4}  peak {}", Bytes(m.peak_bytes));
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    install();
    let args = Args::parse();
    anyhow::ensure!(
        args.hidden % args.heads == 0,
        "hidden must be a multiple of heads"
    );
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    anyhow::ensure!(args.micro_batches > 0, "--micro-batches must be at least 1");
    // A held-out batch for the losses compared below, the same for every run.
    tch::manual_seed(1234);
    let held_out = batch(&args);
    let all = Utilities {
        checkpoint: true,
        autocast: true,
        micro_batches: args.micro_batches,
    };

    let mut model = Lm::new(&args);
    println!(
        "training {} blocks, width {}, batch {}x{} tokens, {} micro-batches, checkpointed layers, bf16 autocast, GradScaler, AdamW",
        args.layers, args.hidden, args.batch, args.seq, args.micro_batches
    );
    let first = loss(&model, &held_out)?;
    let mut trainer =
        TrainerBuilder::new(all.config(true, StatePrecision::F32)).build(&mut model)?;
    train(&args, &mut trainer, true)?;
    let last = loss(trainer.model(), &held_out)?;
    println!(
        "held-out loss {first:.3} -> {last:.3} ({})",
        if last < first {
            "falling"
        } else {
            "not falling"
        }
    );
    drop(trainer);

    // Each utility's share: steps with none, each alone, and all together. The
    // optimizer steps too (the same for all), so peaks include its update; each is the
    // second step of its trainer, once AdamW's state exists.
    println!("\npeak memory of one training step (above the step's start):");
    let none = Utilities {
        checkpoint: false,
        autocast: false,
        micro_batches: 1,
    };
    let variants = [
        ("none", none),
        (
            "checkpoint (every layer)",
            Utilities {
                checkpoint: true,
                ..none
            },
        ),
        (
            "autocast bf16",
            Utilities {
                autocast: true,
                ..none
            },
        ),
        (
            "accumulation",
            Utilities {
                micro_batches: args.micro_batches,
                ..none
            },
        ),
        ("all together", all),
    ];
    let x = batch(&args);
    let mut baseline = None;
    for (label, use_) in variants {
        let mut trainer =
            TrainerBuilder::new(use_.config(true, StatePrecision::F32)).build(&mut model)?;
        trainer.step(&x)?;
        let peak = trainer.step(&x)?.peak_bytes;
        let base = *baseline.get_or_insert(peak);
        println!(
            "  {label:<26} {:>12}  saves {:>5.1}%",
            Bytes(peak).to_string(),
            100.0 * (base as f64 - peak as f64) / base as f64
        );
    }

    // The optimizer's state: the same seed, data and steps with the two moments kept in
    // f32, bf16 and 8-bit blockwise codes.
    println!(
        "\nAdamW state precision ({} steps from the same seed and data, held-out loss):",
        args.steps
    );
    let mut reference = None;
    for (label, state) in [
        ("f32", StatePrecision::F32),
        ("bf16", StatePrecision::Bf16),
        ("int8 blockwise (256)", StatePrecision::Int8),
    ] {
        let mut model = Lm::new(&args);
        let mut trainer = TrainerBuilder::new(all.config(true, state)).build(&mut model)?;
        train(&args, &mut trainer, false)?;
        let last = loss(trainer.model(), &held_out)?;
        let bytes = trainer.optimizer_state_bytes();
        let (f32_loss, f32_bytes) = *reference.get_or_insert((last, bytes));
        println!(
            "  {label:<22} loss {last:.4} ({:+.2}% vs f32)  state {:>12} ({:.3}x f32)",
            100.0 * (last - f32_loss) / f32_loss,
            Bytes(bytes).to_string(),
            bytes as f64 / f32_bytes as f64
        );
    }

    println!(
        "\nsaved activations as int8 (plain f32 steps, same seed, same batches, {} steps):",
        args.steps
    );
    let (f32_loss, _) = train_plain(&args, &held_out, None)?;
    let int8 = Some(SavedTensors::Compress(CompressDtype::Int8));
    let (int8_loss, saved) = train_plain(&args, &held_out, int8)?;
    println!("  f32   loss {f32_loss:.4}");
    println!(
        "  int8  loss {int8_loss:.4}  ({:+.2}% of f32; compression saved {} of saved activations per step)",
        100.0 * (int8_loss - f32_loss) / f32_loss,
        Bytes(saved)
    );
    Ok(())
}

/// Trains a fresh model (seed 0) for `args.steps` plain steps (AdamW in f32, no other
/// utility) with `saved` hooks around each forward if given; returns the held-out loss
/// and the bytes compression saved in the last step.
fn train_plain(args: &Args, held_out: &Batch, saved: Option<SavedTensors>) -> Result<(f64, u64)> {
    let plain = Utilities {
        checkpoint: false,
        autocast: false,
        micro_batches: 1,
    };
    let mut config = plain.config(false, StatePrecision::F32);
    config.saved = saved;
    let mut model = Lm::new(args);
    let mut trainer = TrainerBuilder::new(config).build(&mut model)?;
    let mut compressed = 0;
    for _ in 0..args.steps {
        compressed = trainer
            .step(&batch(args))?
            .compressed_saved_bytes
            .unwrap_or(0);
    }
    Ok((loss(trainer.model(), held_out)?, compressed))
}
