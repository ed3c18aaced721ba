//! The integration tests of memsave-amp, built as one test binary (issue #26: one binary
//! per file meant one libtorch link per file). Each module was a binary of its own; now
//! they share one process and run on parallel threads, so every test is `#[serial]`:
//! the meter's counter is process-wide.
mod autocast;
mod scaler;
