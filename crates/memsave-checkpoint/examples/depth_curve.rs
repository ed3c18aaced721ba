//! How peak memory grows with depth under each plan, on residual MLP blocks
//! (`x = x + Linear(GELU(Linear(x)))`): linear without checkpointing, about √L with
//! segments, logarithmic with nested checkpointing and the least-memory budget plan.
//!
//!   cargo run --release -p memsave-checkpoint --example depth_curve
use anyhow::Result;
use clap::Parser;
use memsave_checkpoint::{CheckpointedSequential, Plan, Solver};
use memsave_meter::{install, measure, Bytes};
use memsave_sys::tensor::set_grad_none;
use std::time::Instant;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Depths to measure.
    #[arg(long, default_values_t = vec![6, 12, 24, 48], num_args = 1..)]
    depths: Vec<usize>,
    /// Hidden size.
    #[arg(long, default_value_t = 128)]
    hidden: i64,
    /// Batch dimensions before the hidden size.
    #[arg(long, default_values_t = vec![16, 128], num_args = 1..)]
    batch: Vec<i64>,
}

fn step(seq: &CheckpointedSequential, x: &Tensor, params: &[Tensor]) -> Result<(u64, f64)> {
    for p in params {
        set_grad_none(p)?;
    }
    let start = Instant::now();
    let (r, m) = measure(Device::Cpu, |_| -> Result<()> {
        seq.f_forward(x)?.square().mean(Kind::Float).f_backward()?;
        Ok(())
    });
    r?;
    Ok((m.peak_bytes, start.elapsed().as_secs_f64()))
}

fn main() -> Result<()> {
    install();
    let args = Args::parse();
    let mut shape = args.batch.clone();
    shape.push(args.hidden);
    let act = shape.iter().product::<i64>() as u64 * 4;
    println!(
        "residual MLP blocks, input {shape:?}, one activation {}; peak above the step's start minus the\nparameter gradients (which every plan needs), in activations, and time relative to no checkpointing",
        Bytes(act)
    );
    println!(
        "{:>6} {:>12} {:>16} {:>16} {:>16} {:>16}",
        "depth", "grads", "none", "segments(√L)", "nested", "least memory"
    );
    for &depth in &args.depths {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut seq = CheckpointedSequential::new().preserve_rng(false);
        let h = args.hidden;
        for i in 0..depth {
            let up = nn::linear(vs.root() / i / "up", h, 4 * h, Default::default());
            let down = nn::linear(vs.root() / i / "down", 4 * h, h, Default::default());
            seq = seq.add_fn(move |x| x + down.forward(&up.forward(x).gelu("none")));
        }
        let x = Tensor::rand(shape.as_slice(), (Kind::Float, Device::Cpu));
        let params = vs.trainable_variables();
        let grads: u64 = params.iter().map(|p| p.numel() as u64 * 4).sum();
        seq.profile(&x, &params, |y| y.square().mean(Kind::Float))?;
        let least = Solver::new(seq.chain_profile().expect("profiled")).min_memory();
        let sqrt = ((depth as f64).sqrt().round() as usize).max(1);
        let mut cells = Vec::new();
        let mut base_time = None;
        for plan in [
            Some(Plan::None),
            Some(Plan::Segments(sqrt)),
            Some(Plan::Nested),
            None,
        ] {
            match plan {
                Some(p) => seq.set_plan(p)?,
                None => seq.set_schedule(least.clone())?,
            }
            step(&seq, &x, &params)?;
            let (peak, time) = step(&seq, &x, &params)?;
            let base = *base_time.get_or_insert(time);
            let acts = peak.saturating_sub(grads) as f64 / act as f64;
            cells.push(format!("{acts:.1} ({:.2}x)", time / base));
        }
        println!(
            "{depth:>6} {:>12} {:>16} {:>16} {:>16} {:>16}",
            Bytes(grads).to_string(),
            cells[0],
            cells[1],
            cells[2],
            cells[3]
        );
    }
    Ok(())
}
