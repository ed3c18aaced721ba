//! A chain is a model of blocks: `CheckpointedSequential` runs every plan on its own
//! `Blocks` (each checkpoint of the schedule a block, nested ones inside it), and
//! `Plan::PerLayer` puts every layer under a lever of its own, as any model of blocks.
use super::blocks::{assert_bitwise, gradients_through, lever, Entry, ENTRIES};
use memsave_checkpoint::{BlockKey, BlockLever, CheckpointedSequential, Plan};
use memsave_meter::measure;
use memsave_sys::tensor::set_grad_none;
use proptest::prelude::*;
use serial_test::serial;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

const H: i64 = 6;
const LAYERS: usize = 6;

/// A chain of six layers: residual linear-tanh, BatchNorm, dropout, a plain linear.
fn chain() -> (nn::VarStore, CheckpointedSequential) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root();
    let lin = |i: usize| nn::linear(&p / i, H, H, Default::default());
    let (l0, l1, l3, l4, l5) = (lin(0), lin(1), lin(3), lin(4), lin(5));
    let bn = nn::batch_norm1d(&p / "bn", H, Default::default());
    let seq = CheckpointedSequential::new()
        .add_fn(move |x| x + l0.forward(x).tanh())
        .add_fn_t(move |x, train| bn.forward_t(&l1.forward(x), train).relu())
        .add_fn(move |x| x.dropout(0.25, true))
        .add_fn(move |x| l3.forward(x).sigmoid() + x)
        .add_fn(move |x| l4.forward(x).tanh())
        .add_fn(move |x| l5.forward(x));
    (vs, seq)
}

/// Sets `plan` on `seq` and, for `Plan::PerLayer`, layer `i` under `lever(levers[i])`.
fn set_plan(seq: &mut CheckpointedSequential, plan: Plan, levers: &[u8]) {
    seq.set_plan(plan).unwrap();
    if plan == Plan::PerLayer {
        let assignment = levers
            .iter()
            .enumerate()
            .map(|(i, &l)| (BlockKey::new(format!("layer {i}"), 0), lever(l)));
        seq.blocks().set_levers(assignment).unwrap();
    }
}

