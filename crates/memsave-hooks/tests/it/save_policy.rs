//! SavePolicy: what the packing hooks keep as it is (parameters, buffers,
//! normalization statistics, small tensors, named ops), what a closure decides, the
//! check of named ops, and a tensor saved twice written once.
use memsave_hooks::{
    saved_tensors_hooks, Codec, Compress, DiskOffload, Kept, PolicyError, SavePolicy,
};
use serial_test::serial;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// `|a - b| / |a|` over all gradients together.
fn relative_l2(exact: &[Tensor], approx: &[Tensor]) -> f64 {
    let sq = |t: &Tensor| t.square().sum(Kind::Double).double_value(&[]);
    let num: f64 = exact.iter().zip(approx).map(|(a, b)| sq(&(a - b))).sum();
    let den: f64 = exact.iter().map(sq).sum();
    (num / den).sqrt()
}

/// The gradients of `params` after `loss()` runs under `hooks` (or none) and backward.
fn grads(params: &[Tensor], hooks: Option<Compress>, loss: impl Fn() -> Tensor) -> Vec<Tensor> {
    for p in params {
        memsave_sys::tensor::set_grad_none(p).unwrap();
    }
    let l = match hooks {
        Some(h) => saved_tensors_hooks(h, loss).unwrap(),
        None => loss(),
    };
    l.backward();
    params.iter().map(|p| p.grad().copy()).collect()
}

/// `keep_ops` keeps what a named op saves; `check` reports the names never seen, and
/// only after the step has seen the others.
#[test]
#[serial_test::parallel]
fn keep_ops_keeps_what_named_ops_save_and_check_reports_names_never_seen() {
    let w = Tensor::randn([256, 256], CPU).set_requires_grad(true);
    let x = Tensor::randn([64, 256], CPU);
    let int8 = Compress::new(Codec::int8())
        .excluding(&[x.shallow_clone()])
        .keep_ops(&["aten::tanh", "SigmoidBackward0", "aten::no_such_op"]);
    assert_eq!(
        int8.check(),
        Err(PolicyError::UnseenOps {
            names: vec![
                "aten::tanh".into(),
                "SigmoidBackward0".into(),
                "aten::no_such_op".into()
            ],
            near: vec![],
        })
    );
    let loss = saved_tensors_hooks(int8.clone(), || {
        // tanh saves its output h (kept: saved by aten::tanh); the mm after it saves h
        // again (compressed: aten::mm and TanhBackward0 are not named, the trap of
        // naming a saving op). sigmoid saves its output s and the mm after it s again
        // (both kept: produced by SigmoidBackward0); exp saves its output (compressed).
        let h = x.matmul(&w).tanh();
        let s = h.matmul(&w).sigmoid();
        s.matmul(&w).exp().sum(Kind::Float)
    })
    .unwrap();
    let stats = int8.stats();
    assert_eq!((stats.kept.ops, stats.tensors), (3, 2), "{stats:?}");
    let err = int8.check().unwrap_err();
    assert_eq!(
        err,
        PolicyError::UnseenOps {
            names: vec!["aten::no_such_op".into()],
            near: vec![],
        }
    );
    assert!(
        err.to_string().contains("aten::no_such_op") && !err.to_string().contains('\n'),
        "{err}"
    );
    loss.backward();
}

/// `pack_if` is told the saving op, the producer, the shape and the default decision,
/// and overrides the default: refusing tanh's output keeps it (counted as `policy`).
#[test]
#[serial_test::parallel]
fn pack_if_sees_op_producer_shape_and_default_and_decides() {
    let w = Tensor::randn([256, 256], CPU).set_requires_grad(true);
    let x = Tensor::randn([64, 256], CPU);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let int8 = Compress::new(Codec::int8())
        .excluding(&[x.shallow_clone()])
        .pack_if(move |t| {
            log.lock().unwrap().push((
                t.op.map(str::to_owned),
                t.producer.map(str::to_owned),
                t.shape.to_vec(),
                t.bytes,
                t.kept_by_default,
            ));
            t.op != Some("aten::tanh")
        });
    let loss = saved_tensors_hooks(int8.clone(), || {
        let b = Tensor::ones([1, 256], CPU); // a constant row, broadcast
        ((x.matmul(&w) * &b).tanh()).sum(Kind::Float)
    })
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    // x (excluded) is not shown to the closure; mul saves b (for the mm output's
    // gradient), tanh its output.
    assert_eq!(
        seen,
        vec![
            (
                Some("aten::mul".to_owned()),
                None,
                vec![1, 256],
                1024,
                Some(Kept::Buffer)
            ),
            (
                Some("aten::tanh".to_owned()),
                Some("TanhBackward0".to_owned()),
                vec![64, 256],
                64 * 256 * 4,
                None
            ),
        ]
    );
    let stats = int8.stats();
    // The closure packed the buffer (256 values: one int8 block of 1,024, padded, and
    // its scale) and refused tanh's output.
    assert_eq!((stats.tensors, stats.kept.policy), (1, 1), "{stats:?}");
    assert_eq!(stats.stored_bytes, 1024 + 4);
    loss.backward();
}

