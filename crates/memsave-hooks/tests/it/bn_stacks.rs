//! Batch-norm networks (issue #25, "Real architectures"): Compress's defaults keep the
//! gradients close and the memory small on random conv/BatchNorm/ReLU/linear stacks;
//! DiskOffload writes no running statistic and a tensor saved twice once.
use memsave_hooks::{saved_tensors_hooks, Codec, Compress, DiskOffload};
use memsave_meter::measure;
use proptest::prelude::*;
use serial_test::serial;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

/// Images in a batch: the smallest activation of the stacks below (4 channels of
/// 8 x 8) is then 16 KiB, above Compress's 4 KiB threshold; with a batch of 1 the
/// smallest stacks' activations (1 KiB) would be kept as they are.
const BATCH: i64 = 16;

struct Stack {
    vs: nn::VarStore,
    convs: Vec<nn::Conv2D>,
    norms: Vec<nn::BatchNorm>,
    head: nn::Linear,
    channels: i64,
    image: i64,
}

/// `depth` blocks of 3x3 conv (padding 1) + BatchNorm2d (train mode) + ReLU on
/// `[BATCH, 3, image, image]`, then a linear head to 10 outputs. `spread` scales
/// each conv's output channels by `e^u`, `u` uniform in `[-spread, spread]`, as
/// trained networks' channels differ in range (MobileNetV2's depthwise convs by
/// orders of magnitude); 0 leaves tch's initialization.
fn stack(depth: usize, channels: i64, image: i64, spread: f64) -> Stack {
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = nn::ConvConfig {
        padding: 1,
        ..Default::default()
    };
    let mut convs = Vec::new();
    let mut norms = Vec::new();
    for i in 0..depth {
        let c_in = if i == 0 { 3 } else { channels };
        let mut conv = nn::conv2d(vs.root() / format!("conv{i}"), c_in, channels, 3, cfg);
        if spread > 0.0 {
            let u = Tensor::rand([channels, 1, 1, 1], (Kind::Float, Device::Cpu)) * (2.0 * spread)
                - spread;
            tch::no_grad(|| {
                let _ = conv.ws.f_mul_(&u.exp()).unwrap();
                if let Some(bs) = conv.bs.as_mut() {
                    let _ = bs.f_mul_(&u.exp().reshape([-1])).unwrap();
                }
            });
        }
        convs.push(conv);
        norms.push(nn::batch_norm2d(
            vs.root() / format!("bn{i}"),
            channels,
            Default::default(),
        ));
    }
    let head = nn::linear(
        vs.root() / "head",
        channels * image * image,
        10,
        Default::default(),
    );
    Stack {
        vs,
        convs,
        norms,
        head,
        channels,
        image,
    }
}

impl Stack {
    fn loss(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for (conv, bn) in self.convs.iter().zip(&self.norms) {
            h = bn.forward_t(&conv.forward(&h), true).relu();
        }
        self.head
            .forward(&h.flatten(1, -1))
            .square()
            .mean(Kind::Float)
    }

    /// Bytes retained after the forward (the loss kept, so every saved tensor) and the
    /// gradients of one step, with `hooks` or without.
    fn step<H: memsave_hooks::SavedTensorHooks + Clone>(
        &self,
        x: &Tensor,
        hooks: Option<&H>,
    ) -> (i64, Vec<Tensor>) {
        for p in self.vs.trainable_variables() {
            memsave_sys::tensor::set_grad_none(&p).unwrap();
        }
        let (loss, m) = measure(Device::Cpu, |_| match hooks {
            Some(h) => saved_tensors_hooks(h.clone(), || self.loss(x)).unwrap(),
            None => self.loss(x),
        });
        loss.backward();
        let grads = self
            .vs
            .trainable_variables()
            .iter()
            .map(|p| p.grad().copy())
            .collect();
        (m.retained_bytes(), grads)
    }

    /// Bytes of one activation (a conv's output, a ReLU's).
    fn activation_bytes(&self) -> u64 {
        (BATCH * self.channels * self.image * self.image * 4) as u64
    }
}

