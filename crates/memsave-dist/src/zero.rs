//! ZeRO stages 1 and 2: each rank keeps and updates only its shard of the optimizer
//! state (and, in stage 2, of the gradients, reduced in buckets while backward runs),
//! then the updated parameters are gathered.
use std::sync::{Arc, Mutex, MutexGuard};

use memsave_optim::{Optimizer, Options, Placement, Rule, State};
use memsave_sys::grad_hooks::GradHookHandle;
use memsave_sys::tensor::nbytes;
use tch::{Device, Kind, Tensor};

use crate::bucket::{copy_from_flat_at, BucketReduce, Buckets};
use crate::check::same_shapes_everywhere;
use crate::error::{DistError, Result};
use crate::group::ProcessGroup;
use crate::ready::ready_hooks;

/// How much of the training state is sharded (DeepSpeed's ZeRO stages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer state sharded; gradients all-reduced whole (PyTorch's
    /// `ZeroRedundancyOptimizer` on top of DDP).
    One,
    /// Optimizer state and gradients sharded: gradients are reduced in buckets while
    /// backward produces them, each rank receiving only its shard's sum, and the full
    /// gradients are freed bucket by bucket (DeepSpeed's ZeRO-2).
    Two,
}

/// An optimizer from `memsave-optim` (any rule, any state precision) that holds 1/N
/// of the state on each of N ranks.
///
/// The parameters are laid out, in order, in one flat f32 vector, each starting at a
/// multiple of the state's block (1 value for f32 and bf16 state, the block of
/// [`State::Int8Blockwise`]), the gaps and the end padded with zeros to a multiple of
/// N × the block; rank `r` owns the `r`-th of N equal slices, and its optimizer updates
/// only that slice. So with 8-bit state every block of a slice holds the values of one
/// parameter, in the positions that parameter's blocks have on one process, and the
/// zeros beside them change neither a block's scale (its largest magnitude) nor their
/// codes: given the same averaged gradients, the updates are those of a single-process
/// optimizer with the same state. The padding never reaches a parameter or its
/// gradient, and its gradient, moments and values stay 0 (a 0 is stored exactly).
///
/// The padding costs up to `block - 1` values per parameter, plus up to `N × block - 1`
/// at the end, over all ranks: each padded value takes 4 bytes of the flat parameter
/// slice, 4 of its gradient and one byte per 8-bit state buffer (2 for AdamW), and is
/// sent like any other value. With blocks of 256 and many small parameters (biases,
/// norms) that can be most of their share; f32 and bf16 state pad only the end.
///
/// Stage 1: backward runs as on one process; [`ZeroOptimizer::f_step`] flattens the
/// gradients, all-reduces them, keeps this rank's slice, updates it and all-gathers
/// the parameters.
///
/// Stage 2: the parameters are grouped into buckets of consecutive parameters, in
/// reverse order (the order backward usually produces their gradients), as
/// [`crate::DistributedDataParallel`] does. A post-accumulate-grad hook on each
/// parameter counts ready gradients; when a bucket is complete (and every bucket
/// before it is done), its gradients are flattened, their `.grad`s are freed, and one
/// all-to-all sends each rank the part of the bucket that falls in its slice; each
/// rank adds what it receives, in rank order, into its slice's gradient sum. So a rank
/// holds its slice of the gradients (1/N) plus the bucket in flight, never all of them.
/// Each rank sends the bucket less its own part: over a step, `(N-1)/N` of the padded
/// gradients, as a reduce-scatter would. [`ZeroOptimizer::f_step`] then divides the
/// sum by N (gradients are averaged, as in DDP), updates the slice and all-gathers the
/// parameters.
///
/// Gradient accumulation: under stage 1, backward several micro-batches and step once
/// (no communication before the step). Under stage 2, every backward reduces its
/// buckets (communication per micro-batch, gradients stay at 1/N), unless it runs
/// inside [`ZeroOptimizer::no_sync`]: then the gradients add up whole in `.grad`, and
/// the next backward outside `no_sync` (or the step) reduces the sum.
///
/// With `Placement::Disk(dir)` each rank keeps its shard's state files in
/// `dir/rank-R` (R its rank), so ranks on one machine (or a shared file system) can be
/// given the same directory.
///
/// A parameter that has a gradient on no rank is skipped, its values, state and step
/// count untouched, as a single-process optimizer skips it: the shard's optimizer has
/// one parameter per parameter's part of the slice, and the step all-reduces one flag
/// per parameter to agree which were used. One used on some ranks only is averaged as
/// if the others had a zero gradient.
///
/// Traps: under stage 2
/// a parameter that gets no gradient in a backward leaves its bucket incomplete until
/// the step, which reduces it with zeros; every rank must run the same backwards, or
/// the collectives wait on each other until the timeout. Each parameter can carry only
/// one post-accumulate-grad hook, so stage 2 cannot be combined with
/// [`crate::DistributedDataParallel`] or `step_in_backward` on the same parameters.
/// Stage 1's step needs two transient flat f32 buffers as large as all the parameters
/// with their padding; stage 2 needs, per bucket, the bucket and N × this rank's part
/// of it.
#[derive(Debug)]
pub struct ZeroOptimizer<R: Rule> {
    // Dropped first: removing the hooks releases their references to the reducer.
    _hooks: Vec<GradHookHandle>,
    /// Stage 2's bucketed reduction (None under stage 1).
    reducer: Option<Arc<Mutex<Reducer>>>,
    group: ProcessGroup,
    stage: ZeroStage,
    params: Vec<Tensor>,
    layout: Layout,
    shard: Tensor,
    /// The pieces of `shard` the inner optimizer steps, one per parameter that lies in
    /// it: (parameter index, first value in the shard, length).
    pieces: Vec<(usize, i64, i64)>,
    inner: Optimizer<R>,
    max_grad_norm: Option<f64>,
}

