//! Measuring a closure: start and end bytes, the peak above the start, named marks.
use crate::bytes::Bytes;
use crate::stats::{f_max_memory_allocated, f_memory_allocated, f_reset_peak_memory_stats};
use crate::Result;
use memsave_sys::alloc;
use std::fmt;
use tch::Device;

/// A named reading of `memory_allocated` inside a [`measure`] scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// The label given to [`Marks::mark`].
    pub label: String,
    /// Bytes allocated on the device at the mark (absolute, like `memory_allocated`).
    pub bytes: u64,
}

/// Collects marks inside a [`measure`] scope (the seed's `mem_before`/`mem_after`).
#[derive(Debug)]
pub struct Marks {
    device: Device,
    marks: Vec<Mark>,
}

impl Marks {
    /// Records the bytes allocated now under `label` and returns them, or returns the
    /// meter's error and records nothing.
    pub fn f_mark(&mut self, label: impl Into<String>) -> Result<u64> {
        let bytes = f_memory_allocated(self.device)?;
        self.marks.push(Mark {
            label: label.into(),
            bytes,
        });
        Ok(bytes)
    }

    /// Records the bytes allocated now under `label`; returns them.
    ///
    /// # Panics
    /// When the device cannot be read; see [`f_mark`](Self::f_mark).
    pub fn mark(&mut self, label: impl Into<String>) -> u64 {
        self.f_mark(label).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// What [`measure`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measurement {
    /// The device measured.
    pub device: Device,
    /// Bytes allocated when the scope began.
    pub start_bytes: u64,
    /// Bytes allocated when the scope ended.
    pub end_bytes: u64,
    /// Highest allocation during the scope minus `start_bytes`.
    pub peak_bytes: u64,
    /// The marks recorded inside the scope, in order.
    pub marks: Vec<Mark>,
}

impl Measurement {
    /// `end_bytes - start_bytes`: what the scope left allocated (negative if it freed).
    pub fn retained_bytes(&self) -> i64 {
        self.end_bytes as i64 - self.start_bytes as i64
    }

    /// The bytes of the first mark with this label.
    pub fn mark(&self, label: &str) -> Option<u64> {
        self.marks
            .iter()
            .find(|m| m.label == label)
            .map(|m| m.bytes)
    }
}

impl fmt::Display for Measurement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory on {:?}", self.device)?;
        writeln!(f, "  start     {:>12}", Bytes(self.start_bytes).to_string())?;
        writeln!(
            f,
            "  peak      {:>12}  (above start)",
            Bytes(self.peak_bytes).to_string()
        )?;
        write!(f, "  end       {:>12}", Bytes(self.end_bytes).to_string())?;
        for m in &self.marks {
            write!(f, "\n  {:<20} {:>12}", m.label, Bytes(m.bytes).to_string())?;
        }
        Ok(())
    }
}

/// Runs `f` and measures the memory of `device` around it, or returns the meter's
/// error (a device that cannot be metered, such as CUDA on a machine without a GPU).
///
/// The device is read before `f` runs, so on an unmeterable device `f` is not run.
/// The device's peak is reset at the start of the scope; on the CPU the enclosing
/// peak is restored when the scope ends, also when `f` panics, so scopes nest and an
/// outer scope still sees what happened before an inner one.
///
/// # Traps
/// On CUDA the caching allocator's peak can be reset but not raised back: after an
/// inner scope the outer scope's peak only covers what came after the inner scope
/// began. Nest scopes on the CPU only, or measure CUDA code with one scope.
pub fn f_measure<T>(device: Device, f: impl FnOnce(&mut Marks) -> T) -> Result<(T, Measurement)> {
    let outer_peak = f_max_memory_allocated(device)?;
    let start_bytes = f_memory_allocated(device)?;
    f_reset_peak_memory_stats(device)?;
    let restore_outer_peak = OuterPeak { device, outer_peak };
    let mut marks = Marks {
        device,
        marks: Vec::new(),
    };
    let value = f(&mut marks);
    let end_bytes = f_memory_allocated(device)?;
    let peak = f_max_memory_allocated(device)?;
    drop(restore_outer_peak);
    let measurement = Measurement {
        device,
        start_bytes,
        end_bytes,
        peak_bytes: peak.saturating_sub(start_bytes),
        marks: marks.marks,
    };
    Ok((value, measurement))
}

/// Runs `f` and measures the memory of `device` around it; see [`f_measure`].
///
/// # Panics
/// When the device cannot be metered, with the meter's message (before `f` runs).
pub fn measure<T>(device: Device, f: impl FnOnce(&mut Marks) -> T) -> (T, Measurement) {
    f_measure(device, f).unwrap_or_else(|e| panic!("{e}"))
}

/// Raises the CPU peak back to the enclosing scope's when dropped: at the end of a
/// scope, or while unwinding from a panic in it.
struct OuterPeak {
    device: Device,
    outer_peak: u64,
}

impl Drop for OuterPeak {
    fn drop(&mut self) {
        if self.device == Device::Cpu {
            alloc::raise_peak(self.outer_peak);
        }
    }
}
