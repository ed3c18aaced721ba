//! The ranks of a fit in lockstep. With a process group every rank runs the same
//! search, and a search decides on measurements (peaks, times, a clock) that differ
//! from rank to rank: each such figure is agreed first, as the largest over the ranks
//! (the rank with the most memory and the slowest rank set what fits and how fast the
//! step is), so that every rank takes the same branch and issues the same collectives.
//! On one process every figure is its own.
use crate::FitError;
use memsave_step::ProcessGroup;
use std::time::Instant;
use tch::{Kind, Tensor};

/// The ranks `fit` runs on: one process, or every rank of a process group.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ranks {
    group: Option<ProcessGroup>,
}

impl Ranks {
    /// The ranks of `group`, or one process.
    pub(crate) fn new(group: Option<&ProcessGroup>) -> Self {
        Self {
            group: group.cloned(),
        }
    }

    /// The process group, if the fit runs on one.
    pub(crate) fn group(&self) -> Option<&ProcessGroup> {
        self.group.as_ref()
    }

    /// Ranks in the group (1 on one process).
    pub(crate) fn world_size(&self) -> usize {
        self.group.as_ref().map_or(1, ProcessGroup::world_size)
    }

    /// This process's rank (0 on one process).
    pub(crate) fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, ProcessGroup::rank)
    }

    /// Every rank's `values`, by rank (one process: its own). Every rank must call it
    /// at the same point with as many values.
    ///
    /// # Errors
    /// [`FitError::Group`] when the collective fails (a rank died, or the group's
    /// timeout passed).
    pub(crate) fn gather(&self, values: &[f64]) -> Result<Vec<Vec<f64>>, FitError> {
        let Some(group) = &self.group else {
            return Ok(vec![values.to_vec()]);
        };
        let n = group.world_size();
        let failed = |e: &dyn std::fmt::Display| {
            FitError::Group(format!(
                "rank {}: agreeing on a measurement with the other ranks: {e}",
                group.rank()
            ))
        };
        let input = Tensor::from_slice(values).to_kind(Kind::Double);
        let output = Tensor::zeros([(n * values.len()) as i64], (Kind::Double, input.device()));
        group.all_gather(&output, &input).map_err(|e| failed(&e))?;
        let all = Vec::<f64>::try_from(&output).map_err(|e| failed(&e))?;
        Ok(all
            .chunks(values.len().max(1))
            .map(<[f64]>::to_vec)
            .collect())
    }

    /// Every rank's `values`, by rank, as [`gather`](Self::gather), but by a broadcast
    /// from each rank in turn: the agreement after a step, whose outcome may differ
    /// from rank to rank. No step broadcasts (its collectives all-reduce,
    /// reduce-scatter, all-gather, exchange all-to-all and wait at a barrier; Gloo keeps
    /// each kind apart), so a rank whose step failed alone and waits here never meets
    /// a collective of the step that another rank still waits in: both wait until the
    /// group's timeout and fail with an error, instead of exchanging one another's
    /// bytes. Every rank must call it at the same point with as many values.
    ///
    /// # Errors
    /// [`FitError::Group`] when a broadcast fails (a rank died, or the group's timeout
    /// passed).
    pub(crate) fn gather_after_step(&self, values: &[f64]) -> Result<Vec<Vec<f64>>, FitError> {
        let Some(group) = &self.group else {
            return Ok(vec![values.to_vec()]);
        };
        let failed = |e: &dyn std::fmt::Display| {
            FitError::Group(format!(
                "rank {}: agreeing on a step's outcome with the other ranks: {e}",
                group.rank()
            ))
        };
        let mine = Tensor::from_slice(values).to_kind(Kind::Double);
        (0..group.world_size())
            .map(|src| {
                let t = if src == group.rank() {
                    mine.copy()
                } else {
                    mine.zeros_like()
                };
                group.broadcast(&t, src).map_err(|e| failed(&e))?;
                Vec::<f64>::try_from(&t).map_err(|e| failed(&e))
            })
            .collect()
    }

    /// The largest of each of `values` over the ranks (see [`gather`](Self::gather)).
    pub(crate) fn max(&self, values: &[f64]) -> Result<Vec<f64>, FitError> {
        let all = self.gather(values)?;
        Ok((0..values.len())
            .map(|i| all.iter().map(|r| r[i]).fold(f64::NEG_INFINITY, f64::max))
            .collect())
    }

    /// Whether `yes` holds on any rank.
    pub(crate) fn any(&self, yes: bool) -> Result<bool, FitError> {
        Ok(self.max(&[f64::from(u8::from(yes))])?[0] > 0.0)
    }

    /// Seconds since `since` (each rank's own start of the fit) on the rank that has
    /// spent the most: the clock every deadline of the search reads.
    pub(crate) fn elapsed_s(&self, since: Instant) -> Result<f64, FitError> {
        Ok(self.max(&[since.elapsed().as_secs_f64()])?[0])
    }
}
