//! The copy-on-write helpers: in place exactly when the tensor is exclusive and the
//! result fits, out of place otherwise, the same values either way, and the counters.
use memsave_inplace::{
    add, can_mutate_in_place, f_add, f_clamp, f_dropout, f_gelu, f_inplace_or, f_mul, f_relu,
    f_residual_add, inplace_or, is_exclusive, relu, reset_stats, sharing, stats, InplaceError,
    InplaceStats,
};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

/// Runs `op` on `x` and reports whether it reused `x`'s memory, with the result.
fn run(x: Tensor, op: impl FnOnce(Tensor) -> memsave_inplace::Result<Tensor>) -> (bool, Tensor) {
    let before = x.data_ptr();
    let y = op(x).unwrap();
    (y.data_ptr() == before, y)
}

fn exclusive_f32() -> Tensor {
    Tensor::randn([3, 4], F32)
}

#[test]
#[serial]
fn every_helper_mutates_an_exclusive_tensor_and_matches_out_of_place() {
    let other = Tensor::randn([3, 4], F32);
    type Op<'a> = (
        &'a str,
        Box<dyn Fn(Tensor) -> memsave_inplace::Result<Tensor> + 'a>,
        Box<dyn Fn(&Tensor) -> Tensor + 'a>,
    );
    let ops: Vec<Op> = vec![
        (
            "add",
            Box::new(|x| f_add(x, &other)),
            Box::new(|x| x + &other),
        ),
        (
            "residual_add",
            Box::new(|x| f_residual_add(x, &other)),
            Box::new(|x| x + &other),
        ),
        (
            "mul",
            Box::new(|x| f_mul(x, &other)),
            Box::new(|x| x * &other),
        ),
        ("relu", Box::new(f_relu), Box::new(|x| x.relu())),
        (
            "gelu",
            Box::new(|x| f_gelu(x, "none")),
            Box::new(|x| x.gelu("none")),
        ),
        (
            "gelu tanh",
            Box::new(|x| f_gelu(x, "tanh")),
            Box::new(|x| x.gelu("tanh")),
        ),
        (
            "clamp",
            Box::new(|x| f_clamp(x, -0.5, 0.25)),
            Box::new(|x| x.clamp(-0.5, 0.25)),
        ),
    ];
    for (name, helper, reference) in ops {
        let x = exclusive_f32();
        let expected = reference(&x);
        reset_stats();
        let (in_place, y) = run(x, helper);
        assert!(in_place, "{name} should reuse x's memory");
        assert!(y.equal(&expected), "{name}");
        assert_eq!(
            stats(),
            InplaceStats {
                in_place: 1,
                copied: 0,
                bytes_saved: 3 * 4 * 4
            },
            "{name}"
        );
    }
}

#[test]
#[serial]
fn a_shared_tensor_is_copied_and_left_unchanged() {
    let other = Tensor::randn([3, 4], F32);
    let x = exclusive_f32();
    let keep = x.copy();
    let handle = x.shallow_clone();
    reset_stats();
    let (in_place, y) = run(x, |x| f_add(x, &other));
    assert!(!in_place);
    assert!(handle.equal(&keep), "the other handle sees no change");
    assert!(y.equal(&(&keep + &other)));
    assert_eq!(
        stats(),
        InplaceStats {
            in_place: 0,
            copied: 1,
            bytes_saved: 0
        }
    );

    let x = exclusive_f32();
    let view = x.narrow(0, 0, 1);
    let view_before = view.copy();
    let (in_place, _) = run(x, f_relu);
    assert!(!in_place);
    assert!(view.equal(&view_before), "the view sees no change");
}

#[test]
#[serial]
fn a_view_is_copied_while_its_base_is_held_and_mutated_once_it_alone_holds_it() {
    // The base is held by a named handle, then by a temporary that outlives the call
    // (temporaries live to the end of the statement): both times the view is copied.
    let base = exclusive_f32();
    let (in_place, y) = run(base.view([4, 3]), f_relu);
    assert!(!in_place);
    assert!(y.equal(&base.view([4, 3]).relu()));
    drop(base);
    let (in_place, _) = run(exclusive_f32().view([4, 3]), f_relu);
    assert!(
        !in_place,
        "the temporary base is still alive during the call"
    );

    // Once the base is unreachable the view alone holds it (exclusivity.rs) and the
    // update happens in place, with the same values.
    let view = exclusive_f32().view([4, 3]);
    assert!(is_exclusive(&view).unwrap());
    let expected = view.relu();
    let (in_place, y) = run(view, f_relu);
    assert!(in_place);
    assert!(y.equal(&expected));
}

