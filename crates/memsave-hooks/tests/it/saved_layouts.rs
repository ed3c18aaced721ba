//! A tensor saved by two nodes in two layouts of the same memory (issue #25): in
//! torchvision's ViT the attention's output is saved by the attention in its own
//! strided layout and again by `out_proj` as a contiguous view of the same memory.
//! DiskOffload writes it once and Compress stores it once; each save gets its own
//! layout back, bitwise the tensor for DiskOffload, the numbers of the first save's
//! stored form for Compress. A normalization's input, which Compress stores centered,
//! shares that form too, decoded to the same numbers for both saves.
use memsave_hooks::{
    saved_tensors_hooks, Codec, Compress, Compressed, DiskOffload, HookError, SavedTensorHooks,
};
use serial_test::serial;
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// Two saves of one `[rows, cols]` tensor `t`: the view the first op saves, then the
/// view the second saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layouts {
    /// `t.T` by one matmul, then `t` by another.
    TransposedThenItself,
    /// `t`, then `t.T`.
    ItselfThenTransposed,
    /// `t`, then the first half of its columns (every element inside `t`'s memory).
    ItselfThenSlice,
    /// `t` viewed as `[cols, rows]` (reshaped, contiguous) then `t.T`.
    ReshapedThenTransposed,
}

const LAYOUTS: [Layouts; 4] = [
    Layouts::TransposedThenItself,
    Layouts::ItselfThenTransposed,
    Layouts::ItselfThenSlice,
    Layouts::ReshapedThenTransposed,
];

/// Sizes `[rows, cols]` of `t`: the issue's `[4, 8]`, and others.
const SIZES: [(i64, i64); 3] = [(4, 8), (64, 32), (33, 17)];

/// Parameters: the leaf `t` comes from, and the two matmuls' weights.
struct Params {
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
}

impl Params {
    fn new(rows: i64, cols: i64) -> Params {
        Params {
            x: Tensor::randn([rows, cols], CPU).set_requires_grad(true),
            w1: Tensor::randn([rows.max(cols), 5], CPU).set_requires_grad(true),
            w2: Tensor::randn([rows.max(cols), 3], CPU).set_requires_grad(true),
        }
    }

    fn all(&self) -> [&Tensor; 3] {
        [&self.x, &self.w1, &self.w2]
    }

    /// The views each op saves of `t` (`[rows, cols]`), in their order.
    fn views(t: &Tensor, layouts: Layouts) -> (Tensor, Tensor) {
        let (rows, cols) = (t.size()[0], t.size()[1]);
        match layouts {
            Layouts::TransposedThenItself => (t.transpose(0, 1), t.shallow_clone()),
            Layouts::ItselfThenTransposed => (t.shallow_clone(), t.transpose(0, 1)),
            Layouts::ItselfThenSlice => (t.shallow_clone(), t.narrow(1, 0, cols / 2)),
            Layouts::ReshapedThenTransposed => (t.reshape([cols, rows]), t.transpose(0, 1)),
        }
    }

    /// `t = 2x` saves nothing; each matmul saves its view of `t` (and its weight, a
    /// parameter, kept); the sums save nothing.
    fn loss(&self, layouts: Layouts) -> Tensor {
        let t = &self.x * 2.0;
        let (a, b) = Params::views(&t, layouts);
        let w = |w: &Tensor, v: &Tensor| w.narrow(0, 0, v.size()[1]);
        let a = a.mm(&w(&self.w1, &a)).sum(Kind::Float);
        let b = b.mm(&w(&self.w2, &b)).sum(Kind::Float);
        a + b
    }

    /// The gradients after `loss()` runs and backward, copied; cleared after.
    fn grads(&self, loss: impl FnOnce() -> Tensor) -> Vec<Tensor> {
        loss().backward();
        let g = self.all().iter().map(|p| p.grad().copy()).collect();
        for p in self.all() {
            memsave_sys::tensor::set_grad_none(p).unwrap();
        }
        g
    }
}

