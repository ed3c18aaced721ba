//! A rank's parameter shards in files instead of memory (ZeRO-Infinity's parameter
//! offload, FSDP2's `CPUOffloadPolicy` where the device is this process's counted
//! memory): one file per unit, read back for each use and checked, and a manifest that
//! names the files of the last step that finished.
//!
//! A step writes each updated shard to a new file (`unit-U.G.f32`, G the step's
//! generation) and reads the newest one; [`ShardFiles::commit`] (at the end of
//! backward) replaces the manifest by an atomic rename and only then removes the files
//! it no longer names. So a step that fails half way leaves the manifest naming the
//! whole previous step, which [`read_manifest`] loads.
use std::fs;
use std::path::{Path, PathBuf};

use memsave_hooks::FileError;

use tch::{Device, Kind, Tensor};

use crate::error::{DistError, Result};

/// The manifest's name in the directory.
pub(crate) const MANIFEST: &str = "weights.manifest";

/// Its first line.
const HEADER: &str = "memsave fsdp shard files 1";

/// One shard file: its name in the directory and the CRC-32 of its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FileRef {
    name: String,
    crc: u32,
}

/// One unit's files.
#[derive(Debug)]
struct UnitFiles {
    /// Values in the shard file (this rank's slice, padding included).
    values: i64,
    /// The shapes of the unit's parameters (for [`read_manifest`]).
    shapes: Vec<Vec<i64>>,
    /// The file the manifest names.
    committed: FileRef,
    /// A newer file written by the step under way, not yet in the manifest.
    pending: Option<FileRef>,
    /// The sum of the gradients of the step's micro-batches so far, and which
    /// parameters some micro-batch gave one (see [`ShardFiles::add_gradient`]).
    gradient: Option<(FileRef, Vec<f32>)>,
}

/// A rank's shard files (see the module docs).
#[derive(Debug)]
pub(crate) struct ShardFiles {
    dir: PathBuf,
    /// A directory made for this `Fsdp`, removed with it.
    temporary: Option<tempfile::TempDir>,
    rank: usize,
    world: usize,
    /// The generation of the files the manifest names last; the step under way writes
    /// `generation + 1`.
    generation: u64,
    units: Vec<UnitFiles>,
}

fn io_error(rank: usize, path: &Path, what: &str, e: impl std::fmt::Display) -> DistError {
    DistError::ShardFile {
        rank,
        path: path.to_owned(),
        reason: format!("could not {what}: {e}"),
    }
}

impl ShardFiles {
    /// Files in `dir` (created if missing), or in a new temporary directory when
    /// `None`. The directory must take files: checked now by writing and removing a
    /// probe, so that an unwritable one is refused before anything is sharded.
    pub(crate) fn create(dir: Option<&Path>, rank: usize, world: usize) -> Result<Self> {
        let (dir, temporary) = match dir {
            Some(dir) => {
                fs::create_dir_all(dir)
                    .map_err(|e| io_error(rank, dir, "create the shard directory", e))?;
                (dir.to_owned(), None)
            }
            None => {
                let temp = tempfile::Builder::new()
                    .prefix("memsave-shards-")
                    .tempdir()
                    .map_err(|e| {
                        io_error(rank, &std::env::temp_dir(), "make a shard directory in", e)
                    })?;
                (temp.path().to_owned(), Some(temp))
            }
        };
        let manifest = dir.join(MANIFEST);
        if manifest.exists() {
            return Err(DistError::ShardFile {
                rank,
                path: manifest,
                reason: "is there already: the directory holds the weights of another Fsdp (read them with Fsdp::read_parameter_files); give each Fsdp an empty directory of its own".into(),
            });
        }
        let probe = dir.join(".probe");
        fs::write(&probe, b"probe")
            .and_then(|()| fs::remove_file(&probe))
            .map_err(|e| io_error(rank, &dir, "write files in the shard directory", e))?;
        Ok(Self {
            dir,
            temporary,
            rank,
            world,
            generation: 0,
            units: Vec::new(),
        })
    }

    /// The directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the directory was made for this `Fsdp` (and goes with it).
    pub(crate) fn is_temporary(&self) -> bool {
        self.temporary.is_some()
    }

    /// Bytes in the files the manifest names.
    pub(crate) fn bytes(&self) -> u64 {
        self.units.iter().map(|u| 4 * u.values as u64).sum()
    }

    /// Writes a new unit's shard (f32, contiguous) and commits it.
    pub(crate) fn add_unit(&mut self, shard: &Tensor, shapes: Vec<Vec<i64>>) -> Result<()> {
        let unit = self.units.len();
        let name = format!("unit-{unit}.{}.f32", self.generation);
        let crc = self.write(&name, shard)?;
        self.units.push(UnitFiles {
            values: shard.numel() as i64,
            shapes,
            committed: FileRef { name, crc },
            pending: None,
            gradient: None,
        });
        self.write_manifest()
    }

