//! PyTorch's own tests of non-reentrant checkpointing, translated to Rust (Trust II).
//!
//! Each test names the PyTorch test it comes from (`test/test_autograd.py`, class
//! `TestNestedCheckpoint` or `TestAutograd`). Left out because tch cannot express them:
//! `test_nested_checkpoint_same_graph` and `..._reentrant_backwards` (node hooks),
//! `check_graph_dies` (weak references to graph nodes), the `TorchDispatchMode` kernel
//! counts, `GraphExecGroup` and saved-tensor introspection on nodes. memsave's
//! `checkpoint` does not stop the recomputation early by default (PyTorch does; the
//! stop unwinds the function): the default case expects that.
use memsave_checkpoint::{checkpoint, checkpoint1, Checkpoint};
use serial_test::serial;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

type F = Arc<dyn Fn(&Tensor) -> Tensor + Send + Sync>;

/// A reference function and the checkpointed variants that must agree with it.
type Case = (&'static str, F, Vec<(&'static str, F)>);

fn f(g: impl Fn(&Tensor) -> Tensor + Send + Sync + 'static) -> F {
    Arc::new(g)
}

/// PyTorch's `grad` helper: d fn(x) / dx with `create_graph`, for a scalar `fn(x)`.
fn grad(inner: F) -> F {
    f(move |x| {
        let out = inner(x);
        Tensor::run_backward(&[out], &[x], true, true).remove(0)
    })
}

/// PyTorch's `checkpoint` helper: `checkpoint(fn, x, use_reentrant=False)`.
fn c(inner: F) -> F {
    f(move |x| {
        let inner = inner.clone();
        checkpoint1(x, move |x| inner(x)).unwrap()
    })
}

/// PyTorch's `sum` helper.
fn s(inner: F) -> F {
    f(move |x| inner(x).sum(Kind::Float))
}

fn scalar(v: f64) -> Tensor {
    Tensor::from(v).to_kind(Kind::Float).set_requires_grad(true)
}

fn sin_exp_sin() -> F {
    f(|x| x.sin().exp().sin())
}

fn assert_close(expected: &Tensor, actual: &Tensor, what: &str) {
    assert!(
        expected.allclose(actual, 1e-5, 1e-8, false),
        "{what}: expected {expected:?}, got {actual:?}"
    );
}

/// PyTorch's `g` of `test_nested_checkpoint`: runs two `autograd.grad` calls on its own
/// computation before returning `sin(x)`, so a checkpoint of it runs backward inside its
/// forward and inside every recomputation.
fn grads_inside() -> F {
    f(|x| {
        let a = x.sin().exp().sin();
        let b = x.sin().exp().sin();
        let _ga = Tensor::run_backward(&[a], &[x], false, false);
        let _gb = Tensor::run_backward(&[b], &[x], false, false);
        x.sin()
    })
}

/// PyTorch's `get_tests`: each reference and the checkpointed variants that must agree.
fn get_tests(fun: F) -> Vec<Case> {
    let (g, c) = (grad, c);
    vec![
        (
            "fn",
            fun.clone(),
            vec![("c(fn)", c(fun.clone())), ("c(c(fn))", c(c(fun.clone())))],
        ),
        (
            "grad(fn)",
            g(fun.clone()),
            vec![
                ("grad(c(fn))", g(c(fun.clone()))),
                ("grad(c(c(fn)))", g(c(c(fun.clone())))),
            ],
        ),
        (
            "grad(grad(fn))",
            g(g(fun.clone())),
            vec![
                ("grad(c(grad(fn)))", g(c(g(fun.clone())))),
                ("c(grad(grad(c(fn))))", c(g(g(c(fun.clone()))))),
                ("grad(c(grad(c(fn))))", g(c(g(c(fun.clone()))))),
            ],
        ),
        (
            "grad(grad(grad(fn)))",
            g(g(g(fun.clone()))),
            vec![
                ("grad(c(grad(grad(c(fn)))))", g(c(g(g(c(fun.clone())))))),
                (
                    "grad(c(grad(c(grad(c(fn))))))",
                    g(c(g(c(g(c(fun.clone())))))),
                ),
            ],
        ),
    ]
}

