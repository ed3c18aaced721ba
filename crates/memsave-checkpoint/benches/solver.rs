//! How long the budget solver takes to plan a chain, by depth: residual layers 16 wide
//! (`x + linear(x)` on a 32 x 16 float input), with measured-looking times that differ a
//! little per layer, solved for half the plain run's peak.
//!
//!   cargo bench -p memsave-checkpoint --bench solver
//!
//! Before the timings it prints, per depth, the table's size bound, the plan's predicted
//! peak against its budget, and the process's peak resident memory so far (`VmHWM`;
//! compare it with the figure before any solve, most of which is libtorch).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use memsave_checkpoint::{predict, ChainProfile, LayerProfile, Schedule, Solver};
use std::time::{Duration, Instant};

const DEPTHS: [usize; 6] = [50, 100, 200, 500, 1000, 5000];

/// A profile like the one measured on `x + linear(x)` layers 16 wide, batch 32.
fn residual_chain(layers: usize) -> ChainProfile {
    let act = 32 * 16 * 4;
    let grads = 16 * 16 * 4 + 16 * 4;
    // Times vary by a few percent per layer, as measured ones do.
    let jitter = |i: usize| 1.0 + ((i * 7919) % 101) as f64 / 1000.0;
    let mut elements: Vec<LayerProfile> = (0..layers)
        .map(|i| LayerProfile {
            input_bytes: act,
            output_bytes: act,
            retained_bytes: act,
            forward_peak_bytes: 2 * act,
            nograd_peak_bytes: 2 * act,
            backward_peak_bytes: 2 * act + grads,
            param_grad_bytes: grads,
            saves_output: false,
            forward_time_s: 10e-6 * jitter(i),
            nograd_time_s: 8e-6 * jitter(i + 1),
            backward_time_s: 20e-6 * jitter(i + 2),
        })
        .collect();
    elements.push(LayerProfile {
        input_bytes: act,
        output_bytes: 4,
        retained_bytes: act,
        forward_peak_bytes: act + 4,
        nograd_peak_bytes: act + 4,
        backward_peak_bytes: act,
        param_grad_bytes: 0,
        saves_output: false,
        forward_time_s: 5e-6,
        nograd_time_s: 4e-6,
        backward_time_s: 5e-6,
    });
    ChainProfile {
        elements,
        checkpoint_overhead_bytes: 0,
    }
}

fn halfway_budget(profile: &ChainProfile) -> u64 {
    let plain = predict(profile, &Schedule::plain(profile.layers())).peak_bytes;
    let least = predict(profile, &Solver::new(profile).min_memory()).peak_bytes;
    least + (plain - least) / 2
}

/// Peak resident memory of this process so far, from `/proc/self/status`.
fn peak_resident() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l["VmHWM:".len()..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn depth_curve(c: &mut Criterion) {
    // libtorch, which this crate links, is most of the process's resident memory.
    println!("peak RSS before any solve: {}", peak_resident());
    println!("depth  table bound   plan time  predicted peak / budget   forwards  peak RSS so far");
    for depth in DEPTHS {
        let profile = residual_chain(depth);
        let budget = halfway_budget(&profile);
        let start = Instant::now();
        let schedule = Solver::new(&profile)
            .solve_budget(budget)
            .expect("feasible");
        let elapsed = start.elapsed();
        let peak = predict(&profile, &schedule).peak_bytes;
        assert!(peak <= budget);
        println!(
            "{depth:>5}  {:>8.1} MiB  {:>8.3} s  {peak:>9} / {budget:<9}     {:>8}  {}",
            Solver::table_bound_bytes(depth) as f64 / (1 << 20) as f64,
            elapsed.as_secs_f64(),
            schedule.forward_count(),
            peak_resident(),
        );
    }
    let mut group = c.benchmark_group("solver_plan_halfway_budget");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    for depth in DEPTHS {
        let profile = residual_chain(depth);
        let budget = halfway_budget(&profile);
        group.bench_with_input(BenchmarkId::from_parameter(depth), &depth, |b, _| {
            b.iter(|| {
                Solver::new(&profile)
                    .solve_budget(budget)
                    .expect("feasible")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, depth_curve);
criterion_main!(benches);
