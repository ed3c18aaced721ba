//! The integration tests of memsave-step, built as one test binary (one libtorch link
//! instead of one per file). Tests that measure a step are `#[serial]`: the meter is
//! process-wide.
mod common;
mod data_parallel;
mod device_peak;
mod errors;
mod failed_step;
mod fsdp;
mod grad_groups;
mod loss;
mod optimizer_hyperparameters;
mod scaler_in_backward;
mod statistics;
mod steering;
mod trainer_state;
