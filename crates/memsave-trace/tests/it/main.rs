//! The integration tests of memsave-trace, built as one test binary (issue #26: one
//! binary per file meant one libtorch link per file). Each module was a binary of its
//! own; now they share one process and run on parallel threads, so every test that
//! records, measures or allocates tensors is `#[serial]` (the allocator's recording and
//! the meter are process-wide).
mod leak;
mod memory_viz;
mod recorder;
