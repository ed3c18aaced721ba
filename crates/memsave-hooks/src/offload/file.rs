//! One saved tensor as a store file: raw bytes written and read in chunks, with a
//! CRC-32 so that a file changed between forward and backward is caught.
use crate::error::OffloadError;
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// Bytes copied per chunk: the only memory outside libtorch's allocator that a write
/// or a read uses.
const CHUNK: usize = 1 << 20;

/// Checks that `dir` exists and takes new files (by writing and removing a probe
/// file) and returns a name prefix for a new store's files there, unique to this
/// process and moment; the error names the directory.
pub(crate) fn store_prefix(dir: &Path) -> Result<String, OffloadError> {
    let bad = |reason: String| OffloadError::Dir {
        dir: dir.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(dir).map_err(|e| bad(format!("cannot be used: {e}")))?;
    if !meta.is_dir() {
        return Err(bad("is not a directory".into()));
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let prefix = format!("memsave-{}-{nanos:x}", std::process::id());
    let probe = dir.join(format!("{prefix}-probe"));
    std::fs::write(&probe, b"probe").map_err(|e| bad(format!("does not take files: {e}")))?;
    std::fs::remove_file(&probe).map_err(|e| bad(format!("does not remove files: {e}")))?;
    Ok(prefix)
}

/// What a file must hold to be read back.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub kind: Kind,
    pub shape: Vec<i64>,
    pub device: Device,
    pub bytes: u64,
}

impl Layout {
    pub fn of(t: &Tensor) -> Layout {
        Layout {
            kind: t.kind(),
            shape: t.size(),
            device: t.device(),
            bytes: (t.numel() * t.kind().elt_size_in_bytes()) as u64,
        }
    }
}

/// Writes the bytes of `t` (contiguous, any device) to `path`; returns their CRC-32.
pub(crate) fn write(path: &Path, t: &Tensor) -> Result<u32, String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("{what} {}: {e}", path.display());
    let bytes = t
        .f_reshape([-1])
        .and_then(|flat| flat.f_view_dtype(Kind::Uint8))
        .map_err(|e| fail("cannot view the tensor for", &e))?;
    let total = bytes.numel();
    let mut file = File::create(path).map_err(|e| fail("cannot create", &e))?;
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; CHUNK.min(total)];
    for start in (0..total).step_by(CHUNK) {
        let len = CHUNK.min(total - start);
        bytes
            .f_narrow(0, start as i64, len as i64)
            .and_then(|chunk| chunk.f_copy_data_u8(&mut buf[..len], len))
            .map_err(|e| fail("cannot copy the tensor for", &e))?;
        crc.update(&buf[..len]);
        file.write_all(&buf[..len])
            .map_err(|e| fail("cannot write", &e))?;
    }
    Ok(crc.finalize())
}

/// Reads the tensor `layout` describes back from `path`, checking its length and its
/// CRC-32 against `crc`; any difference is an `Err` naming the file.
pub(crate) fn read(path: &Path, layout: &Layout, crc: u32) -> Result<Tensor, String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        format!("offload store file {} {what}: {e}", path.display())
    };
    let mut file = File::open(path).map_err(|e| fail("cannot be opened", &e))?;
    let len = file
        .metadata()
        .map_err(|e| fail("cannot be read", &e))?
        .len();
    if len != layout.bytes {
        return Err(format!(
            "offload store file {} was truncated or changed between forward and backward: {len} bytes, expected {}",
            path.display(),
            layout.bytes
        ));
    }
    let total = layout.bytes as usize;
    let tch_err = |e: tch::TchError| fail("cannot be restored", &e);
    let out = Tensor::f_empty([total as i64], (Kind::Uint8, Device::Cpu)).map_err(tch_err)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; CHUNK.min(total)];
    for start in (0..total).step_by(CHUNK) {
        let n = CHUNK.min(total - start);
        file.read_exact(&mut buf[..n])
            .map_err(|e| fail("cannot be read", &e))?;
        hasher.update(&buf[..n]);
        // Straight into the restored tensor: a chunk tensor in between would add its
        // size to the peak of backward.
        memsave_sys::tensor::write_bytes(&out, start, &buf[..n])
            .map_err(|e| fail("cannot be restored", &e))?;
    }
    if hasher.finalize() != crc {
        return Err(format!(
            "offload store file {} was changed between forward and backward (checksum mismatch); refusing to compute gradients from it",
            path.display()
        ));
    }
    let t = out
        .f_view_dtype(layout.kind)
        .and_then(|t| t.f_reshape(&layout.shape))
        .map_err(tch_err)?;
    match layout.device {
        Device::Cpu => Ok(t),
        device => t.f_to_device(device).map_err(tch_err),
    }
}
