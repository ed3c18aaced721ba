//! Device-level counters: `memory_allocated`, peaks, limits; CPU and CUDA.
use crate::{MeterError, Result};
use memsave_sys::{alloc, device};
use tch::Device;

/// Installs the counting CPU allocator; every meter function does this on first use.
///
/// Call it first thing in `main` when tensors created before the first measurement
/// must be counted too. Idempotent and thread-safe.
pub fn install() {
    // The bridge installs at most once; failure is impossible short of a broken libtorch.
    if let Err(e) = alloc::install_counting_allocator() {
        panic!("memsave-meter: cannot install the counting CPU allocator: {e}");
    }
}

fn device_error(device: Device, e: impl ToString) -> MeterError {
    MeterError::Device {
        device,
        reason: e.to_string(),
    }
}

fn unsupported(device: Device) -> MeterError {
    device_error(device, "only the CPU and CUDA devices are metered")
}

/// Bytes held by live tensors on `device`, or an error when it cannot be metered.
pub fn f_memory_allocated(device: Device) -> Result<u64> {
    match device {
        Device::Cpu => {
            install();
            Ok(alloc::allocated())
        }
        Device::Cuda(i) => device::cuda_stats(i)
            .map(|s| s.allocated_bytes)
            .map_err(|e| device_error(device, e)),
        _ => Err(unsupported(device)),
    }
}

/// Bytes held by live tensors on `device` (`torch.cuda.memory_allocated`).
///
/// # Panics
/// When the device cannot be metered (CUDA absent); use [`f_memory_allocated`] to get
/// an error instead.
pub fn memory_allocated(device: Device) -> u64 {
    f_memory_allocated(device).unwrap_or_else(|e| panic!("{e}"))
}

/// Highest [`memory_allocated`] since the last [`reset_peak_memory_stats`].
pub fn f_max_memory_allocated(device: Device) -> Result<u64> {
    match device {
        Device::Cpu => {
            install();
            Ok(alloc::peak())
        }
        Device::Cuda(i) => device::cuda_stats(i)
            .map(|s| s.peak_allocated_bytes)
            .map_err(|e| device_error(device, e)),
        _ => Err(unsupported(device)),
    }
}

/// Highest [`memory_allocated`] since the last reset (`torch.cuda.max_memory_allocated`).
///
/// # Panics
/// When the device cannot be metered; see [`f_max_memory_allocated`].
pub fn max_memory_allocated(device: Device) -> u64 {
    f_max_memory_allocated(device).unwrap_or_else(|e| panic!("{e}"))
}

/// Sets the peak of `device` to its current allocation.
pub fn f_reset_peak_memory_stats(device: Device) -> Result<()> {
    match device {
        Device::Cpu => {
            install();
            alloc::reset_peak();
            Ok(())
        }
        Device::Cuda(i) => device::cuda_reset_peak(i).map_err(|e| device_error(device, e)),
        _ => Err(unsupported(device)),
    }
}

/// Sets the peak of `device` to its current allocation
/// (`torch.cuda.reset_peak_memory_stats`).
///
/// # Panics
/// When the device cannot be metered; see [`f_reset_peak_memory_stats`].
pub fn reset_peak_memory_stats(device: Device) {
    f_reset_peak_memory_stats(device).unwrap_or_else(|e| panic!("{e}"))
}

/// Returns cached, unused device memory to the system (`torch.cuda.empty_cache`).
///
/// This never frees a tensor that is still referenced, by you or by an autograd graph:
/// it only releases blocks the caching allocator keeps for reuse, so
/// [`memory_allocated`] is unchanged by it. On the CPU there is no cache and it does
/// nothing.
pub fn f_empty_cache(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => device::cuda_empty_cache().map_err(|e| device_error(device, e)),
        _ => Err(unsupported(device)),
    }
}

/// Returns cached, unused device memory to the system; see [`f_empty_cache`].
///
/// # Panics
/// When the device cannot be metered (CUDA absent, an unsupported device).
pub fn empty_cache(device: Device) {
    f_empty_cache(device).unwrap_or_else(|e| panic!("{e}"))
}

/// Makes `device` behave as if it had only `limit` bytes (`None`: no limit).
///
/// On the CPU an allocation that would take [`memory_allocated`] past the limit fails
/// with libtorch's out-of-memory error, which tch's `f_` functions return as `Err`;
/// the counter is unchanged by the failed allocation. The limit is process-wide, so
/// restore the previous one ([`memory_limit`]) when done, also on an error.
///
/// # Errors
/// On any device but the CPU: libtorch's CUDA allocator has no byte limit that
/// applies to allocated bytes. To check a byte budget on CUDA, measure the peak
/// ([`f_measure`](crate::f_measure)) and compare it with the budget instead.
pub fn f_set_memory_limit(device: Device, limit: Option<u64>) -> Result<()> {
    match device {
        Device::Cpu => {
            install();
            alloc::set_limit(limit);
            Ok(())
        }
        _ => Err(device_error(
            device,
            "a memory limit is only supported on the CPU (a simulated device); on CUDA \
             measure the peak and compare it with the budget instead",
        )),
    }
}

