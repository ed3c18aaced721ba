//! Setting a configuration's checkpoint plan on a workload, profiling the workload's
//! layers first when the plan is a byte budget.
use crate::config::{PlanChoice, StepConfig};
use crate::workload::{Batch, Workload};
use memsave_checkpoint::{ChainProfile, CheckpointedSequential, Plan};
use std::panic::{self, AssertUnwindSafe};
use tch::Device;

/// Profiles `model`'s layers on `example` (per-layer bytes and times, the workload's
/// loss as the chain's last element) and keeps the profile in the layers, as
/// [`CheckpointedSequential::profile`] does. Parameter gradients are set to none.
pub fn f_profile(model: &mut dyn Workload, example: &Batch) -> Result<ChainProfile, String> {
    let params = model.parameters();
    // The loss borrows the workload while its layers are profiled: take the layers out
    // for the time being, and put them back whatever happens (also on a panic).
    let mut layers = std::mem::replace(model.layers_mut(), CheckpointedSequential::new());
    let target = example.target.as_ref();
    let outcome = {
        let model: &dyn Workload = &*model;
        panic::catch_unwind(AssertUnwindSafe(|| {
            layers
                .profile(&example.input, &params, |y| {
                    model.loss(y, target).unwrap_or_else(|e| panic!("{e}"))
                })
                .cloned()
                .map_err(|e| e.to_string())
        }))
    };
    *model.layers_mut() = layers;
    match outcome {
        Ok(result) => result,
        Err(payload) => panic::resume_unwind(payload),
    }
}

/// Sets `config`'s checkpoint plan on `model`; a budget is solved over a profile of
/// the model on the step's (first micro-batch's) examples of `x`, under the
/// configuration's autocast.
pub fn apply_plan(
    model: &mut dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
) -> Result<(), String> {
    let plan = match config.plan {
        PlanChoice::Fixed(plan) => plan,
        PlanChoice::Budget(bytes) => {
            let example = match config.micro_batches {
                Some(count) => {
                    let first = memsave_accum::f_split(x.len(), memsave_accum::Split::Count(count))
                        .map_err(|e| e.to_string())?[0];
                    x.f_narrow(first.start, first.len)
                        .map_err(|e| e.to_string())?
                }
                None => x.shallow_clone(),
            };
            let _autocast = config
                .autocast
                .map(|kind| memsave_amp::AutocastGuard::new(device, kind))
                .transpose()
                .map_err(|e| e.to_string())?;
            f_profile(model, &example)?;
            Plan::Budget(bytes)
        }
    };
    model.layers_mut().set_plan(plan).map_err(|e| e.to_string())
}
