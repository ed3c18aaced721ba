//! DiskOffload on a small ResNet (stem, basic blocks with and without a downsampling
//! shortcut, pooled head; BatchNorm in training mode) writes, per step, the bytes of
//! the distinct tensors the step saves, once each, less what stays alive anyway:
//! parameters, running statistics, the batch (excluded, as memsave-step does) and a
//! constant table a layer holds (written in the first step only). The expected bytes
//! come from a recorder that keeps every saved tensor as it is, classified here by
//! identity, not by the store's rules.
use memsave_hooks::{hooks_from_fn, saved_tensors_hooks, DiskOffload};
use serial_test::serial;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

fn conv(p: nn::Path, cin: i64, cout: i64, k: i64, stride: i64) -> nn::Conv2D {
    let config = nn::ConvConfig {
        stride,
        padding: k / 2,
        bias: false,
        ..Default::default()
    };
    nn::conv2d(p, cin, cout, k, config)
}

/// conv-BN-ReLU-conv-BN, plus the input (or its 1x1 conv-BN when the shape changes),
/// then ReLU in place.
struct Block {
    c1: nn::Conv2D,
    b1: nn::BatchNorm,
    c2: nn::Conv2D,
    b2: nn::BatchNorm,
    down: Option<(nn::Conv2D, nn::BatchNorm)>,
}

impl Block {
    fn new(p: nn::Path, cin: i64, cout: i64, stride: i64) -> Self {
        let down = (stride != 1 || cin != cout).then(|| {
            (
                conv(&p / "down", cin, cout, 1, stride),
                nn::batch_norm2d(&p / "down_bn", cout, Default::default()),
            )
        });
        Block {
            c1: conv(&p / "c1", cin, cout, 3, stride),
            b1: nn::batch_norm2d(&p / "b1", cout, Default::default()),
            c2: conv(&p / "c2", cout, cout, 3, 1),
            b2: nn::batch_norm2d(&p / "b2", cout, Default::default()),
            down,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.b1.forward_t(&x.apply(&self.c1), true).relu();
        let h = self.b2.forward_t(&h.apply(&self.c2), true);
        let shortcut = match &self.down {
            Some((c, b)) => b.forward_t(&x.apply(c), true),
            None => x.shallow_clone(),
        };
        (h + shortcut).relu_()
    }

    fn batch_norms(&self) -> usize {
        2 + self.down.is_some() as usize
    }
}

struct Net {
    vs: nn::VarStore,
    stem: nn::Conv2D,
    stem_bn: nn::BatchNorm,
    /// A constant the net holds (a fixed per-position scale after the stem), alive
    /// across steps like a rotary table or a cached mask.
    table: Tensor,
    blocks: Vec<Block>,
    head: nn::Linear,
}

impl Net {
    fn new(width: i64, image: i64) -> Self {
        let vs = nn::VarStore::new(Device::Cpu);
        let r = vs.root();
        let blocks = vec![
            Block::new(&r / "b0", width, width, 1),
            Block::new(&r / "b1", width, 2 * width, 2),
            Block::new(&r / "b2", 2 * width, 2 * width, 1),
        ];
        Net {
            stem: conv(&r / "stem", 3, width, 3, 1),
            stem_bn: nn::batch_norm2d(&r / "stem_bn", width, Default::default()),
            table: Tensor::rand([width, image / 2, image / 2], CPU) + 0.5,
            head: nn::linear(&r / "head", 2 * width, 10, Default::default()),
            blocks,
            vs,
        }
    }

    fn loss(&self, x: &Tensor) -> Tensor {
        let h = self.stem_bn.forward_t(&x.apply(&self.stem), true).relu();
        let mut h = h.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false) * &self.table;
        for b in &self.blocks {
            h = b.forward(&h);
        }
        let pooled = h.adaptive_avg_pool2d([1, 1]).flatten(1, -1);
        pooled.apply(&self.head).square().mean(Kind::Float)
    }

    fn batch_norms(&self) -> usize {
        1 + self.blocks.iter().map(Block::batch_norms).sum::<usize>()
    }

    fn grads(&self) -> Vec<Tensor> {
        let params = self.vs.trainable_variables();
        let grads = params.iter().map(|p| p.grad().copy()).collect();
        for p in &params {
            memsave_sys::tensor::set_grad_none(p).unwrap();
        }
        grads
    }
}

/// What the recorder saw in one step, classified by identity.
#[derive(Debug, Default, PartialEq, Eq)]
struct Expected {
    /// Saves of parameters (and their views: the head's weight, transposed).
    parameter_saves: u64,
    /// Saves of running statistics.
    running_stat_saves: u64,
    /// Saves of the batch.
    batch_saves: u64,
    /// Saves of the constant table.
    table_saves: u64,
    /// Saves of per-channel vectors without a grad_fn that are none of the above:
    /// batch norm's saved mean and inverse std (the store keeps these few bytes in
    /// memory too, as buffers).
    vector_saves: u64,
    /// Saves of the other tensors.
    other_saves: u64,
    /// The other saved tensors, once each: (data pointer, bytes).
    distinct: BTreeMap<usize, u64>,
    /// The table's bytes.
    table_bytes: u64,
}

