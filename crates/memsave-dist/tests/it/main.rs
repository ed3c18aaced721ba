//! The integration tests of memsave-dist, built as one test binary (issue #26: one
//! binary per file meant one libtorch link per file). Each module was a binary of its
//! own; now they share one process and run on parallel threads. The multi-process tests
//! start this binary again as their ranks, naming the ignored worker test by its path in
//! this binary (`parity::parity_worker`). A test that depends on global state (the
//! default RNG) is `#[serial]`, and every other test that uses libtorch in this process
//! is `#[parallel]` so that it never runs beside a serial one.
mod common;
mod errors;
mod fsdp;
mod fsdp_checkpoint;
mod fsdp_errors;
mod fsdp_files;
mod fsdp_launch;
mod fsdp_optim;
mod launch;
mod parity;
mod unused;
mod zero_disk;
mod zero_int8;
