//! Saved-tensor hooks: semantics, bad input, memory.
use memsave_hooks::{
    hooks_from_fn, saved_tensors_hooks, Accounting, HooksError, HooksGuard, SaveOnCpu,
};
use memsave_meter::{f_memory_allocated, measure};
use serial_test::serial;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn leaf(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

fn counting() -> (
    Arc<AtomicUsize>,
    Arc<AtomicUsize>,
    impl memsave_hooks::SavedTensorHooks,
) {
    let packs = Arc::new(AtomicUsize::new(0));
    let unpacks = Arc::new(AtomicUsize::new(0));
    let (p, u) = (packs.clone(), unpacks.clone());
    let hooks = hooks_from_fn(
        move |t: &Tensor| {
            p.fetch_add(1, Ordering::SeqCst);
            Ok(t.shallow_clone())
        },
        move |t: &Tensor| {
            u.fetch_add(1, Ordering::SeqCst);
            Ok(t.shallow_clone())
        },
    );
    (packs, unpacks, hooks)
}

#[test]
#[serial_test::parallel]
fn pack_runs_for_every_saved_tensor_and_unpack_for_every_use() {
    let (w, x) = (leaf(&[3, 3]), leaf(&[2, 3]));
    let (packs, unpacks, hooks) = counting();
    // mm saves x and w; tanh saves its output.
    let y = saved_tensors_hooks(hooks, || x.mm(&w).tanh().sum(Kind::Float)).unwrap();
    assert_eq!(packs.load(Ordering::SeqCst), 3);
    assert_eq!(unpacks.load(Ordering::SeqCst), 0);
    y.backward();
    assert_eq!(unpacks.load(Ordering::SeqCst), 3);
    let expected = {
        let (w, x) = (w.detach().set_requires_grad(true), x.detach());
        x.mm(&w).tanh().sum(Kind::Float).backward();
        w.grad()
    };
    assert!(w.grad().equal(&expected));
}

#[test]
#[serial_test::parallel]
fn outside_the_scope_and_on_other_threads_nothing_is_packed() {
    let (packs, _, hooks) = counting();
    let guard = HooksGuard::new(hooks).unwrap();
    let other = std::thread::spawn(|| {
        let x = leaf(&[4]);
        let _ = x.tanh();
    });
    other.join().unwrap();
    assert_eq!(
        packs.load(Ordering::SeqCst),
        0,
        "another thread's save went through this thread's hooks"
    );
    let x = leaf(&[4]);
    let _y = x.tanh();
    assert_eq!(packs.load(Ordering::SeqCst), 1);
    guard.exit().unwrap();
    let _z = x.tanh();
    assert_eq!(packs.load(Ordering::SeqCst), 1);
}

#[test]
#[serial_test::parallel]
fn the_innermost_scope_wins_and_scopes_left_out_of_order_are_reported() {
    let (outer_packs, _, outer) = counting();
    let (inner_packs, _, inner) = counting();
    let x = leaf(&[4]);
    let g1 = HooksGuard::new(outer).unwrap();
    let g2 = HooksGuard::new(inner).unwrap();
    let _y = x.tanh();
    assert_eq!(
        (
            outer_packs.load(Ordering::SeqCst),
            inner_packs.load(Ordering::SeqCst)
        ),
        (0, 1)
    );
    let err = g1.exit().unwrap_err();
    assert!(matches!(err, HooksError::OutOfOrder(_)), "{err}");
    g2.exit().unwrap();
}

/// As in PyTorch, a pack hook that fails makes the op that saved the tensor fail, so the
/// forward stops there (Trust II, item 14; PyTorch's test_saved_tensors_hook_raises...
/// cases in test/test_autograd.py raise at the op too).
#[test]
#[serial_test::parallel]
fn a_pack_hook_that_fails_or_panics_fails_the_op_that_saved_naming_the_tensor() {
    let x = leaf(&[2, 5]);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let failing = hooks_from_fn(
        move |_t: &Tensor| {
            c.fetch_add(1, Ordering::SeqCst);
            Err::<Tensor, _>("disk full".into())
        },
        |t: &Tensor| Ok(t.shallow_clone()),
    );
    let result = saved_tensors_hooks(failing, || -> Result<Tensor, tch::TchError> {
        let y = x.f_exp()?;
        // Never reached: the forward stops at the first failing save.
        let z = y.f_sin()?;
        z.f_sum(Kind::Float)
    })
    .unwrap();
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("disk full") && err.contains("[2, 5]") && err.contains("Float"),
        "{err}"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "pack ran after the failing save"
    );

    let panicking = hooks_from_fn(
        |_t: &Tensor| -> Result<Tensor, _> { panic!("pack exploded") },
        |t: &Tensor| Ok(t.shallow_clone()),
    );
    let err = saved_tensors_hooks(panicking, || x.f_exp())
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(err.contains("pack exploded"), "{err}");
    assert!(
        !err.contains("Exception raised from"),
        "backtrace leaked: {err}"
    );
    // The scope is gone: later saves are plain and backward works.
    x.exp().sum(Kind::Float).backward();
    assert!(x.grad().allclose(&x.detach().exp(), 1e-6, 1e-6, false));
}

