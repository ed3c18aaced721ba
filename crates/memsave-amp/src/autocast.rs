//! Autocast scopes: per-device enable flag and dtype, restored exactly when a scope ends.
use crate::error::{AmpError, Result};
use memsave_sys::autocast as raw;
use std::marker::PhantomData;
use tch::{Device, Kind};

/// The autocast switches of one device type on the current thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutocastState {
    /// Whether eligible operations run in `dtype`.
    pub enabled: bool,
    /// The lower-precision dtype eligible operations cast to.
    pub dtype: Kind,
}

/// The autocast state of `device`'s type (CPU or CUDA) on this thread.
///
/// The state is per device type, not per device index: `Device::Cuda(1)` reads the
/// same switches as `Device::Cuda(0)`.
pub fn autocast_state(device: Device) -> Result<AutocastState> {
    check_device(device)?;
    Ok(AutocastState {
        enabled: raw::is_enabled(device)?,
        dtype: raw::dtype(device)?,
    })
}

fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) if tch::Cuda::is_available() => Ok(()),
        Device::Cuda(_) => Err(AmpError::Device {
            device,
            reason: "CUDA is not available; pick the device with Device::cuda_if_available()"
                .into(),
        }),
        _ => Err(AmpError::Device {
            device,
            reason: "autocast is supported on the CPU and CUDA only".into(),
        }),
    }
}

fn check_dtype(device: Device, kind: Kind) -> Result<()> {
    match kind {
        Kind::BFloat16 | Kind::Half => Ok(()),
        _ => Err(AmpError::UnsupportedDtype { device, kind }),
    }
}

/// An autocast scope for one device type; leaving it restores the previous state.
///
/// Like `torch.autocast`, entering sets the device type's enable flag and dtype and
/// increments the autocast nesting depth; dropping the guard decrements the depth,
/// clears the cache of casted weights when the outermost scope ends, and restores the
/// flag and dtype that were in force before the guard was created. Inner scopes may
/// disable autocast ([`AutocastGuard::disabled`]) or change the dtype.
///
/// The state is thread-local, so the guard is neither `Send` nor `Sync`. Drop guards
/// in reverse order of creation (the natural order of nested scopes); dropping an
/// outer guard first restores the state that guard saw, as PyTorch would.
///
/// Traps, as in PyTorch: weights cast inside the scope are cached until the outermost
/// scope ends, so a bf16 copy of every parameter used stays alive for that long; and
/// backward should run outside the scope (it runs in the dtypes the forward chose).
#[derive(Debug)]
pub struct AutocastGuard {
    device: Device,
    previous: AutocastState,
    _thread_local: PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Enables autocast to `dtype` (BFloat16 or Half) on `device`'s type.
    pub fn new(device: Device, dtype: Kind) -> Result<Self> {
        Self::with_enabled(device, dtype, true)
    }

    /// Disables autocast on `device`'s type for the scope (the dtype is kept).
    pub fn disabled(device: Device) -> Result<Self> {
        let dtype = autocast_state(device)?.dtype;
        Self::with_enabled(device, dtype, false)
    }

    /// Sets autocast on `device`'s type to `enabled` with `dtype` for the scope.
    ///
    /// `dtype` must be BFloat16 or Half when `enabled` is true.
    pub fn with_enabled(device: Device, dtype: Kind, enabled: bool) -> Result<Self> {
        let previous = autocast_state(device)?;
        if enabled {
            check_dtype(device, dtype)?;
        }
        raw::set_enabled(device, enabled)?;
        if let Err(e) = raw::set_dtype(device, dtype) {
            raw::set_enabled(device, previous.enabled)?;
            return Err(e.into());
        }
        raw::increment_nesting();
        Ok(Self {
            device,
            previous,
            _thread_local: PhantomData,
        })
    }