fn bitwise_equal(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.equal(b))
}

fn relative_l2(exact: &[Tensor], approx: &[Tensor]) -> f64 {
    let sq = |t: &Tensor| t.square().sum(Kind::Double).double_value(&[]);
    let num: f64 = exact.iter().zip(approx).map(|(a, b)| sq(&(a - b))).sum();
    let den: f64 = exact.iter().map(sq).sum();
    (num / den).sqrt()
}

/// DiskOffload writes `t` once, whichever two views of it the ops save and in which
/// order; backward gets each view back, gradients bitwise those of the plain step.
#[test]
#[serial_test::parallel]
fn disk_offload_writes_a_tensor_saved_in_two_layouts_once() {
    let dir = tempfile::tempdir().unwrap();
    for (rows, cols) in SIZES {
        let p = Params::new(rows, cols);
        for layouts in LAYOUTS {
            let case = format!("{layouts:?} of [{rows}, {cols}]");
            let plain = p.grads(|| p.loss(layouts));
            let store = DiskOffload::new(dir.path()).unwrap().synchronous(true);
            let got = p.grads(|| {
                let loss = saved_tensors_hooks(store.clone(), || p.loss(layouts)).unwrap();
                let stats = store.stats();
                assert_eq!(
                    (stats.tensors_written, stats.shared),
                    (1, 1),
                    "{case}: {stats:?}"
                );
                assert_eq!(stats.written_bytes, (rows * cols * 4) as u64, "{case}");
                assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 1, "{case}");
                loss
            });
            assert!(bitwise_equal(&got, &plain), "{case}");
            assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 0, "{case}");
        }
    }
}

/// Compress's stored packs as [`Recorded`] records them: per pack, in packing order,
/// the saving op and the tensor its unpack gave back (`None` for a tensor kept as it
/// is).
type Unpacked = Arc<Mutex<Vec<(Option<String>, Option<Option<Tensor>>)>>>;

/// Compress, recording what each pack's unpack gives back.
#[derive(Clone)]
struct Recorded {
    inner: Compress,
    unpacked: Unpacked,
}

impl Recorded {
    fn new(inner: Compress) -> Self {
        Recorded {
            inner,
            unpacked: Arc::default(),
        }
    }

    /// What the unpack of the `n`th tensor that `op` saved and Compress stored gave
    /// back.
    fn unpacked(&self, op: &str, n: usize) -> Tensor {
        let all = self.unpacked.lock().unwrap();
        let mut of_op = all
            .iter()
            .filter(|(o, t)| o.as_deref() == Some(op) && t.is_some());
        let (_, t) = of_op
            .nth(n)
            .unwrap_or_else(|| panic!("no save {n} by {op}"));
        match t {
            Some(Some(t)) => t.shallow_clone(),
            _ => panic!("save {n} by {op} was not unpacked"),
        }
    }
}

impl SavedTensorHooks for Recorded {
    type Packed = (usize, Compressed);

    fn pack(&self, tensor: &Tensor) -> Result<Self::Packed, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        true
    }

    fn pack_saved_by(&self, tensor: &Tensor, op: Option<&str>) -> Result<Self::Packed, HookError> {
        let packed = self.inner.pack_saved_by(tensor, op)?;
        let stored = matches!(packed, Compressed::Encoded(_));
        let mut all = self.unpacked.lock().unwrap();
        all.push((op.map(str::to_owned), stored.then_some(None)));
        Ok((all.len() - 1, packed))
    }

    fn unpack(&self, (id, packed): &Self::Packed) -> Result<Tensor, HookError> {
        let t = self.inner.unpack(packed)?;
        if let (_, Some(unpacked)) = &mut self.unpacked.lock().unwrap()[*id] {
            *unpacked = Some(t.copy());
        }
        Ok(t)
    }
}

