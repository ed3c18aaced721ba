//! ZeRO stage 3, fully sharded data parallel (PyTorch's FSDP2, DeepSpeed's ZeRO-3):
//! each rank keeps 1/N of every parameter and gathers a unit's weights only while it
//! runs.
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use memsave_optim::{Optimizer, Rule};
use memsave_sys::grad_hooks::{register_post_accumulate_grad_hook, GradHookHandle};
use memsave_sys::hooks::{Packed, RawHooks};
use memsave_sys::CallbackError;
use tch::nn::ModuleT;
use tch::{Device, Kind, Tensor};

use crate::check::same_shapes_everywhere;
use crate::error::{DistError, Result};
use crate::group::{ProcessGroup, Work};
use crate::shard_files::ShardFiles;
use std::path::Path;

/// Options of [`Fsdp`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsdpConfig {
    /// Free a unit's gathered weights right after its forward and gather them again in
    /// backward (default `true`, as FSDP2's `reshard_after_forward`): one unit's full
    /// weights at a time, for one more all-gather per unit and step. `false` keeps them
    /// from the forward until the unit's gradients are reduced in backward: every
    /// unit's full weights are held at the end of the forward, and backward gathers
    /// nothing.
    pub reshard_after_forward: bool,
    /// In backward, when a unit is gathered again, start the all-gather of the unit
    /// backward needs next (the one that ran before it in the forward) without waiting
    /// for it (default `true`, as FSDP2's `BACKWARD_PRE`): the gather runs on the
    /// group's worker thread while this unit's backward computes, and two units' full
    /// weights are held at once (current and prefetched) instead of one. Only with
    /// `reshard_after_forward` (otherwise backward gathers nothing). `false` gathers
    /// each unit when backward asks for it, one at a time.
    pub backward_prefetch: bool,
    /// Keep this rank's shards in files instead of memory (default `false`): ZeRO-3's
    /// parameter offload (DeepSpeed's ZeRO-Infinity, FSDP2's `CPUOffloadPolicy`), and on
    /// one process (a group of one) parameters off the device. [`Fsdp::new`] makes a
    /// temporary directory for them; [`Fsdp::new_in_dir`] takes one. See [`Fsdp`]'s
    /// "Shards in files".
    pub shards_in_files: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            reshard_after_forward: true,
            backward_prefetch: true,
            shards_in_files: false,
        }
    }
}

/// What one rank's fully sharded units hold and have sent, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FsdpStats {
    /// Bytes of parameters this rank keeps between uses: its shard of every unit
    /// (padding included) and the 4-byte NaN that freed parameters read as.
    pub parameter_bytes: u64,
    /// Values this rank holds beyond ceil(P/N), P all units' values: what padding each
    /// unit on its own adds (see [`Fsdp`]'s padding rule); fewer than the units.
    pub padding_values: u64,
    /// Bytes of full (gathered) weights held now.
    pub gathered_bytes: u64,
    /// The most gathered bytes held at once since the last
    /// [`Fsdp::reset_gathered_peak`].
    pub gathered_peak_bytes: u64,
    /// Units gathered (all-gathers) so far.
    pub gathers: u64,
    /// Units whose gradients were reduce-scattered so far.
    pub reductions: u64,
    /// Bytes of this rank's shards kept in files ([`FsdpConfig::shards_in_files`]; 0
    /// otherwise, when they are in `parameter_bytes`).
    pub file_bytes: u64,
}

