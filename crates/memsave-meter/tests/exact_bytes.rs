//! Exact byte counts from the meter. Every test here allocates, so they run serially:
//! the counter is process-wide.
use memsave_meter::{
    detect_leak, f_detect_leak, f_measure, f_set_memory_limit, measure, memory_allocated,
    memory_summary, reset_peak_memory_stats,
};
use serial_test::serial;
use std::sync::{Arc, Barrier};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

/// Removes the memory limit when dropped, so a failing assertion cannot leave it set.
struct LimitGuard;
impl Drop for LimitGuard {
    fn drop(&mut self) {
        f_set_memory_limit(CPU, None).unwrap();
    }
}

#[test]
#[serial]
fn a_1024_square_f32_tensor_is_4_mib_and_views_add_nothing() {
    let start = memory_allocated(CPU);
    let t = Tensor::zeros([1024, 1024], (Kind::Float, CPU));
    assert_eq!(memory_allocated(CPU) - start, 4_194_304);
    let view = t.narrow(0, 0, 10);
    let transposed = t.tr();
    let reshaped = t.view([-1]);
    let shallow = t.shallow_clone();
    assert_eq!(memory_allocated(CPU) - start, 4_194_304);
    drop((view, transposed, reshaped, shallow));
    let copy = t.copy();
    assert_eq!(memory_allocated(CPU) - start, 2 * 4_194_304);
    drop(copy);
    drop(t);
    assert_eq!(memory_allocated(CPU), start);
}

/// The seed's network: `x = x + linear(x)` for `layers` Linear(h, h) layers.
fn seed_network(vs: &nn::Path, layers: usize, h: i64) -> Vec<nn::Linear> {
    (0..layers)
        .map(|i| nn::linear(vs / i, h, h, Default::default()))
        .collect()
}

fn forward(layers: &[nn::Linear], x: &Tensor) -> Tensor {
    let mut x = x.shallow_clone();
    for layer in layers {
        x = &x + layer.forward(&x);
    }
    x
}

#[test]
#[serial]
fn seed_network_retains_one_input_per_layer_after_forward() {
    let (l, b, s, h) = (6usize, 3i64, 5i64, 16i64);
    let vs = nn::VarStore::new(CPU);
    let layers = seed_network(&vs.root(), l, h);
    let x = Tensor::rand([b, s, h], (Kind::Float, CPU));
    let (out, m) = measure(CPU, |_| forward(&layers, &x));
    // Layer i saves its input for backward; the inputs of layers 1..L and the output are
    // new tensors, L of them, each B*S*H f32 values.
    assert_eq!(m.retained_bytes(), l as i64 * b * s * h * 4);
    drop(out);
    assert_eq!(memory_allocated(CPU), m.start_bytes);
}

#[test]
#[serial]
fn seed_network_backward_peak_is_reproducible_to_the_byte() {
    let (l, b, s, h) = (5usize, 2i64, 7i64, 32i64);
    let vs = nn::VarStore::new(CPU);
    let layers = seed_network(&vs.root(), l, h);
    let x = Tensor::rand([b, s, h], (Kind::Float, CPU));
    let mut peaks = Vec::new();
    for _ in 0..3 {
        for v in vs.trainable_variables() {
            memsave_sys::tensor::set_grad_none(&v).unwrap();
        }
        let (_, m) = measure(CPU, |_| {
            let loss = forward(&layers, &x).square().mean(Kind::Float);
            loss.backward();
        });
        peaks.push((m.peak_bytes, m.end_bytes - m.start_bytes));
    }
    assert!(peaks[0].0 > 0);
    assert_eq!(peaks[1], peaks[2]);
    // After the first step the gradients exist already and are accumulated in place.
    assert_eq!(peaks[0].0, peaks[1].0);
}

#[test]
#[serial]
fn allocations_from_several_threads_sum_exactly() {
    let start = memory_allocated(CPU);
    let threads = 4;
    let ready = Arc::new(Barrier::new(threads + 1));
    let release = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (ready, release) = (ready.clone(), release.clone());
            std::thread::spawn(move || {
                let tensors: Vec<Tensor> = (0..10)
                    .map(|j| Tensor::zeros([(i * 10 + j + 1) as i64 * 64], (Kind::Float, CPU)))
                    .collect();
                ready.wait();
                release.wait();
                drop(tensors);
            })
        })
        .collect();
    ready.wait();
    // Sum over threads i and tensors j of (10 i + j + 1) * 64 floats * 4 bytes.
    let expected: u64 = (0..threads as u64)
        .flat_map(|i| (0..10u64).map(move |j| (i * 10 + j + 1) * 64 * 4))
        .sum();
    assert_eq!(expected, 209_920);
    assert_eq!(memory_allocated(CPU) - start, expected);
    release.wait();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(memory_allocated(CPU), start);
}

#[test]
#[serial]
fn the_limit_fails_an_allocation_with_an_error_and_leaves_the_counter() {
    let _guard = LimitGuard;
    let start = memory_allocated(CPU);
    f_set_memory_limit(CPU, Some(start + 1000)).unwrap();
    let small = Tensor::f_zeros([250], (Kind::Float, CPU)).expect("1000 bytes fit exactly");
    let err = Tensor::f_zeros([1], (Kind::Float, CPU)).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("out of memory"), "{message}");
    assert!(message.contains("memory limit"), "{message}");
    assert_eq!(memory_allocated(CPU), start + 1000);
    drop(small);
    assert_eq!(memory_allocated(CPU), start);
    let summary = memory_summary(CPU);
    assert!(summary.contains("limit"), "{summary}");
}

