//! Whether a split into micro-batches changes the step: the coupling of the samples of
//! a batch, found from what the step does rather than from a list of ops.
//!
//! Two ways find it. The step's first run happens under
//! `memsave_sys::ops::sample_coupling_op`, which names a batch-norm-family op in
//! training mode. And when it names none, [`split_changes_gradients`] runs one step of a
//! small batch whole and split in two (the same examples, the same random stream, the
//! same running statistics to start from) and compares the gradients: any mixing of
//! the samples that shows in them (`y - y.mean(0)`, a softmax over the batch, a loss
//! normalized by a count over the whole batch) makes them differ by far more than the
//! rounding of the sums.
//!
//! A step that draws random numbers (dropout) draws others for two micro-batches than
//! for the whole batch, so its gradients differ even when nothing couples the samples.
//! For such a step (on the CPU: when the run moved the random generator; on another
//! device, always, since only the CPU generator's state is read) the difference is
//! checked again by the interaction of the two halves `A` and `B` of the batch, each
//! run whole from the same random stream, so with the same draws: with nothing
//! coupling them, `g(A,B) - g(A,A) - g(B,B) + g(B,A)` is zero up to rounding (the
//! first half's terms cancel, and so do the second's), and with coupling it is not.
//! Different draws are not counted as a change: another step would draw others too.
//!
//! What is not found: coupling that does not show at the size probed or on the
//! workload's examples probed (a mixing that only starts past some batch size, or only
//! for some inputs), coupling below the tolerance, and, on a step that draws random
//! numbers, draws that depend on the data (the interaction test assumes they depend
//! on the batch's shape only).
use crate::choice::Choice;
use crate::probe::{machine_cap, step_caught, ProbeError};
use crate::state::Snapshot;
use memsave_checkpoint::Schedule;
use memsave_step::step::Unobserved;
use memsave_step::workload::{Batch, Workload};
use tch::{Device, Kind, Tensor};

/// The relative L2 difference of the gradients, over all parameters together, above
/// which a split changes the step, for parameters in f32 or f64: rounding the sums of
/// two micro-batches instead of one batch moves them by about 1e-7.
pub(crate) const TOLERANCE: f64 = 1e-4;

/// [`TOLERANCE`] for parameters in f16 or bf16, whose rounding is 2^-11 or 2^-8.
pub(crate) const TOLERANCE_HALF: f64 = 3e-2;

/// How the step couples the samples of a batch, as `fit` found it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Coupling {
    /// It runs this op (a batch-norm-family op in training mode).
    Op(String),
    /// A split of `examples` examples in two changed the gradients by `rel_l2`
    /// (relative L2 against the whole batch's; NaN when a split's gradient is not
    /// finite).
    Gradients { examples: i64, rel_l2: f64 },
}

impl Coupling {
    /// What [`Choice::sample_coupling_op`](crate::Choice::sample_coupling_op) holds.
    pub(crate) fn name(&self) -> String {
        match self {
            Coupling::Op(op) => op.clone(),
            Coupling::Gradients { examples, rel_l2 } => format!(
                "a mixing of the samples (a split of {examples} examples in two changed the gradients by {rel_l2:.2e} relative L2)"
            ),
        }
    }

    /// Why micro-batches are lossy for this step, in one sentence, and whether they
    /// were considered.
    pub(crate) fn sentence(&self, allowed: bool) -> String {
        let why = match self {
            Coupling::Op(op) => format!(
                "the step runs {op} in training mode, which normalizes each sample with the whole batch's statistics: micro-batches change the gradients and the running statistics"
            ),
            Coupling::Gradients { examples, rel_l2 } => format!(
                "the step couples the samples of a batch (a reduction over the batch dimension, say): a split of {examples} examples into two micro-batches changed the gradients by {rel_l2:.2e} relative L2 against the whole batch's, so micro-batches change the training"
            ),
        };
        format!(
            "{why}, so {}",
            if allowed {
                "they are a lossy lever here (allowed)"
            } else {
                "they were not considered (allow micro_batches to consider them)"
            }
        )
    }
}

/// The most examples the check runs on: coupling shows at any size from two, and the
/// check's runs, unlike the probes, are not retried smaller when they take too much.
pub(crate) const MAX_CHECK_SIZE: i64 = 64;

