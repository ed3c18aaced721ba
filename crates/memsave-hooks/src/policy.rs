//! `SavePolicy`: which saved tensors a packing hook packs, and which it keeps as they
//! are because packing them would add bytes or wreck the gradients.
use crate::error::{HookError, PolicyError};
use crate::pass_through::PassThrough;
use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// Saved tensors smaller than this (bytes of their distinct elements) are kept as they
/// are by [`Compress`](crate::Compress) unless told otherwise: 4 KiB.
///
/// Below it, int8 would save at most 3 KiB a tensor while paying a pack (and on CUDA
/// a host synchronization) for it, and the tensors there are mostly per-channel or
/// per-row values (biases' inputs, statistics, scalars) that backward scales
/// everything else by.
pub const DEFAULT_MIN_BYTES: u64 = 4096;

/// The normalization ops [`Compress`](crate::Compress) knows, as the saving op's name
/// (what [`Accounting`](crate::Accounting) reports): libtorch lowers `batch_norm`,
/// `layer_norm`, `group_norm`, `instance_norm` and `rms_norm` to these, depending on
/// version and device. Their statistics are kept as they are and their input is
/// compressed with blocks that never mix two channels (batch and instance norm), two
/// (sample, channel) planes (group norm) or two rows (layer and RMS norm): backward
/// divides each by its own spread. Where the op subtracts a mean (all but RMS norm),
/// the input is stored relative to each block's (int8, fp8) or group's (bf16, fp16)
/// midpoint, since backward reads it only through `x - mean`.
pub const NORM_OPS: &[&str] = &[
    "aten::native_batch_norm",
    "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training",
    "aten::_batch_norm_with_update",
    "aten::_batch_norm_no_update",
    "aten::cudnn_batch_norm",
    "aten::miopen_batch_norm",
    "aten::native_group_norm",
    "aten::native_layer_norm",
    "aten::_fused_rms_norm",
];

/// The ops whose saved tensors [`Compress`](crate::Compress) stores in row blocks, as
/// the saving op's name: softmax (`aten::_softmax`, `aten::_safe_softmax`), which
/// saves its output, a probability distribution along the last dimension, and the
/// batched matrix multiplies (`aten::bmm`, `aten::baddbmm`), which save their inputs:
/// attention written out (`q.matmul(&k.transpose(-2, -1))`, a scale, a mask,
/// `softmax(-1)`, maybe dropout, `.matmul(&v)`) saves its `[B, H, T, T]`
/// probabilities there (by softmax, and by the matmul with `v` as a `[B * H, T, T]`
/// view, the stored form shared; after dropout, a tensor of its own that only the
/// matmul saves), and `q`, `k` and `v`. Blockwise codecs store these in blocks of at
/// most [`ROW_BLOCK`] elements that never span two rows (of the last
/// dimension), and int8 rounds them to nearest without keeping signs (a value too
/// small for its block's step is stored as zero, not as one step): backward reads
/// them linearly (softmax's `p * (g - sum(g * p))`, a matmul's `a^T g`), never
/// through a sign or a mask.
///
/// Why: in 1,024-element blocks a sharp row of probabilities (one value near 1) set
/// the step for its neighbours' small values, and keeping signs stored each tiny
/// probability as one step (`max / 127`): a row of 256 can gain more mass than it
/// has. int8's gradient relative L2 was 7.2e-2 to 1.1e-1 on small GPT- and
/// LLaMA-style decoders with attention written out, 1.8e-2 to 2.5e-2 with these
/// rules (memsave-hooks' `written_attention` tests; with attention dropout 0.1 the GPT
/// was 3.0e-2 to 4.6e-2 with softmax's output alone in row blocks); softmax's output
/// in row blocks with the sign rule kept gave 4.5e-2 to 5.9e-2 (without dropout).
///
/// Traps: a softmax over another dimension than the last is still stored in rows of
/// the last one (each block within its own range, but rows then mix distributions).
/// A tensor that one of these ops saves first and a later op saves again shares the
/// form without the sign rule, also where that op reads a sign (see
/// [`Compress`](crate::Compress) on shared forms).
pub const ROW_BLOCK_OPS: &[&str] = &[
    "aten::_softmax",
    "aten::_safe_softmax",
    "aten::bmm",
    "aten::baddbmm",
];

