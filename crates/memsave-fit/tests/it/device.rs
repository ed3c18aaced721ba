//! A step's peak as `fit`'s budget counts it (the whole device), measured with the meter
//! outside `fit`: the step's absolute peak less what the process held before the step
//! that is neither the model's parameters nor its input (other models, fit's leftovers),
//! plus what of those the meter does not see (storages allocated before
//! `memsave_meter::install()`: a model built before the test installed it).
use memsave_step::{StepMeasurement, Workload};
use tch::Device;

/// What the process holds besides a workload's parameters and data (see [`outside`]).
pub struct Outside {
    /// What the meter reads now, less the parameters and data it sees.
    held: u64,
    /// The parameters and data it does not see.
    unseen: u64,
}

/// What a step of `workload` does not count: allocated now, less the bytes of its
/// parameters, its buffers and the data its batches are sliced from (for the models of these
/// tests, its global batch is all of it: a batch counts the storage it is in).
pub fn outside(workload: &dyn Workload) -> Outside {
    let data = workload.batch(workload.global_batch()).unwrap();
    let mut tensors = workload.parameters();
    tensors.extend(workload.buffers());
    tensors.push(data.input);
    let (mut counted, mut unseen) = (0, 0);
    for t in &tensors {
        let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        if memsave_sys::alloc::is_counted(t).unwrap() {
            counted += bytes;
        } else {
            unseen += bytes;
        }
    }
    Outside {
        held: memsave_meter::f_memory_allocated(Device::Cpu).unwrap() - counted,
        unseen,
    }
}

/// `m`'s peak as `fit` counts it (see [`outside`]).
pub fn peak(m: &StepMeasurement, outside: &Outside) -> u64 {
    m.device_peak_bytes() + outside.unseen - outside.held
}

/// An allocation the meter read (`start_bytes`, say), as `fit` counts it.
pub fn above(allocated: u64, outside: &Outside) -> u64 {
    allocated + outside.unseen - outside.held
}
