//! Issue #25: `DiskOffload` over the whole forward and loss of the zoo's ResNet-18
//! writes, per training step, the bytes of the tensors the step saves, once each,
//! and nothing that stays alive anyway: no parameter, no BatchNorm running statistic,
//! not the batch. It is lossless: gradients and running statistics after each step
//! are bitwise a plain step's.
//!
//! The expected bytes come from a second copy of the model stepped under a recorder
//! that keeps every saved tensor as it is (so no two saved tensors share an address
//! by reuse) and sorts them here by identity against that copy's `VarStore` and batch,
//! and by the op that saved them, not by the store's rules. What the files hold is
//! read from the store's directory itself, between the forward and backward.
use memsave_hooks::{saved_tensors_hooks, DiskOffload, HookError, SavedTensorHooks};
use memsave_models::{Architecture, ResNetConfig, ZooWorkload};
use memsave_step::Workload;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const BATCH: i64 = 4;
const CLASSES: i64 = 5;
const STEPS: usize = 3;
/// BatchNorm layers of ResNet-18: the stem's, two per basic block (8), and one per
/// downsampling shortcut (3).
const BATCH_NORMS: usize = 1 + 2 * 8 + 3;

fn resnet18() -> Architecture {
    Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: CLASSES,
        image: [3, 32, 32],
    })
}

/// A copy of the model (the same seed: the same parameters) and its SGD optimizer.
fn build() -> (ZooWorkload, nn::Optimizer) {
    tch::manual_seed(0);
    let model = ZooWorkload::new("resnet18", &resnet18(), BATCH, Device::Cpu).unwrap();
    let opt = nn::Sgd::default().build(model.var_store(), 0.05).unwrap();
    (model, opt)
}

/// The whole forward and the loss, in training mode.
fn forward_loss(model: &ZooWorkload, x: &Tensor, y: &Tensor) -> Tensor {
    let out = model.layers().f_forward_t(x, true).unwrap();
    model.loss(&out, Some(y)).unwrap()
}

/// Backward, then the gradients (copied) and the running statistics after the step;
/// then the optimizer's step, gradients zeroed.
fn finish(
    model: &ZooWorkload,
    opt: &mut nn::Optimizer,
    loss: Tensor,
) -> (Vec<Tensor>, Vec<Tensor>) {
    loss.backward();
    let grads = model.parameters().iter().map(|p| p.grad().copy()).collect();
    let buffers = model.buffers().iter().map(Tensor::copy).collect();
    opt.step();
    opt.zero_grad();
    (grads, buffers)
}

/// The address of a tensor's storage (its data less its offset): two live tensors
/// share it exactly when they share a storage.
fn storage(t: &Tensor) -> usize {
    t.data_ptr() as usize - t.storage_offset() as usize * t.kind().elt_size_in_bytes()
}

fn bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// A tensor's bytes as they lie in memory.
fn raw(t: &Tensor) -> Vec<u8> {
    let flat = t.contiguous().view([-1]).view_dtype(Kind::Uint8);
    Vec::<u8>::try_from(&flat).unwrap()
}

/// Keeps every saved tensor as it is and notes it with the op that saved it.
#[derive(Clone, Default)]
struct Recorder {
    saves: Arc<Mutex<Vec<Save>>>,
}

/// A saved tensor and the op that saved it.
type Save = (Option<String>, Tensor);

impl SavedTensorHooks for Recorder {
    type Packed = Tensor;

    fn pack(&self, tensor: &Tensor) -> Result<Tensor, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        true
    }

    fn pack_saved_by(&self, tensor: &Tensor, op: Option<&str>) -> Result<Tensor, HookError> {
        let mut saves = self.saves.lock().unwrap();
        saves.push((op.map(str::to_owned), tensor.shallow_clone()));
        Ok(tensor.shallow_clone())
    }

    fn unpack(&self, packed: &Tensor) -> Result<Tensor, HookError> {
        Ok(packed.shallow_clone())
    }
}

