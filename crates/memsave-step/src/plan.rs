//! Setting a configuration's checkpoint plan on a workload, profiling the workload's
//! layers first when the plan is a byte budget.
use crate::config::{PlanChoice, SavedTensors, StepConfig};
use crate::error::StepError;
use crate::levers::{CompressDtype, OffloadSpec};
use crate::workload::{Batch, Workload};
use memsave_checkpoint::{
    BlockKey, BlockLever, Blocks, BlocksProfile, BoundaryStore, ChainProfile,
    CheckpointedSequential, Plan, ProfileOptions,
};
use memsave_hooks::{Compress, DiskOffload};
use memsave_sys::hooks::RawHooks;
use std::cell::RefCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use tch::Device;

/// Profiles `model`'s layers on `example` (per-layer bytes and times, the workload's
/// loss as the chain's last element) and keeps the profile in the layers, as
/// [`CheckpointedSequential::profile`] does. Parameter gradients are set to none. An
/// error of the workload's loss is returned as it is.
pub fn f_profile(model: &mut dyn Workload, example: &Batch) -> Result<ChainProfile, StepError> {
    /// Unwinds out of the profiler when the loss failed (its error kept aside).
    struct LossFailed;
    let params = model.parameters();
    let loss_error = RefCell::new(None);
    // The loss borrows the workload while its layers are profiled: take the layers out
    // for the time being, and put them back whatever happens (also on a panic).
    let mut layers = std::mem::replace(model.layers_mut(), CheckpointedSequential::new());
    let target = example.target.as_ref();
    let outcome = {
        let model: &dyn Workload = &*model;
        panic::catch_unwind(AssertUnwindSafe(|| {
            layers
                .profile(&example.input, &params, |y| match model.loss(y, target) {
                    Ok(loss) => loss,
                    Err(e) => {
                        *loss_error.borrow_mut() = Some(e);
                        // Not a panic: no hook prints it; caught right below.
                        panic::resume_unwind(Box::new(LossFailed))
                    }
                })
                .cloned()
                .map_err(|e| StepError::lever("checkpoint", e))
        }))
    };
    *model.layers_mut() = layers;
    // The profiler may catch the unwind itself and report a panicking layer: the
    // loss's own error says more.
    if let Some(e) = loss_error.borrow_mut().take() {
        return Err(e.into());
    }
    match outcome {
        Ok(result) => result,
        Err(payload) => panic::resume_unwind(payload),
    }
}

/// Profiles the blocks of a workload of blocks ([`Workload::blocks`]) on `example`
/// ([`Blocks::profile`](memsave_checkpoint::Blocks::profile): one step with every
/// block kept, one with every block recomputed, the workload's loss included); the
/// parameters' gradients are set to none, running statistics and levers left as they
/// were.
///
/// # Errors
/// [`StepError::InvalidConfig`] for a chain, unless it is under `Plan::PerLayer` (its
/// layers are then the blocks `layer i`, see [`planned_blocks`]); the step's error.
pub fn f_profile_blocks(model: &dyn Workload, example: &Batch) -> Result<BlocksProfile, StepError> {
    blocks_of(model)?
        .profile(&model.parameters(), step_of(model, example))
        .map_err(|e| StepError::lever("checkpoint", e))
}

/// [`f_profile_blocks`] with a third step whose blocks offload what they save to files
/// ([`disk_block_lever`]), for `BlocksProfile::solve_levers`; with `free_gradients`,
/// each parameter's gradient is freed as soon as backward completes it (the profile of
/// a step whose gradients go to files or into the optimizer step in backward: see
/// `Blocks::profile_with`).
///
/// # Errors
/// As [`f_profile_blocks`].
pub fn f_profile_blocks_with_offload(
    model: &dyn Workload,
    example: &Batch,
    free_gradients: bool,
) -> Result<BlocksProfile, StepError> {
    let options = ProfileOptions::default()
        .with_offload(disk_block_lever())
        .with_free_gradients(free_gradients);
    f_profile_blocks_with(model, example, &options)
}