impl<R: Rule> ZeroOptimizer<R> {
    /// Shards the optimizer of `params` (the same parameters, in the same order, on
    /// every rank: checked once here) over the ranks of `group`, and copies rank 0's
    /// parameter values to every rank. Parameters must be contiguous f32 CPU tensors
    /// that require grad. Stage 2 reduces gradients in buckets of at most 25 MiB
    /// (PyTorch DDP's default; see [`ZeroOptimizer::with_bucket_cap`]).
    pub fn new(
        group: &ProcessGroup,
        params: &[Tensor],
        config: R,
        options: Options,
        stage: ZeroStage,
    ) -> Result<Self> {
        Self::with_bucket_cap(group, params, config, options, stage, 25 << 20)
    }

    /// As [`ZeroOptimizer::new`], with stage 2's buckets holding at most
    /// `bucket_cap_bytes` of gradient (a parameter larger than that gets a bucket of
    /// its own). Smaller buckets free full gradients sooner and communicate more often.
    /// Stage 1 ignores it.
    pub fn with_bucket_cap(
        group: &ProcessGroup,
        params: &[Tensor],
        config: R,
        options: Options,
        stage: ZeroStage,
        bucket_cap_bytes: u64,
    ) -> Result<Self> {
        let rank = group.rank();
        for (index, p) in params.iter().enumerate() {
            if p.kind() != Kind::Float
                || p.device() != Device::Cpu
                || !p.is_contiguous()
                || !p.requires_grad()
            {
                return Err(DistError::Config {
                    rank,
                    reason: format!(
                        "parameter {index} (shape {:?}, {:?} on {:?}): ZeRO needs contiguous f32 CPU parameters that require grad",
                        p.size(),
                        p.kind(),
                        p.device()
                    ),
                });
            }
        }
        same_shapes_everywhere(group, params)?;
        let err = tensor_err(rank, "sharding the parameters");
        let n = group.world_size() as i64;
        let block = match options.state {
            State::Int8Blockwise { block } => block as i64,
            State::F32 | State::Bf16 => 1,
        };
        let layout = Layout::new(params, block.max(1), n);
        let padded = layout.padded;
        let shard_len = padded / n;
        let _no_grad = tch::no_grad_guard();
        for p in params {
            group.broadcast(p, 0)?;
        }
        let flat = layout
            .flatten(params, |p| Some(p.shallow_clone()))
            .map_err(err)?;
        let shard = flat
            .f_narrow(0, rank as i64 * shard_len, shard_len)
            .and_then(|s| s.f_contiguous())
            .and_then(|s| s.f_detach_copy())
            .map_err(err)?
            .set_requires_grad(true);
        drop(flat);
        let max_grad_norm = options.max_grad_norm;
        // Every rank gets the same options, but each shard's state is its own: on disk,
        // ranks sharing a directory would overwrite each other's `param-0.state`.
        let placement = match options.placement {
            Placement::Disk(dir) => Placement::Disk(dir.join(format!("rank-{rank}"))),
            other => other,
        };
        let inner_options = Options {
            max_grad_norm: None,
            placement,
            ..options
        };
        // One optimizer parameter per parameter's part of the slice (its padding with
        // it), views of the shard: a parameter no rank has a gradient for is skipped,
        // its values, state and step count untouched, as on one process.
        let pieces = layout.pieces(rank as i64 * shard_len, shard_len);
        let views = pieces
            .iter()
            .map(|&(_, at, len)| {
                shard
                    .detach()
                    .f_narrow(0, at, len)
                    .map(|v| v.set_requires_grad(true))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let inner = Optimizer::with_options(&views, config, inner_options)
            .map_err(|source| DistError::Optim { rank, source })?;
        let (hooks, reducer) = match stage {
            ZeroStage::One => (Vec::new(), None),
            ZeroStage::Two => {
                let reducer = Arc::new(Mutex::new(Reducer::new(
                    group,
                    params,
                    layout.clone(),
                    shard_len,
                    bucket_cap_bytes,
                )));
                let hooks = ready_hooks(params, &reducer, rank, Reducer::mark_ready)?;
                (hooks, Some(reducer))
            }
        };
        Ok(Self {
            _hooks: hooks,
            reducer,
            group: group.clone(),
            stage,
            params: params.iter().map(Tensor::shallow_clone).collect(),
            layout,
            shard,
            pieces,
            inner,
            max_grad_norm,
        })
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The slice of the flat parameter vector this rank owns: (first value, length).
    /// Lengths are equal on every rank; the last ranks' slices may end in padding.
    pub fn shard_range(&self) -> (i64, i64) {
        let len = self.shard.numel() as i64;
        (self.group.rank() as i64 * len, len)
    }

    /// Length of the flat parameter vector with its padding (world size × shard length).
    pub fn padded_len(&self) -> i64 {
        self.layout.padded
    }

    /// Bytes of optimizer state this rank holds (its shard's).
    pub fn state_bytes(&self) -> u64 {
        self.inner.state_bytes()
    }

    /// The state tensors this rank holds in memory now (its shard's; see
    /// `memsave_optim::Optimizer::state_tensors`), to register with a memory tool.
    pub fn state_tensors(&self) -> Vec<Tensor> {
        self.inner.state_tensors()
    }

    /// Bytes of gradients this rank holds now: the parameters' `.grad`s, its shard's,
    /// and (stage 2) the sum of its slice reduced since the last step.
    pub fn gradient_bytes(&self) -> u64 {
        let accumulated = self.reducer().and_then(|r| r.acc.as_ref().map(nbytes));
        self.params
            .iter()
            .chain(std::iter::once(&self.shard))
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .map(|g| nbytes(&g))
            .sum::<u64>()
            + accumulated.unwrap_or(0)
    }

    /// Runs `f` (forward and backward of a micro-batch) without communication: under
    /// stage 2 the gradients accumulate whole in the parameters' `.grad` (PyTorch's
    /// `no_sync`), to be reduced by the next backward outside `no_sync` or by the step.
    /// Stage 1 never communicates in backward, so there it only runs `f`.
    pub fn no_sync<T>(&self, f: impl FnOnce() -> T) -> T {
        if let Some(mut r) = self.reducer() {
            r.sync = false;
        }
        let out = f();
        if let Some(mut r) = self.reducer() {
            r.sync = true;
        }
        out
    }

    /// Number of stage 2 bucket reductions so far (0 under stage 1).
    pub fn reductions(&self) -> u64 {
        self.reducer().map_or(0, |r| r.reductions)
    }

    /// Number of stage 2 buckets (0 under stage 1).
    pub fn bucket_count(&self) -> usize {
        self.reducer().map_or(0, |r| r.buckets.len())
    }

    fn reducer(&self) -> Option<MutexGuard<'_, Reducer>> {
        self.reducer
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The optimizer of this rank's shard (to change learning rates), with one
    /// parameter per parameter that lies in the shard, in order.
    pub fn inner_mut(&mut self) -> &mut Optimizer<R> {
        &mut self.inner
    }

    /// Number of updates of parameter `index`'s part of this rank's shard (0 when no
    /// part of it lies there, or before its first gradient).
    pub fn step_count(&self, index: usize) -> u64 {
        let piece = self.pieces.iter().position(|&(i, _, _)| i == index);
        piece.map_or(0, |k| self.inner.step_count(k))
    }

    /// Clears the gradients of the parameters and of this rank's shard (see
    /// [`Optimizer::f_zero_grad`]).
    pub fn f_zero_grad(&self, set_to_none: bool) -> Result<()> {
        let rank = self.group.rank();
        memsave_optim::zero_grad(&self.params, set_to_none)
            .map_err(|source| DistError::Optim { rank, source })?;
        if let Some(mut r) = self.reducer() {
            // Recreated as zeros by the next reduction.
            r.acc = None;
            r.used.iter_mut().for_each(|u| *u = false);
        }
        memsave_optim::zero_grad(&[self.shard.shallow_clone()], set_to_none)
            .and_then(|()| self.inner.f_zero_grad(set_to_none))
            .map_err(|source| DistError::Optim { rank, source })
    }

    /// Averages the gradients over the ranks, updates this rank's shard, and gathers
    /// the updated parameters on every rank (see the type's documentation).
    pub fn f_step(&mut self) -> Result<()> {
        let rank = self.group.rank();
        let err = tensor_err(rank, "sharded step");
        let _no_grad = tch::no_grad_guard();
        let n = self.group.world_size();
        let mut used: Vec<bool> = self.params.iter().map(|p| p.grad().defined()).collect();
        let mut shard_grad = match self.stage {
            ZeroStage::One => {
                let (start, len) = self.shard_range();
                let flat_grad = self
                    .layout
                    .flatten(&self.params, |p| {
                        let g = p.grad();
                        g.defined().then_some(g)
                    })
                    .map_err(err)?;
                self.group.all_reduce(&flat_grad)?;
                flat_grad
                    .f_narrow(0, start, len)
                    .and_then(|g| g.f_contiguous())
                    .and_then(|g| g.f_detach_copy())
                    .map_err(err)?
            }
            ZeroStage::Two => {
                let mut r = self.reducer().expect("stage 2 has a reducer");
                let acc = r.finish_step()?;
                for (u, seen) in used.iter_mut().zip(r.used.iter_mut()) {
                    *u |= std::mem::take(seen);
                }
                acc
            }
        };
        let used = self.used_anywhere(&used)?;
        let _ = shard_grad.f_div_scalar_(n as f64).map_err(err)?;
        if let Some(max_norm) = self.max_grad_norm {
            self.clip(&mut shard_grad, max_norm)?;
        }
        memsave_sys::dist::set_grad(&self.shard, &shard_grad)?;
        for (view, &(index, at, len)) in self.inner.params().iter().zip(&self.pieces) {
            if used[index] {
                let g = shard_grad.f_narrow(0, at, len).map_err(err)?;
                memsave_sys::dist::set_grad(view, &g)?;
            } else {
                memsave_sys::tensor::set_grad_none(view)?;
            }
        }
        self.inner
            .f_step()
            .map_err(|source| DistError::Optim { rank, source })?;
        if self.stage == ZeroStage::One {
            memsave_sys::tensor::set_grad_none(&self.shard)?;
            for view in self.inner.params() {
                memsave_sys::tensor::set_grad_none(view)?;
            }
        }
        let gathered =
            Tensor::f_empty([self.layout.padded], (Kind::Float, Device::Cpu)).map_err(err)?;
        self.group.all_gather(&gathered, &self.shard.detach())?;
        self.layout.unflatten(&gathered, &self.params).map_err(err)
    }

    /// Whether each parameter had a gradient on any rank (`mine`: on this one), with one
    /// all-reduce of a flag per parameter.
    fn used_anywhere(&self, mine: &[bool]) -> Result<Vec<bool>> {
        let err = tensor_err(self.group.rank(), "used parameters");
        let flags: Vec<f32> = mine.iter().map(|&u| f32::from(u8::from(u))).collect();
        let flags = Tensor::f_from_slice(&flags).map_err(err)?;
        self.group.all_reduce(&flags)?;
        let sums = Vec::<f32>::try_from(&flags).map_err(err)?;
        Ok(sums.into_iter().map(|s| s > 0.0).collect())
    }

    /// Scales the shard's gradient so that the norm of the whole (all ranks') gradient
    /// is at most `max_norm`, as [`Options::max_grad_norm`] does on one process.
    fn clip(&self, shard_grad: &mut Tensor, max_norm: f64) -> Result<()> {
        let err = tensor_err(self.group.rank(), "max_grad_norm");
        let sq = shard_grad
            .f_to_kind(Kind::Double)
            .and_then(|g| g.f_square())
            .and_then(|g| g.f_sum(Kind::Double))
            .and_then(|s| s.f_reshape([1]))
            .map_err(err)?;
        self.group.all_reduce(&sq)?;
        let total = sq.f_double_value(&[0]).map_err(err)?;
        let coef = max_norm / (total.sqrt() + 1e-6);
        if coef < 1.0 {
            let _ = shard_grad.f_mul_scalar_(coef).map_err(err)?;
        }
        Ok(())
    }
}

/// Stage 2's reduction of gradients in buckets during backward.
#[derive(Debug)]
struct Reducer {
    group: ProcessGroup,
    params: Vec<Tensor>,
    layout: Layout,
    /// Consecutive parameters in each bucket, last first.
    buckets: Buckets,
    /// The flat range `[start, end)` of each bucket: from its first parameter's offset
    /// to the next bucket's (the first bucket, holding the last parameter, to the end
    /// of the padding), so the ranges cover the flat vector and each bucket carries
    /// its parameters' padding.
    ranges: Vec<(i64, i64)>,
    sync: bool,
    shard_len: i64,
    /// This rank's slice of the gradients summed over the ranks since the last step.
    acc: Option<Tensor>,
    /// Which parameters had a gradient here since the last step.
    used: Vec<bool>,
    reductions: u64,
}

impl Reducer {
    fn new(
        group: &ProcessGroup,
        params: &[Tensor],
        layout: Layout,
        shard_len: i64,
        bucket_cap_bytes: u64,
    ) -> Self {
        let buckets = Buckets::new(params, bucket_cap_bytes);
        let ranges = (0..buckets.len())
            .map(|b| {
                let m = buckets.members(b);
                let first = *m.last().expect("buckets are not empty");
                let end = layout
                    .offsets
                    .get(m[0] + 1)
                    .copied()
                    .unwrap_or(layout.padded);
                (layout.offsets[first], end)
            })
            .collect();
        Self {
            group: group.clone(),
            params: params.iter().map(Tensor::shallow_clone).collect(),
            layout,
            buckets,
            ranges,
            sync: true,
            shard_len,
            acc: None,
            used: vec![false; params.len()],
            reductions: 0,
        }
    }

    /// Completes the reductions of the step: the buckets a backward left incomplete,
    /// then, when nothing was reduced since the last step (every backward ran inside
    /// `no_sync`, or none ran) or gradients are left in `.grad`, every bucket. Returns
    /// the slice's gradient summed over the ranks.
    fn finish_step(&mut self) -> Result<Tensor> {
        self.reduce_owed()?;
        if self.acc.is_none() || self.params.iter().any(|p| p.grad().defined()) {
            for bucket in 0..self.buckets.len() {
                self.reduce(bucket)?;
            }
        }
        match self.acc.take() {
            Some(acc) => Ok(acc),
            // No parameters at all: an empty slice.
            None => {
                Tensor::f_zeros([self.shard_len], (Kind::Float, Device::Cpu)).map_err(|source| {
                    DistError::Tensor {
                        rank: self.group.rank(),
                        context: "gradient bucket",
                        source,
                    }
                })
            }
        }
    }
}

impl BucketReduce for Reducer {
    fn buckets(&mut self) -> &mut Buckets {
        &mut self.buckets
    }

    fn syncing(&self) -> bool {
        self.sync
    }

    /// Sends each rank its part of bucket `bucket`'s gradients (zeros for parameters
    /// without one), frees the bucket's `.grad`s, and adds what this rank receives, in
    /// rank order, into its slice's sum.
    fn reduce(&mut self, bucket: usize) -> Result<()> {
        let rank = self.group.rank();
        let n = self.group.world_size();
        let err = tensor_err(rank, "gradient bucket");
        let _no_grad = tch::no_grad_guard();
        let (start, end) = self.ranges[bucket];
        let flat = Tensor::f_zeros([end - start], (Kind::Float, Device::Cpu)).map_err(err)?;
        for &i in self.buckets.members(bucket) {
            let p = &self.params[i];
            let g = p.grad();
            if g.defined() {
                self.used[i] = true;
                let k = p.numel() as i64;
                flat.f_narrow(0, self.layout.offsets[i] - start, k)
                    .and_then(|mut dst| dst.f_copy_(&g.f_reshape([-1])?))
                    .map_err(err)?;
                memsave_sys::tensor::set_grad_none(p)?;
            }
        }
        let s = self.shard_len;
        let part = |r: usize| {
            let (lo, hi) = (r as i64 * s, (r as i64 + 1) * s);
            (start.max(lo), end.min(hi))
        };
        let input_splits: Vec<i64> = (0..n)
            .map(|r| {
                let (a, b) = part(r);
                (b - a).max(0)
            })
            .collect();
        let mine = input_splits[rank];
        let output_splits = vec![mine; n];
        let received =
            Tensor::f_empty([mine * n as i64], (Kind::Float, Device::Cpu)).map_err(err)?;
        self.group
            .all_to_all_single(&received, &flat, &output_splits, &input_splits)?;
        drop(flat);
        if mine > 0 {
            if self.acc.is_none() {
                self.acc = Some(Tensor::f_zeros([s], (Kind::Float, Device::Cpu)).map_err(err)?);
            }
            let acc = self.acc.as_ref().expect("just created");
            let mut dst = acc
                .f_narrow(0, part(rank).0 - rank as i64 * s, mine)
                .map_err(err)?;
            for r in 0..n as i64 {
                let src = received.f_narrow(0, r * mine, mine).map_err(err)?;
                let _ = dst.f_add_(&src).map_err(err)?;
            }
        } else if self.acc.is_none() {
            self.acc = Some(Tensor::f_zeros([s], (Kind::Float, Device::Cpu)).map_err(err)?);
        }
        self.reductions += 1;
        Ok(())
    }
}

fn tensor_err(rank: usize, context: &'static str) -> impl Fn(tch::TchError) -> DistError + Copy {
    move |source| DistError::Tensor {
        rank,
        context,
        source,
    }
}

/// Where each parameter lies in the flat vector: one after another, each starting at a
/// multiple of the state's block (1 value for f32 and bf16 state), so that an 8-bit
/// block never holds values of two parameters. The gaps and the tail hold zeros.
#[derive(Clone, Debug)]
struct Layout {
    /// First value of each parameter.
    offsets: Vec<i64>,
    /// Length with the padding: a multiple of N × block.
    padded: i64,
}

impl Layout {
    /// `params` in order, each padded to whole `block`s, the whole padded to a multiple
    /// of `ranks` × `block`.
    fn new(params: &[Tensor], block: i64, ranks: i64) -> Self {
        let round_up = |len: i64, unit: i64| (len + unit - 1) / unit * unit;
        let mut offsets = Vec::with_capacity(params.len());
        let mut end = 0;
        for p in params {
            offsets.push(end);
            end += round_up(p.numel() as i64, block);
        }
        Self {
            offsets,
            padded: round_up(end, ranks * block),
        }
    }

    /// Each parameter's part of the slice `[start, start + len)`, with the padding after
    /// it (the last one's to the end): (parameter index, first value in the slice,
    /// length), for the parameters that have one.
    fn pieces(&self, start: i64, len: i64) -> Vec<(usize, i64, i64)> {
        let ends = self.offsets.iter().skip(1).copied().chain([self.padded]);
        self.offsets
            .iter()
            .zip(ends)
            .enumerate()
            .filter_map(|(i, (&a, b))| {
                let (lo, hi) = (a.max(start), b.min(start + len));
                (lo < hi).then_some((i, lo - start, hi - lo))
            })
            .collect()
    }

    /// The tensors `pick` returns for the parameters, each copied to its offset in a
    /// zero f32 vector of the padded length (zeros where `pick` returns `None`).
    fn flatten(
        &self,
        params: &[Tensor],
        pick: impl Fn(&Tensor) -> Option<Tensor>,
    ) -> Result<Tensor, tch::TchError> {
        let flat = Tensor::f_zeros([self.padded], (Kind::Float, Device::Cpu))?;
        for (p, &offset) in params.iter().zip(&self.offsets) {
            if let Some(t) = pick(p) {
                flat.f_narrow(0, offset, p.numel() as i64)?
                    .f_copy_(&t.f_reshape([-1])?)?;
            }
        }
        Ok(flat)
    }

    /// Copies each parameter's values out of `flat` into the parameter, in its shape;
    /// the padding is left behind.
    fn unflatten(&self, flat: &Tensor, params: &[Tensor]) -> Result<(), tch::TchError> {
        copy_from_flat_at(flat, params, self.offsets.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(numels: &[i64]) -> Vec<Tensor> {
        numels
            .iter()
            .map(|&n| Tensor::zeros([n], (Kind::Float, Device::Cpu)))
            .collect()
    }

    #[test]
    fn each_parameter_starts_a_block() {
        let l = Layout::new(&params(&[100, 37, 256]), 64, 2);
        assert_eq!(l.offsets, [0, 128, 192]);
        assert_eq!(l.padded, 512);
        // Block 1 (f32 and bf16 state): back to back, padded to N values.
        let l = Layout::new(&params(&[100, 37, 256]), 1, 2);
        assert_eq!(l.offsets, [0, 100, 137]);
        assert_eq!(l.padded, 394);
        let l = Layout::new(&params(&[64, 0, 1]), 64, 1);
        assert_eq!((l.offsets, l.padded), (vec![0, 64, 64], 128));
        assert_eq!(Layout::new(&[], 64, 4).padded, 0);
    }

    #[test]
    fn flatten_pads_and_unflatten_skips_the_padding() {
        let a = Tensor::from_slice(&[1f32, 2., 3.]);
        let b = Tensor::from_slice(&[4f32, 5., 6., 7.]).reshape([2, 2]);
        let params = [a.shallow_clone(), b.shallow_clone()];
        let l = Layout::new(&params, 4, 1);
        let flat = l.flatten(&params, |p| Some(p.shallow_clone())).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&flat).unwrap(),
            [1., 2., 3., 0., 4., 5., 6., 7.]
        );
        let none = l.flatten(&params, |_| None).unwrap();
        assert_eq!(Vec::<f32>::try_from(&none).unwrap(), [0.; 8]);
        let gathered = Tensor::from_slice(&[10f32, 20., 30., -1., 40., 50., 60., 70.]);
        l.unflatten(&gathered, &params).unwrap();
        assert_eq!(Vec::<f32>::try_from(&a).unwrap(), [10., 20., 30.]);
        assert_eq!(
            Vec::<f32>::try_from(b.reshape([-1])).unwrap(),
            [40., 50., 60., 70.]
        );
        assert!(l.unflatten(&gathered.narrow(0, 0, 6), &params).is_err());
    }
}