/// What the recorder saw in one step, sorted by identity and saving op.
#[derive(Debug, Default)]
struct Expected {
    /// Saves of parameters and views of them.
    parameters: u64,
    /// Saves of BatchNorm's running mean and variance (tch's BatchNorm has no
    /// `num_batches_tracked`).
    running_stats: u64,
    /// Saves of the batch (input and target).
    batch: u64,
    /// Saves of batch norm's own saved mean and inverse std: per-channel vectors the
    /// forward makes, without a `grad_fn`. The store keeps these few bytes in memory
    /// as buffers (see `DiskOffload`'s docs), so they are not expected in files.
    bn_statistics: u64,
    /// Saves of the loss's total weight (a scalar without a `grad_fn`), kept in memory
    /// for the same reason.
    loss_weight: u64,
    /// Saves of everything else: activations, and max pooling's indices.
    others: u64,
    /// Those, once each by storage: (storage, bytes).
    distinct: BTreeMap<usize, u64>,
    /// Ops that saved them, for the report.
    ops: BTreeMap<String, u64>,
}

impl Expected {
    fn of(model: &ZooWorkload, x: &Tensor, y: &Tensor, saves: &[Save]) -> Self {
        let params: HashSet<usize> = model.parameters().iter().map(storage).collect();
        let running: HashSet<usize> = model.buffers().iter().map(storage).collect();
        let batch: HashSet<usize> = [storage(x), storage(y)].into();
        let mut e = Expected::default();
        // Each storage's saves: the same data pointer and bytes every time.
        let mut first: BTreeMap<usize, (usize, u64)> = BTreeMap::new();
        for (op, t) in saves {
            let op = op.as_deref().unwrap_or("?");
            let s = storage(t);
            let no_grad_fn = !t.requires_grad();
            let vector = t.size().iter().filter(|&&d| d > 1).count() <= 1;
            if params.contains(&s) {
                e.parameters += 1;
            } else if running.contains(&s) {
                e.running_stats += 1;
            } else if batch.contains(&s) {
                e.batch += 1;
            } else if no_grad_fn && op.contains("batch_norm") && vector && t.kind() == Kind::Float {
                e.bn_statistics += 1;
            } else if no_grad_fn
                && op.contains("nll_loss")
                && t.numel() == 1
                && t.kind() == Kind::Float
            {
                e.loss_weight += 1;
            } else {
                // Nothing else without a grad_fn: no constant, no mask or table a layer
                // holds; max pooling's indices are made anew each step.
                assert!(
                    !no_grad_fn || (op.contains("max_pool") && t.kind() == Kind::Int64),
                    "an unexpected tensor without a grad_fn saved by {op}: {t:?}"
                );
                assert!(
                    !t.stride().contains(&0),
                    "an expanded tensor saved by {op}: {t:?}"
                );
                e.others += 1;
                *e.ops.entry(op.to_owned()).or_default() += 1;
                let this = (t.data_ptr() as usize, bytes(t));
                let before = *first.entry(s).or_insert(this);
                assert_eq!(
                    before, this,
                    "{op} saved a part of another saved tensor: {t:?}"
                );
                e.distinct.insert(s, this.1);
            }
        }
        e
    }

    fn bytes(&self) -> u64 {
        self.distinct.values().sum()
    }
}