/// Tensors under `min_bytes` are kept as they are, at or above it compressed, over
/// several sizes and thresholds (the default 4 KiB among them).
#[test]
#[serial_test::parallel]
fn tensors_under_min_bytes_are_kept() {
    let w = Tensor::randn([8, 8], CPU).set_requires_grad(true);
    for min_bytes in [None, Some(0), Some(1000), Some(1 << 16)] {
        let threshold = min_bytes.unwrap_or(memsave_hooks::DEFAULT_MIN_BYTES);
        for rows in [1i64, 15, 16, 17, 100, 600] {
            let x = Tensor::randn([rows, 8], CPU);
            let mut int8 = Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
            if let Some(m) = min_bytes {
                int8 = int8.min_bytes(m);
            }
            let loss =
                saved_tensors_hooks(int8.clone(), || x.matmul(&w).tanh().sum(Kind::Float)).unwrap();
            let bytes = (rows * 8 * 4) as u64;
            let stats = int8.stats();
            let compressed = bytes >= threshold;
            assert_eq!(
                (stats.tensors, stats.kept.small),
                (compressed as u64, !compressed as u64),
                "{rows} rows, threshold {threshold}: {stats:?}"
            );
            loss.backward();
        }
    }
}

/// What the policies keep, tensor by tensor: parameters and their views, buffers
/// (vectors and scalars without a grad_fn), empty tensors; a larger constant is
/// packed (the documented trap: it may be a mask the forward made). What SaveOnCpu
/// and DiskOffload keep on an accelerator, testable on the CPU.
#[test]
#[serial_test::parallel]
fn the_policies_keep_parameters_buffers_and_empty_tensors() {
    let param = Tensor::randn([16, 16], CPU).set_requires_grad(true);
    let activation = param.tanh(); // has a grad_fn
    let running_mean = Tensor::zeros([16], CPU);
    let scalar = Tensor::from(2.0f32);
    let column = Tensor::zeros([16, 1, 1], CPU);
    let table = Tensor::zeros([16, 16], CPU);
    let mask = Tensor::zeros([16, 16], (Kind::Bool, Device::Cpu));
    let small_activation = Tensor::randn([4], CPU).set_requires_grad(true).exp();
    let cases: Vec<(&str, Tensor, Option<Kept>)> = vec![
        ("parameter", param.shallow_clone(), Some(Kept::Parameter)),
        (
            "parameter's rows",
            param.narrow(0, 4, 8),
            Some(Kept::Parameter),
        ),
        ("parameter's t()", param.tr(), Some(Kept::Parameter)),
        ("activation", activation, None),
        ("running mean", running_mean, Some(Kept::Buffer)),
        ("scalar", scalar, Some(Kept::Buffer)),
        ("per-channel column", column, Some(Kept::Buffer)),
        ("constant table", table, None),
        ("bool mask", mask, None),
        ("empty", Tensor::zeros([0, 16], CPU), Some(Kept::Empty)),
        ("small activation", small_activation, None),
    ];
    for (what, t, expected) in &cases {
        assert_eq!(
            SavePolicy::exact().keeps(t, None).unwrap(),
            *expected,
            "{what}"
        );
    }
    // The lossy policy also keeps what is under 4 KiB.
    let lossy = SavePolicy::lossy();
    assert_eq!(lossy.keeps(&cases[10].1, None).unwrap(), Some(Kept::Small));
    assert_eq!(lossy.keeps(&cases[7].1, None).unwrap(), Some(Kept::Small));
    let big_table = Tensor::zeros([64, 64], CPU);
    assert_eq!(lossy.keeps(&big_table, None).unwrap(), None);
}

