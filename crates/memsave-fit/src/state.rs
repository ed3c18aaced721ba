//! The model's state as `fit` found it, put back when it ends: its parameters, its
//! buffers (BatchNorm's running statistics, which every probe run moves) and the CPU
//! random generator's state (dropout and the workload's own draws advance it).
use memsave_step::workload::Workload;
use tch::{Device, TchError, Tensor};

/// Why the model's state could not be saved or put back: libtorch's error (copying a
/// tensor, or the random generator's state).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StateError {
    /// Saving it, before the first run.
    #[error("saving the model's state: {0}")]
    Save(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Putting it back, after the last run.
    #[error("putting the model's state back: {0}")]
    Restore(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Host copies of the parameters and buffers, bitwise, and the CPU generator's state.
pub(crate) struct ModelState {
    tensors: Snapshot,
    rng: Tensor,
}

/// Host copies of some tensors' values, bitwise, to write back into them in place
/// (views and optimizers holding the tensors see the values put back).
pub(crate) struct Snapshot {
    /// (the tensor, a host copy of its values).
    tensors: Vec<(Tensor, Tensor)>,
}

impl Snapshot {
    /// Copies the values of `tensors`.
    pub(crate) fn of(tensors: Vec<Tensor>) -> Result<Self, TchError> {
        let tensors = tensors
            .into_iter()
            .map(|t| host_copy(&t).map(|c| (t, c)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { tensors })
    }

    /// Writes the copied values back.
    pub(crate) fn restore(&self) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        for (t, saved) in &self.tensors {
            t.shallow_clone().f_copy_(saved)?;
        }
        Ok(())
    }
}

/// A copy of `t`'s values on the host that later writes to `t` do not change.
fn host_copy(t: &Tensor) -> Result<Tensor, TchError> {
    let d = t.f_detach()?;
    if d.device() == Device::Cpu {
        let mut copy = d.f_empty_like()?;
        copy.f_copy_(&d)?;
        Ok(copy)
    } else {
        d.f_to_device(Device::Cpu)
    }
}

impl ModelState {
    /// Saves the state of `workload` and of the CPU generator.
    pub(crate) fn save(workload: &dyn Workload) -> Result<Self, StateError> {
        let tensors = Snapshot::of(
            workload
                .parameters()
                .into_iter()
                .chain(workload.buffers())
                .collect(),
        )
        .map_err(|e| StateError::Save(e.into()))?;
        let rng = memsave_sys::rng::cpu_state().map_err(|e| StateError::Save(e.into()))?;
        Ok(Self { tensors, rng })
    }

    /// Writes the saved values back (in place: views and optimizers holding the
    /// tensors see them) and puts the generator's state back.
    pub(crate) fn restore(&self) -> Result<(), StateError> {
        self.tensors
            .restore()
            .map_err(|e| StateError::Restore(e.into()))?;
        memsave_sys::rng::set_cpu_state(&self.rng).map_err(|e| StateError::Restore(e.into()))
    }
}
