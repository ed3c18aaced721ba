//! The integration tests of memsave-accum, built as one test binary (one libtorch link instead
//! of one per file). Tests that measure memory, set a memory limit or seed the global
//! generator are `#[serial]`; the others are `#[parallel]` (they never run alongside a
//! serial one).
mod accumulate;
mod fit;
