//! The integration tests of memsave-bench, built as one test binary (issue #26: one
//! binary per file meant one libtorch link per file). Each module was a binary of its
//! own; now they share one process and run on parallel threads. A test that runs a
//! suite, builds a model or depends on other process-wide state (the meter, the
//! default RNG, libtorch's thread count, the CPU memory limit) is `#[serial]`, and every
//! other test that uses libtorch in this process is `#[parallel]` so that it never runs
//! beside a serial one. Tests that only parse suites or run the `memsave` binary have
//! no attribute.
//!
//! `tests/allocator.rs` stays a binary of its own: it checks glibc's `malloc` state at
//! the first timed step of a process, which tests run before it would have settled.
mod atomic;
mod cli;
mod common;
mod distributed;
mod distributed_techniques;
mod end_to_end;
mod fit;
mod fit_world_size;
mod launch_cli;
mod launch_ends_ranks;
mod optimizer;
mod optimizer_hyperparameters;
mod rounds;
mod suite_errors;
mod suite_messages;
mod trace;
mod zero3;
mod zoo;
mod zoo_zero3;
