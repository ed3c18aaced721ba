//! Normalization inputs far from zero (issue #25, "Real architectures"): a channel (or
//! row) whose mean is many times its spread is what batch norm sees in small batches
//! and deep layers (ResNet-18's last stage on 32 x 32 images is 1 x 1 pixel, so a
//! channel's statistics come from a handful of values). Backward uses such an input
//! only through `x - mean`; stored relative to zero, bf16's and int8's error is a
//! fraction of `|x|`, many times the spread backward divides by. Compress's defaults
//! keep the gradients within the bounds (int8 3e-2, bf16 1e-2, relative L2)
//! whatever the offset.
use memsave_hooks::{saved_tensors_hooks, Codec, Compress};
use proptest::prelude::*;
use serial_test::serial;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

/// The bounds on the gradients' relative L2 error.
const INT8_MAX_ERROR: f64 = 3e-2;
const BF16_MAX_ERROR: f64 = 1e-2;

/// A stack of normalized layers whose inputs have means `shift` times their spread.
struct Stack {
    vs: nn::VarStore,
    layers: Vec<(Box<dyn Module>, Box<dyn ModuleT>)>,
    input: Tensor,
}

/// `depth` blocks of 3x3 conv + BatchNorm2d (training) + ReLU on `[batch, 3, image,
/// image]`, each conv's bias drawn from N(0, shift²): with tch's initialization a
/// conv's output spreads by about 0.5, so its channels' means are about `2 * shift`
/// spreads away from zero.
fn conv_stack(depth: usize, channels: i64, image: i64, batch: i64, shift: f64) -> Stack {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut layers: Vec<(Box<dyn Module>, Box<dyn ModuleT>)> = Vec::new();
    for i in 0..depth {
        let c_in = if i == 0 { 3 } else { channels };
        let cfg = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        let conv = nn::conv2d(vs.root() / format!("conv{i}"), c_in, channels, 3, cfg);
        tch::no_grad(|| {
            if let Some(b) = &conv.bs {
                let mut b = b.shallow_clone();
                b.copy_(&(Tensor::randn([channels], (Kind::Float, Device::Cpu)) * shift));
            }
        });
        let bn = nn::batch_norm2d(vs.root() / format!("bn{i}"), channels, Default::default());
        layers.push((Box::new(conv), Box::new(bn)));
    }
    let input = Tensor::randn([batch, 3, image, image], (Kind::Float, Device::Cpu));
    Stack { vs, layers, input }
}

/// `depth` blocks of linear + LayerNorm + GELU on `[batch, tokens, width]`, each
/// linear's output shifted by a constant per row drawn from N(0, shift²) (a residual
/// stream whose rows sit far from zero).
fn linear_stack(depth: usize, width: i64, tokens: i64, batch: i64, shift: f64) -> Stack {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut layers: Vec<(Box<dyn Module>, Box<dyn ModuleT>)> = Vec::new();
    for i in 0..depth {
        let linear = nn::linear(
            vs.root() / format!("fc{i}"),
            width,
            width,
            Default::default(),
        );
        let rows = Tensor::randn([batch, tokens, 1], (Kind::Float, Device::Cpu)) * shift;
        let shifted = nn::func(move |x| linear.forward(x) + &rows);
        let ln = nn::layer_norm(
            vs.root() / format!("ln{i}"),
            vec![width],
            Default::default(),
        );
        layers.push((Box::new(shifted), Box::new(ln)));
    }
    let input = Tensor::randn([batch, tokens, width], (Kind::Float, Device::Cpu));
    Stack { vs, layers, input }
}

impl Stack {
    fn loss(&self) -> Tensor {
        let mut h = self.input.shallow_clone();
        for (layer, norm) in &self.layers {
            h = norm.forward_t(&layer.forward(&h), true);
            h = if h.dim() == 4 {
                h.relu()
            } else {
                h.gelu("none")
            };
        }
        // A loss whose gradient differs per element.
        let target = Tensor::ones_like(&h).cumsum(-1, Kind::Float).sin();
        (&h * target).sum(Kind::Float) / h.size()[0]
    }

    /// The gradients of one step, under `hooks` or plain.
    fn grads(&self, hooks: Option<Compress>) -> Vec<Tensor> {
        let params = self.vs.trainable_variables();
        let loss = match hooks {
            Some(h) => saved_tensors_hooks(h, || self.loss()).unwrap(),
            None => self.loss(),
        };
        Tensor::run_backward(&[loss], &params, false, false)
    }

    /// Relative L2 error of int8's and bf16's gradients under Compress's defaults.
    fn errors(&self) -> (f64, f64) {
        let exact = self.grads(None);
        let error = |codec| {
            let hooks = Compress::new(codec).excluding(&[self.input.shallow_clone()]);
            let grads = self.grads(Some(hooks.clone()));
            assert!(hooks.stats().tensors > 0, "nothing compressed");
            relative_l2(&exact, &grads)
        };
        (error(Codec::int8()), error(Codec::Bf16))
    }
}

