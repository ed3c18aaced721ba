//! Every checkpointing plan on the seed network (`x = x + linear(x)`), measured: peak
//! bytes above the step's start, step time, and the solver's prediction.
//!
//!   cargo run --release -p memsave-checkpoint --example seed_plans
//!   cargo run --release -p memsave-checkpoint --example seed_plans -- --budget 60MiB
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
    /// Number of residual layers.
    #[arg(long, default_value_t = 10)]
    layers: usize,
    /// Batch dimensions of the input (before the hidden size).
    #[arg(long, default_values_t = vec![50, 100], num_args = 1..)]
    batch: Vec<i64>,
    /// Hidden size.
    #[arg(long, default_value_t = 512)]
    hidden: i64,
    /// Budgets to solve for, e.g. 60MiB.
    #[arg(long)]
    budget: Vec<Bytes>,
    /// Timed repeats per plan (the minimum is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

fn step(seq: &CheckpointedSequential, x: &Tensor, params: &[Tensor]) -> Result<(u64, f64)> {
    for p in params {
        set_grad_none(p)?;
    }
    let start = Instant::now();
    let (r, m) = measure(Device::Cpu, |_| -> Result<()> {
        let loss = seq.f_forward(x)?.square().mean(Kind::Float);
        loss.f_backward()?;
        Ok(())
    });
    r?;
    Ok((m.peak_bytes, start.elapsed().as_secs_f64()))
}

fn main() -> Result<()> {
    install();
    let args = Args::parse();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut seq = CheckpointedSequential::new();
    for i in 0..args.layers {
        let lin = nn::linear(vs.root() / i, args.hidden, args.hidden, Default::default());
        seq = seq.add_fn(move |x| x + lin.forward(x));
    }
    let mut shape = args.batch.clone();
    shape.push(args.hidden);
    let x = Tensor::rand(shape.as_slice(), (Kind::Float, Device::Cpu));
    let params = vs.trainable_variables();
    seq.profile(&x, &params, |y| y.square().mean(Kind::Float))?;
    if std::env::var_os("SHOW_PROFILE").is_some() {
        let act = (x.numel() * 4) as f64;
        for (i, e) in seq
            .chain_profile()
            .expect("profiled")
            .elements
            .iter()
            .enumerate()
        {
            println!(
                "element {i}: in {:.2} out {:.2} retained {:.2} fwd {:.2} nograd {:.2} bwd {:.2} (activations), grads {}",
                e.input_bytes as f64 / act,
                e.output_bytes as f64 / act,
                e.retained_bytes as f64 / act,
                e.forward_peak_bytes as f64 / act,
                e.nograd_peak_bytes as f64 / act,
                e.backward_peak_bytes as f64 / act,
                Bytes(e.param_grad_bytes)
            );
        }
    }

    let mut plans = vec![Plan::None, Plan::EveryLayer];
    plans.extend((2..=args.layers).map(Plan::Segments));
    plans.push(Plan::Nested);
    plans.extend(args.budget.iter().map(|b| Plan::Budget(b.0)));
    let min_schedule = Solver::new(seq.chain_profile().expect("profiled")).min_memory();

    println!(
        "{:<22} {:>12} {:>12} {:>9}  schedule",
        "plan", "peak", "predicted", "time"
    );
    let mut baseline_time = None;
    let mut run = |seq: &mut CheckpointedSequential, label: String| -> Result<()> {
        step(seq, &x, &params)?; // warm-up
        let mut best = (u64::MAX, f64::INFINITY);
        for _ in 0..args.repeats {
            let (peak, t) = step(seq, &x, &params)?;
            best = (best.0.min(peak), best.1.min(t));
        }
        let base = *baseline_time.get_or_insert(best.1);
        let predicted = seq.predict().map_or(0, |p| p.peak_bytes);
        println!(
            "{:<22} {:>12} {:>12} {:>8.2}x  {}",
            label,
            Bytes(best.0).to_string(),
            Bytes(predicted).to_string(),
            best.1 / base,
            seq.schedule()
        );
        Ok(())
    };
    for plan in plans {
        match seq.set_plan(plan) {
            Ok(()) => run(&mut seq, plan.to_string())?,
            Err(e) => println!("{:<22} {e}", plan.to_string()),
        }
    }
    seq.set_schedule(min_schedule)?;
    run(&mut seq, "least memory".to_owned())?;

    // For every segment count PyTorch's checkpoint_sequential offers: the budget plan
    // given that plan's measured peak as its budget.
    println!("\nsegments(k) against budget(peak of segments(k)):");
    println!(
        "{:<14} {:>12} {:>9}   {:>12} {:>9}  budget schedule",
        "k", "seg peak", "seg time", "budget peak", "time"
    );
    for k in 2..=args.layers {
        let mut measure_plan = |plan: Plan| -> Result<(u64, f64)> {
            seq.set_plan(plan)?;
            step(&seq, &x, &params)?;
            let mut best = (u64::MAX, f64::INFINITY);
            for _ in 0..args.repeats {
                let (peak, t) = step(&seq, &x, &params)?;
                best = (best.0.min(peak), best.1.min(t));
            }
            Ok(best)
        };
        let (seg_peak, seg_time) = measure_plan(Plan::Segments(k))?;
        let (b_peak, b_time) = measure_plan(Plan::Budget(seg_peak))?;
        println!(
            "{:<14} {:>12} {:>8.3}s   {:>12} {:>8.3}s  {}",
            format!("segments({k})"),
            Bytes(seg_peak).to_string(),
            seg_time,
            Bytes(b_peak).to_string(),
            b_time,
            seq.schedule()
        );
    }
    Ok(())
}
