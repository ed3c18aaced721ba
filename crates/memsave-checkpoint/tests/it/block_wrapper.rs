//! `Blocks::set_wrapper` and `Blocks::f_block_parameters`: what ZeRO-3 needs to make
//! each top-level block a unit. The wrapper is entered once around each top-level
//! block's run (its nested blocks run inside it), around each recomputation in
//! backward, and around a nested block's recomputation outside its parent's run, with
//! the top-level block's name; the parameters each top-level block uses are found
//! from its outputs alone.
use memsave_checkpoint::{BlockKey, BlockLever, BlockWrapper, Blocks, Shared};
use serial_test::serial;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// `a` (with `a.inner` nested in it), then `b` run twice (shared weights), then `c`
/// reading `a`'s output too; `tied` is used by `a` and `c`; `glue` between blocks.
struct Net {
    vs: nn::VarStore,
    a: Shared<nn::Linear>,
    inner: Shared<nn::Linear>,
    b: Shared<nn::Linear>,
    c: Shared<nn::Linear>,
    tied: Tensor,
    glue: Tensor,
}

impl Net {
    fn new() -> Net {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let p = vs.root();
        let lin = |name: &str| Shared::new(nn::linear(&p / name, 4, 4, Default::default()));
        Net {
            a: lin("a"),
            inner: lin("inner"),
            b: lin("b"),
            c: lin("c"),
            tied: p.var("tied", &[4], nn::Init::Const(0.5)),
            glue: p.var("glue", &[4], nn::Init::Const(1.0)),
            vs,
        }
    }

    fn loss(&self, blocks: &Blocks, x: &Tensor) -> Tensor {
        let (a, inner, tied) = (
            self.a.clone(),
            self.inner.clone(),
            self.tied.shallow_clone(),
        );
        let out = blocks
            .forward(|bl| {
                let h = bl.run("a", &[x], move |xs| {
                    let (inner, tied) = (inner.clone(), tied.shallow_clone());
                    let h = a.forward(&xs[0]).tanh();
                    // A nested block: its parameters are `a`'s unit's.
                    let blocks = CURRENT.lock().unwrap().clone().unwrap();
                    blocks
                        .run("a.inner", &[&h], move |ys| {
                            vec![inner.forward(&ys[0]).sin() * &tied]
                        })
                        .unwrap()
                })?[0]
                    .shallow_clone();
                let g = &h * &self.glue;
                let mut y = g.shallow_clone();
                for _ in 0..2 {
                    let b = self.b.clone();
                    y = bl.run("b", &[&y], move |xs| vec![b.forward(&xs[0]).relu()])?[0]
                        .shallow_clone();
                }
                let (c, tied) = (self.c.clone(), self.tied.shallow_clone());
                let z = bl.run("c", &[&y, &h], move |xs| {
                    vec![c.forward(&(&xs[0] + &xs[1])) + &tied]
                })?[0]
                    .shallow_clone();
                Ok::<_, memsave_checkpoint::CheckpointError>(z.square().mean(Kind::Float))
            })
            .unwrap();
        out.unwrap()
    }
}

/// The blocks a nested block's function runs in (a block function cannot borrow them).
static CURRENT: Mutex<Option<Blocks>> = Mutex::new(None);

fn named(net: &Net, lists: &[(String, Vec<Tensor>)]) -> Vec<(String, Vec<String>)> {
    let vars = net.vs.variables();
    lists
        .iter()
        .map(|(block, list)| {
            let mut names: Vec<String> = list
                .iter()
                .map(|t| {
                    vars.iter()
                        .find(|(_, v)| v.data_ptr() == t.data_ptr())
                        .map(|(n, _)| n.clone())
                        .unwrap()
                })
                .collect();
            names.sort();
            (block.clone(), names)
        })
        .collect()
}

#[test]
#[serial]
fn each_top_level_block_gets_the_parameters_it_uses_nested_blocks_included() {
    let net = Net::new();
    let blocks = Blocks::new();
    *CURRENT.lock().unwrap() = Some(blocks.clone());
    let x = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    blocks.set_every(BlockLever::Recompute);
    let _ = net.loss(&blocks, &x);
    let keys = blocks.keys();
    let mut params: Vec<(String, Tensor)> = net.vs.variables().into_iter().collect();
    params.sort_by(|p, q| p.0.cmp(&q.0));
    let params: Vec<Tensor> = params.into_iter().map(|(_, t)| t).collect();
    // An observer is told nothing of the search's forward.
    let told = Arc::new(Mutex::new(0usize));
    let count = Arc::clone(&told);
    blocks.set_observer(Some(Arc::new(
        move |_: &memsave_checkpoint::BlockNotice| {
            *count.lock().unwrap() += 1;
        },
    )));
    let lists = blocks
        .f_block_parameters(&params, || Ok::<_, String>(net.loss(&blocks, &x)))
        .unwrap();
    assert_eq!(*told.lock().unwrap(), 0);
    let _ = net.loss(&blocks, &x);
    assert!(*told.lock().unwrap() > 0, "the observer is back");
    blocks.set_observer(None);
    let s = |v: &[&str]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    assert_eq!(
        named(&net, &lists),
        vec![
            (
                "a".into(),
                s(&["a.bias", "a.weight", "inner.bias", "inner.weight", "tied"])
            ),
            ("b".into(), s(&["b.bias", "b.weight"])),
            ("c".into(), s(&["c.bias", "c.weight", "tied"])),
        ]
    );
    // The glue between blocks is in none; the levers are as they were.
    assert!(lists
        .iter()
        .all(|(_, l)| l.iter().all(|t| t.data_ptr() != net.glue.data_ptr())));
    assert_eq!(blocks.lever(&BlockKey::new("b", 1)).name(), "recompute");
    // The last forward's record is the one before (not the search's).
    assert_eq!(blocks.keys(), keys);
    assert!(blocks.last_forward().iter().all(|r| r.lever == "recompute"));
    assert!(params.iter().all(|p| !p.grad().defined()));
    *CURRENT.lock().unwrap() = None;
}