/// Layer norm over rows, and group norm over channels, whose ranges differ by up to
/// 1e3 either way: int8 keeps their statistics (mean and rstd) and compresses their
/// inputs with blocks per row (per plane) that follow each one's range.
#[test]
#[serial]
fn layer_and_group_norm_statistics_are_kept_and_inputs_grouped() {
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root() / "lin", 32, 32, Default::default());
    let ln = nn::layer_norm(vs.root() / "ln", vec![32], Default::default());
    let conv = nn::conv2d(vs.root() / "conv", 3, 8, 3, Default::default());
    let gn = nn::group_norm(vs.root() / "gn", 4, 8, Default::default());
    let params = vs.trainable_variables();
    // 64 rows of 32 values, each row scaled by 10^u, u in [-3, 3].
    let rows = Tensor::randn([64, 32], CPU)
        * Tensor::pow_scalar(10.0, &(Tensor::rand([64, 1], CPU) * 6.0 - 3.0));
    let images = Tensor::randn([8, 3, 10, 10], CPU)
        * Tensor::pow_scalar(10.0, &(Tensor::rand([8, 1, 1, 1], CPU) * 6.0 - 3.0));
    let loss = || {
        let a = ln
            .forward(&lin.forward(&rows))
            .tanh()
            .square()
            .mean(Kind::Float);
        let b = gn
            .forward(&conv.forward(&images))
            .tanh()
            .square()
            .mean(Kind::Float);
        a + b
    };
    let exact = grads(&params, None, loss);
    let int8 =
        Compress::new(Codec::int8()).excluding(&[rows.shallow_clone(), images.shallow_clone()]);
    let approx = grads(&params, Some(int8.clone()), loss);
    let stats = int8.stats();
    // Layer norm's mean and rstd, group norm's mean and rstd.
    assert_eq!(stats.kept.statistics, 4, "{stats:?}");
    let error = relative_l2(&exact, &approx);
    assert!(error < 3e-2, "relative L2 {error:.3e}");
}

/// A ReLU output saved by the ReLU and by the matmul after it (as itself, or
/// flattened) is written once; a copy of it is a tensor of its own, written again.
/// Gradients are bitwise those of the plain step either way.
#[test]
#[serial_test::parallel]
fn a_tensor_saved_by_two_nodes_is_written_once() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::randn([128, 64], CPU).set_requires_grad(true);
    let x = Tensor::randn([4, 8, 128], CPU).set_requires_grad(true);
    for (variant, written, shared) in [("same", 2, 1), ("flattened", 2, 1), ("copy", 3, 0)] {
        let loss = || {
            let r = x.relu();
            let r = match variant {
                "copy" => r.copy(),
                _ => r,
            };
            let h = match variant {
                "flattened" => r.reshape([32, 128]).matmul(&w),
                _ => r.matmul(&w),
            };
            h.tanh().sum(Kind::Float)
        };
        let plain = {
            let l = loss();
            l.backward();
            let g = (x.grad().copy(), w.grad().copy());
            memsave_sys::tensor::set_grad_none(&x).unwrap();
            memsave_sys::tensor::set_grad_none(&w).unwrap();
            g
        };
        let store = DiskOffload::new(dir.path()).unwrap().synchronous(true);
        let l = saved_tensors_hooks(store.clone(), loss).unwrap();
        let stats = store.stats();
        assert_eq!(
            (stats.tensors_written, stats.shared),
            (written, shared),
            "{variant}: {stats:?}"
        );
        // The ReLU output (4 x 8 x 128 f32, twice for the copy) and tanh's (4 x 8 x 64).
        let relu = 4 * 8 * 128 * 4;
        assert_eq!(
            stats.written_bytes,
            (written - 1) * relu + 4 * 8 * 64 * 4,
            "{variant}"
        );
        assert_eq!(
            std::fs::read_dir(store.dir()).unwrap().count() as u64,
            written
        );
        l.backward();
        assert!(
            x.grad().equal(&plain.0) && w.grad().equal(&plain.1),
            "{variant}"
        );
        memsave_sys::tensor::set_grad_none(&x).unwrap();
        memsave_sys::tensor::set_grad_none(&w).unwrap();
        drop(l);
        assert_eq!(
            std::fs::read_dir(store.dir()).unwrap().count(),
            0,
            "{variant}"
        );
    }
}
