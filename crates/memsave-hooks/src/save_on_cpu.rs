//! `SaveOnCpu`: keep saved CUDA activations in host memory until backward.
use crate::error::HookError;
use crate::scope::SavedTensorHooks;
use tch::{Device, Tensor};

/// Moves each saved tensor that lives on an accelerator to host memory (pinned, so the
/// copy back can overlap) and brings it back in backward (PyTorch's `save_on_cpu`).
///
/// Tensors already on the CPU are kept as they are: on a CPU-only machine this is a
/// no-op that costs nothing. Gradients are bitwise equal to the baseline's: the copy
/// is exact. The device memory is freed only when nothing else holds the tensor; a
/// parameter saved by an op stays on the device (and is copied needlessly, as in
/// PyTorch) unless you keep parameters out with a scope that covers activations only.
#[derive(Debug, Clone, Copy)]
pub struct SaveOnCpu {
    pin_memory: bool,
}

impl Default for SaveOnCpu {
    fn default() -> Self {
        Self { pin_memory: true }
    }
}

impl SaveOnCpu {
    /// Pinned host memory (the default).
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the host copies are pinned (page-locked); pinned memory copies back
    /// faster but is a scarcer resource.
    pub fn pin_memory(mut self, pin: bool) -> Self {
        self.pin_memory = pin;
        self
    }
}

/// A saved tensor kept by [`SaveOnCpu`]: where it came from and the host copy.
#[derive(Debug)]
pub struct OnCpu {
    device: Device,
    tensor: Tensor,
}

impl SavedTensorHooks for SaveOnCpu {
    type Packed = OnCpu;

    fn pack(&self, tensor: &Tensor) -> Result<OnCpu, HookError> {
        let device = tensor.device();
        if device == Device::Cpu {
            return Ok(OnCpu {
                device,
                tensor: tensor.shallow_clone(),
            });
        }
        let host = tensor.f_to_device(Device::Cpu)?;
        let host = if self.pin_memory {
            host.f_pin_memory(device)?
        } else {
            host
        };
        Ok(OnCpu {
            device,
            tensor: host,
        })
    }

    fn unpack(&self, packed: &OnCpu) -> Result<Tensor, HookError> {
        if packed.device == Device::Cpu {
            return Ok(packed.tensor.shallow_clone());
        }
        Ok(packed.tensor.f_to_device(packed.device)?)
    }
}
