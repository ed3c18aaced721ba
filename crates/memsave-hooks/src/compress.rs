//! `Compress`: saved activations stored smaller by a [`Codec`] until backward.
use crate::codec::{Codec, Encoded};
use crate::distinct::{distinct, Expanded};
use crate::error::{HookError, PolicyError};
use crate::policy::{KeptStats, SavePolicy, SavedInfo, Selector};
use crate::saved_once::{Lookup, Region, SavedOnce, View};
use crate::scope::SavedTensorHooks;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::{TchError, Tensor};

/// Saved-tensor hooks that store saved floating-point activations with a [`Codec`]
/// (bf16, fp16, fp8 e4m3 or int8 blockwise) and restore their dtype in backward
/// (ActNN's idea, without the 2-bit kernels).
///
/// **What is compressed.** Only what would otherwise stay in memory for backward
/// alone, and only where the codec's error cannot wreck the gradients: the
/// [`SavePolicy::lossy`] defaults keep as they are
///
/// - parameters (and their views), the tensors given to
///   [`excluding`](Self::excluding), buffers (floating-point vectors and scalars
///   without a `grad_fn`: running statistics) and constants (tensors without a
///   `grad_fn` that an earlier step saved and that are still alive: a table a layer
///   holds; known from the second step on, see [`SavePolicy`]): they stay alive
///   anyway, so a stored form would only add bytes;
/// - the statistics of normalization ops ([`NORM_OPS`](crate::NORM_OPS): batch norm's
///   saved mean and inverse std, layer and group norm's mean and rstd): backward
///   scales each channel by them, and int8 blocks spanning channels of different
///   spreads stored the small ones as zero or one step;
/// - tensors under 4 KiB ([`DEFAULT_MIN_BYTES`](crate::DEFAULT_MIN_BYTES)).
///
/// What softmax and the batched matrix multiplies save (attention written out: the
/// `[B, H, T, T]` probabilities, `q`, `k`, `v`) is compressed in blocks of at most 64
/// elements within its rows, int8 without keeping signs
/// ([`ROW_BLOCK_OPS`](crate::ROW_BLOCK_OPS)): with the general blocks, int8's
/// gradients were 7.2e-2 to 1.1e-1 off (relative L2) on small GPT- and LLaMA-style
/// decoders that write attention out, 1.8e-2 to 2.5e-2 with these (the issue's bound
/// is 3e-2).
///
/// The input of a normalization op is compressed with blocks that never span two
/// channels (batch norm), two planes (group norm) or two rows (layer and RMS norm), so
/// each block's scale follows the spread backward divides by; where the op subtracts
/// a mean (all but RMS norm), each int8 or fp8 block is stored relative to its
/// midrange and each bf16 or fp16 group relative to its mean. Backward reads such an
/// input only through `x - mean`, and a channel whose mean is many times its spread
/// (a handful of values per channel: small batches, deep layers) lost that difference
/// stored relative to zero: bf16 gradients were off by 1.4e-2 (relative L2) on
/// ResNet-18 with 4 images of 32 x 32, int8's by 3.2e-2 on ResNet-50, 0.18 on a
/// conv/BN stack whose channels sit 200 spreads from zero (3.6e-3, 7.9e-3 and 9.2e-3
/// centered). Such an input whose stored form would not be smaller (two values per
/// channel: two bytes, a scale and an offset for eight bytes) is kept as it is.
/// Change the rules with
/// [`min_bytes`](Self::min_bytes), [`keep_ops`](Self::keep_ops), [`pack_if`](Self::pack_if)
/// or a whole [`policy`](Self::policy); [`stats`](Self::stats) counts what was kept
/// and why, and [`check`](Self::check) reports `keep_ops` names never seen. Knowing
/// the saving op costs a (C++) callback per op while the scope is open.
///
/// Trap: before these rules, int8 over a batch-norm network's forward made the
/// gradients' relative L2 error 0.288 on ResNet-18 and 2.13 on MobileNetV2 (1.2e-4 on
/// an MLP), with no warning; a policy that packs what the defaults keep
/// (`pack_if(|_| true)`) brings that back. The codec's own traps are on [`Codec`]
/// (tensors it does not take are kept as they are). Gradients are approximate: each
/// saved value carries the codec's error, and the gradient error grows with depth.
/// The stored form is freed when backward has used it.
///
/// A saved tensor expanded from a smaller one (stride 0 in a dimension: `expand`,
/// broadcasting) is stored as the smaller one and expanded back in backward: a
/// `[1, 1024]` row expanded to `[256, 1024]` stores 1,024 values, not 262,144.
///
/// A tensor that several autograd nodes save is stored once while its stored form is
/// alive, whatever layout each node saves it in: a ReLU saves its output and the
/// Linear after it the same tensor (or a flattened view of it) as its input; an
/// attention saves its output in its own strided layout and the output projection a
/// contiguous view of the same memory. A later save shares the first one's form when
/// it has the same storage, dtype and version and either the same place, shape and
/// strides, or every element inside the memory the first one fills (a first save
/// without gaps: contiguous, transposed, permuted); its unpack lays the first save's
/// decoded values out as the memory held them and views them with its own sizes and
/// strides, so both saves read the same numbers. Storing it twice would hold more than
/// the uncompressed tensor, which the forward's nodes shared (a ViT's attention output
/// was stored twice before). Traps: the first save decides the stored form. A
/// normalization's input saved first by another op shares that op's form, stored
/// relative to zero rather than centered; saved first by the normalization, the other
/// op reads the centered form, which restores no value exactly, zero included (a sign
/// or `x > 0` mask that op computes from it in backward may flip where the tensor is
/// zero). A write through `Tensor::data()` between the two saves does not bump the
/// version autograd checks, so the second save shares the first's stored form
/// (without hooks autograd would not notice such a write either).
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
/// assert_eq!((stats.tensors, stats.passed_through, stats.kept.excluded), (1, 1, 1));
/// assert_eq!(stats.original_bytes, 64 * 256 * 4);
/// assert_eq!(stats.stored_bytes, 64 * 256 + 16 * 4);
/// loss.backward();
/// assert!(w.grad().defined());
/// ```
#[derive(Debug, Clone)]
pub struct Compress {
    codec: Codec,
    select: Selector,
    stats: Arc<Counters>,
    stored: Arc<SavedOnce<Inner>>,
}

