//! The micro-batch search under a simulated CPU budget, checked against a linear scan
//! of measured peaks. Serial: the meter's counter and limit are process-wide.
use memsave_accum::{fit_micro_batch, AccumError};
use memsave_meter::{f_set_memory_limit, measure, memory_allocated, memory_limit};
use serial_test::serial;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;
const MAX: i64 = 24;

struct Seed {
    vs: nn::VarStore,
    layers: Vec<nn::Linear>,
    data: Tensor,
}

impl Seed {
    fn new() -> Self {
        Self::on(CPU)
    }

    fn on(device: Device) -> Self {
        let vs = nn::VarStore::new(device);
        let h = 16;
        let layers = (0..3)
            .map(|i| nn::linear(vs.root() / i, h, h, Default::default()))
            .collect();
        let data = Tensor::randn([MAX, 4, h], (Kind::Float, device));
        Self { vs, layers, data }
    }

    /// The forward with tch's fallible functions, so the simulated limit surfaces as Err.
    fn loss(&self, n: i64) -> Result<Tensor, tch::TchError> {
        let mut y = self.data.f_narrow(0, 0, n)?;
        for layer in &self.layers {
            y = y.f_add(&y.f_linear(&layer.ws, layer.bs.as_ref())?)?;
        }
        y.f_mean(Kind::Float)
    }

    /// The forward with tch's panicking shortcuts.
    fn loss_panicking(&self, n: i64) -> Tensor {
        let mut y = self.data.narrow(0, 0, n);
        for layer in &self.layers {
            y = &y + layer.forward(&y);
        }
        y.mean(Kind::Float)
    }

    /// The oracle: the peak of forward + backward for `n` samples, measured without a
    /// limit, gradients freed before and after.
    fn peak(&self, n: i64) -> u64 {
        let params = self.vs.trainable_variables();
        memsave_accum::free_grads(&params).unwrap();
        let (_, m) = measure(self.vs.device(), |_| self.loss(n).unwrap().backward());
        memsave_accum::free_grads(&params).unwrap();
        m.peak_bytes
    }
}

#[test]
#[serial]
fn finds_the_largest_micro_batch_a_linear_scan_finds() {
    let seed = Seed::new();
    let peaks: Vec<u64> = (1..=MAX).map(|n| seed.peak(n)).collect();
    assert!(peaks.windows(2).all(|w| w[0] < w[1]), "{peaks:?}");
    for expected in [1i64, 5, 6, 13, MAX] {
        // A budget between the peaks of `expected` and `expected + 1` samples.
        let budget = match peaks.get(expected as usize) {
            Some(next) => (peaks[expected as usize - 1] + next) / 2,
            None => peaks[MAX as usize - 1] + 1_000_000,
        };
        let params = seed.vs.trainable_variables();
        let report = fit_micro_batch(budget, MAX, &params, |n| seed.loss(n)).unwrap();
        assert_eq!(report.micro_batch, expected, "{report}");
        assert_eq!(memory_limit(CPU), None, "the limit is removed");
        assert!(params.iter().all(|p| !p.grad().defined()));
        let fits = |n: i64| {
            report
                .trials
                .iter()
                .find(|t| t.micro_batch == n)
                .map(|t| t.fits)
        };
        assert_eq!(fits(expected), Some(true), "{report}");
        if expected < MAX {
            assert_eq!(fits(expected + 1), Some(false), "{report}");
        }
        for t in report.trials.iter().filter(|t| t.fits) {
            assert_eq!(t.peak_bytes, peaks[t.micro_batch as usize - 1], "{report}");
        }
        // Doubling, then bisecting: a logarithmic number of trials.
        assert!(report.trials.len() <= 2 * 5 + 1, "{report}");
    }
}

#[test]
#[serial]
fn panicking_forwards_that_hit_the_limit_count_as_too_big() {
    let seed = Seed::new();
    let budget = (seed.peak(7) + seed.peak(8)) / 2;
    let params = seed.vs.trainable_variables();
    let report = fit_micro_batch(budget, MAX, &params, |n| {
        Ok::<_, tch::TchError>(seed.loss_panicking(n))
    })
    .unwrap();
    assert_eq!(report.micro_batch, 7, "{report}");
    assert_eq!(memory_limit(CPU), None);
}

/// An allocation the system refuses (libtorch's CPU allocator says "not enough memory",
/// not "out of memory") counts as "does not fit" too: returned, under a context that
/// hides it from the error's own text, or panicked.
#[test]
#[serial]
fn allocations_the_system_refuses_count_as_too_big() {
    const REFUSED: &str =
        "DefaultCPUAllocator: not enough memory: you tried to allocate 1048576 bytes.";
    let seed = Seed::new();
    let params = seed.vs.trainable_variables();
    let report = fit_micro_batch(1 << 30, MAX, &params, |n| {
        if n > 5 {
            return Err(anyhow::anyhow!(REFUSED).context("the forward of layer 2"));
        }
        Ok(seed.loss(n)?)
    })
    .unwrap();
    assert_eq!(report.micro_batch, 5, "{report}");
    assert_eq!(memory_limit(CPU), None);

    let report = fit_micro_batch(1 << 30, MAX, &params, |n| {
        if n > 5 {
            panic!("{REFUSED}");
        }
        Ok::<_, tch::TchError>(seed.loss_panicking(n))
    })
    .unwrap();
    assert_eq!(report.micro_batch, 5, "{report}");
    assert_eq!(memory_limit(CPU), None);
}