/// Compress stores `t` once, whichever two views of it the ops save and in which
/// order: the second save gets the numbers of the first save's stored form, each
/// where `t`'s memory holds it (its view of the first save's unpacked tensor,
/// bitwise), and the gradients stay within int8's error.
#[test]
#[serial_test::parallel]
fn compress_stores_a_tensor_saved_in_two_layouts_once_with_the_first_saves_numbers() {
    for (rows, cols) in SIZES {
        let p = Params::new(rows, cols);
        for layouts in LAYOUTS {
            let case = format!("{layouts:?} of [{rows}, {cols}]");
            let plain = p.grads(|| p.loss(layouts));
            let hooks = Recorded::new(Compress::new(Codec::int8()).min_bytes(0));
            let got = p.grads(|| {
                let loss = saved_tensors_hooks(hooks.clone(), || p.loss(layouts)).unwrap();
                let stats = hooks.inner.stats();
                assert_eq!((stats.tensors, stats.shared), (1, 1), "{case}: {stats:?}");
                assert_eq!(stats.original_bytes, (rows * cols * 4) as u64, "{case}");
                loss
            });
            // Each mm saved its view of t; the first stored it.
            let first = hooks.unpacked("aten::mm", 0);
            let second = hooks.unpacked("aten::mm", 1);
            // t as the first save's numbers, then viewed as the second op saw it.
            let t = match layouts {
                Layouts::TransposedThenItself => first.transpose(0, 1),
                Layouts::ReshapedThenTransposed => first.reshape([rows, cols]),
                _ => first.shallow_clone(),
            };
            let (_, expected) = Params::views(&t, layouts);
            assert_eq!(second.size(), expected.size(), "{case}");
            assert!(second.equal(&expected), "{case}");
            // The codec's numbers, not the tensor's.
            let exact = Params::views(&(&p.x * 2.0), layouts).1;
            assert!(!second.equal(&exact), "{case}");
            let error = relative_l2(&plain, &got);
            assert!(error < 3e-2, "{case}: relative L2 {error:.3e}");
        }
    }
}

/// The attention of torchvision's ViT (`nn.MultiheadAttention`): libtorch's CPU
/// attention saves its output `[batch, heads, tokens, head_dim]` laid out as
/// `[batch, tokens, heads, head_dim]`, and `out_proj` saves the same memory as a
/// contiguous `[batch * tokens, width]` view. Written once by DiskOffload (gradients
/// bitwise), stored once by Compress.
#[test]
#[serial]
fn the_attention_output_and_its_contiguous_view_are_stored_once() {
    tch::manual_seed(25);
    let (batch, tokens, heads, head_dim) = (2i64, 16i64, 4i64, 16i64);
    let width = heads * head_dim;
    let x = Tensor::randn([batch, tokens, width], CPU);
    // Initialized as a layer's weights are (standard deviation 1 / sqrt(width)):
    // drawn from N(0, 1), the attention saturates and int8's error is 0.87 whether
    // the output is shared or not.
    let scale = 1.0 / (width as f64).sqrt();
    let w_in = (Tensor::randn([3 * width, width], CPU) * scale).set_requires_grad(true);
    let w_out = (Tensor::randn([width, width], CPU) * scale).set_requires_grad(true);
    let params = [&w_in, &w_out];
    let loss = || {
        let qkv = x
            .linear::<Tensor>(&w_in, None)
            .reshape([batch, tokens, 3, heads, head_dim])
            .permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let out = Tensor::scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, false, None, false,
        );
        out.transpose(1, 2)
            .reshape([batch * tokens, width])
            .linear::<Tensor>(&w_out, None)
            .tanh()
            .sum(Kind::Float)
    };
    let grads = |l: Tensor| {
        l.backward();
        let g: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
        for p in params {
            memsave_sys::tensor::set_grad_none(p).unwrap();
        }
        g
    };
    let plain = grads(loss());
    let dir = tempfile::tempdir().unwrap();
    let store = DiskOffload::new(dir.path())
        .unwrap()
        .synchronous(true)
        .excluding(&[x.shallow_clone()]);
    let l = saved_tensors_hooks(store.clone(), loss).unwrap();
    let stats = store.stats();
    let f32s = |n: i64| (n * 4) as u64;
    // q, k and v (strided slices of one projection: each written as its own copy),
    // the attention's log-sum-exp, its output once, and the output projection's.
    let expected = 3 * f32s(batch * tokens * width)
        + f32s(batch * heads * tokens)
        + f32s(batch * tokens * width)
        + f32s(batch * tokens * width);
    assert_eq!(stats.written_bytes, expected, "{stats:?}");
    assert_eq!(stats.shared, 1, "{stats:?}");
    assert!(bitwise_equal(&grads(l), &plain));

    let int8 = Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
    let l = saved_tensors_hooks(int8.clone(), loss).unwrap();
    let stats = int8.stats();
    assert_eq!(stats.shared, 1, "{stats:?}");
    // The log-sum-exp (512 bytes) is kept: under 4 KiB.
    assert_eq!(stats.kept.small, 1, "{stats:?}");
    let lse = f32s(batch * heads * tokens);
    assert_eq!(stats.original_bytes, expected - lse, "{stats:?}");
    let error = relative_l2(&plain, &grads(l));
    assert!(error < 3e-2, "relative L2 {error:.3e}");
}

