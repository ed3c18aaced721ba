//! A store's own directory, and one tensor as a file in it: raw bytes written and
//! read in chunks, with a CRC-32 so that a file changed after it was written is caught.
use crate::error::{FileError, OffloadError};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use tch::{Device, Kind, Tensor};

/// Bytes copied per chunk: the only memory outside libtorch's allocator that a write
/// or a read uses.
const CHUNK: usize = 1 << 20;

/// A store's own directory inside the one the user chose, removed (with whatever is
/// left in it) when dropped.
///
/// Its name, `memsave-<pid>-<start>-<boot>-<n>-<host>`, says who owns it: the process
/// id, the process's start time (clock ticks after boot, `/proc/<pid>/stat`), the
/// first 8 hex digits of the boot id, a counter of this process's stores and the host
/// name. A process killed before dropping its store (Ctrl-C) leaves its directory
/// behind; the next store made in the same directory removes it once its owner is
/// gone, on the same host: another boot, or on this boot no process with that pid and
/// start time (a pid reused by a later process does not keep it). Directories of live
/// processes, of other hosts (a shared file system), of other users, and anything not
/// named so are left alone.
#[derive(Debug)]
pub(crate) struct StoreDir {
    path: PathBuf,
}

/// Stores made by this process so far: the `<n>` of their directories' names.
static STORES: AtomicU64 = AtomicU64::new(0);

impl StoreDir {
    /// Creates a new store directory in `parent`, which must exist and take files
    /// (checked by writing and removing a probe file), after removing the directories
    /// of stores whose owner is gone; the error names `parent`.
    pub fn create(parent: &Path) -> Result<StoreDir, OffloadError> {
        let bad = |reason: String| OffloadError::Dir {
            dir: parent.to_path_buf(),
            reason,
        };
        let meta = std::fs::metadata(parent).map_err(|e| bad(format!("cannot be used: {e}")))?;
        if !meta.is_dir() {
            return Err(bad("is not a directory".into()));
        }
        let me = Owner::me();
        let path = loop {
            let n = STORES.fetch_add(1, Ordering::Relaxed);
            let name = match &me {
                Some(me) => me.name(n),
                // No procfs: a name that no later run takes for a stale store.
                None => format!("memsave-{}-unknown-{n}", std::process::id()),
            };
            let path = parent.join(name);
            match std::fs::create_dir(&path) {
                Ok(()) => break path,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(bad(format!("does not take files: {e}"))),
            }
        };
        // From here on, dropping `dir` removes what was made.
        let dir = StoreDir { path };
        let probe = dir.path.join("probe");
        std::fs::write(&probe, b"probe").map_err(|e| bad(format!("does not take files: {e}")))?;
        std::fs::remove_file(&probe).map_err(|e| bad(format!("does not remove files: {e}")))?;
        if let Some(me) = &me {
            dir.remove_stale(parent, me);
        }
        Ok(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the store directories in `parent` whose owner is gone and whose owner
    /// (user) is the owner of this one; failures are ignored (another store may be
    /// removing the same one).
    fn remove_stale(&self, parent: &Path, me: &Owner) {
        let (Ok(entries), Ok(mine)) = (std::fs::read_dir(parent), std::fs::metadata(&self.path))
        else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(owner) = name.to_str().and_then(Owner::parse) else {
                continue;
            };
            // `DirEntry::metadata` does not follow a symbolic link.
            let same_user = entry
                .metadata()
                .is_ok_and(|m| m.is_dir() && same_user(&m, &mine));
            if same_user && owner.is_gone(me) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

impl Drop for StoreDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The process that owns a store directory, as its name says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Owner {
    pid: u32,
    /// Start time in clock ticks after boot.
    start: u64,
    /// The first 8 hex digits of the boot id.
    boot: String,
    /// The host name, characters other than ASCII letters, digits, `.` and `-` as `_`.
    host: String,
}

impl Owner {
    /// This process (read anew each time: a forked child is another owner); `None`
    /// without procfs.
    fn me() -> Option<Owner> {
        let pid = std::process::id();
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot: String = boot
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(8)
            .collect();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
        let host: String = host
            .trim()
            .chars()
            .take(64)
            .map(|c| match c {
                'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '-' => c,
                _ => '_',
            })
            .collect();
        (boot.len() == 8 && !host.is_empty()).then_some(())?;
        Some(Owner {
            pid,
            start: start_time(pid)?,
            boot,
            host,
        })
    }

    /// The name of this owner's store directory number `n`.
    fn name(&self, n: u64) -> String {
        let Owner {
            pid,
            start,
            boot,
            host,
        } = self;
        format!("memsave-{pid}-{start}-{boot}-{n}-{host}")
    }

    /// The owner a directory's name gives; `None` when it is not a store's name.
    fn parse(name: &str) -> Option<Owner> {
        let mut parts = name.strip_prefix("memsave-")?.splitn(5, '-');
        let mut field = || parts.next().filter(|s| !s.is_empty());
        let pid = field()?.parse().ok()?;
        let start = field()?.parse().ok()?;
        let boot = field()?;
        let _n: u64 = field()?.parse().ok()?;
        let host = field()?;
        let boot_ok = boot.len() == 8 && boot.chars().all(|c| c.is_ascii_hexdigit());
        boot_ok.then(|| Owner {
            pid,
            start,
            boot: boot.to_owned(),
            host: host.to_owned(),
        })
    }

    /// Whether this owner is gone, as seen by `me`: the same host, and another boot or
    /// no process `pid` started at `start` now. Unsure means not gone.
    fn is_gone(&self, me: &Owner) -> bool {
        if self.host != me.host {
            return false;
        }
        if self.boot != me.boot {
            return true;
        }
        match std::fs::metadata(format!("/proc/{}", self.pid)) {
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
            Ok(_) => start_time(self.pid).is_some_and(|start| start != self.start),
        }
    }
}

#[cfg(unix)]
fn same_user(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.uid() == b.uid()
}

#[cfg(not(unix))]
fn same_user(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    false
}

/// When process `pid` started, in clock ticks after boot (field 22 of
/// `/proc/<pid>/stat`, counted after the parenthesized command name, which may hold
/// spaces).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = &stat[stat.rfind(')')? + 1..];
    fields.split_whitespace().nth(19)?.parse().ok()
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
            bytes: memsave_sys::tensor::nbytes(t),
        }
    }
}

/// Writes the bytes of `t` (contiguous, any device) to `path`; returns their CRC-32.
pub(crate) fn write(path: &Path, t: &Tensor) -> Result<u32, FileError> {
    // One element may carry any stride (0 after an `expand`); viewing it as bytes
    // needs stride 1.
    let flat = |t: &Tensor| match t.numel() {
        1 => t.f_as_strided([1], [1], None::<i64>),
        _ => t.f_reshape([-1]),
    };
    let bytes = flat(t)
        .and_then(|flat| flat.f_view_dtype(Kind::Uint8))
        .map_err(|e| FileError::io("view the tensor as bytes for", path, e))?;
    let total = bytes.numel();
    let mut file = File::create(path).map_err(|e| FileError::io("create", path, e))?;
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; CHUNK.min(total)];
    for start in (0..total).step_by(CHUNK) {
        let len = CHUNK.min(total - start);
        bytes
            .f_narrow(0, start as i64, len as i64)
            .and_then(|chunk| chunk.f_copy_data_u8(&mut buf[..len], len))
            .map_err(|e| FileError::io("copy the tensor's bytes for", path, e))?;
        crc.update(&buf[..len]);
        file.write_all(&buf[..len])
            .map_err(|e| FileError::io("write", path, e))?;
    }
    Ok(crc.finalize())
}

