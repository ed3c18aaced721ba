//! Issue #25 ("Real architectures"): `Compress` with its defaults on the zoo's real
//! networks. One training step from the same parameters, batch and random stream,
//! plain and under `Compress::new(codec)` (nothing but the batch excluded, as
//! memsave-step's harness does), on ResNet-18, MobileNetV2, a ViT and a LLaMA-style
//! decoder:
//!
//! - the gradients' relative L2 error over all parameters (`|g_c - g| / |g|`, the
//!   gradients concatenated) is at most 3e-2 for int8 and 1e-2 for bf16;
//! - the bytes retained after the forward are at most 0.4x the plain step's for
//!   int8 (the bound), and at most 0.6x for bf16 (this test's own bound, the
//!   issue gives none: bf16 stores half of what it packs, and what stays as it is,
//!   normalization statistics, max-pool indices, small tensors, the logits, adds
//!   less than a tenth).
//!
//! ResNet-18 and MobileNetV2 run at batches of 4 and 8: at 32 x 32 their last stage
//! is 1 x 1 pixel, so a batch norm there sees 4 or 8 values a channel, and a channel
//! far from zero relative to that spread is where storing its input relative to zero
//! failed (bf16 1.37e-2 on ResNet-18 and 1.12e-2 on MobileNetV2 at batch 4, before
//! Compress centered normalization inputs).
//!
//! "Retained after the forward" is measured by memsave-meter's exact counting CPU
//! allocator: the bytes allocated after the forward and the loss (both kept, so
//! everything autograd saved for backward is alive) minus the bytes allocated before
//! it (`Measurement::retained_bytes`). The model and the batch exist before, so the
//! figure is what the step adds: the saved tensors (or their stored forms), what the
//! policy kept as it was, the logits and the loss. Nothing here is the hooks' own
//! accounting.
//!
//! The thresholds are the issue's, never computed by the code under test; the plain
//! step is the reference.
use memsave_hooks::{saved_tensors_hooks, Codec, Compress, CompressStats};
use memsave_models::{
    Architecture, LlamaConfig, MobileNetV2Config, ResNetConfig, VitConfig, ZooWorkload,
};
use memsave_step::Workload;
use std::sync::Mutex;
use tch::{Device, Kind, Tensor};

/// The meter counts every allocation of the process and the tests seed libtorch's
/// global random stream: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The bounds on the gradients' relative L2 error.
const INT8_MAX_ERROR: f64 = 3e-2;
const BF16_MAX_ERROR: f64 = 1e-2;
/// The bound on int8's retained bytes, as a fraction of the plain step's.
const INT8_MAX_RATIO: f64 = 0.4;
/// This test's bound for bf16 (the issue gives none): bf16 stores 2 bytes of every
/// 4, so half is its floor, plus what stays as it is.
const BF16_MAX_RATIO: f64 = 0.6;

/// One training step's figures.
struct Step {
    /// Bytes allocated after the forward and loss, minus before.
    retained: i64,
    /// Every parameter's gradient, in the store's order.
    grads: Vec<Tensor>,
    stats: Option<CompressStats>,
}

/// One step of `arch` on a batch of `batch`, from seed 0 (parameters, batch) and seed
/// 1 (the forward's draws: dropout), plain or under `Compress::new(codec)`.
fn step(arch: &Architecture, batch: i64, codec: Option<Codec>) -> Step {
    tch::manual_seed(0);
    let model = ZooWorkload::new("m", arch, batch, Device::Cpu).unwrap();
    let data = model.batch(batch).unwrap();
    draw_zero_weights(&model);
    let mut held = vec![data.input.shallow_clone()];
    held.extend(data.target.as_ref().map(Tensor::shallow_clone));
    let hooks = codec.map(|c| Compress::new(c).excluding(&held));
    let forward = || {
        let logits = model.layers().f_forward_t(&data.input, true).unwrap();
        model.loss(&logits, data.target.as_ref()).unwrap()
    };
    tch::manual_seed(1);
    let (loss, m) = memsave_meter::measure(Device::Cpu, |_| match &hooks {
        Some(h) => saved_tensors_hooks(h.clone(), forward).unwrap(),
        None => forward(),
    });
    loss.backward();
    let grads = model
        .parameters()
        .iter()
        .map(|p| {
            let g = p.grad();
            assert!(g.defined(), "a parameter got no gradient");
            g.copy()
        })
        .collect();
    Step {
        retained: m.retained_bytes(),
        grads,
        stats: hooks.map(|h| h.stats()),
    }
}

