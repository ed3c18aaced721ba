//! Measuring a closure: start and end bytes, the peak above the start, named marks.
use crate::bytes::Bytes;
use crate::stats::{f_max_memory_allocated, f_memory_allocated, f_reset_peak_memory_stats};
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
    /// Records the bytes allocated now under `label`; returns them.
    pub fn mark(&mut self, label: impl Into<String>) -> u64 {
        let bytes = f_memory_allocated(self.device).unwrap_or(0);
        self.marks.push(Mark {
            label: label.into(),
            bytes,
        });
        bytes
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

/// Runs `f` and measures the memory of `device` around it.
///
/// The device's peak is reset at the start of the scope; on the CPU the enclosing
/// peak is restored afterwards, so scopes nest. On CUDA the peak stays reset.
/// On a device that cannot be metered all readings are 0.
pub fn measure<T>(device: Device, f: impl FnOnce(&mut Marks) -> T) -> (T, Measurement) {
    let outer_peak = f_max_memory_allocated(device).unwrap_or(0);
    let start_bytes = f_memory_allocated(device).unwrap_or(0);
    let _ = f_reset_peak_memory_stats(device);
    let mut marks = Marks {
        device,
        marks: Vec::new(),
    };
    let value = f(&mut marks);
    let end_bytes = f_memory_allocated(device).unwrap_or(0);
    let peak = f_max_memory_allocated(device).unwrap_or(0);
    if device == Device::Cpu {
        alloc::raise_peak(outer_peak);
    }
    let measurement = Measurement {
        device,
        start_bytes,
        end_bytes,
        peak_bytes: peak.saturating_sub(start_bytes),
        marks: marks.marks,
    };
    (value, measurement)
}
