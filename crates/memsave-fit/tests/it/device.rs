//! A step's peak as `fit`'s budget counts it (the whole device), measured with the meter
//! outside `fit`: the step's absolute peak less what the process held before the step
//! that is neither the model's parameters nor its input (other models, fit's leftovers).
use memsave_step::{StepMeasurement, Workload};
use tch::Device;

/// Allocated now, less the bytes of `workload`'s parameters and of the data its batches
/// are sliced from (for the models of these tests, its global batch is all of it: a
/// batch counts the storage it is in): what a step of it does not count.
pub fn outside(workload: &dyn Workload) -> u64 {
    let parameters: u64 = workload
        .parameters()
        .iter()
        .map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as u64)
        .sum();
    let data = workload.batch(workload.global_batch()).unwrap();
    let data = (data.input.numel() * data.input.kind().elt_size_in_bytes()) as u64;
    memsave_meter::f_memory_allocated(Device::Cpu).unwrap() - parameters - data
}

/// `m`'s peak as `fit` counts it: its absolute peak less `outside` (see [`outside`]).
pub fn peak(m: &StepMeasurement, outside: u64) -> u64 {
    m.device_peak_bytes() - outside
}
