//! The budget solver against brute force, its memory bound, and its messages.
//!
//! The allocation counter below is the one `unsafe` outside memsave-sys: a test-only
//! global allocator that forwards to the system one and counts, per thread, the bytes
//! live and their peak, so the table's size is measured rather than taken from the
//! solver's own figures.
use memsave_checkpoint::{
    predict, Block, ChainProfile, CheckpointError, CheckpointedSequential, LayerProfile, Plan,
    Schedule, Solver,
};
use memsave_meter::Bytes;
use proptest::prelude::*;
use serial_test::parallel;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn count(add: usize, sub: usize) {
    // `try_with`: allocations while the thread's locals are torn down are not counted.
    let _ = LIVE.try_with(|live| {
        let now = (live.get() + add).saturating_sub(sub);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call forwards to `System` with the caller's layout and pointer
// unchanged; the counting touches only const-initialised thread-locals, which do not
// allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 0);
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 0);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(0, layout.size());
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size, layout.size());
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

// The allocator of the whole `it` binary, every module's tests included: it only
// forwards and counts per thread, so tests on other threads do not disturb the counts.
#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the most bytes it had allocated at once on
/// this thread (above what was live when it started).
fn peak_allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get) - base)
}

/// A residual-linear-like chain: each layer keeps its output (`act` bytes).
fn uniform_chain(layers: usize, act: u64) -> ChainProfile {
    let layer = LayerProfile {
        input_bytes: act,
        output_bytes: act,
        retained_bytes: act,
        forward_peak_bytes: 2 * act,
        nograd_peak_bytes: 2 * act,
        backward_peak_bytes: 2 * act,
        param_grad_bytes: 0,
        saves_output: false,
        forward_time_s: 1.0,
        nograd_time_s: 1.0,
        backward_time_s: 2.0,
    };
    let head = LayerProfile {
        output_bytes: 4,
        ..layer.clone()
    };
    let mut elements = vec![layer; layers];
    elements.push(head);
    ChainProfile {
        elements,
        checkpoint_overhead_bytes: 16,
    }
}

#[test]
fn the_solver_table_stays_within_its_stated_bound() {
    // The old table had (n+1)^2 * 501 cells of 24 bytes here: 179 MB.
    let layers = 120;
    let profile = uniform_chain(layers, 1000);
    let plain = predict(&profile, &Schedule::plain(layers)).peak_bytes;
    let (schedule, peak) = peak_allocated(|| Solver::new(&profile).solve_budget(plain / 3));
    let schedule = schedule.unwrap();
    assert!(predict(&profile, &schedule).peak_bytes <= plain / 3);
    let bound = Solver::table_bound_bytes(layers);
    // The schedule itself and the walk's vectors come on top of the table.
    let slack = 1 << 20;
    assert!(peak <= bound + slack, "allocated {peak} B, bound {bound} B");
    assert!(peak <= 64 << 20, "allocated {peak} B");
}

#[test]
fn the_stated_bound_holds_for_every_depth() {
    // The build itself is benchmarked (benches/solver.rs); here only the arithmetic of
    // the bound: at most 64 MiB at any depth, and within 8 MiB at 500 layers.
    for layers in [
        0,
        1,
        7,
        50,
        100,
        500,
        511,
        512,
        1000,
        5000,
        Solver::MAX_LAYERS,
    ] {
        let bound = Solver::table_bound_bytes(layers);
        assert!(bound <= 64 << 20, "{layers} layers: {bound} B");
    }
    assert!(Solver::table_bound_bytes(500) <= 8 << 20);
}

#[test]
fn a_chain_past_the_stated_size_is_refused_with_a_plan_to_use_instead() {
    let profile = uniform_chain(Solver::MAX_LAYERS + 1, 8);
    let err = Solver::new(&profile).solve_budget(1).unwrap_err();
    assert!(matches!(err, CheckpointError::InvalidPlan(_)), "{err}");
    let message = err.to_string();
    assert!(message.contains("100000"), "{message}");
    assert!(message.contains("Plan::Nested"), "{message}");
    // A budget that holds the plain run needs no table, at any length.
    let plain = predict(&profile, &Schedule::plain(Solver::MAX_LAYERS + 1));
    let s = Solver::new(&profile)
        .solve_budget(plain.peak_bytes)
        .unwrap();
    assert_eq!(s.forward_count(), Solver::MAX_LAYERS + 1);
}

#[test]
fn the_smallest_feasible_budget_is_exact_and_rounded_up_in_its_unit() {
    let err = CheckpointError::InfeasibleBudget {
        budget: Bytes(100_000),
        smallest_feasible: Bytes(124_969),
    };
    let message = err.to_string();
    // 124,969 B is 122.0400... KiB: rounding to nearest would print 122.04 KiB, which is
    // 124,968.96 B, below the minimum.
    assert!(message.contains("124969 B (122.05 KiB)"), "{message}");
    assert!(message.contains("100000 B (97.65 KiB)"), "{message}");
    assert!(!message.contains("122.04"), "{message}");

    // Exact multiples are not bumped, and whole bytes below a KiB stay bytes.
    let err = CheckpointError::InfeasibleBudget {
        budget: Bytes(10),
        smallest_feasible: Bytes(3 << 20),
    };
    assert!(err.to_string().contains("3145728 B (3.00 MiB)"), "{err}");
    let err = CheckpointError::InfeasibleBudget {
        budget: Bytes(10),
        smallest_feasible: Bytes(1000),
    };
    assert!(err.to_string().ends_with("is 1000 B"), "{err}");
}

