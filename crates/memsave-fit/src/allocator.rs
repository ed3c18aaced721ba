//! The C allocator's state that steps are timed in: `fit` settles glibc's `malloc`
//! before its first run ([`memsave_meter::settle_c_allocator`], which says why), so
//! that configurations compared early (the small runs, fit's rounds) and late
//! (`exhaustive`'s rounds) are timed under the same allocator.

/// [`memsave_meter::settle_c_allocator`], shared with `memsave bench`.
pub(crate) use memsave_meter::settle_c_allocator as settle;