    /// The newest values of `unit`'s shard (the step's own when it wrote some), read
    /// and checked: a missing, truncated, extended or changed file is an `Err` naming
    /// it.
    pub(crate) fn read(&self, unit: usize) -> Result<Tensor> {
        let u = &self.units[unit];
        let file = u.pending.as_ref().unwrap_or(&u.committed);
        read_checked(&self.dir.join(&file.name), u.values, file.crc, self.rank)
    }

    /// Writes `unit`'s updated shard as the step's own (not in the manifest until
    /// [`commit`](Self::commit)).
    pub(crate) fn write_pending(&mut self, unit: usize, shard: &Tensor) -> Result<()> {
        let name = format!("unit-{unit}.{}.f32", self.generation + 1);
        let crc = self.write(&name, shard)?;
        self.units[unit].pending = Some(FileRef { name, crc });
        Ok(())
    }

    /// Keeps `sum` (the micro-batches' gradients of `unit` so far, its shard's length)
    /// and `used` (which parameters some micro-batch gave one) in the unit's gradient
    /// file, for [`take_gradient`](Self::take_gradient).
    pub(crate) fn put_gradient(&mut self, unit: usize, sum: &Tensor, used: Vec<f32>) -> Result<()> {
        let name = format!("unit-{unit}.grad.f32");
        let crc = self.write(&name, sum)?;
        self.units[unit].gradient = Some((FileRef { name, crc }, used));
        Ok(())
    }

    /// The sum [`put_gradient`](Self::put_gradient) kept for `unit`, read back (and
    /// its file removed), with its flags; `None` when there is none.
    pub(crate) fn take_gradient(&mut self, unit: usize) -> Result<Option<(Tensor, Vec<f32>)>> {
        let Some((file, flags)) = self.units[unit].gradient.take() else {
            return Ok(None);
        };
        let path = self.dir.join(&file.name);
        let sum = read_checked(&path, self.units[unit].values, file.crc, self.rank)?;
        let _ = fs::remove_file(&path);
        Ok(Some((sum, flags)))
    }

    /// Whether `unit` has a sum of gradients waiting.
    pub(crate) fn has_gradient(&self, unit: usize) -> bool {
        self.units[unit].gradient.is_some()
    }

    /// Forgets every sum of gradients and removes their files.
    pub(crate) fn drop_gradients(&mut self) {
        for u in &mut self.units {
            if let Some((file, _)) = u.gradient.take() {
                let _ = fs::remove_file(self.dir.join(&file.name));
            }
        }
    }

    /// Replaces every unit's shard between steps (loading a checkpoint): files of a
    /// failed step are dropped first, every shard is written, then all are committed
    /// at once; a write that fails commits none of them.
    pub(crate) fn replace_all(&mut self, shards: &[Tensor]) -> Result<()> {
        self.discard_pending();
        for (unit, shard) in shards.iter().enumerate() {
            if let Err(e) = self.write_pending(unit, shard) {
                self.discard_pending();
                return Err(e);
            }
        }
        self.commit()
    }

    /// Removes the files of a step that did not finish, so that the next reads come
    /// from the manifest's.
    fn discard_pending(&mut self) {
        for u in &mut self.units {
            if let Some(file) = u.pending.take() {
                let _ = fs::remove_file(self.dir.join(&file.name));
            }
        }
    }

    /// Makes the step's files the manifest's (an atomic rename), then removes the files
    /// they replace. Nothing to do when the step wrote none.
    pub(crate) fn commit(&mut self) -> Result<()> {
        if self.units.iter().all(|u| u.pending.is_none()) {
            return Ok(());
        }
        let before: Vec<(FileRef, Option<FileRef>)> = self
            .units
            .iter()
            .map(|u| (u.committed.clone(), u.pending.clone()))
            .collect();
        let mut replaced = Vec::new();
        for u in &mut self.units {
            if let Some(new) = u.pending.take() {
                replaced.push(std::mem::replace(&mut u.committed, new));
            }
        }
        self.generation += 1;
        if let Err(e) = self.write_manifest() {
            // Not committed: the manifest on disk still names the old files, and the
            // step's stay the newest.
            for (u, (committed, pending)) in self.units.iter_mut().zip(before) {
                u.committed = committed;
                u.pending = pending;
            }
            self.generation -= 1;
            return Err(e);
        }
        for old in replaced {
            // A file left behind costs disk, not correctness: the manifest no longer
            // names it.
            let _ = fs::remove_file(self.dir.join(&old.name));
        }
        Ok(())
    }

    /// Writes `shard` as `name` through a temporary name renamed over it once whole:
    /// a write that fails (a full disk) leaves a file of that name as it was.
    fn write(&self, name: &str, shard: &Tensor) -> Result<u32> {
        let path = self.dir.join(name);
        let partial = self.dir.join(format!("{name}.partial"));
        let written = memsave_hooks::write_tensor_file(&partial, shard)
            .map_err(|e| file_error(self.rank, &path, e))
            .and_then(|crc| {
                fs::rename(&partial, &path).map_err(|e| io_error(self.rank, &path, "write", e))?;
                Ok(crc)
            });
        if written.is_err() {
            let _ = fs::remove_file(&partial);
        }
        written
    }

