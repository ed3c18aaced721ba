//! The integration tests of memsave-inplace, built as one test binary (issue #26: one
//! binary per file meant one libtorch link per file). Each module was a binary of its
//! own; now they share one process and run on parallel threads, so every test is
//! `#[serial]`: the meter's counter and the helpers' counters are process-wide.
mod cow;
mod equivalence;
mod exclusivity;
mod seed_claims;
mod version;