/// The same as [`f_set_memory_limit`], kept returning `Result` for the callers written
/// before the `f_` form existed.
///
/// Unlike the other short names of the meter this does not panic; prefer
/// [`f_set_memory_limit`] in new code.
pub fn set_memory_limit(device: Device, limit: Option<u64>) -> Result<()> {
    f_set_memory_limit(device, limit)
}

/// The limit set with [`f_set_memory_limit`], if any (always `None` off the CPU, where
/// no limit can be set).
pub fn memory_limit(device: Device) -> Option<u64> {
    match device {
        Device::Cpu => alloc::limit(),
        _ => None,
    }
}

/// Number of live allocations on `device`, or an error when it cannot be metered.
pub fn f_live_allocations(device: Device) -> Result<u64> {
    match device {
        Device::Cpu => {
            install();
            Ok(alloc::live_allocations())
        }
        Device::Cuda(i) => device::cuda_stats(i)
            .map(|s| s.live_allocations)
            .map_err(|e| device_error(device, e)),
        _ => Err(unsupported(device)),
    }
}

/// Number of live allocations on `device`.
///
/// # Panics
/// When the device cannot be metered; see [`f_live_allocations`].
pub fn live_allocations(device: Device) -> u64 {
    f_live_allocations(device).unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn cuda_is_an_error_exactly_when_there_is_no_gpu() {
        let reading = f_memory_allocated(Device::Cuda(0));
        if tch::Cuda::is_available() {
            assert!(reading.is_ok(), "{reading:?}");
        } else {
            let err = reading.unwrap_err();
            assert!(err.to_string().contains("CUDA is not available"), "{err}");
            assert!(f_empty_cache(Device::Cuda(0)).is_err());
            assert!(f_live_allocations(Device::Cuda(0)).is_err());
        }
        // No byte limit on CUDA, GPU or not; the error says what to do instead.
        let err = f_set_memory_limit(Device::Cuda(0), Some(1)).unwrap_err();
        assert!(err.to_string().contains("measure the peak"), "{err}");
        assert_eq!(memory_limit(Device::Cuda(0)), None);
    }

    #[test]
    fn unsupported_devices_are_an_error_and_the_short_names_panic() {
        assert!(f_memory_allocated(Device::Mps).is_err());
        assert!(f_max_memory_allocated(Device::Mps).is_err());
        assert!(f_reset_peak_memory_stats(Device::Mps).is_err());
        let panic = std::panic::catch_unwind(|| memory_allocated(Device::Mps)).unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("only the CPU and CUDA devices"),
            "{message}"
        );
        assert!(std::panic::catch_unwind(|| empty_cache(Device::Mps)).is_err());
        assert!(std::panic::catch_unwind(|| live_allocations(Device::Mps)).is_err());
    }

    /// The CUDA path for real: exact bytes of a tensor, the peak of a scope, and the
    /// counter back at its start once the tensors are gone.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_counts_a_tensor_to_the_byte() {
        let dev = Device::Cuda(0);
        let start = memory_allocated(dev);
        let t = Tensor::zeros([1024, 1024], (Kind::Float, dev));
        assert_eq!(memory_allocated(dev) - start, 4_194_304);
        assert!(live_allocations(dev) >= 1);
        reset_peak_memory_stats(dev);
        let (_, m) = crate::measure(dev, |marks| {
            let y = &t + &t;
            marks.mark("after y");
            let _z = &y + &t;
        });
        assert_eq!(m.start_bytes, start + 4_194_304);
        assert_eq!(m.peak_bytes, 2 * 4_194_304);
        assert_eq!(m.mark("after y"), Some(start + 2 * 4_194_304));
        assert_eq!(m.end_bytes, m.start_bytes);
        assert_eq!(max_memory_allocated(dev), start + 3 * 4_194_304);
        drop(t);
        empty_cache(dev);
        assert_eq!(memory_allocated(dev), start);
    }

    #[test]
    #[serial_test::serial(cpu_memory_limit)]
    fn empty_cache_frees_nothing_that_is_referenced() {
        let t = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        let before = memory_allocated(Device::Cpu);
        empty_cache(Device::Cpu);
        assert_eq!(memory_allocated(Device::Cpu), before);
        drop(t);
    }
}
