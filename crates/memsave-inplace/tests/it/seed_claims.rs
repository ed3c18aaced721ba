//! The seed's claims about in-place updates, measured to the byte. Expected values come
//! from formulas: an activation is B*S*H f32 values, 4 bytes each. Every test runs
//! serially: the meter's counter and the helpers' counters are process-wide.
use memsave_inplace::{f_relu, f_residual_add, reset_stats, stats, Result};
use memsave_meter::{empty_cache, measure, memory_allocated};
use serial_test::serial;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;
const F32: (Kind, Device) = (Kind::Float, CPU);
const B: i64 = 2;
const S: i64 = 3;
const H: i64 = 8;
const ACT: i64 = B * S * H * 4;

fn layers(vs: &nn::VarStore, n: usize) -> Vec<nn::Linear> {
    (0..n)
        .map(|i| nn::linear(vs.root() / i, H, H, Default::default()))
        .collect()
}

fn gradients(vs: &nn::VarStore) -> Vec<Tensor> {
    let mut named = vs.variables().into_iter().collect::<Vec<_>>();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, v)| v.grad().copy()).collect()
}

fn clear_gradients(vs: &nn::VarStore) {
    for v in vs.trainable_variables() {
        memsave_sys::tensor::set_grad_none(&v).unwrap();
    }
}

#[test]
#[serial]
fn claim_1_plus_equals_breaks_backward_and_the_helper_copies_with_right_gradients() {
    let vs = nn::VarStore::new(CPU);
    let net = layers(&vs, 3);
    let x0 = Tensor::rand([B, S, H], F32);

    let mut x = x0.copy();
    for layer in &net {
        x += layer.forward(&x);
    }
    let err = x.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("modified by an inplace operation"), "{err}");
    clear_gradients(&vs);

    let mut x = x0.shallow_clone();
    for layer in &net {
        x = &x + layer.forward(&x);
    }
    x.sum(Kind::Float).backward();
    let expected = gradients(&vs);
    clear_gradients(&vs);

    reset_stats();
    let mut x = x0.shallow_clone();
    for layer in &net {
        let fx = layer.forward(&x);
        x = f_residual_add(x, &fx).unwrap();
    }
    assert_eq!((stats().in_place, stats().copied), (0, 3));
    x.sum(Kind::Float).backward();
    let got = gradients(&vs);
    assert_eq!(got.len(), 6);
    for (g, e) in got.iter().zip(&expected) {
        assert!(g.equal(e));
    }
}

#[test]
#[serial]
fn claim_2_add_with_out_fails_at_once_when_anything_requires_grad() {
    let vs = nn::VarStore::new(CPU);
    let layer = nn::linear(vs.root(), H, H, Default::default());
    let x = Tensor::rand([B, S, H], F32);
    let fx = layer.forward(&x);
    let err = x.f_add_out(&x, &fx).unwrap_err().to_string();
    assert!(
        err.contains("functions with out=... arguments don't support automatic differentiation"),
        "{err}"
    );
    let _guard = tch::no_grad_guard();
    let fx = layer.forward(&x);
    assert!(x.f_add_out(&x, &fx).is_ok(), "without grad, out= works");
}

/// Runs `depth` residual layers under no_grad, from an input the caller keeps.
fn inference(net: &[nn::Linear], x0: &Tensor, helper: bool) -> Result<Tensor> {
    tch::no_grad(|| {
        let mut x = x0.shallow_clone();
        for layer in net {
            let fx = layer.forward(&x);
            x = if helper {
                f_residual_add(x, &fx)?
            } else {
                &x + fx
            };
        }
        Ok(x)
    })
}

#[test]
#[serial]
fn claim_3_under_no_grad_the_helper_keeps_memory_flat_at_any_depth() {
    let vs = nn::VarStore::new(CPU);
    let net = layers(&vs, 6);
    let x0 = Tensor::rand([B, S, H], F32);
    for depth in 1..=6 {
        reset_stats();
        let (out, m) = measure(CPU, |_| inference(&net[..depth], &x0, true).unwrap());
        // One copy (x0 stays the caller's), then every layer in place.
        assert_eq!(m.retained_bytes(), ACT, "depth {depth}");
        assert_eq!(m.peak_bytes as i64, 2 * ACT, "depth {depth}: x and f(x)");
        assert_eq!(stats().copied, 1);
        assert_eq!(stats().in_place, depth as u64 - 1);
        assert_eq!(stats().bytes_saved as i64, (depth as i64 - 1) * ACT);
        let (plain, m) = measure(CPU, |_| inference(&net[..depth], &x0, false).unwrap());
        assert_eq!(m.retained_bytes(), ACT);
        let expected_peak = if depth == 1 { 2 * ACT } else { 3 * ACT };
        assert_eq!(m.peak_bytes as i64, expected_peak, "old x, f(x) and new x");
        assert!(out.equal(&plain));
    }
}

