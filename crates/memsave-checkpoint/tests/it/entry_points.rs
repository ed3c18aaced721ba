//! Every autograd entry point through every plan gives the un-checkpointed gradients,
//! bitwise: checkpoint recomputes into the original graph (saved-tensor hooks), so
//! `run_backward` to chosen tensors, `create_graph` and `keep_graph` see the same graph
//! as without checkpointing.
use crate::common::*;
use memsave_checkpoint::{CheckpointedSequential, Plan};
use memsave_sys::tensor::backward_with_grads;
use proptest::prelude::*;
use serial_test::serial;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, Copy)]
enum Entry {
    /// `loss.backward()`.
    Backward,
    /// `Tensor::run_backward(&[loss], params)` (PyTorch's `torch.autograd.grad`).
    GradToParams,
    /// `Tensor::run_backward(&[loss], &[x])`.
    GradToInput,
    /// A gradient penalty: `g = grad(loss, x, create_graph)`, then `sum(g^2).backward()`.
    DoubleBackward,
    /// `backward(keep_graph = true)` twice: gradients accumulate twice.
    RetainGraph,
    /// `run_backward` to the last layer's parameters only: the rest is never reached.
    PartialGraph,
}

const ENTRIES: [Entry; 6] = [
    Entry::Backward,
    Entry::GradToParams,
    Entry::GradToInput,
    Entry::DoubleBackward,
    Entry::RetainGraph,
    Entry::PartialGraph,
];

/// A chain of `tanh(linear(x)) + x` blocks: tanh saves its output and linear its input,
/// and the double backward needs both (relu's second derivative would be zero).
fn tanh_net(vs: &nn::VarStore, layers: usize, h: i64) -> CheckpointedSequential {
    let mut seq = CheckpointedSequential::new();
    for i in 0..layers {
        let lin = nn::linear(vs.root() / i, h, h, Default::default());
        seq = seq.add_fn(move |x| lin.forward(x).tanh() + x);
    }
    seq
}

/// Runs `entry` on a fresh forward and returns every gradient it produced, copied.
fn gradients(
    seq: &CheckpointedSequential,
    vs: &nn::VarStore,
    x0: &Tensor,
    entry: Entry,
) -> Vec<Tensor> {
    clear_grads(vs);
    let x = x0.detach().set_requires_grad(true);
    let params = vs.trainable_variables();
    let loss = seq.f_forward(&x).unwrap().square().mean(Kind::Float);
    let grads_of = |ts: &[Tensor]| ts.iter().map(|p| p.grad().copy()).collect::<Vec<_>>();
    match entry {
        Entry::Backward => {
            loss.f_backward().unwrap();
            let mut out = grads_of(&params);
            out.push(x.grad().copy());
            out
        }
        Entry::GradToParams => {
            let g = Tensor::f_run_backward(&[&loss], &params, false, false).unwrap();
            assert!(
                params.iter().all(|p| !p.grad().defined()),
                "grad() must not accumulate"
            );
            g
        }
        Entry::GradToInput => Tensor::f_run_backward(&[&loss], &[&x], false, false).unwrap(),
        Entry::DoubleBackward => {
            let g = Tensor::f_run_backward(&[&loss], &[&x], true, true).unwrap();
            let penalty = g[0].square().sum(Kind::Float);
            penalty.f_backward().unwrap();
            grads_of(&params)
        }
        Entry::RetainGraph => {
            let one = Tensor::ones([], (Kind::Float, Device::Cpu));
            backward_with_grads(&[loss.shallow_clone()], &[one.shallow_clone()], true).unwrap();
            backward_with_grads(&[loss.shallow_clone()], &[one], false).unwrap();
            grads_of(&params)
        }
        Entry::PartialGraph => {
            let last = &params[params.len() - 2..];
            Tensor::f_run_backward(&[&loss], last, false, false).unwrap()
        }
    }
}