/// From `TestNestedCheckpoint.test_nested_checkpoint` (with `get_tests`), every variant
/// for both of its functions, among them `autograd.grad` inside a checkpointed function
/// at the forward and in recomputations (Trust II, item 12: before, "backward reached
/// the checkpoint before its forward finished" and "backward through a recomputation's
/// own graph is not supported").
#[test]
#[serial]
fn nested_checkpoint() {
    for (fn_name, fun) in [("f", sin_exp_sin()), ("g", grads_inside())] {
        for x0 in [-1.3, 0.2, 0.9] {
            let x = scalar(x0);
            for (name, expected_fn, actuals) in get_tests(fun.clone()) {
                let expected = expected_fn(&x);
                for (actual_name, actual_fn) in actuals {
                    let what = format!("{fn_name}: {name} vs {actual_name} at {x0}");
                    assert_close(&expected, &actual_fn(&x), &what);
                }
            }
        }
    }
}

/// From `TestNestedCheckpoint.test_nested_checkpoint_two_children`: two sibling
/// checkpoints under a third, differentiated twice, once with a grad inside a checkpoint.
#[test]
#[serial]
fn nested_checkpoint_two_children() {
    let ff = sin_exp_sin();
    let gg = f(|x| x.cos().sin().exp());
    let h = {
        let (ff, gg) = (ff.clone(), gg.clone());
        f(move |x| gg(&ff(x)))
    };
    let hc = {
        let (cf, cg) = (c(ff), c(gg));
        f(move |x| cg(&cf(x)))
    };
    let a = Tensor::randn([3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let expected = grad(s(grad(s(h))))(&a);
    let actual = grad(s(grad(s(c(hc.clone())))))(&a);
    assert_close(&expected, &actual, "grad(sum(grad(sum(c(hc)))))");
    let actual = grad(s(c(grad(s(c(hc))))))(&a);
    assert_close(&expected, &actual, "grad(sum(c(grad(sum(c(hc))))))");
}

/// From `TestNestedCheckpoint.test_nested_checkpoint_non_tensor_inputs_and_outputs` and
/// `..._kwargs`: several tensor inputs beside captured non-tensor values.
#[test]
#[serial]
fn nested_checkpoint_non_tensor_inputs_and_several_inputs() {
    let k = 3.0;
    let (a, b) = (scalar(2.0), scalar(3.0));
    let plain = ((&a * k) * b.exp()).sin();
    let expected = Tensor::run_backward(&[plain], &[&a, &b], false, false);
    let out = checkpoint(
        &[&a, &b],
        move |xs| vec![((&xs[0] * k) * xs[1].exp()).sin()],
    )
    .unwrap();
    let actual = Tensor::run_backward(&[&out[0]], &[&a, &b], false, false);
    assert_close(&expected[0], &actual[0], "d/da");
    assert_close(&expected[1], &actual[1], "d/db");
}

/// From `TestNestedCheckpoint.test_nested_checkpoint_set_early_stop` (the default case),
/// where memsave differs on purpose: early stop is off by default (it unwinds the
/// function, see `Checkpoint::early_stop`), so the clone after the last saved tensor
/// runs again in the recomputation.
#[test]
#[serial]
fn nested_checkpoint_no_early_stop_by_default() {
    let clones = Arc::new(AtomicUsize::new(0));
    let counter = clones.clone();
    let a = scalar(1.0);
    let out = checkpoint1(&a, move |x| {
        let y = x.sin().cos();
        counter.fetch_add(1, Ordering::SeqCst);
        y.copy()
    })
    .unwrap();
    out.backward();
    assert_eq!(clones.load(Ordering::SeqCst), 2);
}

/// From `TestNestedCheckpoint.test_nested_checkpoint_set_early_stop` (the `early_stop`
/// argument): with early stop off, the clone after the last saved tensor runs again in
/// the recomputation; with it on, it does not.
#[test]
#[serial]
fn nested_checkpoint_set_early_stop() {
    for (early_stop, expected) in [(false, 2), (true, 1)] {
        let clones = Arc::new(AtomicUsize::new(0));
        let counter = clones.clone();
        let a = scalar(1.0);
        let out = Checkpoint::new()
            .early_stop(early_stop)
            .run(&[&a], move |xs| {
                let y = xs[0].sin().cos();
                counter.fetch_add(1, Ordering::SeqCst);
                vec![y.copy()]
            })
            .unwrap();
        out[0].backward();
        assert_eq!(
            clones.load(Ordering::SeqCst),
            expected,
            "early_stop {early_stop}"
        );
        let x = a.detach();
        assert_close(&(-x.sin().sin() * x.cos()), &a.grad(), "gradient");
    }
}

/// From `test_nested_checkpoint_set_early_stop_no_recompution_needed` (second case): a
/// function that saves nothing is never rerun.
#[test]
#[serial]
fn a_function_that_saves_nothing_is_never_recomputed() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let a = scalar(1.0);
    let out = checkpoint1(&a, move |x| {
        counter.fetch_add(1, Ordering::SeqCst);
        x.copy()
    })
    .unwrap();
    out.backward();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_close(&Tensor::from(1.0f32), &a.grad(), "gradient of a clone");
}

/// A function that computes something else on its second call (PyTorch's `nondet`).
fn first_then(first: F, later: F) -> impl Fn(&Tensor) -> Tensor + Send + 'static {
    let calls = AtomicUsize::new(0);
    move |x| {
        if calls.fetch_add(1, Ordering::SeqCst) == 0 {
            first(x)
        } else {
            later(x)
        }
    }
}

