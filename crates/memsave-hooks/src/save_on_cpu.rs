//! `SaveOnCpu`: keep saved CUDA activations in host memory until backward.
use crate::distinct::{distinct, Expanded};
use crate::error::{HookError, PolicyError};
use crate::policy::{KeptStats, SavePolicy, Selector};
use crate::scope::SavedTensorHooks;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tch::{Device, Tensor};

/// Moves each saved tensor that lives on an accelerator to host memory (pinned, so the
/// copy back can overlap) and brings it back in backward (PyTorch's `save_on_cpu`).
///
/// Tensors already on the CPU are kept as they are: on a CPU-only machine this is a
/// no-op that costs nothing. Gradients are bitwise equal to the baseline's: the copy
/// is exact. The device memory is freed only when nothing else holds the tensor, so
/// what stays alive anyway stays on the device uncopied ([`SavePolicy::exact`]):
/// parameters (and their views), the tensors given to [`excluding`](Self::excluding),
/// buffers (floating-point vectors and scalars without a `grad_fn`: running
/// statistics, batch norm's saved statistics) and constants (tensors without a
/// `grad_fn` that an earlier step saved and that are still alive: a table or mask a
/// layer holds), where PyTorch's `save_on_cpu` copies the weights and buffers too.
/// Traps: constants are known from the second step on (the first copies them), and
/// the batch is copied unless excluded; see [`SavePolicy`] for the rules and
/// [`policy`](Self::policy) to change them. A saved tensor expanded from a
/// smaller one (stride 0 in a dimension: `expand`, broadcasting) is copied as the
/// smaller one and expanded back in backward, where a plain copy would hold every
/// repeat. Clones share [`offloaded_bytes`](Self::offloaded_bytes).
#[derive(Debug, Clone)]
pub struct SaveOnCpu {
    pin_memory: bool,
    select: Selector,
    offloaded_bytes: Arc<AtomicU64>,
}

impl Default for SaveOnCpu {
    fn default() -> Self {
        Self {
            pin_memory: true,
            select: Selector::new(SavePolicy::exact()),
            offloaded_bytes: Arc::default(),
        }
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

    /// Also keeps tensors sharing data with `tensors` on the device (inputs you hold).
    pub fn excluding(mut self, tensors: &[Tensor]) -> Self {
        self.select = self.select.excluding(tensors);
        self
    }

    /// Decides what is copied by `policy` instead of [`SavePolicy::exact`]; the
    /// exclusions stay.
    pub fn policy(mut self, policy: SavePolicy) -> Self {
        self.select = self.select.policy(policy);
        self
    }

    /// Tensors on an accelerator that the policy kept there, by reason.
    pub fn kept(&self) -> KeptStats {
        self.select.kept()
    }

    /// `Err` ([`PolicyError::UnseenOps`]) listing the [`SavePolicy::keep_ops`] names
    /// that no saved tensor's saving op or producer matched so far, with the similar
    /// names seen; call it after the first step. `Ok` when `keep_ops` names none.
    pub fn check(&self) -> Result<(), PolicyError> {
        self.select.check()
    }

    /// Bytes copied to host memory so far (of expanded tensors, their base's).
    pub fn offloaded_bytes(&self) -> u64 {
        self.offloaded_bytes.load(Ordering::Relaxed)
    }
}

/// A saved tensor kept by [`SaveOnCpu`]: where it came from and the host copy.
#[derive(Debug)]
pub struct OnCpu {
    device: Device,
    tensor: Tensor,
    /// The saved tensor's sizes when only its distinct elements were copied.
    expanded: Option<Expanded>,
}

impl SavedTensorHooks for SaveOnCpu {
    type Packed = OnCpu;

    fn pack(&self, tensor: &Tensor) -> Result<OnCpu, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        self.select.records_ops()
    }

    fn pack_saved_by(&self, tensor: &Tensor, saved_by: Option<&str>) -> Result<OnCpu, HookError> {
        let device = tensor.device();
        let kept = || OnCpu {
            device,
            tensor: tensor.shallow_clone(),
            expanded: None,
        };
        if device == Device::Cpu {
            return Ok(kept());
        }
        let (base, expanded) = distinct(tensor)?;
        let bytes = memsave_sys::tensor::nbytes(&base);
        if self.select.decide(tensor, bytes, saved_by)?.kept.is_some() {
            return Ok(kept());
        }
        let host = base.f_to_device(Device::Cpu)?;
        self.offloaded_bytes.fetch_add(bytes, Ordering::Relaxed);
        let host = if self.pin_memory {
            host.f_pin_memory(device)?
        } else {
            host
        };
        Ok(OnCpu {
            device,
            tensor: host,
            expanded,
        })
    }

    fn unpack(&self, packed: &OnCpu) -> Result<Tensor, HookError> {
        if packed.tensor.device() == packed.device {
            return Ok(packed.tensor.shallow_clone());
        }
        let base = packed.tensor.f_to_device(packed.device)?;
        Ok(Expanded::restore(packed.expanded.as_ref(), base)?)
    }
}
