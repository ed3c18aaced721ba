//! The checkpoint function: correctness where PyTorch's reentrant variant fails, errors.
use memsave_checkpoint::{checkpoint, checkpoint1, Checkpoint};
use memsave_meter::memory_allocated;
use serial_test::serial;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

fn param(shape: &[i64]) -> Tensor {
    Tensor::rand(shape, (Kind::Float, CPU)).set_requires_grad(true)
}

#[test]
#[serial]
fn parameters_get_gradients_when_no_input_requires_grad() {
    let w = param(&[5, 3]);
    let x = Tensor::rand([4, 5], (Kind::Float, CPU));
    let expected = {
        let y = x.matmul(&w).tanh().sum(Kind::Float);
        y.backward();
        let g = w.grad().copy();
        let _ = w.grad().zero_();
        g
    };
    let w2 = w.shallow_clone();
    let y = checkpoint1(&x, move |x| x.matmul(&w2).tanh()).unwrap();
    assert!(y.requires_grad());
    y.sum(Kind::Float).backward();
    assert_eq!(w.grad(), expected);
}

#[test]
#[serial]
fn several_inputs_and_outputs_and_an_integer_output() {
    let a = param(&[3, 4]);
    let b = param(&[3, 4]);
    let (ga, gb) = {
        let s = (&a * &b).sum(Kind::Float) + (&a - &b).exp().sum(Kind::Float);
        s.backward();
        let g = (a.grad().copy(), b.grad().copy());
        let _ = a.grad().zero_();
        let _ = b.grad().zero_();
        g
    };
    let outs = checkpoint(&[&a, &b], |xs| {
        vec![
            &xs[0] * &xs[1],
            (&xs[0] - &xs[1]).exp(),
            xs[0].argmax(None, false),
        ]
    })
    .unwrap();
    assert_eq!(outs.len(), 3);
    assert!(outs[0].requires_grad() && outs[1].requires_grad());
    assert!(!outs[2].requires_grad());
    assert_eq!(outs[2].kind(), Kind::Int64);
    // Only some outputs used in the loss: the others get no gradient and that is fine.
    (outs[0].sum(Kind::Float) + outs[1].sum(Kind::Float)).backward();
    assert_eq!(a.grad(), ga);
    assert_eq!(b.grad(), gb);
}

#[test]
#[serial]
fn nested_checkpoints_give_the_plain_gradients() {
    let w = param(&[6, 6]);
    let x = param(&[2, 6]);
    let f = |x: &Tensor, w: &Tensor| x.matmul(w).sin().matmul(w).cos();
    let plain = {
        f(&x, &w).sum(Kind::Float).backward();
        let g = (x.grad().copy(), w.grad().copy());
        let _ = x.grad().zero_();
        let _ = w.grad().zero_();
        g
    };
    let w_outer = w.shallow_clone();
    let y = checkpoint1(&x, move |x| {
        let w_inner = w_outer.shallow_clone();
        let h = checkpoint1(x, move |x| x.matmul(&w_inner).sin()).unwrap();
        h.matmul(&w_outer).cos()
    })
    .unwrap();
    y.sum(Kind::Float).backward();
    assert_eq!((x.grad(), w.grad()), plain);
}

#[test]
#[serial]
fn dropout_masks_are_identical_in_the_recompute() {
    let x = param(&[64]);
    tch::manual_seed(7);
    let plain = x.dropout(0.5, true);
    plain.sum(Kind::Float).backward();
    let expected = x.grad().copy();
    let _ = x.grad().zero_();

    tch::manual_seed(7);
    let y = checkpoint1(&x, |x| x.dropout(0.5, true)).unwrap();
    assert_eq!(y, plain);
    y.sum(Kind::Float).backward();
    assert_eq!(x.grad(), expected);

    // Without preserving the RNG the recompute draws a new mask.
    let _ = x.grad().zero_();
    tch::manual_seed(7);
    let y = Checkpoint::new()
        .preserve_rng(false)
        .run(&[&x], |xs| vec![xs[0].dropout(0.5, true)])
        .unwrap();
    y[0].sum(Kind::Float).backward();
    assert_ne!(x.grad(), expected);
}