/// Fully sharded data parallel training over a process group: the units' parameters
/// are sharded across the ranks and gathered only while a unit runs (ZeRO-3).
///
/// One rank over a file rendezvous here (with `memsave launch -n 4`,
/// [`crate::init_process_group`] joins four, and each rank keeps a quarter):
///
/// ```
/// use memsave_dist::{Fsdp, FsdpConfig, InitOptions, ProcessGroup};
/// use memsave_optim::{AdamW, AdamWConfig};
/// use tch::nn::{self, ModuleT};
/// use tch::{Device, Kind, Tensor};
///
/// let dir = tempfile::tempdir()?;
/// let group = ProcessGroup::new_file(&dir.path().join("store"), 0, 1, &InitOptions::default())?;
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut fsdp = Fsdp::new(&group, FsdpConfig::default())?;
/// let mut model = nn::seq_t();
/// for i in 0..4 {
///     let lin = nn::linear(vs.root() / i, 8, 8, Default::default());
///     let params = [lin.ws.shallow_clone(), lin.bs.as_ref().unwrap().shallow_clone()];
///     model = model.add(fsdp.fully_shard(lin, &params)?); // one unit per layer
/// }
/// let mut opt = AdamW::new(&fsdp.parameters(), AdamWConfig::default())?; // the shards
/// let x = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
/// for _ in 0..3 {
///     let loss = fsdp.forward(|| model.forward_t(&x, true).square().mean(Kind::Float))?;
///     loss.backward();
///     fsdp.f_finish_backward()?;
///     opt.f_step()?;
///     opt.zero_grad(true);
/// }
/// // Between steps a rank holds its shards (4 x 72 values here) and one NaN.
/// assert_eq!(fsdp.stats().parameter_bytes, 4 * 4 * 72 + 4);
/// assert_eq!(fsdp.stats().gathered_bytes, 0);
/// # Ok::<(), anyhow::Error>(())
/// ```
///
/// **Units and shards.** [`Fsdp::fully_shard`] takes a module and the parameters it
/// uses (a unit; every rank registers the same units, in the same order) and returns a
/// module to use in its place ([`FsdpUnit`], a tch `ModuleT`: add it to a
/// `CheckpointedSequential` with `add_t`, or to an `nn::SequentialT`). The unit's P values, in order, form
/// one flat f32 vector padded with zeros to N × ceil(P/N) values (N the world size);
/// rank r keeps values r × S to (r+1) × S, S = ceil(P/N), in a shard tensor
/// ([`Fsdp::parameters`], one per unit). **Padding rule**: each unit is padded on its
/// own, to a multiple of N, so any world size works; a rank holds Σ ceil(P_u/N) values,
/// which is ceil(P/N) plus fewer padding values than there are units. Rank 0's values
/// are broadcast when a unit is sharded, so the ranks start equal.
///
/// **Parameters between uses.** The parameter tensors the module holds (tch layers keep
/// their weight `Tensor`s) stay the same objects: their data is swapped in place. Outside
/// their unit's forward and backward they keep their shape but read as NaN (a
/// broadcast view of one 4-byte NaN, so that nothing mistakes them for weights: a
/// `VarStore::save` then writes NaN, not plausible zeros): read the weights with
/// [`Fsdp::f_full_parameters`], put them back into the module's parameters with
/// [`Fsdp::f_restore_full_parameters`] (before saving the module's own way, or before
/// dropping the `Fsdp`), and use a parameter only inside its unit (tied weights across
/// units are refused when saved for backward).
///
/// **Forward.** A unit's forward all-gathers its shard into one flat buffer, points
/// each parameter at its slice (so autograd records the full weights and gradients land
/// in the parameters' `.grad`), runs the module, and with
/// [`FsdpConfig::reshard_after_forward`] frees the buffer. Autograd would keep the
/// weights it saves for backward (a linear layer saves `weight.t()`, a view of the
/// buffer); inside [`Fsdp::forward`] a saved-tensor hook keeps only where such a tensor
/// lies in the buffer, so the buffer can go. Without grad (evaluation) the buffer is
/// always freed after the forward.
///
/// **Backward.** A unit is gathered again when backward first needs one of its weights
/// (the first saved weight it unpacks) or, in a checkpointed unit, when the
/// recomputation runs its forward. A unit whose backward reads no weight (the first
/// layer when its input needs no gradient) is not gathered again. With
/// [`FsdpConfig::backward_prefetch`] (the default), when backward gathers a unit it
/// also starts, without waiting, the all-gather of the unit that ran just before it in
/// the forward, into that unit's own buffer; when backward asks for that unit's
/// weights it waits on the gather instead of gathering. The gather runs on the
/// group's worker thread while this unit's backward computes. At most one prefetch is
/// in flight, so at most two units' full weights are gathered at once (current and
/// prefetched; [`FsdpStats::gathered_bytes`] counts both), plus, while a gather runs,
/// Gloo's own staging buffer of the same size (Gloo gathers into a flat buffer and
/// copies it out; not in `gathered_bytes`, seen by the meter). Only units that
/// backward will gather are prefetched: those whose resharded forward saved some of
/// their weights, or saved nothing through [`Fsdp::forward`]'s hook (a checkpoint,
/// whose recomputation gathers). So no prefetched buffer goes unused in a chain; one
/// that does (backward took another order, or a unit ran outside [`Fsdp::forward`])
/// is waited for and freed by [`Fsdp::f_finish_backward`], its bytes sent counted.
/// When backward asks for another unit than the prefetched one, the prefetched one is
/// kept as gathered until its reduction (three units at once). When every parameter of a unit has its gradient
/// (post-accumulate-grad hooks), the gradients are flattened, reduce-scattered (summed
/// into each rank's slice), divided by N (gradients are averaged, as in DDP) and added
/// to the parameter shards' `.grad` ([`Fsdp::parameters`]); the full gradients and
/// weights are freed.
///
/// **Unused parameters**: a parameter that gets a gradient on some ranks only is
/// averaged as if the others had a zero gradient; one that gets none on any rank in a
/// step (its unit ran without it, or its unit did not run) keeps no gradient in its
/// shard, so the optimizer leaves it as one process does (its values, state and step
/// count; PyTorch's FSDP2, whose gradient stays `None`). Each rank's chunk of the
/// reduce-scatter carries one f32 flag per parameter of the unit after its values, 1
/// where this rank has a gradient, so the sum says which parameters some rank used.
///
/// **Bytes sent per micro-batch**: an all-gather per unit in forward and in backward,
/// and a reduce-scatter, each (N-1)/N of the unit's padded bytes: 3 (N-1)/N of the
/// padded weight bytes, less (N-1)/N of each unit not gathered again; 2 (N-1)/N
/// without `reshard_after_forward`; and the used-flags, 4 (N-1) bytes per parameter.
/// Backward prefetch adds nothing in a chain (it gathers units backward gathers
/// anyway), only the rare unused prefetch above.
///
/// **Gradient accumulation**: every backward reduce-scatters (FSDP's default with
/// gradient sync on, rather than accumulating full gradients under `no_sync`):
/// communication per micro-batch, but a rank never holds more than one unit's full
/// gradients. Accumulating whole gradients would keep every unit's full gradient
/// (P × 4 bytes per rank) between micro-batches, the memory ZeRO-3 exists to remove.
///
/// **The step**: build any `memsave-optim` optimizer over [`Fsdp::parameters`] (the
/// parameter shards: each parameter's part of this rank's slice); it steps only this
/// rank's slice, with any rule, state precision or placement (8-bit state's blocks
/// then run over each parameter shard from its first value, so they group values
/// differently than over each whole parameter on one process). Or hand the optimizer
/// to [`Fsdp::step_in_backward`]: each parameter shard then steps as soon as its unit's
/// reduce-scatter lands. Call [`Fsdp::f_finish_backward`] after a step's last
/// backward: it reduces the units some of whose parameters got no gradient here (with
/// zeros for those; see unused parameters above) and frees any weights still gathered.
///
/// Traps: every rank must run the same units in the same order, forward and backward,
/// or the collectives wait on each other until the group's timeout. Parameters must be
/// contiguous f32 CPU tensors that require grad, each in one unit. The optimizer's
/// `max_grad_norm` would clip by this rank's shard alone; clip outside it. Its own
/// `step_in_backward` does not fire on the shards (their gradients are not set by
/// autograd): use [`Fsdp::step_in_backward`]. With `Placement::Disk`, give each rank its own directory. Each parameter
/// carries one post-accumulate-grad hook, so it cannot also be given to data parallel
/// or ZeRO-2.
///
/// **Shards in files** ([`FsdpConfig::shards_in_files`], or [`Fsdp::new_in_dir`]):
/// this rank keeps no shard in memory, only one file per unit, so that the parameters
/// are off the device (ZeRO-Infinity's parameter offload; on one process, a group of
/// one, the whole model's weights). A unit's gather reads its shard from the file (on
/// one rank the shard is the unit's weights, read straight into the gathered buffer; on
/// several, read, then all-gathered); backward reads it again when it needs the
/// weights (no prefetch: the read is synchronous, so a read ahead would hold a second
/// unit for nothing). **The optimizer must step in backward**
/// ([`Fsdp::step_in_backward`]): when a unit's gradients land, its shard is read, the
/// optimizer's tensors ([`Fsdp::parameters`], which read NaN between steps) are
/// pointed at it and stepped, and the stepped shard is written to a new file; an
/// optimizer stepped after backward would find NaN placeholders. So a rank holds, at
/// most, one unit's gathered weights, one unit's full gradients and, while it steps,
/// its shard (and the optimizer's state of it, which may be in files too:
/// `memsave_optim::Placement::Disk`). [`Fsdp::f_finish_backward`] commits the step:
/// the manifest (`weights.manifest`) is replaced by an atomic rename to name the
/// step's files, and the files it replaced are removed. Every read checks the file's
/// length and CRC-32: a missing, truncated or changed file fails the step with
/// [`DistError::ShardFile`] naming it, as does a write that fails (a full disk); the
/// manifest still names the files of the last step that finished, which
/// [`Fsdp::read_parameter_files`] loads (on one process). Traps: a step that failed
/// half way has stepped some units (their weights, in the step's files, and their
/// optimizer state) and not others: the next step goes on from there, as an
/// optimizer in backward does after an error; reload the last finished step to start
/// over. Files are written without `fsync` (each under a temporary name renamed once
/// whole): the manifest survives the process ending at any point, not the machine going
/// down (use [`Fsdp::save_sharded`] for that). A directory that already holds a
/// manifest is refused (it holds another run's weights). On several ranks, a damaged
/// file fails its own rank's step, and the other ranks wait in their next collective
/// until the group's timeout, as with any step that fails on one rank; each rank's
/// manifest names its own slices.
///
/// **Accumulation** with shards in files: [`Fsdp::set_accumulate`] keeps each unit's
/// gradients in a file of its own between micro-batches, and the last micro-batch's
/// backward steps the unit.
///
/// **Dropping it** removes the hooks that reduce the gradients, and the weights live
/// only in the shards, 1/N on each rank: call [`Fsdp::f_restore_full_parameters`] first
/// (a collective) to put the full weights back into the module's parameters, which
/// then stay with the module. Dropping communicates nothing: a collective in a
/// destructor could report no error, and would pair with whatever collective the other
/// ranks run next, or wait until the group's timeout for a rank that returned early or
/// died. So without that call the parameters keep reading NaN after the drop (a line
/// on stderr says how many units were lost), and the units refuse to run their forward (an `Err` saying the weights are lost); with it,
/// the units run their module as it is, on the restored weights.
pub struct Fsdp {
    // Dropped first: removing the hooks releases their references to the state.
    hooks: Vec<GradHookHandle>,
    shared: Arc<Mutex<Shared>>,
    group: ProcessGroup,
}

impl fmt::Debug for Fsdp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state();
        f.debug_struct("Fsdp")
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .field("units", &s.units.len())
            .field("config", &s.config)
            .finish()
    }
}

/// A module whose parameters [`Fsdp`] shards: gathers them for its forward and frees
/// them after (see [`Fsdp`]). Use it where the module was used.
pub struct FsdpUnit {
    shared: Arc<Mutex<Shared>>,
    unit: usize,
    module: Box<dyn ModuleT>,
}

impl fmt::Debug for FsdpUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsdpUnit")
            .field("unit", &self.unit)
            .field("module", &self.module)
            .finish()
    }
}

/// Steps one parameter shard (its index in [`Fsdp::parameters`]) when its gradients
/// land: see [`Fsdp::step_in_backward`].
type ShardStep = Box<dyn FnMut(usize) -> Result<()> + Send>;

/// The state the units, the hooks and the saved-tensor hook share.
pub(crate) struct Shared {
    pub(crate) group: ProcessGroup,
    config: FsdpConfig,
    /// One f32 NaN: what freed parameters are views of.
    placeholder: Tensor,
    /// The `Fsdp` was dropped: its hooks are gone, and units run their module as it is
    /// when their weights were restored, and refuse otherwise.
    closed: bool,
    /// [`Fsdp::discard`] was called: dropping it loses the weights without a word.
    discarded: bool,
    pub(crate) units: Vec<Unit>,
    gathered_bytes: u64,
    gathered_peak_bytes: u64,
    gathers: u64,
    reductions: u64,
    /// Units whose gathered weights something still held after a resharding forward.
    held_after_forward: Vec<usize>,
    /// The unit whose forward runs now (with grad, outside backward), whose saves the
    /// saved-tensor hook counts.
    forward_unit: Option<usize>,
    /// Units in the order of their last forward with grad (outside backward): backward
    /// runs them in reverse, so the unit before one is the one to prefetch.
    forward_order: Vec<usize>,
    /// The all-gather started ahead of backward's need (see
    /// [`FsdpConfig::backward_prefetch`]); at most one.
    prefetch: Option<Prefetch>,
    /// Set by [`Fsdp::step_in_backward`].
    step: Option<ShardStep>,
    /// The shards' files, with [`FsdpConfig::shards_in_files`].
    files: Option<ShardFiles>,
    /// With shards in files, what [`Fsdp::parameters`] points the pieces at until the
    /// optimizer is built.
    staging: Option<Tensor>,
    /// With shards in files, set by [`Fsdp::set_accumulate`]: a unit's gradients go
    /// to its gradient file instead of its step.
    accumulating: bool,
    /// The staging buffer was freed (by the optimizer's registration or a forward):
    /// [`Fsdp::parameters`] does not make it again.
    unstaged: bool,
}