/// `|approx - exact| / |exact|` over all gradients together.
fn relative_l2(exact: &[Tensor], approx: &[Tensor]) -> f64 {
    let sq = |t: &Tensor| t.square().sum(Kind::Double).double_value(&[]);
    let num: f64 = exact.iter().zip(approx).map(|(a, b)| sq(&(a - b))).sum();
    let den: f64 = exact.iter().map(sq).sum();
    (num / den).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Batch norm over few values per channel (32 to 512), channels' means up to ~200
    /// spreads from zero. (Sizes keep every activation at 4 KiB or more, so that
    /// Compress packs them.)
    #[test]
    #[serial]
    fn batch_norm_inputs_far_from_zero_keep_gradients_close(
        depth in 1usize..=3,
        channels in 32i64..=64,
        image in 4i64..=8,
        batch in 2i64..=8,
        shift in prop::sample::select(vec![0.0, 10.0, 100.0]),
        seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let net = conv_stack(depth, channels, image, batch, shift);
        let (int8, bf16) = net.errors();
        let at = format!("depth {depth}, {channels} channels, {image}px, batch {batch}, shift {shift}");
        prop_assert!(int8 <= INT8_MAX_ERROR, "int8: relative L2 {int8:.3e} ({at})");
        prop_assert!(bf16 <= BF16_MAX_ERROR, "bf16: relative L2 {bf16:.3e} ({at})");
    }

    /// Layer norm over rows whose means are up to ~200 spreads from zero.
    #[test]
    #[serial]
    fn layer_norm_inputs_far_from_zero_keep_gradients_close(
        depth in 1usize..=3,
        width in prop::sample::select(vec![64i64, 128]),
        tokens in 16i64..=48,
        batch in 1i64..=4,
        shift in prop::sample::select(vec![0.0, 10.0, 100.0]),
        seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let net = linear_stack(depth, width, tokens, batch, shift);
        let (int8, bf16) = net.errors();
        let at = format!("depth {depth}, width {width}, {tokens} tokens, batch {batch}, shift {shift}");
        prop_assert!(int8 <= INT8_MAX_ERROR, "int8: relative L2 {int8:.3e} ({at})");
        prop_assert!(bf16 <= BF16_MAX_ERROR, "bf16: relative L2 {bf16:.3e} ({at})");
    }
}

/// One stack of the small-batch case: channels' means ~200 spreads from zero, 2
/// images of 4 x 4 (32 values a channel).
#[test]
#[serial]
fn batch_norm_over_few_values_far_from_zero() {
    tch::manual_seed(3);
    let net = conv_stack(2, 32, 4, 2, 100.0);
    let (int8, bf16) = net.errors();
    println!("int8 {int8:.3e}, bf16 {bf16:.3e}");
    assert!(int8 <= INT8_MAX_ERROR, "int8: relative L2 {int8:.3e}");
    assert!(bf16 <= BF16_MAX_ERROR, "bf16: relative L2 {bf16:.3e}");
}

/// Batch norm over 2 to 4 values a channel (`[batch, 1024, 1, 1]`: 8 to 16 KiB, so
/// packed by size): a centered group of 2 values would store 2 bytes and two f32
/// (its scale and offset) for 8 bytes, so Compress keeps such an input as it is;
/// from 3 values on it stores it. Either way the step retains no more than the plain
/// step's bytes, and the gradient stays within the bounds.
#[test]
#[serial]
fn batch_norm_over_two_values_a_channel_never_stores_more_than_the_input() {
    memsave_meter::install();
    let cpu = (Kind::Float, Device::Cpu);
    for batch in 2i64..=4 {
        tch::manual_seed(batch);
        let x = Tensor::randn([batch, 1024, 1, 1], cpu);
        let shift = (Tensor::randn([1, 1024, 1, 1], cpu) * 50.0).set_requires_grad(true);
        let weight = Tensor::rand([1024], cpu).set_requires_grad(true);
        let bias = Tensor::randn([1024], cpu).set_requires_grad(true);
        let target = Tensor::randn([batch, 1024, 1, 1], cpu);
        let params = [
            shift.shallow_clone(),
            weight.shallow_clone(),
            bias.shallow_clone(),
        ];
        let loss = || {
            let h = &x + &shift;
            let y = h.batch_norm(
                Some(&weight),
                Some(&bias),
                None::<&Tensor>,
                None::<&Tensor>,
                true,
                0.1,
                1e-5,
                false,
            );
            (y * &target).sum(Kind::Float)
        };
        let step = |hooks: Option<Compress>| {
            let (l, m) = memsave_meter::measure(Device::Cpu, |_| match hooks {
                Some(h) => saved_tensors_hooks(h, loss).unwrap(),
                None => loss(),
            });
            (
                m.retained_bytes(),
                Tensor::run_backward(&[l], &params, false, false),
            )
        };
        let (plain, exact) = step(None);
        for (codec, max_error) in [
            (Codec::int8(), INT8_MAX_ERROR),
            (Codec::Bf16, BF16_MAX_ERROR),
        ] {
            let held = [x.shallow_clone(), target.shallow_clone()];
            let hooks = Compress::new(codec).excluding(&held);
            let (bytes, grads) = step(Some(hooks.clone()));
            let stats = hooks.stats();
            let error = relative_l2(&exact, &grads);
            let at = format!("{} over {batch} values a channel", codec.name());
            assert!(
                bytes <= plain,
                "{at}: retained {bytes} bytes, plain {plain}; {stats:?}"
            );
            assert!(error <= max_error, "{at}: relative L2 {error:.3e}");
            // The input h: stored from 3 values a channel on.
            let stored = if batch == 2 { 0 } else { 1 };
            assert_eq!(stats.tensors, stored, "{at}: {stats:?}");
        }
    }
}