/// Draws every weight (a parameter of two or more dimensions) that starts all zero
/// from N(0, 0.02²), from seed 2. torchvision's ViT starts its head at zero, which
/// makes every gradient but the head's zero on the first step: the step would
/// compare nothing the codec touches. (After some training the head is not zero.)
fn draw_zero_weights(model: &ZooWorkload) {
    tch::manual_seed(2);
    tch::no_grad(|| {
        for mut p in model.parameters() {
            if p.dim() >= 2 && p.count_nonzero(None::<i64>).int64_value(&[]) == 0 {
                let drawn = p.randn_like() * 0.02;
                p.copy_(&drawn);
            }
        }
    });
}

/// `|approx - exact| / |exact|` over all gradients together, in f64.
fn relative_l2(exact: &[Tensor], approx: &[Tensor]) -> f64 {
    assert_eq!(exact.len(), approx.len());
    let sq = |t: &Tensor| t.square().sum(Kind::Double).double_value(&[]);
    let num: f64 = exact.iter().zip(approx).map(|(a, b)| sq(&(a - b))).sum();
    let den: f64 = exact.iter().map(sq).sum();
    assert!(den > 0.0, "the plain step's gradients are all zero");
    (num / den).sqrt()
}

/// Runs the three steps at each batch size and checks the bounds for both codecs.
fn check(model: &str, arch: &Architecture, batches: &[i64]) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    memsave_meter::install();
    let mut failures = Vec::new();
    for &batch in batches {
        let name = format!("{model} at batch {batch}");
        failures.extend(check_batch(&name, arch, batch));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What misses a bound at one batch size.
fn check_batch(name: &str, arch: &Architecture, batch: i64) -> Vec<String> {
    let plain = step(arch, batch, None);
    assert!(plain.retained > 0);
    // Every weight takes part: a zero gradient would compare nothing.
    let weights = plain.grads.iter().filter(|g| g.dim() >= 2);
    for (i, g) in weights.enumerate() {
        let nonzero = g.count_nonzero(None::<i64>).int64_value(&[]);
        assert!(nonzero > 0, "{name}: weight {i}'s plain gradient is zero");
    }
    let mut failures = Vec::new();
    for (codec, max_error, max_ratio) in [
        (Codec::int8(), INT8_MAX_ERROR, INT8_MAX_RATIO),
        (Codec::Bf16, BF16_MAX_ERROR, BF16_MAX_RATIO),
    ] {
        let packed = step(arch, batch, Some(codec));
        let error = relative_l2(&plain.grads, &packed.grads);
        let ratio = packed.retained as f64 / plain.retained as f64;
        println!(
            "{name} {}: relative L2 {error:.3e}, retained {} of {} bytes ({ratio:.3}x); {:?}",
            codec.name(),
            packed.retained,
            plain.retained,
            packed.stats
        );
        let stats = packed.stats.unwrap_or_default();
        assert!(
            stats.tensors > 0,
            "{name} {}: nothing compressed",
            codec.name()
        );
        if error > max_error {
            failures.push(format!(
                "{name} {}: gradient relative L2 {error:.3e} > {max_error:e}",
                codec.name()
            ));
        }
        if ratio > max_ratio {
            failures.push(format!(
                "{name} {}: retained {} of the plain step's {} bytes ({ratio:.3}x > {max_ratio}x)",
                codec.name(),
                packed.retained,
                plain.retained
            ));
        }
    }
    failures
}

#[test]
#[serial_test::serial]
fn resnet18_compress_defaults_keep_gradients_close_and_memory_small() {
    // CIFAR-100's images and classes.
    let arch = Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 100,
        image: [3, 32, 32],
    });
    check("resnet18", &arch, &[4, 8]);
}

#[test]
#[serial_test::serial]
fn mobilenet_v2_compress_defaults_keep_gradients_close_and_memory_small() {
    // CIFAR-100's images and classes.
    let arch = Architecture::MobileNetV2(MobileNetV2Config {
        classes: 100,
        image: [3, 32, 32],
    });
    check("mobilenet_v2", &arch, &[4, 8]);
}

#[test]
#[serial_test::serial]
fn vit_compress_defaults_keep_gradients_close_and_memory_small() {
    let arch = Architecture::Vit(VitConfig {
        image: [3, 32, 32],
        patch: 4,
        dim: 64,
        layers: 2,
        heads: 4,
        mlp: 256,
        classes: 10,
    });
    check("vit", &arch, &[8]);
}

#[test]
#[serial_test::serial]
fn llama_compress_defaults_keep_gradients_close_and_memory_small() {
    let arch = Architecture::Llama(LlamaConfig {
        vocab: 512,
        dim: 128,
        layers: 2,
        heads: 4,
        kv_heads: 4,
        hidden: None,
        seq: 32,
        ..LlamaConfig::default()
    });
    check("llama", &arch, &[8]);
}