/// Bytes of a stored gradient added into the live one at a time by [`add_into`]: the
/// chunk tensor adds this much to the peak of backward.
const ADD_CHUNK: usize = 1 << 16;

/// Adds the tensor `layout` describes, read back from `path` a chunk at a time, into
/// `target` (contiguous, of the layout's kind and number of values, on its device):
/// the sum costs one small chunk, not a second copy of the tensor. Checks the length
/// first and the CRC-32 at the end: after an `Err`, `target` may hold a part of the
/// sum, and the caller discards it.
pub(crate) fn add_into(
    path: &Path,
    layout: &Layout,
    crc: u32,
    target: &Tensor,
) -> Result<(), FileError> {
    let file = open_checked(path, layout)?;
    let add = |e: tch::TchError| FileError::io("add the stored sum from", path, e);
    let total = layout.bytes as usize;
    let element = layout.kind.elt_size_in_bytes().max(1);
    let step = (ADD_CHUNK / element).max(1) * element;
    let flat = target.f_view([-1]).map_err(add)?;
    let bytes =
        Tensor::f_empty([step.min(total) as i64], (Kind::Uint8, Device::Cpu)).map_err(add)?;
    read_chunks(file, path, total, step, crc, |start, chunk| {
        memsave_sys::tensor::write_bytes(&bytes, 0, chunk)
            .map_err(|e| FileError::io("add the stored sum from", path, e))?;
        let n = chunk.len();
        let chunk = bytes
            .f_narrow(0, 0, n as i64)
            .and_then(|c| c.f_view_dtype(layout.kind))
            .and_then(|c| c.f_to_device(target.device()))
            .map_err(add)?;
        let _ = flat
            .f_narrow(0, (start / element) as i64, (n / element) as i64)
            .and_then(|mut part| part.f_add_(&chunk))
            .map_err(add)?;
        Ok(())
    })
}