/// Three SGD steps of three copies of ResNet-18 in lockstep, each on a fresh batch:
/// plain, under the recorder, and under a `DiskOffload` made for the step (the batch
/// excluded, as memsave-step does).
#[test]
#[serial_test::serial]
fn disk_offload_on_resnet18_writes_each_saved_activation_once_and_no_running_statistic() {
    let (plain, mut plain_opt) = build();
    let (recorded, mut recorded_opt) = build();
    let (offloaded, mut offloaded_opt) = build();
    assert_eq!(offloaded.buffers().len(), 2 * BATCH_NORMS);
    let parent = std::env::temp_dir();
    let mut first_step_bytes = None;
    for step in 0..STEPS {
        tch::manual_seed(100 + step as i64);
        let x = Tensor::randn([BATCH, 3, 32, 32], (Kind::Float, Device::Cpu));
        let y = Tensor::randint(CLASSES, [BATCH], (Kind::Int64, Device::Cpu));

        let loss = forward_loss(&plain, &x, &y);
        let (grads, buffers) = finish(&plain, &mut plain_opt, loss);

        let recorder = Recorder::default();
        let loss =
            saved_tensors_hooks(recorder.clone(), || forward_loss(&recorded, &x, &y)).unwrap();
        let e = Expected::of(&recorded, &x, &y, &recorder.saves.lock().unwrap());
        recorder.saves.lock().unwrap().clear();
        let (recorded_grads, recorded_buffers) = finish(&recorded, &mut recorded_opt, loss);

        let before: Vec<Tensor> = offloaded.buffers().iter().map(Tensor::copy).collect();
        let store = DiskOffload::new(&parent)
            .unwrap()
            .excluding(&[x.shallow_clone(), y.shallow_clone()]);
        let loss = saved_tensors_hooks(store.clone(), || forward_loss(&offloaded, &x, &y)).unwrap();
        store.flush().unwrap();
        let stats = store.stats();
        let files: Vec<Vec<u8>> = std::fs::read_dir(store.dir())
            .unwrap()
            .map(|f| std::fs::read(f.unwrap().path()).unwrap())
            .collect();
        let after: Vec<Tensor> = offloaded.buffers().iter().map(Tensor::copy).collect();
        let (offloaded_grads, offloaded_buffers) = finish(&offloaded, &mut offloaded_opt, loss);
        let left = std::fs::read_dir(store.dir()).unwrap().count();

        let case = format!("step {step}");
        eprintln!(
            "{case}: {} bytes written in {} files ({} tensors; {} saves shared a file); kept: {:?}; saved by: {:?}",
            stats.written_bytes,
            files.len(),
            stats.tensors_written,
            stats.shared,
            stats.kept,
            e.ops
        );

        // What the recorder saw that stays alive anyway: every running statistic, the
        // input (by the first convolution) and the target (by the loss).
        assert_eq!(e.running_stats, 2 * BATCH_NORMS as u64, "{case}: {e:?}");
        assert_eq!(e.bn_statistics, 2 * BATCH_NORMS as u64, "{case}: {e:?}");
        assert_eq!(e.batch, 2, "{case}: {e:?}");
        assert_eq!(e.loss_weight, 1, "{case}: {e:?}");
        assert!(e.parameters > 0, "{case}: {e:?}");

        // Bytes written: the distinct saved tensors', once each, the same every step.
        assert_eq!(stats.written_bytes, e.bytes(), "{case}: {stats:?}");
        let first = *first_step_bytes.get_or_insert(stats.written_bytes);
        assert_eq!(stats.written_bytes, first, "{case}");
        assert_eq!(
            stats.tensors_written,
            e.distinct.len() as u64,
            "{case}: {stats:?}"
        );
        assert_eq!(
            stats.shared,
            e.others - e.distinct.len() as u64,
            "{case}: {stats:?}"
        );
        assert_eq!(stats.kept_in_memory, 0, "{case}");
        // The files themselves: one per tensor written, their bytes the counted ones.
        assert_eq!(files.len() as u64, stats.tensors_written, "{case}");
        let on_disk: u64 = files.iter().map(|f| f.len() as u64).sum();
        assert_eq!(on_disk, e.bytes(), "{case}");
        // No file holds a running statistic, as it was before the step or after it.
        for stat in before.iter().chain(&after) {
            let stat = raw(stat);
            assert!(
                !files.contains(&stat),
                "{case}: a running statistic was written"
            );
        }
        // The store's reasons agree with the recorder's identities.
        assert_eq!(stats.kept.parameters, e.parameters, "{case}: {stats:?}");
        assert_eq!(stats.kept.excluded, e.batch, "{case}: {stats:?}");
        assert_eq!(
            stats.kept.buffers,
            e.running_stats + e.bn_statistics + e.loss_weight,
            "{case}: {stats:?}"
        );
        assert_eq!(stats.kept.constants, 0, "{case}: {stats:?}");
        assert_eq!(left, 0, "{case}: files left after backward");

        // Lossless: gradients and running statistics bitwise a plain step's.
        for (name, got, want) in [
            ("recorded gradient", &recorded_grads, &grads),
            ("offloaded gradient", &offloaded_grads, &grads),
            ("recorded running statistic", &recorded_buffers, &buffers),
            ("offloaded running statistic", &offloaded_buffers, &buffers),
        ] {
            assert_eq!(got.len(), want.len(), "{case}: {name}s");
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(a.equal(b), "{case}: {name} {i} differs");
            }
        }
    }
    // The same updates: the parameters after the last step are bitwise the plain ones.
    for copy in [&recorded, &offloaded] {
        for (a, b) in copy.parameters().iter().zip(plain.parameters()) {
            assert!(a.equal(&b), "parameters differ after {STEPS} steps");
        }
    }
}