#[derive(Debug, Default)]
struct Counters {
    tensors: AtomicU64,
    passed_through: AtomicU64,
    shared: AtomicU64,
    original_bytes: AtomicU64,
    stored_bytes: AtomicU64,
}

/// What [`Compress`] packed so far (all packs since it was made, freed or not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompressStats {
    /// Tensors stored by the codec.
    pub tensors: u64,
    /// Tensors kept as they were: those of `kept`, and those the codec does not take
    /// (not floating point, inf or NaN, see [`Codec`]).
    pub passed_through: u64,
    /// Tensors the policy kept, by reason.
    pub kept: KeptStats,
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
pub struct SharedEncoded {
    inner: Arc<Inner>,
    /// This pack's tensor over the stored memory, when it is another view of it than
    /// the tensor stored (other sizes, strides or place).
    view: Option<View>,
}

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
        self.inner.encoded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The saved tensor rebuilt: decoded and expanded back if it was expanded, or,
    /// for another view of the memory stored, the decoded values laid out in that
    /// memory's order and viewed with this pack's sizes and strides (the numbers of
    /// the first save's decode, each where the memory held it).
    fn f_decode(&self) -> Result<Tensor, TchError> {
        let decoded = self.lock().f_decode()?;
        match &self.view {
            Some(view) => view.f_of(&view.region().f_from_values(&decoded)?),
            None => Expanded::restore(self.inner.expanded.as_ref(), decoded),
        }
    }
}

impl Compress {
    /// Hooks storing saved activations with `codec` under [`SavePolicy::lossy`].
    pub fn new(codec: Codec) -> Self {
        Self {
            codec,
            select: Selector::new(SavePolicy::lossy()),
            stats: Arc::default(),
            stored: Arc::default(),
        }
    }

    /// Also passes through tensors sharing data with `tensors` (inputs you hold,
    /// parameters' views).
    pub fn excluding(mut self, tensors: &[Tensor]) -> Self {
        self.select = self.select.excluding(tensors);
        self
    }

    /// Decides what is compressed by `policy` instead of [`SavePolicy::lossy`]; the
    /// exclusions stay.
    pub fn policy(mut self, policy: SavePolicy) -> Self {
        self.select = self.select.policy(policy);
        self
    }