    /// The device type this guard controls.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The state that dropping the guard restores.
    pub fn previous(&self) -> AutocastState {
        self.previous
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // The device and dtype were accepted when the guard was created, so restoring
        // them cannot fail; errors are ignored because drop cannot report them.
        if raw::decrement_nesting() == 0 {
            let _ = raw::clear_cache();
        }
        let _ = raw::set_enabled(self.device, self.previous.enabled);
        let _ = raw::set_dtype(self.device, self.previous.dtype);
    }
}

/// Runs `f` with autocast to `dtype` enabled on `device`'s type (`torch.autocast`).
///
/// Returns an error, without running `f`, when the device is unavailable or the dtype
/// is not BFloat16/Half. See [`AutocastGuard`] for nesting and the weight cache.
pub fn f_autocast<T>(device: Device, dtype: Kind, f: impl FnOnce() -> T) -> Result<T> {
    let _guard = AutocastGuard::new(device, dtype)?;
    Ok(f())
}

/// Runs `f` with autocast to `dtype` enabled on `device`'s type.
///
/// # Panics
/// When the device is unavailable or the dtype unsupported; see [`f_autocast`].
pub fn autocast<T>(device: Device, dtype: Kind, f: impl FnOnce() -> T) -> T {
    f_autocast(device, dtype, f).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `f` with autocast disabled on `device`'s type, e.g. a numerically sensitive
/// part of a forward that otherwise runs under [`autocast`].
pub fn f_autocast_disabled<T>(device: Device, f: impl FnOnce() -> T) -> Result<T> {
    let _guard = AutocastGuard::disabled(device)?;
    Ok(f())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_reduced_dtypes_and_leaves_state_alone() {
        let before = autocast_state(Device::Cpu).unwrap();
        let err = AutocastGuard::new(Device::Cpu, Kind::Float).unwrap_err();
        assert!(err.to_string().contains("BFloat16 and Half"), "{err}");
        assert!(AutocastGuard::new(Device::Cpu, Kind::Int64).is_err());
        assert_eq!(autocast_state(Device::Cpu).unwrap(), before);
    }

    #[test]
    fn cuda_is_an_error_exactly_when_there_is_no_gpu() {
        let result = f_autocast(Device::Cuda(0), Kind::Half, || ());
        if tch::Cuda::is_available() {
            assert!(result.is_ok(), "{result:?}");
        } else {
            let err = result.unwrap_err();
            assert!(err.to_string().contains("CUDA is not available"), "{err}");
        }
        let err = f_autocast(Device::Mps, Kind::Half, || ()).unwrap_err();
        assert!(err.to_string().contains("CPU and CUDA only"), "{err}");
    }

    /// The CUDA path for real: eligible ops run in the scope's dtype on the GPU, the
    /// CUDA switches are restored after, and the CPU's are never touched.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_autocast_casts_matmul_and_restores_the_state() {
        let dev = Device::Cuda(0);
        let before = autocast_state(dev).unwrap();
        let cpu_before = autocast_state(Device::Cpu).unwrap();
        let x = tch::Tensor::ones([8, 8], (Kind::Float, dev));
        for dtype in [Kind::Half, Kind::BFloat16] {
            let y = f_autocast(dev, dtype, || {
                assert_eq!(
                    autocast_state(dev).unwrap(),
                    AutocastState {
                        enabled: true,
                        dtype
                    }
                );
                assert_eq!(autocast_state(Device::Cpu).unwrap(), cpu_before);
                x.matmul(&x)
            })
            .unwrap();
            assert_eq!(y.kind(), dtype);
            assert_eq!(y.device(), dev);
            assert_eq!(y.to_kind(Kind::Float).min().double_value(&[]), 8.0);
            assert_eq!(y.to_kind(Kind::Float).max().double_value(&[]), 8.0);
            assert_eq!(autocast_state(dev).unwrap(), before);
        }
        assert_eq!(x.matmul(&x).kind(), Kind::Float, "outside the scope");
        assert_eq!(autocast_state(Device::Cpu).unwrap(), cpu_before);
    }
}
