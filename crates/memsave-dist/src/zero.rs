//! ZeRO stages 1 and 2: each rank keeps and updates only its shard of the optimizer
//! state (and, in stage 2, of the gradients), then the updated parameters are gathered.
use memsave_optim::{Optimizer, Options, Rule, State};
use tch::{Device, Kind, Tensor};

use crate::check::same_shapes_everywhere;
use crate::error::{DistError, Result};
use crate::group::ProcessGroup;

/// How much of the training state is sharded (DeepSpeed's ZeRO stages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer state sharded; gradients all-reduced whole (PyTorch's
    /// `ZeroRedundancyOptimizer` on top of DDP).
    One,
    /// Optimizer state and gradients sharded: gradients are reduce-scattered, and each
    /// rank keeps only its shard of them after the step.
    Two,
}

/// An optimizer from `memsave-optim` (any rule, any state precision) that holds 1/N
/// of the state on each of N ranks.
///
/// The parameters are laid out, in order, in one flat f32 vector padded with zeros to a
/// multiple of N × the state's block (1 value for f32 and bf16 state, the block of
/// [`State::Int8Blockwise`]); rank `r` owns the `r`-th of N equal slices, and its
/// optimizer updates only that slice. One [`ZeroOptimizer::f_step`]:
/// 1. flattens this rank's gradients (zeros for parameters without one);
/// 2. stage 1: all-reduces them and keeps its slice; stage 2: reduce-scatters them, so
///    each rank receives only its slice, and frees the parameters' gradients;
/// 3. divides by N (gradients are averaged, as in DDP) and updates its slice;
/// 4. all-gathers the slices into every rank's parameters.
///
/// Gradient accumulation needs nothing more: backward several micro-batches (their
/// gradients add up locally, with no communication), then step once.
///
/// Traps: a parameter without a gradient is updated with a zero gradient (weight decay
/// and momentum still apply), where a single-process optimizer skips it. The step
/// needs two transient flat f32 buffers as large as all the parameters. With 8-bit
/// state the blocks run over the flat vector, across parameter boundaries, so the
/// quantization differs from a single-process optimizer's per-parameter blocks.
#[derive(Debug)]
pub struct ZeroOptimizer<R: Rule> {
    group: ProcessGroup,
    stage: ZeroStage,
    params: Vec<Tensor>,
    padded: i64,
    shard: Tensor,
    inner: Optimizer<R>,
    max_grad_norm: Option<f64>,
}