/// Elements per block, at most, of what the ops of [`ROW_BLOCK_OPS`] save, under a
/// blockwise codec: 64, one f32 scale per 64 int8 values (6% more than the
/// data, against 0.4% for 1,024-element blocks). Blocks of 1,024 within each row gave
/// 3.4e-2 on a 4-layer LLaMA-style decoder over 256 tokens, 64 gave 3.0e-2 (softmax's
/// output alone in row blocks).
pub const ROW_BLOCK: NonZeroUsize = match NonZeroUsize::new(64) {
    Some(n) => n,
    None => unreachable!(),
};

/// Which elements of a normalization op's input share its statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Norm {
    /// One per channel (dimension 1): batch norm.
    Channels,
    /// One per (sample, channel group): group norm; grouped here by (dim 0, dim 1).
    Planes,
    /// One per row (all but the last dimension): layer norm.
    Rows,
    /// One per row, without a mean: RMS norm (backward reads `x` itself, not its
    /// deviation from a mean, so it is stored uncentered).
    RmsRows,
}

impl Norm {
    /// The dimensions whose indices must not share a codec block.
    fn groups(self, dims: usize) -> Vec<usize> {
        match self {
            Norm::Channels => vec![1],
            Norm::Planes => vec![0, 1],
            Norm::Rows | Norm::RmsRows => (0..dims.saturating_sub(1)).collect(),
        }
    }

    /// Whether the op subtracts a mean, so that backward reads its input only through
    /// the deviations from it.
    fn centered(self) -> bool {
        self != Norm::RmsRows
    }
}

fn norm_of(op: &str) -> Option<Norm> {
    if !NORM_OPS.contains(&op) {
        return None;
    }
    Some(if op.contains("group_norm") {
        Norm::Planes
    } else if op.contains("layer_norm") {
        Norm::Rows
    } else if op.contains("rms_norm") {
        Norm::RmsRows
    } else {
        Norm::Channels
    })
}

/// The autograd node an aten op makes (`aten::native_group_norm` ->
/// `NativeGroupNormBackward`), without its overload number.
fn node_of(op: &str) -> String {
    let name = op.rsplit("::").next().unwrap_or(op);
    let mut node: String = name
        .split('_')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect();
    node.push_str("Backward");
    node
}

/// Why a packing hook kept a saved tensor as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Kept {
    /// A parameter (a leaf that requires grad) or a view of one: alive anyway.
    Parameter,
    /// Shares its data with a tensor given to `excluding`: alive anyway.
    Excluded,
    /// No elements: nothing to store.
    Empty,
    /// Saved or produced by an op named in [`SavePolicy::keep_ops`].
    Op,
    /// Statistics saved by a normalization op ([`NORM_OPS`]): everything it saves but
    /// its input and parameters, i.e. its outputs (the saved mean and inverse std,
    /// which backward multiplies every element by) and its running statistics.
    Statistics,
    /// A floating-point vector or scalar without a `grad_fn` (at most one dimension
    /// larger than 1): running statistics and other buffers (alive anyway), the
    /// per-channel statistics batch norm saves.
    Buffer,
    /// A constant: a tensor without a `grad_fn` that an earlier hook scope on this
    /// thread saved, still alive (the same storage) when this one saves it again: a
    /// table or mask a layer holds, a buffer that is not a vector, a batch tensor you
    /// refill in place. Alive anyway.
    Constant,
    /// Smaller than [`SavePolicy::min_bytes`].
    Small,
    /// The [`SavePolicy::pack_if`] closure said so, where the defaults would pack it.
    Policy,
}

const KEPT: [Kept; 9] = [
    Kept::Parameter,
    Kept::Excluded,
    Kept::Empty,
    Kept::Op,
    Kept::Statistics,
    Kept::Buffer,
    Kept::Constant,
    Kept::Small,
    Kept::Policy,
];

/// How many saved tensors a store kept as they were, by reason (see [`Kept`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptStats {
    /// Parameters and their views.
    pub parameters: u64,
    /// Tensors sharing data with those given to `excluding`.
    pub excluded: u64,
    /// Empty tensors.
    pub empty: u64,
    /// Saved or produced by an op of [`SavePolicy::keep_ops`].
    pub ops: u64,
    /// Normalization statistics.
    pub statistics: u64,
    /// Floating-point vectors and scalars without a `grad_fn`.
    pub buffers: u64,
    /// Constants: tensors without a `grad_fn` found alive across hook scopes.
    pub constants: u64,
    /// Under [`SavePolicy::min_bytes`].
    pub small: u64,
    /// Refused by the [`SavePolicy::pack_if`] closure.
    pub policy: u64,
}