/// `path` opened for reading, refused unless it holds the `layout.bytes` bytes a
/// stored tensor of `layout` has.
fn open_checked(path: &Path, layout: &Layout) -> Result<File, FileError> {
    let file = File::open(path).map_err(|e| FileError::io("open", path, e))?;
    let found = file
        .metadata()
        .map_err(|e| FileError::io("read", path, e))?
        .len();
    if found != layout.bytes {
        return Err(FileError::Length {
            path: path.to_path_buf(),
            found,
            expected: layout.bytes,
        });
    }
    Ok(file)
}

/// Reads the `total` bytes of `file` (at `path`) `chunk` bytes at a time, handing each
/// with its offset to `each`, then checks their CRC-32 against `crc`: after an `Err`,
/// `each` may have seen a part of a damaged file.
fn read_chunks(
    mut file: File,
    path: &Path,
    total: usize,
    chunk: usize,
    crc: u32,
    mut each: impl FnMut(usize, &[u8]) -> Result<(), FileError>,
) -> Result<(), FileError> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; chunk.min(total)];
    for start in (0..total).step_by(chunk) {
        let n = chunk.min(total - start);
        file.read_exact(&mut buf[..n])
            .map_err(|e| FileError::io("read", path, e))?;
        hasher.update(&buf[..n]);
        each(start, &buf[..n])?;
    }
    if hasher.finalize() != crc {
        return Err(FileError::Checksum {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// Writes the bytes of `t` (contiguous, any device) to `path` a 1 MiB chunk at a time
/// (the only memory outside libtorch's allocator it uses); returns their CRC-32, for
/// [`read_tensor_file`]. The file store of `DiskOffload` and `GradOffload`, for other
/// crates that keep tensors in files (ZeRO-3's shards in files, `memsave-dist`).
pub fn write_tensor_file(path: &Path, t: &Tensor) -> Result<u32, FileError> {
    write(path, t)
}

/// Reads back a tensor of `kind` and `shape` on `device` that [`write_tensor_file`]
/// wrote to `path`, straight into the new tensor a chunk at a time: refused
/// ([`FileError::Length`]) unless the file holds exactly its bytes, and
/// ([`FileError::Checksum`]) unless their CRC-32 is `crc`.
pub fn read_tensor_file(
    path: &Path,
    kind: Kind,
    shape: &[i64],
    device: Device,
    crc: u32,
) -> Result<Tensor, FileError> {
    let numel = shape.iter().product::<i64>().max(0) as u64;
    let layout = Layout {
        kind,
        shape: shape.to_vec(),
        device,
        bytes: numel * kind.elt_size_in_bytes() as u64,
    };
    read(path, &layout, crc)
}

/// Reads the tensor `layout` describes back from `path`, checking its length and its
/// CRC-32 against `crc`.
pub(crate) fn read(path: &Path, layout: &Layout, crc: u32) -> Result<Tensor, FileError> {
    let file = open_checked(path, layout)?;
    let total = layout.bytes as usize;
    let restore = |e: tch::TchError| FileError::io("restore the tensor from", path, e);
    let out = Tensor::f_empty([total as i64], (Kind::Uint8, Device::Cpu)).map_err(restore)?;
    // Straight into the restored tensor: a chunk tensor in between would add its size
    // to the peak of backward.
    read_chunks(file, path, total, CHUNK, crc, |start, chunk| {
        memsave_sys::tensor::write_bytes(&out, start, chunk)
            .map_err(|e| FileError::io("restore the tensor from", path, e))
    })?;
    // A flat tensor is the bytes' view as it is: a reshape would be one more view
    // whose base (with grad on) holds another reference to the storage, which a caller
    // counting the storage's users (ZeRO-3's shards in files) would take for a holder.
    let t = out
        .f_view_dtype(layout.kind)
        .and_then(|t| match layout.shape.as_slice() {
            [n] if *n == t.numel() as i64 => Ok(t),
            shape => t.f_reshape(shape),
        })
        .map_err(restore)?;
    match layout.device {
        Device::Cpu => Ok(t),
        device => t.f_to_device(device).map_err(restore),
    }
}
