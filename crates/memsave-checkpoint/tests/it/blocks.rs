//! `Blocks`: blocks of a forward that is not a chain (a skip across blocks, a block run
//! twice with shared weights, a block with two inputs and two outputs, blocks inside a
//! block, BatchNorm and dropout), each under its own lever: every lossless assignment
//! gives the plain forward's gradients and running statistics, bitwise, under every
//! autograd entry point.
use memsave_checkpoint::{
    BlockKey, BlockLever, BlockNotice, Blocks, BoundaryStore, CheckpointError, Shared, StoreError,
    Stored,
};
use memsave_meter::measure;
use memsave_sys::hooks::{Packed, RawHooks};
use memsave_sys::tensor::{backward_with_grads, set_grad_none};
use memsave_sys::CallbackError;
use proptest::prelude::*;
use serial_test::serial;
use std::sync::Arc;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const H: i64 = 6;

/// Keeps a copy of every saved tensor (lossless, as a store to host memory would).
pub(crate) struct CopyHooks;

impl RawHooks for CopyHooks {
    fn pack(&self, tensor: &Tensor, _: Option<&str>) -> Result<Packed, CallbackError> {
        Ok(Box::new(tensor.copy()))
    }
    fn unpack(&self, packed: &Packed) -> Result<Tensor, CallbackError> {
        let t = packed.downcast_ref::<Tensor>().ok_or("not a tensor")?;
        Ok(t.shallow_clone())
    }
}

/// Keeps a boundary's f32 values in a Rust vector, off libtorch's allocator (what the
/// meter counts), as a file would: lossless.
pub(crate) struct VecStore;

impl BoundaryStore for VecStore {
    fn name(&self) -> String {
        "a vector".into()
    }
    fn is_lossless(&self) -> bool {
        true
    }
    fn store(&self, t: &Tensor) -> Result<Stored, StoreError> {
        let values = Vec::<f32>::try_from(t.flatten(0, -1))?;
        Ok(Box::new((values, t.size())))
    }
    fn restore(&self, stored: &Stored) -> Result<Tensor, StoreError> {
        let (values, size) = stored
            .downcast_ref::<(Vec<f32>, Vec<i64>)>()
            .ok_or("not ours")?;
        Ok(Tensor::from_slice(values).view(size.as_slice()))
    }
}

/// The graph's modules, shared with the block functions by `Arc`.
struct Net {
    vs: nn::VarStore,
    stem: Shared<nn::Linear>,
    enc: Shared<nn::Linear>,
    bn: Shared<nn::BatchNorm>,
    mix: Shared<nn::Linear>,
    inner: Shared<nn::Linear>,
    inner2: Shared<nn::Linear>,
    dec: Shared<nn::Linear>,
}

impl Net {
    fn new() -> Net {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let p = vs.root();
        let lin = |name: &str, i, o| Shared::new(nn::linear(&p / name, i, o, Default::default()));
        Net {
            stem: lin("stem", H, H),
            enc: lin("enc", H, H),
            bn: Shared::new(nn::batch_norm1d(&p / "bn", H, Default::default())),
            mix: lin("mix", H, H),
            inner: lin("inner", H, H),
            inner2: lin("inner2", 2 * H, H),
            dec: lin("dec", 3 * H, H),
            vs,
        }
    }

    /// stem -> enc (BatchNorm) -> mix twice (shared weights) -> body (two inputs, two
    /// outputs, two blocks inside, dropout) -> dec (reads enc's output across blocks).
    fn forward(&self, b: &Blocks, x: &Tensor) -> Result<Tensor, CheckpointError> {
        let stem = self.stem.clone();
        let s = b.run("stem", &[x], move |xs| vec![stem.forward(&xs[0]).tanh()])?;
        let (enc, bn) = (self.enc.clone(), self.bn.clone());
        let e = b.run("enc", &[&s[0]], move |xs| {
            vec![bn.forward_t(&enc.forward(&xs[0]), true).relu()]
        })?;
        let mut m = e[0].shallow_clone();
        for _ in 0..2 {
            let mix = self.mix.clone();
            m = b.run("mix", &[&m], move |xs| {
                vec![mix.forward(&xs[0]).tanh() + &xs[0]]
            })?[0]
                .shallow_clone();
        }
        let (inner, inner2, nested) = (self.inner.clone(), self.inner2.clone(), b.clone());
        let body = b.try_run("body", &[&m, &s[0]], move |xs| {
            let inner = inner.clone();
            let a = nested.run("inner", &[&xs[0]], move |ys| {
                vec![inner.forward(&ys[0]).tanh()]
            })?;
            let inner2 = inner2.clone();
            let c = nested.run("inner2", &[&a[0], &xs[1]], move |ys| {
                let z = inner2.forward(&Tensor::cat(&[&ys[0], &ys[1]], 1));
                vec![z.dropout(0.25, true).sigmoid()]
            })?;
            Ok::<_, CheckpointError>(vec![&c[0] + &xs[0], a[0].shallow_clone()])
        })?;
        let dec = self.dec.clone();
        let y = b.run("dec", &[&body[0], &e[0], &body[1]], move |xs| {
            vec![dec
                .forward(&Tensor::cat(&[&xs[0], &xs[1], &xs[2]], 1))
                .tanh()]
        })?;
        Ok(y[0].square().mean(Kind::Float) + body[1].mean(Kind::Float))
    }
}

