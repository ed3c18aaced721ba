//! The seed question's `SimpleNetwork`: 10 residual `Linear(512, 512)` layers,
//! `x = x + linear(x)`, with the per-layer `mem_before`/`mem_after` lists read from the
//! exact meter, then the peak of a backward.
//!
//!   cargo run --release --example seed_network               # input [50, 100, 512]
//!   cargo run --release --example seed_network -- --full     # the seed's [500, 500, 512]
//!   cargo run --release --example seed_network -- -b 8 -s 64
use anyhow::Result;
use clap::Parser;
use memsave::meter::{install, measure, memory_allocated, Bytes};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
#[command(about = "The seed's SimpleNetwork, measured with memsave's meter")]
struct Args {
    /// Batch size B of the input [B, S, 512].
    #[arg(short, long, default_value_t = 50)]
    batch: i64,
    /// Sequence length S of the input [B, S, 512].
    #[arg(short, long, default_value_t = 100)]
    seq: i64,
    /// Use the seed's full input [500, 500, 512] (about 500 MiB an activation).
    #[arg(long)]
    full: bool,
    /// Number of residual layers.
    #[arg(short, long, default_value_t = 10)]
    layers: usize,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    install();
    let (b, s) = if args.full {
        (500, 500)
    } else {
        (args.batch, args.seq)
    };
    anyhow::ensure!(b > 0 && s > 0 && args.layers > 0, "sizes must be positive");
    let device = Device::Cpu;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let linears: Vec<nn::Linear> = (0..args.layers)
        .map(|i| nn::linear(vs.root() / i, 512, 512, Default::default()))
        .collect();
    let x_in = Tensor::rand([b, s, 512], (Kind::Float, device));
    let activation = (b * s * 512 * 4) as u64;
    println!(
        "input [{b}, {s}, 512] f32: one activation is {}",
        Bytes(activation)
    );

    let mut mem_before = Vec::new();
    let mut mem_after = Vec::new();
    let (output, forward) = measure(device, |_| {
        let mut x = x_in.shallow_clone();
        for linear in &linears {
            mem_before.push(mib(memory_allocated(device)));
            x = &x + linear.forward(&x);
            mem_after.push(mib(memory_allocated(device)));
        }
        x
    });
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|m| format!("{m:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("mem_before (MiB): [{}]", fmt(&mem_before));
    println!("mem_after  (MiB): [{}]", fmt(&mem_after));
    println!(
        "retained after forward: {} = {} layers x one activation (each layer's input is saved for backward)",
        Bytes(forward.retained_bytes().max(0) as u64),
        forward.retained_bytes() / activation as i64
    );

    let (_, backward) = measure(device, |_| -> Result<()> {
        let loss = output.square().mean(Kind::Float);
        loss.f_backward()?;
        Ok(())
    });
    println!(
        "backward: peak {} above its start; the step's peak is {} above the input",
        Bytes(backward.peak_bytes),
        Bytes(forward.retained_bytes().max(0) as u64 + backward.peak_bytes)
    );
    println!(
        "after backward: {:+.2} MiB (saved activations freed, parameter gradients allocated)",
        backward.retained_bytes() as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}