    /// Keeps tensors of fewer than `bytes` bytes as they are (default
    /// [`DEFAULT_MIN_BYTES`](crate::DEFAULT_MIN_BYTES); 0 compresses any size). See
    /// [`SavePolicy::min_bytes`].
    pub fn min_bytes(mut self, bytes: u64) -> Self {
        let policy = self.select.current().clone().min_bytes(bytes);
        self.select = self.select.policy(policy);
        self
    }

    /// Keeps every tensor saved or produced by one of `ops`. See
    /// [`SavePolicy::keep_ops`]; [`check`](Self::check) reports names never seen.
    pub fn keep_ops<S: AsRef<str>>(mut self, ops: &[S]) -> Self {
        let policy = self.select.current().clone().keep_ops(ops);
        self.select = self.select.policy(policy);
        self
    }

    /// Compresses exactly the tensors (other than parameters, excluded and empty
    /// ones) for which `f` returns true. See [`SavePolicy::pack_if`].
    pub fn pack_if(mut self, f: impl Fn(&SavedInfo<'_>) -> bool + Send + Sync + 'static) -> Self {
        let policy = self.select.current().clone().pack_if(f);
        self.select = self.select.policy(policy);
        self
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// `Err` ([`PolicyError::UnseenOps`]) listing the [`keep_ops`](Self::keep_ops)
    /// names that no saved tensor's saving op or producer matched so far, with the
    /// similar names seen. Call it after the first step: a name no save matched there
    /// is a typo or an op this libtorch lowers to another, and keeps nothing. `Ok`
    /// when `keep_ops` names none.
    pub fn check(&self) -> Result<(), PolicyError> {
        self.select.check()
    }

    /// What was packed so far.
    pub fn stats(&self) -> CompressStats {
        let c = &self.stats;
        CompressStats {
            tensors: c.tensors.load(Ordering::Relaxed),
            passed_through: c.passed_through.load(Ordering::Relaxed),
            kept: self.select.kept(),
            shared: c.shared.load(Ordering::Relaxed),
            original_bytes: c.original_bytes.load(Ordering::Relaxed),
            stored_bytes: c.stored_bytes.load(Ordering::Relaxed),
        }
    }
}

impl SavedTensorHooks for Compress {
    type Packed = Compressed;

    fn pack(&self, tensor: &Tensor) -> Result<Compressed, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        self.select.records_ops()
    }

    fn pack_saved_by(
        &self,
        tensor: &Tensor,
        saved_by: Option<&str>,
    ) -> Result<Compressed, HookError> {
        let c = &self.stats;
        let kept = || {
            c.passed_through.fetch_add(1, Ordering::Relaxed);
            Ok(Compressed::Kept(tensor.shallow_clone()))
        };
        let (base, expanded) = distinct(tensor)?;
        let bytes = (base.numel() * base.kind().elt_size_in_bytes()) as u64;
        let decision = self.select.decide(tensor, bytes, saved_by)?;
        if decision.kept.is_some() {
            return kept();
        }
        let lookup = self.stored.get_or_make(tensor, Region::of(&base), || {
            let codec = if decision.row_blocks {
                self.codec.block_at_most(crate::policy::ROW_BLOCK)
            } else {
                self.codec
            };
            let Some(e) = codec.f_encode_grouped(
                &base,
                &decision.groups,
                decision.centered,
                !decision.row_blocks,
            )?
            else {
                return Ok(None);
            };
            // A normalization's input in groups of a few elements (each with its
            // scale and offset) may store more than the tensor: kept as it is then.
            if !decision.groups.is_empty() && e.stored_bytes() >= e.original_bytes() {
                return Ok(None);
            }
            c.tensors.fetch_add(1, Ordering::Relaxed);
            c.original_bytes
                .fetch_add(e.original_bytes(), Ordering::Relaxed);
            c.stored_bytes
                .fetch_add(e.stored_bytes(), Ordering::Relaxed);
            Ok(Some(Arc::new(Inner {
                encoded: Mutex::new(e),
                expanded,
            })))
        })?;
        Ok(Compressed::Encoded(match lookup {
            Lookup::Declined => return kept(),
            Lookup::Made(inner) => SharedEncoded { inner, view: None },
            Lookup::Shared(inner, view) => {
                c.shared.fetch_add(1, Ordering::Relaxed);
                SharedEncoded { inner, view }
            }
        }))
    }

    fn unpack(&self, packed: &Compressed) -> Result<Tensor, HookError> {
        Ok(match packed {
            Compressed::Kept(t) => t.shallow_clone(),
            Compressed::Encoded(e) => e.f_decode()?,
        })
    }
}