/// One unit's parameters and shard.
pub(crate) struct Unit {
    /// The module's parameter tensors (the same `TensorImpl`s).
    pub(crate) params: Vec<Tensor>,
    /// Values of the unit, without padding.
    pub(crate) numel: i64,
    /// This rank's slice: `shard_len` values.
    pub(crate) shard: Tensor,
    pub(crate) shard_len: i64,
    /// The optimizer's tensors: views of `shard`, one per parameter with values in
    /// this rank's slice (see [`Fsdp::parameters`]).
    pieces: Vec<Piece>,
    /// The full flat weights (world size × shard_len values) while gathered.
    gathered: Option<Tensor>,
    /// Which parameters got their gradient in the current backward.
    ready: Vec<bool>,
    /// Some gradient arrived that is not reduced yet.
    owed: bool,
    /// Tensors the saved-tensor hook of [`Fsdp::forward`] saw in this unit's last
    /// forward, and how many of them lay in its gathered weights.
    packs: u32,
    saved_slices: u32,
    /// Backward will gather this unit again: its resharded forward saved some of its
    /// weights (by place), or saved nothing through our hook (a checkpoint, which
    /// recomputes the forward in backward). Cleared when backward gathers it.
    needs_weights: bool,
    /// The parameters hold full copies of the weights ([`Fsdp::f_restore_full_parameters`])
    /// until the unit is next gathered or freed.
    restored: bool,
}

/// One parameter's part of a rank's slice of its unit: what the optimizer steps.
struct Piece {
    /// The parameter's index in its unit.
    param: usize,
    /// Where the part starts in the shard, and its length (the unit's padding goes with
    /// its last parameter).
    at: i64,
    len: i64,
    /// A view of the shard (a leaf that requires grad).
    view: Tensor,
}

/// A unit's all-gather started ahead of backward's need, into its own buffer.
struct Prefetch {
    unit: usize,
    flat: Tensor,
    work: Work,
}

/// The gradients of a unit's last micro-batch (`grads`, with this backward's
/// used-flags `used`) and the sum the micro-batches before it left in the unit's
/// gradient file (`stored`, with theirs): per parameter, the sum where both have a
/// gradient (`stored + new`, the order autograd accumulates `.grad` in), else the one
/// that does.
fn combine(
    unit: &Unit,
    stored: Tensor,
    stored_used: &[f32],
    grads: Option<Tensor>,
    used: &[f32],
) -> tch::Result<(Tensor, Vec<f32>)> {
    let both: Vec<f32> = stored_used
        .iter()
        .zip(used)
        .map(|(&a, &b)| if a != 0.0 || b != 0.0 { 1.0 } else { 0.0 })
        .collect();
    let Some(grads) = grads else {
        return Ok((stored, both));
    };
    for piece in &unit.pieces {
        let (old, new) = (stored_used[piece.param] != 0.0, used[piece.param] != 0.0);
        let mut dst = stored.f_narrow(0, piece.at, piece.len)?;
        let src = grads.f_narrow(0, piece.at, piece.len)?;
        match (old, new) {
            (true, true) => {
                let _ = dst.f_add_(&src)?;
            }
            (false, true) => {
                dst.f_copy_(&src)?;
            }
            _ => {}
        }
    }
    Ok((stored, both))
}

/// With shards in files ([`FsdpConfig::shards_in_files`]), the most values of one of
/// the optimizer's tensors ([`Fsdp::parameters`]: a chunk of a parameter's part of the
/// shard): 256 KiB of f32, so that an update reads, and holds, that much of each state
/// buffer (the state may wait in files too), however large the parameter.
pub const SHARD_FILE_CHUNK_VALUES: i64 = 1 << 16;

/// A tensor of `shape` whose every value is `placeholder`'s one NaN (no storage of
/// its own).
fn nan_view(placeholder: &Tensor, shape: &[i64]) -> tch::Result<Tensor> {
    placeholder.f_reshape([0i64; 0])?.f_expand(shape, false)
}

