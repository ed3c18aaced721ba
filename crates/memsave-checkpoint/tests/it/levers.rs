//! Levers of the budget planner: boundary stores that keep a checkpoint's input until
//! its recompute. Plans fit their budget (predicted and measured to the byte), lossless
//! stores keep gradients bitwise equal under every entry point, and without levers
//! nothing changes.
use crate::common::*;
use memsave_checkpoint::{
    predict, BoundaryStore, CheckpointError, CheckpointedSequential, Plan, Schedule, Solver,
    StoreError, Stored, StoredBoundary,
};
use memsave_meter::{measure, memory_allocated};
use memsave_sys::tensor::backward_with_grads;
use proptest::prelude::*;
use serial_test::serial;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

/// The gradient of a scalar f32 loss that `backward()` holds while it runs.
const LOSS_GRAD_BYTES: u64 = 4;

/// Keeps a boundary's bytes in a Rust `Vec`, outside the tensor allocator the meter
/// watches: to the meter, an offload. Counts the values alive.
#[derive(Default)]
struct HostStore {
    alive: Arc<AtomicI64>,
}

struct HostCopy {
    bytes: Vec<u8>,
    shape: Vec<i64>,
    kind: Kind,
    alive: Arc<AtomicI64>,
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        self.alive.fetch_sub(1, Ordering::SeqCst);
    }
}

impl BoundaryStore for HostStore {
    fn name(&self) -> String {
        "host copy".into()
    }
    fn is_lossless(&self) -> bool {
        true
    }
    fn store(&self, t: &Tensor) -> Result<Stored, StoreError> {
        let t = t.contiguous();
        let n = t.numel() * t.kind().elt_size_in_bytes();
        let mut bytes = vec![0u8; n];
        t.f_copy_data_u8(&mut bytes, t.numel())?;
        self.alive.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(HostCopy {
            bytes,
            shape: t.size(),
            kind: t.kind(),
            alive: Arc::clone(&self.alive),
        }))
    }
    fn restore(&self, stored: &Stored) -> Result<Tensor, StoreError> {
        let c = stored.downcast_ref::<HostCopy>().ok_or("not a host copy")?;
        Ok(Tensor::f_from_data_size(&c.bytes, &c.shape, c.kind)?)
    }
}

/// Keeps a boundary as bf16 (lossy, half the bytes, in the metered allocator).
struct Bf16Store;

impl BoundaryStore for Bf16Store {
    fn name(&self) -> String {
        "bf16".into()
    }
    fn is_lossless(&self) -> bool {
        false
    }
    fn store(&self, t: &Tensor) -> Result<Stored, StoreError> {
        Ok(Box::new((t.kind(), t.to_kind(Kind::BFloat16))))
    }
    fn restore(&self, stored: &Stored) -> Result<Tensor, StoreError> {
        let (kind, t) = stored
            .downcast_ref::<(Kind, Tensor)>()
            .ok_or("not a bf16 copy")?;
        Ok(t.to_kind(*kind))
    }
}

fn loss_of(y: &Tensor) -> Tensor {
    y.square().mean(Kind::Float)
}

/// Peak of one step above its start (see the memory module).
fn step_peak(seq: &CheckpointedSequential, vs: &nn::VarStore, x: &Tensor, hold: bool) -> u64 {
    clear_grads(vs);
    let (_, m) = measure(CPU, |_| {
        let y = seq.f_forward(x).unwrap();
        let loss = loss_of(&y);
        let held = hold.then_some(y);
        loss.f_backward().unwrap();
        drop(held);
    });
    m.peak_bytes
}

fn smallest_feasible(seq: &mut CheckpointedSequential) -> u64 {
    match seq.set_plan(Plan::Budget(1)) {
        Err(CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        }) => smallest_feasible.0,
        other => panic!("a 1-byte budget must be infeasible, got {other:?}"),
    }
}