/// `a * 2` split in two, keeping only the first half: a view that alone holds its base.
fn first_half_of_a_split(a: &Tensor) -> Tensor {
    let mut halves = (a * 2.0).chunk(2, 0);
    halves.truncate(1);
    halves.remove(0)
}

/// The gradient of `a` after backward through `f(first_half_of_a_split(a))`.
fn grad_through_first_half(a: &Tensor, f: impl FnOnce(Tensor) -> Tensor) -> (Tensor, Tensor) {
    let a = a.detach().set_requires_grad(true);
    let y = f(first_half_of_a_split(&a));
    y.sum(Kind::Float).backward();
    (y.detach(), a.grad())
}

#[test]
#[serial]
fn one_of_several_views_of_one_op_is_copied_in_training_as_libtorch_refuses_the_write() {
    let a = Tensor::randn([4, 3], F32);
    let half = first_half_of_a_split(&a.detach().set_requires_grad(true));
    assert!(
        is_exclusive(&half).unwrap(),
        "the counts alone say exclusive"
    );
    assert!(!can_mutate_in_place(&half).unwrap());
    drop(half);

    let (expected, expected_grad) = grad_through_first_half(&a, |x| x.relu());
    let (y, grad) = grad_through_first_half(&a, |x| {
        let (in_place, y) = run(x, f_relu);
        assert!(!in_place);
        y
    });
    assert!(y.equal(&expected));
    assert!(grad.equal(&expected_grad));
    for op in [
        |x| f_add(x, &Tensor::ones([2, 3], F32)),
        |x| f_mul(x, &Tensor::ones([2, 3], F32)),
        |x| f_residual_add(x, &Tensor::ones([2, 3], F32)),
        |x| f_dropout(x, 0.5, true),
        |x: Tensor| f_inplace_or(x, |x| x.f_sigmoid_(), |x| x.f_sigmoid()),
    ] as [fn(Tensor) -> memsave_inplace::Result<Tensor>; 5]
    {
        let a = a.detach().set_requires_grad(true);
        let y = op(first_half_of_a_split(&a)).unwrap();
        y.sum(Kind::Float).backward();
        assert!(a.grad().defined());
    }

    // The expression as users write it.
    let a2 = a.detach().set_requires_grad(true);
    let y = f_relu((&a2 * 2.0).chunk(2, 0).remove(0)).unwrap();
    assert!(y.equal(&expected));
    y.sum(Kind::Float).backward();
    assert!(a2.grad().equal(&expected_grad));

    // An input that does not require grad is not recorded, so nothing is refused; the
    // helpers still copy (the other operand may require grad) and agree with relu.
    let half = first_half_of_a_split(&a);
    let expected = half.relu();
    assert!(f_relu(half).unwrap().equal(&expected));
}

#[test]
#[serial]
fn a_view_made_under_no_grad_is_copied_in_training_and_mutated_under_no_grad() {
    // Inputs prepared under no_grad, then updated in training by something that
    // requires grad: libtorch refuses to write into such a view when the write is
    // recorded, so the helper copies.
    let values = Tensor::randn([4, 3], F32);
    let no_grad_view = || {
        let b = values.copy();
        tch::no_grad(|| b.narrow(0, 0, 2))
    };
    let w = Tensor::randn([2, 3], F32).set_requires_grad(true);
    let view = no_grad_view();
    assert!(
        is_exclusive(&view).unwrap(),
        "the counts alone say exclusive"
    );
    assert!(!can_mutate_in_place(&view).unwrap());
    let expected = &no_grad_view() + &w;
    let (in_place, y) = run(view, |x| f_add(x, &w));
    assert!(!in_place);
    assert!(y.equal(&expected));
    y.sum(Kind::Float).backward();
    assert!(w.grad().equal(&Tensor::ones([2, 3], F32)));

    // Under no_grad libtorch checks nothing, and the same view is updated in place.
    let _guard = tch::no_grad_guard();
    let view = no_grad_view();
    assert!(can_mutate_in_place(&view).unwrap());
    let (in_place, y) = run(view, |x| f_add(x, &w));
    assert!(in_place);
    assert!(y.equal(&expected));
}

#[test]
#[serial]
fn a_view_of_a_leaf_that_requires_grad_is_never_exclusive() {
    // libtorch also refuses to write into a view of a leaf that requires grad; such a
    // view is never exclusive, as autograd's gradient accumulator holds the leaf.
    let view = Tensor::randn([4, 3], F32)
        .set_requires_grad(true)
        .narrow(0, 0, 2);
    assert_eq!(sharing(&view).unwrap().base_use_count, Some(2));
    let expected = view.relu();
    let (in_place, y) = run(view, f_relu);
    assert!(!in_place);
    assert!(y.equal(&expected));
}
#[test]
#[serial]
fn a_leaf_that_requires_grad_is_never_mutated_even_under_no_grad() {
    let w = exclusive_f32().set_requires_grad(true);
    let (in_place, y) = run(w, f_relu);
    assert!(!in_place);
    y.sum(Kind::Float).backward();
    let _guard = tch::no_grad_guard();
    let w = exclusive_f32().set_requires_grad(true);
    let (in_place, _) = run(w, |w| f_clamp(w, 0.0, 1.0));
    assert!(!in_place);
}