/// The size of the batch the check runs on for a step of `global` examples (on ranks,
/// each rank's share): as the first small runs of the plain step (a quarter of it), at
/// most [`MAX_CHECK_SIZE`], even, at least 2; `None` below 2 examples, which no split
/// divides.
pub(crate) fn check_size(global: i64) -> Option<i64> {
    if global < 2 {
        return None;
    }
    let quarter = ((global + 3) / 4).min(MAX_CHECK_SIZE);
    Some((quarter - quarter % 2).max(2))
}

/// The relative L2 difference between the gradients of one plain step on `size`
/// examples split into two micro-batches and on the same examples whole, when it is
/// above the tolerance and not explained by random draws (see the [module](self)
/// docs); `None` when the split changes nothing but rounding. `size` must be even.
///
/// Runs without an optimizer, on the plain schedule (set on the layers), each run from
/// the running statistics and the CPU random stream as they were, which are put back
/// afterwards, the gradients freed. On a device other than the CPU, its generators are
/// reseeded, with one seed, before each run (and left so).
pub(crate) fn split_changes_gradients(
    workload: &mut dyn Workload,
    size: i64,
) -> Result<Option<f64>, ProbeError> {
    let layers = workload.layers().len();
    workload
        .layers_mut()
        .set_schedule(Schedule::plain(layers))
        .map_err(failed)?;
    let params = workload.parameters();
    let tolerance = if params
        .iter()
        .any(|p| matches!(p.kind(), Kind::Half | Kind::BFloat16))
    {
        TOLERANCE_HALF
    } else {
        TOLERANCE
    };
    let rng = memsave_sys::rng::cpu_state().map_err(failed)?;
    // Drawn from the CPU stream, which is put back.
    let seed = Tensor::f_randint(i64::from(i32::MAX), [1], (Kind::Int64, Device::Cpu))
        .and_then(|s| s.f_int64_value(&[0]))
        .map_err(failed)?;
    let runs = Runs {
        device: workload.device(),
        buffers: Snapshot::of(workload.buffers()).map_err(failed)?,
        rng,
        seed,
        params,
    };
    // As the probes: the machine's memory the one cap (see `crate::probe`).
    let cap = machine_cap(runs.device)?;
    let mut outcome = runs.compare(&*workload, size, tolerance);
    if size > 2 && matches!(outcome, Err(ProbeError::OutOfMemory(_))) {
        // Coupling shows from two examples on: the smallest check before giving up.
        outcome = runs.compare(&*workload, 2, tolerance);
    }
    drop(cap);
    let put_back = runs.put_back();
    let outcome = outcome?;
    put_back?;
    Ok(outcome)
}

/// The check's runs: what each starts from.
struct Runs {
    device: Device,
    params: Vec<Tensor>,
    buffers: Snapshot,
    rng: Tensor,
    /// The seed of the generators of a device other than the CPU.
    seed: i64,
}

impl Runs {
    fn compare(
        &self,
        workload: &dyn Workload,
        size: i64,
        tolerance: f64,
    ) -> Result<Option<f64>, ProbeError> {
        let x = workload
            .batch(size)
            .map_err(|e| failed(format!("making a batch of {size}: {e}")))?;
        let whole = self.grads(workload, &x, 1)?;
        let drew = self.device != Device::Cpu
            || !memsave_sys::rng::cpu_state()
                .map_err(failed)?
                .equal(&self.rng);
        // The split's gradients are compared as they come, not kept: one host copy
        // of the gradients (`whole`, then summed into as `mixed`) lives through the
        // check.
        let mut diff = Vec::with_capacity(whole.len());
        self.each_grad(workload, &x, 2, |i, g| {
            diff.push(sum_sq(&(g - &whole[i]))?);
            Ok(())
        })?;
        let norm = sum_sq_all(&whole)?;
        let rel = ratio(diff.iter().sum(), norm);
        if rel <= tolerance {
            return Ok(None);
        }
        if !drew {
            return Ok(Some(rel));
        }
        // Different draws or coupling: the interaction of the halves tells,
        // g(A,B) - g(A,A) - g(B,B) + g(B,A), summed into `mixed` run by run.
        let half = size / 2;
        let a = x.f_narrow(0, half).map_err(failed)?;
        let b = x.f_narrow(half, half).map_err(failed)?;
        let mixed = whole;
        for (batch, add) in [
            (cat(&a, &a)?, false),
            (cat(&b, &b)?, false),
            (cat(&b, &a)?, true),
        ] {
            self.each_grad(workload, &batch, 1, |i, g| {
                let mut m = mixed[i].shallow_clone();
                if add { m.f_add_(g) } else { m.f_sub_(g) }
                    .map(drop)
                    .map_err(failed)
            })?;
        }
        let interaction = ratio(sum_sq_all(&mixed)?, norm);
        Ok((interaction > tolerance || interaction.is_nan()).then_some(rel))
    }

