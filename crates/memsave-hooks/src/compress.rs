//! `Compress`: saved activations stored smaller by a [`Codec`] until backward.
use crate::codec::{Codec, Encoded};
use crate::error::HookError;
use crate::pass_through::PassThrough;
use crate::scope::SavedTensorHooks;
use memsave_sys::tensor::WeakStorage;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tch::{Kind, TchError, Tensor};

/// What a packing hook keeps of a saved tensor: its distinct elements.
///
/// A tensor expanded from a smaller one (stride 0 in a dimension, as `expand` and
/// broadcasting make) shares one element among all the positions of that dimension.
/// Copying it (`contiguous`, a codec, a copy to another device) would store every
/// repeat: a `[1, 1024]` row expanded to `[256, 1024]` would take 256 times its bytes.
/// So the hooks keep the tensor narrowed to size 1 in each such dimension and
/// [`Expanded::restore`] expands it back at unpack: the shape and dtype autograd
/// checks are those of the saved tensor; only the strides differ from a copy's.
pub(crate) fn distinct(t: &Tensor) -> Result<(Tensor, Option<Expanded>), TchError> {
    let size = t.size();
    let repeated = |(d, (&n, &s)): (usize, (&i64, &i64))| (s == 0 && n > 1).then_some(d);
    let dims: Vec<usize> = size
        .iter()
        .zip(&t.stride())
        .enumerate()
        .filter_map(repeated)
        .collect();
    if dims.is_empty() {
        return Ok((t.shallow_clone(), None));
    }
    let mut base = t.shallow_clone();
    for d in dims {
        base = base.f_narrow(d as i64, 0, 1)?;
    }
    Ok((base, Some(Expanded(size))))
}

/// The sizes of a saved tensor that [`distinct`] narrowed.
#[derive(Debug, Clone)]
pub(crate) struct Expanded(Vec<i64>);

impl Expanded {
    /// `base`, as [`distinct`] kept it (or a copy of it), expanded back to the saved
    /// tensor's sizes; `base` as it is with `None`.
    pub fn restore(expanded: Option<&Expanded>, base: Tensor) -> Result<Tensor, TchError> {
        match expanded {
            None => Ok(base),
            Some(Expanded(size)) => base.f_expand(size, false),
        }
    }
}

/// Saved-tensor hooks that store every saved floating-point activation with a
/// [`Codec`] (bf16, fp16, fp8 e4m3 or int8 blockwise) and restore its dtype in
/// backward (ActNN's idea, without the 2-bit kernels).
///
/// Parameters and the tensors given to [`excluding`](Self::excluding) pass through
/// untouched (see [`PassThrough`]: compressing a tensor that stays alive adds bytes),
/// as do the tensors the codec does not take (see [`Codec`]). Gradients are
/// approximate: each saved value carries the codec's error, and the gradient error
/// grows with depth. The stored form is freed when backward has used it.
///
/// A saved tensor expanded from a smaller one (stride 0 in a dimension: `expand`,
/// broadcasting) is stored as the smaller one and expanded back in backward: a
/// `[1, 1024]` row expanded to `[256, 1024]` stores 1,024 values, not 262,144.
///
/// A tensor that several autograd nodes save (a ReLU saves its output, and the
/// Linear after it saves the same tensor as its input) is stored once while its
/// stored form is alive: same storage, place, shape, strides, dtype and version.
/// Storing it twice would hold more than the uncompressed tensor, which the
/// forward's nodes shared. Trap: a write through `Tensor::data()` between the two
/// saves does not bump the version autograd checks, so the second save shares the
/// first's stored form (without hooks autograd would not notice such a write either).
///
/// Clones share their [`CompressStats`] and what they stored; read the stats on the
/// original after the forward.
///
/// ```
/// use memsave_hooks::{saved_tensors_hooks, Codec, Compress};
/// use tch::{Device, Kind, Tensor};
///
/// let w = Tensor::randn([256, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let x = Tensor::randn([64, 256], (Kind::Float, Device::Cpu));
/// let int8 = Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
/// let loss = saved_tensors_hooks(int8.clone(), || x.matmul(&w).tanh().sum(Kind::Float)).unwrap();
/// // tanh saved its 64 x 256 f32 output as int8 plus one f32 scale per 1,024 values;
/// // mm saved only the caller's x (for w's gradient), passed through.
/// let stats = int8.stats();
/// assert_eq!((stats.tensors, stats.passed_through), (1, 1));
/// assert_eq!(stats.original_bytes, 64 * 256 * 4);
/// assert_eq!(stats.stored_bytes, 64 * 256 + 16 * 4);
/// loss.backward();
/// assert!(w.grad().defined());
/// ```
#[derive(Debug, Clone)]
pub struct Compress {
    codec: Codec,
    pass: PassThrough,
    stats: Arc<Counters>,
    stored: Arc<Mutex<Vec<Stored>>>,
}

#[derive(Debug, Default)]
struct Counters {
    tensors: AtomicU64,
    passed_through: AtomicU64,
    shared: AtomicU64,
    original_bytes: AtomicU64,
    stored_bytes: AtomicU64,
}

/// A tensor stored so far, to find it when it is saved again.
#[derive(Debug)]
struct Stored {
    storage: WeakStorage,
    data_ptr: usize,
    size: Vec<i64>,
    stride: Vec<i64>,
    kind: Kind,
    version: u64,
    encoded: Weak<Inner>,
}

