//! Sharded checkpoints of fully sharded training: each rank writes its shard of the
//! weights and of the optimizer state, its step and RNG state, to a file of its own; a
//! manifest names the files with their lengths and checksums.
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use memsave_optim::{Optimizer, Rule};
use tch::{Device, Kind, Tensor};

use crate::error::{DistError, Result};
use crate::fsdp::Fsdp;
use crate::group::ProcessGroup;

/// The manifest's name in a checkpoint directory.
const MANIFEST: &str = "manifest";
/// The manifest's first line: format and version.
const MANIFEST_HEADER: &str = "memsave-fsdp-checkpoint 1";
/// A shard file's first bytes.
const MAGIC: &[u8; 8] = b"MSFSDP\x00\x01";

/// The name of rank `rank`'s shard file among `world` ranks, in one of two slots that
/// successive saves take in turn (so that a save never writes over a file the current
/// manifest names).
fn shard_name(rank: usize, world: usize, slot: i64) -> String {
    if slot == 0 {
        format!("rank-{rank}-of-{world}.shard")
    } else {
        format!("rank-{rank}-of-{world}.next.shard")
    }
}

/// What identifies the model: its units' parameter shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModelKey {
    units: u64,
    values: u64,
    /// FNV-1a over the units' parameter counts and shapes.
    hash: u64,
}

impl ModelKey {
    fn of(fsdp: &Fsdp) -> Self {
        let state = fsdp.state();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |v: i64| {
            for byte in v.to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(state.units.len() as i64);
        for unit in &state.units {
            eat(unit.params.len() as i64);
            for p in &unit.params {
                let size = p.size();
                eat(size.len() as i64);
                size.iter().for_each(|&d| eat(d));
            }
        }
        Self {
            units: state.units.len() as u64,
            values: state.units.iter().map(|u| u.numel as u64).sum(),
            hash,
        }
    }
}

/// CRC-32 (IEEE 802.3, as zlib and PNG compute it) of `bytes`.
fn crc32(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !bytes.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// One rank's entry in the manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    file: String,
    len: u64,
    crc: u32,
}

/// The manifest: how many ranks wrote the checkpoint, for which model, at which step,
/// and each rank's file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Manifest {
    world: usize,
    step: u64,
    model: ModelKey,
    entries: Vec<Entry>,
}

impl Manifest {
    fn render(&self) -> String {
        let mut out = format!(
            "{MANIFEST_HEADER}\nworld_size {}\nstep {}\nmodel {} {} {:016x}\n",
            self.world, self.step, self.model.units, self.model.values, self.model.hash
        );
        for (rank, e) in self.entries.iter().enumerate() {
            out.push_str(&format!("rank {rank} {} {} {:08x}\n", e.file, e.len, e.crc));
        }
        out
    }

    /// Parses a manifest; `None` when it is not one.
    fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        if lines.next()? != MANIFEST_HEADER {
            return None;
        }
        let mut field = |name: &str| -> Option<Vec<String>> {
            let line = lines.next()?;
            let mut words = line.split(' ');
            (words.next()? == name).then(|| words.map(str::to_owned).collect())
        };
        let world: usize = field("world_size")?.first()?.parse().ok()?;
        let step: u64 = field("step")?.first()?.parse().ok()?;
        let model = field("model")?;
        let model = ModelKey {
            units: model.first()?.parse().ok()?,
            values: model.get(1)?.parse().ok()?,
            hash: u64::from_str_radix(model.get(2)?, 16).ok()?,
        };
        let mut entries = Vec::new();
        for rank in 0..world {
            let words = field("rank")?;
            if words.len() != 4 || words[0].parse::<usize>().ok()? != rank {
                return None;
            }
            entries.push(Entry {
                file: words[1].clone(),
                len: words[2].parse().ok()?,
                crc: u32::from_str_radix(&words[3], 16).ok()?,
            });
        }
        Some(Self {
            world,
            step,
            model,
            entries,
        })
    }
}

