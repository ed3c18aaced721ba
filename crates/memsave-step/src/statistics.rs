//! The check that a step with a one-example micro-batch left the running statistics
//! finite.
//!
//! BatchNorm in training normalizes each channel over the batch and the feature map,
//! and updates its running variance with the unbiased estimate, which divides by the
//! count less one. With one value per channel (one example whose feature map is 1x1:
//! ResNet-18's last stage on 32x32 images, or a `BatchNorm1d` on one example) that is a
//! division by zero: libtorch's kernel writes a NaN running variance and raises nothing
//! (PyTorch refuses the input in Python: "Expected more than 1 value per channel when
//! training"), and every prediction in evaluation mode is NaN from then on. A split
//! into micro-batches of one example makes exactly this input from a batch that was
//! fine, so the step checks after such a split.
use crate::error::StepError;
use crate::workload::Workload;
use tch::Tensor;

/// The workload's floating-point buffers that were finite before the step, each with a
/// copy of its values, to check and put back after it.
pub(crate) struct StatisticsGuard {
    saved: Vec<(Tensor, Tensor)>,
}

fn torch(e: tch::TchError) -> StepError {
    StepError::Torch(e)
}

fn all_finite(t: &Tensor) -> Result<bool, StepError> {
    let finite = t.f_isfinite().and_then(|f| f.f_all()).map_err(torch)?;
    Ok(finite.f_int64_value(&[]).map_err(torch)? == 1)
}

impl StatisticsGuard {
    /// Copies the buffers of `model` that are floating point and finite (a buffer that
    /// holds infinities on purpose, an attention mask say, is left alone).
    pub(crate) fn save(model: &dyn Workload) -> Result<Self, StepError> {
        let _no_grad = tch::no_grad_guard();
        let mut saved = Vec::new();
        for b in model.buffers() {
            if b.is_floating_point() && all_finite(&b)? {
                let mut copy = b.f_empty_like().map_err(torch)?;
                copy.f_copy_(&b).map_err(torch)?;
                saved.push((b, copy));
            }
        }
        Ok(Self { saved })
    }

    /// `Ok` when every saved buffer is still finite; otherwise puts every saved buffer
    /// back as it was before the step and returns
    /// [`StepError::NonFiniteStatistics`] (`split`: the step split its batch).
    pub(crate) fn check(self, smallest_micro_batch: i64, split: bool) -> Result<(), StepError> {
        let _no_grad = tch::no_grad_guard();
        let mut spoiled = 0;
        for (b, _) in &self.saved {
            if !all_finite(b)? {
                spoiled += 1;
            }
        }
        if spoiled == 0 {
            return Ok(());
        }
        for (b, copy) in &self.saved {
            b.shallow_clone().f_copy_(copy).map_err(torch)?;
        }
        Err(StepError::NonFiniteStatistics {
            buffers: spoiled,
            micro_batch: smallest_micro_batch,
            split,
        })
    }
}
