//! The integration tests of memsave-fit, built as one test binary (one libtorch link
//! instead of one per file). Every test that runs `fit` or measures a step is
//! `#[serial]`: the meter and the allocator's state are process-wide. `allocator.rs`
//! stays a binary of its own: it checks glibc's state as `fit` leaves it, which needs a
//! process nothing else ran in.
// The same small model as memsave-step's integration tests: one file, two crates.
mod blocks;
mod chain_per_layer;
#[path = "../../../memsave-step/tests/it/common.rs"]
mod common;
mod device;
mod fit;
mod mutex;
mod on_ranks;
mod sample_coupling;
mod spoiled_splits;
mod trainer;
