//! A small pre-LN transformer language model trained on synthetic tokens with all of
//! memsave's utilities at once: checkpointed blocks, bf16 autocast, a GradScaler,
//! gradient accumulation and memsave-optim's AdamW. Prints the loss falling and the
//! peak memory of each step, then each utility's share of the saving, all measured with
//! the meter. Last, it trains the same model again from the same seed on the same
//! batches: with the optimizer's state in f32, bf16 and 8-bit blockwise codes, and
//! plainly in f32 against its saved activations stored as int8 (memsave-hooks'
//! `Compress`), and compares the final losses.
//!
//!   cargo run --release --example transformer_training
//!   cargo run --release --example transformer_training -- --steps 60 --layers 6
use anyhow::Result;
use clap::Parser;
use memsave::accum::{GradAccumulator, Split};
use memsave::amp::{f_autocast, GradScaler};
use memsave::checkpoint::{CheckpointedSequential, Plan};
use memsave::hooks::{saved_tensors_hooks, Codec, Compress};
use memsave::meter::{install, measure, Bytes};
use memsave::optim::{AdamW, AdamWConfig, Options, State};
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

/// Token and position embeddings, pre-LN blocks (in a CheckpointedSequential), LN + head.
struct Model {
    embed: nn::Embedding,
    pos: Tensor,
    blocks: CheckpointedSequential,
    norm: nn::LayerNorm,
    head: nn::Linear,
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

impl Model {
    fn new(vs: &nn::VarStore, args: &Args) -> Self {
        let root = vs.root();
        let mut blocks = CheckpointedSequential::new();
        for i in 0..args.layers {
            blocks = blocks.add_fn(block(&root / "block" / i, args.hidden, args.heads));
        }
        Self {
            embed: nn::embedding(&root / "embed", VOCAB, args.hidden, Default::default()),
            pos: root.randn("pos", &[args.seq, args.hidden], 0.0, 0.02),
            blocks,
            norm: nn::layer_norm(&root / "norm", vec![args.hidden], Default::default()),
            head: nn::linear(&root / "head", args.hidden, VOCAB, Default::default()),
        }
    }

    /// Mean next-token cross-entropy of `tokens` ([batch, seq + 1]).
    fn loss(&self, tokens: &Tensor) -> Result<Tensor> {
        let t = tokens.size()[1] - 1;
        let inputs = tokens.narrow(1, 0, t);
        let targets = tokens.narrow(1, 1, t);
        let x = self.embed.forward(&inputs) + &self.pos;
        let y = self.blocks.f_forward(&x)?;
        let logits = self
            .head
            .forward(&self.norm.forward(&y))
            .to_kind(Kind::Float);
        Ok(logits
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&targets.reshape([-1])))
    }
}

/// Sequences that mostly count upwards modulo the vocabulary: each next token is the
/// previous one plus one with probability 3/4, else uniformly random. Learnable, with
/// an entropy floor (about 1.39 nats per token) as natural text has, so that the final
/// losses of two optimizers are compared at a level that means something.
fn batch(args: &Args) -> Tensor {
    let mut tokens = Vec::with_capacity(args.seq as usize + 1);
    tokens.push(Tensor::randint(VOCAB, [args.batch], (Kind::Int64, DEVICE)));
    for t in 1..=args.seq as usize {
        let next = (&tokens[t - 1] + 1).remainder(VOCAB);
        let jump = Tensor::randint(VOCAB, [args.batch], (Kind::Int64, DEVICE));
        let keep = Tensor::rand([args.batch], (Kind::Float, DEVICE)).lt(0.75);
        tokens.push(next.where_self(&keep, &jump));
    }
    Tensor::stack(&tokens, 1)
}

/// One accumulated, scaled training step with the optimizer step (skipped on inf/NaN
/// gradients) and the gradients freed; returns (loss, peak bytes above the start).
fn train_step(
    model: &Model,
    opt: &mut AdamW,
    scaler: &mut GradScaler,
    tokens: &Tensor,
    use_: Utilities,
) -> Result<(f64, u64)> {
    let accumulator = GradAccumulator::with_split(Split::Count(use_.micro_batches));
    let batch_size = tokens.size()[0];
    let params: Vec<Tensor> = opt.params().iter().map(Tensor::shallow_clone).collect();
    let (result, m) = measure(DEVICE, |_| -> Result<f64> {
        let micro_steps = accumulator.f_accumulate(
            &params,
            Some(&mut *scaler),
            batch_size,
            |mb| -> Result<Tensor> {
                let micro = mb.f_narrow(tokens)?;
                if use_.autocast {
                    f_autocast(DEVICE, Kind::BFloat16, || model.loss(&micro))?
                } else {
                    model.loss(&micro)
                }
            },
        )?;
        opt.f_step_scaled(scaler)?;
        scaler.f_update()?;
        opt.f_zero_grad(true)?;
        Ok(micro_steps
            .iter()
            .map(|s| s.loss * s.micro_batch.len as f64 / batch_size as f64)
            .sum())
    });
    Ok((result?, m.peak_bytes))
}

/// A fresh model and optimizer from seed 0, with the optimizer's state at `state`.
fn fresh(args: &Args, state: State) -> Result<(nn::VarStore, Model, AdamW)> {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(DEVICE);
    let model = Model::new(&vs, args);
    let config = AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    };
    let options = Options {
        state,
        ..Default::default()
    };
    let opt = AdamW::with_options(&vs.trainable_variables(), config, options)?;
    Ok((vs, model, opt))
}