#[test]
#[serial]
fn claim_3_in_training_the_helper_copies_and_memory_grows_one_activation_per_layer() {
    let vs = nn::VarStore::new(CPU);
    let net = layers(&vs, 4);
    let x0 = Tensor::rand([B, S, H], F32);
    let (_out, m) = measure(CPU, |marks| {
        let mut x = x0.shallow_clone();
        for (i, layer) in net.iter().enumerate() {
            let fx = layer.forward(&x);
            x = f_residual_add(x, &fx).unwrap();
            drop(fx);
            marks.mark(format!("layer {i}"));
        }
        x
    });
    assert_eq!(m.marks.len(), 4);
    for (i, mark) in m.marks.iter().enumerate() {
        // Layer i's input is saved by its linear; f(x) is freed (add saves nothing).
        assert_eq!(
            mark.bytes as i64 - m.start_bytes as i64,
            (i as i64 + 1) * ACT
        );
    }
}

/// Linear then relu, `n` times, on a 2-D input (so the linear's output is no view).
fn linear_relu(net: &[nn::Linear], x0: &Tensor, helper: bool, exp_between: bool) -> Tensor {
    let mut x = x0.shallow_clone();
    for layer in net {
        let mut h = layer.forward(&x);
        if exp_between {
            h = h.exp();
        }
        x = if helper { f_relu(h).unwrap() } else { h.relu() };
    }
    x
}

#[test]
#[serial]
fn claim_4_relu_in_place_after_linear_lowers_the_peak_by_one_activation() {
    let layers_n = 4;
    let vs = nn::VarStore::new(CPU);
    let net = layers(&vs, layers_n);
    let x0 = Tensor::rand([B * S, H], F32);
    let l = layers_n as i64;

    let (out, plain) = measure(CPU, |_| linear_relu(&net, &x0, false, false));
    out.sum(Kind::Float).backward();
    drop(out);
    let expected = gradients(&vs);
    clear_gradients(&vs);

    reset_stats();
    let (out, helper) = measure(CPU, |_| linear_relu(&net, &x0, true, false));
    assert_eq!((stats().in_place, stats().copied), (layers_n as u64, 0));
    out.sum(Kind::Float).backward();
    drop(out);
    for (g, e) in gradients(&vs).iter().zip(&expected) {
        assert!(g.equal(e));
    }
    clear_gradients(&vs);

    // Every relu output is saved (by relu and by the next linear): L activations stay.
    assert_eq!(plain.retained_bytes(), l * ACT);
    assert_eq!(helper.retained_bytes(), l * ACT);
    // Out of place, the last linear's output and the relu's output coexist.
    assert_eq!(plain.peak_bytes as i64, (l + 1) * ACT);
    assert_eq!(helper.peak_bytes as i64, l * ACT);
}

#[test]
#[serial]
fn claim_4_after_exp_which_saves_its_output_the_helper_copies() {
    let vs = nn::VarStore::new(CPU);
    let net = layers(&vs, 3);
    let x0 = Tensor::rand([B * S, H], F32);
    let (expected, plain) = measure(CPU, |_| linear_relu(&net, &x0, false, true));
    reset_stats();
    let (out, helper) = measure(CPU, |_| linear_relu(&net, &x0, true, true));
    assert_eq!((stats().in_place, stats().copied), (0, 3));
    assert!(out.equal(&expected));
    out.sum(Kind::Float).backward();
    // Each layer keeps exp's output and relu's output.
    assert_eq!(helper.retained_bytes(), 3 * 2 * ACT);
    assert_eq!(helper.retained_bytes(), plain.retained_bytes());
    assert_eq!(helper.peak_bytes, plain.peak_bytes);
}

#[test]
#[serial]
fn claim_5_dropping_a_tensor_the_graph_holds_frees_nothing() {
    let vs = nn::VarStore::new(CPU);
    let net = layers(&vs, 2);
    let start = memory_allocated(CPU);
    let x0 = Tensor::rand([B * S, H], F32);
    let h = net[0].forward(&x0);
    let y = net[1].forward(&h);
    assert_eq!(memory_allocated(CPU) - start, 3 * ACT as u64);
    drop(h);
    empty_cache(CPU);
    assert_eq!(
        memory_allocated(CPU) - start,
        3 * ACT as u64,
        "the graph holds h"
    );
    drop(y);
    assert_eq!(memory_allocated(CPU) - start, ACT as u64, "only x0 is left");
    drop(x0);
    assert_eq!(memory_allocated(CPU), start);
}