fn profiled(
    vs: &nn::VarStore,
    layers: usize,
    h: i64,
    x: &Tensor,
    stores: Vec<Arc<dyn BoundaryStore>>,
) -> CheckpointedSequential {
    let mut seq = residual_net(vs, layers, h, 0.0)
        .preserve_rng(false)
        .with_levers(stores);
    seq.profile(x, &vs.trainable_variables(), loss_of).unwrap();
    seq
}

#[test]
#[serial]
fn without_levers_plans_do_not_change() {
    let vs = nn::VarStore::new(CPU);
    let x = rand(&[16, 8, 32]);
    let mut plain = residual_net(&vs, 12, 32, 0.0).preserve_rng(false);
    plain
        .profile(&x, &vs.trainable_variables(), loss_of)
        .unwrap();
    let profile = plain.chain_profile().unwrap().clone();
    let mut without = Solver::new(&profile);
    let mut with_none = Solver::with_levers(&profile, &[]);
    let baseline = predict(&profile, &Schedule::plain(12)).peak_bytes;
    let smallest = smallest_feasible(&mut plain);
    for budget in (smallest..=baseline).step_by(((baseline - smallest) / 40).max(1) as usize) {
        let a = without.solve_budget(budget).unwrap();
        let b = with_none.solve_budget(budget).unwrap();
        assert_eq!(a, b, "at {budget}");
        assert!(a.stored().is_empty());
        plain.set_plan(Plan::Budget(budget)).unwrap();
        assert_eq!(plain.schedule(), &a);
    }
    assert!(without.solve_budget(smallest - 1).is_err());
    assert!(!plain.explain().contains("boundaries"));
}

/// `x + lin2(tanh(lin1(x)))` with a 4x wider middle (the MLP of a transformer block).
fn expansion_net(vs: &nn::VarStore, layers: usize, h: i64) -> CheckpointedSequential {
    let mut seq = CheckpointedSequential::new().preserve_rng(false);
    for i in 0..layers {
        let up = nn::linear(vs.root() / i / "up", h, 4 * h, Default::default());
        let down = nn::linear(vs.root() / i / "down", 4 * h, h, Default::default());
        seq = seq.add_fn(move |x| x + down.forward(&up.forward(x).tanh()));
    }
    seq
}

#[test]
#[serial]
fn lever_plans_fit_their_budget_predicted_and_measured() {
    let vs = nn::VarStore::new(CPU);
    // Boundaries of 256 KiB, parameter gradients of 33 KiB a layer.
    let x = rand(&[256, 8, 32]);
    let store = Arc::new(HostStore::default());
    let mut seq = expansion_net(&vs, 12, 32).with_levers(vec![store.clone()]);
    seq.profile(&x, &vs.trainable_variables(), loss_of).unwrap();
    // Recomputation alone, solved on the same measurements (two models profiled apart
    // would differ by the machine's timing noise, not by the store).
    let profile = seq.chain_profile().unwrap().clone();
    let recompute_only = |budget: u64| Solver::new(&profile).solve_budget(budget);
    let floor = match recompute_only(1) {
        Err(CheckpointError::InfeasibleBudget {
            smallest_feasible, ..
        }) => smallest_feasible.0,
        other => panic!("a 1-byte budget must be infeasible, got {other:?}"),
    };
    let smallest = smallest_feasible(&mut seq);
    assert!(smallest <= floor, "{smallest} vs recompute-only {floor}");
    // At the recompute-only floor, where recomputation alone nests checkpoints deeply, a
    // free store buys back most of the recomputation.
    let alone_at_floor = recompute_only(floor).unwrap();
    seq.set_plan(Plan::Budget(floor)).unwrap();
    assert!(!seq.schedule().stored().is_empty(), "{}", seq.explain());
    assert!(seq.explain().contains("stored by host copy"));
    assert!(
        seq.schedule().forward_count() < alone_at_floor.forward_count(),
        "{}\n{alone_at_floor}",
        seq.explain(),
    );
    let baseline = step_peak(&seq, &vs, &x, true);
    let steps = 6;
    for i in 0..=steps {
        let budget = smallest + (baseline - smallest) * i / steps;
        seq.set_plan(Plan::Budget(budget)).unwrap();
        let predicted = seq.predict().unwrap();
        assert!(
            predicted.peak_bytes <= budget,
            "predicted {predicted:?} > {budget}"
        );
        // The store only adds choices: never slower than recomputation alone.
        if let Ok(alone) = recompute_only(budget) {
            let alone = predict(&profile, &alone).step_time_s;
            assert!(predicted.step_time_s <= alone + 1e-12, "at {budget}");
        }
        for hold in [false, true] {
            // The recompute-only model leaves out the loss's gradient (4 bytes, see
            // stores_add_no_error_to_the_model); it shows where a plan is tight.
            let peak = step_peak(&seq, &vs, &x, hold).saturating_sub(LOSS_GRAD_BYTES);
            assert!(
                peak <= budget,
                "budget {budget}, output held {hold}: measured {peak}\n{}",
                seq.explain()
            );
        }
        assert_eq!(
            store.alive.load(Ordering::SeqCst),
            0,
            "freed after backward"
        );
    }
}