/// From `TestAutograd.test_checkpoint_detects_non_determinism`: a recomputation that saves
/// fewer tensors, or tensors of other shapes, is an error at backward; one that saves
/// more (early stop) gives the right gradient.
#[test]
#[serial]
fn checkpoint_detects_non_determinism() {
    let save_3 = sin_exp_sin();
    let save_2 = f(|x| x.sin().exp());
    let save_2_alt = f(|x| x.sin() * Tensor::from_slice(&[1.0f32, 2.0]));

    let a = Tensor::randn([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let out = checkpoint1(&a, first_then(save_3.clone(), save_2.clone())).unwrap();
    let err = out.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(
        err.contains("saved 3") || err.contains("forward saved 3"),
        "{err}"
    );

    let out = checkpoint1(&a, first_then(save_2.clone(), save_3)).unwrap();
    out.sum(Kind::Float).backward();
    assert_close(
        &(a.detach().sin().exp() * a.detach().cos()),
        &a.grad(),
        "save_2 then save_3",
    );

    let out = checkpoint1(&a, first_then(save_2, save_2_alt)).unwrap();
    let err = out.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("shape"), "{err}");
}

/// From `TestAutograd.test_checkpointing_without_reentrant_correct_grad`: backward and
/// `autograd.grad` through a checkpoint both give the plain gradient.
#[test]
#[serial]
fn checkpointing_without_reentrant_correct_grad() {
    let a = Tensor::randn([2, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let expected = a.detach().exp();
    checkpoint1(&a, |x| x.exp())
        .unwrap()
        .sum(Kind::Float)
        .backward();
    assert_close(&expected, &a.grad(), "backward");
    let out = checkpoint1(&a, |x| x.exp()).unwrap().sum(Kind::Float);
    let by_grad = Tensor::run_backward(&[out], &[&a], false, false).remove(0);
    assert_close(&expected, &by_grad, "autograd.grad");
}
