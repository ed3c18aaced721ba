//! Searching the largest micro-batch whose forward and backward fit a byte budget.
use crate::error::{AccumError, BoxError, Result};
use crate::grads::free_grads;
use crate::limit::LimitGuard;
use memsave_meter::{f_measure, f_memory_allocated, memory_limit, Bytes};
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use tch::{Device, Tensor};

/// One micro-batch size the search tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trial {
    /// Samples in the micro-batch.
    pub micro_batch: i64,
    /// Whether its forward and backward ran within the budget.
    pub fits: bool,
    /// Highest allocation above the search's start: the step's peak when it ran to
    /// the end, the allocation reached before the refused one when an allocation
    /// failed (the simulated CPU limit, or CUDA out of memory).
    pub peak_bytes: u64,
}

/// What [`fit_micro_batch`] found and tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitReport {
    /// The largest micro-batch size that fits (at most the bound searched).
    pub micro_batch: i64,
    /// The budget that applied, in bytes above the allocation when the search started:
    /// the one asked for, or less when a memory limit already set left less room.
    pub budget_bytes: u64,
    /// Every trial, in the order run.
    pub trials: Vec<Trial>,
}

impl fmt::Display for FitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "largest micro-batch within {}: {}",
            Bytes(self.budget_bytes),
            self.micro_batch
        )?;
        for t in &self.trials {
            write!(
                f,
                "\n  {:>8} samples  {:<8} peak {}",
                t.micro_batch,
                if t.fits { "fits" } else { "too big" },
                Bytes(t.peak_bytes)
            )?;
        }
        Ok(())
    }
}

/// Finds the largest micro-batch, up to `max_micro_batch` samples, whose forward and
/// backward stay within `budget_bytes` above the memory allocated on the parameters'
/// device when the search starts (after the gradients of `params` are freed).
///
/// `micro_loss(n)` runs the forward of a micro-batch of `n` samples and returns its
/// loss; the search runs backward on it. The search doubles the size from 1 until a
/// trial fails or the bound is reached, then bisects; it assumes memory grows with the
/// micro-batch.
///
/// How a trial is judged depends on the device of `params` (the CPU when `params` is
/// empty):
/// - **CPU**: each trial runs under the meter's simulated memory limit
///   ([`memsave_meter::f_set_memory_limit`]), so an allocation past the budget fails
///   at once with an out-of-memory error, which counts as "does not fit" (so does an
///   allocation the system refuses, "not enough memory"). When a limit is already set
///   and leaves less room than `budget_bytes`, that tighter limit is the budget (the
///   report's `budget_bytes` says which applied). The limit in force before is
///   restored when the search ends, also on an error or a panic.
/// - **CUDA**: libtorch has no byte limit for allocated memory there, so each trial
///   runs to completion and fits when its measured peak
///   ([`memsave_meter::f_measure`]) is within the budget; a trial the GPU itself
///   cannot hold (CUDA out of memory) counts as "does not fit". Each trial resets the
///   device's peak statistics.
///
/// Traps: the gradients of `params` are freed before and after every trial, so each
/// trial counts the gradient buffers; the optimizer step is not run (it would change
/// the parameters), so leave room for optimizer state such as Adam's moments, or
/// create it with one real step before searching. Use tch's `f_` functions in the
/// closure: a panicking shortcut that hits the limit is caught and counts as "does not
/// fit", but its panic message is still printed. All of `params` must live on one
/// device.
pub fn fit_micro_batch<F, E>(
    budget_bytes: u64,
    max_micro_batch: i64,
    params: &[Tensor],
    mut micro_loss: F,
) -> Result<FitReport>
where
    F: FnMut(i64) -> Result<Tensor, E>,
    E: Into<BoxError>,
{
    if max_micro_batch < 1 {
        return Err(AccumError::ZeroMicroBatchSize(max_micro_batch));
    }
    let device = params.first().map_or(Device::Cpu, Tensor::device);
    if let Some(p) = params.iter().find(|p| p.device() != device) {
        return Err(AccumError::MixedDevices {
            first: device,
            other: p.device(),
        });
    }
    if !matches!(device, Device::Cpu | Device::Cuda(_)) {
        return Err(AccumError::Meter(memsave_meter::MeterError::Device {
            device,
            reason: "the search runs on the CPU and CUDA only".into(),
        }));
    }
    free_grads(params)?;
    let start = f_memory_allocated(device)?;
    let (budget_bytes, _limit) = match device {
        Device::Cpu => {
            let budget = match memory_limit(Device::Cpu) {
                Some(limit) => budget_bytes.min(limit.saturating_sub(start)),
                None => budget_bytes,
            };
            (budget, Some(LimitGuard::set(start.saturating_add(budget))?))
        }
        _ => (budget_bytes, None),
    };
    let mut trials = Vec::new();
    let mut run = |n: i64, trials: &mut Vec<Trial>| -> Result<(bool, Option<String>)> {
        let (outcome, m) = f_measure(device, |_| {
            panic::catch_unwind(AssertUnwindSafe(|| -> Result<(), BoxError> {
                let loss = micro_loss(n).map_err(Into::into)?;
                loss.f_backward()?;
                Ok(())
            }))
        })?;
        free_grads(params)?;
        let peak_bytes = (m.start_bytes + m.peak_bytes).saturating_sub(start);
        let failure = match outcome {
            Ok(Ok(())) if peak_bytes <= budget_bytes => None,
            Ok(Ok(())) => Some(format!(
                "the peak of {} is over the budget",
                Bytes(peak_bytes)
            )),
            Ok(Err(e)) if is_out_of_memory(&*e) => Some(e.to_string()),
            Ok(Err(source)) => {
                return Err(AccumError::Trial {
                    micro_batch: n,
                    source,
                })
            }
            Err(payload) => match panic_message(&payload) {
                Some(msg) if memsave_sys::is_out_of_memory_message(msg) => Some(msg.to_owned()),
                _ => panic::resume_unwind(payload),
            },
        };
        let fits = failure.is_none();
        trials.push(Trial {
            micro_batch: n,
            fits,
            peak_bytes,
        });
        Ok((fits, failure))
    };

    if let (false, reason) = run(1, &mut trials)? {
        return Err(AccumError::BudgetTooSmall {
            budget_bytes,
            reason: reason.unwrap_or_default(),
        });
    }
    let mut fits = 1i64;
    let mut too_big: Option<i64> = None;
    let mut next = 2i64;
    while too_big.is_none() && fits < max_micro_batch {
        let n = next.min(max_micro_batch);
        if run(n, &mut trials)?.0 {
            fits = n;
        } else {
            too_big = Some(n);
        }
        next = n.saturating_mul(2);
    }
    if let Some(mut hi) = too_big {
        while hi - fits > 1 {
            let mid = fits + (hi - fits) / 2;
            if run(mid, &mut trials)?.0 {
                fits = mid;
            } else {
                hi = mid;
            }
        }
    }
    Ok(FitReport {
        micro_batch: fits,
        budget_bytes,
        trials,
    })
}

/// Whether `e` or any of its causes is an out-of-memory error, by its text (the trial's
/// error type is the caller's).
fn is_out_of_memory(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(e);
    while let Some(err) = current {
        if memsave_sys::is_out_of_memory_message(&err.to_string()) {
            return true;
        }
        current = err.source();
    }
    false
}

fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> Option<&str> {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
}