#[test]
#[serial_test::parallel]
fn an_unpack_of_another_shape_or_dtype_or_an_unpack_error_is_an_err_naming_the_tensor() {
    let x = leaf(&[3]);
    let wrong_shape = hooks_from_fn(
        |t: &Tensor| Ok(t.shallow_clone()),
        |t: &Tensor| Ok(t.narrow(0, 0, 2)),
    );
    let y = saved_tensors_hooks(wrong_shape, || x.exp().sum(Kind::Float)).unwrap();
    let err = y.f_backward().unwrap_err().to_string();
    assert!(
        err.contains("[2]") && err.contains("[3]") && err.contains("ExpBackward0"),
        "{err}"
    );

    let wrong_dtype = hooks_from_fn(
        |t: &Tensor| Ok(t.shallow_clone()),
        |t: &Tensor| Ok(t.to_kind(Kind::Double)),
    );
    let y = saved_tensors_hooks(wrong_dtype, || x.exp().sum(Kind::Float)).unwrap();
    let err = y.f_backward().unwrap_err().to_string();
    assert!(err.contains("Double") && err.contains("Float"), "{err}");

    let failing = hooks_from_fn(
        |t: &Tensor| Ok(t.shallow_clone()),
        |_t: &Tensor| Err::<Tensor, _>("gone".into()),
    );
    let y = saved_tensors_hooks(failing, || x.exp().sum(Kind::Float)).unwrap();
    let err = y.f_backward().unwrap_err().to_string();
    assert!(err.contains("gone") && err.contains("[3]"), "{err}");
}

#[test]
#[serial_test::parallel]
fn a_saved_tensor_modified_in_place_is_still_caught_under_hooks() {
    // libtorch skips its version check when hooks are set; the bridge checks instead.
    let x2 = leaf(&[4]);
    let (_, _, hooks) = counting();
    let (z, e) = saved_tensors_hooks(hooks, || {
        let e = x2.exp();
        (e.sum(Kind::Float), e)
    })
    .unwrap();
    let _ = e.shallow_clone().g_add_scalar_(1.0);
    let err = z.f_backward().unwrap_err().to_string();
    assert!(
        err.contains("modified by an in-place operation") && err.contains("[4]"),
        "{err}"
    );
}

