//! The integration tests of memsave-optim, built as one test binary (one libtorch link instead
//! of one per file). Tests that measure memory, set a memory limit or seed the global
//! generator are `#[serial]`; the others are `#[parallel]` (they never run alongside a
//! serial one).
mod chunks;
mod common;
mod disk_checksum;
mod grad_hooks;
mod grad_scaler;
mod huge_gradients;
mod hyperparameters;
mod in_backward;
mod match_tch;
mod observer;
mod out_of_memory;
mod state;
