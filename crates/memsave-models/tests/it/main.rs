//! The integration tests of memsave-models, built as one test binary (one libtorch link instead
//! of one per file). Every test is `#[serial]`: nearly all measure the process's
//! allocations (fit, peaks against PyTorch's) or seed the global generator.
mod compress_zoo;
mod configs;
mod disk_offload_zoo;
mod fit_floor;
mod fit_params_in_files;
mod fit_running_stats;
mod fit_zoo;
mod graphs;
mod layer_units;
mod offload_params_zoo;
mod one_value_per_channel;
mod resnet18_training;
mod running_stats;
mod transformers;
mod vision;

/// What `fit`'s budget (the whole device) counts of `model` before its step: its
/// parameters, its buffers and the data its batches of `batch` examples are sliced from (for the
/// workloads of these tests, such a batch is all of it; a batch counts the storage it
/// is in), with no optimizer state. A budget of this and a fraction of a plain step's
/// `peak_bytes` asks `fit` for that fraction of what the step allocates.
pub fn counted_before_step(model: &dyn memsave_step::Workload, batch: i64) -> u64 {
    let bytes = |t: &tch::Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let x = model.batch(batch).unwrap();
    model.parameters().iter().map(bytes).sum::<u64>()
        + model.buffers().iter().map(bytes).sum::<u64>()
        + bytes(&x.input)
        + x.target.as_ref().map_or(0, bytes)
}