const KEYS: [(&str, usize); 8] = [
    ("stem", 0),
    ("enc", 0),
    ("mix", 0),
    ("mix", 1),
    ("body", 0),
    ("inner", 0),
    ("inner2", 0),
    ("dec", 0),
];

#[derive(Debug, Clone, Copy)]
pub(crate) enum Entry {
    Backward,
    GradToParams,
    GradToInput,
    DoubleBackward,
    RetainGraph,
}

pub(crate) const ENTRIES: [Entry; 5] = [
    Entry::Backward,
    Entry::GradToParams,
    Entry::GradToInput,
    Entry::DoubleBackward,
    Entry::RetainGraph,
];

pub(crate) fn lever(i: u8) -> BlockLever {
    match i {
        0 => BlockLever::Keep,
        1 => BlockLever::Recompute,
        2 => BlockLever::RecomputeStoringInputs {
            store: Arc::new(VecStore),
        },
        _ => BlockLever::store("copy", true, Arc::new(CopyHooks)),
    }
}

/// One step of a fresh net under `levers` (`None`: plain) through `entry`: the
/// gradients it produced and every variable after it (running statistics included).
fn step(levers: Option<&[u8]>, entry: Entry) -> (Vec<Tensor>, Vec<Tensor>) {
    let net = Net::new();
    let blocks = Blocks::new();
    let x0 = Tensor::randn([5, H], (Kind::Float, Device::Cpu));
    if let Some(levers) = levers {
        // A first forward makes the keys known; its running statistics are put back.
        let vars = net.vs.variables();
        let stats: Vec<(String, Tensor)> =
            vars.iter().map(|(n, v)| (n.clone(), v.copy())).collect();
        let _ = blocks.forward(|b| net.forward(b, &x0)).unwrap().unwrap();
        tch::no_grad(|| {
            for (name, s) in &stats {
                vars[name].shallow_clone().copy_(s);
            }
        });
        let assignment = KEYS
            .iter()
            .zip(levers)
            .map(|(&(n, c), &l)| (BlockKey::new(n, c), lever(l)));
        blocks.assign(assignment).unwrap();
    }
    for p in net.vs.trainable_variables() {
        set_grad_none(&p).unwrap();
    }
    let x = x0.detach().set_requires_grad(true);
    tch::manual_seed(7);
    let loss = blocks.forward(|b| net.forward(b, &x)).unwrap().unwrap();
    // By name: a VarStore lists its variables in no fixed order.
    let mut named: Vec<(String, Tensor)> = net.vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let params: Vec<Tensor> = named
        .into_iter()
        .filter(|(_, v)| v.requires_grad())
        .map(|(_, v)| v)
        .collect();
    let grads = gradients_through(entry, &loss, &params, &x);
    let mut names: Vec<_> = net.vs.variables().into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    (grads, names.into_iter().map(|(_, v)| v.copy()).collect())
}

