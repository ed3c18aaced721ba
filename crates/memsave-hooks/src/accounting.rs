//! `Accounting`: which ops keep your memory for backward.
use crate::error::HookError;
use crate::scope::SavedTensorHooks;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// One tensor autograd saved while [`Accounting`] was active.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedRecord {
    /// The aten op that saved the tensor for its backward (`aten::addmm`), `unknown`
    /// when none was seen running.
    pub op: String,
    /// The `grad_fn` name of the op that produced the saved tensor (`AddmmBackward0`),
    /// `leaf` for a leaf that requires grad, `constant` for one that does not.
    pub producer: String,
    /// The label of the last [`Accounting::mark`] before the save (empty: none).
    pub mark: String,
    /// `numel * element size` of the saved tensor.
    pub bytes: u64,
    /// False when the same data was already counted (saved twice, or excluded).
    pub counted: bool,
    /// Shape of the saved tensor.
    pub shape: Vec<i64>,
}

#[derive(Debug, Default)]
struct Inner {
    mark: String,
    records: Vec<SavedRecord>,
    seen: HashSet<usize>,
}

/// Saved-tensor hooks that keep every tensor as it is and record what was saved: its
/// bytes, the op that saved it, the op that produced it and the current mark. Answers "which op keeps my
/// memory" for a forward, before any backward runs.
///
/// Clone it into [`saved_tensors_hooks`](crate::saved_tensors_hooks) and read the
/// original afterwards (clones share their records).
///
/// Each distinct data pointer is counted once (a tensor saved by two ops, or the
/// weight that `addmm` saves as a transposed view, adds nothing the second time);
/// tensors that stay alive anyway, such as parameters, can be left out with
/// [`excluding`](Self::excluding). Views at an offset into a storage count as their
/// own bytes. Tensors saved inside a checkpoint go to the checkpoint, not here.
///
/// The seed network (10 layers of `x = x + Linear(512, 512)(x)` on `[50, 100, 512]`):
/// what its forward keeps is each layer's input, saved by `addmm`, 10,240,000 bytes a
/// layer; the first layer's input is the caller's own tensor.
///
/// ```
/// use memsave_hooks::{saved_tensors_hooks, Accounting};
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let layers: Vec<_> = (0..10).map(|i| nn::linear(vs.root() / i, 512, 512, Default::default())).collect();
/// let x = Tensor::randn([50, 100, 512], (Kind::Float, Device::Cpu));
/// let mut held = vs.trainable_variables();
/// held.push(x.shallow_clone());
/// let acct = Accounting::new().excluding(&held);
/// let y = saved_tensors_hooks(acct.clone(), || {
///     let mut h = x.shallow_clone();
///     for (i, layer) in layers.iter().enumerate() {
///         acct.mark(format!("layer {i}"));
///         h = &h + layer.forward(&h);
///     }
///     h
/// })
/// .unwrap();
/// assert_eq!(acct.bytes_by_op().get("aten::addmm"), Some(&(9 * 10_240_000)));
/// assert_eq!(acct.bytes_by_mark().get("layer 3"), Some(&10_240_000));
/// assert_eq!(acct.total_bytes(), 9 * 10_240_000);
/// y.sum(Kind::Float).backward();
/// ```
#[derive(Debug, Clone, Default)]
pub struct Accounting {
    inner: Arc<Mutex<Inner>>,
}

impl Accounting {
    /// An empty account.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leaves out tensors sharing data with `tensors` (parameters, inputs you hold).
    pub fn excluding(self, tensors: &[Tensor]) -> Self {
        {
            let mut inner = self.lock();
            for t in tensors {
                inner.seen.insert(t.data_ptr() as usize);
            }
        }
        self
    }

    /// Labels every tensor saved from now on (a layer name, say).
    pub fn mark(&self, label: impl Into<String>) {
        self.lock().mark = label.into();
    }

    /// Every saved tensor, in the order autograd saved them.
    pub fn records(&self) -> Vec<SavedRecord> {
        self.lock().records.clone()
    }

    /// Counted bytes in all.
    pub fn total_bytes(&self) -> u64 {
        self.lock()
            .records
            .iter()
            .filter(|r| r.counted)
            .map(|r| r.bytes)
            .sum()
    }

    /// Counted bytes per op that saved them (`aten::addmm`): which op keeps the memory.
    pub fn bytes_by_op(&self) -> BTreeMap<String, u64> {
        self.group(|r| r.op.clone())
    }

    /// Counted bytes per op that produced the saved tensors (`AddBackward0`).
    pub fn bytes_by_producer(&self) -> BTreeMap<String, u64> {
        self.group(|r| r.producer.clone())
    }

    /// Counted bytes per mark.
    pub fn bytes_by_mark(&self) -> BTreeMap<String, u64> {
        self.group(|r| r.mark.clone())
    }

    fn group(&self, key: impl Fn(&SavedRecord) -> String) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for r in self.lock().records.iter().filter(|r| r.counted) {
            *out.entry(key(r)).or_insert(0) += r.bytes;
        }
        out
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Which node produced `t`, as [`Accounting`] reports it: its `grad_fn` name
/// (`AddmmBackward0`), `leaf` for a tensor that requires grad without one, `constant`
/// otherwise.
pub fn producer_of(t: &Tensor) -> Result<String, HookError> {
    Ok(match memsave_sys::hooks::grad_fn_name(t)? {
        Some(name) => name,
        None if t.requires_grad() => "leaf".to_owned(),
        None => "constant".to_owned(),
    })
}

impl SavedTensorHooks for Accounting {
    type Packed = Tensor;

    fn pack(&self, tensor: &Tensor) -> Result<Tensor, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        true
    }

    fn pack_saved_by(&self, tensor: &Tensor, saved_by: Option<&str>) -> Result<Tensor, HookError> {
        let bytes = memsave_sys::tensor::nbytes(tensor);
        let producer = producer_of(tensor)?;
        let mut inner = self.lock();
        let counted = inner.seen.insert(tensor.data_ptr() as usize);
        let mark = inner.mark.clone();
        inner.records.push(SavedRecord {
            op: saved_by.unwrap_or("unknown").to_owned(),
            producer,
            mark,
            bytes,
            counted,
            shape: tensor.size(),
        });
        Ok(tensor.shallow_clone())
    }

    fn unpack(&self, packed: &Tensor) -> Result<Tensor, HookError> {
        Ok(packed.shallow_clone())
    }
}
