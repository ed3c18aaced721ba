//! Codecs: error bounds across shapes and dtypes, pass-through rules, exact memory.
use memsave_hooks::{saved_tensors_hooks, Codec, Compress};
use memsave_meter::f_memory_allocated;
use proptest::prelude::*;
use serial_test::serial;
use std::num::NonZeroUsize;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap()
}

/// Unit roundoff of the dtype the restored tensor is rounded to.
fn roundoff(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 2f64.powi(-8),
        Kind::Half => 2f64.powi(-11),
        Kind::Float => 2f64.powi(-23),
        _ => 2f64.powi(-52),
    }
}

/// The documented bound of `codec` for every element of `x`, plus the restored
/// dtype's own rounding of the result.
fn bounds(codec: Codec, x: &[f64], kind: Kind) -> Vec<f64> {
    let block_max = |block: usize| -> Vec<f64> {
        x.chunks(block)
            .flat_map(|c| {
                let m = c.iter().fold(0f64, |m, v| m.max(v.abs()));
                std::iter::repeat_n(m, c.len())
            })
            .collect()
    };
    let f32_slack = |v: f64| 4.0 * 2f64.powi(-24) * v;
    let codec_bound: Vec<f64> = match codec {
        Codec::Bf16 => x.iter().map(|v| 2f64.powi(-8) * v.abs()).collect(),
        Codec::Fp16 => x
            .iter()
            .map(|v| 2f64.powi(-11) * v.abs() + 2f64.powi(-25))
            .collect(),
        Codec::Fp8E4m3 { block } => x
            .iter()
            .zip(block_max(block.get()))
            .map(|(v, m)| 2f64.powi(-4) * v.abs() + 2f64.powi(-10) * m / 448.0 + f32_slack(m))
            .collect(),
        Codec::Int8 {
            block,
            stochastic_rounding,
        } => block_max(block.get())
            .into_iter()
            .zip(x)
            .map(|(m, v)| {
                // Rounded to nearest, a nonzero value below half a step keeps its sign:
                // one step.
                let tiny = v.abs() > 0.0 && v.abs() < m / 254.0;
                let step = if stochastic_rounding || tiny {
                    m / 127.0
                } else {
                    m / 254.0
                };
                step + f32_slack(m)
            })
            .collect(),
    };
    codec_bound
        .iter()
        .zip(x)
        .map(|(b, v)| b + roundoff(kind) * (v.abs() + b))
        .collect()
}