/// The gradients `entry` produces from `loss`: backward (every parameter's, then the
/// input's), `run_backward` to the parameters or to the input, double backward
/// through the input's gradient, or two backward passes with `retain_graph` (the
/// parameters').
pub(crate) fn gradients_through(
    entry: Entry,
    loss: &Tensor,
    params: &[Tensor],
    x: &Tensor,
) -> Vec<Tensor> {
    let grads_of = |ts: &[Tensor]| ts.iter().map(|p| p.grad().copy()).collect::<Vec<_>>();
    match entry {
        Entry::Backward => {
            loss.f_backward().unwrap();
            let mut out = grads_of(params);
            out.push(x.grad().copy());
            out
        }
        Entry::GradToParams => Tensor::f_run_backward(&[loss], params, false, false).unwrap(),
        Entry::GradToInput => Tensor::f_run_backward(&[loss], &[x], false, false).unwrap(),
        Entry::DoubleBackward => {
            let g = Tensor::f_run_backward(&[loss], &[x], true, true).unwrap();
            g[0].square().sum(Kind::Float).f_backward().unwrap();
            grads_of(params)
        }
        Entry::RetainGraph => {
            let one = Tensor::ones([], (Kind::Float, Device::Cpu));
            backward_with_grads(&[loss.shallow_clone()], &[one.shallow_clone()], true).unwrap();
            backward_with_grads(&[loss.shallow_clone()], &[one], false).unwrap();
            grads_of(params)
        }
    }
}

pub(crate) fn assert_bitwise(a: &[Tensor], b: &[Tensor], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: count");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(x.defined() && y.defined(), "{what} {i}: undefined");
        assert!(
            x.equal(y),
            "{what} {i} differs by {} (of {})",
            (x - y).abs().max().double_value(&[]),
            x.abs().max().double_value(&[])
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    #[serial]
    fn every_lossless_assignment_gives_the_plain_gradients_and_statistics(
        levers in proptest::collection::vec(0u8..4, KEYS.len()),
        entry in 0..ENTRIES.len(),
    ) {
        let entry = ENTRIES[entry];
        let (plain_grads, plain_vars) = step(None, entry);
        let (grads, vars) = step(Some(&levers), entry);
        assert_bitwise(&plain_grads, &grads, &format!("{entry:?} {levers:?} gradient"));
        assert_bitwise(&plain_vars, &vars, &format!("{entry:?} {levers:?} variable"));
    }
}

#[test]
#[serial]
fn every_block_recomputed_gives_the_plain_gradients_under_every_entry_point() {
    for entry in ENTRIES {
        let (plain_grads, plain_vars) = step(None, entry);
        for lever in [1, 2] {
            let (grads, vars) = step(Some(&[lever; 8]), entry);
            assert_bitwise(&plain_grads, &grads, &format!("{entry:?} {lever} gradient"));
            assert_bitwise(&plain_vars, &vars, &format!("{entry:?} {lever} variable"));
        }
    }
}

#[test]
#[serial]
fn the_forward_records_every_call_with_its_key_depth_and_lever() {
    let net = Net::new();
    let blocks = Blocks::new();
    let x = Tensor::randn([5, H], (Kind::Float, Device::Cpu));
    let _ = blocks.forward(|b| net.forward(b, &x)).unwrap().unwrap();
    let expected: Vec<BlockKey> = KEYS.iter().map(|&(n, c)| BlockKey::new(n, c)).collect();
    assert_eq!(blocks.keys(), expected);
    let depths: Vec<usize> = blocks.last_forward().iter().map(|r| r.depth).collect();
    assert_eq!(depths, [0, 0, 0, 0, 0, 1, 1, 0]);
    let dec = &blocks.last_forward()[7];
    // dec's inputs: three [5, 6] f32 tensors.
    assert_eq!(dec.input_bytes, 3 * 5 * 6 * 4);
    assert_eq!(dec.output_bytes, 5 * 6 * 4);
    blocks.set_every(BlockLever::Recompute);
    let _ = blocks.forward(|b| net.forward(b, &x)).unwrap().unwrap();
    assert!(blocks.last_forward().iter().all(|r| r.lever == "recompute"));
    assert_eq!(blocks.keys(), expected, "a recomputation records nothing");
}

/// A block of `relu(linear(x)).tanh()`: kept, it holds relu's output and tanh's (two
/// activations); recomputed, its output only (the RNG state it keeps is not on the
/// device's allocator).
#[test]
#[serial]
fn a_recomputed_block_keeps_its_output_only() {
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = Shared::new(nn::linear(vs.root(), 64, 64, Default::default()));
    let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
    let act = 32 * 64 * 4;
    let blocks = Blocks::new();
    let run = |blocks: &Blocks| {
        let lin = lin.clone();
        blocks.run("block", &[&x], move |xs| {
            vec![lin.forward(&xs[0]).relu().tanh()]
        })
    };
    let (y, kept) = measure(Device::Cpu, |_| blocks.forward(run).unwrap().unwrap());
    assert_eq!(kept.retained_bytes(), 2 * act);
    assert_eq!(blocks.last_forward()[0].retained_bytes, 2 * act);
    drop(y);
    blocks.set_every(BlockLever::Recompute);
    let (y, recomputed) = measure(Device::Cpu, |_| blocks.forward(run).unwrap().unwrap());
    assert_eq!(recomputed.retained_bytes(), act);
    y[0].sum(Kind::Float).backward();
    assert!(lin.with(|l| l.ws.grad().defined()));
}

#[test]
#[serial]
fn a_forward_whose_blocks_changed_is_refused_before_the_block_runs() {
    let blocks = Blocks::new();
    let x = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let forward = |names: &'static [&'static str]| {
        let ran = ran.clone();
        let x = x.shallow_clone();
        move |b: &Blocks| -> Result<(), CheckpointError> {
            for name in names {
                let ran = ran.clone();
                b.run(name, &[&x], move |xs| {
                    ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    vec![&xs[0] * 2]
                })?;
            }
            Ok(())
        }
    };
    blocks.forward(forward(&["a", "b"])).unwrap().unwrap();
    blocks
        .set(BlockKey::new("b", 0), BlockLever::Recompute)
        .unwrap();
    ran.store(0, std::sync::atomic::Ordering::SeqCst);
    let err = blocks.forward(forward(&["a", "c"])).unwrap().unwrap_err();
    assert!(matches!(err, CheckpointError::BlocksChanged(_)), "{err}");
    assert!(
        err.to_string().contains("c#0") && err.to_string().contains("b#0"),
        "{err}"
    );
    assert_eq!(
        ran.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "c did not run"
    );
    // Fewer blocks than planned: refused once the forward ends.
    let err = blocks.forward(forward(&["a"])).unwrap_err();
    assert!(err.to_string().contains("b#0 did not run"), "{err}");
    // More blocks than planned.
    let err = blocks
        .forward(forward(&["a", "b", "b"]))
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("b#1"), "{err}");
    // A uniform lever follows any forward.
    blocks.set_every(BlockLever::Recompute);
    blocks.forward(forward(&["c"])).unwrap().unwrap();
}

