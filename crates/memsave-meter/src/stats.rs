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

/// Like [`f_empty_cache`], ignoring devices that cannot be metered.
pub fn empty_cache(device: Device) {
    let _ = f_empty_cache(device);
}

/// Makes `device` behave as if it had only `limit` bytes (`None`: no limit).
///
/// On the CPU an allocation that would take [`memory_allocated`] past the limit fails
/// with libtorch's out-of-memory error, which tch's `f_` functions return as `Err`;
/// the counter is unchanged by the failed allocation. Not supported on CUDA.
pub fn set_memory_limit(device: Device, limit: Option<u64>) -> Result<()> {
    match device {
        Device::Cpu => {
            install();
            alloc::set_limit(limit);
            Ok(())
        }
        _ => Err(device_error(
            device,
            "a memory limit is only supported on the CPU (a simulated device)",
        )),
    }
}

/// The limit set with [`set_memory_limit`], if any.
pub fn memory_limit(device: Device) -> Option<u64> {
    match device {
        Device::Cpu => alloc::limit(),
        _ => None,
    }
}

/// Number of live allocations on `device`.
pub fn live_allocations(device: Device) -> Result<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn cuda_is_an_error_not_a_panic_without_a_gpu() {
        if tch::Cuda::is_available() {
            return;
        }
        let err = f_memory_allocated(Device::Cuda(0)).unwrap_err();
        assert!(err.to_string().contains("CUDA is not available"), "{err}");
        assert!(set_memory_limit(Device::Cuda(0), Some(1)).is_err());
    }

    #[test]
    fn empty_cache_frees_nothing_that_is_referenced() {
        let t = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        let before = memory_allocated(Device::Cpu);
        empty_cache(Device::Cpu);
        assert_eq!(memory_allocated(Device::Cpu), before);
        drop(t);
    }
}