/// What a rank's shard file holds.
struct ShardFile {
    rank: u64,
    world: u64,
    model_hash: u64,
    step: u64,
    /// Each unit's shard values.
    shards: Vec<Vec<f32>>,
    rng: Vec<u8>,
    optimizer: Vec<u8>,
}

impl ShardFile {
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        for v in [self.rank, self.world, self.model_hash, self.step] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.shards.len() as u64).to_le_bytes());
        for shard in &self.shards {
            out.extend_from_slice(&(shard.len() as u64).to_le_bytes());
            shard
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
        for bytes in [&self.rng, &self.optimizer] {
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Parses a shard file; `None` when it is not one or is cut short.
    fn parse(bytes: &[u8]) -> Option<Self> {
        let mut c = Cursor { bytes, at: 0 };
        if c.take(8)? != MAGIC {
            return None;
        }
        let (rank, world, model_hash, step) = (c.u64()?, c.u64()?, c.u64()?, c.u64()?);
        let units = c.u64()?;
        let mut shards = Vec::new();
        for _ in 0..units {
            let len = usize::try_from(c.u64()?).ok()?;
            let raw = c.take(len.checked_mul(4)?)?;
            shards.push(
                raw.chunks_exact(4)
                    .map(|v| f32::from_le_bytes(v.try_into().expect("4 bytes")))
                    .collect(),
            );
        }
        let rng = c.bytes()?.to_vec();
        let optimizer = c.bytes()?.to_vec();
        (c.at == bytes.len()).then_some(Self {
            rank,
            world,
            model_hash,
            step,
            shards,
            rng,
            optimizer,
        })
    }
}

/// Reads a shard file front to back.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len())?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Some(out)
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    /// A length, then that many bytes.
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.u64()?).ok()?;
        self.take(len)
    }
}

/// Agrees across the ranks on whether each succeeded: every rank gets `Ok(value)` only
/// when all did; a rank that failed gets its own error, the others one naming the
/// ranks that failed.
fn agree<T>(group: &ProcessGroup, local: Result<T>, what: &str, dir: &Path) -> Result<T> {
    let rank = group.rank();
    let err = |source| DistError::Tensor {
        rank,
        context: "agreeing on a checkpoint",
        source,
    };
    let flag = Tensor::f_from_slice(&[i64::from(local.is_err())]).map_err(err)?;
    let all =
        Tensor::f_zeros([group.world_size() as i64], (Kind::Int64, Device::Cpu)).map_err(err)?;
    group.all_gather(&all, &flag)?;
    let all = Vec::<i64>::try_from(&all).map_err(err)?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r] != 0).collect();
    match local {
        Err(e) => Err(e),
        Ok(_) if !failed.is_empty() => Err(DistError::Config {
            rank,
            reason: format!(
                "checkpoint {}: ranks {failed:?} could not {what} (their errors say why); nothing was {}",
                dir.display(),
                if what == "load it" { "loaded" } else { "written" }
            ),
        }),
        Ok(value) => Ok(value),
    }
}

fn refuse(rank: usize, dir: &Path, reason: String) -> DistError {
    DistError::Config {
        rank,
        reason: format!("checkpoint {}: {reason}", dir.display()),
    }
}

fn io_refusal(rank: usize, dir: &Path, what: &str, path: &Path, e: std::io::Error) -> DistError {
    refuse(rank, dir, format!("{what} {}: {e}", path.display()))
}