impl Stored {
    fn is(&self, t: &Tensor, version: u64) -> Result<bool, HookError> {
        Ok(self.data_ptr == t.data_ptr() as usize
            && self.version == version
            && self.kind == t.kind()
            && self.size == t.size()
            && self.stride == t.stride()
            && self.storage.is_storage_of(t)?)
    }
}

/// What [`Compress`] packed so far (all packs since it was made, freed or not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompressStats {
    /// Tensors stored by the codec.
    pub tensors: u64,
    /// Tensors kept as they were (parameters, excluded, not taken by the codec).
    pub passed_through: u64,
    /// Tensors saved again while their stored form was alive, sharing it (not in
    /// `tensors` or the byte counts).
    pub shared: u64,
    /// Bytes of the compressed tensors as they were: of their distinct elements,
    /// so a tensor expanded from a smaller one counts the smaller one's bytes.
    pub original_bytes: u64,
    /// Bytes of their stored form, scales included.
    pub stored_bytes: u64,
}

impl CompressStats {
    /// Bytes that compression saved: `original_bytes - stored_bytes`.
    pub fn saved_bytes(&self) -> u64 {
        self.original_bytes.saturating_sub(self.stored_bytes)
    }
}

/// A tensor packed by [`Compress`]: kept as it was, or its stored form.
#[derive(Debug)]
pub enum Compressed {
    /// Passed through untouched.
    Kept(Tensor),
    /// Stored by the codec (shared by the packs of one tensor saved twice).
    Encoded(SharedEncoded),
}

/// A stored form, shared by the packs of one tensor that several nodes saved.
#[derive(Debug, Clone)]
pub struct SharedEncoded(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    encoded: Mutex<Encoded>,
    /// The saved tensor's sizes when only its distinct elements were encoded.
    expanded: Option<Expanded>,
}

impl SharedEncoded {
    /// Bytes of the stored form, scales included.
    pub fn stored_bytes(&self) -> u64 {
        self.lock().stored_bytes()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Encoded> {
        self.0.encoded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The saved tensor rebuilt: decoded, and expanded back if it was expanded.
    fn f_decode(&self) -> Result<Tensor, TchError> {
        let decoded = self.lock().f_decode()?;
        Expanded::restore(self.0.expanded.as_ref(), decoded)
    }
}

impl Compress {
    /// Hooks storing saved activations with `codec`; parameters pass through.
    pub fn new(codec: Codec) -> Self {
        Self {
            codec,
            pass: PassThrough::new(),
            stats: Arc::default(),
            stored: Arc::default(),
        }
    }

    /// Also passes through tensors sharing data with `tensors` (inputs you hold,
    /// parameters' views).
    pub fn excluding(mut self, tensors: &[Tensor]) -> Self {
        self.pass = self.pass.excluding(tensors);
        self
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// What was packed so far.
    pub fn stats(&self) -> CompressStats {
        let c = &self.stats;
        CompressStats {
            tensors: c.tensors.load(Ordering::Relaxed),
            passed_through: c.passed_through.load(Ordering::Relaxed),
            shared: c.shared.load(Ordering::Relaxed),
            original_bytes: c.original_bytes.load(Ordering::Relaxed),
            stored_bytes: c.stored_bytes.load(Ordering::Relaxed),
        }
    }
}

impl SavedTensorHooks for Compress {
    type Packed = Compressed;

    fn pack(&self, tensor: &Tensor) -> Result<Compressed, HookError> {
        let c = &self.stats;
        if self.pass.contains(tensor)? {
            c.passed_through.fetch_add(1, Ordering::Relaxed);
            return Ok(Compressed::Kept(tensor.shallow_clone()));
        }
        let version = memsave_sys::tensor::version(tensor)?;
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        stored.retain(|s| s.encoded.strong_count() > 0);
        for s in stored.iter() {
            if s.is(tensor, version)? {
                if let Some(encoded) = s.encoded.upgrade() {
                    c.shared.fetch_add(1, Ordering::Relaxed);
                    return Ok(Compressed::Encoded(SharedEncoded(encoded)));
                }
            }
        }
        let (base, expanded) = distinct(tensor)?;
        let Some(e) = self.codec.f_encode(&base)? else {
            c.passed_through.fetch_add(1, Ordering::Relaxed);
            return Ok(Compressed::Kept(tensor.shallow_clone()));
        };
        c.tensors.fetch_add(1, Ordering::Relaxed);
        c.original_bytes
            .fetch_add(e.original_bytes(), Ordering::Relaxed);
        c.stored_bytes
            .fetch_add(e.stored_bytes(), Ordering::Relaxed);
        let e = Arc::new(Inner {
            encoded: Mutex::new(e),
            expanded,
        });
        if tensor.numel() > 0 {
            stored.push(Stored {
                storage: WeakStorage::new(tensor)?,
                data_ptr: tensor.data_ptr() as usize,
                size: tensor.size(),
                stride: tensor.stride(),
                kind: tensor.kind(),
                version,
                encoded: Arc::downgrade(&e),
            });
        }
        Ok(Compressed::Encoded(SharedEncoded(e)))
    }

    fn unpack(&self, packed: &Compressed) -> Result<Tensor, HookError> {
        Ok(match packed {
            Compressed::Kept(t) => t.shallow_clone(),
            Compressed::Encoded(e) => e.f_decode()?,
        })
    }
}
