//! The failures reported against the custom-node checkpoint, each as a test: gradients
//! to captured parameters, a gradient penalty, a captured tensor also used outside,
//! a closure that mutates its input, and checkpointed dropout on several threads.
use memsave_checkpoint::{checkpoint1, Checkpoint};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

fn rand(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

#[test]
#[serial]
fn run_backward_reaches_a_parameter_captured_in_the_closure() {
    tch::manual_seed(1);
    let w = rand(&[4, 4]).set_requires_grad(true);
    let x = rand(&[3, 4]);
    let forward = |checkpointed: bool| {
        let w2 = w.shallow_clone();
        let y = if checkpointed {
            checkpoint1(&x, move |x| x.matmul(&w2).tanh()).unwrap()
        } else {
            x.matmul(&w2).tanh()
        };
        y.square().sum(Kind::Float)
    };
    let expected = Tensor::run_backward(&[&forward(false)], &[&w], false, false);
    let got = Tensor::f_run_backward(&[&forward(true)], &[&w], false, false).unwrap();
    assert!(got[0].defined(), "the gradient of w is undefined");
    assert!(got[0].equal(&expected[0]));
    assert!(
        !w.grad().defined(),
        "run_backward must not accumulate into w.grad()"
    );
}

#[test]
#[serial]
fn a_gradient_penalty_through_a_checkpoint_equals_the_baseline() {
    tch::manual_seed(2);
    let w = rand(&[4, 4]).set_requires_grad(true);
    let x0 = rand(&[3, 4]);
    let penalty_grad = |checkpointed: bool| {
        let x = x0.detach().set_requires_grad(true);
        let w2 = w.shallow_clone();
        let y = if checkpointed {
            checkpoint1(&x, move |x| x.matmul(&w2).tanh()).unwrap()
        } else {
            x.matmul(&w2).tanh()
        };
        let g = Tensor::f_run_backward(&[&y.sum(Kind::Float)], &[&x], true, true).unwrap();
        let _ = w.grad().f_zero_();
        g[0].square().sum(Kind::Float).f_backward().unwrap();
        let out = w.grad().copy();
        memsave_sys::tensor::set_grad_none(&w).unwrap();
        out
    };
    let expected = penalty_grad(false);
    let got = penalty_grad(true);
    assert!(expected.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    assert!(got.equal(&expected));
}

#[test]
#[serial]
fn a_captured_tensor_also_used_outside_the_checkpoint_gets_both_gradients() {
    tch::manual_seed(3);
    let base = rand(&[4]).set_requires_grad(true);
    let x = rand(&[2, 4]).set_requires_grad(true);
    let grads = |checkpointed: bool| {
        memsave_sys::tensor::set_grad_none(&base).unwrap();
        memsave_sys::tensor::set_grad_none(&x).unwrap();
        let cond = base.exp(); // has a graph of its own
        let c = cond.shallow_clone();
        let y = if checkpointed {
            checkpoint1(&x, move |x| x * &c).unwrap()
        } else {
            &x * &c
        };
        (y.sum(Kind::Float) + cond.sum(Kind::Float))
            .f_backward()
            .unwrap();
        (base.grad().copy(), x.grad().copy())
    };
    let (eb, ex) = grads(false);
    let (gb, gx) = grads(true);
    assert!(gb.equal(&eb) && gx.equal(&ex));
}

#[test]
#[serial]
fn a_closure_that_modifies_its_input_in_place_is_refused_naming_the_input() {
    let w = Tensor::ones([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let h = &w * 1.0;
    let err = Checkpoint::new()
        .run(&[&h], |xs| {
            let mut x = xs[0].shallow_clone();
            let _ = x.g_mul_scalar_(2.0);
            vec![&x * &x]
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("input 0") && err.contains("in place"), "{err}");
}

#[test]
#[serial]
fn checkpointed_dropout_on_several_threads_gives_the_baseline_gradients() {
    const THREADS: usize = 4;
    const STEPS: usize = 60;
    let wrong: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                scope.spawn(move || {
                    let mut wrong = 0;
                    for step in 0..STEPS {
                        let w =
                            Tensor::ones([64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                        let w2 = w.shallow_clone();
                        let x = Tensor::full(
                            [64],
                            (t * STEPS + step) as f64 + 1.0,
                            (Kind::Float, Device::Cpu),
                        );
                        let y = checkpoint1(&x, move |x| (x * &w2).dropout(0.5, true).square())
                            .unwrap();
                        // The mask the forward drew is visible in y: y = 4 (x w)^2 where kept.
                        let kept = y.ne(0.0).to_kind(Kind::Float);
                        y.sum(Kind::Float).backward();
                        // d/dw of 4 (x w)^2 = 8 x^2 w, only where kept.
                        let expected = &kept * 8.0 * x.square();
                        if !w.grad().allclose(&expected, 1e-6, 1e-6, false) {
                            wrong += 1;
                        }
                    }
                    wrong
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(
        wrong,
        0,
        "{wrong} of {} steps gave wrong gradients",
        THREADS * STEPS
    );
}