impl KeptStats {
    /// All kept tensors.
    pub fn total(&self) -> u64 {
        self.parameters
            + self.excluded
            + self.empty
            + self.ops
            + self.statistics
            + self.buffers
            + self.constants
            + self.small
            + self.policy
    }

    /// The count for `reason`.
    pub fn get(&self, reason: Kept) -> u64 {
        match reason {
            Kept::Parameter => self.parameters,
            Kept::Excluded => self.excluded,
            Kept::Empty => self.empty,
            Kept::Op => self.ops,
            Kept::Statistics => self.statistics,
            Kept::Buffer => self.buffers,
            Kept::Constant => self.constants,
            Kept::Small => self.small,
            Kept::Policy => self.policy,
        }
    }
}

/// What a [`SavePolicy::pack_if`] closure is told about a saved tensor.
#[derive(Debug, Clone, Copy)]
pub struct SavedInfo<'a> {
    /// The aten op that saved it (`aten::native_batch_norm`); `None` when unknown (a
    /// checkpoint boundary handed to a store by the planner).
    pub op: Option<&'a str>,
    /// The autograd node that produced it (`ConvolutionBackward0`); `None` for a
    /// tensor without one (it does not require grad: a buffer, a constant, a mask, the
    /// batch).
    pub producer: Option<&'a str>,
    /// Its shape.
    pub shape: &'a [i64],
    /// Its dtype.
    pub kind: Kind,
    /// Bytes of its distinct elements (an expanded tensor counts its base's).
    pub bytes: u64,
    /// What the policy's rules decide without the closure: `Some(reason)` keeps it.
    pub kept_by_default: Option<Kept>,
}

