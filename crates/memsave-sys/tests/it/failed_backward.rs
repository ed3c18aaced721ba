//! A backward that fails frees the graph it ran, as one that succeeds does, unless it
//! was asked to keep it.
//!
//! The case that leaked: a residual update written in place (`x += f(x)`) on a tensor
//! that `f` saved makes a reference cycle (the tensor's `grad_fn` leads to the node
//! that saved the tensor itself). A successful backward breaks it by freeing each
//! node's saved tensors; one that fails (here at the version check of the modified
//! tensor) used to leave the nodes it had not reached holding them, so the model's
//! weights and the input stayed allocated after every handle to them was dropped.
//! libtorch's own engine leaks the same way; memsave's engine frees what the failed
//! backward would have freed.
use memsave_sys::alloc;
use memsave_sys::hooks::{self, Packed, RawHooks};
use memsave_sys::CallbackError;
use serial_test::{parallel, serial};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

const CPU_FLOAT: (Kind, Device) = (Kind::Float, Device::Cpu);

/// The input (`[4, 8]` floats, 128 bytes) and `layers` weights (`[8, 8]`, 256 bytes
/// each) of a residual network, and the loss of `x += x.matmul(w)` through each layer.
/// The input does not require grad, as a batch does not.
fn in_place_residual(layers: usize) -> (Tensor, Vec<Tensor>, Tensor) {
    let x = Tensor::ones([4, 8], CPU_FLOAT);
    let weights: Vec<Tensor> = (0..layers)
        .map(|_| Tensor::ones([8, 8], CPU_FLOAT).set_requires_grad(true))
        .collect();
    let mut y = x.shallow_clone();
    for w in &weights {
        let fx = y.matmul(w);
        let _ = y.f_add_(&fx).unwrap();
    }
    let loss = y.sum(Kind::Float);
    (x, weights, loss)
}

#[test]
#[serial]
fn a_failed_in_place_backward_frees_the_graph_once_its_tensors_are_dropped() {
    alloc::install_counting_allocator().unwrap();
    hooks::install_engine().unwrap();
    let before = alloc::allocated();
    {
        let (x, weights, loss) = in_place_residual(3);
        let e = loss.f_backward().unwrap_err().to_string();
        assert!(
            e.contains("modified by an inplace operation"),
            "the backward fails at the version check: {e}"
        );
        drop(loss);
        assert_eq!(
            alloc::allocated() - before,
            128 + 3 * 256,
            "the input and the weights, nothing else"
        );
        drop((x, weights));
    }
    assert_eq!(alloc::allocated(), before);
}

/// Packs by keeping the tensor itself (its `grad_fn` included), as an identity hook does.
struct Keep;

impl RawHooks for Keep {
    fn pack(&self, tensor: &Tensor, _saved_by: Option<&str>) -> Result<Packed, CallbackError> {
        Ok(Box::new(tensor.shallow_clone()))
    }

    fn unpack(&self, packed: &Packed) -> Result<Tensor, CallbackError> {
        let t = packed.downcast_ref::<Tensor>().ok_or("not a tensor")?;
        Ok(t.shallow_clone())
    }
}

#[test]
#[serial]
fn a_failed_in_place_backward_frees_what_saved_tensor_hooks_packed() {
    alloc::install_counting_allocator().unwrap();
    let before = alloc::allocated();
    {
        let frame = hooks::push(Arc::new(Keep)).unwrap();
        let (x, weights, loss) = in_place_residual(3);
        frame.exit().unwrap();
        let e = loss.f_backward().unwrap_err().to_string();
        assert!(
            e.contains("modified by an in-place operation"),
            "the hook's version check fails the backward: {e}"
        );
        drop(loss);
        assert_eq!(alloc::allocated() - before, 128 + 3 * 256);
        drop((x, weights));
    }
    assert_eq!(alloc::allocated(), before);
}

/// Packs by keeping the tensor; unpacking fails while `fail` is set.
struct FailWhileSet {
    fail: Arc<AtomicBool>,
}

impl RawHooks for FailWhileSet {
    fn pack(&self, tensor: &Tensor, _saved_by: Option<&str>) -> Result<Packed, CallbackError> {
        Ok(Box::new(tensor.shallow_clone()))
    }

    fn unpack(&self, packed: &Packed) -> Result<Tensor, CallbackError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err("the saved tensor is not readable yet".into());
        }
        let t = packed.downcast_ref::<Tensor>().ok_or("not a tensor")?;
        Ok(t.shallow_clone())
    }
}

#[test]
#[parallel]
fn a_failed_backward_that_keeps_the_graph_can_run_again() {
    let fail = Arc::new(AtomicBool::new(true));
    let w = Tensor::ones([3], CPU_FLOAT).set_requires_grad(true);
    let frame = hooks::push(Arc::new(FailWhileSet {
        fail: Arc::clone(&fail),
    }))
    .unwrap();
    let loss = (&w * &w).sum(Kind::Float);
    frame.exit().unwrap();
    let e = Tensor::f_run_backward(&[&loss], &[&w], true, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("the saved tensor is not readable yet"),
        "{e}"
    );
    fail.store(false, Ordering::SeqCst);
    let grads = Tensor::f_run_backward(&[&loss], &[&w], false, false).unwrap();
    assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), vec![2.0; 3]);
}

#[test]
#[parallel]
fn a_failed_grad_to_an_intermediate_keeps_the_graph_below_it() {
    let w = Tensor::ones([3], CPU_FLOAT).set_requires_grad(true);
    // `exp` saves its result: the part of the graph below `h` holds a saved tensor.
    let h = w.exp();
    let c = Tensor::ones([3], CPU_FLOAT).set_requires_grad(true);
    let frame = hooks::push(Arc::new(FailWhileSet {
        fail: Arc::new(AtomicBool::new(true)),
    }))
    .unwrap();
    let loss = (&h * &c).sum(Kind::Float);
    frame.exit().unwrap();
    let e = Tensor::f_run_backward(&[&loss], &[&h], false, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("the saved tensor is not readable yet"),
        "{e}"
    );
    // That grad stopped at `h`: the exp's node was not part of it and keeps its
    // saved result for a later backward.
    h.sum(Kind::Float).f_backward().unwrap();
    for g in Vec::<f32>::try_from(&w.grad()).unwrap() {
        assert!((g - std::f32::consts::E).abs() < 1e-6, "{g}");
    }
}
