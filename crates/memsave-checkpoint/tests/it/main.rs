//! The integration tests of memsave-checkpoint, built as one test binary (issue #26: one
//! binary per file meant one libtorch link per file). Each module was a binary of its
//! own; now they share one process and run on parallel threads, so a test that measures
//! memory or depends on global state (the meter, the default RNG) is `#[serial]`, and
//! every other test that uses libtorch is `#[parallel]` so that it never runs beside a
//! serial one. `solver` installs a counting global allocator for the whole binary.
mod batch_norm;
mod block_plan;
mod block_wrapper;
mod blocks;
mod chain_blocks;
mod common;
mod entry_points;
mod function;
mod gradients;
mod layer_parameters;
mod levers;
mod memory;
mod pytorch_checkpoint;
mod reported;
mod solver;
mod user_loop;