type PackIf = dyn Fn(&SavedInfo<'_>) -> bool + Send + Sync;

/// Which saved tensors a packing hook ([`Compress`](crate::Compress),
/// [`DiskOffload`](crate::DiskOffload), [`SaveOnCpu`](crate::SaveOnCpu)) packs, and
/// which it keeps as they are.
///
/// Always kept, whatever the policy says (packing them never saves memory):
/// parameters and their views, the tensors given to the store's `excluding`, and
/// empty tensors. Kept by the default rules, in this order (the first that applies
/// is the [`Kept`] reason the stats count):
///
/// 1. **[`keep_ops`](Self::keep_ops)**: tensors saved by one of these ops, or
///    produced by one (none by default).
/// 2. **Normalization statistics** ([`lossy`](Self::lossy) only): what an op of
///    [`NORM_OPS`] saves that is not its input, i.e. a tensor without a `grad_fn` or
///    produced by that op's own node (batch norm's saved mean and inverse std, layer
///    and group norm's mean and rstd). Backward multiplies every element of a channel
///    by the inverse std: int8 blocks shared across channels stored small ones as 0
///    or one step, and the gradients' relative L2 error reached 2.13 on MobileNetV2.
///    The input of these ops is packed, with blocks of its own per channel, plane or
///    row, centered where the op subtracts a mean (see [`NORM_OPS`]).
///    What the ops of [`ROW_BLOCK_OPS`] save (softmax's output, a batched matmul's
///    inputs; [`lossy`](Self::lossy) only) is packed in blocks within rows, without
///    int8's sign rule (see there).
/// 3. **Buffers**: floating-point tensors without a `grad_fn` (they do not require
///    grad) that have at most one dimension larger than 1: running statistics, other
///    per-channel buffers and scalars (alive anyway), and batch norm's saved mean
///    and inverse std, which the forward makes but which are a few bytes per channel,
///    not worth a file or a copy each.
/// 4. **Constants**: a tensor without a `grad_fn` that a hook scope on this thread
///    saved before, in a scope that has ended, and that is still alive (the same
///    storage) when this scope saves it again: a table or mask a layer holds, a
///    buffer that is not a vector, a batch tensor refilled in place. Something
///    outside the steps holds it, so a packed copy would only add bytes.
/// 5. **Small tensors**: fewer than [`min_bytes`](Self::min_bytes) bytes of distinct
///    elements ([`DEFAULT_MIN_BYTES`] for [`lossy`](Self::lossy), 0 for
///    [`exact`](Self::exact)).
///
/// **How constants are told apart.** From inside a pack hook, a tensor without a
/// `grad_fn` may stay alive (a constant a layer holds, the caller's batch) or be made
/// by the forward and dropped after it (a dropout mask, max-pool's indices, a mask
/// computed each step): their handle counts are alike (3 for both a constant table
/// and a CPU dropout mask in libtorch 2.13), and the hook does not see when a tensor
/// was allocated. What it sees is a tensor saved by an earlier scope still alive when
/// a later one saves it again, so constants are known **from the second step on**
/// (one hook scope per step, on the same thread; stores may be made fresh for each
/// step, what was seen is kept per thread). Trap: the first step packs them (a
/// constant is written to disk or compressed once); give them to `excluding` to keep
/// them from the first step. A tensor made anew each step is never a constant.
///
/// **The batch** counts as alive anyway only when given to `excluding` (memsave-plan
/// gives it, and the target): a hook cannot tell whether you hold it until backward
/// or let the forward drop it (a closure that takes it by value), where packing it
/// frees its memory. A batch tensor you refill in place each step is a constant from
/// the second step on.
///
/// [`pack_if`](Self::pack_if) overrides rules 1-5 per tensor. The names given to
/// [`keep_ops`](Self::keep_ops) are checked by the store's `check()` after a step: a
/// name that no save matched (a typo, or an op this libtorch lowers differently) is an
/// `Err` listing it with the similar names seen. Names are compared, exactly, with
/// the saving op (the aten op running when autograd saved the tensor:
/// `aten::native_batch_norm`, not `aten::batch_norm`, which libtorch lowers to it)
/// and the producer (the autograd node that made the tensor: `ReluBackward0`) of
/// every save, including those of parameters and excluded tensors. They are not
/// checked when the policy is built: memsave-sys exposes no registry of libtorch's
/// operators, and a producer may be a node of a custom function.
///
/// ```
/// use memsave_hooks::{Codec, Compress, Kept, SavePolicy};
///
/// // Also compress batch norm's statistics (never a good idea), keep softmax's output.
/// let policy = SavePolicy::lossy()
///     .keep_ops(&["aten::_softmax"])
///     .pack_if(|t| t.kept_by_default.is_none() || t.kept_by_default == Some(Kept::Statistics));
/// let int8 = Compress::new(Codec::int8()).policy(policy);
/// assert!(int8.check().is_err()); // before a step, aten::_softmax was never seen
/// ```
#[derive(Clone)]
pub struct SavePolicy {
    min_bytes: u64,
    statistics: bool,
    keep_ops: Arc<Vec<String>>,
    pack_if: Option<Arc<PackIf>>,
}

impl std::fmt::Debug for SavePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavePolicy")
            .field("min_bytes", &self.min_bytes)
            .field("statistics", &self.statistics)
            .field("keep_ops", &self.keep_ops)
            .field("pack_if", &self.pack_if.is_some())
            .finish()
    }
}

impl Default for SavePolicy {
    fn default() -> Self {
        Self::exact()
    }
}

impl SavePolicy {
    /// The policy of the exact stores ([`DiskOffload`](crate::DiskOffload),
    /// [`SaveOnCpu`](crate::SaveOnCpu)): keeps what stays alive anyway (parameters,
    /// excluded tensors, buffers, constants); no size threshold; normalization statistics are
    /// moved like any tensor (the copy is exact). It needs no op names, so the store
    /// asks for none (a callback per op) unless `keep_ops` or `pack_if` is set.
    pub fn exact() -> Self {
        Self {
            min_bytes: 0,
            statistics: false,
            keep_ops: Arc::default(),
            pack_if: None,
        }
    }

    /// [`Compress`](crate::Compress)'s policy: [`exact`](Self::exact), plus
    /// normalization statistics kept and their inputs grouped, plus tensors under
    /// [`DEFAULT_MIN_BYTES`] kept.
    pub fn lossy() -> Self {
        Self {
            min_bytes: DEFAULT_MIN_BYTES,
            statistics: true,
            ..Self::exact()
        }
    }

    /// Keeps tensors of fewer than `bytes` bytes (of distinct elements); 0 packs any
    /// size.
    pub fn min_bytes(mut self, bytes: u64) -> Self {
        self.min_bytes = bytes;
        self
    }

