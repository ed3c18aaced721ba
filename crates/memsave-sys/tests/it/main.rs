//! The integration tests of memsave-sys, built as one test binary (issue #26: one
//! binary per file meant one libtorch link per file). Each module was a binary of its
//! own; now they share one process and run on parallel threads, so a test that measures
//! the process's memory is `#[serial]`, and every other test that uses libtorch is
//! `#[parallel]` so that it never runs beside a serial one.
mod c_malloc;
mod callback_errors;
mod failed_backward;
mod ffi_boundary;
mod ops;
mod tensor_bytes;