/// Trains `args.steps` steps with every utility; returns the losses.
fn train(args: &Args, model: &mut Model, opt: &mut AdamW, verbose: bool) -> Result<Vec<f64>> {
    let mut scaler = GradScaler::default();
    let all = Utilities {
        checkpoint: true,
        autocast: true,
        micro_batches: args.micro_batches,
    };
    model.blocks.set_plan(Plan::EveryLayer)?;
    let mut losses = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let tokens = batch(args);
        let (loss, peak) = train_step(model, opt, &mut scaler, &tokens, all)?;
        losses.push(loss);
        if verbose && (step % 5 == 0 || step + 1 == args.steps) {
            println!("step {step:>3}  loss {loss:.4}  peak {}", Bytes(peak));
        }
    }
    Ok(losses)
}

fn main() -> Result<()> {
    install();
    let args = Args::parse();
    anyhow::ensure!(
        args.hidden % args.heads == 0,
        "hidden must be a multiple of heads"
    );
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    let (_vs, mut model, mut opt) = fresh(&args, State::F32)?;

    println!(
        "training {} blocks, width {}, batch {}x{} tokens, {} micro-batches, checkpointed blocks, bf16 autocast, GradScaler, AdamW",
        args.layers, args.hidden, args.batch, args.seq, args.micro_batches
    );
    let losses = train(&args, &mut model, &mut opt, true)?;
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!(
        "loss {first:.3} -> {last:.3} ({})",
        if last < first {
            "falling"
        } else {
            "not falling"
        }
    );

    // Each utility's share: one step with none, each alone, and all together. The
    // optimizer steps too (the same for all), so peaks include its update.
    println!("\npeak memory of one training step (above the step's start):");
    let none = Utilities {
        checkpoint: false,
        autocast: false,
        micro_batches: 1,
    };
    let variants = [
        ("none", none),
        (
            "checkpoint (every block)",
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
        (
            "all together",
            Utilities {
                checkpoint: true,
                autocast: true,
                micro_batches: args.micro_batches,
            },
        ),
    ];
    let tokens = batch(&args);
    let mut scaler = GradScaler::default();
    let mut baseline = None;
    for (label, use_) in variants {
        model.blocks.set_plan(if use_.checkpoint {
            Plan::EveryLayer
        } else {
            Plan::None
        })?;
        let (_, peak) = train_step(&model, &mut opt, &mut scaler, &tokens, use_)?;
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
        "\nAdamW state precision ({} steps from the same seed and data):",
        args.steps
    );
    let mut reference = None;
    for (label, state) in [
        ("f32", State::F32),
        ("bf16", State::Bf16),
        ("int8 blockwise (256)", State::Int8Blockwise { block: 256 }),
    ] {
        let (_vs, mut model, mut opt) = fresh(&args, state)?;
        let losses = train(&args, &mut model, &mut opt, false)?;
        let last = losses[losses.len() - 1];
        let (f32_loss, f32_bytes) = *reference.get_or_insert((last, opt.state_bytes()));
        println!(
            "  {label:<22} final loss {last:.4} ({:+.2}% vs f32)  state {:>12} ({:.3}x f32)",
            100.0 * (last - f32_loss) / f32_loss,
            Bytes(opt.state_bytes()).to_string(),
            opt.state_bytes() as f64 / f32_bytes as f64
        );
    }

    println!(
        "\nsaved activations as int8 (same seed, same batches, {} steps):",
        args.steps
    );
    let (f32_loss, _) = train_plain(&args, None)?;
    // Blocks of 64 values per scale (bitsandbytes' choice for activations-sized error).
    let int8 = Compress::new(Codec::Int8 {
        block: std::num::NonZeroUsize::new(64).expect("64 is not zero"),
        stochastic_rounding: false,
    });
    let (int8_loss, saved) = train_plain(&args, Some(int8))?;
    println!("  f32   final loss {f32_loss:.4}");
    println!(
        "  int8  final loss {int8_loss:.4}  ({:+.2}% of f32; {} of saved activations stored as int8 per step)",
        100.0 * (int8_loss - f32_loss) / f32_loss,
        Bytes(saved)
    );
    Ok(())
}

/// Trains a fresh model (seed 0) for `args.steps` plain steps, with `compress` hooks
/// around each forward if given; returns the last loss and the bytes compression
/// saved in the last step.
fn train_plain(args: &Args, compress: Option<Compress>) -> Result<(f64, u64)> {
    let (_vs, model, mut opt) = fresh(args, State::F32)?;
    let mut last = (0.0, 0);
    for _ in 0..args.steps {
        let tokens = batch(args);
        let (loss, saved) = match &compress {
            Some(hooks) => {
                let before = hooks.stats().saved_bytes();
                let loss = saved_tensors_hooks(hooks.clone(), || model.loss(&tokens))??;
                (loss, hooks.stats().saved_bytes() - before)
            }
            None => (model.loss(&tokens)?, 0),
        };
        opt.f_zero_grad(true)?;
        loss.f_backward()?;
        opt.f_step()?;
        last = (loss.double_value(&[]), saved);
    }
    Ok(last)
}