/// [`f_profile_blocks`] as `options` say (`Blocks::profile_with`): with a step whose
/// blocks offload ([`disk_block_lever`]) or compress ([`compress_block_lever`]) what
/// they save, with the gradients freed as they are complete.
///
/// # Errors
/// As [`f_profile_blocks`].
pub fn f_profile_blocks_with(
    model: &dyn Workload,
    example: &Batch,
    options: &ProfileOptions,
) -> Result<BlocksProfile, StepError> {
    blocks_of(model)?
        .profile_with(&model.parameters(), options, step_of(model, example))
        .map_err(|e| StepError::lever("checkpoint", e))
}

/// The blocks of a workload of blocks, or of a chain under
/// [`Plan::PerLayer`]; [`StepError::InvalidConfig`] for a chain under another plan.
fn blocks_of(model: &dyn Workload) -> Result<&Blocks, StepError> {
    planned_blocks(model).ok_or_else(|| {
        StepError::InvalidConfig(format!(
            "'{}' is a chain of layers under plan {}: profile its layers, or set Plan::PerLayer to profile each layer as a block",
            model.name(),
            model.layers().plan()
        ))
    })
}

/// The blocks whose levers decide what `model`'s step keeps: a model of blocks'
/// own ([`Workload::blocks`]), or for a chain under [`Plan::PerLayer`] its layers'
/// ([`CheckpointedSequential::blocks`], layer `i` the block `layer i`). `None` for a
/// chain under a schedule (its checkpoints are blocks too, but the schedule sets
/// their levers).
pub fn planned_blocks(model: &dyn Workload) -> Option<&Blocks> {
    model.blocks().or_else(|| {
        let layers = model.layers();
        (layers.plan() == Plan::PerLayer).then(|| layers.blocks())
    })
}

/// Sets exactly `levers` on `model`'s blocks ([`Blocks::set_levers`]: every other
/// block kept): a model of blocks' own, or a chain's layers, which go under
/// [`Plan::PerLayer`] (their keys are `layer i`, call 0). What `fit`'s per-block
/// choice ([`memsave_fit::Choice::block_levers`]) means on any model.
///
/// # Errors
/// [`StepError::InvalidConfig`] naming a key no block of the last forward has (a model
/// of blocks). A chain's blocks are new under `Plan::PerLayer`: a key no layer has
/// (`layer 9` of six) is refused by its next forward, naming it.
///
/// [`memsave_fit::Choice::block_levers`]: https://docs.rs/memsave-fit
pub fn set_block_levers(
    model: &mut dyn Workload,
    levers: Vec<(BlockKey, BlockLever)>,
) -> Result<(), StepError> {
    if model.blocks().is_none() {
        model
            .layers_mut()
            .set_plan(Plan::PerLayer)
            .map_err(|e| StepError::lever("checkpoint", e))?;
    }
    let blocks = planned_blocks(model).expect("a model of blocks, or a chain under PerLayer");
    blocks
        .set_levers(levers)
        .map_err(|e| StepError::InvalidConfig(e.to_string()))
}

/// The lever each block of `model`'s last forward ran under, by key (see
/// [`planned_blocks`]); `None` when the model has no such blocks. With
/// [`set_block_levers`], what puts a step's levers back as they were.
pub fn block_levers(model: &dyn Workload) -> Option<Vec<(BlockKey, BlockLever)>> {
    let blocks = planned_blocks(model)?;
    Some(
        blocks
            .keys()
            .into_iter()
            .map(|key| {
                let lever = blocks.lever(&key);
                (key, lever)
            })
            .collect(),
    )
}