    fn write_manifest(&self) -> Result<()> {
        let mut text = format!("{HEADER}\nrank {} world {}\n", self.rank, self.world);
        for (index, u) in self.units.iter().enumerate() {
            let shapes: Vec<String> = u
                .shapes
                .iter()
                .map(|s| {
                    let dims: Vec<String> = s.iter().map(i64::to_string).collect();
                    format!("s{}", dims.join("x"))
                })
                .collect();
            text.push_str(&format!(
                "unit {index} file {} values {} crc {:08x} shapes {}\n",
                u.committed.name,
                u.values,
                u.committed.crc,
                shapes.join(",")
            ));
        }
        let path = self.dir.join(MANIFEST);
        let tmp = self.dir.join(format!("{MANIFEST}.partial"));
        fs::write(&tmp, text)
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(|e| io_error(self.rank, &path, "write", e))
    }
}

/// Reads `values` f32 back from `path` (memsave-hooks' tensor files: straight into a
/// new tensor a chunk at a time), refusing a file of another length or whose CRC-32 is
/// not `crc`, with an error naming it.
fn read_checked(path: &Path, values: i64, crc: u32, rank: usize) -> Result<Tensor> {
    memsave_hooks::read_tensor_file(path, Kind::Float, &[values], Device::Cpu, crc)
        .map_err(|e| file_error(rank, path, e))
}

/// memsave-hooks' file error as this crate's, naming `path`.
fn file_error(rank: usize, path: &Path, e: FileError) -> DistError {
    let reason = match e {
        FileError::Length {
            found, expected, ..
        } => format!(
            "holds {found} bytes, {expected} expected: it was truncated or appended to after it was written"
        ),
        FileError::Checksum { .. } => {
            "changed after it was written (CRC-32 mismatch); refusing to use it".to_owned()
        }
        FileError::Io { action, source, .. } => format!("could not {action}: {source}"),
        other => other.to_string(),
    };
    DistError::ShardFile {
        rank,
        path: path.to_owned(),
        reason,
    }
}

/// The parameters a one-rank [`crate::Fsdp`] with shards in files last committed to
/// `dir`: each file checked, the values split into the parameters' shapes, in the
/// order the units and their parameters were given. See [`crate::Fsdp::read_parameter_files`].
pub(crate) fn read_manifest(dir: &Path) -> Result<Vec<Tensor>> {
    let path = dir.join(MANIFEST);
    let bad = |reason: String| DistError::ShardFile {
        rank: 0,
        path: path.clone(),
        reason,
    };
    let text = fs::read_to_string(&path).map_err(|e| io_error(0, &path, "read", e))?;
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(bad(format!(
            "is not a shard manifest (its first line is not {HEADER:?})"
        )));
    }
    let who: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
    match who.as_slice() {
        ["rank", _, "world", "1"] => {}
        ["rank", rank, "world", world] => {
            return Err(bad(format!(
                "holds rank {rank}'s shards of {world}: each rank keeps a slice of every parameter; gather them with Fsdp::f_full_parameters"
            )))
        }
        _ => return Err(bad("has no rank and world line".into())),
    }
    let mut out = Vec::new();
    for line in lines {
        let parts: Vec<&str> = line.split(' ').collect();
        let ["unit", _, "file", name, "values", values, "crc", crc, "shapes", shapes] =
            parts.as_slice()
        else {
            return Err(bad(format!("has a line that does not parse: {line:?}")));
        };
        let values: i64 = values
            .parse::<i64>()
            .ok()
            .filter(|v| (0..=i64::MAX / 4).contains(v))
            .ok_or_else(|| bad(format!("values {values:?} is not a count of values")))?;
        let crc =
            u32::from_str_radix(crc, 16).map_err(|_| bad(format!("crc {crc:?} is not hex")))?;
        // The shapes first: a manifest that does not add up is refused before its
        // files are read.
        let mut parsed = Vec::new();
        let mut offset = 0i64;
        for shape in shapes.split(',').filter(|s| !s.is_empty()) {
            let dims = shape
                .strip_prefix('s')
                .ok_or_else(|| bad(format!("shape {shape:?} does not parse")))?;
            let dims: Vec<i64> = dims
                .split('x')
                .filter(|d| !d.is_empty())
                .map(str::parse)
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| bad(format!("shape {shape:?} does not parse")))?;
            let k = dims
                .iter()
                .try_fold(1i64, |a, &d| if d < 0 { None } else { a.checked_mul(d) })
                .filter(|&k| k <= values - offset)
                .ok_or_else(|| bad(format!("shape {shape:?} does not fit its file")))?;
            parsed.push((dims, offset, k));
            offset += k;
        }
        let flat = read_checked(&dir.join(name), values, crc, 0)?;
        for (dims, at, k) in parsed {
            let t = flat
                .f_narrow(0, at, k)
                .and_then(|t| t.f_reshape(dims.as_slice()))
                .and_then(|t| t.f_contiguous())
                .map_err(|e| bad(format!("its shapes do not fit its file: {e}")))?;
            out.push(t);
        }
    }
    Ok(out)
}
