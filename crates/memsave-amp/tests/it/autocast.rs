//! Autocast scopes: state restored on exit, the cast cache's lifetime, and the exact
//! bytes the seed network retains for backward under bf16/fp16 autocast. Tests that
//! allocate run serially: the meter's counter is process-wide.
use memsave_amp::{autocast, autocast_state, f_autocast, AutocastGuard, AutocastState};
use memsave_meter::{measure, memory_allocated};
use serial_test::serial;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

fn state(enabled: bool, dtype: Kind) -> AutocastState {
    AutocastState { enabled, dtype }
}

#[test]
#[serial]
fn nested_scopes_restore_exactly_the_previous_state() {
    let outside = autocast_state(CPU).unwrap();
    assert_eq!(
        outside,
        state(false, Kind::BFloat16),
        "libtorch's CPU default"
    );
    {
        let outer = AutocastGuard::new(CPU, Kind::BFloat16).unwrap();
        assert_eq!(outer.previous(), outside);
        assert_eq!(autocast_state(CPU).unwrap(), state(true, Kind::BFloat16));
        {
            let _off = AutocastGuard::disabled(CPU).unwrap();
            assert_eq!(autocast_state(CPU).unwrap(), state(false, Kind::BFloat16));
            let x = Tensor::ones([2, 2], (Kind::Float, CPU));
            assert_eq!(x.matmul(&x).kind(), Kind::Float);
            {
                let _half = AutocastGuard::new(CPU, Kind::Half).unwrap();
                assert_eq!(autocast_state(CPU).unwrap(), state(true, Kind::Half));
                assert_eq!(x.matmul(&x).kind(), Kind::Half);
            }
            assert_eq!(autocast_state(CPU).unwrap(), state(false, Kind::BFloat16));
        }
        assert_eq!(autocast_state(CPU).unwrap(), state(true, Kind::BFloat16));
        let y = autocast(CPU, Kind::Half, || {
            let x = Tensor::ones([2, 2], (Kind::Float, CPU));
            x.matmul(&x)
        });
        assert_eq!(y.kind(), Kind::Half);
        assert_eq!(autocast_state(CPU).unwrap(), state(true, Kind::BFloat16));
    }
    assert_eq!(autocast_state(CPU).unwrap(), outside);
}

#[test]
#[serial]
fn state_is_restored_when_the_scope_panics() {
    let outside = autocast_state(CPU).unwrap();
    let result = std::panic::catch_unwind(|| {
        autocast(CPU, Kind::Half, || panic!("inside autocast"));
    });
    assert!(result.is_err());
    assert_eq!(autocast_state(CPU).unwrap(), outside);
}

#[test]
#[serial]
fn cast_weights_are_cached_until_the_outermost_scope_ends() {
    let h = 16i64;
    let vs = nn::VarStore::new(CPU);
    let layer = nn::linear(vs.root(), h, h, Default::default());
    let x = Tensor::ones([3, h], (Kind::Float, CPU));
    // The bf16 casts of the weight (H*H) and the bias (H), 2 bytes each, stay in the
    // cache while any autocast scope is open.
    let cached = (h * h + h) as u64 * 2;
    let start = memory_allocated(CPU);
    {
        let _outer = AutocastGuard::new(CPU, Kind::BFloat16).unwrap();
        {
            let _inner = AutocastGuard::new(CPU, Kind::BFloat16).unwrap();
            drop(layer.forward(&x));
            assert_eq!(memory_allocated(CPU) - start, cached);
        }
        // Leaving a nested scope keeps the cache; a second forward reuses it.
        assert_eq!(memory_allocated(CPU) - start, cached);
        drop(layer.forward(&x));
        assert_eq!(memory_allocated(CPU) - start, cached);
    }
    assert_eq!(memory_allocated(CPU), start);
}

/// The seed network: `x = x + Linear(H, H)(x)`, `l` times.
fn seed_forward(layers: &[nn::Linear], x: &Tensor) -> Tensor {
    let mut y = x.shallow_clone();
    for layer in layers {
        y = &y + layer.forward(&y);
    }
    y
}

fn retained_after_forward(
    b: i64,
    s: i64,
    h: i64,
    l: i64,
    x_requires_grad: bool,
    kind: Option<Kind>,
) -> i64 {
    let vs = nn::VarStore::new(CPU);
    let layers: Vec<nn::Linear> = (0..l)
        .map(|i| nn::linear(vs.root() / i, h, h, Default::default()))
        .collect();
    let x = Tensor::randn([b, s, h], (Kind::Float, CPU)).set_requires_grad(x_requires_grad);
    let (out, m) = measure(CPU, |_| match kind {
        Some(kind) => f_autocast(CPU, kind, || seed_forward(&layers, &x)).unwrap(),
        None => seed_forward(&layers, &x),
    });
    assert_eq!(
        out.kind(),
        Kind::Float,
        "x + linear(x) promotes back to f32"
    );
    out.sum(Kind::Float).backward();
    m.retained_bytes()
}

#[test]
#[serial]
fn reduced_precision_autocast_shrinks_saved_activations_exactly() {
    let (b, s, h, l) = (2i64, 5, 8, 4);
    let act = b * s * h;
    // f32: each layer saves its f32 input; inputs 1..L and the output are new tensors.
    assert_eq!(retained_after_forward(b, s, h, l, false, None), l * act * 4);
    for kind in [Kind::BFloat16, Kind::Half] {
        // Each layer saves the 2-byte cast of its input for the weight's gradient and,
        // when its input needs a gradient, the 2-byte cast of its weight for it. Layer
        // 0's input x needs none, so only layers 1..L keep a weight cast; the cache
        // holding the rest is cleared when the scope ends. The f32 sums x_1..x_{L-1}
        // are saved by nobody; only the output stays.
        assert_eq!(
            retained_after_forward(b, s, h, l, false, Some(kind)),
            l * act * 2 + act * 4 + (l - 1) * h * h * 2,
            "{kind:?}"
        );
        // With x requiring a gradient, layer 0 keeps its weight cast too.
        assert_eq!(
            retained_after_forward(b, s, h, l, true, Some(kind)),
            l * act * 2 + act * 4 + l * h * h * 2,
            "{kind:?}"
        );
    }
}
