//! The accumulation loop: micro-batch forward/backward, one optimizer step per batch.
use crate::error::{AccumError, BoxError, Result};
use crate::grads::free_grads;
use crate::split::{f_split, MicroBatch, Split};
use memsave_amp::{f_clip_grad_norm_, GradScaler, StepOutcome};
use memsave_meter::f_measure;
use tch::{nn, Tensor};

/// Settings of a [`GradAccumulator`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AccumConfig {
    /// How each batch is split (default: one micro-batch, i.e. no accumulation).
    pub split: Split,
    /// Clips the joint L2 norm of the accumulated (unscaled) gradients before the step
    /// (default: no clipping).
    pub max_grad_norm: Option<f64>,
}

impl Default for AccumConfig {
    fn default() -> Self {
        Self {
            split: Split::Count(1),
            max_grad_norm: None,
        }
    }
}

/// What happened to one micro-batch, measured with the meter on the parameters' device.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroStep {
    /// The micro-batch.
    pub micro_batch: MicroBatch,
    /// Its mean-reduced loss, unweighted.
    pub loss: f64,
    /// Bytes the closure left allocated: the activations saved for backward plus the
    /// loss (0 on a device the meter cannot read).
    pub retained_after_forward_bytes: u64,
    /// Highest allocation during its forward and backward, above its start.
    pub peak_bytes: u64,
}

/// What one accumulated optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct AccumStep {
    /// Whether the optimizer ran (always, without a scaler).
    pub outcome: StepOutcome,
    /// The full-batch mean loss: the weighted sum of the micro-losses.
    pub loss: f64,
    /// One entry per micro-batch, in order.
    pub micro_steps: Vec<MicroStep>,
}

/// Gradient accumulation: one optimizer step from the micro-batches of a batch.
///
/// For each micro-batch the closure returns the **mean-reduced** loss over that
/// micro-batch; the loop multiplies it by the micro-batch's weight `len / batch_size`
/// (and by the scale, with a [`GradScaler`]) and runs backward, so the accumulated
/// gradient equals the full-batch gradient of the mean loss, also when the last
/// micro-batch is smaller. After the last micro-batch it steps the optimizer (with a
/// scaler: unscales once, skips the whole step if any gradient is inf/NaN, updates the
/// scale) and frees the gradients (set to none). Gradients present before the call are
/// freed first.
///
/// Only one micro-batch's activations are alive at a time, so the activation memory is
/// that of the largest micro-batch. The forward is yours: run it under
/// [`memsave_amp::autocast`] or through a checkpointed model inside the closure and it
/// composes with accumulation unchanged.
///
/// Traps: a loss summed (not averaged) over the micro-batch would be weighted twice;
/// a model whose forward couples samples (batch norm) sees micro-batch statistics;
/// each micro-loss is read back as an `f64` for the report (a device sync on CUDA),
/// and on CUDA the per-micro-batch measurement resets the device's peak statistics.
#[derive(Debug, Clone, Default)]
pub struct GradAccumulator {
    config: AccumConfig,
}

impl GradAccumulator {
    /// An accumulator with `config`.
    pub fn new(config: AccumConfig) -> Self {
        Self { config }
    }

