//! The observed rule behind `is_exclusive`, one row of its doc table per test: who
//! holds a tensor, and what libtorch 2.13's two reference counts say about it.
use memsave_inplace::{can_mutate_in_place, is_exclusive, sharing, Sharing};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

fn counts(t: &Tensor) -> (u64, u64, bool) {
    let s = sharing(t).unwrap();
    (s.use_count, s.storage_use_count, s.is_view)
}

/// A non-leaf tensor that requires grad and that nothing holds but the returned handle.
fn activation() -> (Tensor, Tensor) {
    let w = Tensor::rand([3, 4], F32).set_requires_grad(true);
    let x = &w * 2.0;
    (w, x)
}

#[test]
#[serial]
fn a_fresh_tensor_is_exclusive() {
    let x = Tensor::rand([3, 4], F32);
    assert_eq!(counts(&x), (1, 1, false));
    assert!(is_exclusive(&x).unwrap());
    assert!(can_mutate_in_place(&x).unwrap());
    let (_w, a) = activation();
    assert!(is_exclusive(&a).unwrap());
}

#[test]
#[serial]
fn a_shallow_clone_raises_the_use_count_until_dropped() {
    let x = Tensor::rand([3, 4], F32);
    let other = x.shallow_clone();
    assert_eq!(counts(&x), (2, 1, false));
    assert!(!is_exclusive(&x).unwrap());
    drop(other);
    assert!(is_exclusive(&x).unwrap());
}

#[test]
#[serial]
fn autograd_saving_an_input_raises_the_use_count() {
    let (_w, h) = activation();
    let weight = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let out = h.matmul(&weight);
    assert_eq!(counts(&h), (2, 1, false));
    assert!(!is_exclusive(&h).unwrap());
    drop(out);
    assert!(is_exclusive(&h).unwrap(), "the graph that saved h is gone");
}

#[test]
#[serial]
fn an_input_that_needs_no_gradient_is_saved_when_the_other_operand_needs_one() {
    let x = Tensor::rand([3, 4], F32);
    let weight = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let _out = x.matmul(&weight);
    assert_eq!(
        counts(&x),
        (2, 1, false),
        "matmul saved x for weight's gradient"
    );
}

#[test]
#[serial]
fn gelu_clamp_and_mul_save_their_input_add_and_dropout_do_not() {
    let (_w, h) = activation();
    let g = h.gelu("none");
    assert_eq!(counts(&h).0, 2, "gelu saved its input");
    drop(g);
    let c = h.clamp(-0.5, 0.5);
    assert_eq!(counts(&h).0, 2, "clamp saved its input");
    drop(c);
    let m = &h * &h;
    assert_eq!(counts(&h).0, 3, "mul saved both operands");
    drop(m);
    let _a = &h + 1.0;
    let _d = h.dropout(0.5, true);
    let _s = &h * 3.0;
    assert_eq!(
        counts(&h),
        (1, 1, false),
        "add, dropout and mul by a scalar save no input"
    );
}

#[test]
#[serial]
fn autograd_saving_an_output_raises_the_storage_use_count() {
    let (_w, h) = activation();
    let r = h.relu();
    assert_eq!(counts(&r), (1, 2, false));
    assert!(!is_exclusive(&r).unwrap());
    let e = h.exp();
    assert_eq!(counts(&e), (1, 2, false));
    assert!(!is_exclusive(&e).unwrap());
    let s = h.sigmoid();
    assert!(!is_exclusive(&s).unwrap());
}

#[test]
#[serial]
fn nothing_is_saved_under_no_grad() {
    let (_w, h) = activation();
    let _guard = tch::no_grad_guard();
    let weight = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let out = h.matmul(&weight);
    let r = out.relu();
    assert_eq!(counts(&h), (1, 1, false));
    assert_eq!(counts(&r), (1, 1, false));
}

#[test]
#[serial]
fn a_view_raises_both_counts_of_its_base_even_under_no_grad() {
    let x = Tensor::rand([3, 4], F32);
    let v = x.narrow(0, 0, 1);
    assert_eq!(counts(&x), (2, 2, false));
    assert_eq!(counts(&v), (1, 2, true));
    assert!(!is_exclusive(&x).unwrap());
    assert!(!is_exclusive(&v).unwrap());
    drop(v);
    let t = tch::no_grad(|| x.tr());
    assert_eq!(counts(&x), (2, 2, false));
    drop(t);
    assert!(is_exclusive(&x).unwrap());
}