#[test]
#[serial]
fn a_panic_in_the_recompute_is_an_error_and_the_next_step_works() {
    let x = param(&[8]);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let start = memory_allocated(CPU);
    let y = checkpoint1(&x, move |x| {
        if counter.fetch_add(1, Ordering::SeqCst) == 1 {
            panic!("boom in recompute");
        }
        x.exp()
    })
    .unwrap();
    let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("boom in recompute"), "{err}");
    assert!(err.contains("recomputation"), "{err}");
    drop(y);
    let y = checkpoint1(&x, |x| x.exp()).unwrap();
    y.sum(Kind::Float).backward();
    assert_eq!(x.grad(), x.exp());
    drop(y);
    let _ = x.grad().zero_();
    assert_eq!(memory_allocated(CPU), start + 8 * 4); // only x's gradient remains
}

#[test]
#[serial]
fn an_error_in_the_forward_is_returned() {
    let x = param(&[3]);
    let err = Checkpoint::new()
        .try_run(&[&x], |_| Err::<Vec<Tensor>, _>("no can do"))
        .unwrap_err();
    assert!(err.to_string().contains("no can do"), "{err}");
}

#[test]
#[serial]
fn a_recompute_of_another_shape_is_refused() {
    let x = param(&[4]);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    // exp saves its output, so backward needs the recomputation (a closure of views
    // alone saves nothing and is never rerun).
    let y = checkpoint1(&x, move |x| {
        let n = counter.fetch_add(1, Ordering::SeqCst) as i64;
        x.narrow(0, 0, 4 - n).exp()
    })
    .unwrap();
    let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("shape"), "{err}");
    assert!(err.contains("[3]") && err.contains("[4]"), "{err}");
}

#[test]
#[serial]
fn an_input_modified_after_the_forward_is_refused() {
    let x = param(&[4]);
    let h = &x * 2.0;
    let y = checkpoint1(&h, |h| h.exp()).unwrap();
    let _ = h.shallow_clone().g_add_scalar_(1.0);
    let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("modified in place"), "{err}");
}

#[test]
#[serial]
fn a_second_backward_is_refused_with_a_clear_message() {
    let x = param(&[4]);
    let y = checkpoint1(&x, |x| x.exp()).unwrap();
    let s = y.sum(Kind::Float);
    s.backward();
    let err = s.f_backward().unwrap_err().to_string();
    assert!(err.contains("second time"), "{err}");
}

#[test]
#[serial]
fn without_grad_mode_the_function_just_runs() {
    let x = param(&[4]);
    let y = tch::no_grad(|| checkpoint1(&x, |x| x.exp()).unwrap());
    assert!(!y.requires_grad());
    assert_eq!(y, x.detach().exp());
}

#[test]
#[serial]
fn the_recompute_replays_autocast_and_clears_its_cast_cache() {
    use memsave_sys::autocast;
    let w = param(&[16, 16]);
    let x = Tensor::rand([4, 16], (Kind::Float, CPU));
    let start = memory_allocated(CPU);
    autocast::set_dtype(CPU, Kind::BFloat16).unwrap();
    autocast::set_enabled(CPU, true).unwrap();
    autocast::increment_nesting();
    let w2 = w.shallow_clone();
    let y = checkpoint1(&x, move |x| x.matmul(&w2)).unwrap();
    if autocast::decrement_nesting() == 0 {
        autocast::clear_cache().unwrap();
    }
    autocast::set_enabled(CPU, false).unwrap();
    assert_eq!(y.kind(), Kind::BFloat16);
    y.to_kind(Kind::Float).sum(Kind::Float).backward();
    drop(y);
    // The recompute ran under bf16 autocast too (the gradient flows through a bf16
    // matmul), and left no cached bf16 copy of `w` behind: only w's f32 gradient remains.
    assert_eq!(w.grad().kind(), Kind::Float);
    assert_eq!(memory_allocated(CPU), start + 16 * 16 * 4);
}