    /// An accumulator that splits every batch with `split`.
    pub fn with_split(split: Split) -> Self {
        Self::new(AccumConfig {
            split,
            ..Default::default()
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &AccumConfig {
        &self.config
    }

    /// Runs forward/backward on every micro-batch of a `batch_size` batch, then one
    /// optimizer step, then frees the gradients.
    pub fn f_step<F, E>(
        &self,
        optimizer: &mut nn::Optimizer,
        batch_size: i64,
        micro_loss: F,
    ) -> Result<AccumStep>
    where
        F: FnMut(&MicroBatch) -> Result<Tensor, E>,
        E: Into<BoxError>,
    {
        self.step_impl(optimizer, None, batch_size, micro_loss)
    }

    /// [`f_step`](Self::f_step) with loss scaling: every weighted micro-loss is scaled,
    /// the gradients are unscaled once, the step is skipped when any is inf/NaN (the
    /// parameters stay unchanged) and the scale is updated once.
    pub fn f_step_scaled<F, E>(
        &self,
        optimizer: &mut nn::Optimizer,
        scaler: &mut GradScaler,
        batch_size: i64,
        micro_loss: F,
    ) -> Result<AccumStep>
    where
        F: FnMut(&MicroBatch) -> Result<Tensor, E>,
        E: Into<BoxError>,
    {
        self.step_impl(optimizer, Some(scaler), batch_size, micro_loss)
    }

    /// Only the accumulation: forward/backward on every micro-batch, adding into the
    /// gradients of `params` (without freeing them first). Step and free them yourself,
    /// e.g. with [`free_grads`](crate::free_grads).
    pub fn f_accumulate<F, E>(
        &self,
        params: &[Tensor],
        scaler: Option<&mut GradScaler>,
        batch_size: i64,
        mut micro_loss: F,
    ) -> Result<Vec<MicroStep>>
    where
        F: FnMut(&MicroBatch) -> Result<Tensor, E>,
        E: Into<BoxError>,
    {
        let micro_batches = f_split(batch_size, self.config.split)?;
        let device = params.first().ok_or(AccumError::NoParameters)?.device();
        let mut scaler = scaler;
        let mut steps = Vec::with_capacity(micro_batches.len());
        for mb in &micro_batches {
            let fail = |source: BoxError| AccumError::MicroBatch {
                index: mb.index,
                start: mb.start,
                end: mb.end(),
                source,
            };
            let (result, m) = f_measure(device, |marks| -> Result<(f64, u64)> {
                let loss = micro_loss(mb).map_err(|e| fail(e.into()))?;
                let retained = marks.f_mark("forward")?;
                if loss.numel() != 1 {
                    return Err(AccumError::LossNotScalar {
                        index: mb.index,
                        shape: loss.size(),
                    });
                }
                let value = loss.f_double_value(&[]).map_err(|e| fail(e.into()))?;
                let weighted = loss.f_mul_scalar(mb.weight)?;
                // The unweighted loss is not needed in backward: free it first, as
                // `loss = loss * w` does in PyTorch.
                drop(loss);
                let to_backward = match scaler.as_deref_mut() {
                    Some(s) => s.f_scale(&weighted)?,
                    None => weighted,
                };
                to_backward.f_backward().map_err(|e| fail(e.into()))?;
                Ok((value, retained))
            })?;
            let (loss, retained_abs) = result?;
            steps.push(MicroStep {
                micro_batch: *mb,
                loss,
                retained_after_forward_bytes: retained_abs.saturating_sub(m.start_bytes),
                peak_bytes: m.peak_bytes,
            });
        }
        Ok(steps)
    }

    fn step_impl<F, E>(
        &self,
        optimizer: &mut nn::Optimizer,
        mut scaler: Option<&mut GradScaler>,
        batch_size: i64,
        micro_loss: F,
    ) -> Result<AccumStep>
    where
        F: FnMut(&MicroBatch) -> Result<Tensor, E>,
        E: Into<BoxError>,
    {
        let params = optimizer.trainable_variables();
        free_grads(&params)?;
        let result = self
            .f_accumulate(&params, scaler.as_deref_mut(), batch_size, micro_loss)
            .and_then(|micro_steps| {
                let outcome = self.apply(optimizer, scaler, &params)?;
                let loss = micro_steps
                    .iter()
                    .map(|s| s.micro_batch.weight * s.loss)
                    .sum();
                Ok(AccumStep {
                    outcome,
                    loss,
                    micro_steps,
                })
            });
        free_grads(&params)?;
        result
    }

    /// Clips, steps (through the scaler if any) and updates the scale.
    fn apply(
        &self,
        optimizer: &mut nn::Optimizer,
        scaler: Option<&mut GradScaler>,
        params: &[Tensor],
    ) -> Result<StepOutcome> {
        match scaler {
            Some(scaler) => {
                if let Some(max_norm) = self.config.max_grad_norm {
                    scaler.f_unscale_params_(params)?;
                    f_clip_grad_norm_(params, max_norm)?;
                }
                let outcome = scaler.f_step(optimizer)?;
                scaler.f_update()?;
                Ok(outcome)
            }
            None => {
                if let Some(max_norm) = self.config.max_grad_norm {
                    f_clip_grad_norm_(params, max_norm)?;
                }
                optimizer.step();
                Ok(StepOutcome::Stepped)
            }
        }
    }
}