/// The largest `|a - b|` over each row of `[rows, len]` (as f64).
fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// A normalization's input, stored centered by Compress (relative to each block's
/// midrange: rows here, 200 spreads from zero), and saved again in another layout by
/// a matmul, in either order. Stored once; both saves get the same numbers, those of
/// the first save's form (bitwise, in each one's layout): with the layer norm first,
/// the matmul's values are as close to the tensor as the centered form is (half a
/// step of each row's half-range / 127), and the layer norm's gradients keep that
/// precision; with the matmul first, the layer norm shares its form stored relative
/// to zero.
#[test]
#[serial]
fn a_normalizations_centered_form_shared_with_another_layout_decodes_to_the_same_numbers() {
    tch::manual_seed(26);
    let (rows, width) = (48i64, 128i64);
    let x = Tensor::randn([rows, width], CPU).set_requires_grad(true);
    let w = Tensor::randn([rows, 8], CPU).set_requires_grad(true);
    let gamma = Tensor::ones([width], CPU).set_requires_grad(true);
    let params = [&x, &w, &gamma];
    // Weights of the losses' sums (a product with a tensor that needs no gradient
    // saves only that tensor: excluded).
    let c = Tensor::randn([rows, width], CPU);
    let t_of = |x: &Tensor| x * 1.0 + 200.0;
    let loss = |norm_first: bool| {
        let t = t_of(&x);
        let norm = |t: &Tensor| {
            (t.layer_norm([width], Some(&gamma), None::<&Tensor>, 1e-5, false) * &c)
                .sum(Kind::Float)
        };
        let mm = |t: &Tensor| t.transpose(0, 1).mm(&w).sum(Kind::Float);
        if norm_first {
            norm(&t) + mm(&t)
        } else {
            mm(&t) + norm(&t)
        }
    };
    let grads = |l: Tensor| {
        l.backward();
        let g: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
        for p in params {
            memsave_sys::tensor::set_grad_none(p).unwrap();
        }
        g
    };
    let t = t_of(&x).detach();
    // Each row's half-range / 127: the step of its centered int8 block.
    let step = (t.amax([1], true) - t.amin([1], true)) / 2.0 / 127.0;
    for norm_first in [true, false] {
        let plain = grads(loss(norm_first));
        let hooks = Recorded::new(Compress::new(Codec::int8()).excluding(&[c.shallow_clone()]));
        let l = saved_tensors_hooks(hooks.clone(), || loss(norm_first)).unwrap();
        let stats = hooks.inner.stats();
        assert_eq!((stats.tensors, stats.shared), (1, 1), "{stats:?}");
        let got = grads(l);
        let by_norm = hooks.unpacked("aten::native_layer_norm", 0);
        let by_mm = hooks.unpacked("aten::mm", 0);
        assert_eq!(by_mm.size(), [width, rows]);
        assert!(
            by_mm.equal(&by_norm.transpose(0, 1)),
            "norm first: {norm_first}"
        );
        let error = (&by_norm - &t).abs();
        if norm_first {
            // Within half a centered step of each row, everywhere (the matmul's too).
            let over = (error - &step / 2.0 * 1.001).clamp_min(0.0);
            assert_eq!(over.max().double_value(&[]), 0.0);
            let grad_error = relative_l2(&plain, &got);
            assert!(grad_error < 3e-2, "relative L2 {grad_error:.3e}");
        } else {
            // Stored relative to zero: steps of about 200 / 127 / 2 (the trap the
            // docs name), many centered steps.
            assert!(max_abs(&by_norm, &t) > 10.0 * step.max().double_value(&[]));
        }
    }
}