fn plan_strategy(depth: usize) -> impl Strategy<Value = Plan> {
    prop_oneof![
        Just(Plan::EveryLayer),
        (1..=depth).prop_map(Plan::Segments),
        Just(Plan::Nested),
        // Stands for "some budget": resolved against the profile in the test.
        (0u64..=4).prop_map(Plan::Budget),
    ]
}

fn assert_bitwise(baseline: &[Tensor], planned: &[Tensor], what: &str) {
    assert_eq!(baseline.len(), planned.len(), "{what}: number of gradients");
    for (i, (a, b)) in baseline.iter().zip(planned).enumerate() {
        assert!(a.defined() && b.defined(), "{what}: gradient {i} undefined");
        assert!(
            a.equal(b),
            "{what}: gradient {i} differs: {:?} vs {:?}",
            a.view(-1).get(0),
            b.view(-1).get(0)
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    #[serial]
    fn every_entry_point_through_every_plan_gives_the_baseline_gradients(
        (depth, plan) in (2usize..=7).prop_flat_map(|d| (Just(d), plan_strategy(d))),
        width in 2i64..=6,
        batch in 1i64..=3,
        seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut seq = tanh_net(&vs, depth, width);
        let x = rand(&[batch, width]);
        let plan = match plan {
            Plan::Budget(k) => {
                // A budget between the least-memory plan's predicted peak and the
                // baseline's, so the solver mixes kept and recomputed layers.
                let params = vs.trainable_variables();
                seq.profile(&x, &params, |y| y.square().mean(Kind::Float)).unwrap();
                seq.set_plan(Plan::None).unwrap();
                let high = seq.predict().unwrap().peak_bytes;
                seq.set_plan(Plan::EveryLayer).unwrap();
                let low = seq.predict().unwrap().peak_bytes;
                Plan::Budget(low.max(1) + (high.saturating_sub(low)) * k / 4)
            }
            other => other,
        };
        for entry in ENTRIES {
            seq.set_plan(Plan::None).unwrap();
            let baseline = gradients(&seq, &vs, &x, entry);
            if seq.set_plan(plan).is_err() {
                // A budget below what any schedule needs: nothing to compare.
                continue;
            }
            let planned = gradients(&seq, &vs, &x, entry);
            assert_bitwise(&baseline, &planned, &format!("{plan} with {entry:?}"));
        }
    }
}

#[test]
#[serial]
fn nested_checkpoints_give_the_baseline_gradients_under_every_entry_point() {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::Cpu);
    let lin_a = nn::linear(vs.root() / "a", 5, 5, Default::default());
    let lin_b = nn::linear(vs.root() / "b", 5, 5, Default::default());
    let x0 = rand(&[3, 5]);
    let run = |nested: bool, entry: Entry| {
        let (a, b) = (lin_a.ws.shallow_clone(), lin_b.ws.shallow_clone());
        let (ab, bb) = (
            lin_a.bs.as_ref().unwrap().shallow_clone(),
            lin_b.bs.as_ref().unwrap().shallow_clone(),
        );
        let mut seq = CheckpointedSequential::new().add_fn(move |x| {
            let inner = |x: &Tensor, w: &Tensor, b: &Tensor| x.linear(w, Some(b)).tanh();
            if nested {
                let (w2, b2) = (b.shallow_clone(), bb.shallow_clone());
                let h = inner(x, &a, &ab);
                memsave_checkpoint::checkpoint1(&h, move |h| inner(h, &w2, &b2)).unwrap() + x
            } else {
                inner(&inner(x, &a, &ab), &b, &bb) + x
            }
        });
        seq.set_plan(if nested { Plan::EveryLayer } else { Plan::None })
            .unwrap();
        gradients(&seq, &vs, &x0, entry)
    };
    for entry in ENTRIES {
        let baseline = run(false, entry);
        let planned = run(true, entry);
        assert_bitwise(&baseline, &planned, &format!("nested with {entry:?}"));
    }
}