/// One profiled step of `model` on `example`: its forward (which runs the blocks) and
/// its loss.
fn step_of<'a>(
    model: &'a dyn Workload,
    example: &'a Batch,
) -> impl FnMut() -> Result<tch::Tensor, StepError> + 'a {
    move || {
        let y = model
            .layers()
            .f_forward_t(&example.input, true)
            .map_err(|e| StepError::lever("checkpoint", e))?;
        Ok(model.loss(&y, example.target.as_ref())?)
    }
}

/// Sets `config`'s checkpoint plan on `model`; a budget is solved over a profile of
/// the model on the step's (first micro-batch's) examples of `x`, under the
/// configuration's autocast.
pub fn apply_plan(
    model: &mut dyn Workload,
    x: &Batch,
    config: &StepConfig,
    device: Device,
) -> Result<(), StepError> {
    if apply_block_plan(model, config)? {
        return model
            .layers_mut()
            .set_plan(Plan::None)
            .map_err(|e| StepError::lever("checkpoint", e));
    }
    let (levers, budget) = match config.plan {
        PlanChoice::Fixed(_) => (Vec::new(), None),
        PlanChoice::Budget(bytes) => (Vec::new(), Some(bytes)),
        PlanChoice::BudgetWithLevers {
            bytes,
            offload,
            compress,
        } => (lever_stores(offload, compress)?, Some(bytes)),
    };
    if !levers.is_empty() || model.layers().has_levers() {
        model.layers_mut().set_levers(levers);
    }
    let plan = match (config.plan, budget) {
        (PlanChoice::Fixed(plan), _) => plan,
        (_, Some(bytes)) => {
            let example = match config.micro_batches {
                Some(count) => {
                    let first = memsave_accum::f_split(x.len(), memsave_accum::Split::Count(count))
                        .map_err(|e| StepError::lever("accumulation", e))?[0];
                    x.f_narrow(first.start, first.len)?
                }
                None => x.shallow_clone(),
            };
            let _autocast = config
                .autocast
                .map(|kind| memsave_amp::AutocastGuard::new(device, kind))
                .transpose()
                .map_err(|e| StepError::lever("autocast", e))?;
            f_profile(model, &example)?;
            Plan::Budget(bytes)
        }
        (_, None) => unreachable!("every budget choice has a budget"),
    };
    model
        .layers_mut()
        .set_plan(plan)
        .map_err(|e| StepError::lever("checkpoint", e))
}

/// For a workload of blocks ([`Workload::blocks`]), sets every block's lever from
/// `config`'s plan and returns true: no plan keeps every block, `every_layer`
/// recomputes every block, and with saved tensors offloaded to disk keeps each
/// recomputed block's inputs in files too (in a directory of its own inside the
/// offload's `dir`), as a chain's checkpoint inputs go to the hooks. Returns false for
/// a chain (nothing done).
///
/// # Errors
/// [`StepError::Lever`] for a plan a model of blocks does not take yet (segments,
/// nested, a budget).
pub fn apply_block_plan(model: &dyn Workload, config: &StepConfig) -> Result<bool, StepError> {
    let Some(blocks) = model.blocks() else {
        return Ok(false);
    };
    let lever = match config.plan {
        PlanChoice::Fixed(Plan::None) => BlockLever::Keep,
        // With saved tensors in files, a recomputed block's inputs go to files too (as
        // a chain's checkpoint inputs do, through the hooks): kept in memory, they
        // would make the offload lever do nothing for a model of blocks.
        PlanChoice::Fixed(Plan::EveryLayer) => match &config.saved {
            Some(SavedTensors::Offload(OffloadSpec::Disk { dir, .. })) => {
                BlockLever::RecomputeStoringInputs {
                    store: disk_boundary_store_in(dir.as_ref().map(std::path::PathBuf::from)),
                }
            }
            Some(SavedTensors::OffloadSynchronous) => BlockLever::RecomputeStoringInputs {
                store: disk_boundary_store(),
            },
            _ => BlockLever::Recompute,
        },
        _ => {
            return Err(StepError::lever(
                "checkpoint",
                format!(
                    "'{}' is a model of blocks, not a chain: its checkpoint plan is none or every_layer (one checkpoint per block)",
                    model.name()
                ),
            ))
        }
    };
    blocks.set_every(lever);
    Ok(true)
}

