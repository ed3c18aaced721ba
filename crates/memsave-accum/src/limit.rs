//! A scoped CPU memory limit that is removed however the scope ends: the meter's
//! [`MemoryLimitGuard`], on the CPU, with this crate's error.
use crate::error::Result;
use memsave_meter::MemoryLimitGuard;
use tch::Device;

/// Sets the meter's CPU memory limit for a scope.
pub(crate) enum LimitGuard {}

impl LimitGuard {
    /// Limits counted CPU memory to `limit_bytes` (or keeps a lower limit already in
    /// force) until the returned guard is dropped, also while unwinding from a panic;
    /// it then puts back the limit that was in force before, normally none.
    pub(crate) fn set(limit_bytes: u64) -> Result<MemoryLimitGuard> {
        Ok(MemoryLimitGuard::f_new(Device::Cpu, limit_bytes)?)
    }
}
