//! A scoped CPU memory limit that is removed however the scope ends.
use crate::error::Result;
use memsave_meter::{f_set_memory_limit, memory_limit};
use tch::Device;

/// Sets the meter's CPU memory limit; dropping it (also while unwinding from a panic)
/// restores the limit that was in force before, normally none.
#[derive(Debug)]
pub(crate) struct LimitGuard {
    previous: Option<u64>,
}

impl LimitGuard {
    /// Limits counted CPU memory to `limit_bytes` until the guard is dropped.
    pub(crate) fn set(limit_bytes: u64) -> Result<Self> {
        let previous = memory_limit(Device::Cpu);
        f_set_memory_limit(Device::Cpu, Some(limit_bytes))?;
        Ok(Self { previous })
    }
}

impl Drop for LimitGuard {
    fn drop(&mut self) {
        // Cannot fail on the CPU, which `set` already used.
        let _ = f_set_memory_limit(Device::Cpu, self.previous);
    }
}
