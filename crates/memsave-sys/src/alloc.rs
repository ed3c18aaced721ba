//! The counting CPU allocator: exact bytes held by tensor storages on the CPU.
//!
//! Once installed, every CPU storage allocated through c10's allocator is counted
//! until it is freed. Storages allocated before installation keep their original
//! deleter and never touch the counter. Scratch memory that kernels allocate with
//! plain `malloc` (oneDNN/MKL workspaces) is not counted.
use crate::error::check;
use crate::ffi;
use crate::Result;

/// Installs the counting allocator as libtorch's CPU allocator; idempotent and thread-safe.
pub fn install_counting_allocator() -> Result<()> {
    // SAFETY: no arguments; the bridge catches every C++ exception.
    check(unsafe { ffi::ms_cpu_install_counting_allocator() })
}

/// True when libtorch's current CPU allocator is the counting one.
pub fn counting_allocator_active() -> bool {
    let mut active = false;
    // SAFETY: `active` is a valid, writable bool for the duration of the call.
    check(unsafe { ffi::ms_cpu_counting_allocator_active(&mut active) }).is_ok() && active
}

/// Bytes currently held by counted CPU storages.
pub fn allocated() -> u64 {
    // SAFETY: `out` is a valid, writable i64 for the duration of the call.
    read_counter(|out| unsafe { ffi::ms_cpu_allocated(out) }).max(0) as u64
}

/// Highest value of [`allocated`] since installation or the last [`reset_peak`].
pub fn peak() -> u64 {
    // SAFETY: `out` is a valid, writable i64 for the duration of the call.
    read_counter(|out| unsafe { ffi::ms_cpu_peak(out) }).max(0) as u64
}

/// Sets the peak to the current allocation.
pub fn reset_peak() {
    // SAFETY: no arguments; the bridge catches every C++ exception.
    expect_ok(unsafe { ffi::ms_cpu_reset_peak() })
}

/// Raises the peak to at least `bytes`; lets a nested measurement restore the peak of
/// an enclosing one after resetting it.
pub fn raise_peak(bytes: u64) {
    // SAFETY: a plain value; the bridge catches every C++ exception.
    expect_ok(unsafe { ffi::ms_cpu_raise_peak(bytes.min(i64::MAX as u64) as i64) })
}

/// Limits counted CPU memory to `limit` bytes (`None`: no limit). An allocation that
/// would exceed it fails with libtorch's out-of-memory error and changes nothing.
pub fn set_limit(limit: Option<u64>) {
    let raw = limit.map_or(-1, |l| l.min(i64::MAX as u64) as i64);
    // SAFETY: a plain value; the bridge catches every C++ exception.
    expect_ok(unsafe { ffi::ms_cpu_set_limit(raw) })
}

/// The limit set with [`set_limit`], if any.
pub fn limit() -> Option<u64> {
    // SAFETY: `out` is a valid, writable i64 for the duration of the call.
    let raw = read_counter(|out| unsafe { ffi::ms_cpu_limit(out) });
    (raw >= 0).then_some(raw as u64)
}

/// Number of counted CPU storages alive now.
pub fn live_allocations() -> u64 {
    // SAFETY: `out` is a valid, writable i64 for the duration of the call.
    read_counter(|out| unsafe { ffi::ms_cpu_live_allocations(out) }).max(0) as u64
}

/// Sizes in bytes of the `k` largest live counted storages, largest first.
pub fn largest_allocations(k: usize) -> Vec<u64> {
    let mut out = vec![0i64; k];
    let mut n = 0usize;
    // SAFETY: `out` has room for `k` values and the bridge writes at most `k`; `n` is
    // a valid, writable usize.
    expect_ok(unsafe { ffi::ms_cpu_largest_allocations(out.as_mut_ptr(), k, &mut n) });
    out.truncate(n);
    out.into_iter().map(|b| b.max(0) as u64).collect()
}

/// Reads one counter. The counters live behind a mutex and fail only if locking it
/// fails, which the C++ runtime reports as an exception the bridge turns into a status.
fn read_counter(read: impl FnOnce(*mut i64) -> i32) -> i64 {
    let mut out = 0i64;
    expect_ok(read(&mut out));
    out
}

/// The allocator's counters cannot fail short of a broken C++ runtime; if they do,
/// say so rather than report a wrong byte count.
fn expect_ok(status: i32) {
    if let Err(e) = check(status) {
        panic!("memsave-sys: the counting allocator's counters failed: {e}");
    }
}
