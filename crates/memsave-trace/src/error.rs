//! Errors of a recording.
use tch::Device;

/// Why a recording could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Only the CPU's counting allocator has an event stream here: CUDA's caching
    /// allocator keeps its own trace, which memsave-trace does not read yet.
    #[error("cannot record {0:?}: memsave-trace reads the CPU's counting allocator only, not CUDA's caching allocator; record the step on Device::Cpu (on CUDA, PyTorch's torch.cuda.memory._record_memory_history gives the allocator's own snapshot)")]
    UnsupportedDevice(Device),
    /// Another recording is on (recordings are process-wide and do not nest).
    #[error("a memory recording is already on in this process: recordings do not nest; stop the other one first")]
    AlreadyRecording,
    /// The saved-tensor hooks of the recording could not be entered or left.
    #[error("memsave-trace: {0}")]
    Hooks(#[from] memsave_hooks::HooksError),
    /// The bridge failed (libtorch's message).
    #[error("memsave-trace: {0}")]
    Bridge(#[from] memsave_sys::Error),
    /// Writing an export failed.
    #[error("writing the memory snapshot: {0}")]
    Pickle(#[from] serde_pickle::Error),
}
