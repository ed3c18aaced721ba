//! PyTorch's own tests of saved-tensor hooks (`test/test_autograd.py`, class
//! `TestAutograd`), translated to Rust (Trust II). Each test names the one it comes from.
//! Left out: the per-variable hook API (`_raw_saved_self.register_hooks`), which tch does
//! not expose, `disable_saved_tensors_hooks`, and the Python-only dispatch-mode tests.
use memsave_hooks::{hooks_from_fn, saved_tensors_hooks, HooksGuard};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

fn leaf(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

/// Hooks that multiply by `pack_by` when packing and by `unpack_by` when unpacking.
fn scaling(pack_by: f64, unpack_by: f64) -> impl memsave_hooks::SavedTensorHooks {
    hooks_from_fn(
        move |t: &Tensor| Ok(t * pack_by),
        move |t: &Tensor| Ok(t * unpack_by),
    )
}

fn assert_close(expected: &Tensor, actual: &Tensor, what: &str) {
    assert!(
        expected.allclose(actual, 1e-5, 1e-6, false),
        "{what}: expected {expected:?}, got {actual:?}"
    );
}

/// From `test_saved_tensor_hooks_custom_error_propagation`: a failing pack fails the op at
/// the forward; a failing unpack fails the backward; the hook's own message comes back.
#[test]
#[serial_test::parallel]
fn saved_tensor_hooks_custom_error_propagation() {
    let a = Tensor::from(1.0f32).set_requires_grad(true);
    let failing_pack = hooks_from_fn(
        |_t: &Tensor| Err::<Tensor, _>("CustomError: pack".into()),
        |t: &Tensor| Ok(t.shallow_clone()),
    );
    let err = saved_tensors_hooks(failing_pack, || a.f_sin())
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(err.contains("CustomError: pack"), "{err}");

    let failing_unpack = hooks_from_fn(
        |t: &Tensor| Ok(t.shallow_clone()),
        |_t: &Tensor| Err::<Tensor, _>("CustomError: unpack".into()),
    );
    let out = saved_tensors_hooks(failing_unpack, || a.sin()).unwrap();
    let err = out.f_backward().unwrap_err().to_string();
    assert!(err.contains("CustomError: unpack"), "{err}");
}

/// From `test_wrapped_number_saved_tensors_hooks`: multiplying by a number saves no tensor
/// for the hooks, so hooks that fail when called are never called.
#[test]
#[serial_test::parallel]
fn wrapped_number_saved_tensors_hooks() {
    let a = leaf(&[5]);
    let refusing = hooks_from_fn(
        |_t: &Tensor| Err::<Tensor, _>("pack must not be called".into()),
        |_t: &Tensor| Err::<Tensor, _>("unpack must not be called".into()),
    );
    let out = saved_tensors_hooks(refusing, || (&a * 3.0).sum(Kind::Float)).unwrap();
    let g = Tensor::run_backward(&[out], &[&a], false, false).remove(0);
    assert_close(
        &Tensor::full([5], 3.0, (Kind::Float, Device::Cpu)),
        &g,
        "grad",
    );
}

/// From `test_unpack_hooks_exec_count`: `x * y` with only `x` requiring grad saves `y`
/// alone; unpack runs once, in backward.
#[test]
#[serial_test::parallel]
fn unpack_hooks_exec_count() {
    let x = Tensor::ones([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let (packs, unpacks) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (p, u) = (packs.clone(), unpacks.clone());
    let counting = hooks_from_fn(
        move |t: &Tensor| {
            p.fetch_add(1, Ordering::SeqCst);
            Ok(t.shallow_clone())
        },
        move |t: &Tensor| {
            u.fetch_add(1, Ordering::SeqCst);
            Ok(t.shallow_clone())
        },
    );
    let guard = HooksGuard::new(counting).unwrap();
    let out = &x * &y;
    assert_eq!(packs.load(Ordering::SeqCst), 1);
    assert_eq!(unpacks.load(Ordering::SeqCst), 0);
    out.sum(Kind::Float).backward();
    assert_eq!(packs.load(Ordering::SeqCst), 1);
    assert_eq!(unpacks.load(Ordering::SeqCst), 1);
    guard.exit().unwrap();
}

/// From `test_saved_variable_packing_unpacking_saved_original_with_default_hooks`:
/// `a * a` saves `a` twice; backward uses what unpack returns.
#[test]
#[serial_test::parallel]
fn saved_variable_packing_unpacking_with_default_hooks() {
    for (pack_by, unpack_by, factor) in [(1.0, 1.0, 2.0), (2.0, 0.5, 2.0), (2.0, 1.0, 4.0)] {
        let a = leaf(&[5]);
        let y = saved_tensors_hooks(scaling(pack_by, unpack_by), || &a * &a).unwrap();
        y.sum(Kind::Float).backward();
        let what = format!("pack x{pack_by}, unpack x{unpack_by}");
        assert_close(&(a.detach() * factor), &a.grad(), &what);
    }
    // Outside the hooks, plain behaviour again.
    let a = leaf(&[5]);
    (&a * &a).sum(Kind::Float).backward();
    assert_close(&(a.detach() * 2.0), &a.grad(), "no hooks");
}

/// From `test_setting_default_saved_variable_hooks_twice_should_use_inner`: only the
/// innermost hooks apply.
#[test]
#[serial_test::parallel]
fn setting_default_saved_variable_hooks_twice_should_use_inner() {
    let (a, b) = (leaf(&[5]), leaf(&[5]));
    let outer = HooksGuard::new(scaling(3.0, 3.0)).unwrap();
    let y = saved_tensors_hooks(scaling(5.0, 5.0), || &a * &a).unwrap();
    let z = &b * &b;
    outer.exit().unwrap();
    (y + z).sum(Kind::Float).backward();
    assert_close(&(a.detach() * 50.0), &a.grad(), "inner hooks");
    assert_close(&(b.detach() * 18.0), &b.grad(), "outer hooks");
}

/// From `test_default_saved_tensors_hooks_double_backward`: double backward through
/// tensors the hooks packed (identity hooks; hooks that double around the forward only).
#[test]
#[serial_test::parallel]
fn default_saved_tensors_hooks_double_backward() {
    for (pack_by, factor) in [(1.0, 6.0), (2.0, 12.0)] {
        let a = leaf(&[5]);
        let y = saved_tensors_hooks(scaling(pack_by, 1.0), || a.pow_tensor_scalar(3)).unwrap();
        let g = Tensor::run_backward(&[y.sum(Kind::Float)], &[&a], true, true).remove(0);
        g.sum(Kind::Float).backward();
        assert_close(
            &(a.detach() * factor),
            &a.grad(),
            &format!("pack x{pack_by}"),
        );
    }
}