    /// Keeps every tensor saved by one of `ops` (aten names, `aten::_softmax`) or
    /// produced by one (autograd node names, `SoftmaxBackward0`), as
    /// [`Accounting`](crate::Accounting) reports them; replaces the list given before.
    /// A name no save matched is reported by the store's `check()`, with similar
    /// names seen (see the type's docs for what is compared).
    ///
    /// Trap: the rules decide per save. A tensor that two ops save, kept for one
    /// because that op is named here, is packed for the other too, and both forms
    /// stay until backward: to keep every save of a tensor, name the op that produced
    /// it (its node, `TanhBackward0`).
    pub fn keep_ops<S: AsRef<str>>(mut self, ops: &[S]) -> Self {
        self.keep_ops = Arc::new(ops.iter().map(|s| s.as_ref().to_owned()).collect());
        self
    }

    /// Decides, for each tensor that is not a parameter, excluded or empty, whether to
    /// pack it (`true`) or keep it, told the op that saved it, its producer, shape,
    /// dtype, size and what the rules would do ([`SavedInfo`]): a constant, a buffer
    /// or a normalization's statistics are packed if it says so.
    pub fn pack_if(mut self, f: impl Fn(&SavedInfo<'_>) -> bool + Send + Sync + 'static) -> Self {
        self.pack_if = Some(Arc::new(f));
        self
    }

    /// Why a store with this policy (and nothing excluded) keeps `tensor` when `op`
    /// saves it now; `None`: it packs it. A tensor without a `grad_fn` is a
    /// [`Kept::Constant`] once a hook scope on this thread that has ended saved it.
    pub fn keeps(&self, tensor: &Tensor, op: Option<&str>) -> Result<Option<Kept>, HookError> {
        let base = crate::distinct::distinct(tensor)?.0;
        let bytes = (base.numel() * base.kind().elt_size_in_bytes()) as u64;
        Ok(self
            .decide(&PassThrough::new(), tensor, bytes, op, |_, _| ())?
            .kept)
    }

    /// Whether deciding needs the name of the saving op.
    fn needs_op(&self) -> bool {
        self.statistics || !self.keep_ops.is_empty() || self.pack_if.is_some()
    }

    /// What to do with `tensor` (`bytes` of distinct elements) saved by `op`;
    /// `observe` is told the saving op and the producer of every save (also of what
    /// is always kept) when `keep_ops` names any.
    fn decide(
        &self,
        pass: &PassThrough,
        tensor: &Tensor,
        bytes: u64,
        op: Option<&str>,
        mut observe: impl FnMut(Option<&str>, Option<&str>),
    ) -> Result<Decision, HookError> {
        let kept = |reason| {
            Ok(Decision {
                kept: Some(reason),
                groups: Vec::new(),
                centered: false,
                row_blocks: false,
            })
        };
        let always = if tensor.numel() == 0 {
            Some(Kept::Empty)
        } else if pass.is_parameter(tensor)? {
            Some(Kept::Parameter)
        } else if pass.is_excluded(tensor) {
            Some(Kept::Excluded)
        } else {
            None
        };
        let requires_grad = tensor.requires_grad();
        let norm = op.filter(|_| self.statistics).and_then(norm_of);
        // A tensor that does not require grad has no grad_fn: only ask for others, and
        // only where a rule or the check of keep_ops needs the name.
        let producer = if requires_grad
            && (!self.keep_ops.is_empty()
                || (always.is_none() && (norm.is_some() || self.pack_if.is_some())))
        {
            memsave_sys::hooks::grad_fn_name(tensor)?
        } else {
            None
        };
        if !self.keep_ops.is_empty() {
            observe(op, producer.as_deref());
        }
        if let Some(reason) = always {
            return kept(reason);
        }
        let shape = tensor.size();
        let kind = tensor.kind();
        let mut groups = Vec::new();
        let mut centered = false;
        let mut row_blocks = false;
        let default = if self
            .keep_ops
            .iter()
            .any(|k| Some(k.as_str()) == op || Some(k.as_str()) == producer.as_deref())
        {
            Some(Kept::Op)
        } else if let Some(norm) = norm.filter(|_| {
            // Statistics: no grad_fn, or made by the normalization's own node.
            let own = op.map(node_of);
            match (&producer, &own) {
                (Some(p), Some(own)) => !p.starts_with(own.as_str()),
                _ => requires_grad,
            }
        }) {
            // The normalization's input: blocks that never mix two of its groups,
            // stored relative to their midpoints where backward reads deviations.
            groups = norm.groups(shape.len());
            centered = norm.centered();
            (bytes < self.min_bytes).then_some(Kept::Small)
        } else if norm.is_some() {
            Some(Kept::Statistics)
        } else if self.statistics && op.is_some_and(|op| ROW_BLOCK_OPS.contains(&op)) {
            // Probabilities, attention's inputs: in blocks within rows.
            groups = (0..shape.len().saturating_sub(1)).collect();
            row_blocks = true;
            (bytes < self.min_bytes).then_some(Kept::Small)
        } else if !requires_grad && is_float(kind) && shape.iter().filter(|&&d| d > 1).count() <= 1
        {
            Some(Kept::Buffer)
        } else if !requires_grad && crate::alive::outlived_a_scope(tensor)? {
            Some(Kept::Constant)
        } else if bytes < self.min_bytes {
            Some(Kept::Small)
        } else {
            None
        };
        let kept = match &self.pack_if {
            None => default,
            Some(f) => {
                let info = SavedInfo {
                    op,
                    producer: producer.as_deref(),
                    shape: &shape,
                    kind,
                    bytes,
                    kept_by_default: default,
                };
                if f(&info) {
                    None
                } else {
                    Some(default.unwrap_or(Kept::Policy))
                }
            }
        };
        Ok(Decision {
            kept,
            groups,
            centered,
            row_blocks,
        })
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}

/// What a store does with one saved tensor.
#[derive(Debug)]
pub(crate) struct Decision {
    /// `Some(reason)`: keep it as it is.
    pub kept: Option<Kept>,
    /// For a normalization's input: the dimensions whose indices must not share a
    /// codec block.
    pub groups: Vec<usize>,
    /// For the input of a normalization that subtracts a mean: store it relative to
    /// midpoints of its own (see `Codec::f_encode_grouped`).
    pub centered: bool,
    /// Saved by an op of [`ROW_BLOCK_OPS`]: blocks of at most [`ROW_BLOCK`]
    /// within rows (`groups`), int8 rounded to nearest without keeping signs.
    pub row_blocks: bool,
}

/// A store's policy, its exclusions and what it kept so far (shared by clones).
#[derive(Debug, Clone)]
pub(crate) struct Selector {
    pass: PassThrough,
    policy: SavePolicy,
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    kept: [AtomicU64; KEPT.len()],
    /// Per name of `keep_ops`: seen saving or producing a tensor.
    seen: Vec<AtomicBool>,
    /// Every saving op and producer seen (when `keep_ops` names any), for the check's
    /// similar names.
    names: Mutex<BTreeSet<String>>,
}

impl Selector {
    pub fn new(policy: SavePolicy) -> Self {
        Self::with(PassThrough::new(), policy)
    }

    fn with(pass: PassThrough, policy: SavePolicy) -> Self {
        let state = Arc::new(State {
            kept: Default::default(),
            seen: policy
                .keep_ops
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            names: Mutex::default(),
        });
        Self {
            pass,
            policy,
            state,
        }
    }

    /// The same exclusions under `policy`, counts reset.
    pub fn policy(&self, policy: SavePolicy) -> Self {
        Self::with(self.pass.clone(), policy)
    }

    /// The policy.
    pub fn current(&self) -> &SavePolicy {
        &self.policy
    }

    /// Also excludes `tensors`, counts reset.
    pub fn excluding(&self, tensors: &[Tensor]) -> Self {
        Self::with(self.pass.clone().excluding(tensors), self.policy.clone())
    }

    pub fn records_ops(&self) -> bool {
        self.policy.needs_op()
    }

    /// What to do with `tensor` saved by `op` (`bytes` of distinct elements); a kept
    /// tensor is counted.
    pub fn decide(
        &self,
        tensor: &Tensor,
        bytes: u64,
        op: Option<&str>,
    ) -> Result<Decision, HookError> {
        let keep_ops = &self.policy.keep_ops;
        let state = &self.state;
        let d = self
            .policy
            .decide(&self.pass, tensor, bytes, op, |op, producer| {
                let mut names = state.names.lock().unwrap_or_else(|p| p.into_inner());
                for name in [op, producer].into_iter().flatten() {
                    for (i, k) in keep_ops.iter().enumerate() {
                        if k == name {
                            state.seen[i].store(true, Ordering::Relaxed);
                        }
                    }
                    if !names.contains(name) {
                        names.insert(name.to_owned());
                    }
                }
            })?;
        if let Some(reason) = d.kept {
            let i = KEPT.iter().position(|&k| k == reason).unwrap_or(0);
            self.state.kept[i].fetch_add(1, Ordering::Relaxed);
        }
        Ok(d)
    }

    pub fn kept(&self) -> KeptStats {
        let n = |k: Kept| {
            let i = KEPT.iter().position(|&r| r == k).unwrap_or(0);
            self.state.kept[i].load(Ordering::Relaxed)
        };
        KeptStats {
            parameters: n(Kept::Parameter),
            excluded: n(Kept::Excluded),
            empty: n(Kept::Empty),
            ops: n(Kept::Op),
            statistics: n(Kept::Statistics),
            buffers: n(Kept::Buffer),
            constants: n(Kept::Constant),
            small: n(Kept::Small),
            policy: n(Kept::Policy),
        }
    }

    /// `Err` listing the names of `keep_ops` never seen so far, and the names seen
    /// that look like them.
    pub fn check(&self) -> Result<(), PolicyError> {
        let unseen: Vec<String> = self
            .policy
            .keep_ops
            .iter()
            .zip(&self.state.seen)
            .filter(|(_, s)| !s.load(Ordering::Relaxed))
            .map(|(name, _)| name.clone())
            .collect();
        if unseen.is_empty() {
            return Ok(());
        }
        let names = self.state.names.lock().unwrap_or_else(|p| p.into_inner());
        let near: Vec<String> = names
            .iter()
            .filter(|seen| unseen.iter().any(|u| similar(u, seen)))
            .take(MAX_NEAR)
            .cloned()
            .collect();
        Err(PolicyError::UnseenOps {
            names: unseen,
            near,
        })
    }
}

/// At most this many similar names are listed by `check`.
const MAX_NEAR: usize = 8;

/// The core of an op or node name: lowercase, without its namespace (`aten::`), the
/// node's `Backward` and overload number, and underscores (`aten::native_batch_norm`
/// and `NativeBatchNormBackward0` are both `nativebatchnorm`).
fn core_name(name: &str) -> String {
    let name = name.rsplit("::").next().unwrap_or(name);
    let name = name.trim_end_matches(|c: char| c.is_ascii_digit());
    let name = name.strip_suffix("Backward").unwrap_or(name);
    name.chars()
        .filter(|&c| c != '_')
        .flat_map(char::to_lowercase)
        .collect()
}

/// Whether a name given to `keep_ops` and a name seen look alike: one's core contains
/// the other's (`aten::batch_norm` and `aten::native_batch_norm`, `relu` and
/// `ReluBackward0`).
fn similar(given: &str, seen: &str) -> bool {
    let (a, b) = (core_name(given), core_name(seen));
    !a.is_empty() && !b.is_empty() && (a.contains(&b) || b.contains(&a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_follow_autograd() {
        assert_eq!(
            node_of("aten::native_group_norm"),
            "NativeGroupNormBackward"
        );
        assert_eq!(
            node_of("aten::_native_batch_norm_legit"),
            "NativeBatchNormLegitBackward"
        );
        assert_eq!(node_of("aten::_fused_rms_norm"), "FusedRmsNormBackward");
    }

    #[test]
    fn names_alike_share_their_core() {
        assert_eq!(core_name("aten::native_batch_norm"), "nativebatchnorm");
        assert_eq!(core_name("NativeBatchNormBackward0"), "nativebatchnorm");
        assert_eq!(core_name("MmBackward"), "mm");
        assert!(similar("aten::batch_norm", "aten::native_batch_norm"));
        assert!(similar("relu", "ReluBackward0"));
        assert!(similar("MmBackward", "aten::mm"));
        assert!(!similar("aten::no_such_op", "aten::mm"));
        assert!(!similar("aten::relu", "aten::tanh"));
    }

    #[test]
    fn every_norm_op_has_a_grouping() {
        for op in NORM_OPS {
            assert!(norm_of(op).is_some(), "{op}");
        }
        assert_eq!(norm_of("aten::native_group_norm"), Some(Norm::Planes));
        assert_eq!(norm_of("aten::native_layer_norm"), Some(Norm::Rows));
        assert_eq!(norm_of("aten::_fused_rms_norm"), Some(Norm::RmsRows));
        assert!(Norm::Rows.centered() && Norm::Channels.centered() && Norm::Planes.centered());
        assert!(!Norm::RmsRows.centered());
        assert_eq!(norm_of("aten::cudnn_batch_norm"), Some(Norm::Channels));
        assert_eq!(norm_of("aten::relu"), None);
    }
}