    /// The gradients (on the host, in f32 or f64) of one plain step on `x` in
    /// `micro_batches`, run from the saved statistics and random stream, then freed.
    fn grads(
        &self,
        workload: &dyn Workload,
        x: &Batch,
        micro_batches: usize,
    ) -> Result<Vec<Tensor>, ProbeError> {
        let mut grads = Vec::with_capacity(self.params.len());
        self.each_grad(workload, x, micro_batches, |_, g| {
            grads.push(g.shallow_clone());
            Ok(())
        })?;
        Ok(grads)
    }

    /// Runs one plain step on `x` in `micro_batches` from the saved statistics and
    /// random stream and hands each parameter's gradient (index, then a host copy in
    /// f32, or f64 for f64 parameters; zeros for a parameter without one) to `each`,
    /// one at a time; frees the gradients.
    fn each_grad(
        &self,
        workload: &dyn Workload,
        x: &Batch,
        micro_batches: usize,
        mut each: impl FnMut(usize, &Tensor) -> Result<(), ProbeError>,
    ) -> Result<(), ProbeError> {
        self.buffers.restore().map_err(failed)?;
        if self.device != Device::Cpu {
            tch::manual_seed(self.seed); // every generator, the CPU's put back next
        }
        memsave_sys::rng::set_cpu_state(&self.rng).map_err(failed)?;
        memsave_accum::free_grads(&self.params).map_err(failed)?;
        let config = Choice::new(x.len(), 1).probe_config(None, micro_batches);
        step_caught(
            workload,
            x,
            &config,
            self.device,
            None,
            None,
            &Unobserved,
            false,
        )?;
        let result = self.params.iter().enumerate().try_for_each(|(i, p)| {
            let kind = if p.kind() == Kind::Double {
                Kind::Double
            } else {
                Kind::Float
            };
            let g = p.grad();
            let host = if g.defined() {
                g.f_to(Device::Cpu).and_then(|g| g.f_to_kind(kind))
            } else {
                Tensor::f_zeros(p.size(), (kind, Device::Cpu))
            }
            .map_err(failed)?;
            each(i, &host)
        });
        memsave_accum::free_grads(&self.params).map_err(failed)?;
        result
    }

    /// The statistics, the random stream and the gradients as before the check.
    fn put_back(&self) -> Result<(), ProbeError> {
        self.buffers.restore().map_err(failed)?;
        memsave_sys::rng::set_cpu_state(&self.rng).map_err(failed)?;
        memsave_accum::free_grads(&self.params).map_err(failed)
    }
}

/// `a` then `b`, examples and targets.
fn cat(a: &Batch, b: &Batch) -> Result<Batch, ProbeError> {
    let both = |x: &Tensor, y: &Tensor| Tensor::f_cat(&[x, y], 0).map_err(failed);
    Ok(Batch {
        input: both(&a.input, &b.input)?,
        target: match (&a.target, &b.target) {
            (Some(x), Some(y)) => Some(both(x, y)?),
            _ => None,
        },
    })
}

fn sum_sq(t: &Tensor) -> Result<f64, ProbeError> {
    t.f_square()
        .and_then(|s| s.f_sum(Kind::Double))
        .and_then(|s| s.f_double_value(&[]))
        .map_err(failed)
}

/// The sum of the squares of every value of `ts`, in f64.
fn sum_sq_all(ts: &[Tensor]) -> Result<f64, ProbeError> {
    ts.iter().map(sum_sq).sum()
}

/// `sqrt(num / den)`: 0 when `num` is 0, NaN when either is, infinite when only `den`
/// is 0.
fn ratio(num: f64, den: f64) -> f64 {
    if num == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}

fn failed(e: impl std::fmt::Display) -> ProbeError {
    ProbeError::Failed(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_check_runs_on_an_even_quarter_of_at_most_64() {
        assert_eq!(check_size(1), None);
        assert_eq!(check_size(2), Some(2));
        assert_eq!(check_size(3), Some(2));
        assert_eq!(check_size(16), Some(4));
        assert_eq!(check_size(22), Some(6));
        assert_eq!(check_size(4096), Some(64));
    }
}