/// Batch norm's input in channels-last layout (`[N, C, H, W]` over `[N, H, W, C]`
/// memory), stored centered per channel, then saved by a matmul as the contiguous
/// `[N * H * W, C]` view of that memory: stored once, the matmul's values are the
/// batch norm's numbers at the same places (the centered form's rows laid back into
/// memory order), within half a centered step of the input.
#[test]
#[serial]
fn a_channels_last_batch_norm_input_shares_its_centered_form_with_a_contiguous_view() {
    tch::manual_seed(27);
    let (n, c, h, w) = (4i64, 8i64, 6i64, 6i64);
    let x = Tensor::randn([n, h, w, c], CPU).set_requires_grad(true);
    let weight = Tensor::randn([c, 5], CPU).set_requires_grad(true);
    let gamma = Tensor::ones([c], CPU).set_requires_grad(true);
    let offsets = Tensor::randn([c], CPU) * 100.0;
    // The weights of the batch norm's sum (saved by the product, excluded).
    let weights = Tensor::randn([n, c, h, w], CPU);
    let t_of = |x: &Tensor| x * 1.0 + &offsets;
    let loss = || {
        let t = t_of(&x);
        let nchw = t.permute([0, 3, 1, 2]);
        let bn = nchw.batch_norm(
            Some(&gamma),
            None::<&Tensor>,
            None::<&Tensor>,
            None::<&Tensor>,
            true,
            0.1,
            1e-5,
            false,
        );
        let bn = (bn * &weights).sum(Kind::Float);
        let mm = t.reshape([n * h * w, c]).mm(&weight).sum(Kind::Float);
        bn + mm
    };
    let hooks = Recorded::new(Compress::new(Codec::int8()).excluding(&[weights.shallow_clone()]));
    let l = saved_tensors_hooks(hooks.clone(), loss).unwrap();
    let stats = hooks.inner.stats();
    assert_eq!((stats.tensors, stats.shared), (1, 1), "{stats:?}");
    l.backward();
    let ops: Vec<String> = hooks
        .unpacked
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(op, _)| op.clone())
        .collect();
    let bn_op = ops
        .iter()
        .find(|op| op.contains("batch_norm"))
        .unwrap_or_else(|| panic!("no batch norm among {ops:?}"));
    let by_bn = hooks.unpacked(bn_op, 0);
    let by_mm = hooks.unpacked("aten::mm", 0);
    assert_eq!(by_bn.size(), [n, c, h, w]);
    assert!(by_mm.equal(&by_bn.permute([0, 2, 3, 1]).reshape([n * h * w, c])));
    let t = t_of(&x).detach().reshape([n * h * w, c]);
    // Each channel's half-range / 127.
    let step = (t.amax([0], true) - t.amin([0], true)) / 2.0 / 127.0;
    let over = ((&by_mm - &t).abs() - &step / 2.0 * 1.001).clamp_min(0.0);
    assert_eq!(over.max().double_value(&[]), 0.0);
}
