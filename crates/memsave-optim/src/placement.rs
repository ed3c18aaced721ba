//! Where optimizer state lives between steps: with the parameters, in CPU memory, or
//! in files, fetched for one parameter's update at a time.
use std::path::{Path, PathBuf};

use tch::{Device, Tensor};

use crate::error::{OptimError, Result};
use crate::state::{Buffer, BufferLayout, ParamState};

/// Where the state buffers of an optimizer live between steps.
///
/// Off the device, each parameter's buffers are brought to the parameter's device just
/// before its update and put back right after, so the device holds the state of one
/// parameter at a time, and only during the step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// On the parameter's device.
    #[default]
    Device,
    /// In CPU memory (for CUDA parameters; for CPU parameters it is the same as
    /// [`Placement::Device`]). Each step copies each parameter's state to the GPU and
    /// back, synchronously.
    Cpu,
    /// In files under this directory (created if needed), one per parameter, named
    /// `param-<index>.state`: raw bytes of the buffers at the state's precision. The
    /// files belong to the optimizer; two optimizers must not share a directory.
    ///
    /// Each file is checked when it is read back: its length must be exactly what the
    /// state needs and its CRC-32 the one computed when it was written (kept in
    /// memory). A changed, truncated or extended file makes the step fail with
    /// [`OptimError::StateFile`] naming it, before the parameter is touched.
    Disk(PathBuf),
}

/// The placement's storage, as the optimizer uses it.
#[derive(Debug)]
pub(crate) enum StateStore {
    Device,
    Cpu,
    Disk(PathBuf),
}

impl StateStore {
    pub(crate) fn new(placement: &Placement) -> Result<Self> {
        Ok(match placement {
            Placement::Device => StateStore::Device,
            Placement::Cpu => StateStore::Cpu,
            Placement::Disk(dir) => {
                std::fs::create_dir_all(dir).map_err(|source| OptimError::Io {
                    path: dir.clone(),
                    source,
                })?;
                StateStore::Disk(dir.clone())
            }
        })
    }

    /// The file of parameter `index`, for [`Placement::Disk`].
    pub(crate) fn file(dir: &Path, index: usize) -> PathBuf {
        dir.join(format!("param-{index}.state"))
    }

    /// Puts the buffers of `st` on `layout.device`, ready for an update: zeros before
    /// the first step, else wherever they were kept.
    pub(crate) fn fetch(
        &self,
        index: usize,
        st: &mut ParamState,
        layout: &BufferLayout,
    ) -> Result<()> {
        if st.buffers.is_empty() && st.step == 0 {
            st.buffers = layout
                .signs
                .iter()
                .map(|(_, sign)| Buffer::zeros(layout.state, layout.numel, *sign, layout.device))
                .collect::<Result<_>>()?;
            return Ok(());
        }
        match self {
            StateStore::Device => {}
            StateStore::Cpu => {
                st.buffers = st
                    .buffers
                    .iter()
                    .map(|b| b.to_device(layout.device))
                    .collect::<Result<_>>()?;
            }
            StateStore::Disk(dir) => {
                if st.buffers.is_empty() {
                    st.buffers = read_buffers(&Self::file(dir, index), layout, st.disk_crc)?;
                }
            }
        }
        Ok(())
    }

    /// Puts the buffers of `st` back where they live between steps.
    pub(crate) fn keep(&self, index: usize, st: &mut ParamState) -> Result<()> {
        match self {
            StateStore::Device => {}
            StateStore::Cpu => {
                st.buffers = st
                    .buffers
                    .iter()
                    .map(|b| b.to_device(Device::Cpu))
                    .collect::<Result<_>>()?;
            }
            StateStore::Disk(dir) => {
                st.disk_crc = Some(write_buffers(&Self::file(dir, index), &st.buffers)?);
                st.buffers.clear();
            }
        }
        Ok(())
    }
}

/// Writes the buffers' bytes to `path`; returns their CRC-32.
fn write_buffers(path: &Path, buffers: &[Buffer]) -> Result<u32> {
    let mut bytes = Vec::new();
    for b in buffers {
        for (_, t) in b.parts() {
            bytes.extend_from_slice(&tensor_bytes(t)?);
        }
    }
    let crc = crc32fast::hash(&bytes);
    std::fs::write(path, bytes).map_err(|source| OptimError::Io {
        path: path.to_owned(),
        source,
    })?;
    Ok(crc)
}

/// Reads back what [`write_buffers`] wrote, refusing a file whose length is not
/// exactly the layout's or whose CRC-32 is not `crc`.
fn read_buffers(path: &Path, layout: &BufferLayout, crc: Option<u32>) -> Result<Vec<Buffer>> {
    let damaged = |reason: String| OptimError::StateFile {
        path: path.to_owned(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|source| OptimError::Io {
        path: path.to_owned(),
        source,
    })?;
    let parts: Vec<Vec<(&'static str, tch::Kind, Vec<i64>)>> = layout
        .signs
        .iter()
        .map(|(_, sign)| Buffer::layout(layout.state, layout.numel, *sign))
        .collect();
    let size = |kind: tch::Kind, shape: &[i64]| {
        shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes()
    };
    let expected: usize = parts
        .iter()
        .flatten()
        .map(|(_, kind, shape)| size(*kind, shape))
        .sum();
    if bytes.len() != expected {
        return Err(damaged(format!(
            "optimizer state file holds {} bytes, {expected} expected: it was truncated or appended to after the optimizer wrote it",
            bytes.len()
        )));
    }
    let Some(crc) = crc else {
        return Err(damaged(
            "no checksum was recorded for this optimizer state file, so it cannot be trusted"
                .into(),
        ));
    };
    let found = crc32fast::hash(&bytes);
    if found != crc {
        return Err(damaged(format!(
            "optimizer state file changed after the optimizer wrote it (CRC-32 {found:08x}, {crc:08x} written); refusing to step from it"
        )));
    }
    let mut offset = 0usize;
    let mut buffers = Vec::new();
    for ((_, sign), buffer_parts) in layout.signs.iter().zip(parts) {
        let mut tensors = Vec::new();
        for (_, kind, shape) in buffer_parts {
            let len = size(kind, &shape);
            let slice = &bytes[offset..offset + len];
            tensors
                .push(Tensor::f_from_data_size(slice, &shape, kind)?.f_to_device(layout.device)?);
            offset += len;
        }
        buffers.push(Buffer::from_parts(layout.state, *sign, tensors));
    }
    Ok(buffers)
}

/// The raw bytes of a tensor, in its kind and on the CPU.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.f_to_device(Device::Cpu)?.f_contiguous()?;
    let numel = t.numel();
    let mut out = vec![0u8; memsave_sys::tensor::nbytes(&t) as usize];
    t.f_copy_data_u8(&mut out, numel)?;
    Ok(out)
}