fn codec_strategy() -> impl Strategy<Value = Codec> {
    (0usize..4, 1usize..300, any::<bool>()).prop_map(|(i, block, stochastic)| {
        let block = NonZeroUsize::new(block).unwrap();
        match i {
            0 => Codec::Bf16,
            1 => Codec::Fp16,
            2 => Codec::Fp8E4m3 { block },
            _ => Codec::Int8 {
                block,
                stochastic_rounding: stochastic,
            },
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    #[serial]
    fn every_codec_restores_dtype_and_shape_within_its_stated_bound(
        codec in codec_strategy(),
        shape in prop::collection::vec(1i64..9, 1..4),
        kind in prop::sample::select(vec![Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half]),
        scale in prop::sample::select(vec![1e-3, 1.0, 100.0]),
        seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let x = (Tensor::randn(&shape, (Kind::Float, Device::Cpu)) * scale).to_kind(kind);
        let Some(encoded) = codec.f_encode(&x).unwrap() else {
            // Only a codec that would not shrink the tensor passes it through here.
            prop_assert!(matches!(codec, Codec::Bf16 | Codec::Fp16));
            prop_assert!(matches!(kind, Kind::BFloat16 | Kind::Half));
            return Ok(());
        };
        let restored = encoded.f_decode().unwrap();
        prop_assert_eq!(restored.kind(), kind);
        prop_assert_eq!(restored.size(), shape);
        let (a, b) = (values(&x), values(&restored));
        for ((v, r), bound) in a.iter().zip(&b).zip(bounds(codec, &a, kind)) {
            prop_assert!((v - r).abs() <= bound, "{codec:?} {kind:?}: {v} restored as {r}, bound {bound}");
        }
    }
}

#[test]
#[serial_test::parallel]
fn non_floating_tensors_and_out_of_range_values_pass_through() {
    let ints = Tensor::arange(10, (Kind::Int64, Device::Cpu));
    let mask = ints.gt(4);
    for codec in [Codec::Bf16, Codec::Fp16, Codec::fp8(), Codec::int8()] {
        assert!(codec.f_encode(&ints).unwrap().is_none(), "{codec:?}");
        assert!(codec.f_encode(&mask).unwrap().is_none(), "{codec:?}");
    }
    let big = Tensor::from_slice(&[1.0f32, 70000.0]);
    assert!(Codec::Fp16.f_encode(&big).unwrap().is_none());
    assert!(Codec::Bf16.f_encode(&big).unwrap().is_some());
    let inf = Tensor::from_slice(&[1.0f32, f32::INFINITY]);
    assert!(Codec::int8().f_encode(&inf).unwrap().is_none());
    assert!(Codec::fp8().f_encode(&inf).unwrap().is_none());
}

#[test]
#[serial_test::parallel]
fn int8_stores_one_byte_per_value_and_one_f32_scale_per_block() {
    let x = Tensor::randn([10, 100], (Kind::Float, Device::Cpu));
    let codec = Codec::Int8 {
        block: NonZeroUsize::new(64).unwrap(),
        stochastic_rounding: false,
    };
    let e = codec.f_encode(&x).unwrap().unwrap();
    // 1,000 values in 16 blocks of 64 (the last one padded).
    assert_eq!(e.stored_bytes(), 16 * 64 + 16 * 4);
    assert_eq!(e.original_bytes(), 4000);
}

#[test]
#[serial]
fn stochastic_rounding_is_unbiased_where_nearest_is_not() {
    // 1.3 steps: nearest always rounds down, stochastic on average not.
    let m = 127.0f32;
    let x = Tensor::from_slice(&[m, 1.3]).repeat([20000]);
    let mean_restored = |stochastic: bool| {
        let codec = Codec::Int8 {
            block: NonZeroUsize::new(2).unwrap(),
            stochastic_rounding: stochastic,
        };
        let r = codec.f_encode(&x).unwrap().unwrap().f_decode().unwrap();
        r.reshape([-1, 2])
            .select(1, 1)
            .mean(Kind::Double)
            .double_value(&[])
    };
    tch::manual_seed(0);
    assert_eq!(mean_restored(false), 1.0);
    assert!((mean_restored(true) - 1.3).abs() < 0.02);
}

/// Ten layers of `h = h + Linear(64, 64)(h)` on `[8, 64]`: each layer saves its input.
fn chain(vs: &nn::VarStore) -> Vec<nn::Linear> {
    (0..10)
        .map(|i| nn::linear(vs.root() / i, 64, 64, Default::default()))
        .collect()
}

fn forward(layers: &[nn::Linear], x: &Tensor) -> Tensor {
    layers
        .iter()
        .fold(x.shallow_clone(), |h, l| &h + l.forward(&h))
}

#[test]
#[serial]
fn compressed_forward_retains_its_output_plus_exactly_the_stored_bytes_and_frees_them_in_backward()
{
    let vs = nn::VarStore::new(Device::Cpu);
    let layers = chain(&vs);
    let x = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
    for codec in [Codec::Bf16, Codec::Fp16, Codec::fp8(), Codec::int8()] {
        let start = f_memory_allocated(Device::Cpu).unwrap();
        // [8, 64] f32 is 2 KiB: under the default threshold.
        let hooks = Compress::new(codec)
            .min_bytes(0)
            .excluding(&[x.shallow_clone()]);
        let y = saved_tensors_hooks(hooks.clone(), || forward(&layers, &x)).unwrap();
        let stats = hooks.stats();
        // Nine layer inputs compressed; x and nine weights (as `t()` views) passed
        // through: layer 0's input does not require grad, so it does not save its weight.
        assert_eq!(stats.tensors, 9, "{codec:?}");
        assert_eq!(stats.passed_through, 10, "{codec:?}");
        assert_eq!(stats.original_bytes, 9 * 8 * 64 * 4);
        let retained = f_memory_allocated(Device::Cpu).unwrap() - start;
        assert_eq!(retained, 8 * 64 * 4 + stats.stored_bytes, "{codec:?}");
        y.sum(Kind::Float).backward();
        drop(y);
        for p in vs.trainable_variables() {
            memsave_sys::tensor::set_grad_none(&p).unwrap();
        }
        assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start, "{codec:?}");
    }
}

#[test]
#[serial_test::parallel]
fn int8_gradients_are_close_to_exact_ones() {
    let vs = nn::VarStore::new(Device::Cpu);
    let layers = chain(&vs);
    let x = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
    let grads = |hooks: Option<Compress>| -> Vec<Tensor> {
        for p in vs.trainable_variables() {
            let _ = memsave_sys::tensor::set_grad_none(&p);
        }
        let y = match hooks {
            Some(h) => saved_tensors_hooks(h, || forward(&layers, &x)).unwrap(),
            None => forward(&layers, &x),
        };
        y.square().mean(Kind::Float).backward();
        vs.trainable_variables()
            .iter()
            .map(|p| p.grad().copy())
            .collect()
    };
    let exact = grads(None);
    let int8 = grads(Some(Compress::new(Codec::int8()).min_bytes(0)));
    let num: f64 = exact
        .iter()
        .zip(&int8)
        .map(|(a, b)| (a - b).square().sum(Kind::Double).double_value(&[]))
        .sum();
    let den: f64 = exact
        .iter()
        .map(|a| a.square().sum(Kind::Double).double_value(&[]))
        .sum();
    let rel_l2 = (num / den).sqrt();
    assert!(rel_l2 > 0.0 && rel_l2 < 3e-2, "relative L2 error {rel_l2}");
}

/// A ReLU saves its output and the matmul after it saves the same tensor as its
/// input: stored once, shared by both packs. A tensor of the same shape in a fresh
/// storage is stored anew. The gradients equal those of storing each save on its own
/// (a copy before the matmul makes the two saves two tensors).
#[test]
#[serial]
fn a_tensor_saved_by_two_nodes_is_stored_once() {
    memsave_meter::install();
    let run = |copy: bool| {
        tch::manual_seed(3);
        let w = Tensor::randn([128, 128], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([32, 128], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let int8 = Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
        let loss = saved_tensors_hooks(int8.clone(), || {
            let r = x.relu();
            let r = if copy { r.copy() } else { r };
            // A second ReLU output of the same shape: its own storage.
            let r2 = r.matmul(&w).relu();
            r2.matmul(&w).sum(Kind::Float)
        })
        .unwrap();
        let stats = int8.stats();
        loss.backward();
        (stats, x.grad(), w.grad())
    };
    let (shared, xg, wg) = run(false);
    assert_eq!((shared.tensors, shared.shared), (2, 2), "{shared:?}");
    assert_eq!(shared.original_bytes, 2 * 32 * 128 * 4);
    assert_eq!(shared.stored_bytes, 2 * (32 * 128 + 4 * 4));
    let (apart, xg_apart, wg_apart) = run(true);
    assert_eq!((apart.tensors, apart.shared), (3, 1), "{apart:?}");
    assert!(xg.equal(&xg_apart));
    assert!(wg.equal(&wg_apart));
}

/// A saved tensor expanded from a smaller one (stride 0) is stored as the smaller one:
/// the forward holds its output plus the codec's form of the base alone (where the
/// plain forward holds the base), and the gradients are those of the base restored by
/// the codec, expanded. Several shapes.
#[test]
#[serial]
fn an_expanded_saved_tensor_is_stored_as_its_base() {
    memsave_meter::install();
    let cases: [(&[i64], &[i64]); 4] = [
        (&[1, 1024], &[256, 1024]),
        (&[1, 300], &[64, 300]),
        (&[3, 1, 5], &[3, 7, 5]),
        (&[1, 1], &[9, 13]),
    ];
    for (base_shape, shape) in cases {
        let base = Tensor::randn(base_shape, (Kind::Float, Device::Cpu));
        let w = Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        // mul saves the expanded base, for w's gradient (and not w: the base does not
        // require grad). A copy the forward makes: `base` itself, saved again by the
        // next step, would be a constant (alive anyway) and kept as it is.
        let step = |hooks: Option<&Compress>| {
            let f = || (base.copy().expand(shape, false) * &w).sum(Kind::Float);
            let start = f_memory_allocated(Device::Cpu).unwrap();
            let loss = match hooks {
                Some(h) => saved_tensors_hooks(h.clone(), f).unwrap(),
                None => f(),
            };
            let held = f_memory_allocated(Device::Cpu).unwrap() - start;
            loss.backward();
            drop(loss);
            let grad = w.grad().copy();
            memsave_sys::tensor::set_grad_none(&w).unwrap();
            // Nothing left but the copy of the gradient.
            let left = f_memory_allocated(Device::Cpu).unwrap() - start;
            assert_eq!(left, grad.numel() as u64 * 4);
            (held, grad)
        };
        let (plain_held, plain) = step(None);
        let n = base.numel() as u64;
        assert_eq!(
            plain_held,
            4 + 4 * n,
            "{shape:?}: the loss and the base's copy"
        );
        let m = base.abs().max().double_value(&[]);
        for codec in [Codec::Bf16, Codec::Fp16, Codec::fp8(), Codec::int8()] {
            // The smaller bases are under the default threshold.
            let hooks = Compress::new(codec).min_bytes(0);
            let (held, grad) = step(Some(&hooks));
            let stored = match codec {
                Codec::Bf16 | Codec::Fp16 => 2 * n,
                // One byte per value of whole (zero-padded) blocks, an f32 scale each.
                _ => n.div_ceil(1024) * (1024 + 4),
            };
            let stats = hooks.stats();
            assert_eq!(
                (stats.tensors, stats.passed_through),
                (1, 0),
                "{codec:?} {shape:?}"
            );
            assert_eq!(stats.original_bytes, 4 * n, "{codec:?} {shape:?}");
            assert_eq!(stats.stored_bytes, stored, "{codec:?} {shape:?}");
            assert_eq!(held, 4 + stored, "{codec:?} {shape:?}");
            assert_eq!(grad.size(), plain.size());
            match codec {
                Codec::Bf16 | Codec::Fp16 => {
                    let kind = if codec == Codec::Bf16 {
                        Kind::BFloat16
                    } else {
                        Kind::Half
                    };
                    let restored = base.to_kind(kind).to_kind(Kind::Float).expand(shape, false);
                    assert!(grad.equal(&restored), "{codec:?} {shape:?}");
                }
                _ => {
                    // fp8: |x - x'| <= 2^-4 |x| + 2^-10 m / 448; int8: m / 254.
                    let err = (&grad - &plain).abs().max().double_value(&[]);
                    assert!(err <= m / 15.0, "{codec:?} {shape:?}: {err} of {m}");
                }
            }
        }
    }
}

/// Int8 rounding to nearest never stores a nonzero value as zero: 0.3 and -0.49 of a
/// step become one step of their sign, zeros stay zero, the rest round to nearest.
#[test]
#[serial_test::parallel]
fn int8_keeps_the_sign_of_values_below_half_a_step() {
    let x = Tensor::from_slice(&[127.0f32, 0.3, -0.49, 0.0, 0.5, -1.4, 2.6]);
    let r = Codec::int8()
        .f_encode(&x)
        .unwrap()
        .unwrap()
        .f_decode()
        .unwrap();
    assert_eq!(
        values(&r),
        vec![127.0, 1.0, -1.0, 0.0, 1.0, -1.0, 3.0],
        "restored {r:?}"
    );
}
