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

/// Whether `t`'s storage is one the counting allocator counts: a CPU storage allocated
/// after [`install_counting_allocator`] (one allocated before, by the allocator then in
/// place, is invisible to [`allocated`] for its whole life). `false` for a tensor
/// without storage or off the CPU.
pub fn is_counted(t: &tch::Tensor) -> Result<bool> {
    let mut out = false;
    // SAFETY: `t` is a live tch tensor, so its pointer is a valid at::Tensor*; `out`
    // is a valid, writable bool for the duration of the call.
    check(unsafe { ffi::ms_cpu_storage_counted(t.as_ptr().cast(), &mut out) })?;
    Ok(out)
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

/// One allocation (`bytes > 0`) or free (`bytes < 0`) of a counted CPU storage, seen
/// by the recorder ([`start_recording`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocEvent {
    /// The storage's address (its data pointer).
    pub addr: u64,
    /// Bytes allocated (positive) or freed (negative).
    pub bytes: i64,
    /// [`allocated`] right after this event.
    pub allocated_after: u64,
    /// A monotonic clock in nanoseconds; 0 for the storages live when recording started.
    pub time_ns: u64,
}

/// Starts recording every allocation and free of counted CPU storages, process-wide,
/// from every thread; `false` when a recording is already on (nothing changes then).
///
/// The events open with one allocation per storage already live (time 0), so a replay
/// of the events gives [`allocated`] at every event. While no recording is on the
/// allocator pays a single flag test per allocation. Call [`stop_recording`] to get the
/// events; they accumulate in memory (32 bytes each, outside the counter) until then.
pub fn start_recording() -> Result<bool> {
    install_counting_allocator()?;
    let mut started = false;
    // SAFETY: `started` is a valid, writable bool for the duration of the call.
    check(unsafe { ffi::ms_cpu_trace_start(&mut started) })?;
    Ok(started)
}

/// How many events the current recording holds: a position in its stream, to say
/// "this happened between event n-1 and event n".
pub fn recording_position() -> usize {
    let mut out = 0usize;
    // SAFETY: `out` is a valid, writable usize for the duration of the call.
    expect_ok(unsafe { ffi::ms_cpu_trace_position(&mut out) });
    out
}

/// How many blocks the C library's `malloc` serves from mappings of their own (glibc:
/// blocks above its mmap threshold), or `None` where the C library does not say. A
/// block served so is faulted in page by page each time it is allocated; one below the
/// threshold reuses the heap's pages.
pub fn c_mapped_blocks() -> Option<u64> {
    let mut out = -1i64;
    // SAFETY: `out` is a valid, writable i64 for the duration of the call.
    expect_ok(unsafe { ffi::ms_c_mapped_blocks(&mut out) });
    u64::try_from(out).ok()
}

/// Stops the recording and returns its events, in the order the counter saw them
/// (empty when none was on).
pub fn stop_recording() -> Vec<AllocEvent> {
    let mut count = 0usize;
    // SAFETY: `count` is a valid, writable usize for the duration of the call.
    expect_ok(unsafe { ffi::ms_cpu_trace_stop(&mut count) });
    let mut raw = vec![ffi::MsAllocEvent::default(); count];
    let mut written = 0usize;
    // SAFETY: `raw` has room for `count` events and the bridge writes at most `count`;
    // `written` is a valid, writable usize.
    expect_ok(unsafe { ffi::ms_cpu_trace_read(raw.as_mut_ptr(), count, &mut written) });
    raw.truncate(written);
    raw.into_iter()
        .map(|e| AllocEvent {
            addr: e.addr,
            bytes: e.bytes,
            allocated_after: e.allocated_after.max(0) as u64,
            time_ns: e.time_ns,
        })
        .collect()
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