/// Every layer its own checkpoint, every input past the first kept by store 0.
fn every_layer_stored(len: usize) -> Schedule {
    let stored = (1..len)
        .map(|layer| StoredBoundary { layer, lever: 0 })
        .collect();
    Schedule::every_layer(len).with_stored(stored).unwrap()
}

#[test]
#[serial]
fn a_stored_boundary_leaves_memory_until_the_recompute() {
    let vs = nn::VarStore::new(CPU);
    let shape = [4i64, 6, 16];
    let act = 4 * 6 * 16 * 4;
    let x = rand(&shape);
    let store = Arc::new(HostStore::default());
    let mut seq = profiled(&vs, 8, 16, &x, vec![store.clone()]);
    seq.set_schedule(every_layer_stored(8)).unwrap();
    let stored = seq.schedule().clone();
    let n_stored = stored.stored().len() as i64;
    assert!(n_stored > 0, "{}", seq.explain());
    let retained = |seq: &CheckpointedSequential| {
        let (y, m) = measure(CPU, |_| seq.f_forward(&x).unwrap());
        drop(y);
        m.retained_bytes()
    };
    let with_store = retained(&seq);
    assert_eq!(store.alive.load(Ordering::SeqCst), 0);
    let kept = Schedule::new(stored.blocks().to_vec(), 8).unwrap();
    seq.set_schedule(kept).unwrap();
    let without = retained(&seq);
    assert_eq!(without - with_store, n_stored * act);

    // The stored values live as long as the graph.
    seq.set_schedule(stored).unwrap();
    let start = memory_allocated(CPU);
    let loss = loss_of(&seq.f_forward(&x).unwrap());
    assert_eq!(store.alive.load(Ordering::SeqCst), n_stored);
    loss.f_backward().unwrap();
    drop(loss);
    assert_eq!(store.alive.load(Ordering::SeqCst), 0);
    clear_grads(&vs);
    assert_eq!(memory_allocated(CPU), start);
}

/// An I/O failure with the step it broke, whose text leaves the cause out.
#[derive(Debug, thiserror::Error)]
#[error("{what}")]
struct StoreFailed {
    what: &'static str,
    #[source]
    cause: std::io::Error,
}

/// Keeps a boundary as it is until told to fail; then `store` or `restore` fails
/// with a typed error and its cause.
#[derive(Default)]
struct FailingStore {
    fail_store: AtomicBool,
    fail_restore: AtomicBool,
}

