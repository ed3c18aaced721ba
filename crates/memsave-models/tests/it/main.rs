//! The integration tests of memsave-models, built as one test binary (one libtorch link instead
//! of one per file). Every test is `#[serial]`: nearly all measure the process's
//! allocations (fit, peaks against PyTorch's) or seed the global generator.
mod compress_zoo;
mod configs;
mod disk_offload_zoo;
mod fit_running_stats;
mod fit_zoo;
mod graphs;
mod layer_units;
mod one_value_per_channel;
mod resnet18_training;
mod running_stats;
mod transformers;
mod vision;