#[test]
#[serial]
fn misuse_gets_an_error_that_says_what_to_do() {
    let blocks = Blocks::new();
    let x = Tensor::ones([2], (Kind::Float, Device::Cpu));
    let err = blocks.run("a", &[&x], |xs| vec![xs[0].copy()]).unwrap_err();
    assert!(err.to_string().contains("blocks.forward"), "{err}");
    // Before any forward a lever is taken, and checked by the first forward.
    blocks
        .set(BlockKey::new("z", 0), BlockLever::Recompute)
        .unwrap();
    let err = blocks
        .forward(|b| b.run("a", &[&x], |xs| vec![xs[0].copy()]))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("z#0, which the forward did not run"),
        "{err}"
    );
    blocks.set_every(BlockLever::Keep);
    blocks
        .forward(|b| b.run("a", &[&x], |xs| vec![xs[0].copy()]))
        .unwrap()
        .unwrap();
    let err = blocks
        .set(BlockKey::new("a", 1), BlockLever::Recompute)
        .unwrap_err();
    assert!(
        err.to_string().contains("no block a#1") && err.to_string().contains("a#0"),
        "{err}"
    );
    let err = blocks.forward(|b| b.forward(|_| ())).unwrap().unwrap_err();
    assert!(err.to_string().contains("one forward at a time"), "{err}");
    // A panicking block is an error naming it, and the blocks stay usable.
    let err = blocks
        .forward(|b| b.run("a", &[&x], |_| panic!("boom")))
        .unwrap()
        .unwrap_err();
    assert!(
        err.to_string().contains("block a#0") && err.to_string().contains("boom"),
        "{err}"
    );
    blocks
        .forward(|b| b.run("a", &[&x], |xs| vec![xs[0].copy()]))
        .unwrap()
        .unwrap();
}

