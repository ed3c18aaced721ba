//! The saved-tensor hooks of a `compress:` or `offload:` strategy, made fresh for each
//! step, and what they report after it.
use crate::config::SavedTensors;
use crate::error::StepError;
use crate::levers::{CompressDtype, OffloadSpec};
use memsave_hooks::{raw_hooks, Codec, Compress, DiskOffload, HooksGuard, SaveOnCpu};
use memsave_sys::hooks::RawHooks;
use std::path::PathBuf;
use std::sync::Arc;
use tch::Tensor;

/// The hooks of one step.
pub(crate) enum StepHooks {
    Compress(Compress),
    Disk(DiskOffload),
    Cpu(SaveOnCpu),
}

/// What the hooks moved or shrank during a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SavedBytes {
    /// Bytes written to the offload store (disk) or copied to host memory (cpu).
    pub offloaded_bytes: Option<u64>,
    /// Bytes that compression saved (original minus stored, scales included).
    pub compressed_saved_bytes: Option<u64>,
}

impl SavedBytes {
    /// These bytes plus what the checkpoint's boundary stores took between `before` and
    /// `after` (`CheckpointedSequential::lever_stats`, then `Blocks::lever_stats`; a
    /// store first used in the step is in `after` only): lossless stores moved bytes
    /// out (offloaded), lossy ones shrank them (compressed).
    pub fn with_levers(
        self,
        before: &[memsave_checkpoint::LeverStats],
        after: &[memsave_checkpoint::LeverStats],
    ) -> Self {
        let mut out = self;
        // A store first used during the step is in `after` only: from zero.
        for (i, a) in after.iter().enumerate() {
            let (b_bytes, b_resident) = before
                .get(i)
                .map_or((0, 0), |b| (b.bytes, b.resident_bytes.unwrap_or(0)));
            let bytes = a.bytes - b_bytes;
            let resident = a.resident_bytes.unwrap_or(0) - b_resident;
            let moved = bytes.saturating_sub(resident);
            let slot = if a.lossless {
                &mut out.offloaded_bytes
            } else {
                &mut out.compressed_saved_bytes
            };
            *slot = Some(slot.unwrap_or(0) + moved);
        }
        out
    }
}

/// The codec of a suite's `compress: {dtype}`.
pub(crate) fn codec(dtype: CompressDtype) -> Codec {
    match dtype {
        CompressDtype::Bf16 => Codec::Bf16,
        CompressDtype::Fp16 => Codec::Fp16,
        CompressDtype::Fp8 => Codec::fp8(),
        CompressDtype::Int8 => Codec::int8(),
    }
}

/// The default store: `memsave-offload` in the system's temporary directory.
pub(crate) fn default_dir() -> Result<PathBuf, StepError> {
    let dir = std::env::temp_dir().join("memsave-offload");
    std::fs::create_dir_all(&dir).map_err(|source| StepError::Io {
        what: format!("offload directory {}", dir.display()),
        source,
    })?;
    Ok(dir)
}

impl StepHooks {
    /// Hooks for `choice` that pass `held` through (parameters and the step's input).
    pub fn new(choice: &SavedTensors, held: &[Tensor]) -> Result<Self, StepError> {
        Ok(match choice {
            SavedTensors::Compress(dtype) => {
                StepHooks::Compress(Compress::new(codec(*dtype)).excluding(held))
            }
            SavedTensors::Offload(OffloadSpec::Disk { dir, max_in_flight }) => {
                let dir = match dir {
                    Some(dir) => PathBuf::from(dir),
                    None => default_dir()?,
                };
                let mut store =
                    DiskOffload::new(dir).map_err(|e| StepError::lever("offload", e))?;
                if let Some((bytes, _)) = max_in_flight {
                    store = store.max_in_flight_bytes(*bytes);
                }
                StepHooks::Disk(store.excluding(held))
            }
            SavedTensors::Offload(OffloadSpec::Cpu) => {
                StepHooks::Cpu(SaveOnCpu::new().excluding(held))
            }
            SavedTensors::OffloadSynchronous => {
                let store =
                    DiskOffload::new(default_dir()?).map_err(|e| StepError::lever("offload", e))?;
                StepHooks::Disk(store.excluding(held).synchronous(true).prefetch(0))
            }
        })
    }

    /// Makes these hooks handle what the calling thread saves until the guard exits.
    pub fn enter(&self) -> Result<HooksGuard, StepError> {
        match self {
            StepHooks::Compress(h) => HooksGuard::new(h.clone()),
            StepHooks::Disk(h) => HooksGuard::new(h.clone()),
            StepHooks::Cpu(h) => HooksGuard::new(h.clone()),
        }
        .map_err(|e| StepError::lever(self.lever(), e))
    }

    /// The same hooks as raw hooks, for a saved-tensor hook that hands them the
    /// tensors it does not keep itself (ZeRO-3's, `Fsdp::forward_with`). Enter them
    /// too ([`enter`](Self::enter)), around it: their scope is then open, which their
    /// packing of constants reads.
    pub fn raw(&self) -> Arc<dyn RawHooks> {
        match self {
            StepHooks::Compress(h) => raw_hooks(h.clone()),
            StepHooks::Disk(h) => raw_hooks(h.clone()),
            StepHooks::Cpu(h) => raw_hooks(h.clone()),
        }
    }

    /// The lever these hooks are, as a suite names it.
    fn lever(&self) -> &'static str {
        match self {
            StepHooks::Compress(_) => "compress",
            StepHooks::Disk(_) | StepHooks::Cpu(_) => "offload",
        }
    }

    /// At the end of a forward: waits for a disk store's writer to finish what the
    /// forward handed it, so what the forward keeps does not depend on the writer's
    /// pace (as one synchronizes a CUDA stream before reading its memory). Backward
    /// would wait for these writes or take the tensors back anyway. A failed write
    /// (the tensor stayed in memory) is left for [`finish`](Self::finish), which
    /// reports the step's total.
    pub fn settle(&self) {
        if let StepHooks::Disk(h) = self {
            h.wait_written();
        }
    }

    /// After the step: the bytes moved or shrunk; `Err` (naming the directory) when an
    /// offload write failed and tensors stayed in memory.
    pub fn finish(&self) -> Result<SavedBytes, StepError> {
        Ok(match self {
            StepHooks::Compress(h) => {
                // A policy naming an op no save matched is reported, not ignored.
                h.check().map_err(|e| StepError::lever("compress", e))?;
                SavedBytes {
                    offloaded_bytes: None,
                    compressed_saved_bytes: Some(h.stats().saved_bytes()),
                }
            }
            StepHooks::Disk(h) => {
                h.flush().map_err(|e| StepError::lever("offload", e))?;
                SavedBytes {
                    offloaded_bytes: Some(h.stats().written_bytes),
                    compressed_saved_bytes: None,
                }
            }
            StepHooks::Cpu(h) => SavedBytes {
                offloaded_bytes: Some(h.offloaded_bytes()),
                compressed_saved_bytes: None,
            },
        })
    }
}