/// The wrapper's calls in one step: (block name, whether in backward).
fn wrapped_calls(levers: &[(&str, usize, BlockLever)]) -> (Vec<(String, bool)>, Vec<Tensor>) {
    let net = Net::new();
    let blocks = Blocks::new();
    *CURRENT.lock().unwrap() = Some(blocks.clone());
    let x = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    // A first forward to learn the keys, then the levers.
    let _ = net.loss(&blocks, &x);
    for (name, call, lever) in levers {
        blocks
            .set(BlockKey::new(*name, *call), lever.clone())
            .unwrap();
    }
    let calls = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&calls);
    let wrapper: BlockWrapper = Arc::new(move |name, xs, f| {
        let backward = memsave_sys::hooks::current_autograd_node_name()
            .unwrap()
            .is_some();
        log.lock().unwrap().push((name.to_string(), backward));
        f(xs)
    });
    blocks.set_wrapper(Some(wrapper));
    let loss = net.loss(&blocks, &x);
    loss.backward();
    blocks.set_wrapper(None);
    *CURRENT.lock().unwrap() = None;
    let grads = net
        .vs
        .trainable_variables()
        .iter()
        .map(|p| p.grad().copy())
        .collect();
    let calls = calls.lock().unwrap().clone();
    (calls, grads)
}

#[test]
#[serial]
fn the_wrapper_runs_around_each_top_level_block_and_each_recomputation_outside_one() {
    let forward =
        |v: &[&str]| -> Vec<(String, bool)> { v.iter().map(|n| (n.to_string(), false)).collect() };
    // Every block kept: once per top-level run, in the forward only.
    let (kept, plain) = wrapped_calls(&[]);
    assert_eq!(kept, forward(&["a", "b", "b", "c"]));
    // `b#1` and `a` recomputed: again in backward, `a`'s nested block inside it.
    let (recomputed, grads) = wrapped_calls(&[
        ("b", 1, BlockLever::Recompute),
        ("a", 0, BlockLever::Recompute),
    ]);
    let mut expected = forward(&["a", "b", "b", "c"]);
    expected.extend([("b".to_string(), true), ("a".to_string(), true)]);
    assert_eq!(recomputed, expected);
    // The nested block recomputed under a kept `a`: its recomputation in backward runs
    // outside `a`'s run, so the wrapper is entered for it, with `a`'s name.
    let (nested, nested_grads) = wrapped_calls(&[("a.inner", 0, BlockLever::Recompute)]);
    let mut expected = forward(&["a", "b", "b", "c"]);
    expected.push(("a".to_string(), true));
    assert_eq!(nested, expected);
    for (g, p) in grads
        .iter()
        .chain(&nested_grads)
        .zip(plain.iter().chain(&plain))
    {
        assert!(g.equal(p));
    }
}

/// A block function that panics inside the wrapper: the wrapper still returns (what it
/// entered, it leaves: a ZeRO-3 unit frees its weights), and the run is an error
/// naming the block; the next forward runs.
#[test]
#[serial]
fn a_panicking_block_leaves_the_wrapper_and_is_an_error_naming_it() {
    let blocks = Blocks::new();
    let depth = Arc::new(Mutex::new((0i32, 0i32)));
    let seen = Arc::clone(&depth);
    let wrapper: BlockWrapper = Arc::new(move |_, xs, f| {
        seen.lock().unwrap().0 += 1;
        let out = f(xs);
        seen.lock().unwrap().1 += 1;
        out
    });
    blocks.set_wrapper(Some(wrapper));
    let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let out = blocks
        .forward(|b| b.run("boom", &[&x], |_| panic!("broken block")))
        .unwrap();
    let e = out.unwrap_err().to_string();
    assert!(e.contains("boom#0") && e.contains("broken block"), "{e}");
    assert_eq!(*depth.lock().unwrap(), (1, 1));
    let y = blocks
        .forward(|b| b.run("fine", &[&x], |xs| vec![&xs[0] * 2.0]))
        .unwrap()
        .unwrap();
    assert_eq!(y.len(), 1);
    assert_eq!(*depth.lock().unwrap(), (2, 2));
}

/// A wrapper that runs the block's function but returns no tensor of its own: the run
/// is an error naming the block and the wrapper, not an empty output for the caller to
/// index.
#[test]
#[serial]
fn a_wrapper_that_drops_the_outputs_is_an_error_naming_the_block() {
    let blocks = Blocks::new();
    let wrapper: BlockWrapper = Arc::new(move |_, xs, f| {
        let _ = f(xs);
        Vec::new()
    });
    blocks.set_wrapper(Some(wrapper));
    let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let out = blocks
        .forward(|b| b.run("dropped", &[&x], |xs| vec![&xs[0] * 2.0]))
        .unwrap();
    let e = out.unwrap_err().to_string();
    assert!(
        e.contains("dropped#0") && e.contains("wrapper returned no tensor"),
        "{e}"
    );
}