#[test]
#[serial]
fn broadcasting_that_grows_x_is_copied_and_broadcasting_into_x_is_not() {
    let (in_place, y) = run(Tensor::randn([4], F32), |x| {
        f_add(x, &Tensor::randn([3, 4], F32))
    });
    assert!(!in_place);
    assert_eq!(y.size(), [3, 4]);
    let (in_place, y) = run(Tensor::randn([3, 1], F32), |x| {
        f_mul(x, &Tensor::randn([4], F32))
    });
    assert!(!in_place);
    assert_eq!(y.size(), [3, 4]);
    let (in_place, y) = run(exclusive_f32(), |x| f_add(x, &Tensor::randn([4], F32)));
    assert!(in_place);
    assert_eq!(y.size(), [3, 4]);
    let (in_place, _) = run(exclusive_f32(), |x| f_mul(x, &Tensor::randn([3, 1], F32)));
    assert!(in_place);
}

#[test]
#[serial]
fn a_promotion_x_cannot_hold_is_copied() {
    let int = || {
        Tensor::arange(12, (Kind::Int64, Device::Cpu))
            .view([3, 4])
            .contiguous()
    };
    let (in_place, y) = run(int(), |x| f_add(x, &Tensor::randn([4], F32)));
    assert!(!in_place);
    assert_eq!(y.kind(), Kind::Float);
    let (in_place, y) = run(exclusive_f32(), |x| {
        f_add(x, &Tensor::randn([4], (Kind::Double, Device::Cpu)))
    });
    assert!(!in_place, "f32 + f64 of the same tier is f64");
    assert_eq!(y.kind(), Kind::Double);
    let (in_place, y) = run(int(), |x| f_clamp(x, 0.5, 5.5));
    assert!(!in_place, "float bounds promote an integer tensor");
    assert_eq!(y.kind(), Kind::Float);
    let bools = || Tensor::ones([3, 4], (Kind::Bool, Device::Cpu));
    let (in_place, y) = run(bools(), |x| f_add(x, &int()));
    assert!(!in_place);
    assert_eq!(y.kind(), Kind::Int64);
}

#[test]
#[serial]
fn a_lower_category_or_a_zero_dim_operand_keeps_x_s_kind_and_goes_in_place() {
    let int = Tensor::arange(4, (Kind::Int64, Device::Cpu));
    let (in_place, y) = run(exclusive_f32(), |x| f_add(x, &int));
    assert!(in_place);
    assert_eq!(y.kind(), Kind::Float);
    let scalar_f64 = Tensor::from(2.5f64);
    assert_eq!(scalar_f64.dim(), 0);
    let x = exclusive_f32();
    let expected = &x * &scalar_f64;
    let (in_place, y) = run(x, |x| f_mul(x, &scalar_f64));
    assert!(
        in_place,
        "a zero-dim f64 does not promote a dimensioned f32"
    );
    assert!(y.equal(&expected));
    assert_eq!(y.kind(), Kind::Float);
    let (in_place, y) = run(exclusive_f32(), |x| f_add(x, &Tensor::from(1i64)));
    assert!(in_place);
    assert_eq!(y.kind(), Kind::Float);
    let (in_place, y) = run(Tensor::from(1i64), |x| f_add(x, &Tensor::from(1.5f64)));
    assert!(!in_place, "a zero-dim float promotes a zero-dim integer");
    assert_eq!(y.kind(), Kind::Double);
}

#[test]
#[serial]
fn in_training_gelu_clamp_and_mul_by_a_grad_tensor_copy_because_in_place_saves_nothing() {
    let w = exclusive_f32().set_requires_grad(true);
    let (in_place, _) = run(&w * 1.0, |x| f_gelu(x, "none"));
    assert!(!in_place);
    let (in_place, _) = run(&w * 1.0, |x| f_clamp(x, -1.0, 1.0));
    assert!(!in_place);
    let (in_place, _) = run(&w * 1.0, |x| f_mul(x, &w));
    assert!(!in_place);
    let constant = exclusive_f32();
    let (in_place, _) = run(&w * 1.0, |x| f_mul(x, &constant));
    assert!(in_place, "mul by a constant saves only the constant");
    let (in_place, _) = run(&w * 1.0, f_relu);
    assert!(in_place, "relu saves its output, which is the mutated x");
    let (in_place, _) = run(&w * 1.0, |x| f_dropout(x, 0.5, true));
    assert!(in_place, "dropout saves only its mask");
}