/// Runs a step with a recorder that keeps every saved tensor as it is.
fn record(net: &Net, x: &Tensor) -> (Expected, Vec<Tensor>) {
    let saved: Arc<Mutex<Vec<Tensor>>> = Arc::default();
    let log = Arc::clone(&saved);
    let recorder = hooks_from_fn(
        move |t: &Tensor| {
            log.lock().unwrap().push(t.shallow_clone());
            Ok(t.shallow_clone())
        },
        |t: &Tensor| Ok(t.shallow_clone()),
    );
    let loss = saved_tensors_hooks(recorder, || net.loss(x)).unwrap();
    let ptr = |t: &Tensor| t.data_ptr() as usize;
    let params: HashSet<usize> = net.vs.trainable_variables().iter().map(ptr).collect();
    let running: HashSet<usize> = net
        .vs
        .variables()
        .iter()
        .filter(|(name, _)| name.contains("running_"))
        .map(|(_, t)| ptr(t))
        .collect();
    assert_eq!(running.len(), 2 * net.batch_norms());
    let mut e = Expected {
        table_bytes: (net.table.numel() * 4) as u64,
        ..Default::default()
    };
    for t in saved.lock().unwrap().iter() {
        let p = ptr(t);
        if params.contains(&p) {
            e.parameter_saves += 1;
        } else if running.contains(&p) {
            e.running_stat_saves += 1;
        } else if p == ptr(x) {
            e.batch_saves += 1;
        } else if p == ptr(&net.table) {
            e.table_saves += 1;
        } else if !t.requires_grad() && t.size().iter().filter(|&&d| d > 1).count() <= 1 {
            e.vector_saves += 1;
        } else {
            assert!(!t.stride().contains(&0), "an expanded tensor: {t:?}");
            e.other_saves += 1;
            let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
            // A tensor saved twice is the same tensor, never a part of another.
            let before = e.distinct.insert(p, bytes);
            assert!(before.is_none() || before == Some(bytes), "{t:?}");
        }
    }
    drop(saved);
    loss.backward();
    (e, net.grads())
}

/// Over several widths, images and batches, three steps each with a store made for
/// the step and a fresh batch: the bytes written are the recorder's distinct saved
/// bytes (plus the table in the first step only); no running statistic, parameter or
/// batch is written; gradients are bitwise the recorder's.
#[test]
#[serial]
fn disk_offload_writes_each_saved_tensor_once_and_nothing_that_stays_alive() {
    let dir = tempfile::tempdir().unwrap();
    for (width, image, batch) in [(4, 8, 2), (8, 12, 3), (16, 16, 4)] {
        tch::manual_seed(width);
        let net = Net::new(width, image);
        let bn = net.batch_norms() as u64;
        for step in 0..3 {
            let x = Tensor::randn([batch, 3, image, image], CPU);
            let store = DiskOffload::new(dir.path())
                .unwrap()
                .excluding(&[x.shallow_clone()]);
            let loss = saved_tensors_hooks(store.clone(), || net.loss(&x)).unwrap();
            store.flush().unwrap();
            let stats = store.stats();
            loss.backward();
            let offloaded = net.grads();
            let (e, recorded) = record(&net, &x);
            let case = format!("width {width}, image {image}, batch {batch}, step {step}");

            // What the recorder saw that stays alive anyway.
            assert_eq!(e.running_stat_saves, 2 * bn, "{case}: {e:?}");
            assert_eq!(e.vector_saves, 2 * bn, "{case}: {e:?}");
            assert_eq!((e.batch_saves, e.table_saves), (1, 1), "{case}: {e:?}");
            let table = if step == 0 { e.table_bytes } else { 0 };
            let expected_bytes = e.distinct.values().sum::<u64>() + table;
            let expected_files = e.distinct.len() as u64 + (step == 0) as u64;
            assert_eq!(stats.written_bytes, expected_bytes, "{case}: {stats:?}");
            assert_eq!(stats.tensors_written, expected_files, "{case}: {stats:?}");
            assert_eq!(stats.kept_in_memory, 0, "{case}");
            // Each ReLU output saved again (by the next conv, the shortcut's conv or
            // the pooling) shared its file.
            let again = e.other_saves - e.distinct.len() as u64;
            assert!(again >= 3, "{case}: {e:?}");
            assert_eq!(stats.shared, again, "{case}: {stats:?}");
            // The running statistics and batch norm's saved statistics stayed in
            // memory, counted as buffers; the parameters and the batch too.
            assert_eq!(
                stats.kept.buffers,
                e.running_stat_saves + e.vector_saves,
                "{case}: {stats:?}"
            );
            assert_eq!(
                stats.kept.parameters, e.parameter_saves,
                "{case}: {stats:?}"
            );
            assert_eq!(stats.kept.excluded, e.batch_saves, "{case}: {stats:?}");
            assert_eq!(stats.kept.constants, (step > 0) as u64, "{case}: {stats:?}");
            assert!(
                offloaded.iter().zip(&recorded).all(|(a, b)| a.equal(b)),
                "{case}: gradients differ"
            );
            drop(loss);
            assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 0);
        }
    }
}
