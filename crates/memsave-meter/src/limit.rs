//! A simulated memory limit held for a scope: [`MemoryLimitGuard`].
use crate::stats::{f_set_memory_limit, memory_limit};
use crate::Result;
use tch::Device;

/// A simulated memory limit ([`f_set_memory_limit`]) in force while the guard lives;
/// dropping it puts back the limit that was in force before, also when the scope is
/// left by `?` or by a panic unwinding through it.
///
/// The guard only ever tightens: the limit it sets is the smaller of the one asked
/// for and one already in force (a caller's own limit is never loosened). Guards
/// nest: drop them in the reverse order of their creation (as scopes do) and each
/// puts back the limit its creation found.
///
/// Warnings: the limit is process-wide, not per thread: while a guard lives, every
/// thread's CPU allocations count against it. And code run under it must expect its
/// allocations to fail: tch's short (non-`f_`) methods panic on that error, so a
/// closure that calls them (a layer's `forward`) panics past its budget and poisons
/// any `Mutex` it holds. To learn whether code fits a budget without making it fail,
/// measure its peak ([`f_measure`](crate::f_measure)) and compare instead.
///
/// Only the CPU has a simulated limit: on any other device [`MemoryLimitGuard::f_new`]
/// is the error of [`f_set_memory_limit`].
///
/// ```
/// use memsave_meter::{f_memory_allocated, memory_limit, MemoryLimitGuard};
/// use tch::{Device, Kind, Tensor};
///
/// let cpu = Device::Cpu;
/// let start = f_memory_allocated(cpu)?;
/// {
///     let _limit = MemoryLimitGuard::f_new(cpu, start + 1024)?;
///     // 1 KiB fits; 4 MiB more does not, and is an error, not a crash.
///     let small = Tensor::f_zeros([256], (Kind::Float, cpu)).expect("1 KiB fits");
///     assert!(Tensor::f_zeros([1 << 20], (Kind::Float, cpu)).is_err());
///     drop(small);
/// }
/// // The guard is gone: so is its limit.
/// assert_eq!(memory_limit(cpu), None);
/// # Ok::<(), memsave_meter::MeterError>(())
/// ```
#[derive(Debug)]
#[must_use = "the limit is removed as soon as the guard is dropped"]
pub struct MemoryLimitGuard {
    device: Device,
    previous: Option<u64>,
}

impl MemoryLimitGuard {
    /// Limits `device` to `limit_bytes` of counted memory (or keeps a lower limit
    /// already in force) until the guard is dropped.
    ///
    /// # Errors
    /// On a device without a simulated limit (anything but the CPU); nothing changes then.
    pub fn f_new(device: Device, limit_bytes: u64) -> Result<Self> {
        let previous = memory_limit(device);
        let limit = previous.map_or(limit_bytes, |p| p.min(limit_bytes));
        f_set_memory_limit(device, Some(limit))?;
        Ok(Self { device, previous })
    }

    /// The limit in force while the guard lives (the smaller of the one asked for and
    /// the one in force before).
    pub fn limit(&self) -> Option<u64> {
        memory_limit(self.device)
    }

    /// The limit the guard puts back when dropped (`None`: no limit).
    pub fn previous(&self) -> Option<u64> {
        self.previous
    }
}

impl Drop for MemoryLimitGuard {
    fn drop(&mut self) {
        // Cannot fail: `f_new` succeeded on this device, and setting the CPU's limit
        // only fails on a device that has none.
        let _ = f_set_memory_limit(self.device, self.previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f_memory_allocated;
    use std::panic;
    use tch::{Kind, Tensor};

    const CPU: Device = Device::Cpu;

    // The limit is process-wide: no other test of this binary allocates under it.
    #[test]
    #[serial_test::serial(cpu_memory_limit)]
    fn the_guard_tightens_nests_and_restores_through_a_panic() {
        assert_eq!(memory_limit(CPU), None);
        let start = f_memory_allocated(CPU).unwrap();
        {
            let outer = MemoryLimitGuard::f_new(CPU, start + 4096).unwrap();
            assert_eq!(outer.limit(), Some(start + 4096));
            assert_eq!(outer.previous(), None);
            {
                // Asking for more than is in force keeps the lower limit.
                let looser = MemoryLimitGuard::f_new(CPU, start + (1 << 30)).unwrap();
                assert_eq!(looser.limit(), Some(start + 4096));
                let tighter = MemoryLimitGuard::f_new(CPU, start + 16).unwrap();
                assert_eq!(tighter.limit(), Some(start + 16));
                assert!(Tensor::f_zeros([64], (Kind::Float, CPU)).is_err());
            }
            assert_eq!(memory_limit(CPU), Some(start + 4096));
        }
        assert_eq!(memory_limit(CPU), None);

        // A panic unwinding through the scope removes the limit too.
        let outcome = panic::catch_unwind(|| {
            let _limit = MemoryLimitGuard::f_new(CPU, start + 16).unwrap();
            assert_eq!(memory_limit(CPU), Some(start + 16));
            panic!("on purpose");
        });
        assert!(outcome.is_err());
        assert_eq!(memory_limit(CPU), None);

        // No simulated limit off the CPU: an error, and nothing changes.
        assert!(MemoryLimitGuard::f_new(Device::Cuda(0), 1).is_err());
        assert_eq!(memory_limit(CPU), None);
    }
}