#[test]
#[serial]
fn training_gradients_are_the_same_in_place_and_out_of_place() {
    let w0 = exclusive_f32();
    let constant = exclusive_f32();
    let forward = |helpers: bool| {
        tch::manual_seed(7);
        let w = w0.copy().set_requires_grad(true);
        let h = &w * 2.0;
        let out = if helpers {
            let h = f_mul(h, &constant).unwrap();
            let h = f_dropout(h, 0.3, true).unwrap();
            let h = f_add(h, &constant).unwrap();
            f_relu(h).unwrap()
        } else {
            ((&h * &constant).dropout(0.3, true) + &constant).relu()
        };
        out.square().sum(Kind::Float).backward();
        (out.detach(), w.grad().copy())
    };
    let before = stats();
    let (out_helper, grad_helper) = forward(true);
    assert_eq!(stats().since(&before).in_place, 4);
    let (out_plain, grad_plain) = forward(false);
    assert!(out_helper.equal(&out_plain));
    assert!(grad_helper.equal(&grad_plain));
}

#[test]
#[serial]
fn dropout_in_eval_or_with_p_zero_returns_x_and_counts_nothing() {
    reset_stats();
    let (same, _) = run(exclusive_f32(), |x| f_dropout(x, 0.5, false));
    assert!(same);
    let (same, _) = run(exclusive_f32(), |x| f_dropout(x, 0.0, true));
    assert!(same);
    assert_eq!(stats(), InplaceStats::default());
}

#[test]
#[serial]
fn dropout_draws_the_same_mask_in_place_and_out_of_place() {
    let x = exclusive_f32();
    tch::manual_seed(3);
    let expected = x.dropout(0.5, true);
    tch::manual_seed(3);
    let (in_place, y) = run(x, |x| f_dropout(x, 0.5, true));
    assert!(in_place);
    assert!(y.equal(&expected));
}

#[test]
#[serial]
fn bad_input_returns_an_error_and_never_panics() {
    let err = f_dropout(exclusive_f32(), 1.5, true).unwrap_err();
    assert!(
        matches!(err, InplaceError::InvalidArgument { op: "dropout", .. }),
        "{err}"
    );
    let err = f_add(exclusive_f32(), &Tensor::randn([5], F32)).unwrap_err();
    let message = err.to_string();
    assert!(message.starts_with("add: "), "{message}");
    assert!(message.contains("must match the size"), "{message}");
    assert!(!message.contains("Exception raised from"), "{message}");
    let err = f_gelu(exclusive_f32(), "fast").unwrap_err();
    assert!(
        matches!(err, InplaceError::Torch { op: "gelu", .. }),
        "{err}"
    );
    let ints = Tensor::arange(4, (Kind::Int64, Device::Cpu));
    let err = f_gelu(ints, "none").unwrap_err();
    assert!(
        matches!(err, InplaceError::Torch { op: "gelu", .. }),
        "{err}"
    );
}

#[test]
#[serial]
fn a_failed_in_place_op_counts_nothing() {
    reset_stats();
    assert!(f_gelu(exclusive_f32(), "fast").is_err());
    assert_eq!(stats(), InplaceStats::default());
}

#[test]
#[serial]
fn inplace_or_runs_the_in_place_closure_only_when_exclusive() {
    let y = Tensor::randn([3, 4], F32);
    let x = exclusive_f32();
    let expected = &x - &y;
    let (in_place, z) = run(x, |x| f_inplace_or(x, |x| x.f_sub_(&y), |x| x.f_sub(&y)));
    assert!(in_place);
    assert!(z.equal(&expected));
    let x = exclusive_f32();
    let _other = x.shallow_clone();
    let z = inplace_or(
        x,
        |_| panic!("must not run on a shared tensor"),
        |x| x.f_sub(&y),
    );
    assert!(z.equal(&(&_other - &y)));
}

#[test]
#[serial]
#[should_panic(expected = "add: ")]
fn the_short_names_panic_with_the_error() {
    let _ = add(exclusive_f32(), &Tensor::randn([5], F32));
}

#[test]
#[serial]
fn the_stats_display_bytes_not_allocated() {
    reset_stats();
    let x = relu(Tensor::zeros([256, 1024], F32));
    drop(x);
    assert_eq!(
        stats().to_string(),
        "1 in place, 0 copied, 1.00 MiB not allocated"
    );
}
