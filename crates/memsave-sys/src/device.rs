//! Accelerator (CUDA) memory statistics through libtorch's device-generic API.
use crate::error::check;
use crate::{ffi, Error, Result};

/// c10's number for CUDA devices.
const CUDA: i32 = 1;

/// Aggregate memory statistics of one accelerator device's caching allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceStats {
    /// Bytes held by live tensors.
    pub allocated_bytes: u64,
    /// Highest `allocated_bytes` since the last peak reset.
    pub peak_allocated_bytes: u64,
    /// Number of live allocations.
    pub live_allocations: u64,
    /// Bytes reserved from the device by the caching allocator (allocated or cached).
    pub reserved_bytes: u64,
}

/// True when libtorch sees a CUDA accelerator with at least one device.
pub fn cuda_available() -> bool {
    // SAFETY: no arguments; the bridge catches every C++ exception.
    unsafe { ffi::ms_accelerator_type() == CUDA }
}

fn require_cuda() -> Result<()> {
    if cuda_available() {
        Ok(())
    } else {
        Err(Error::new("CUDA is not available on this machine"))
    }
}

/// Memory statistics of CUDA device `index`.
pub fn cuda_stats(index: usize) -> Result<DeviceStats> {
    require_cuda()?;
    let (mut allocated, mut peak, mut live, mut reserved) = (0i64, 0i64, 0i64, 0i64);
    // SAFETY: the four out-pointers are valid, writable i64s for the duration of the call.
    check(unsafe {
        ffi::ms_device_stats(
            CUDA,
            index as i64,
            &mut allocated,
            &mut peak,
            &mut live,
            &mut reserved,
        )
    })?;
    Ok(DeviceStats {
        allocated_bytes: allocated.max(0) as u64,
        peak_allocated_bytes: peak.max(0) as u64,
        live_allocations: live.max(0) as u64,
        reserved_bytes: reserved.max(0) as u64,
    })
}

/// Resets the peak of CUDA device `index` to its current allocation.
pub fn cuda_reset_peak(index: usize) -> Result<()> {
    require_cuda()?;
    // SAFETY: plain values; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_device_reset_peak(CUDA, index as i64) })
}

/// Returns the caching allocator's unused cached blocks to the driver.
pub fn cuda_empty_cache() -> Result<()> {
    require_cuda()?;
    // SAFETY: plain values; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_device_empty_cache(CUDA) })
}

/// Waits for all work queued on CUDA device `index`.
pub fn cuda_synchronize(index: usize) -> Result<()> {
    require_cuda()?;
    // SAFETY: plain values; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_device_synchronize(CUDA, index as i64) })
}