impl BoundaryStore for FailingStore {
    fn name(&self) -> String {
        "failing".into()
    }
    fn is_lossless(&self) -> bool {
        true
    }
    fn store(&self, t: &Tensor) -> Result<Stored, StoreError> {
        if self.fail_store.load(Ordering::SeqCst) {
            return Err(Box::new(StoreFailed {
                what: "writing the boundary",
                cause: std::io::Error::other("disk full"),
            }));
        }
        Ok(Box::new(t.copy()))
    }
    fn restore(&self, stored: &Stored) -> Result<Tensor, StoreError> {
        if self.fail_restore.load(Ordering::SeqCst) {
            return Err(Box::new(StoreFailed {
                what: "reading the boundary back",
                cause: std::io::Error::other("file removed"),
            }));
        }
        Ok(stored
            .downcast_ref::<Tensor>()
            .ok_or("not a tensor")?
            .copy())
    }
}

#[test]
#[serial]
fn a_store_s_typed_error_fails_the_step_with_its_cause() {
    let vs = nn::VarStore::new(CPU);
    let x = rand(&[4, 16]);
    let store = Arc::new(FailingStore::default());
    store.fail_store.store(true, Ordering::SeqCst);
    let mut seq = residual_net(&vs, 6, 16, 0.0)
        .preserve_rng(false)
        .with_levers(vec![store.clone()]);
    let e = seq
        .profile(&x, &vs.trainable_variables(), loss_of)
        .unwrap_err();
    assert!(
        e.to_string().contains(
            "calibrating the boundary store \"failing\": store failed: writing the boundary: disk full"
        ),
        "{e}"
    );

    store.fail_store.store(false, Ordering::SeqCst);
    seq.profile(&x, &vs.trainable_variables(), loss_of).unwrap();
    seq.set_schedule(every_layer_stored(6)).unwrap();
    store.fail_restore.store(true, Ordering::SeqCst);
    let loss = loss_of(&seq.f_forward(&x).unwrap());
    let e = loss.f_backward().unwrap_err();
    assert!(
        e.to_string()
            .contains("reading the boundary back: file removed"),
        "{e}"
    );
    clear_grads(&vs);
}

#[test]
#[serial]
fn a_schedule_naming_a_missing_store_is_refused() {
    let vs = nn::VarStore::new(CPU);
    let x = rand(&[4, 16]);
    let mut seq = profiled(&vs, 6, 16, &x, vec![Arc::new(HostStore::default())]);
    let schedule = every_layer_stored(6);
    seq.set_schedule(schedule.clone()).unwrap();
    let mut bare = residual_net(&vs, 6, 16, 0.0);
    let err = bare.set_schedule(schedule).unwrap_err();
    assert!(err.to_string().contains("with_levers"), "{err}");
}

/// A plan snapshot's schedule numbers its stores by their place among the chain's:
/// after `set_levers` replaced them (as many, one lossy), putting the snapshot back is
/// refused, naming the cause, and leaves the chain as it was (no store swapped in
/// silently, no store index past the end).
#[test]
#[serial]
fn a_plan_snapshot_is_refused_once_its_stores_were_replaced() {
    let vs = nn::VarStore::new(CPU);
    let x = rand(&[4, 16]);
    let mut seq = profiled(&vs, 6, 16, &x, vec![Arc::new(HostStore::default())]);
    seq.set_schedule(every_layer_stored(6)).unwrap();
    let snapshot = seq.plan_snapshot();
    // Same stores: it goes back.
    seq.restore_plan(snapshot.clone()).unwrap();
    assert!(seq.explain().contains("stored by"), "{}", seq.explain());
    for stores in [
        vec![Arc::new(Bf16Store) as Arc<dyn BoundaryStore>],
        Vec::new(),
    ] {
        let count = stores.len();
        seq.set_levers(stores);
        let before = seq.explain();
        let err = seq.restore_plan(snapshot.clone()).unwrap_err();
        assert!(
            matches!(err, CheckpointError::InvalidPlan(_))
                && err.to_string().contains("set_levers"),
            "{err}"
        );
        assert_eq!(seq.explain(), before, "with {count} stores");
        assert!(!before.contains("stored by"), "{before}");
    }
}