/// Four recomputed blocks in a row: each checkpoint keeps its input, the output of the
/// block before (three activations and the output); with the inputs in a store, only
/// the output stays (the first input is the caller's).
#[test]
#[serial]
fn recomputed_blocks_with_stored_inputs_keep_only_the_output() {
    let vs = nn::VarStore::new(Device::Cpu);
    let lins: Vec<Shared<nn::Linear>> = (0..4)
        .map(|i| Shared::new(nn::linear(vs.root() / i, 64, 64, Default::default())))
        .collect();
    let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
    let act = 32 * 64 * 4;
    let blocks = Blocks::new();
    let chain = |b: &Blocks| -> Result<Tensor, CheckpointError> {
        let mut h = x.shallow_clone();
        for lin in &lins {
            let lin = lin.clone();
            h = b.run("layer", &[&h], move |xs| vec![lin.forward(&xs[0]).tanh()])?[0]
                .shallow_clone();
        }
        Ok(h)
    };
    let mut retained = Vec::new();
    for lever in [
        BlockLever::Recompute,
        BlockLever::RecomputeStoringInputs {
            store: Arc::new(VecStore),
        },
    ] {
        blocks.set_every(lever);
        let (y, m) = measure(Device::Cpu, |_| blocks.forward(chain).unwrap().unwrap());
        retained.push(m.retained_bytes());
        y.sum(Kind::Float).backward();
    }
    assert_eq!(retained, [4 * act, act]);
}

/// A block that fails in a planned forward: its own error comes back (not "the blocks
/// changed"), the record of the last complete forward stays, and levers can still be
/// set for its blocks; the next forward runs.
#[test]
#[serial]
fn a_failing_block_keeps_its_own_error_and_the_last_complete_record() {
    let blocks = Blocks::new();
    let x = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    let forward = |fail: bool| {
        let x = x.shallow_clone();
        move |b: &Blocks| -> Result<(), CheckpointError> {
            for name in ["a", "b", "c"] {
                b.try_run(name, &[&x], move |xs| {
                    if fail && name == "b" {
                        return Err("out of memory (a test's)");
                    }
                    Ok(vec![&xs[0] * 2])
                })?;
            }
            Ok(())
        }
    };
    blocks.forward(forward(false)).unwrap().unwrap();
    blocks
        .set(BlockKey::new("c", 0), BlockLever::Recompute)
        .unwrap();
    let err = blocks.forward(forward(true)).unwrap().unwrap_err();
    assert!(
        err.to_string().contains("out of memory (a test's)") && err.to_string().contains("b#0"),
        "{err}"
    );
    assert_eq!(blocks.keys().len(), 3, "the last complete forward's record");
    blocks.set(BlockKey::new("c", 0), BlockLever::Keep).unwrap();
    blocks.forward(forward(false)).unwrap().unwrap();
    // Levers set before any forward: a failing block's error stands too.
    let fresh = Blocks::new();
    fresh
        .set(BlockKey::new("c", 0), BlockLever::Recompute)
        .unwrap();
    let err = fresh.forward(forward(true)).unwrap().unwrap_err();
    assert!(
        err.to_string().contains("out of memory (a test's)"),
        "{err}"
    );
    // After the first complete forward, the order of top-level blocks is checked.
    fresh.forward(forward(false)).unwrap().unwrap();
    let swapped = {
        let x = x.shallow_clone();
        move |b: &Blocks| -> Result<(), CheckpointError> {
            for name in ["b", "a", "c"] {
                b.run(name, &[&x], |xs| vec![&xs[0] * 2])?;
            }
            Ok(())
        }
    };
    let err = fresh.forward(swapped).unwrap().unwrap_err();
    assert!(matches!(err, CheckpointError::BlocksChanged(_)), "{err}");
}

/// `err` names the block `key` and says `what` it did.
fn assert_refused(err: &CheckpointError, key: &str, what: &str, case: &str) {
    let text = err.to_string();
    assert!(
        text.contains(&format!("block {key}")) && text.contains(what),
        "{case}: {text}"
    );
}

