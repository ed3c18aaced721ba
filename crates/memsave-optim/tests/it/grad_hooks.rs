//! memsave-sys's post-accumulate-grad hooks, as step_in_backward uses them: when they
//! fire, what a panic does, and removal.
use memsave_sys::grad_hooks::register_post_accumulate_grad_hook;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

fn leaf() -> Tensor {
    Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

#[test]
#[serial_test::parallel]
fn the_hook_sees_the_accumulated_gradient_once_per_backward_until_removed() {
    let w = leaf();
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let handle = register_post_accumulate_grad_hook(
        &w,
        Box::new(move |t: &Tensor| {
            // Used twice in the graph, accumulated once: 2 + 3 per element.
            assert_eq!(t.grad().sum(Kind::Float).double_value(&[]), 15.0);
            seen.fetch_add(1, Ordering::SeqCst);
            Ok(memsave_sys::tensor::set_grad_none(t)?)
        }),
    )
    .unwrap();
    for _ in 0..2 {
        ((&w * 2.0).sum(Kind::Float) + (&w * 3.0).sum(Kind::Float)).backward();
        assert!(!w.grad().defined());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(handle.remove().unwrap());
    (&w * 2.0).sum(Kind::Float).backward();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(w.grad().defined());
}

#[test]
#[serial_test::parallel]
fn a_panic_in_the_hook_is_an_error_from_backward_not_an_unwind_into_cpp() {
    let w = leaf();
    let _handle =
        register_post_accumulate_grad_hook(&w, Box::new(|_: &Tensor| panic!("boom in the hook")))
            .unwrap();
    let e = w.sum(Kind::Float).f_backward().unwrap_err();
    assert!(e.to_string().contains("panicked: boom in the hook"), "{e}");
}

#[test]
#[serial_test::parallel]
fn only_leaves_that_require_grad_take_a_hook() {
    let w = leaf();
    let not_leaf = &w * 2.0;
    let e =
        register_post_accumulate_grad_hook(&not_leaf, Box::new(|_: &Tensor| Ok(()))).unwrap_err();
    assert!(
        e.to_string().contains("leaf tensors that require grad"),
        "{e}"
    );
}