#[test]
#[serial]
fn a_lossy_store_keeps_gradients_close() {
    let vs = nn::VarStore::new(CPU);
    let x = rand(&[16, 8, 32]);
    let mut seq = profiled(&vs, 10, 32, &x, vec![Arc::new(Bf16Store)]);
    let baseline = step_grads(&seq, &vs, &x);
    seq.set_schedule(every_layer_stored(10)).unwrap();
    assert!(seq.explain().contains("(lossy)"), "{}", seq.explain());
    let planned = step_grads(&seq, &vs, &x);
    let (mut diff, mut norm) = (0.0, 0.0);
    for (a, b) in baseline.iter().zip(&planned) {
        diff += (a - b).square().sum(Kind::Double).double_value(&[]);
        norm += a.square().sum(Kind::Double).double_value(&[]);
    }
    let rel_l2 = (diff / norm).sqrt();
    // bf16 keeps 8 bits of mantissa: a relative error of at most 2^-9 per stored value.
    assert!(rel_l2 > 0.0 && rel_l2 <= 1e-2, "relative L2 {rel_l2}");
}

/// `tanh(linear(x)) + x`: as in the entry_points module, differentiable twice.
fn tanh_net(vs: &nn::VarStore, layers: usize, h: i64) -> CheckpointedSequential {
    let mut seq = CheckpointedSequential::new();
    for i in 0..layers {
        let lin = nn::linear(vs.root() / i, h, h, Default::default());
        seq = seq.add_fn(move |x| lin.forward(x).tanh() + x);
    }
    seq
}

#[derive(Debug, Clone, Copy)]
enum Entry {
    Backward,
    GradToParams,
    GradToInput,
    DoubleBackward,
    RetainGraph,
}