fn tensor_err(rank: usize, context: &'static str) -> impl Fn(tch::TchError) -> DistError + Copy {
    move |source| DistError::Tensor {
        rank,
        context,
        source,
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl Fsdp {
    /// No units yet: register them with [`Fsdp::fully_shard`]. With
    /// [`FsdpConfig::shards_in_files`], the shards go to a temporary directory made
    /// now (removed with the `Fsdp`); an error names the directory that could not be
    /// made.
    pub fn new(group: &ProcessGroup, config: FsdpConfig) -> Result<Self> {
        Self::with_files(group, config, None)
    }

    /// [`Fsdp::new`] with this rank's shards in files in `dir` (created if missing;
    /// [`FsdpConfig::shards_in_files`] is implied), which stay after the `Fsdp` is
    /// dropped: the weights of the last step that finished, loadable with
    /// [`Fsdp::read_parameter_files`] on one process. Give each rank, and each
    /// `Fsdp`, its own directory. A directory that does not take files is refused now,
    /// naming it.
    pub fn new_in_dir(group: &ProcessGroup, config: FsdpConfig, dir: &Path) -> Result<Self> {
        let config = FsdpConfig {
            shards_in_files: true,
            ..config
        };
        Self::with_files(group, config, Some(dir))
    }

    /// The parameters a one-process `Fsdp` with shards in files last committed to
    /// `dir` (see [`Fsdp::new_in_dir`]): those of the last step whose backward
    /// finished, in the order the units and their parameters were given, each file's
    /// length and CRC-32 checked. Needs no `Fsdp`: after a failed step, or in another
    /// process after this one ended.
    ///
    /// # Errors
    /// [`DistError::ShardFile`] naming the manifest or the shard file that is missing,
    /// changed or truncated, or a directory of one rank of several (each holds a slice
    /// of every parameter).
    pub fn read_parameter_files(dir: &Path) -> Result<Vec<Tensor>> {
        crate::shard_files::read_manifest(dir)
    }

    fn with_files(group: &ProcessGroup, config: FsdpConfig, dir: Option<&Path>) -> Result<Self> {
        let files = if config.shards_in_files {
            Some(ShardFiles::create(dir, group.rank(), group.world_size())?)
        } else {
            None
        };
        let err = tensor_err(group.rank(), "the freed-parameter placeholder");
        let placeholder = Tensor::f_full([1], f64::NAN, (Kind::Float, Device::Cpu)).map_err(err)?;
        Ok(Self {
            hooks: Vec::new(),
            shared: Arc::new(Mutex::new(Shared {
                group: group.clone(),
                config,
                placeholder,
                closed: false,
                discarded: false,
                units: Vec::new(),
                gathered_bytes: 0,
                gathered_peak_bytes: 0,
                gathers: 0,
                reductions: 0,
                held_after_forward: Vec::new(),
                forward_unit: None,
                forward_order: Vec::new(),
                prefetch: None,
                step: None,
                files,
                staging: None,
                accumulating: false,
                unstaged: false,
            })),
            group: group.clone(),
        })
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    /// Shards `params` (the parameters `module` uses) as the next unit and returns the
    /// module that gathers them around its forward (FSDP2's `fully_shard`). A
    /// collective: every rank calls it for the same units in the same order.
    ///
    /// Checks first, on every rank, that the parameters are contiguous f32 CPU tensors
    /// that require grad and belong to no other unit, and that every rank gives
    /// parameters of the same shapes (an `Err` naming the rank that differs, before
    /// anything changes). Then copies rank 0's values to every rank, keeps this rank's
    /// slice and frees the full tensors.
    pub fn fully_shard<M: ModuleT + 'static>(
        &mut self,
        module: M,
        params: &[Tensor],
    ) -> Result<FsdpUnit> {
        let unit = self.fully_shard_parameters(params)?;
        Ok(FsdpUnit {
            shared: Arc::clone(&self.shared),
            unit,
            module: Box::new(module),
        })
    }

    /// [`Fsdp::fully_shard`] for a module that stays where it is (a closure inside a
    /// `CheckpointedSequential`, say): shards `params` as the next unit, with the same
    /// checks, and returns the unit's index. Run the module's forward inside
    /// [`FsdpUnits::f_forward`] with that index, where the module is called, so that
    /// its weights are gathered around it. A collective, as `fully_shard`.
    pub fn fully_shard_parameters(&mut self, params: &[Tensor]) -> Result<usize> {
        let rank = self.group.rank();
        let unit = self.state().units.len();
        self.check_distinct(unit, params)?;
        for (index, p) in params.iter().enumerate() {
            if p.kind() != Kind::Float
                || p.device() != Device::Cpu
                || !p.is_contiguous()
                || !p.requires_grad()
            {
                return Err(DistError::Config {
                    rank,
                    reason: format!(
                        "unit {unit}, parameter {index} (shape {:?}, {:?} on {:?}): fully_shard needs contiguous f32 CPU parameters that require grad",
                        p.size(),
                        p.kind(),
                        p.device()
                    ),
                });
            }
        }
        same_shapes_everywhere(&self.group, params).map_err(|e| match e {
            DistError::Mismatch {
                rank,
                other,
                what,
                detail,
            } => DistError::Mismatch {
                rank,
                other,
                what,
                detail: format!("unit {unit}: {detail}"),
            },
            e => e,
        })?;
        let err = tensor_err(rank, "sharding a unit");
        let n = self.group.world_size() as i64;
        let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let shard_len = (numel + n - 1) / n;
        let shard = {
            let _no_grad = tch::no_grad_guard();
            for p in params {
                self.group.broadcast(p, 0)?;
            }
            let flat = Tensor::f_zeros([shard_len * n], (Kind::Float, Device::Cpu)).map_err(err)?;
            let mut offset = 0;
            for p in params {
                let k = p.numel() as i64;
                flat.f_narrow(0, offset, k)
                    .and_then(|mut dst| dst.f_copy_(&p.f_reshape([-1])?))
                    .map_err(err)?;
                offset += k;
            }
            flat.f_narrow(0, rank as i64 * shard_len, shard_len)
                .and_then(|s| s.f_detach_copy())
                .map_err(err)?
        };
        // Each parameter's part of this rank's slice, the padding with the last one.
        let start = rank as i64 * shard_len;
        let mut pieces = Vec::new();
        let mut offset = 0;
        for (index, p) in params.iter().enumerate() {
            let end = if index + 1 == params.len() {
                shard_len * n
            } else {
                offset + p.numel() as i64
            };
            let (lo, hi) = (offset.max(start), end.min(start + shard_len));
            if lo < hi {
                let view = shard
                    .f_narrow(0, lo - start, hi - lo)
                    .map_err(err)?
                    .set_requires_grad(true);
                pieces.push(Piece {
                    param: index,
                    at: lo - start,
                    len: hi - lo,
                    view,
                });
            }
            offset = end;
        }
        let mut state = self.state();
        let (shard, pieces) = match state.files.as_mut() {
            None => (shard, pieces),
            Some(files) => {
                // The shard goes to its file; the shard and the optimizer's pieces keep
                // their shapes and read NaN until a step points them at its values.
                files.add_unit(&shard, params.iter().map(Tensor::size).collect())?;
                let nan = |len: i64| nan_view(&state.placeholder, &[len]).map_err(err);
                // Each piece cut into chunks of at most `SHARD_FILE_CHUNK_VALUES`: the optimizer
                // steps (and keeps the state of) one chunk at a time, so that a large
                // parameter's update never holds its whole state (elementwise rules
                // step a chunk as they step the whole).
                let chunks = pieces.into_iter().flat_map(|piece| {
                    (0..piece.len)
                        .step_by(SHARD_FILE_CHUNK_VALUES as usize)
                        .map(move |start| {
                            (
                                piece.param,
                                piece.at + start,
                                SHARD_FILE_CHUNK_VALUES.min(piece.len - start),
                            )
                        })
                });
                let pieces = chunks
                    .map(|(param, at, len)| {
                        let own = Tensor::f_empty([len], (Kind::Float, Device::Cpu))
                            .map_err(err)?
                            .set_requires_grad(true);
                        own.shallow_clone().f_set_data(&nan(len)?).map_err(err)?;
                        Ok(Piece {
                            param,
                            at,
                            len,
                            view: own,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                (nan(shard_len)?, pieces)
            }
        };
        state.units.push(Unit {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            numel,
            shard,
            shard_len,
            pieces,
            gathered: None,
            ready: vec![false; params.len()],
            owed: false,
            packs: 0,
            saved_slices: 0,
            needs_weights: false,
            restored: false,
        });
        state.free(unit)?;
        drop(state);
        for (index, p) in params.iter().enumerate() {
            let shared = Arc::clone(&self.shared);
            let hook = register_post_accumulate_grad_hook(
                p,
                Box::new(move |_| {
                    lock(&shared)
                        .mark_ready(unit, index)
                        .map_err(CallbackError::from)
                }),
            )
            .map_err(|e| DistError::Config {
                rank,
                reason: format!("unit {unit}, parameter {index}: {e}"),
            })?;
            self.hooks.push(hook);
        }
        Ok(unit)
    }

    /// A handle on the units that runs a unit's forward where its module is called
    /// (see [`Fsdp::fully_shard_parameters`]); it may be cloned into the modules and
    /// shared across threads.
    pub fn units(&self) -> FsdpUnits {
        FsdpUnits {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Refuses a parameter given twice, or already in a unit (then it reads from the
    /// placeholder).
    fn check_distinct(&self, unit: usize, params: &[Tensor]) -> Result<()> {
        let placeholder = self.state().placeholder.data_ptr();
        for (index, p) in params.iter().enumerate() {
            let reason = if p.data_ptr() == placeholder {
                Some("is already in a unit of this Fsdp".to_owned())
            } else {
                params[..index]
                    .iter()
                    .position(|q| q.data_ptr() == p.data_ptr())
                    .map(|first| format!("is the same tensor as parameter {first}"))
            };
            if let Some(reason) = reason {
                return Err(DistError::Config {
                    rank: self.group.rank(),
                    reason: format!(
                        "unit {unit}, parameter {index} {reason}; each parameter belongs to one unit, once"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The parameter shards this rank keeps, to give to the optimizer: one flat f32
    /// tensor per parameter with values in this rank's slice of its unit (the part of
    /// it that lies there; the unit's padding goes with its last parameter), units in
    /// the order of [`Fsdp::fully_shard`] and parameters in the order given, so that
    /// together they are this rank's slice of every unit, in order (FSDP2's sharded
    /// parameters, flattened; with shards in files, each cut into chunks of at most
    /// [`SHARD_FILE_CHUNK_VALUES`]). After backward their `.grad` holds their averaged
    /// gradients; a parameter that got a gradient on no rank keeps none, so that the
    /// optimizer skips it (its values, state and step count), as on one process.
    ///
    /// With shards in files they hold no values between steps; so that an optimizer can
    /// be built over them (each a contiguous tensor of its own), this call points them
    /// at slices of one NaN buffer (as long as the largest of them, plus one value
    /// each), which [`Fsdp::step_in_backward`] or the first forward frees; from then
    /// on they are returned as they are (all views of one NaN): build the optimizer
    /// before the first step.
    pub fn parameters(&self) -> Vec<Tensor> {
        let mut state = self.state();
        if state.files.is_some() && state.step.is_none() && !state.unstaged {
            // Without the buffer (out of memory) they stay NaN views, which an optimizer
            // refuses with its own message.
            let _ = state.stage_pieces();
        }
        state
            .units
            .iter()
            .flat_map(|u| u.pieces.iter().map(|p| p.view.shallow_clone()))
            .collect()
    }

    /// Number of units.
    pub fn len(&self) -> usize {
        self.state().units.len()
    }

    /// Whether there are no units.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` (a forward, with its loss) so that the weights autograd saves inside
    /// fully sharded units can be freed after each unit's forward: a saved-tensor hook
    /// keeps where each such tensor lies in its unit's gathered buffer instead of the
    /// tensor, and backward gathers the unit again when it needs one. Other saved
    /// tensors are kept as they are.
    ///
    /// A checkpointed unit (`CheckpointedSequential`'s plans, `memsave_checkpoint`'s
    /// checkpoint) needs no such hook: the checkpoint's own hooks, innermost, keep
    /// nothing of its forward. Without `forward`, an unchecked unit's weights stay held
    /// by autograd until its backward: correct, but no memory saved, and
    /// [`Fsdp::f_finish_backward`] says so (unless `reshard_after_forward` is off),
    /// except for a forward outside before one inside (an evaluation loss with grad
    /// between steps): its graph holds the weights until it is dropped.
    ///
    /// Trap: saved-tensor hooks entered inside `f` (offload, compression) are innermost
    /// and see the units' weights first; those that keep the weights make
    /// `f_finish_backward` refuse as above.
    pub fn forward<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.forward_with(None, f)
    }

    /// [`Fsdp::forward`] whose saved-tensor hook hands every tensor that is not a
    /// unit's gathered weight to `others` (offload or compression hooks, say) instead of
    /// keeping it as it is: nested saved-tensor hooks do not chain (the innermost
    /// handles every save), so hooks entered around `forward` would see nothing, and
    /// hooks entered inside it would see the weights first and keep them. `records_ops`
    /// is `others`' own; an `others` error fails the save or the backward as it would
    /// on its own.
    pub fn forward_with<T>(
        &self,
        others: Option<Arc<dyn RawHooks>>,
        f: impl FnOnce() -> T,
    ) -> Result<T> {
        // A forward with grad before this one but outside it (a validation loss) held
        // its units' weights in its own graph, not in this step's: allowed.
        {
            let mut state = self.state();
            state.held_after_forward.clear();
            state.unstage_pieces()?;
        }
        let hooks = Arc::new(GatheredSaves {
            shared: Arc::clone(&self.shared),
            others,
        });
        let frame = memsave_sys::hooks::push(hooks)?;
        let out = f();
        frame.exit()?;
        Ok(out)
    }

    /// Ends a step's backward(s): reduce-scatters the gradients of units some of whose
    /// parameters got no gradient here (zeros for those; a parameter no rank used keeps
    /// no gradient in its shard), frees any gathered weights, and
    /// refuses when a unit's weights could not be freed after its forward (see
    /// [`Fsdp::forward`]). A collective; call it after the last backward of a step,
    /// before the optimizer step.
    pub fn f_finish_backward(&self) -> Result<()> {
        let mut state = self.state();
        state.drop_prefetch()?;
        state.accumulating = false;
        for unit in 0..state.units.len() {
            let stored = state.files.as_ref().is_some_and(|f| f.has_gradient(unit));
            if state.units[unit].owed || stored {
                state.reduce(unit)?;
            }
        }
        for unit in 0..state.units.len() {
            state.free(unit)?;
            state.units[unit].needs_weights = false;
        }
        if let Some(files) = state.files.as_mut() {
            files.commit()?;
        }
        if !state.held_after_forward.is_empty() {
            let held = std::mem::take(&mut state.held_after_forward);
            return Err(DistError::Config {
                rank: self.group.rank(),
                reason: format!(
                    "units {held:?}: their gathered weights were still held after their forward (saved for backward by autograd or kept by a hook), so reshard_after_forward could not free them; run the forward inside Fsdp::forward, or turn reshard_after_forward off"
                ),
            });
        }
        Ok(())
    }

    /// The optimizer step in backward (ZeRO-3's counterpart of memsave-optim's
    /// `step_in_backward`): from now on, each parameter shard is stepped (the
    /// optimizer's `f_step_param`) as soon as its unit's gradients are reduce-scattered
    /// into it (not when no rank used its parameter), and its gradient is then dropped;
    /// so a rank never holds more than one unit's shard gradients, and no step follows
    /// backward. Returns the optimizer, shared with the
    /// hook: read its state or step counts through the mutex; do not call its `f_step`.
    ///
    /// `optimizer` must hold exactly [`Fsdp::parameters`], in that order (an `Err`
    /// otherwise, before anything changes). Traps: every backward steps, so this does
    /// not combine with gradient accumulation over micro-batches (except with shards in
    /// files, whose sums wait in files: [`Fsdp::set_accumulate`]); global gradient-norm
    /// clipping is not applied (as with `f_step_param`); units whose reduction waits
    /// for [`Fsdp::f_finish_backward`] (some parameter got no gradient) step there. An
    /// optimizer error fails the backward, naming this rank. Registering again replaces
    /// the previous optimizer.
    pub fn step_in_backward<R: Rule>(
        &self,
        optimizer: Optimizer<R>,
    ) -> Result<Arc<Mutex<Optimizer<R>>>> {
        let rank = self.group.rank();
        let shards = self.parameters();
        let params = optimizer.params();
        let same = params.len() == shards.len()
            && params
                .iter()
                .zip(&shards)
                .all(|(p, s)| p.data_ptr() == s.data_ptr() && p.numel() == s.numel());
        if !same {
            return Err(DistError::Config {
                rank,
                reason: format!(
                    "step_in_backward: the optimizer holds {} parameters that are not this Fsdp's {} parameter shards in order; build it over Fsdp::parameters()",
                    params.len(),
                    shards.len()
                ),
            });
        }
        self.state().unstage_pieces()?;
        let optimizer = Arc::new(Mutex::new(optimizer));
        let stepped = Arc::clone(&optimizer);
        self.state().step = Some(Box::new(move |index| {
            let mut opt = stepped.lock().unwrap_or_else(|e| e.into_inner());
            opt.f_step_param(index)
                .map(|_| ())
                .map_err(|source| DistError::Optim { rank, source })
        }));
        Ok(optimizer)
    }

    /// With shards in files, accumulation over micro-batches with the step in backward:
    /// while `on`, each unit's reduced gradients are added to a gradient file of its
    /// own (the sum of the micro-batches so far, checked like the shards) instead of
    /// stepping it, so that the device holds one unit's gradients at a time; turn it
    /// off before the last micro-batch's backward, whose gradients are added to the
    /// sum (the stored sum plus the new ones, the order autograd accumulates `.grad`
    /// in, so the step is bitwise the one after accumulating in memory) and step each
    /// unit. [`Fsdp::f_finish_backward`] turns it off and steps the units whose sum the
    /// last backward did not reach. Without shards in files it changes nothing (the
    /// shards' `.grad` accumulate, and the optimizer steps after backward).
    ///
    /// Call it before each micro-batch's backward: a unit left partly reduced by the
    /// micro-batch before (a parameter it did not use) is added to its file then, so
    /// that the sums run in autograd's order ((q1 + q2) + q3). An `Err` (a file that
    /// cannot be read or written) fails the step.
    pub fn set_accumulate(&self, on: bool) -> Result<()> {
        let mut state = self.state();
        if state.files.is_none() {
            return Ok(());
        }
        if state.accumulating {
            for unit in 0..state.units.len() {
                if state.units[unit].owed {
                    state.reduce(unit)?;
                }
            }
        }
        state.accumulating = on;
        Ok(())
    }

    /// Forgets what a step that failed half way left behind, before the next one: the
    /// units' gradients (in memory and, with shards in files, the sums waiting in
    /// files), what backward had reduced, any gathered weights, and accumulation (off).
    /// Nothing of a finished step is touched: its weights, its optimizer state. The
    /// step engine (`memsave-step`) calls it at the start of every step. Communicates
    /// nothing.
    pub fn f_discard_unfinished_step(&self) -> Result<()> {
        let mut state = self.state();
        state.drop_gradients_and_weights()?;
        state.forward_unit = None;
        Ok(())
    }

    /// Every unit's full parameters, in the order they were given to
    /// [`Fsdp::fully_shard`], as new tensors (copies, without grad). A collective: one
    /// all-gather per unit not gathered now.
    pub fn f_full_parameters(&self) -> Result<Vec<Tensor>> {
        let mut state = self.state();
        state.settle_prefetch()?;
        let rank = self.group.rank();
        let err = tensor_err(rank, "gathering the full parameters");
        let _no_grad = tch::no_grad_guard();
        let mut out = Vec::new();
        for (index, unit) in state.units.iter().enumerate() {
            let flat = match &unit.gathered {
                Some(flat) => flat.shallow_clone(),
                None => state.all_gather(index)?,
            };
            let mut offset = 0;
            for p in &unit.params {
                let k = p.numel() as i64;
                out.push(
                    flat.f_narrow(0, offset, k)
                        .and_then(|t| t.f_reshape(p.size()))
                        .and_then(|t| t.f_detach_copy())
                        .map_err(err)?,
                );
                offset += k;
            }
        }
        Ok(out)
    }

    /// Puts every unit's full weights back into its parameters, as copies of their own
    /// (contiguous, the parameters' shapes), so that the module holds the trained
    /// weights: to save it its own way (`VarStore::save`), evaluate it without `Fsdp`,
    /// or keep it after dropping the `Fsdp` (see [`Fsdp`]'s "Dropping it"). A
    /// collective: one all-gather per unit; call it between steps, on every rank.
    ///
    /// Every rank then holds the whole model (4 bytes per value) besides its shards,
    /// until a unit's next forward gathers it again (training goes on from the shards,
    /// so writes to the restored parameters are not seen by it and are lost then; use
    /// [`Fsdp::load_sharded`] to change the weights). Refused (an `Err`, nothing
    /// changed) while a step is under way: a unit's weights are gathered or its
    /// gradients not yet reduced (call [`Fsdp::f_finish_backward`] first).
    pub fn f_restore_full_parameters(&self) -> Result<()> {
        let mut state = self.state();
        let rank = self.group.rank();
        let busy =
            state.prefetch.is_some() || state.units.iter().any(|u| u.gathered.is_some() || u.owed);
        if busy {
            return Err(DistError::Config {
                rank,
                reason: "f_restore_full_parameters: a step is under way (a unit's weights are gathered or its gradients not reduced); call it between steps, after f_finish_backward".to_owned(),
            });
        }
        let err = tensor_err(rank, "restoring the full parameters");
        let _no_grad = tch::no_grad_guard();
        for unit in 0..state.units.len() {
            let flat = state.all_gather(unit)?;
            let mut offset = 0;
            let copies = state.units[unit]
                .params
                .iter()
                .map(|p| {
                    let k = p.numel() as i64;
                    let copy = flat
                        .f_narrow(0, offset, k)
                        .and_then(|t| t.f_reshape(p.size()))
                        .and_then(|t| t.f_detach_copy());
                    offset += k;
                    copy
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(err)?;
            let u = &mut state.units[unit];
            for (p, copy) in u.params.iter().zip(&copies) {
                p.shallow_clone().f_set_data(copy).map_err(err)?;
            }
            u.restored = true;
        }
        Ok(())
    }

    /// Says that the weights of the units not restored may go when this `Fsdp` is
    /// dropped, without the line on stderr that says they are lost: for a caller that
    /// keeps a copy of its own and puts it back (as `fit` does after each run), or
    /// throws the model away (as a benchmark's case does). The parameters still read
    /// NaN afterwards. Communicates nothing.
    pub fn discard(&self) {
        self.state().discarded = true;
    }

    /// What this rank holds and has done (see [`FsdpStats`]).
    pub fn stats(&self) -> FsdpStats {
        let state = self.state();
        let shard_values: i64 = state.units.iter().map(|u| u.shard_len).sum();
        let n = self.group.world_size() as i64;
        let file_bytes = state.files.as_ref().map_or(0, ShardFiles::bytes);
        FsdpStats {
            parameter_bytes: if state.files.is_some() {
                4
            } else {
                4 * shard_values as u64 + 4
            },
            file_bytes,
            padding_values: (shard_values as u64)
                - (state.units.iter().map(|u| u.numel).sum::<i64>() as u64).div_ceil(n as u64),
            gathered_bytes: state.gathered_bytes,
            gathered_peak_bytes: state.gathered_peak_bytes,
            gathers: state.gathers,
            reductions: state.reductions,
        }
    }

    /// The directory of this rank's shard files ([`FsdpConfig::shards_in_files`]),
    /// `None` when the shards are in memory.
    pub fn shard_dir(&self) -> Option<std::path::PathBuf> {
        self.state().files.as_ref().map(|f| f.dir().to_owned())
    }

    /// Starts [`FsdpStats::gathered_peak_bytes`] again from the bytes gathered now.
    pub fn reset_gathered_peak(&self) {
        let mut state = self.state();
        state.gathered_peak_bytes = state.gathered_bytes;
    }
}

impl Shared {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// All-gathers `unit`'s shards into a new flat buffer. With shards in files, this
    /// rank's shard is read from its file first; on one rank it is the buffer.
    fn all_gather(&self, unit: usize) -> Result<Tensor> {
        let err = tensor_err(self.rank(), "gathering a unit");
        let n = self.group.world_size() as i64;
        let u = &self.units[unit];
        let shard = self.shard_values(unit)?;
        if n == 1 && self.files.is_some() {
            return Ok(shard);
        }
        let flat = Tensor::f_empty([u.shard_len * n], (Kind::Float, Device::Cpu)).map_err(err)?;
        self.group.all_gather(&flat, &shard)?;
        Ok(flat)
    }

    /// This rank's shard of `unit` (a copy read from its file with shards in files, the
    /// shard itself otherwise), for sharded checkpoints.
    pub(crate) fn shard_values(&self, unit: usize) -> Result<Tensor> {
        match &self.files {
            Some(files) => files.read(unit),
            None => Ok(self.units[unit].shard.detach()),
        }
    }

    /// Replaces this rank's shard of every unit by `shards` (one per unit, of its
    /// length), between steps; with shards in files, all committed at once.
    pub(crate) fn set_shards(&mut self, shards: &[Tensor]) -> Result<()> {
        let err = tensor_err(self.rank(), "loading a unit's shard");
        let _no_grad = tch::no_grad_guard();
        match self.files.as_mut() {
            Some(files) => files.replace_all(shards),
            None => {
                for (unit, values) in shards.iter().enumerate() {
                    self.units[unit]
                        .shard
                        .shallow_clone()
                        .f_copy_(values)
                        .map_err(err)?;
                }
                Ok(())
            }
        }
    }

    /// Gathers `unit`'s weights and points its parameters at them, unless gathered: from
    /// the prefetch when it is this unit's, else with a blocking all-gather. In
    /// `backward`, then starts the prefetch of the unit backward needs next.
    fn gather(&mut self, unit: usize, backward: bool) -> Result<()> {
        if self.units[unit].gathered.is_none() {
            let flat = match self.prefetch.take() {
                Some(p) if p.unit == unit => {
                    p.work.wait()?;
                    p.flat
                }
                other => {
                    // Backward asked for another unit first (an order the forward did
                    // not predict): the prefetched unit is kept as gathered, until its
                    // reduction or the end of backward.
                    if let Some(p) = other {
                        p.work.wait()?;
                        self.install(p.unit, p.flat)?;
                    }
                    self.allocate_and_gather(unit)?
                }
            };
            self.install(unit, flat)?;
        }
        if backward {
            self.units[unit].needs_weights = false;
            self.start_prefetch(unit)?;
        }
        Ok(())
    }

    /// A new buffer with `unit`'s gathered weights, counted as gathered.
    fn allocate_and_gather(&mut self, unit: usize) -> Result<Tensor> {
        let flat = self.all_gather(unit)?;
        self.count_gathered(&flat);
        Ok(flat)
    }

    fn count_gathered(&mut self, flat: &Tensor) {
        self.gathers += 1;
        self.gathered_bytes += memsave_sys::tensor::nbytes(flat);
        self.gathered_peak_bytes = self.gathered_peak_bytes.max(self.gathered_bytes);
    }

    /// After backward gathered `current`: starts the all-gather of the unit that ran
    /// just before it in the forward, when prefetching is on, none is in flight, and
    /// that unit will be gathered in backward and is not gathered now.
    fn start_prefetch(&mut self, current: usize) -> Result<()> {
        // With shards in files a unit is read when backward needs it: a read ahead would
        // hold a second unit without overlapping anything (the read is synchronous).
        if !(self.config.backward_prefetch && self.config.reshard_after_forward)
            || self.prefetch.is_some()
            || self.files.is_some()
        {
            return Ok(());
        }
        let Some(at) = self.forward_order.iter().position(|&u| u == current) else {
            return Ok(());
        };
        let Some(&next) = at.checked_sub(1).and_then(|i| self.forward_order.get(i)) else {
            return Ok(());
        };
        let u = &self.units[next];
        if !u.needs_weights || u.gathered.is_some() {
            return Ok(());
        }
        let err = tensor_err(self.rank(), "prefetching a unit");
        let n = self.group.world_size() as i64;
        let flat = Tensor::f_empty([u.shard_len * n], (Kind::Float, Device::Cpu)).map_err(err)?;
        let work = self.group.all_gather_async(&flat, &u.shard.detach())?;
        self.count_gathered(&flat);
        self.prefetch = Some(Prefetch {
            unit: next,
            flat,
            work,
        });
        Ok(())
    }

    /// Waits for a prefetch in flight and keeps its weights as its unit's gathered ones.
    fn settle_prefetch(&mut self) -> Result<()> {
        if let Some(p) = self.prefetch.take() {
            p.work.wait()?;
            self.install(p.unit, p.flat)?;
        }
        Ok(())
    }

    /// Waits for a prefetch in flight that backward did not use (its unit's backward
    /// never asked for weights) and frees its buffer; its bytes were sent and count in
    /// [`ProcessGroup::bytes_sent`].
    fn drop_prefetch(&mut self) -> Result<()> {
        if let Some(p) = self.prefetch.take() {
            let bytes = memsave_sys::tensor::nbytes(&p.flat);
            let waited = p.work.wait();
            drop(p.flat);
            self.gathered_bytes -= bytes;
            waited?;
        }
        Ok(())
    }

    /// Points `unit`'s parameters at their slices of `flat` (its gathered weights,
    /// already counted) and keeps it as the unit's gathered buffer.
    fn install(&mut self, unit: usize, flat: Tensor) -> Result<()> {
        let err = tensor_err(self.rank(), "gathering a unit");
        let _no_grad = tch::no_grad_guard();
        let mut offset = 0;
        for p in &self.units[unit].params {
            let k = p.numel() as i64;
            let view = flat
                .f_narrow(0, offset, k)
                .and_then(|t| t.f_view(p.size().as_slice()))
                .map_err(err)?;
            p.shallow_clone().f_set_data(&view).map_err(err)?;
            offset += k;
        }
        self.units[unit].restored = false;
        self.units[unit].gathered = Some(flat);
        Ok(())
    }

    /// Points `unit`'s parameters at the placeholder and drops its gathered buffer.
    fn free(&mut self, unit: usize) -> Result<()> {
        let err = tensor_err(self.rank(), "freeing a unit's weights");
        for p in &self.units[unit].params {
            let nans = nan_view(&self.placeholder, &p.size()).map_err(err)?;
            p.shallow_clone().f_set_data(&nans).map_err(err)?;
        }
        self.units[unit].restored = false;
        if let Some(flat) = self.units[unit].gathered.take() {
            self.gathered_bytes -= memsave_sys::tensor::nbytes(&flat);
        }
        Ok(())
    }

    /// After `unit`'s forward: frees its weights unless backward will want them and
    /// the configuration keeps them (see [`FsdpConfig::reshard_after_forward`]).
    fn after_forward(&mut self, unit: usize, grad: bool, in_backward: bool) -> Result<()> {
        if grad && !in_backward {
            self.forward_unit = None;
            let u = &mut self.units[unit];
            u.needs_weights =
                self.config.reshard_after_forward && (u.saved_slices > 0 || u.packs == 0);
        }
        if grad && (in_backward || !self.config.reshard_after_forward) {
            return Ok(());
        }
        let flat = self.units[unit]
            .gathered
            .as_ref()
            .map(Tensor::shallow_clone);
        self.free(unit)?;
        if let Some(flat) = flat {
            // `flat` here and nothing else: the buffer goes with it.
            if grad
                && memsave_sys::tensor::storage_use_count(&flat)? > 1
                && !self.held_after_forward.contains(&unit)
            {
                self.held_after_forward.push(unit);
            }
        }
        Ok(())
    }

    /// The post-accumulate-grad hook of `unit`'s parameter `index`: reduces the unit
    /// once every parameter has its gradient.
    fn mark_ready(&mut self, unit: usize, index: usize) -> Result<()> {
        let u = &mut self.units[unit];
        u.ready[index] = true;
        u.owed = true;
        if u.ready.iter().all(|&r| r) {
            self.reduce(unit)?;
        }
        Ok(())
    }

    /// Reduce-scatters `unit`'s gradients (zeros where a parameter has none) into its
    /// parameter shards' `.grad` (averaged over the ranks, added to what is there), and
    /// frees the full gradients and weights. Each rank's chunk carries one flag per
    /// parameter after its values, 1 where this rank has a gradient, so that the sum
    /// says which parameters some rank used: a shard whose parameter no rank used keeps
    /// no gradient (or the one an earlier micro-batch gave it), and the optimizer skips
    /// it.
    fn reduce(&mut self, unit: usize) -> Result<()> {
        let rank = self.rank();
        let err = tensor_err(rank, "reducing a unit's gradients");
        let n = self.group.world_size() as i64;
        let _no_grad = tch::no_grad_guard();
        let first = self.units[..unit]
            .iter()
            .map(|u| u.pieces.len())
            .sum::<usize>();
        let mut stepped = Vec::new();
        if self.files.is_some() {
            // The gradients are computed: the weights can go before the gradients are
            // gathered into one buffer (a unit's bytes fewer at this moment).
            self.free(unit)?;
        }
        let (grads, used) = {
            let u = &self.units[unit];
            let (len, flags) = (u.shard_len, u.params.len() as i64);
            let chunk = len + flags;
            let flat = Tensor::f_zeros([chunk * n], (Kind::Float, Device::Cpu)).map_err(err)?;
            let mut offset = 0;
            for (index, p) in u.params.iter().enumerate() {
                let k = p.numel() as i64;
                let g = p.grad();
                if g.defined() {
                    let g = g.f_reshape([-1]).map_err(err)?;
                    // The gradient's values, chunk by chunk.
                    let mut at = offset;
                    while at < offset + k {
                        let c = at / len;
                        let upto = (offset + k).min((c + 1) * len);
                        flat.f_narrow(0, c * chunk + at - c * len, upto - at)
                            .and_then(|mut dst| {
                                dst.f_copy_(&g.f_narrow(0, at - offset, upto - at)?)
                            })
                            .map_err(err)?;
                        at = upto;
                    }
                    for c in 0..n {
                        let _ = flat
                            .f_narrow(0, c * chunk + len + index as i64, 1)
                            .and_then(|mut f| f.f_fill_(1.0))
                            .map_err(err)?;
                    }
                    memsave_sys::tensor::set_grad_none(p)?;
                }
                offset += k;
            }
            let mine = if n == 1 && self.files.is_some() {
                // One rank's sum is its own chunk: no collective, no second buffer.
                flat
            } else {
                let mine = Tensor::f_empty([chunk], (Kind::Float, Device::Cpu)).map_err(err)?;
                self.group.reduce_scatter(&mine, &flat)?;
                mine
            };
            let used = mine
                .f_narrow(0, len, flags)
                .and_then(|f| Vec::<f32>::try_from(&f))
                .map_err(err)?;
            // The averaged values, in a tensor of their own (without the flags): what
            // the shards' gradients are views of.
            let grads = if u.pieces.iter().any(|p| used[p.param] != 0.0) {
                // On one rank with shards in files the sum is the average: a view,
                // not a copy.
                let grads = if n == 1 && self.files.is_some() {
                    mine.f_narrow(0, 0, len)
                } else {
                    mine.f_narrow(0, 0, len)
                        .and_then(|g| g.f_div_scalar(n as f64))
                }
                .map_err(err)?;
                Some(grads)
            } else {
                None
            };
            drop(mine);
            (grads, used)
        };
        let (grads, used) = match self.files.as_mut() {
            // With shards in files, a micro-batch before the last adds its gradients
            // to the unit's gradient file; the last one takes the sum back.
            Some(files) if self.accumulating => {
                if let Some(g) = grads {
                    // The micro-batches' sum so far plus these: per parameter, the sum
                    // where both have a gradient (the stored one first, as autograd
                    // adds into `.grad`), else the one that has.
                    let (sum, flags) = match files.take_gradient(unit)? {
                        Some((stored, stored_used)) => {
                            combine(&self.units[unit], stored, &stored_used, Some(g), &used)
                                .map_err(err)?
                        }
                        None => (g, used.clone()),
                    };
                    files.put_gradient(unit, &sum, flags)?;
                }
                (None, used)
            }
            Some(files) => match files.take_gradient(unit)? {
                Some((stored, stored_used)) => {
                    let (sum, flags) =
                        combine(&self.units[unit], stored, &stored_used, grads, &used)
                            .map_err(err)?;
                    (Some(sum), flags)
                }
                None => (grads, used),
            },
            None => (grads, used),
        };
        if let Some(grads) = grads {
            let u = &self.units[unit];
            for (k, piece) in u.pieces.iter().enumerate() {
                if used[piece.param] == 0.0 {
                    continue;
                }
                let src = grads.f_narrow(0, piece.at, piece.len).map_err(err)?;
                let g = piece.view.grad();
                if g.defined() {
                    let mut g = g;
                    let _ = g.f_add_(&src).map_err(err)?;
                } else {
                    memsave_sys::tensor::set_grad(&piece.view, &src)?;
                }
                stepped.push(first + k);
            }
        }
        let u = &mut self.units[unit];
        u.ready.iter_mut().for_each(|r| *r = false);
        u.owed = false;
        self.reductions += 1;
        if self.files.is_none() {
            // (With shards in files, freed before the gradients were gathered.)
            self.free(unit)?;
        }
        if self.step.is_some() {
            // With shards in files the pieces get this unit's values for the step, and
            // the stepped values go to the unit's file for this step.
            let loaded = match (&self.files, stepped.is_empty()) {
                (Some(_), false) => Some(self.load_pieces(unit)?),
                _ => None,
            };
            let mut stepping = Ok(());
            if let Some(step) = self.step.as_mut() {
                for &index in &stepped {
                    stepping = step(index);
                    if stepping.is_err() {
                        break;
                    }
                }
            }
            if let Some(shard) = loaded {
                // Written even after an optimizer error: the parameters it stepped
                // keep their new values, as their state keeps its (as in memory).
                let written = match self.files.as_mut() {
                    Some(files) => files.write_pending(unit, &shard),
                    None => Ok(()),
                };
                let unloaded = self.unload_pieces(unit);
                stepping.and(written).and(unloaded)?;
            } else {
                stepping?;
            }
            for piece in &self.units[unit].pieces {
                memsave_sys::tensor::set_grad_none(&piece.view)?;
            }
        }
        Ok(())
    }

    /// With shards in files: reads `unit`'s shard and points its pieces (the
    /// optimizer's tensors) at their parts of it, which it returns.
    fn load_pieces(&self, unit: usize) -> Result<Tensor> {
        let err = tensor_err(self.rank(), "reading a unit's shard for its step");
        let shard = self.shard_values(unit)?;
        let _no_grad = tch::no_grad_guard();
        let pointed = self.units[unit].pieces.iter().try_for_each(|piece| {
            let part = shard.f_narrow(0, piece.at, piece.len)?;
            piece.view.shallow_clone().f_set_data(&part)
        });
        if let Err(e) = pointed {
            // None of them keeps pointing at the shard.
            let _ = self.unload_pieces(unit);
            return Err(err(e));
        }
        Ok(shard)
    }

    /// With shards in files: points every piece at its own slice of one new NaN buffer
    /// (see [`Fsdp::parameters`]), unless done already.
    fn stage_pieces(&mut self) -> Result<()> {
        if self.staging.is_some() {
            return Ok(());
        }
        let err = tensor_err(self.rank(), "staging the parameter shards");
        let pieces = self.units.iter().flat_map(|u| &u.pieces);
        let longest = pieces.clone().map(|p| p.len).max().unwrap_or(0);
        let count = pieces.clone().count() as i64;
        let staging =
            Tensor::f_full([longest + count], f64::NAN, (Kind::Float, Device::Cpu)).map_err(err)?;
        let _no_grad = tch::no_grad_guard();
        for (k, piece) in pieces.enumerate() {
            let part = staging.f_narrow(0, k as i64, piece.len).map_err(err)?;
            piece.view.shallow_clone().f_set_data(&part).map_err(err)?;
        }
        self.staging = Some(staging);
        Ok(())
    }

    /// Points the pieces back at NaN views and frees [`Shared::stage_pieces`]' buffer.
    fn unstage_pieces(&mut self) -> Result<()> {
        self.unstaged = true;
        if self.staging.is_none() {
            return Ok(());
        }
        for unit in 0..self.units.len() {
            self.unload_pieces(unit)?;
        }
        self.staging = None;
        Ok(())
    }

    /// With shards in files: points `unit`'s pieces back at NaN.
    fn unload_pieces(&self, unit: usize) -> Result<()> {
        let err = tensor_err(self.rank(), "freeing a unit's shard after its step");
        let _no_grad = tch::no_grad_guard();
        for piece in &self.units[unit].pieces {
            let nans = nan_view(&self.placeholder, &[piece.len]).map_err(err)?;
            piece.view.shallow_clone().f_set_data(&nans).map_err(err)?;
        }
        Ok(())
    }

    /// Drops every parameter's and shard's gradient and every gathered weight, and
    /// forgets the current backward's progress (before loading a checkpoint).
    pub(crate) fn drop_gradients_and_weights(&mut self) -> Result<()> {
        self.drop_prefetch()?;
        self.accumulating = false;
        if let Some(files) = self.files.as_mut() {
            files.drop_gradients();
        }
        for unit in 0..self.units.len() {
            let u = &mut self.units[unit];
            for p in &u.params {
                memsave_sys::tensor::set_grad_none(p)?;
            }
            for piece in &u.pieces {
                memsave_sys::tensor::set_grad_none(&piece.view)?;
            }
            u.ready.iter_mut().for_each(|r| *r = false);
            u.owed = false;
            u.needs_weights = false;
            self.free(unit)?;
        }
        self.held_after_forward.clear();
        Ok(())
    }

    /// Before `unit`'s forward with grad outside backward: its saves are counted from
    /// zero, and it moves to the end of the forward order.
    fn begin_forward(&mut self, unit: usize) {
        self.forward_unit = Some(unit);
        let u = &mut self.units[unit];
        u.packs = 0;
        u.saved_slices = 0;
        self.forward_order.retain(|&v| v != unit);
        self.forward_order.push(unit);
    }

    /// The unit whose gathered buffer holds the memory at `ptr`, and the value offset.
    fn locate(&self, ptr: usize) -> Option<(usize, i64)> {
        self.units.iter().enumerate().find_map(|(index, u)| {
            let flat = u.gathered.as_ref()?;
            let base = flat.data_ptr() as usize;
            let end = base + memsave_sys::tensor::nbytes(flat) as usize;
            (base..end)
                .contains(&ptr)
                .then(|| (index, ((ptr - base) / 4) as i64))
        })
    }
}

impl Drop for Fsdp {
    /// Communicates nothing (see [`Fsdp`]'s "Dropping it"): the units are closed, and
    /// those not restored are freed, their parameters reading NaN, which a line on
    /// stderr says (unless a panic is unwinding).
    fn drop(&mut self) {
        let mut state = lock(&self.shared);
        state.closed = true;
        let mut lost = 0;
        for unit in 0..state.units.len() {
            if !state.units[unit].restored {
                lost += 1;
                // An error here (out of memory for a view) leaves the parameter as it
                // was; a destructor has no one to tell.
                let _ = state.free(unit);
            }
        }
        // Not silent: the trained weights of these units are gone from this process.
        // (While unwinding, the panic is the news.)
        let kept = state
            .files
            .as_ref()
            .filter(|f| !f.is_temporary())
            .map(|f| f.dir().display().to_string());
        let quiet = state.discarded || std::thread::panicking();
        if let (Some(dir), true) = (kept, lost > 0 && !quiet) {
            let load = if self.group.world_size() == 1 {
                " (Fsdp::read_parameter_files)"
            } else {
                ", this rank's slice of them"
            };
            eprintln!(
                "memsave: rank {}: an Fsdp was dropped without f_restore_full_parameters: {lost} of {} units' parameters read NaN; the weights of its last finished step stay in {dir}'s files{load}",
                self.group.rank(),
                state.units.len()
            );
        } else if lost > 0 && !quiet {
            eprintln!(
                "memsave: rank {}: an Fsdp was dropped without f_restore_full_parameters (Trainer::restore_full_parameters): {lost} of {} units' weights are lost and their parameters read NaN; restore them before dropping to keep the trained weights",
                self.group.rank(),
                state.units.len()
            );
        }
    }
}

impl FsdpUnit {
    /// The unit's index in its [`Fsdp`].
    pub fn index(&self) -> usize {
        self.unit
    }

    /// Gathers the unit's weights, runs the module, and frees them (see [`Fsdp`]); a
    /// failed collective is an `Err`.
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        unit_forward(&self.shared, self.unit, || self.module.forward_t(x, train))
    }
}

/// Runs `forward` as `unit`'s: gathers its weights, runs it, and frees them (see
/// [`Fsdp`]'s forward and backward).
fn unit_forward<T>(shared: &Mutex<Shared>, unit: usize, forward: impl FnOnce() -> T) -> Result<T> {
    let grad = memsave_sys::tensor::grad_mode_enabled();
    let in_backward = memsave_sys::hooks::current_autograd_node_name()?.is_some();
    {
        let mut state = lock(shared);
        if state.closed {
            if state.units[unit].restored {
                drop(state);
                return Ok(forward());
            }
            return Err(DistError::Config {
                rank: state.rank(),
                reason: format!(
                    "unit {unit}: its Fsdp was dropped without f_restore_full_parameters, so its weights are lost (each rank kept only its shard); restore them before dropping the Fsdp"
                ),
            });
        }
        if grad && !in_backward {
            state.begin_forward(unit);
        }
        state.gather(unit, in_backward)?;
    }
    // The lock is not held while the module runs: the saved-tensor hook takes it.
    let y = forward();
    lock(shared).after_forward(unit, grad, in_backward)?;
    Ok(y)
}

/// Runs the forward of a unit sharded with [`Fsdp::fully_shard_parameters`] where its
/// module is called: [`FsdpUnits::f_forward`] does what an [`FsdpUnit`]'s forward
/// does around a module it does not own. Cheap to clone; `Send` and `Sync`.
#[derive(Clone)]
pub struct FsdpUnits {
    shared: Arc<Mutex<Shared>>,
}

impl fmt::Debug for FsdpUnits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsdpUnits")
            .field("units", &lock(&self.shared).units.len())
            .finish()
    }
}

impl FsdpUnits {
    /// Gathers `unit`'s weights, runs `forward` (the unit's module, called with its
    /// input), and frees them as [`FsdpConfig::reshard_after_forward`] says; in
    /// backward (a checkpoint's recomputation) they stay until the unit's gradients
    /// are reduced. A failed collective, or a unit this `Fsdp` does not have, is an
    /// `Err` (then `forward` did not run). Trap: every parameter `forward` uses must be
    /// in `unit`, as with [`Fsdp::fully_shard`].
    pub fn f_forward<T>(&self, unit: usize, forward: impl FnOnce() -> T) -> Result<T> {
        let units = lock(&self.shared).units.len();
        if unit >= units {
            return Err(DistError::Config {
                rank: lock(&self.shared).rank(),
                reason: format!("unit {unit}: this Fsdp has {units} units"),
            });
        }
        unit_forward(&self.shared, unit, forward)
    }
}

impl ModuleT for FsdpUnit {
    /// # Panics
    /// When a collective fails; use [`FsdpUnit::f_forward_t`] for a `Result`.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// What the saved-tensor hook of [`Fsdp::forward`] keeps for a tensor that lies in a
/// unit's gathered weights.
#[derive(Debug)]
struct GatheredSlice {
    unit: usize,
    offset: i64,
    size: Vec<i64>,
    stride: Vec<i64>,
}

/// Saved-tensor hooks that keep the gathered weights' place instead of the weights,
/// and hand the other tensors to `others` when there are any.
struct GatheredSaves {
    shared: Arc<Mutex<Shared>>,
    others: Option<Arc<dyn RawHooks>>,
}

/// What `others` of [`GatheredSaves`] packed.
struct Delegated(Packed);

impl RawHooks for GatheredSaves {
    fn pack(
        &self,
        tensor: &Tensor,
        saved_by: Option<&str>,
    ) -> std::result::Result<Packed, CallbackError> {
        {
            let mut state = lock(&self.shared);
            if let Some(unit) = state.forward_unit {
                state.units[unit].packs += 1;
            }
        }
        if tensor.device() == Device::Cpu && tensor.numel() > 0 {
            let mut state = lock(&self.shared);
            let ptr = tensor.data_ptr() as usize;
            if ptr == state.placeholder.data_ptr() as usize {
                return Err(DistError::Config {
                    rank: state.rank(),
                    reason: "a fully sharded parameter is used outside its unit's forward (tied weights across units?); use each parameter in one unit".to_owned(),
                }
                .into());
            }
            if tensor.kind() == Kind::Float {
                if let Some((unit, offset)) = state.locate(ptr) {
                    if let Some(current) = state.forward_unit {
                        state.units[current].saved_slices += 1;
                    }
                    return Ok(Box::new(GatheredSlice {
                        unit,
                        offset,
                        size: tensor.size(),
                        stride: tensor.stride(),
                    }));
                }
            }
        }
        match &self.others {
            Some(others) => Ok(Box::new(Delegated(others.pack(tensor, saved_by)?))),
            None => Ok(Box::new(tensor.shallow_clone())),
        }
    }

    fn records_ops(&self) -> bool {
        self.others.as_ref().is_some_and(|o| o.records_ops())
    }

    fn unpack(&self, packed: &Packed) -> std::result::Result<Tensor, CallbackError> {
        if let Some(slice) = packed.downcast_ref::<GatheredSlice>() {
            let mut state = lock(&self.shared);
            state.gather(slice.unit, true)?;
            let flat = state.units[slice.unit]
                .gathered
                .as_ref()
                .expect("just gathered");
            return Ok(flat.f_as_strided(
                slice.size.as_slice(),
                slice.stride.as_slice(),
                slice.offset,
            )?);
        }
        if let (Some(Delegated(inner)), Some(others)) =
            (packed.downcast_ref::<Delegated>(), &self.others)
        {
            return others.unpack(inner);
        }
        match packed.downcast_ref::<Tensor>() {
            Some(t) => Ok(t.shallow_clone()),
            None => Err("fsdp: a saved tensor of an unknown kind".into()),
        }
    }
}
