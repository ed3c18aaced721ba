//! Leak detection: run a training step N times and see what each step leaves behind.
use crate::bytes::Bytes;
use crate::stats::f_memory_allocated;
use crate::MeterError;
use std::fmt;
use tch::Device;

/// Bytes allocated after each of N runs of a step; see [`detect_leak`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeakReport {
    /// Bytes allocated before the first step.
    pub start_bytes: u64,
    /// Bytes allocated after each step.
    pub after_step_bytes: Vec<u64>,
}

impl LeakReport {
    /// Growth of each step over the previous one (the first against the start).
    pub fn growth_per_step(&self) -> Vec<i64> {
        let mut previous = self.start_bytes as i64;
        self.after_step_bytes
            .iter()
            .map(|&b| {
                let growth = b as i64 - previous;
                previous = b as i64;
                growth
            })
            .collect()
    }

    /// Bytes left behind per step after the first (which may build lasting state such
    /// as optimizer buffers): `(last - first) / (n - 1)`; 0 with fewer than two steps.
    pub fn leaked_bytes_per_step(&self) -> i64 {
        match self.after_step_bytes.as_slice() {
            [first, .., last] => {
                (*last as i64 - *first as i64) / (self.after_step_bytes.len() as i64 - 1)
            }
            _ => 0,
        }
    }

    /// True when every step after the first left memory behind.
    pub fn is_leaking(&self) -> bool {
        let growth = self.growth_per_step();
        growth.len() >= 2 && growth[1..].iter().all(|&g| g > 0)
    }
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_step = self.leaked_bytes_per_step();
        if self.is_leaking() {
            write!(
                f,
                "leak: {} left behind per step over {} steps",
                Bytes(per_step.unsigned_abs()),
                self.after_step_bytes.len()
            )
        } else {
            write!(
                f,
                "no leak: memory is flat after the first step ({} steps)",
                self.after_step_bytes.len()
            )
        }
    }
}

/// Runs `step(i)` for `i` in `0..steps` and records the bytes allocated on `device`
/// after each; the first error, of a step or of the meter, stops the run and is
/// returned (a meter error converted into `E`).
///
/// The device is read before the first step, so on a device that cannot be metered
/// no step runs. The classic leak, `total_loss = total_loss + loss`, keeps every
/// step's graph alive and shows as a steady growth per step; accumulating
/// `loss.double_value(&[])` instead shows as zero.
pub fn f_detect_leak<E: From<MeterError>>(
    device: Device,
    steps: usize,
    step: impl FnMut(usize) -> Result<(), E>,
) -> Result<LeakReport, E> {
    run_steps(device, steps, step).map_err(|failure| match failure {
        Failure::Meter(e) => e.into(),
        Failure::Step(e) => e,
    })
}

/// Runs `step(i)` for `i` in `0..steps` and records the bytes allocated on `device`
/// after each; the first error of a step stops the run and is returned. See
/// [`f_detect_leak`].
///
/// # Panics
/// When the device cannot be metered, with the meter's message (before the first
/// step runs): an unmeterable device never reports "no leak".
pub fn detect_leak<E>(
    device: Device,
    steps: usize,
    step: impl FnMut(usize) -> Result<(), E>,
) -> Result<LeakReport, E> {
    run_steps(device, steps, step).map_err(|failure| match failure {
        Failure::Meter(e) => panic!("{e}"),
        Failure::Step(e) => e,
    })
}

enum Failure<E> {
    Meter(MeterError),
    Step(E),
}

fn run_steps<E>(
    device: Device,
    steps: usize,
    mut step: impl FnMut(usize) -> Result<(), E>,
) -> Result<LeakReport, Failure<E>> {
    let start_bytes = f_memory_allocated(device).map_err(Failure::Meter)?;
    // Grown as the steps run: `steps` is the caller's number and may be huge.
    let mut after_step_bytes = Vec::new();
    for i in 0..steps {
        step(i).map_err(Failure::Step)?;
        after_step_bytes.push(f_memory_allocated(device).map_err(Failure::Meter)?);
    }
    Ok(LeakReport {
        start_bytes,
        after_step_bytes,
    })
}