impl Fsdp {
    /// Saves the training state as a sharded checkpoint in directory `dir` (made if
    /// missing): each rank writes its shard file (its shard of every unit's weights,
    /// its shard of the optimizer's state, `step`, and its CPU RNG state), and rank 0
    /// writes `manifest` last (the world size, the step, what identifies the model, and
    /// each file's name, length and CRC-32), after every rank's file is complete. A
    /// collective.
    ///
    /// An earlier checkpoint in `dir` stays whole until the new one is: the shard files
    /// go under names the current manifest does not use (`rank-R-of-N.shard` and
    /// `rank-R-of-N.next.shard` take turns), the ranks agree that every one was written,
    /// and only then is the manifest replaced, by an atomic rename. A save that fails
    /// on any rank removes the files it wrote and leaves the earlier checkpoint loadable;
    /// after a save that succeeds rank 0 removes the files the earlier manifest named.
    ///
    /// `optimizer` must be the one over [`Fsdp::parameters`]. Its state goes through
    /// `Optimizer::save` (a temporary file next to the shard, removed after).
    pub fn save_sharded<R: Rule>(
        &self,
        dir: &Path,
        optimizer: &Optimizer<R>,
        step: u64,
    ) -> Result<()> {
        let group = self.state().group.clone();
        let (rank, world) = (group.rank(), group.world_size());
        let model = ModelKey::of(self);
        let err = |source| DistError::Tensor {
            rank,
            context: "writing a checkpoint",
            source,
        };
        // Rank 0 makes the directory and picks the names the current manifest does
        // not use; every rank takes rank 0's pick.
        let (prepared, old_files) = if rank == 0 {
            match fs::create_dir_all(dir) {
                Ok(()) => {
                    let old: Vec<String> = fs::read_to_string(dir.join(MANIFEST))
                        .ok()
                        .and_then(|text| Manifest::parse(&text))
                        .map(|m| m.entries.into_iter().map(|e| e.file).collect())
                        .unwrap_or_default();
                    let next = i64::from(old.contains(&shard_name(0, world, 0)));
                    (Ok(next), old)
                }
                Err(e) => (
                    Err(io_refusal(rank, dir, "cannot create", dir, e)),
                    Vec::new(),
                ),
            }
        } else {
            (Ok(0), Vec::new())
        };
        let slot = agree(&group, prepared, "write it", dir)?;
        let slots = Tensor::f_zeros([world as i64], (Kind::Int64, Device::Cpu)).map_err(err)?;
        group.all_gather(&slots, &Tensor::f_from_slice(&[slot]).map_err(err)?)?;
        let slot = Vec::<i64>::try_from(&slots).map_err(err)?[0];
        let name = shard_name(rank, world, slot);
        let local = self.write_shard(dir, &name, optimizer, step, model);
        let entry = agree(&group, local, "write it", dir);
        let remove_mine = || {
            let _ = fs::remove_file(dir.join(&name));
            let _ = fs::remove_file(partial(&dir.join(&name)));
        };
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                remove_mine();
                return Err(e);
            }
        };
        // Every rank's (length, checksum) to rank 0, for the manifest.
        let gathered = (|| {
            let mine =
                Tensor::f_from_slice(&[entry.len as i64, i64::from(entry.crc)]).map_err(err)?;
            let all =
                Tensor::f_zeros([2 * world as i64], (Kind::Int64, Device::Cpu)).map_err(err)?;
            group.all_gather(&all, &mine)?;
            Vec::<i64>::try_from(&all).map_err(err)
        })();
        let all = match gathered {
            Ok(all) => all,
            Err(e) => {
                remove_mine();
                return Err(e);
            }
        };
        let manifest = Manifest {
            world,
            step,
            model,
            entries: (0..world)
                .map(|r| Entry {
                    file: shard_name(r, world, slot),
                    len: all[2 * r] as u64,
                    crc: all[2 * r + 1] as u32,
                })
                .collect(),
        };
        let written = if rank == 0 {
            write_atomically(&dir.join(MANIFEST), manifest.render().as_bytes())
                .map_err(|e| io_refusal(rank, dir, "cannot write", &dir.join(MANIFEST), e))
        } else {
            Ok(())
        };
        let renamed = rank == 0 && written.is_ok();
        if let Err(e) = agree(&group, written, "write it", dir) {
            // The rename is the commit: once it is done (this rank 0's own, or, as a
            // rank that lost the others in the last agreement, a manifest on disk that
            // names this rank's file), the new files are the checkpoint and stay. A
            // file no manifest names is harmless: the next save writes over its slot.
            let committed = renamed
                || fs::read_to_string(dir.join(MANIFEST))
                    .ok()
                    .and_then(|text| Manifest::parse(&text))
                    .is_some_and(|m| m == manifest);
            if !committed {
                remove_mine();
            }
            return Err(e);
        }
        // Committed: the earlier checkpoint's files are no longer named anywhere.
        if rank == 0 {
            let now: Vec<&str> = manifest.entries.iter().map(|e| e.file.as_str()).collect();
            for file in old_files {
                let named_elsewhere = file == MANIFEST || file.contains(['/', '\\']);
                if !now.contains(&file.as_str()) && !named_elsewhere {
                    let _ = fs::remove_file(dir.join(file));
                }
            }
        }
        Ok(())
    }

    /// Writes this rank's shard file; returns its manifest entry.
    fn write_shard<R: Rule>(
        &self,
        dir: &Path,
        name: &str,
        optimizer: &Optimizer<R>,
        step: u64,
        model: ModelKey,
    ) -> Result<Entry> {
        self.check_optimizer(optimizer)?;
        let state = self.state();
        let (rank, world) = (state.group.rank(), state.group.world_size());
        let err = |source| DistError::Tensor {
            rank,
            context: "writing a checkpoint",
            source,
        };
        let shards = (0..state.units.len())
            .map(|unit| {
                let values = state.shard_values(unit)?;
                Vec::<f32>::try_from(&values).map_err(err)
            })
            .collect::<Result<Vec<_>>>()?;
        drop(state);
        let rng = memsave_sys::rng::cpu_state()?;
        let rng = Vec::<u8>::try_from(&rng).map_err(err)?;
        let scratch = dir.join(format!(".rank-{rank}-optimizer.json"));
        let optimizer_bytes = optimizer
            .save(&scratch)
            .map_err(|source| DistError::Optim { rank, source })
            .and_then(|()| {
                fs::read(&scratch).map_err(|e| io_refusal(rank, dir, "cannot read", &scratch, e))
            });
        let _ = fs::remove_file(&scratch);
        let file = ShardFile {
            rank: rank as u64,
            world: world as u64,
            model_hash: model.hash,
            step,
            shards,
            rng,
            optimizer: optimizer_bytes?,
        };
        let bytes = file.to_bytes();
        let path = dir.join(name);
        write_atomically(&path, &bytes)
            .map_err(|e| io_refusal(rank, dir, "cannot write", &path, e))?;
        Ok(Entry {
            file: name.to_owned(),
            len: bytes.len() as u64,
            crc: crc32(&bytes),
        })
    }

    /// Refuses an optimizer that is not over this `Fsdp`'s shards.
    fn check_optimizer<R: Rule>(&self, optimizer: &Optimizer<R>) -> Result<()> {
        let ours = self.parameters();
        let theirs = optimizer.params();
        let same = theirs.len() == ours.len()
            && ours
                .iter()
                .zip(theirs)
                .all(|(a, b)| a.data_ptr() == b.data_ptr() && a.size() == b.size());
        if same {
            Ok(())
        } else {
            Err(DistError::Config {
                rank: self.state().group.rank(),
                reason: format!(
                    "the optimizer holds {} tensors that are not this Fsdp's {} parameter shards; build it over Fsdp::parameters()",
                    theirs.len(),
                    ours.len()
                ),
            })
        }
    }

    /// Loads a checkpoint written by [`Fsdp::save_sharded`] from `dir` into these units'
    /// shards, `optimizer`'s state and the CPU RNG; returns the step it was saved at. A
    /// collective, on the same number of ranks as the save and the same units.
    ///
    /// Every rank checks the manifest and that every shard file is there with the
    /// manifest's length, and the checksum and contents of its own file, before
    /// anything is changed. Refused, on every rank (an `Err` starting with the rank),
    /// are: a directory without a manifest (not a checkpoint, or a save that did not
    /// finish); one written by another number of ranks (naming both); one written for
    /// another model (other units or shapes); a missing or damaged shard file (naming
    /// it; a rank whose own file is fine names the ranks that refused); an optimizer
    /// state this rank's optimizer refuses (another rule, precision or grouping). All
    /// ranks change or none: the ranks agree that every one has read and checked its
    /// part, then that every one has loaded its optimizer state (a rank that did puts
    /// its earlier state back, kept in host memory meanwhile, when another did not),
    /// and only then copy in the weights and the RNG state. Gradients and gathered
    /// weights are dropped.
    pub fn load_sharded<R: Rule>(&self, dir: &Path, optimizer: &mut Optimizer<R>) -> Result<u64> {
        let group = self.state().group.clone();
        let rank = group.rank();
        let err = |source| DistError::Tensor {
            rank,
            context: "loading a checkpoint",
            source,
        };
        // Stage 1: read, check and stage everything; nothing changes yet.
        let local = self.read_shard(dir, optimizer).and_then(|file| {
            let shards = file
                .shards
                .iter()
                .map(|values| Tensor::f_from_slice(values).map_err(err))
                .collect::<Result<Vec<_>>>()?;
            let rng = Tensor::f_from_slice(&file.rng).map_err(err)?;
            // Checked here rather than refused by set_cpu_state after the weights are in.
            let current = memsave_sys::rng::cpu_state()?.numel();
            if file.rng.len() != current {
                return Err(refuse(
                    rank,
                    dir,
                    format!(
                        "rank {rank}'s shard file holds a random generator state of {} bytes, and this libtorch's is {current} bytes (written by another version?)",
                        file.rng.len()
                    ),
                ));
            }
            // What the optimizer holds now, to put back if another rank cannot load.
            let before = optimizer
                .state_dict()
                .map_err(|source| DistError::Optim { rank, source })?;
            Ok((file, shards, rng, before))
        });
        let (file, shards, rng, before) = agree(&group, local, "load it", dir)?;
        // Stage 2: the optimizer's state, which may still be refused (another rule,
        // precision or grouping); every rank puts its own back unless all loaded.
        let scratch = std::env::temp_dir().join(format!(
            "memsave-fsdp-{}-rank-{rank}-optimizer.json",
            std::process::id()
        ));
        let loaded = fs::write(&scratch, &file.optimizer)
            .map_err(|e| io_refusal(rank, dir, "cannot write", &scratch, e))
            .and_then(|()| {
                optimizer.load(&scratch).map_err(|source| {
                    // The optimizer's tensors are one per parameter with the shards in
                    // memory, one per chunk with them in files: a checkpoint of one
                    // kind does not load into the other.
                    let layout = if self.shard_dir().is_some() {
                        "; if it was saved with the shards in memory (one optimizer tensor per parameter), it loads only into an Fsdp with its shards in memory: this one keeps them in files, whose optimizer steps each parameter in chunks of at most SHARD_FILE_CHUNK_VALUES values"
                    } else {
                        "; if it was saved with the shards in files (one optimizer tensor per chunk of a parameter), it loads only into an Fsdp with its shards in files"
                    };
                    refuse(
                        rank,
                        dir,
                        format!(
                            "the optimizer state in rank {rank}'s shard file: {source}{layout}"
                        ),
                    )
                })
            });
        let _ = fs::remove_file(&scratch);
        let this_loaded = loaded.is_ok();
        if let Err(e) = agree(&group, loaded, "load it", dir) {
            if this_loaded {
                optimizer
                    .load_state_dict(&before)
                    .map_err(|source| DistError::Optim { rank, source })?;
            }
            return Err(e);
        }
        drop(before);
        // Stage 3: every rank loaded its optimizer state; the weights and RNG follow
        // (copies into tensors of the shapes checked in stage 1).
        let mut state = self.state();
        state.drop_gradients_and_weights()?;
        let _no_grad = tch::no_grad_guard();
        state.set_shards(&shards)?;
        memsave_sys::rng::set_cpu_state(&rng)?;
        Ok(file.step)
    }

    /// Reads and checks this rank's part of the checkpoint in `dir`.
    fn read_shard<R: Rule>(&self, dir: &Path, optimizer: &Optimizer<R>) -> Result<ShardFile> {
        let (rank, world) = {
            let state = self.state();
            (state.group.rank(), state.group.world_size())
        };
        let refuse = |reason: String| refuse(rank, dir, reason);
        self.check_optimizer(optimizer)?;
        let manifest_path = dir.join(MANIFEST);
        let text = match fs::read_to_string(&manifest_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refuse(format!(
                    "no manifest ({}): not a sharded checkpoint, or its save did not finish",
                    manifest_path.display()
                )))
            }
            Err(e) => return Err(io_refusal(rank, dir, "cannot read", &manifest_path, e)),
        };
        let manifest = Manifest::parse(&text).ok_or_else(|| {
            refuse(format!(
                "{} is not a manifest of memsave's sharded checkpoints (damaged?)",
                manifest_path.display()
            ))
        })?;
        if manifest.world != world {
            return Err(refuse(format!(
                "it was written by {} ranks and this run has {world}; resume on {} ranks",
                manifest.world, manifest.world
            )));
        }
        let model = ModelKey::of(self);
        if manifest.model != model {
            let same_totals =
                manifest.model.units == model.units && manifest.model.values == model.values;
            return Err(refuse(format!(
                "it was written for another model: {} units of {} values there, {} units of {} values here{}",
                manifest.model.units,
                manifest.model.values,
                model.units,
                model.values,
                if same_totals { " (same totals, different shapes)" } else { "" }
            )));
        }
        // Every file there with its length: a missing one is named on every rank.
        for entry in &manifest.entries {
            let path = dir.join(&entry.file);
            match fs::metadata(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(refuse(format!("shard file {} is missing", path.display())))
                }
                Err(e) => return Err(io_refusal(rank, dir, "cannot read", &path, e)),
                Ok(m) if m.len() != entry.len => {
                    return Err(refuse(format!(
                        "shard file {} is damaged: {} bytes, the manifest says {}",
                        path.display(),
                        m.len(),
                        entry.len
                    )))
                }
                Ok(_) => {}
            }
        }
        let entry = &manifest.entries[rank];
        let path = dir.join(&entry.file);
        let bytes = fs::read(&path).map_err(|e| io_refusal(rank, dir, "cannot read", &path, e))?;
        let crc = crc32(&bytes);
        if crc != entry.crc {
            return Err(refuse(format!(
                "shard file {} is damaged: its CRC-32 is {crc:08x}, the manifest says {:08x}",
                path.display(),
                entry.crc
            )));
        }
        let damaged =
            |why: &str| refuse(format!("shard file {} is damaged: {why}", path.display()));
        let file =
            ShardFile::parse(&bytes).ok_or_else(|| damaged("not a shard file, or cut short"))?;
        if (file.rank, file.world, file.model_hash, file.step)
            != (rank as u64, world as u64, model.hash, manifest.step)
        {
            return Err(damaged(&format!(
                "it says rank {} of {} at step {}, the manifest rank {rank} of {world} at step {}",
                file.rank, file.world, file.step, manifest.step
            )));
        }
        let state = self.state();
        let lens_match = file.shards.len() == state.units.len()
            && file
                .shards
                .iter()
                .zip(&state.units)
                .all(|(s, u)| s.len() as i64 == u.shard_len);
        if !lens_match {
            return Err(damaged("its shards' lengths do not match the units'"));
        }
        Ok(file)
    }

    /// Gathers every unit's full parameters and writes them on rank 0 to `path` as one
    /// ordinary tch file (`Tensor::save_multi`; names `unit{u}.param{i}`, in the order
    /// given to [`Fsdp::fully_shard`]), to use without `Fsdp`. A collective; the other
    /// ranks write nothing. Holds the whole model on every rank while it runs.
    pub fn save_full(&self, path: &Path) -> Result<()> {
        let full = self.f_full_parameters()?;
        let (rank, counts): (usize, Vec<usize>) = {
            let state = self.state();
            (
                state.group.rank(),
                state.units.iter().map(|u| u.params.len()).collect(),
            )
        };
        if rank != 0 {
            return Ok(());
        }
        let mut named = Vec::with_capacity(full.len());
        let mut tensors = full.into_iter();
        for (u, &count) in counts.iter().enumerate() {
            for i in 0..count {
                named.push((
                    format!("unit{u}.param{i}"),
                    tensors.next().expect("one per parameter"),
                ));
            }
        }
        Tensor::save_multi(&named, path).map_err(|source| DistError::Tensor {
            rank,
            context: "writing the full parameters",
            source,
        })
    }
}