/// A lossless store for checkpoint inputs in files of a temporary directory of its
/// own, made at the first store (a failure to make it fails that store, and so the
/// step, with the reason) and removed when the store is dropped; written
/// synchronously so that a planned peak holds. What `fit` uses for blocks recomputed
/// under its offload lever ([`BlockLever::RecomputeStoringInputs`]).
pub fn disk_boundary_store() -> Arc<dyn BoundaryStore> {
    disk_boundary_store_in(None)
}

/// [`disk_boundary_store`] with its directory made inside `parent` (the system's
/// temporary directory when `None`).
fn disk_boundary_store_in(parent: Option<std::path::PathBuf>) -> Arc<dyn BoundaryStore> {
    Arc::new(LazyDiskStore(parent, std::sync::OnceLock::new()))
}

/// Saved-tensor hooks that write what a block saves to files (memsave-hooks'
/// `DiskOffload`, synchronous, its exact policy: parameters and constants stay), in the
/// system's temporary `memsave-offload` directory made at the first save (a failure to
/// make it fails that save, and so the step, with the reason): what `fit` uses for
/// blocks it offloads ([`BlockLever::Store`]).
pub fn disk_block_lever() -> BlockLever {
    BlockLever::store(
        "offload to disk",
        true,
        Arc::new(LazyDiskHooks(std::sync::OnceLock::new())),
    )
}

/// Saved-tensor hooks that keep what a block saves compressed to `dtype`
/// (memsave-hooks' `Compress` under its lossy policy: parameters, integer tensors and
/// small tensors stay as they are): what `fit` uses for blocks it compresses
/// ([`BlockLever::Store`], lossy: the block's gradients change).
pub fn compress_block_lever(dtype: CompressDtype) -> BlockLever {
    BlockLever::store(
        format!("compress to {}", dtype.as_str()),
        false,
        memsave_hooks::raw_hooks(Compress::new(crate::saved::codec(dtype))),
    )
}

/// Why a store made on first use could not be made, given to every use after.
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
struct FirstUse(Arc<StepError>);

impl FirstUse {
    fn new(e: StepError) -> Self {
        FirstUse(Arc::new(e))
    }
}

/// [`disk_block_lever`]'s hooks: the store made on first use (or why it could not be,
/// given to every save).
struct LazyDiskHooks(std::sync::OnceLock<Result<Arc<dyn RawHooks>, FirstUse>>);

impl LazyDiskHooks {
    fn get(&self) -> Result<&Arc<dyn RawHooks>, memsave_sys::CallbackError> {
        self.0
            .get_or_init(|| {
                let dir = crate::saved::default_dir().map_err(FirstUse::new)?;
                let store = DiskOffload::new(dir)
                    .map_err(|e| FirstUse::new(StepError::lever("offload", e)))?;
                Ok(memsave_hooks::raw_hooks(
                    store.synchronous(true).prefetch(0),
                ))
            })
            .as_ref()
            .map_err(|e| Box::new(e.clone()) as memsave_sys::CallbackError)
    }
}

impl RawHooks for LazyDiskHooks {
    fn pack(
        &self,
        tensor: &tch::Tensor,
        saved_by: Option<&str>,
    ) -> Result<memsave_sys::hooks::Packed, memsave_sys::CallbackError> {
        self.get()?.pack(tensor, saved_by)
    }
    fn unpack(
        &self,
        packed: &memsave_sys::hooks::Packed,
    ) -> Result<tch::Tensor, memsave_sys::CallbackError> {
        self.get()?.unpack(packed)
    }
}

/// [`disk_boundary_store`]'s store: the directory made on first use (or why it could
/// not be, given to every store).
struct LazyDiskStore(
    Option<std::path::PathBuf>,
    std::sync::OnceLock<Result<Arc<dyn BoundaryStore>, FirstUse>>,
);