#[test]
fn the_reported_smallest_budget_is_met_and_one_byte_less_is_not() {
    let profile = uniform_chain(30, 1000);
    let mut solver = Solver::new(&profile);
    let Err(CheckpointError::InfeasibleBudget {
        smallest_feasible, ..
    }) = solver.solve_budget(10)
    else {
        panic!("10 bytes cannot be enough");
    };
    let s = solver.solve_budget(smallest_feasible.0).unwrap();
    assert_eq!(predict(&profile, &s).peak_bytes, smallest_feasible.0);
    assert!(solver.solve_budget(smallest_feasible.0 - 1).is_err());
}

#[test]
#[parallel]
fn the_not_profiled_error_names_the_method_that_exists() {
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root(), 4, 4, Default::default());
    let mut seq = CheckpointedSequential::new().add_fn(move |x| x + lin.forward(x));
    let err = seq.set_plan(Plan::Budget(1 << 20)).unwrap_err();
    assert!(matches!(err, CheckpointError::NotProfiled), "{err}");
    let message = err.to_string();
    assert!(!message.contains("plan_for_budget"), "{message}");
    assert!(
        message.contains("CheckpointedSequential::profile("),
        "{message}"
    );
    // Doing what it says works.
    let x = Tensor::rand([2, 4], (Kind::Float, Device::Cpu));
    seq.profile(&x, &vs.trainable_variables(), |y| {
        y.square().mean(Kind::Float)
    })
    .unwrap();
    seq.set_plan(Plan::Budget(1 << 20)).unwrap();
}

/// Every schedule of layers `start..end`; `whole` allows a first checkpoint that covers
/// the whole range (a recompute that starts by checkpointing its own range again only
/// adds cost, and would nest without end).
fn all_schedules(start: usize, end: usize, whole: bool) -> Vec<Vec<Block>> {
    if start == end {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for rest in all_schedules(start + 1, end, true) {
        let mut blocks = vec![Block::Layer(start)];
        blocks.extend(rest);
        out.push(blocks);
    }
    for k in start + 1..=end {
        if k == end && !whole {
            continue;
        }
        let inners = all_schedules(start, k, false);
        let rests = all_schedules(k, end, true);
        for inner in &inners {
            for rest in &rests {
                let mut blocks = vec![Block::Checkpoint {
                    start,
                    end: k,
                    inner: inner.clone(),
                }];
                blocks.extend(rest.iter().cloned());
                out.push(blocks);
            }
        }
    }
    out
}

prop_compose! {
    /// A chain of 0 to 6 layers plus the loss (1 to 7 stages) with random sizes, times
    /// and checkpoint overhead; whole-number times so equal sums compare equal.
    fn random_chain()(
        sizes in prop::collection::vec(0u64..400, 2..=8),
        costs in prop::collection::vec(
            (0u64..400, 0u64..800, 0u64..800, 0u64..800, 0u64..300, any::<bool>(),
             1u32..8, 0u32..8, 1u32..8),
            7,
        ),
        overhead in 0u64..60,
    ) -> ChainProfile {
        let layers = sizes.len() - 2;
        let elements = (0..=layers)
            .map(|l| {
                let (kept, fwd, nograd, bwd, grads, saves, tf, tn, tb) = costs[l];
                LayerProfile {
                    input_bytes: sizes[l],
                    output_bytes: sizes[l + 1],
                    retained_bytes: sizes[l + 1] + kept,
                    forward_peak_bytes: sizes[l + 1] + fwd,
                    nograd_peak_bytes: sizes[l + 1] + nograd,
                    backward_peak_bytes: bwd,
                    param_grad_bytes: grads,
                    saves_output: saves,
                    forward_time_s: f64::from(tf),
                    nograd_time_s: f64::from(tn),
                    backward_time_s: f64::from(tb),
                }
            })
            .collect();
        ChainProfile { elements, checkpoint_overhead_bytes: overhead }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Against every schedule: the solver's plan fits the budget and is as fast as the
    /// fastest schedule that fits, or both find none; the smallest feasible budget it
    /// names is the least peak of all schedules.
    #[test]
    fn the_solver_is_optimal_on_small_chains(
        profile in random_chain(),
        fractions in prop::collection::vec(0u64..=1100, 6),
    ) {
        let layers = profile.layers();
        let all: Vec<(u64, f64)> = all_schedules(0, layers, true)
            .into_iter()
            .map(|blocks| {
                let p = predict(&profile, &Schedule::new(blocks, layers).unwrap());
                (p.peak_bytes, p.step_time_s)
            })
            .collect();
        let least_peak = all.iter().map(|&(peak, _)| peak).min().unwrap();
        let plain_peak = predict(&profile, &Schedule::plain(layers)).peak_bytes;
        let mut solver = Solver::new(&profile);
        let mut budgets: Vec<u64> = fractions
            .iter()
            .map(|f| least_peak.saturating_sub(50) + (plain_peak + 50 - least_peak.min(plain_peak)) * f / 1000)
            .collect();
        budgets.extend([least_peak, least_peak.saturating_sub(1), plain_peak]);
        for budget in budgets {
            let best = all
                .iter()
                .filter(|&&(peak, _)| peak <= budget)
                .map(|&(_, time)| time)
                .min_by(f64::total_cmp);
            match (solver.solve_budget(budget), best) {
                (Ok(schedule), Some(best)) => {
                    let p = predict(&profile, &schedule);
                    prop_assert!(p.peak_bytes <= budget, "{schedule}: {} > {budget}", p.peak_bytes);
                    prop_assert_eq!(p.step_time_s, best, "{} at budget {}", schedule, budget);
                }
                (Err(CheckpointError::InfeasibleBudget { smallest_feasible, .. }), None) => {
                    prop_assert_eq!(smallest_feasible.0, least_peak);
                }
                (got, best) => prop_assert!(false, "budget {budget}: solver {got:?}, brute force {best:?}"),
            }
        }
    }
}
