//! Exact memory of the plans on the seed network, and the budget plan's guarantee.
use crate::common::*;
use memsave_checkpoint::{CheckpointError, Plan};
use memsave_meter::{detect_leak, measure, memory_allocated};
use serial_test::serial;
use tch::nn;
use tch::{Device, Kind};

const CPU: Device = Device::Cpu;

/// Retained bytes after the forward of `x = x + linear(x)` under a plan, above the start.
fn retained_after_forward(layers: usize, plan: Plan, shape: &[i64]) -> i64 {
    let vs = nn::VarStore::new(CPU);
    let mut seq = residual_net(&vs, layers, shape[shape.len() - 1], 0.0).preserve_rng(false);
    seq.set_plan(plan).unwrap();
    let x = rand(shape);
    let (y, m) = measure(CPU, |_| seq.f_forward(&x).unwrap());
    drop(y);
    m.retained_bytes()
}

#[test]
#[serial]
fn retained_bytes_follow_the_documented_formulas() {
    let shape = [3i64, 5, 16];
    let act = 3 * 5 * 16 * 4;
    for layers in [1usize, 4, 7, 10] {
        // Baseline and EveryLayer: the input of every layer after the first, and the output.
        assert_eq!(
            retained_after_forward(layers, Plan::None, &shape),
            layers as i64 * act
        );
        assert_eq!(
            retained_after_forward(layers, Plan::EveryLayer, &shape),
            layers as i64 * act
        );
        // Segments(k), segment size s = L / k: the k - 1 checkpoint outputs, then the
        // L - (k - 1) s activations of the plain last part.
        for k in 1..=layers {
            let s = layers / k;
            let expected = ((k - 1) + layers - (k - 1) * s) as i64 * act;
            assert_eq!(
                retained_after_forward(layers, Plan::Segments(k), &shape),
                expected,
                "L = {layers}, k = {k}"
            );
        }
    }
}

#[test]
#[serial]
fn a_checkpoint_keeps_a_generator_state_only_when_its_function_draws_random_numbers() {
    let shape = [2i64, 8];
    let act = 2 * 8 * 4;
    // libtorch's own size of a CPU generator state copy (mt19937 and normal cache).
    let state = memsave_sys::checkpoint::cpu_generator_state_bytes().unwrap() as i64;
    assert!(state > 4 * 624, "mt19937 alone is 624 words");
    let retained = |dropout: f64, preserve: bool| {
        let vs = nn::VarStore::new(CPU);
        let mut seq = residual_net(&vs, 6, 8, dropout).preserve_rng(preserve);
        seq.set_plan(Plan::Segments(3)).unwrap();
        let x = rand(&shape);
        let (y, m) = measure(CPU, |_| seq.f_forward(&x).unwrap());
        drop(y);
        m.retained_bytes()
    };
    // Without randomness nothing is stashed: two checkpoint outputs, then the plain
    // last segment's two inputs.
    assert_eq!(retained(0.0, true), 4 * act);
    assert_eq!(retained(0.0, false), 4 * act);
    // With dropout each of the two checkpoints keeps one state to replay its masks.
    assert_eq!(retained(0.5, true) - retained(0.5, false), 2 * state);
}

/// Peak of one step above its start; `hold_output` keeps the model's output alive until
/// backward is over, as a variable holding it would.
fn step_peak(
    seq: &memsave_checkpoint::CheckpointedSequential,
    vs: &nn::VarStore,
    x: &tch::Tensor,
    hold_output: bool,
) -> u64 {
    clear_grads(vs);
    let (_, m) = measure(CPU, |_| {
        let y = seq.f_forward(x).unwrap();
        let loss = y.square().mean(Kind::Float);
        let held = hold_output.then_some(y);
        loss.f_backward().unwrap();
        drop(held);
    });
    m.peak_bytes
}

#[test]
#[serial]
fn budget_plans_stay_under_their_budget() {
    budget_plans_stay_under_their_budget_with(0.0);
}

fn budget_plans_stay_under_their_budget_with(dropout: f64) {
    let vs = nn::VarStore::new(CPU);
    let mut seq = residual_net(&vs, 10, 32, dropout);
    let x = rand(&[16, 8, 32]);
    let params = vs.trainable_variables();
    seq.profile(&x, &params, |y| y.square().mean(Kind::Float))
        .unwrap();
    let baseline = step_peak(&seq, &vs, &x, true);

    let smallest = match seq.set_plan(Plan::Budget(1)) {
        Err(CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        }) => smallest_feasible.0,
        other => panic!("a 1-byte budget must be infeasible, got {other:?}"),
    };
    assert!(
        smallest * 10 < baseline * 7,
        "smallest {smallest} vs baseline {baseline}"
    );
    let steps = 12;
    let mut previous_time = f64::INFINITY;
    for i in 0..=steps {
        let budget = smallest + (baseline - smallest) * i / steps;
        seq.set_plan(Plan::Budget(budget)).unwrap();
        for hold_output in [false, true] {
            let peak = step_peak(&seq, &vs, &x, hold_output);
            assert!(
                peak <= budget,
                "budget {budget}, output held {hold_output}: measured peak {peak}\n{}",
                seq.explain()
            );
        }
        // More budget never costs more predicted time (the solver's times are measured,
        // so the number of recomputed layers need not fall in step).
        let time = seq.predict().unwrap().step_time_s;
        assert!(
            time <= previous_time + 1e-12,
            "more budget, more time at {budget}"
        );
        previous_time = time;
    }
    // With room for the baseline nothing is recomputed.
    seq.set_plan(Plan::Budget(baseline * 2)).unwrap();
    assert_eq!(seq.schedule().forward_count(), 10);
}

#[test]
#[serial]
fn a_budget_plan_needs_a_profile() {
    let vs = nn::VarStore::new(CPU);
    let mut seq = residual_net(&vs, 3, 4, 0.0);
    let err = seq.set_plan(Plan::Budget(1 << 20)).unwrap_err();
    assert!(matches!(err, CheckpointError::NotProfiled), "{err}");
    assert!(err.to_string().contains("profile"));
}

#[test]
#[serial]
fn thousands_of_checkpointed_steps_leak_nothing() {
    let vs = nn::VarStore::new(CPU);
    let mut seq = residual_net(&vs, 5, 8, 0.1);
    let x = rand(&[2, 8]);
    for plan in [Plan::Segments(2), Plan::Nested, Plan::EveryLayer] {
        seq.set_plan(plan).unwrap();
        let report = detect_leak(CPU, 1000, |_| {
            seq.f_forward(&x)?
                .square()
                .mean(Kind::Float)
                .f_backward()
                .map_err(Into::into)
        })
        .map_err(|e: memsave_checkpoint::CheckpointError| e)
        .unwrap();
        assert_eq!(report.leaked_bytes_per_step(), 0, "{plan}: {report}");
        assert!(!report.is_leaking());
    }
    clear_grads(&vs);
    let before = memory_allocated(CPU);
    drop(seq);
    assert_eq!(memory_allocated(CPU), before);
}
