//! Version checks: the guard names what was mutated, and by how many versions, at the
//! call site; the debug helper does the same for a closure's inputs.
use memsave_inplace::{
    check_unmutated, debug_assert_unmutated, f_relu, is_exclusive, InplaceError, Mutation,
    VersionGuard,
};
use serial_test::serial;
use tch::{nn, nn::Module, Device, Kind, Tensor};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

#[test]
#[serial]
fn an_untouched_guard_verifies() {
    let a = Tensor::rand([3], F32);
    let b = a.relu();
    let mut guard = VersionGuard::new();
    guard.track("a", &a).unwrap().track("b", &b).unwrap();
    assert_eq!(guard.len(), 2);
    assert!(guard.verify().is_ok());
    assert!(guard.mutations().unwrap().is_empty());
}

#[test]
#[serial]
fn the_guard_names_each_mutated_tensor_and_how_many_versions() {
    let mut a = Tensor::rand([3], F32);
    let b = Tensor::rand([3], F32);
    let mut c = Tensor::rand([4], F32);
    let mut guard = VersionGuard::new();
    guard.track("a", &a).unwrap();
    guard.track("b", &b).unwrap();
    guard.track("c", &c).unwrap();
    a += 1.0;
    a *= 2.0;
    let _ = c.narrow(0, 0, 2).fill_(0.0);
    let mutated = guard.mutations().unwrap();
    assert_eq!(
        mutated,
        vec![
            Mutation {
                label: "a".into(),
                recorded_version: 0,
                current_version: 2
            },
            Mutation {
                label: "c".into(),
                recorded_version: 0,
                current_version: 1
            },
        ]
    );
    assert_eq!(mutated[0].versions(), 2);
    let err = guard.verify().unwrap_err();
    assert!(matches!(&err, InplaceError::Mutated(m) if m.len() == 2));
    assert_eq!(
        err.to_string(),
        "2 tensor(s) mutated in place: `a` was mutated 2 time(s) since it was recorded \
         (version 0 -> 2); `c` was mutated 1 time(s) since it was recorded (version 0 -> 1)"
    );
    c += 1.0;
    guard.rebase().unwrap();
    assert!(guard.verify().is_ok());
}

#[test]
#[serial]
fn the_guard_catches_the_seed_mutation_before_backward_fails() {
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 4, 4, Default::default());
    let mut x = Tensor::rand([2, 4], F32).set_requires_grad(true) * 1.0;
    let fx = layer.forward(&x);
    let mut guard = VersionGuard::new();
    guard.track("x (saved by linear)", &x).unwrap();
    x += &fx;
    let err = guard.verify().unwrap_err();
    assert!(
        err.to_string()
            .contains("`x (saved by linear)` was mutated 1 time(s)"),
        "{err}"
    );
    let late = x.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(late.contains("modified by an inplace operation"), "{late}");
}

#[test]
#[serial]
fn a_tracked_tensor_is_shared_so_the_helpers_leave_it_alone() {
    let x = Tensor::rand([3], F32);
    let mut guard = VersionGuard::new();
    guard.track("x", &x).unwrap();
    assert!(!is_exclusive(&x).unwrap());
    let y = f_relu(x).unwrap();
    assert!(is_exclusive(&y).unwrap());
    assert!(guard.verify().is_ok());
    assert_eq!(format!("{guard:?}"), r#"{"x": 0}"#);
}

#[test]
#[serial]
fn check_unmutated_returns_the_value_or_names_the_inputs() {
    let a = Tensor::rand([3], F32);
    let b = Tensor::rand([3], F32);
    let sum = check_unmutated(&[&a, &b], || &a + &b).unwrap();
    assert!(sum.equal(&(&a + &b)));
    let err = check_unmutated(&[&a, &b], || {
        let mut alias = b.shallow_clone();
        alias += 1.0;
        alias += 1.0;
    })
    .unwrap_err();
    assert_eq!(
        err,
        InplaceError::Mutated(vec![Mutation {
            label: "input 1".into(),
            recorded_version: 0,
            current_version: 2
        }])
    );
}

#[test]
#[serial]
fn check_unmutated_holds_no_handle_so_the_helpers_still_mutate_inside() {
    let x = Tensor::rand([3], F32);
    let exclusive_inside = check_unmutated(&[&x], || is_exclusive(&x).unwrap()).unwrap();
    assert!(exclusive_inside);
}

#[test]
#[serial]
fn debug_assert_unmutated_passes_through_a_pure_closure() {
    let a = Tensor::rand([3], F32);
    let r = debug_assert_unmutated(&[&a], || a.relu());
    assert_eq!(r.size(), [3]);
}

#[test]
#[serial]
fn debug_assert_unmutated_panics_on_a_mutation_in_debug_builds_only() {
    let a = Tensor::from_slice(&[-1.0f32, 2.0, -3.0]);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        debug_assert_unmutated(&[&a], || {
            let _ = a.shallow_clone().relu_();
        })
    }));
    if cfg!(debug_assertions) {
        let payload = outcome.expect_err("a debug build panics on the mutation");
        let message = payload.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("`input 0` was mutated 1 time(s)"),
            "{message}"
        );
    } else {
        assert!(outcome.is_ok(), "a release build only runs the closure");
    }
    // Either way the closure ran, once.
    assert_eq!(memsave_sys::tensor::version(&a).unwrap(), 1);
    assert_eq!(Vec::<f32>::try_from(&a).unwrap(), [0.0, 2.0, 0.0]);
}
