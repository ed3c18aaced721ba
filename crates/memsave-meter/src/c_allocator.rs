//! The C allocator's state that steps are timed in: [`settle_c_allocator`].
//!
//! On the CPU, libtorch takes tensors from the C library's `malloc`. glibc's serves a
//! block above its mmap threshold (128 KiB at first) from fresh pages and gives them
//! back when the block is freed, and raises the threshold to the size of such a block
//! when it is freed (up to 32 MiB; the heap is trimmed past twice the threshold). A
//! step is timed faster once the threshold is above its tensors: their pages are
//! reused, not faulted in again. Without a warm-up, then, how fast a step measures
//! depends on what ran before it in the process: whatever runs first (the first
//! strategy of a benchmark, the first configurations a search compares) is timed under
//! page faults that the ones after it do not pay, and two configurations whose tensors
//! differ in size (a whole batch, or a few micro-batches) can swap places.

/// One block just under glibc's 32 MiB cap, so that its chunk (the block, a header,
/// rounded up to pages) stays under the cap and raises the threshold when freed.
const SETTLE_BYTES: usize = (32 << 20) - (64 << 10);

/// Allocates and frees one block just under 32 MiB, as any step with a tensor that
/// large does, so that glibc's thresholds are at their final values before the first
/// timed step and stay there: call it once before timing anything (`memsave fit` and
/// `memsave bench` do).
///
/// The cost: a process keeps up to 64 MiB of freed heap instead of giving it back (per
/// malloc arena), as it would after its first large tensor anyway. With another C
/// library or allocator, or with glibc's threshold set by hand
/// (`MALLOC_MMAP_THRESHOLD_`, which turns the raising off), one allocation that
/// changes nothing.
///
/// ```
/// memsave_meter::settle_c_allocator();
/// // Idempotent: a second call finds the thresholds where the first left them.
/// memsave_meter::settle_c_allocator();
/// ```
pub fn settle_c_allocator() {
    let block: Vec<u8> = Vec::with_capacity(SETTLE_BYTES);
    // Not elided: the allocation and the free are the point.
    drop(std::hint::black_box(block));
}