/// One step of a fresh chain under `plan` and, for `Plan::PerLayer`, `levers` (see
/// `blocks::lever`), through `entry`: the gradients and every variable after it.
fn step(plan: Plan, levers: &[u8], entry: Entry) -> (Vec<Tensor>, Vec<Tensor>) {
    let (vs, mut seq) = chain();
    set_plan(&mut seq, plan, levers);
    for p in vs.trainable_variables() {
        set_grad_none(&p).unwrap();
    }
    let x = Tensor::randn([5, H], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    tch::manual_seed(7);
    let loss = seq.f_forward(&x).unwrap().square().mean(Kind::Float);
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let params: Vec<Tensor> = named
        .iter()
        .filter(|(_, v)| v.requires_grad())
        .map(|(_, v)| v.shallow_clone())
        .collect();
    let grads = gradients_through(entry, &loss, &params, &x);
    (grads, named.into_iter().map(|(_, v)| v.copy()).collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Keep, recompute, recompute with the input in a store, saves to lossless hooks:
    /// any mix over the layers gives the plain chain's gradients and variables
    /// (BatchNorm's running statistics updated once), bitwise.
    #[test]
    #[serial]
    fn every_lossless_lever_per_layer_gives_the_plain_gradients_and_statistics(
        levers in proptest::collection::vec(0u8..4, LAYERS),
        entry in 0..ENTRIES.len(),
    ) {
        let entry = ENTRIES[entry];
        let (plain_grads, plain_vars) = step(Plan::None, &[], entry);
        let (grads, vars) = step(Plan::PerLayer, &levers, entry);
        assert_bitwise(&plain_grads, &grads, &format!("{entry:?} {levers:?} gradient"));
        assert_bitwise(&plain_vars, &vars, &format!("{entry:?} {levers:?} variable"));
    }
}

/// What a forward holds after it, measured: per layer, every layer kept is the plain
/// chain to the byte and every layer recomputed is `Plan::EveryLayer` to the byte (the
/// same engine, the same checkpoints); the first two layers kept, the rest recomputed,
/// lies strictly between.
#[test]
#[serial]
fn per_layer_levers_hold_what_the_uniform_plans_hold() {
    let x = Tensor::rand([64, H], (Kind::Float, Device::Cpu));
    let retained = |plan: Plan, levers: &[u8]| {
        let (_vs, seq) = chain();
        // No backward here: no generator state to keep per checkpoint.
        let mut seq = seq.preserve_rng(false);
        set_plan(&mut seq, plan, levers);
        let (y, m) = measure(Device::Cpu, |_| seq.f_forward(&x).unwrap());
        drop(y);
        m.retained_bytes()
    };
    let plain = retained(Plan::None, &[]);
    let every = retained(Plan::EveryLayer, &[]);
    assert!(every < plain, "every layer {every} vs plain {plain}");
    assert_eq!(retained(Plan::PerLayer, &[0; LAYERS]), plain);
    assert_eq!(retained(Plan::PerLayer, &[1; LAYERS]), every);
    let mixed = retained(Plan::PerLayer, &[0, 0, 1, 1, 1, 1]);
    assert!(
        every < mixed && mixed < plain,
        "{every} < {mixed} < {plain}"
    );
}

/// The schedule's checkpoints are the blocks of the chain's engine: their keys, depth
/// and lever are recorded, nested ones inside their parent.
#[test]
#[serial]
fn the_schedule_s_checkpoints_run_as_blocks() {
    let (_vs, mut seq) = chain();
    let x = Tensor::rand([4, H], (Kind::Float, Device::Cpu));
    let keys = |seq: &CheckpointedSequential| -> Vec<(String, usize, String)> {
        seq.blocks()
            .last_forward()
            .into_iter()
            .map(|r| (r.key.to_string(), r.depth, r.lever))
            .collect()
    };
    seq.set_plan(Plan::Segments(2)).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    assert_eq!(
        keys(&seq),
        [("layers 0..3#0".to_string(), 0, "recompute".to_string())]
    );
    seq.set_plan(Plan::Nested).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    let nested = keys(&seq);
    assert!(nested.iter().any(|(_, depth, _)| *depth > 0), "{nested:?}");
    assert!(nested
        .iter()
        .all(|(k, _, l)| k.starts_with("layers ") && l == "recompute"));
    seq.set_plan(Plan::None).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    assert!(keys(&seq).is_empty());
    seq.set_plan(Plan::PerLayer).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    let per_layer: Vec<String> = keys(&seq).into_iter().map(|(k, ..)| k).collect();
    let expected: Vec<String> = (0..LAYERS).map(|i| format!("layer {i}#0")).collect();
    assert_eq!(per_layer, expected);
}

/// Levers on the blocks of a chain under a schedule are refused by its next forward,
/// naming the block; a new plan other than per-layer forgets them. Levers per layer
/// may be set as soon as the plan is per-layer, before its first forward.
#[test]
#[serial]
fn per_layer_levers_need_the_per_layer_plan() {
    let (_vs, mut seq) = chain();
    let x = Tensor::rand([4, H], (Kind::Float, Device::Cpu));
    seq.set_plan(Plan::Segments(2)).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    seq.set_plan(Plan::PerLayer).unwrap();
    seq.blocks()
        .set(BlockKey::new("layer 2", 0), BlockLever::Recompute)
        .unwrap();
    let _ = seq.f_forward(&x).unwrap();
    assert_eq!(seq.blocks().last_forward()[2].lever, "recompute");
    // Set after the plan changed: the schedule's forward does not run it.
    seq.set_plan(Plan::EveryLayer).unwrap();
    seq.blocks()
        .set(BlockKey::new("layer 2", 0), BlockLever::Recompute)
        .unwrap();
    let err = seq.f_forward(&x).unwrap_err().to_string();
    assert!(
        err.contains("layer 2#0: recompute") && err.contains("set Plan::PerLayer"),
        "{err}"
    );
    seq.set_plan(Plan::EveryLayer).unwrap();
    assert!(seq.f_forward(&x).is_ok());
}

/// Under a schedule, levers on the chain's blocks (for every block, or for a
/// checkpoint's key) are refused by the next forward, naming them, instead of being
/// ignored; new boundary stores (`set_levers`) forget the levers per layer.
#[test]
#[serial]
fn levers_a_schedule_would_ignore_are_refused() {
    let (_vs, mut seq) = chain();
    let x = Tensor::rand([4, H], (Kind::Float, Device::Cpu));
    seq.set_plan(Plan::Segments(2)).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    seq.blocks().set_every(BlockLever::Recompute);
    let err = seq.f_forward(&x).unwrap_err().to_string();
    assert!(
        err.contains("every block: recompute") && err.contains("set Plan::PerLayer"),
        "{err}"
    );
    seq.set_plan(Plan::Segments(2)).unwrap();
    let _ = seq.f_forward(&x).unwrap();
    seq.blocks()
        .set(BlockKey::new("layers 0..3", 0), BlockLever::Keep)
        .unwrap();
    let err = seq.f_forward(&x).unwrap_err().to_string();
    assert!(err.contains("layers 0..3#0: keep"), "{err}");
    // Per layer, then new stores: back to a plain chain that runs.
    seq.set_plan(Plan::PerLayer).unwrap();
    seq.blocks()
        .set(BlockKey::new("layer 1", 0), BlockLever::Recompute)
        .unwrap();
    let _ = seq.f_forward(&x).unwrap();
    seq.set_levers(Vec::new());
    assert_eq!(seq.plan(), Plan::None);
    assert!(seq.f_forward(&x).is_ok());
}

/// `explain()` lists the levers per layer in the chain's order: `layer 2` before
/// `layer 10`, not as strings sort.
#[test]
#[serial]
fn explain_lists_levers_per_layer_in_the_chain_s_order() {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut seq = CheckpointedSequential::new();
    for i in 0..12 {
        let l = nn::linear(vs.root() / i, H, H, Default::default());
        seq = seq.add_fn(move |x| l.forward(x).tanh());
    }
    seq.set_plan(Plan::PerLayer).unwrap();
    let x = Tensor::randn([3, H], (Kind::Float, Device::Cpu));
    // Before any forward (the order the levers were assigned for is not known yet) and
    // after one.
    let picked = [10usize, 2, 11, 1];
    for forward in [false, true] {
        if forward {
            let _ = seq.f_forward(&x).unwrap();
        }
        let levers = picked.iter().map(|&i| {
            (
                BlockKey::new(format!("layer {i}"), 0),
                BlockLever::Recompute,
            )
        });
        seq.blocks().set_levers(levers).unwrap();
        let text = seq.explain();
        let line = text
            .lines()
            .find(|l| l.starts_with("levers per layer:"))
            .unwrap_or_else(|| panic!("{text}"));
        assert_eq!(
            line,
            "levers per layer: layer 1#0: recompute, layer 2#0: recompute, layer 10#0: recompute, layer 11#0: recompute",
            "after a forward: {forward}"
        );
    }
}