#[test]
#[serial]
fn a_detached_alias_raises_the_storage_use_count_only() {
    let (_w, h) = activation();
    let d = h.detach();
    assert_eq!(counts(&h), (1, 2, false));
    assert!(!is_exclusive(&d).unwrap());
}

#[test]
#[serial]
fn a_view_that_alone_holds_its_base_is_exclusive() {
    let x = Tensor::rand([3, 4], F32).view([4, 3]);
    assert_eq!(counts(&x), (1, 2, true));
    assert_eq!(sharing(&x).unwrap().base_use_count, Some(1));
    assert!(is_exclusive(&x).unwrap());
    // A second view of the same base makes both shared.
    let y = x.view([12]);
    assert!(!is_exclusive(&x).unwrap());
    assert!(!is_exclusive(&y).unwrap());
}

#[test]
#[serial]
fn linear_with_bias_on_3d_input_returns_a_view_and_without_bias_does_not() {
    let weight = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let bias = Tensor::rand([4], F32).set_requires_grad(true);
    let x = Tensor::rand([2, 3, 4], F32);
    let out = x.linear(&weight, Some(&bias));
    assert_eq!(counts(&out), (1, 2, true));
    assert!(
        is_exclusive(&out).unwrap(),
        "only the view holds addmm's output"
    );
    assert_eq!(counts(&x.linear(&weight, None::<&Tensor>)), (1, 1, false));
    let x2 = Tensor::rand([6, 4], F32);
    assert_eq!(counts(&x2.linear(&weight, Some(&bias))), (1, 1, false));
}

#[test]
#[serial]
fn a_leaf_that_requires_grad_is_exclusive_but_never_mutable() {
    let w = Tensor::rand([3, 4], F32).set_requires_grad(true);
    assert!(is_exclusive(&w).unwrap());
    assert!(!can_mutate_in_place(&w).unwrap());
    let _guard = tch::no_grad_guard();
    assert!(!can_mutate_in_place(&w).unwrap());
}

#[test]
#[serial]
fn an_expanded_tensor_is_never_mutable() {
    let x = Tensor::rand([1, 4], F32).expand([3, 4], false).contiguous();
    assert!(
        can_mutate_in_place(&x).unwrap(),
        "contiguous() made a real copy"
    );
    let e = Tensor::rand([1, 4], F32).expand([3, 4], false);
    assert!(!can_mutate_in_place(&e).unwrap());
    // Not a view, yet every row is the same memory: exclusive, but not writable in place.
    let overlapping = Tensor::empty_strided([3, 4], [0, 1], F32);
    assert!(is_exclusive(&overlapping).unwrap());
    assert!(!can_mutate_in_place(&overlapping).unwrap());
}

#[test]
#[serial]
fn sharing_displays_the_counts() {
    let x = Tensor::rand([3], F32);
    assert_eq!(
        sharing(&x).unwrap().to_string(),
        "exclusive (use count 1, storage use count 1)"
    );
    let v = x.narrow(0, 0, 1);
    assert_eq!(
        sharing(&v).unwrap().to_string(),
        "shared (use count 1, storage use count 2, a view)"
    );
    assert!(!Sharing {
        use_count: 1,
        storage_use_count: 0,
        is_view: false,
        base_use_count: None,
    }
    .is_exclusive());
}

#[test]
#[serial]
fn libtorch_records_how_each_view_was_made() {
    use memsave_sys::tensor::{view_creation, ViewCreation};
    let (_w, x) = activation();
    assert_eq!(view_creation(&x).unwrap(), None, "not a view");
    assert_eq!(
        view_creation(&x.narrow(0, 0, 1)).unwrap(),
        Some(ViewCreation::Default)
    );
    assert_eq!(
        view_creation(&x.chunk(3, 0)[0]).unwrap(),
        Some(ViewCreation::MultiOutputNode)
    );
    assert_eq!(
        view_creation(&tch::no_grad(|| x.narrow(0, 0, 1))).unwrap(),
        Some(ViewCreation::NoGradMode)
    );
    assert_eq!(
        view_creation(&x.detach()).unwrap(),
        None,
        "a detached alias is a view autograd does not track"
    );
}