#[test]
#[serial]
fn errors_and_panics_remove_the_limit_too() {
    let seed = Seed::new();
    let params = seed.vs.trainable_variables();

    let err = fit_micro_batch(16, MAX, &params, |n| seed.loss(n)).unwrap_err();
    assert!(
        matches!(
            err,
            AccumError::BudgetTooSmall {
                budget_bytes: 16,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("even a micro-batch of 1 sample"),
        "{err}"
    );
    assert_eq!(memory_limit(CPU), None);

    let err = fit_micro_batch(1 << 30, 0, &params, |n| seed.loss(n)).unwrap_err();
    assert!(matches!(err, AccumError::ZeroMicroBatchSize(0)), "{err}");

    let err = fit_micro_batch(1 << 30, MAX, &params, |n| {
        if n > 3 {
            return Err(anyhow::anyhow!("corrupt sample"));
        }
        Ok(seed.loss(n)?)
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "trial with a micro-batch of 4 samples failed: corrupt sample"
    );
    assert_eq!(memory_limit(CPU), None);

    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        fit_micro_batch(
            1 << 30,
            MAX,
            &params,
            |_| -> Result<Tensor, tch::TchError> { panic!("bug in the forward") },
        )
    }));
    assert!(panicked.is_err());
    assert_eq!(memory_limit(CPU), None);
}

/// Removes the memory limit when dropped, so a failing assertion cannot leave it set.
struct LimitGuard;
impl Drop for LimitGuard {
    fn drop(&mut self) {
        f_set_memory_limit(CPU, None).unwrap();
    }
}

#[test]
#[serial]
fn a_tighter_limit_already_set_is_honoured_and_restored() {
    let seed = Seed::new();
    let params = seed.vs.trainable_variables();
    let (p5, p6) = (seed.peak(5), seed.peak(6));
    let _guard = LimitGuard;
    let user_limit = memory_allocated(CPU) + (p5 + p6) / 2;
    f_set_memory_limit(CPU, Some(user_limit)).unwrap();

    let report = fit_micro_batch(10_000_000, MAX, &params, |n| seed.loss(n)).unwrap();
    assert_eq!(report.micro_batch, 5, "{report}");
    assert_eq!(
        report.budget_bytes,
        (p5 + p6) / 2,
        "the limit's room is the budget"
    );
    assert_eq!(
        memory_limit(CPU),
        Some(user_limit),
        "the user's limit is back"
    );

    // A budget tighter than the limit still wins, and the limit is back after it too.
    let budget = (seed.peak(2) + seed.peak(3)) / 2;
    let report = fit_micro_batch(budget, MAX, &params, |n| seed.loss(n)).unwrap();
    assert_eq!(report.micro_batch, 2, "{report}");
    assert_eq!(report.budget_bytes, budget);
    assert_eq!(memory_limit(CPU), Some(user_limit));
}

#[test]
#[serial]
#[ignore = "needs CUDA"]
fn parameters_on_two_devices_are_refused() {
    let seed = Seed::new();
    let mut params = seed.vs.trainable_variables();
    params.push(Tensor::zeros([1], (Kind::Float, Device::Cuda(0))).set_requires_grad(true));
    let err = fit_micro_batch(1 << 30, MAX, &params, |n| seed.loss(n));
    match err {
        Err(e @ AccumError::MixedDevices { .. }) => {
            assert!(
                e.to_string().contains("move the model to one device"),
                "{e}"
            )
        }
        other => panic!("expected MixedDevices, got {other:?}"),
    }
}

/// The CUDA path: no simulated limit, each trial's measured peak against the budget.
#[test]
#[serial]
#[ignore = "needs CUDA"]
fn on_cuda_finds_the_largest_micro_batch_a_linear_scan_finds() {
    let seed = Seed::on(Device::Cuda(0));
    // The first run creates lasting state (cuBLAS's workspace), counted before `start`.
    seed.peak(MAX);
    let peaks: Vec<u64> = (1..=MAX).map(|n| seed.peak(n)).collect();
    assert!(peaks.windows(2).all(|w| w[0] <= w[1]), "{peaks:?}");
    let params = seed.vs.trainable_variables();
    // The caching allocator rounds to 512 bytes, so neighbouring sizes may tie: check
    // the sizes whose successor needs more.
    let checked: Vec<i64> = (1..MAX)
        .filter(|&n| peaks[n as usize] > peaks[n as usize - 1])
        .take(4)
        .collect();
    assert!(!checked.is_empty(), "{peaks:?}");
    for expected in checked {
        let budget = (peaks[expected as usize - 1] + peaks[expected as usize]) / 2;
        let report = fit_micro_batch(budget, MAX, &params, |n| seed.loss(n)).unwrap();
        assert_eq!(report.micro_batch, expected, "{report}");
        assert_eq!(report.budget_bytes, budget);
        assert!(params.iter().all(|p| !p.grad().defined()));
        for t in report.trials.iter().filter(|t| t.fits) {
            assert_eq!(t.peak_bytes, peaks[t.micro_batch as usize - 1], "{report}");
        }
    }
}