/// What a block must not do gets an error naming the block, before any gradient: two
/// functions under one name in a forward, no tensor returned, an output cut from the
/// graph, an input changed in place; and a block nested in one forward and not in the
/// next, once levers are set for the blocks.
#[test]
#[serial]
fn a_block_that_misbehaves_gets_an_error_naming_it() {
    let x = Tensor::ones([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    for lever in [BlockLever::Keep, BlockLever::Recompute] {
        let case = format!("{lever:?}");
        let blocks = Blocks::new();
        blocks.set_every(lever.clone());
        // Two closures named "a" in one forward.
        let err = blocks
            .forward(|b| -> Result<(), CheckpointError> {
                b.run("a", &[&x], |xs| vec![&xs[0] * 2])?;
                b.run("a", &[&x], |xs| vec![&xs[0] + 1])?;
                Ok(())
            })
            .unwrap()
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("block name \"a\" runs a second function"),
            "{case}: {err}"
        );
        // What the error advises: clones of one closure are one function.
        assert!(err.to_string().contains("`f.clone()`"), "{case}: {err}");
        let scale = Arc::new(2.0);
        let f = move |xs: &[Tensor]| vec![&xs[0] * *scale];
        blocks
            .forward(|b| -> Result<(), CheckpointError> {
                b.run("a", &[&x], f.clone())?;
                b.run("a", &[&x], f.clone())?;
                Ok(())
            })
            .unwrap()
            .unwrap();
        // One closure run twice under one name is a block with shared weights.
        blocks
            .forward(|b| -> Result<(), CheckpointError> {
                for _ in 0..2 {
                    b.run("a", &[&x], |xs| vec![&xs[0] * 2])?;
                }
                Ok(())
            })
            .unwrap()
            .unwrap();
        // No tensor returned.
        let err = blocks
            .forward(|b| b.run("empty", &[&x], |_| Vec::new()))
            .unwrap()
            .unwrap_err();
        assert_refused(&err, "empty#0", "it returned no tensor", &case);
        // An input changed in place (not the caller's leaf: a tensor computed from it).
        let h = &x * 1;
        let err = blocks
            .forward(|b| {
                b.run("inplace", &[&h], |xs| {
                    let mut y = xs[0].shallow_clone();
                    let _ = y.g_mul_scalar_(2.0);
                    vec![y]
                })
            })
            .unwrap()
            .unwrap_err();
        assert_refused(&err, "inplace#0", "it modified its input 0 in place", &case);
        // Outputs that never require grad are a function's outputs like any other: a
        // table made from the input's shape, and one detached beside one in the graph
        // give the plain gradients, kept or recomputed.
        let y = blocks
            .forward(|b| {
                b.run("table", &[&x], |xs| {
                    let n = xs[0].size()[1];
                    vec![Tensor::arange(n, (Kind::Float, Device::Cpu)).sin()]
                })
            })
            .unwrap()
            .unwrap();
        assert!(!y[0].requires_grad(), "{case}");
        let y = blocks
            .forward(|b| b.run("logs", &[&x], |xs| vec![xs[0].sin(), xs[0].cos().detach()]))
            .unwrap()
            .unwrap();
        (&y[0] * &y[1]).sum(Kind::Float).backward();
        let expected = x.cos() * x.cos();
        assert!(x.grad().equal(&expected), "{case}");
        memsave_sys::tensor::set_grad_none(&x).unwrap();
        // A block that detaches its output only when run again: the recomputation
        // refills the forward graph's saved tensors, so the gradient is the forward's.
        let again = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = again.clone();
        let y = blocks
            .forward(|b| {
                b.run("moody", &[&x], move |xs| {
                    let y = xs[0].sin();
                    if flag.load(std::sync::atomic::Ordering::SeqCst) {
                        vec![y.detach()]
                    } else {
                        vec![y]
                    }
                })
            })
            .unwrap()
            .unwrap();
        again.store(true, std::sync::atomic::Ordering::SeqCst);
        y[0].sum(Kind::Float).backward();
        assert!(x.grad().equal(&x.cos()), "{case}");
        memsave_sys::tensor::set_grad_none(&x).unwrap();
    }
    // Nested in one forward, at the top level in the next: the plan names it.
    let blocks = Blocks::new();
    let nested = |b: &Blocks| -> Result<(), CheckpointError> {
        let inner = b.clone();
        let xx = x.shallow_clone();
        b.run("outer", &[&x], move |xs| {
            let _ = inner.run("inner", &[&xx], |ys| vec![&ys[0] * 3]);
            vec![&xs[0] * 2]
        })?;
        Ok(())
    };
    blocks.forward(nested).unwrap().unwrap();
    blocks
        .set(BlockKey::new("outer", 0), BlockLever::Recompute)
        .unwrap();
    let flat = |b: &Blocks| -> Result<(), CheckpointError> {
        b.run("outer", &[&x], |xs| vec![&xs[0] * 2])?;
        b.run("inner", &[&x], |ys| vec![&ys[0] * 3])?;
        Ok(())
    };
    let err = blocks.forward(flat).unwrap().unwrap_err();
    assert!(matches!(err, CheckpointError::BlocksChanged(_)), "{err}");
    assert!(err.to_string().contains("inner#0"), "{err}");
}

/// The observer is told of each run of each block, in the forward and in backward's
/// recomputations (a block nested in a recomputed one runs again inside it).
#[test]
#[serial]
fn the_observer_sees_every_run_and_every_recomputation() {
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let blocks = Blocks::new();
    let log = seen.clone();
    blocks.set_observer(Some(Arc::new(move |n: &BlockNotice| {
        let line = match n {
            BlockNotice::Start { key, recompute } => format!("start {key} {recompute}"),
            BlockNotice::End { key } => format!("end {key}"),
        };
        log.lock().unwrap().push(line);
    })));
    let x = Tensor::ones([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let forward = |b: &Blocks| -> Result<Tensor, CheckpointError> {
        let h = b.run("a", &[&x], |xs| vec![xs[0].tanh()])?;
        let inner = b.clone();
        let y = b.run("b", &[&h[0]], move |xs| {
            let c = inner
                .run("c", &[&xs[0]], |ys| vec![ys[0].sin()])
                .expect("c runs");
            vec![c[0].exp()]
        })?;
        Ok(y[0].shallow_clone())
    };
    let _ = blocks.forward(forward).unwrap().unwrap();
    blocks
        .set(BlockKey::new("b", 0), BlockLever::Recompute)
        .unwrap();
    seen.lock().unwrap().clear();
    let y = blocks.forward(forward).unwrap().unwrap();
    y.sum(Kind::Float).backward();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "start a#0 false",
            "end a#0",
            "start b#0 false",
            "start c#0 false",
            "end c#0",
            "end b#0",
            "start b#0 true",
            "start c#0 true",
            "end c#0",
            "end b#0",
        ]
    );
    blocks.set_observer(None);
}

/// Under `no_grad` nothing reads a block's inputs again (no graph, no recomputation),
/// so a block may change them in place there, as under inference mode: an activation
/// run in place on its input, a key-value cache whose new row is written into the
/// buffer its input is a view of. Under grad mode the same block is refused.
#[test]
#[serial]
fn a_block_under_no_grad_may_change_its_inputs_in_place() {
    let x = Tensor::ones([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    for lever in [BlockLever::Keep, BlockLever::Recompute] {
        let blocks = Blocks::new();
        blocks.set_every(lever.clone());
        let h = (&x * -1).detach();
        let y = tch::no_grad(|| {
            blocks.forward(|b| {
                b.run("relu", &[&h], |xs| {
                    let mut y = xs[0].shallow_clone();
                    let _ = y.relu_();
                    vec![y]
                })
            })
        });
        let y = y.unwrap().unwrap_or_else(|e| panic!("{lever:?}: {e}"));
        assert_eq!(y[0].sum(Kind::Float).double_value(&[]), 0.0, "{lever:?}");
        // The cache's rows 0..2 are the input; the block writes row 2.
        let cache = Tensor::zeros([3, 3], (Kind::Float, Device::Cpu));
        let past = cache.narrow(0, 0, 2);
        let buffer = cache.shallow_clone();
        let y = tch::no_grad(|| {
            blocks.forward(|b| {
                b.run("attend", &[&past], move |xs| {
                    let _ = buffer.narrow(0, 2, 1).fill_(1.0);
                    vec![&xs[0] + 1]
                })
            })
        });
        y.unwrap().unwrap_or_else(|e| panic!("{lever:?}: {e}"));
        assert_eq!(cache.sum(Kind::Float).double_value(&[]), 3.0, "{lever:?}");
        // With grad mode, the same block is refused.
        let h = &x * 1;
        let err = blocks
            .forward(|b| {
                b.run("relu", &[&h], |xs| {
                    let mut y = xs[0].shallow_clone();
                    let _ = y.relu_();
                    vec![y]
                })
            })
            .unwrap()
            .unwrap_err();
        assert!(
            err.to_string().contains("it modified its input 0 in place"),
            "{lever:?}: {err}"
        );
    }
}