fn gradients(
    seq: &CheckpointedSequential,
    vs: &nn::VarStore,
    x0: &Tensor,
    entry: Entry,
) -> Vec<Tensor> {
    clear_grads(vs);
    let x = x0.detach().set_requires_grad(true);
    let params = vs.trainable_variables();
    let loss = loss_of(&seq.f_forward(&x).unwrap());
    let grads_of = |ts: &[Tensor]| ts.iter().map(|p| p.grad().copy()).collect::<Vec<_>>();
    match entry {
        Entry::Backward => {
            loss.f_backward().unwrap();
            let mut out = grads_of(&params);
            out.push(x.grad().copy());
            out
        }
        Entry::GradToParams => Tensor::f_run_backward(&[&loss], &params, false, false).unwrap(),
        Entry::GradToInput => Tensor::f_run_backward(&[&loss], &[&x], false, false).unwrap(),
        Entry::DoubleBackward => {
            let g = Tensor::f_run_backward(&[&loss], &[&x], true, true).unwrap();
            g[0].square().sum(Kind::Float).f_backward().unwrap();
            grads_of(&params)
        }
        Entry::RetainGraph => {
            let one = Tensor::ones([], (Kind::Float, CPU));
            backward_with_grads(&[loss.shallow_clone()], &[one.shallow_clone()], true).unwrap();
            backward_with_grads(&[loss.shallow_clone()], &[one], false).unwrap();
            grads_of(&params)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    #[serial]
    fn lossless_stores_give_the_baseline_gradients_bitwise(
        depth in 3usize..=8,
        width in 2i64..=8,
        batch in 1i64..=3,
        k in 0u64..=3,
        seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let vs = nn::VarStore::new(CPU);
        let x = rand(&[batch, width]);
        let store = Arc::new(HostStore::default());
        let mut seq = tanh_net(&vs, depth, width).with_levers(vec![store.clone()]);
        seq.profile(&x, &vs.trainable_variables(), loss_of).unwrap();
        seq.set_plan(Plan::None).unwrap();
        let high = seq.predict().unwrap().peak_bytes;
        let low = smallest_feasible(&mut seq);
        // From the least memory (stores in use) up towards the baseline.
        let budget = low + high.saturating_sub(low) * k / 6;
        for entry in [Entry::Backward, Entry::GradToParams, Entry::GradToInput, Entry::DoubleBackward, Entry::RetainGraph] {
            seq.set_plan(Plan::None).unwrap();
            let baseline = gradients(&seq, &vs, &x, entry);
            seq.set_plan(Plan::Budget(budget)).unwrap();
            let planned = gradients(&seq, &vs, &x, entry);
            prop_assert_eq!(baseline.len(), planned.len());
            for (i, (a, b)) in baseline.iter().zip(&planned).enumerate() {
                prop_assert!(a.equal(b), "{:?}, gradient {}, schedule {}", entry, i, seq.schedule());
            }
            prop_assert_eq!(store.alive.load(Ordering::SeqCst), 0);
        }
    }
}

#[test]
#[serial]
fn a_module_chain_works_with_levers() {
    // Modules (not closures) and a layer that keeps its output (relu): its output is
    // never offered to a store, since relu's own copy stays anyway.
    let vs = nn::VarStore::new(CPU);
    let mut seq = CheckpointedSequential::new().preserve_rng(false);
    for i in 0..6 {
        seq = seq.add(nn::linear(vs.root() / i, 16, 16, Default::default()));
        seq = seq.add_fn(|x| x.relu());
    }
    let mut seq = seq.with_levers(vec![Arc::new(HostStore::default())]);
    let x = rand(&[8, 16]);
    seq.profile(&x, &vs.trainable_variables(), loss_of).unwrap();
    let boundaries = &seq.lever_profiles()[0].boundaries;
    for (l, b) in boundaries.iter().enumerate() {
        // Inputs of linear layers (l even, past 0) follow a relu: not storable.
        assert_eq!(b.is_some(), l % 2 == 1, "boundary {l}");
    }
    let smallest = smallest_feasible(&mut seq);
    seq.set_plan(Plan::Budget(smallest)).unwrap();
    let y = seq.forward(&x);
    loss_of(&y).backward();
}

/// Exact model check: on every-layer checkpointing with the first `n` boundaries stored,
/// the measured peak differs from the prediction by the same bytes for every `n`, the
/// recompute-only model's own gap (4 bytes on this chain: the loss's gradient, which
/// `backward()` creates and holds until it returns): stores add no error of their own,
/// and each stored boundary lowers the peak.
#[test]
#[serial]
fn stores_add_no_error_to_the_model() {
    let vs = nn::VarStore::new(CPU);
    let x = rand(&[256, 8, 32]);
    let act = 256 * 8 * 32 * 4;
    let mut seq = expansion_net(&vs, 12, 32).with_levers(vec![Arc::new(HostStore::default())]);
    seq.profile(&x, &vs.trainable_variables(), loss_of).unwrap();
    let mut gaps = Vec::new();
    let mut peaks = Vec::new();
    for n in [0usize, 1, 2, 5, 11] {
        let stored = (1..=n)
            .map(|layer| StoredBoundary { layer, lever: 0 })
            .collect();
        seq.set_schedule(Schedule::every_layer(12).with_stored(stored).unwrap())
            .unwrap();
        let predicted = seq.predict().unwrap().peak_bytes as i64;
        let measured = step_peak(&seq, &vs, &x, true) as i64;
        gaps.push(measured - predicted);
        peaks.push((n, measured));
    }
    assert!(gaps.iter().all(|g| *g == gaps[0]), "{gaps:?}");
    // The first stored boundaries lower the peak by exactly one boundary each; later
    // ones less, once another phase of the step sets the peak.
    assert_eq!(peaks[0].1 - peaks[1].1, act, "{peaks:?}");
    assert_eq!(peaks[0].1 - peaks[2].1, 2 * act, "{peaks:?}");
    assert!(peaks.windows(2).all(|w| w[1].1 < w[0].1), "{peaks:?}");
}