#[test]
#[serial]
fn bf16_autocast_matmul_runs_with_the_counter_installed() {
    use memsave_sys::autocast;
    let a = Tensor::rand([64, 32], (Kind::Float, CPU));
    let b = Tensor::rand([32, 16], (Kind::Float, CPU));
    let was = autocast::is_enabled(CPU).unwrap();
    let dtype = autocast::dtype(CPU).unwrap();
    autocast::set_dtype(CPU, Kind::BFloat16).unwrap();
    autocast::set_enabled(CPU, true).unwrap();
    let (c, m) = measure(CPU, |_| a.matmul(&b));
    autocast::set_enabled(CPU, was).unwrap();
    autocast::set_dtype(CPU, dtype).unwrap();
    autocast::clear_cache().unwrap();
    assert_eq!(c.kind(), Kind::BFloat16);
    // The bf16 result (2 bytes a value) is what remains; the casts were temporaries.
    assert_eq!(m.retained_bytes(), 64 * 16 * 2);
    assert!(m.peak_bytes >= (64 * 32 + 32 * 16 + 64 * 16) * 2);
}

#[test]
#[serial]
fn summing_losses_with_their_graphs_leaks_and_summing_numbers_does_not() {
    let (batch, inp, out) = (8i64, 32i64, 16i64);
    let vs = nn::VarStore::new(CPU);
    let model = nn::linear(vs.root(), inp, out, Default::default());
    let step_loss = || {
        let x = Tensor::rand([batch, inp], (Kind::Float, CPU));
        model.forward(&x).square().mean(Kind::Float)
    };

    let mut total = Tensor::zeros([], (Kind::Float, CPU));
    let leaky = detect_leak(CPU, 5, |_| -> Result<(), ()> {
        total = &total + step_loss();
        Ok(())
    })
    .unwrap();
    assert!(leaky.is_leaking(), "{leaky}");
    // Each step's graph keeps x (saved by the linear) and the linear's output (saved by
    // square) alive through `total`.
    assert_eq!(
        leaky.leaked_bytes_per_step(),
        (batch * inp + batch * out) * 4
    );
    drop(total);

    let mut total = 0.0;
    let fixed = detect_leak(CPU, 5, |_| -> Result<(), ()> {
        total += step_loss().double_value(&[]);
        Ok(())
    })
    .unwrap();
    assert!(!fixed.is_leaking(), "{fixed}");
    assert_eq!(fixed.leaked_bytes_per_step(), 0);
    assert!(fixed.growth_per_step().iter().all(|&g| g == 0), "{fixed:?}");
    assert!(total.is_finite());
}

#[test]
#[serial]
fn nested_scopes_keep_the_outer_peak() {
    reset_peak_memory_stats(CPU);
    let (_, outer) = measure(CPU, |_| {
        let big = Tensor::zeros([1000], (Kind::Float, CPU));
        drop(big);
        let (_, inner) = measure(CPU, |_| Tensor::zeros([10], (Kind::Float, CPU)));
        assert_eq!(inner.peak_bytes, 40);
    });
    assert_eq!(outer.peak_bytes, 4000);
}

#[test]
#[serial]
fn an_inner_scope_that_panics_keeps_the_outer_peak() {
    reset_peak_memory_stats(CPU);
    let (_, outer) = measure(CPU, |_| {
        let big = Tensor::zeros([1_000_000], (Kind::Float, CPU));
        drop(big);
        let caught = std::panic::catch_unwind(|| {
            measure(CPU, |_| {
                let _small = Tensor::zeros([10], (Kind::Float, CPU));
                panic!("a bug inside the inner scope");
            })
        });
        assert!(caught.is_err());
    });
    assert_eq!(outer.peak_bytes, 4_000_000);
}

#[test]
#[serial]
fn an_unmeterable_device_is_an_error_never_zero_bytes() {
    let mut ran = false;
    let err = f_measure(Device::Mps, |_| ran = true).unwrap_err();
    assert!(err.to_string().contains("cannot meter Mps"), "{err}");
    assert!(
        !ran,
        "the closure does not run when the device cannot be read"
    );

    let err = f_detect_leak(Device::Mps, 3, |_| -> anyhow::Result<()> { Ok(()) }).unwrap_err();
    assert!(err.to_string().contains("cannot meter Mps"), "{err}");

    // The short names panic with the meter's message instead of reporting "no leak".
    let panic =
        std::panic::catch_unwind(|| detect_leak(Device::Mps, 3, |_| -> Result<(), ()> { Ok(()) }))
            .unwrap_err();
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(message.contains("cannot meter Mps"), "{message}");
    let panic = std::panic::catch_unwind(|| measure(Device::Mps, |_| ())).unwrap_err();
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(message.contains("cannot meter Mps"), "{message}");
}

#[test]
#[serial]
fn a_huge_step_count_allocates_nothing_up_front() {
    let report = detect_leak(CPU, usize::MAX, |i| if i == 2 { Err(i) } else { Ok(()) });
    assert_eq!(report, Err(2));
}

#[test]
#[serial]
fn marks_read_the_device_of_their_scope() {
    let (_, m) = f_measure(CPU, |marks| {
        let start = marks.f_mark("start").unwrap();
        let t = Tensor::zeros([256], (Kind::Float, CPU));
        assert_eq!(marks.f_mark("after t").unwrap(), start + 1024);
        drop(t);
    })
    .unwrap();
    assert_eq!(m.mark("after t"), Some(m.start_bytes + 1024));
}