impl LazyDiskStore {
    fn get(&self) -> Result<&Arc<dyn BoundaryStore>, memsave_checkpoint::StoreError> {
        self.1
            .get_or_init(|| {
                lever_stores_in(true, None, self.0.as_deref())
                    .map_err(FirstUse::new)?
                    .pop()
                    .ok_or_else(|| FirstUse::new(StepError::invalid("no disk store was made")))
            })
            .as_ref()
            .map_err(|e| Box::new(e.clone()) as memsave_checkpoint::StoreError)
    }
}

impl BoundaryStore for LazyDiskStore {
    fn name(&self) -> String {
        "offload to disk".into()
    }
    fn is_lossless(&self) -> bool {
        true
    }
    fn store(
        &self,
        boundary: &tch::Tensor,
    ) -> Result<memsave_checkpoint::Stored, memsave_checkpoint::StoreError> {
        self.get()?.store(boundary)
    }
    fn restore(
        &self,
        stored: &memsave_checkpoint::Stored,
    ) -> Result<tch::Tensor, memsave_checkpoint::StoreError> {
        self.get()?.restore(stored)
    }
    fn resident_bytes(&self, stored: &memsave_checkpoint::Stored) -> Option<u64> {
        self.get().ok()?.resident_bytes(stored)
    }
}

/// The boundary stores of a `checkpoint: {budget, offload, compress}` strategy: disk
/// offload in a temporary directory of its own (removed when the store is dropped),
/// without read-ahead so that the planned peak holds, and the codec.
fn lever_stores(
    offload: bool,
    compress: Option<CompressDtype>,
) -> Result<Vec<Arc<dyn BoundaryStore>>, StepError> {
    lever_stores_in(offload, compress, None)
}

/// [`lever_stores`], the disk store's temporary directory made inside `parent` (the
/// system's temporary directory when `None`).
fn lever_stores_in(
    offload: bool,
    compress: Option<CompressDtype>,
    parent: Option<&std::path::Path>,
) -> Result<Vec<Arc<dyn BoundaryStore>>, StepError> {
    let mut stores: Vec<Arc<dyn BoundaryStore>> = Vec::new();
    if offload {
        let builder = tempfile::Builder::new().prefix("memsave-levers-").clone();
        let made = match parent {
            Some(parent) => builder.tempdir_in(parent),
            None => builder.tempdir(),
        };
        let dir = made.map_err(|source| StepError::Io {
            what: "checkpoint offload: no temporary directory".into(),
            source,
        })?;
        let store = DiskOffload::new(dir.path()).map_err(|e| StepError::lever("offload", e))?;
        stores.push(Arc::new(DirStore {
            store: store.prefetch(0),
            _dir: dir,
        }));
    }
    if let Some(dtype) = compress {
        stores.push(Arc::new(Compress::new(crate::saved::codec(dtype))));
    }
    Ok(stores)
}

/// A disk store that owns its temporary directory.
struct DirStore {
    store: DiskOffload,
    _dir: tempfile::TempDir,
}

impl BoundaryStore for DirStore {
    fn name(&self) -> String {
        self.store.name()
    }
    fn is_lossless(&self) -> bool {
        self.store.is_lossless()
    }
    fn store(
        &self,
        boundary: &tch::Tensor,
    ) -> Result<memsave_checkpoint::Stored, memsave_checkpoint::StoreError> {
        BoundaryStore::store(&self.store, boundary)
    }
    fn restore(
        &self,
        stored: &memsave_checkpoint::Stored,
    ) -> Result<tch::Tensor, memsave_checkpoint::StoreError> {
        self.store.restore(stored)
    }
    fn resident_bytes(&self, stored: &memsave_checkpoint::Stored) -> Option<u64> {
        self.store.resident_bytes(stored)
    }
}