#[test]
#[serial_test::parallel]
fn bf16_hooks_give_gradients_close_to_exact_and_save_on_cpu_is_exact_on_the_cpu() {
    let w = leaf(&[16, 16]);
    let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
    let exact = {
        let w = w.detach().set_requires_grad(true);
        x.mm(&w).tanh().mm(&w).sum(Kind::Float).backward();
        w.grad()
    };
    let bf16 = hooks_from_fn(
        |t: &Tensor| Ok((t.kind(), t.to_kind(Kind::BFloat16))),
        |(k, t): &(Kind, Tensor)| Ok(t.to_kind(*k)),
    );
    saved_tensors_hooks(bf16, || x.mm(&w).tanh().mm(&w).sum(Kind::Float))
        .unwrap()
        .backward();
    let rel =
        (w.grad() - &exact).abs().max().double_value(&[]) / exact.abs().max().double_value(&[]);
    assert!(rel < 0.02, "relative error {rel}");
    memsave_sys::tensor::set_grad_none(&w).unwrap();
    saved_tensors_hooks(SaveOnCpu::new(), || x.mm(&w).tanh().mm(&w).sum(Kind::Float))
        .unwrap()
        .backward();
    assert!(w.grad().equal(&exact));
}

#[test]
#[serial]
fn a_thousand_checkpointed_steps_leave_memory_where_it_started_with_and_without_hooks() {
    memsave_sys::alloc::install_counting_allocator().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root(), 8, 8, Default::default());
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let step = |lin: &nn::Linear| {
        let l = lin.ws.shallow_clone();
        let b = lin.bs.as_ref().unwrap().shallow_clone();
        let y = memsave_checkpoint::checkpoint1(&x, move |x| {
            x.linear(&l, Some(&b)).tanh().dropout(0.1, true)
        })
        .unwrap();
        y.square().sum(Kind::Float).backward();
        for p in vs.trainable_variables() {
            memsave_sys::tensor::set_grad_none(&p).unwrap();
        }
    };
    step(&lin); // first-use allocations (engine, RNG state) out of the way
    let start = f_memory_allocated(Device::Cpu).unwrap();
    for _ in 0..1000 {
        step(&lin);
    }
    assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
    let acct = Accounting::new();
    let guard = HooksGuard::new(acct.clone()).unwrap();
    for _ in 0..1000 {
        step(&lin);
    }
    guard.exit().unwrap();
    assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
}

/// The seed network: 10 layers of `x = x + linear(x)` on [50, 100, 512]. What autograd
/// keeps after the forward is each layer's input, saved by addmm; Accounting names it.
#[test]
#[serial]
fn accounting_attributes_exactly_the_bytes_the_forward_retains_on_the_seed_network() {
    memsave_sys::alloc::install_counting_allocator().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let layers: Vec<nn::Linear> = (0..10)
        .map(|i| nn::linear(vs.root() / i, 512, 512, Default::default()))
        .collect();
    let input = Tensor::randn([50, 100, 512], (Kind::Float, Device::Cpu));
    let forward = |x: &Tensor, acct: Option<&Accounting>| {
        let mut x = x.shallow_clone();
        for (i, layer) in layers.iter().enumerate() {
            if let Some(a) = acct {
                a.mark(format!("layer {i}"));
            }
            x = &x + layer.forward(&x);
        }
        x
    };
    // Retained after the forward, without hooks, output dropped: the saved tensors alone.
    let (_, m) = measure(Device::Cpu, |_| {
        let y = forward(&input, None);
        let sum = y.sum(Kind::Float);
        drop(y);
        sum
    });
    let retained = m.retained_bytes() as u64 - 4; // the scalar sum
    let params = vs.trainable_variables();
    let mut held: Vec<Tensor> = params.iter().map(|p| p.shallow_clone()).collect();
    held.push(input.shallow_clone());
    let acct = Accounting::new().excluding(&held);
    let y = saved_tensors_hooks(acct.clone(), || {
        forward(&input, Some(&acct)).sum(Kind::Float)
    })
    .unwrap();
    assert_eq!(
        retained,
        9 * 50 * 100 * 512 * 4,
        "9 layer inputs besides the input itself"
    );
    assert_eq!(acct.total_bytes(), retained);
    assert_eq!(acct.bytes_by_op().get("aten::addmm"), Some(&retained));
    let by_mark = acct.bytes_by_mark();
    assert_eq!(by_mark.len(), 9);
    assert!(by_mark.values().all(|&b| b == 50 * 100 * 512 * 4));
    y.backward();
}