impl<R: Rule> ZeroOptimizer<R> {
    /// Shards the optimizer of `params` (the same parameters, in the same order, on
    /// every rank: checked once here) over the ranks of `group`, and copies rank 0's
    /// parameter values to every rank. Parameters must be contiguous f32 CPU tensors
    /// that require grad.
    pub fn new(
        group: &ProcessGroup,
        params: &[Tensor],
        config: R,
        options: Options,
        stage: ZeroStage,
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
        let total: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let unit = n * block.max(1);
        let padded = (total + unit - 1) / unit * unit;
        let shard_len = padded / n;
        let _no_grad = tch::no_grad_guard();
        for p in params {
            group.broadcast(p, 0)?;
        }
        let flat = flatten(params, padded, |p| Some(p.shallow_clone())).map_err(err)?;
        let shard = flat
            .f_narrow(0, rank as i64 * shard_len, shard_len)
            .and_then(|s| s.f_contiguous())
            .and_then(|s| s.f_detach_copy())
            .map_err(err)?
            .set_requires_grad(true);
        drop(flat);
        let max_grad_norm = options.max_grad_norm;
        let inner_options = Options {
            max_grad_norm: None,
            ..options
        };
        let inner = Optimizer::with_options(&[shard.shallow_clone()], config, inner_options)
            .map_err(|source| DistError::Optim { rank, source })?;
        Ok(Self {
            group: group.clone(),
            stage,
            params: params.iter().map(Tensor::shallow_clone).collect(),
            padded,
            shard,
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
        self.padded
    }

    /// Bytes of optimizer state this rank holds (its shard's).
    pub fn state_bytes(&self) -> u64 {
        self.inner.state_bytes()
    }

    /// Bytes of gradients this rank holds now: the parameters' `.grad`s and its shard's.
    pub fn gradient_bytes(&self) -> u64 {
        self.params
            .iter()
            .chain(std::iter::once(&self.shard))
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .map(|g| g.numel() as u64 * g.kind().elt_size_in_bytes() as u64)
            .sum()
    }

    /// The optimizer of this rank's shard (to change learning rates, read step counts).
    pub fn inner_mut(&mut self) -> &mut Optimizer<R> {
        &mut self.inner
    }

    /// Clears the gradients of the parameters and of this rank's shard (see
    /// [`Optimizer::f_zero_grad`]).
    pub fn f_zero_grad(&self, set_to_none: bool) -> Result<()> {
        let rank = self.group.rank();
        memsave_optim::zero_grad(&self.params, set_to_none)
            .map_err(|source| DistError::Optim { rank, source })?;
        self.inner
            .f_zero_grad(set_to_none)
            .map_err(|source| DistError::Optim { rank, source })
    }

    /// Averages the gradients over the ranks, updates this rank's shard, and gathers
    /// the updated parameters on every rank (see the type's documentation).
    pub fn f_step(&mut self) -> Result<()> {
        let rank = self.group.rank();
        let err = tensor_err(rank, "sharded step");
        let _no_grad = tch::no_grad_guard();
        let n = self.group.world_size();
        let (start, len) = self.shard_range();
        let flat_grad = flatten(&self.params, self.padded, |p| {
            let g = p.grad();
            g.defined().then_some(g)
        })
        .map_err(err)?;
        let mut shard_grad = match self.stage {
            ZeroStage::One => {
                self.group.all_reduce(&flat_grad)?;
                flat_grad
                    .f_narrow(0, start, len)
                    .and_then(|g| g.f_contiguous())
                    .and_then(|g| g.f_detach_copy())
                    .map_err(err)?
            }
            ZeroStage::Two => {
                let out = Tensor::f_empty([len], (Kind::Float, Device::Cpu)).map_err(err)?;
                self.group.reduce_scatter(&out, &flat_grad)?;
                for p in &self.params {
                    memsave_sys::tensor::set_grad_none(p)?;
                }
                out
            }
        };
        drop(flat_grad);
        let _ = shard_grad.f_div_scalar_(n as f64).map_err(err)?;
        if let Some(max_norm) = self.max_grad_norm {
            self.clip(&mut shard_grad, max_norm)?;
        }
        memsave_sys::dist::set_grad(&self.shard, &shard_grad)?;
        self.inner
            .f_step()
            .map_err(|source| DistError::Optim { rank, source })?;
        if self.stage == ZeroStage::One {
            memsave_sys::tensor::set_grad_none(&self.shard)?;
        }
        let gathered = Tensor::f_empty([self.padded], (Kind::Float, Device::Cpu)).map_err(err)?;
        self.group.all_gather(&gathered, &self.shard.detach())?;
        let mut offset = 0;
        for p in &self.params {
            let k = p.numel() as i64;
            let mut dst = p.shallow_clone();
            let src = gathered
                .f_narrow(0, offset, k)
                .and_then(|s| s.f_view_as(p))
                .map_err(err)?;
            dst.f_copy_(&src).map_err(err)?;
            offset += k;
        }
        Ok(())
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

fn tensor_err(rank: usize, context: &'static str) -> impl Fn(tch::TchError) -> DistError + Copy {
    move |source| DistError::Tensor {
        rank,
        context,
        source,
    }
}

/// The tensors `pick` returns for `params`, flattened one after another into a zero f32
/// vector of `padded` values (zeros where `pick` returns `None`).
fn flatten(
    params: &[Tensor],
    padded: i64,
    pick: impl Fn(&Tensor) -> Option<Tensor>,
) -> Result<Tensor, tch::TchError> {
    let flat = Tensor::f_zeros([padded], (Kind::Float, Device::Cpu))?;
    let mut offset = 0;
    for p in params {
        let k = p.numel() as i64;
        if let Some(t) = pick(p) {
            flat.f_narrow(0, offset, k)?.f_copy_(&t.f_reshape([-1])?)?;
        }
        offset += k;
    }
    Ok(flat)
}