/// The temporary file [`write_atomically`] writes before renaming it to `path`.
fn partial(path: &Path) -> PathBuf {
    let mut tmp: PathBuf = path.to_owned();
    tmp.set_extension("partial");
    tmp
}

/// Writes `bytes` to `path` through a temporary file renamed over it, so that a reader
/// sees the old file or the whole new one.
/// Writes `bytes` to `path` through a temporary name and a rename, each flushed to the
/// disk (the file before the rename, the directory after), so that a machine that goes
/// down after a save, not only a process, finds the whole file or the earlier one.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = partial(path);
    let mut file = fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, path)?;
    sync_dir(path)
}

/// Flushes the directory holding `path`, so that a rename in it is on the disk.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        // Opening a directory to sync it works on Unix; elsewhere the rename stands.
        Some(dir) if cfg!(unix) => fs::File::open(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        })?
        .sync_all(),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        // The check value of CRC-32/ISO-HDLC (zlib's crc32) over "123456789".
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn a_manifest_reads_back_and_garbage_is_refused() {
        let m = Manifest {
            world: 2,
            step: 10,
            model: ModelKey {
                units: 8,
                values: 1284,
                hash: 0x0123_4567_89ab_cdef,
            },
            entries: vec![
                Entry {
                    file: shard_name(0, 2, 0),
                    len: 100,
                    crc: 0xdead_beef,
                },
                Entry {
                    file: shard_name(1, 2, 0),
                    len: 101,
                    crc: 7,
                },
            ],
        };
        assert_eq!(Manifest::parse(&m.render()), Some(m.clone()));
        assert_eq!(Manifest::parse("hello"), None);
        // One rank's line missing.
        let cut: String = m
            .render()
            .lines()
            .take(5)
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(Manifest::parse(&cut), None);
    }

    #[test]
    fn a_shard_file_reads_back_and_a_cut_one_is_refused() {
        let f = ShardFile {
            rank: 1,
            world: 2,
            model_hash: 42,
            step: 10,
            shards: vec![vec![1.0, -2.5], vec![], vec![3.25]],
            rng: vec![1, 2, 3],
            optimizer: b"{}".to_vec(),
        };
        let bytes = f.to_bytes();
        let back = ShardFile::parse(&bytes).expect("parses");
        assert_eq!(
            (back.rank, back.world, back.model_hash, back.step),
            (1, 2, 42, 10)
        );
        assert_eq!(back.shards, f.shards);
        assert_eq!((back.rng, back.optimizer), (f.rng, f.optimizer));
        for len in [0, 7, 8, 20, bytes.len() - 1] {
            assert!(ShardFile::parse(&bytes[..len]).is_none(), "cut at {len}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ShardFile::parse(&longer).is_none());
    }
}
