//! Device-generic autocast state: per-device enable flag and dtype, nesting, cast cache.
//!
//! These are the raw switches; `memsave-amp` builds scoped guards on them.
use crate::error::check;
use crate::{ffi, Error, Result};
use tch::{Device, Kind};

fn device_type(device: Device) -> i32 {
    match device {
        Device::Cpu => 0,
        Device::Cuda(_) => 1,
        Device::Mps => 13,
        Device::Vulkan => 10,
    }
}

fn kind_to_scalar_type(kind: Kind) -> Result<i32> {
    match kind {
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        Kind::Double => Ok(7),
        Kind::BFloat16 => Ok(15),
        other => Err(Error::new(format!(
            "autocast dtype must be a floating kind (Half, BFloat16, Float, Double), got {other:?}"
        ))),
    }
}

fn scalar_type_to_kind(v: i32) -> Result<Kind> {
    match v {
        5 => Ok(Kind::Half),
        6 => Ok(Kind::Float),
        7 => Ok(Kind::Double),
        15 => Ok(Kind::BFloat16),
        other => Err(Error::new(format!(
            "unexpected autocast scalar type {other}"
        ))),
    }
}

/// Whether autocast is enabled for `device`'s type on this thread.
pub fn is_enabled(device: Device) -> Result<bool> {
    let mut out = false;
    // SAFETY: `out` is a valid, writable bool for the duration of the call.
    check(unsafe { ffi::ms_autocast_is_enabled(device_type(device), &mut out) })?;
    Ok(out)
}

/// Enables or disables autocast for `device`'s type on this thread.
pub fn set_enabled(device: Device, enabled: bool) -> Result<()> {
    // SAFETY: plain values; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_autocast_set_enabled(device_type(device), enabled) })
}

/// The dtype autocast casts to on `device`'s type.
pub fn dtype(device: Device) -> Result<Kind> {
    let mut out = 0;
    // SAFETY: `out` is a valid, writable int for the duration of the call.
    check(unsafe { ffi::ms_autocast_get_dtype(device_type(device), &mut out) })?;
    scalar_type_to_kind(out)
}

/// Sets the dtype autocast casts to on `device`'s type.
pub fn set_dtype(device: Device, kind: Kind) -> Result<()> {
    let scalar_type = kind_to_scalar_type(kind)?;
    // SAFETY: plain values; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_autocast_set_dtype(device_type(device), scalar_type) })
}

/// Enters one autocast nesting level; returns the new depth.
pub fn increment_nesting() -> i64 {
    let mut depth = 0i64;
    // SAFETY: `depth` is a valid, writable i64; the bridge catches every C++ exception.
    nesting_ok(check(unsafe {
        ffi::ms_autocast_increment_nesting(&mut depth)
    }));
    depth
}

/// Leaves one autocast nesting level; returns the new depth.
pub fn decrement_nesting() -> i64 {
    let mut depth = 0i64;
    // SAFETY: `depth` is a valid, writable i64; the bridge catches every C++ exception.
    nesting_ok(check(unsafe {
        ffi::ms_autocast_decrement_nesting(&mut depth)
    }));
    depth
}

/// The nesting depth is a thread-local counter in libtorch; updating it cannot fail
/// short of a broken C++ runtime, and a wrong depth would corrupt the cast cache.
fn nesting_ok(result: Result<()>) {
    if let Err(e) = result {
        panic!("memsave-sys: autocast nesting failed: {e}");
    }
}

/// Clears the cache of casted weights (done by PyTorch when the outermost scope ends).
pub fn clear_cache() -> Result<()> {
    // SAFETY: no arguments; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_autocast_clear_cache() })
}
