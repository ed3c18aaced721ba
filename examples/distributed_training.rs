//! The transformer language model of `transformer_training`, trained on 2 ranks with
//! ZeRO-2 (each rank keeps half of AdamW's state and of the gradients), gradient
//! accumulation and checkpointed blocks. Run without `RANK` in the environment, it
//! launches itself as 2 local ranks (as `memsave launch -n 2` would); each rank prints
//! its loss, peak and the bytes of state and gradients it holds, by the meter.
//!
//!   cargo run --release --example distributed_training
//!   cargo run --release -p memsave-bench -- launch -n 4 -- target/release/examples/distributed_training
use anyhow::{Context, Result};
use clap::Parser;
use memsave::checkpoint::{CheckpointedSequential, Plan};
use memsave::dist::{init_process_group, InitOptions, LaunchConfig, ZeroOptimizer, ZeroStage};
use memsave::meter::{
    install, max_memory_allocated, memory_allocated, reset_peak_memory_stats, Bytes,
};
use memsave::optim::{AdamWConfig, Options};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser, Clone)]
#[command(
    about = "Train a tiny transformer LM on several ranks with ZeRO-2, accumulation and checkpointing"
)]
struct Args {
    /// Ranks to launch when started without RANK in the environment.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Training steps.
    #[arg(long, default_value_t = 20)]
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
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 32)]
    seq: i64,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 2)]
    micro_batches: i64,
}

const VOCAB: i64 = 32;

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

/// Embeddings, checkpointed pre-LN blocks, LN and the head.
struct Model {
    embed: nn::Embedding,
    pos: Tensor,
    blocks: CheckpointedSequential,
    norm: nn::LayerNorm,
    head: nn::Linear,
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
        let x = self.embed.forward(&tokens.narrow(1, 0, t)) + &self.pos;
        let y = self.blocks.f_forward(&x)?;
        let logits = self.head.forward(&self.norm.forward(&y));
        Ok(logits
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&tokens.narrow(1, 1, t).reshape([-1])))
    }
}

/// Sequences that count upwards modulo the vocabulary from a random start: learnable.
fn batch(args: &Args) -> Tensor {
    let start = Tensor::randint(VOCAB, [args.batch, 1], (Kind::Int64, Device::Cpu));
    (start + Tensor::arange(args.seq + 1, (Kind::Int64, Device::Cpu))).remainder(VOCAB)
}

fn rank_main(args: &Args) -> Result<()> {
    install();
    let group = init_process_group(&InitOptions::default())?;
    let (rank, world) = (group.rank(), group.world_size());
    tch::manual_seed(0); // the same initial model everywhere (ZeRO also broadcasts rank 0's)
    let vs = nn::VarStore::new(Device::Cpu);
    let mut model = Model::new(&vs, args);
    model.blocks.set_plan(Plan::EveryLayer)?;
    let params = vs.trainable_variables();
    let numel: i64 = params.iter().map(Tensor::numel).map(|n| n as i64).sum();
    let config = AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    };
    let mut opt = ZeroOptimizer::new(&group, &params, config, Options::default(), ZeroStage::Two)?;
    tch::manual_seed(1 + rank as i64); // each rank its own data
    for step in 0..args.steps {
        reset_peak_memory_stats(Device::Cpu);
        let start = memory_allocated(Device::Cpu);
        let tokens = batch(args);
        let micro = args.batch / args.micro_batches;
        let mut total = 0.0;
        for m in 0..args.micro_batches {
            // ZeRO-2 reduces each micro-batch's gradients in buckets during its
            // backward, freeing them: each rank holds only its shard's sum.
            let loss = model.loss(&tokens.narrow(0, m * micro, micro))? / args.micro_batches as f64;
            loss.backward();
            total += loss.double_value(&[]);
        }
        let grads = opt.gradient_bytes();
        opt.f_step()?;
        opt.f_zero_grad(true)?;
        let mean = Tensor::from_slice(&[total]);
        group.all_reduce(&mean)?;
        if rank == 0 && (step % 5 == 4 || step == 0) {
            println!(
                "step {:>3}  loss {:.4}  peak {}",
                step + 1,
                mean.double_value(&[0]) / world as f64,
                Bytes((max_memory_allocated(Device::Cpu) - start) as u64)
            );
        }
        if step + 1 == args.steps {
            let full_state = 2 * 4 * numel as u64;
            println!(
                "rank {rank} of {world}: {numel} parameters; AdamW state {} here (single process: {}), gradients held after backward {} (single process: {})",
                Bytes(opt.state_bytes()),
                Bytes(full_state),
                Bytes(grads),
                Bytes(4 * numel as u64),
            );
        }
    }
    group.barrier()?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if std::env::var_os("RANK").is_some() {
        return rank_main(&args);
    }
    let exe = std::env::current_exe().context("this example's own path")?;
    let rest: Vec<_> = std::env::args_os().skip(1).collect();
    let config = LaunchConfig {
        nproc_per_node: args.ranks,
        ..Default::default()
    };
    memsave::dist::launch(&config, exe.as_os_str(), &rest)?;
    Ok(())
}