/// `|a - b| / |a|` over all gradients together.
fn relative_l2(exact: &[Tensor], approx: &[Tensor]) -> f64 {
    let sq = |t: &Tensor| t.square().sum(Kind::Double).double_value(&[]);
    let num: f64 = exact.iter().zip(approx).map(|(a, b)| sq(&(a - b))).sum();
    let den: f64 = exact.iter().map(sq).sum();
    (num / den).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]
    /// Compress's defaults on random stacks: int8 gradients within 3e-2 (relative
    /// L2) of the plain step's, bf16 within 1e-2; int8 retains at most 0.4x the plain
    /// step's bytes after the forward (bf16 0.55x: half is its floor). Batch norm's
    /// four statistics per layer (running mean and var, saved mean and inverse std)
    /// are kept as they are.
    #[test]
    #[serial]
    fn compress_defaults_keep_bn_stack_gradients_close_and_memory_small(
        depth in 2usize..=5,
        channels in 4i64..=16,
        image in 8i64..=16,
        spread in prop::sample::select(vec![0.0, 2.0, 4.0]),
        seed in 0i64..1000,
    ) {
        memsave_meter::install();
        tch::manual_seed(seed);
        let net = stack(depth, channels, image, spread);
        let x = Tensor::randn([BATCH, 3, image, image], (Kind::Float, Device::Cpu));
        let (plain_bytes, exact) = net.step::<Compress>(&x, None);
        for (codec, max_error, max_ratio) in [(Codec::int8(), 3e-2, 0.4), (Codec::Bf16, 1e-2, 0.55)] {
            let hooks = Compress::new(codec).excluding(&[x.shallow_clone()]);
            let (bytes, grads) = net.step(&x, Some(&hooks));
            let error = relative_l2(&exact, &grads);
            let ratio = bytes as f64 / plain_bytes as f64;
            let stats = hooks.stats();
            prop_assert!(error <= max_error, "{}: relative L2 {error:.3e} (depth {depth}, {channels} channels, {image}px, spread {spread})", codec.name());
            prop_assert!(ratio <= max_ratio, "{}: retained {bytes} of {plain_bytes} bytes ({ratio:.3})", codec.name());
            prop_assert_eq!(stats.kept.statistics, 4 * depth as u64, "{:?}", stats);
            // Each layer's conv output and ReLU output.
            prop_assert_eq!(stats.tensors, 2 * depth as u64, "{:?}", stats);
        }
    }
}

/// The figures, on one stack with channels of different ranges: int8 over
/// everything the forward saves (Compress before it had rules, brought back by
/// `pack_if(|_| true)`) wrecks the gradients; the defaults do not.
#[test]
#[serial]
fn int8_over_everything_wrecks_a_bn_stack_where_the_defaults_do_not() {
    memsave_meter::install();
    tch::manual_seed(7);
    let net = stack(3, 8, 12, 4.0);
    let x = Tensor::randn([BATCH, 3, 12, 12], (Kind::Float, Device::Cpu));
    let (_, exact) = net.step::<Compress>(&x, None);
    let int8 = || Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
    let (_, defaults) = net.step(&x, Some(&int8()));
    let (_, everything) = net.step(&x, Some(&int8().pack_if(|_| true)));
    let (good, bad) = (
        relative_l2(&exact, &defaults),
        relative_l2(&exact, &everything),
    );
    println!("int8 relative L2: defaults {good:.3e}, everything packed {bad:.3e}");
    assert!(good < 3e-2, "defaults: {good:.3e}");
    assert!(bad > 0.3, "everything packed: {bad:.3e}");
}

/// DiskOffload on a stack writes each layer's conv and ReLU output and the head's
/// output, once each: no running statistic or saved batch statistic (four vectors a
/// layer, kept in memory), no second file for the ReLU output the next conv (or the
/// head, flattened) saves again. Gradients bitwise equal the plain step's.
#[test]
#[serial]
fn disk_offload_writes_no_statistic_and_a_tensor_saved_twice_once() {
    memsave_meter::install();
    let dir = tempfile::tempdir().unwrap();
    for (depth, channels, image) in [(2, 4, 8), (3, 8, 12), (5, 16, 16)] {
        tch::manual_seed(depth as i64);
        let net = stack(depth, channels, image, 0.0);
        let x = Tensor::randn([BATCH, 3, image, image], (Kind::Float, Device::Cpu));
        let (_, exact) = net.step::<DiskOffload>(&x, None);
        let store = DiskOffload::new(dir.path())
            .unwrap()
            .synchronous(true)
            .excluding(&[x.shallow_clone()]);
        let (_, grads) = net.step(&x, Some(&store));
        let stats = store.stats();
        let head_output = (BATCH * 10 * 4) as u64;
        assert_eq!(
            stats.written_bytes,
            2 * depth as u64 * net.activation_bytes() + head_output,
            "{depth} x {channels} x {image}: {stats:?}"
        );
        assert_eq!(stats.tensors_written, 2 * depth as u64 + 1, "{stats:?}");
        // The next conv saves each ReLU output again, the head the last one flattened.
        assert_eq!(stats.shared, depth as u64, "{stats:?}");
        assert_eq!(stats.kept.buffers, 4 * depth as u64, "{stats:?}");
        assert!(
            exact.iter().zip(&grads).all(|(a, b)| a.equal(b)),
            "gradients differ"
        );
        // Backward freed every file.
        assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 0);
    }
}
