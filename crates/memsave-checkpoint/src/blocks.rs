//! [`Blocks`]: named blocks of any forward function, each run under its own lever.
use crate::block_plan::LeversBack;
use crate::error::{CheckpointError, Result};
use crate::function::Checkpoint;
use crate::levers::{BoundaryStore, Lever, LeverStats};
use memsave_sys::hooks::RawHooks;
use std::any::TypeId;
use std::collections::HashMap;
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tch::{Device, Tensor};

/// One call of a block in a forward: its name and how many calls of that name came
/// before it in the same forward (shared weights run twice: `dec#0`, `dec#1`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    /// The name given to [`Blocks::run`].
    pub name: String,
    /// The call index of that name within the forward, from 0.
    pub call: usize,
}

impl BlockKey {
    /// The `call`-th call of the block `name`.
    pub fn new(name: impl Into<String>, call: usize) -> Self {
        Self {
            name: name.into(),
            call,
        }
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.name, self.call)
    }
}

/// What a block does with the tensors its ops save for backward.
#[derive(Clone, Default)]
pub enum BlockLever {
    /// Keeps them, as a plain forward does (the default).
    #[default]
    Keep,
    /// Keeps only the block's inputs and recomputes the block in backward (a
    /// checkpoint, with the RNG state preserved).
    Recompute,
    /// [`Recompute`](Self::Recompute), and the block's inputs are kept by `store` (a
    /// file, a compressed copy) until the recomputation instead of by the checkpoint:
    /// below what recomputation alone reaches, since every checkpoint keeps its
    /// inputs. An input is freed only once nothing else holds it (another block kept
    /// with it saved, the caller's own variables).
    RecomputeStoringInputs {
        /// Where the inputs wait (`memsave-hooks`' `DiskOffload`, a codec).
        store: Arc<dyn BoundaryStore>,
    },
    /// Hands every tensor the block's ops save to `hooks` (memsave-hooks' disk offload
    /// or compression, as `memsave_hooks::raw_hooks(..)`), which keep them until
    /// backward.
    Store {
        /// A short name for reports ("offload to disk", "int8").
        name: String,
        /// Whether the hooks give back exactly the bits they were given (then gradients
        /// stay bitwise equal to the plain step's).
        lossless: bool,
        /// The pack/unpack pair.
        hooks: Arc<dyn RawHooks>,
    },
}

impl BlockLever {
    /// [`BlockLever::Store`] with these hooks.
    pub fn store(name: impl Into<String>, lossless: bool, hooks: Arc<dyn RawHooks>) -> Self {
        BlockLever::Store {
            name: name.into(),
            lossless,
            hooks,
        }
    }

    /// Whether gradients stay bitwise equal to the plain step's under this lever.
    pub fn is_lossless(&self) -> bool {
        match self {
            BlockLever::Keep | BlockLever::Recompute => true,
            BlockLever::RecomputeStoringInputs { store } => store.is_lossless(),
            BlockLever::Store { lossless, .. } => *lossless,
        }
    }

    /// `keep`, `recompute` or the store's name.
    pub fn name(&self) -> String {
        match self {
            BlockLever::Keep => "keep".into(),
            BlockLever::Recompute => "recompute".into(),
            BlockLever::RecomputeStoringInputs { store } => {
                format!("recompute, inputs to {}", store.name())
            }
            BlockLever::Store { name, .. } => name.clone(),
        }
    }
}

impl fmt::Debug for BlockLever {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// What one block call did in the last forward run by [`Blocks::forward`].
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRecord {
    /// Which call.
    pub key: BlockKey,
    /// How many blocks it runs inside (0 at the top).
    pub depth: usize,
    /// The lever it ran under.
    pub lever: String,
    /// Bytes of its inputs (each distinct storage once).
    pub input_bytes: u64,
    /// Bytes of its outputs.
    pub output_bytes: u64,
    /// Bytes the device held more after the call than before: its outputs and
    /// whatever it saved for backward (kept, or held in memory by a store).
    pub retained_bytes: i64,
    /// Seconds of its forward.
    pub forward_s: f64,
}

/// The levers of [`Blocks`] as they were set ([`Blocks::levers_snapshot`]).
#[derive(Clone, Debug)]
pub struct LeversSnapshot {
    every: BlockLever,
    levers: HashMap<BlockKey, BlockLever>,
    planned: Option<Vec<BlockKey>>,
}

/// What a [`Blocks`] observer is told (see [`Blocks::set_observer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockNotice {
    /// A run of the block starts: in the forward, or (`recompute`) a recomputation in
    /// backward, its own or its parent's.
    Start {
        /// The block's call.
        key: BlockKey,
        /// Whether the run is a recomputation.
        recompute: bool,
    },
    /// The run last started ends.
    End {
        /// The block's call.
        key: BlockKey,
    },
}

/// Told when each block's run starts and ends, on the thread that runs it.
pub type BlockObserver = Arc<dyn Fn(&BlockNotice) + Send + Sync>;

/// A block function's outputs, or why it has none.
type Outputs<E> = std::result::Result<Vec<Tensor>, RunError<E>>;

/// What each top-level block's function runs through ([`Blocks::set_wrapper`]): called
/// with the block's name, its inputs and its function, it returns the function's
/// outputs (ZeRO-3 gathers the block's weights around it). It has no error channel:
/// it panics, and the block's run turns the panic into an `Err` naming the block.
/// The function's own error comes back as its `Err` whatever the wrapper returns.
pub type BlockWrapper = Arc<
    dyn Fn(&str, &[Tensor], &mut dyn FnMut(&[Tensor]) -> Vec<Tensor>) -> Vec<Tensor> + Send + Sync,
>;

#[derive(Default)]
pub(crate) struct State {
    /// The lever of a key without one of its own.
    pub(crate) every: BlockLever,
    /// Levers of single calls.
    pub(crate) levers: HashMap<BlockKey, BlockLever>,
    /// Call counters of the forward in progress, `None` outside one.
    calls: Option<HashMap<String, usize>>,
    /// Depth of the block running in the forward in progress.
    depth: usize,
    /// The forward in progress's blocks.
    recording: Vec<BlockRecord>,
    /// The last finished forward's blocks.
    pub(crate) last: Vec<BlockRecord>,
    /// The sequence per-call levers were assigned for.
    pub(crate) planned: Option<Vec<BlockKey>>,
    /// Call counters of the recomputations in progress, innermost last.
    replays: Vec<HashMap<String, usize>>,
    /// Whether a block of the forward in progress was refused as not planned, or
    /// failed: the forward's own error then stands, and its partial record is not
    /// kept as the last forward.
    refused: bool,
    /// The memory segments of a profiled step in progress.
    pub(crate) profiler: Option<Profiler>,
    /// While a profiled step runs a top-level block whose saves go to a store: its
    /// index, and whether backward has read one of its saves yet (see
    /// [`MarksBackward`]).
    stored_top: Option<(usize, Arc<std::sync::atomic::AtomicBool>)>,
    /// Told when each block's run starts and ends.
    observer: Option<BlockObserver>,
    /// The stores of [`BlockLever::RecomputeStoringInputs`] used so far, each with
    /// what it took (one counter per store, across blocks and forwards).
    stores: Vec<Lever>,
    /// The function (closure type) each block name runs in the forward in progress,
    /// from its first call on.
    functions: HashMap<String, TypeId>,
    /// What each top-level block's function runs through ([`Blocks::set_wrapper`]).
    wrapper: Option<BlockWrapper>,
    /// The top-level blocks (by name) whose function is running now, innermost last:
    /// a block run inside one of them runs inside its wrapper already.
    ancestors: Vec<String>,
    /// The options of every recomputed block's checkpoint.
    checkpoint: Checkpoint,
}

/// What delimits a segment of a profiled step: the start or end of a top-level
/// block's forward, the start of its recomputation in backward, or a mark of the
/// profiler's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// The step starts.
    Begin,
    /// Top-level block `i` (its place in the forward) starts its forward.
    Start(usize),
    /// Top-level block `i` ends its forward.
    End(usize),
    /// The forward (and the loss) ended; backward starts.
    ForwardEnd,
    /// Top-level block `i`'s recomputation starts, in backward.
    Recompute(usize),
    /// Backward first reads back a save of top-level block `i`, whose saves are in a
    /// store ([`BlockLever::Store`]): where its recomputation would start.
    Unpack(usize),
}

/// A store's hooks that, while a step is profiled, mark the first read of top-level
/// block `index`'s saves in backward ([`Event::Unpack`]).
struct MarksBackward {
    inner: Arc<dyn RawHooks>,
    blocks: Blocks,
    index: usize,
    /// Shared by the frames of the top-level block and of the blocks nested in it.
    marked: Arc<std::sync::atomic::AtomicBool>,
}

impl RawHooks for MarksBackward {
    fn pack(
        &self,
        tensor: &Tensor,
        saved_by: Option<&str>,
    ) -> std::result::Result<memsave_sys::hooks::Packed, memsave_sys::CallbackError> {
        self.inner.pack(tensor, saved_by)
    }

    fn records_ops(&self) -> bool {
        self.inner.records_ops()
    }

    fn unpack(
        &self,
        packed: &memsave_sys::hooks::Packed,
    ) -> std::result::Result<Tensor, memsave_sys::CallbackError> {
        if !self.marked.swap(true, Ordering::SeqCst) {
            if let Some(profiler) = self.blocks.lock().profiler.as_mut() {
                profiler.event(Event::Unpack(self.index));
            }
        }
        self.inner.unpack(packed)
    }
}

/// The peak of each segment of a step, above the bytes allocated when it began.
#[derive(Debug)]
pub(crate) struct Profiler {
    pub(crate) device: Device,
    pub(crate) base: u64,
    /// Segments so far: the event that opened each, and its peak above `base`.
    pub(crate) segments: Vec<(Event, i64)>,
    open: Event,
    /// The tensors that crossed top-level blocks so far, and who held them.
    pub(crate) flow: crate::crossing::Flow,
}

impl Profiler {
    pub(crate) fn begin(device: Device) -> Result<Profiler> {
        let meter = |e: memsave_meter::MeterError| CheckpointError::Torch(e.to_string());
        memsave_meter::f_reset_peak_memory_stats(device).map_err(meter)?;
        Ok(Profiler {
            device,
            base: memsave_meter::f_memory_allocated(device).map_err(meter)?,
            segments: Vec::new(),
            open: Event::Begin,
            flow: crate::crossing::Flow::default(),
        })
    }

    /// Closes the open segment with its peak and opens one at `event`.
    pub(crate) fn event(&mut self, event: Event) {
        let peak = memsave_meter::max_memory_allocated(self.device) as i64 - self.base as i64;
        self.segments.push((self.open, peak));
        self.flow.event(event);
        memsave_meter::reset_peak_memory_stats(self.device);
        self.open = event;
    }
}

/// Orders names as people read them: runs of digits by their value (`layer 2` before
/// `layer 10`), the rest as text.
fn natural(a: &str, b: &str) -> std::cmp::Ordering {
    fn runs(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            if i == bytes.len() || bytes[i].is_ascii_digit() != bytes[start].is_ascii_digit() {
                out.push((bytes[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ra, rb) = (runs(a), runs(b));
    for ((da, x), (db, y)) in ra.iter().zip(&rb) {
        let order = match (da, db) {
            (true, true) => {
                let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
                x.len().cmp(&y.len()).then_with(|| x.cmp(y))
            }
            _ => x.cmp(y),
        };
        if order.is_ne() {
            return order;
        }
    }
    ra.len().cmp(&rb.len()).then_with(|| a.cmp(b))
}

/// Named blocks of a forward function, each run under its own [`BlockLever`]. A
/// handle: clones share the same blocks and levers.
///
/// A chain of layers ([`CheckpointedSequential`](crate::CheckpointedSequential)) is one
/// shape of model; U-Nets (encoder features concatenated into the decoder),
/// encoder–decoder transformers (every decoder block reads the encoder's output) and
/// models with several inputs or outputs are not chains. `Blocks` takes the model as it
/// is written: its forward calls [`Blocks::run`] for each block it wants planned, with
/// any number of tensor inputs and outputs; tensors cross blocks freely. Each call is
/// known by a [`BlockKey`], its name and its call index within the forward (a block
/// run twice with shared weights is `name#0` and `name#1`), and runs under the
/// [`BlockLever`] assigned to that key: kept as it is, recomputed in backward
/// (a checkpoint), or with what it saves handed to saved-tensor hooks (a file, host
/// memory, a compressed copy). Blocks nest: a block's function may run blocks of its
/// own, and a recomputation replays them under their own levers.
///
/// ```
/// use memsave_checkpoint::{BlockKey, BlockLever, Blocks, Shared};
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// // Block functions may run again in backward, on another thread: they capture
/// // modules through `Shared` handles.
/// let enc = Shared::new(nn::linear(vs.root() / "enc", 8, 8, Default::default()));
/// let dec = Shared::new(nn::linear(vs.root() / "dec", 16, 8, Default::default()));
/// let blocks = Blocks::new();
/// let x = Tensor::rand([4, 8], (Kind::Float, Device::Cpu));
///
/// // A forward that is not a chain: the decoder reads the encoder's output and x.
/// let forward = |blocks: &Blocks| -> memsave_checkpoint::Result<Tensor> {
///     let (enc, dec) = (enc.clone(), dec.clone());
///     let h = blocks.run("enc", &[&x], move |xs| vec![enc.forward(&xs[0]).relu()])?;
///     let y = blocks.run("dec", &[&h[0], &x], move |xs| {
///         vec![dec.forward(&Tensor::cat(&[&xs[0], &xs[1]], 1)).tanh()]
///     })?;
///     Ok(y[0].shallow_clone())
/// };
/// let y = blocks.forward(forward)??;
/// assert_eq!(blocks.keys(), vec![BlockKey::new("enc", 0), BlockKey::new("dec", 0)]);
///
/// // Recompute the decoder in backward, keep the encoder's activations.
/// blocks.set(BlockKey::new("dec", 0), BlockLever::Recompute)?;
/// let y = blocks.forward(forward)??;
/// y.square().mean(Kind::Float).backward();
/// # Ok::<(), memsave_checkpoint::CheckpointError>(())
/// ```
///
/// Traps:
/// - Run the model's forward inside [`Blocks::forward`]: it starts the call indices
///   of a step afresh and checks that the blocks come in the order the levers were
///   assigned for. [`Blocks::run`] outside it is an error.
/// - One forward at a time per `Blocks` (its state is shared by its clones).
/// - A block's function is run again in backward under [`BlockLever::Recompute`]:
///   like [`checkpoint`](crate::checkpoint)'s, it must compute the same thing from the
///   same inputs (the RNG state is restored for it; BatchNorm's running statistics are
///   updated once, by the forward).
#[derive(Clone, Default)]
pub struct Blocks {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for Blocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("Blocks")
            .field("every", &state.every)
            .field("levers", &state.levers)
            .field("blocks", &state.last.len())
            .finish()
    }
}

impl Blocks {
    /// Blocks that all keep what they save (a plain forward) until levers are set.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held leaves counters only: carry on.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one forward of the model (`f`, which calls [`run`](Self::run) for its
    /// blocks): the call indices start at 0, and when levers were set for single
    /// calls, the top-level blocks must come in the order they were set for (else the
    /// first that differs is refused before it runs: its `run` returns
    /// [`CheckpointError::BlocksChanged`], which `f` passes on). Afterwards
    /// [`last_forward`](Self::last_forward) tells what each block did (a forward in
    /// which a block failed or was refused leaves the record of the one before).
    ///
    /// # Errors
    /// [`CheckpointError::BlocksChanged`] when `f` ran fewer top-level blocks than the
    /// levers were set for, or none of a key a lever was set for (then `f`'s own
    /// result is dropped; not when a block failed, whose error `f` has);
    /// [`CheckpointError::Blocks`] when a forward is already running on these blocks.
    ///
    /// Trap: a refused forward has run what came before the refusal (every block, when
    /// it ran fewer than planned): BatchNorm's running statistics in those blocks were
    /// updated and the random stream moved. Set the levers again and run the next
    /// batch, or restore the model's state before running the same batch again.
    pub fn forward<T>(&self, f: impl FnOnce(&Blocks) -> T) -> Result<T> {
        {
            let mut state = self.lock();
            if state.calls.is_some() {
                return Err(CheckpointError::Blocks(
                    "Blocks::forward inside another forward of the same blocks: run one forward at a time".into(),
                ));
            }
            state.calls = Some(HashMap::new());
            state.functions.clear();
            state.depth = 0;
            state.refused = false;
            state.recording.clear();
        }
        let out = panic::catch_unwind(AssertUnwindSafe(|| f(self)));
        let mut state = self.lock();
        state.calls = None;
        let recorded = std::mem::take(&mut state.recording);
        let out = match out {
            Ok(out) => out,
            Err(payload) => {
                drop(state);
                panic::resume_unwind(payload)
            }
        };
        if state.refused {
            // A block failed or was refused: its error, in `f`'s result, stands.
            return Ok(out);
        }
        {
            let top: Vec<&BlockKey> = recorded
                .iter()
                .filter(|r| r.depth == 0)
                .map(|r| &r.key)
                .collect();
            if let Some(planned) = state.planned.as_ref().filter(|p| top.len() < p.len()) {
                return Err(CheckpointError::BlocksChanged(format!(
                    "the forward ran {} top-level blocks where the levers were set for {}: {} did not run; set the levers again for this forward",
                    top.len(),
                    planned.len(),
                    planned[top.len()]
                )));
            }
            // Levers set before any forward are checked against the first one.
            let mut unrun: Vec<String> = state
                .levers
                .keys()
                .filter(|k| !recorded.iter().any(|r| &r.key == *k))
                .map(ToString::to_string)
                .collect();
            if !unrun.is_empty() {
                unrun.sort();
                return Err(CheckpointError::BlocksChanged(format!(
                    "levers were set for {}, which the forward did not run; set the levers again for this forward",
                    unrun.join(", ")
                )));
            }
        }
        // Levers set before any forward: from now on, the top-level blocks must come
        // in this forward's order.
        if state.planned.is_none() && !state.levers.is_empty() {
            state.planned = Some(
                recorded
                    .iter()
                    .filter(|r| r.depth == 0)
                    .map(|r| r.key.clone())
                    .collect(),
            );
        }
        state.last = recorded;
        Ok(out)
    }

    /// Sets (or, with `None`, removes) the observer told when each block's run starts
    /// and ends, recomputations included: what `memsave trace` marks its timeline
    /// with, per block. It runs on the thread that runs the block (autograd's in
    /// backward) and must not run a forward of these blocks.
    pub fn set_observer(&self, observer: Option<BlockObserver>) {
        self.lock().observer = observer;
    }

    /// The observer set now, if any: to put it back after setting another for a while.
    pub fn observer(&self) -> Option<BlockObserver> {
        self.lock().observer.clone()
    }

    /// What each store of [`BlockLever::RecomputeStoringInputs`] took from the blocks'
    /// forwards so far, one entry per store in the order first used: as
    /// [`CheckpointedSequential::lever_stats`](crate::CheckpointedSequential::lever_stats)
    /// for a chain's boundary stores (what `memsave bench` reports as offloaded).
    pub fn lever_stats(&self) -> Vec<LeverStats> {
        self.lock().stores.iter().map(Lever::stats).collect()
    }

    /// `store` with its counter: the one kept for it, or a new one.
    pub(crate) fn counted(&self, store: &Arc<dyn BoundaryStore>) -> Lever {
        let mut state = self.lock();
        if let Some(lever) = state.stores.iter().find(|l| Arc::ptr_eq(&l.0, store)) {
            return lever.clone();
        }
        let lever = Lever::new(Arc::clone(store));
        state.stores.push(lever.clone());
        lever
    }

    /// Tells the observer, if any, of `notice` (the lock not held while it runs).
    fn notify(&self, notice: impl FnOnce() -> BlockNotice) {
        let observer = self.lock().observer.clone();
        if let Some(observer) = observer {
            observer(&notice());
        }
    }

    /// Runs the block `name` on `inputs` under its lever; see [`try_run`](Self::try_run).
    /// A panic in `f` becomes an `Err` naming the block.
    pub fn run<F>(&self, name: &str, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static,
    {
        self.try_run(name, inputs, move |xs| {
            Ok::<_, std::convert::Infallible>(f(xs))
        })
    }

    /// Runs the block `name` on `inputs` (any number; undefined tensors pass through)
    /// under the lever of its key, and returns its outputs. `f` gets the inputs as
    /// tensors of the same values; under [`BlockLever::Recompute`] it runs again in
    /// backward, so it must be `Send + 'static` (capture modules by `Arc` or clone,
    /// and values such as a train flag by move).
    ///
    /// # Errors
    /// `f`'s error (or panic) naming the block; [`CheckpointError::Blocks`] outside
    /// [`forward`](Self::forward); [`CheckpointError::BlocksChanged`] when this call is
    /// not the one the levers were set for at this place of the forward;
    /// [`CheckpointError::Blocks`] when a forward runs another closure under a name
    /// it already ran; an error naming the block when `f` changes one of its inputs in
    /// place under grad mode (under `no_grad` nothing reads them again) or returns no
    /// tensor, in the forward and in each recomputation. Outputs that do not require
    /// grad (a table made from an input's shape, a mask, a detached teacher's output)
    /// are a function's outputs like any other: a recomputation refills the saved
    /// tensors of the forward's own graph, so gradients follow the forward under every
    /// lever.
    pub fn try_run<F, E>(&self, name: &str, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> std::result::Result<Vec<Tensor>, E> + Send + 'static,
        E: fmt::Display,
    {
        self.run_block(name, inputs, None, f)
    }

    /// Whether each recomputed block's checkpoint restores the RNG state for its
    /// recomputation (default `true`; see [`Checkpoint::preserve_rng`]). Off saves a
    /// generator state per recomputed block (5,056 bytes on the CPU) where no block
    /// draws random numbers (dropout).
    pub fn preserve_rng(&self, preserve: bool) {
        let mut state = self.lock();
        state.checkpoint = state.checkpoint.preserve_rng(preserve);
    }

    /// [`try_run`](Self::try_run) under `lever` when given (a chain's schedule decides
    /// its checkpoints' levers), else under the lever of the block's key.
    pub(crate) fn run_block<F, E>(
        &self,
        name: &str,
        inputs: &[&Tensor],
        lever: Option<BlockLever>,
        f: F,
    ) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> std::result::Result<Vec<Tensor>, E> + Send + 'static,
        E: fmt::Display,
    {
        self.check_function(name, TypeId::of::<F>())?;
        let (key, lever, recorded_at) = self.enter(name, lever)?;
        let label = format!("block {key}");
        // What a block must not do, checked on every run (the forward's and each
        // recomputation): change its inputs in place, or return no tensor.
        // Without grad mode (inference, `no_grad`) nothing reads the inputs again: no
        // graph saves them and nothing is recomputed, so a block may change them there
        // (as under inference mode, whose tensors have no version): a key-value cache
        // written in place, a `relu_` on its input.
        let f = move |xs: &[Tensor]| -> std::result::Result<Vec<Tensor>, RunError<E>> {
            let watch = memsave_sys::tensor::grad_enabled().unwrap_or(true);
            let versions: Vec<Option<u64>> = xs
                .iter()
                .map(|x| {
                    (watch && x.defined())
                        .then(|| memsave_sys::tensor::version(x).ok())
                        .flatten()
                })
                .collect();
            let out = f(xs).map_err(RunError::Function)?;
            misuse(xs, &versions, &out).map_or(Ok(out), |m| Err(RunError::Misuse(m)))
        };
        // The top-level block this one runs in (itself at the top level): its wrapper
        // is entered once, around the top-level block's run, and again around a run of
        // this block outside it (a recomputation in backward).
        let ancestor = {
            let state = self.lock();
            match recorded_at {
                Some(i) if state.recording[i].depth == 0 => name.to_string(),
                _ => state
                    .ancestors
                    .last()
                    .cloned()
                    .unwrap_or_else(|| name.to_string()),
            }
        };
        let blocks = self.clone();
        let f = move |xs: &[Tensor]| blocks.run_wrapped(&ancestor, xs, &f);
        let started = Instant::now();
        let device = inputs
            .iter()
            .find(|t| t.defined())
            .map_or(Device::Cpu, |t| t.device());
        // Bytes are recorded where the meter can count them (not on every device).
        let before = recorded_at.and_then(|_| memsave_meter::f_memory_allocated(device).ok());
        let top = {
            let mut state = self.lock();
            // A top-level block is known by its rank among the top-level blocks.
            let top = recorded_at
                .filter(|&i| state.recording[i].depth == 0)
                .map(|i| state.recording[..i].iter().filter(|r| r.depth == 0).count());
            if let (Some(i), Some(profiler)) = (top, state.profiler.as_mut()) {
                profiler.event(Event::Start(i));
            }
            top
        };
        let recompute = !self.lock().replays.is_empty();
        self.notify(|| BlockNotice::Start {
            key: key.clone(),
            recompute,
        });
        let watch = top.and_then(|i| self.lock().profiler.as_mut()?.flow.watch(i, inputs));
        let out = self.apply(&lever, &key, &label, inputs, top, f);
        self.notify(|| BlockNotice::End { key: key.clone() });
        let mut state = self.lock();
        if out.is_err() && state.calls.is_some() && state.replays.is_empty() {
            state.refused = true;
        }
        if let (Some(i), Some(profiler)) = (top, state.profiler.as_mut()) {
            if let (Some(watch), Ok(outs)) = (watch, &out) {
                profiler.flow.record(watch, inputs, outs);
            }
            profiler.event(Event::End(i));
        }
        if let Some(i) = recorded_at {
            state.depth -= 1;
            if let Ok(outs) = &out {
                let after = memsave_meter::f_memory_allocated(device).ok();
                let record = &mut state.recording[i];
                record.input_bytes = distinct_bytes(inputs.iter().copied());
                record.output_bytes = distinct_bytes(outs.iter());
                if let (Some(before), Some(after)) = (before, after) {
                    record.retained_bytes = after as i64 - before as i64;
                }
                record.forward_s = started.elapsed().as_secs_f64();
            }
        }
        out
    }

    /// Runs `f` on `xs` as part of top-level block `ancestor`: through the wrapper
    /// when one is set and no run of a top-level block is in progress (the forward of
    /// a top-level block, or a recomputation in backward), directly otherwise.
    fn run_wrapped<E>(
        &self,
        ancestor: &str,
        xs: &[Tensor],
        f: &dyn Fn(&[Tensor]) -> Outputs<E>,
    ) -> Outputs<E> {
        /// Pops the ancestor pushed below, however the run ends.
        struct Entered<'a>(&'a Blocks);
        impl Drop for Entered<'_> {
            fn drop(&mut self) {
                self.0.lock().ancestors.pop();
            }
        }
        let wrapper = {
            let mut state = self.lock();
            let outside = state.ancestors.is_empty();
            state.ancestors.push(ancestor.to_string());
            state.wrapper.clone().filter(|_| outside)
        };
        let _entered = Entered(self);
        let Some(wrapper) = wrapper else {
            return f(xs);
        };
        // The function's error, or its panic, is kept here and the wrapper returns
        // normally (a ZeRO-3 unit then frees what it gathered); the panic goes on
        // from here, to become the block's error as without a wrapper.
        let mut result = None;
        let mut panicked = None;
        let out = wrapper(
            ancestor,
            xs,
            &mut |ys: &[Tensor]| match panic::catch_unwind(AssertUnwindSafe(|| f(ys))) {
                Ok(Ok(out)) => {
                    result = Some(Ok(()));
                    out
                }
                Ok(Err(e)) => {
                    result = Some(Err(e));
                    Vec::new()
                }
                Err(payload) => {
                    panicked = Some(payload);
                    Vec::new()
                }
            },
        );
        if let Some(payload) = panicked {
            panic::resume_unwind(payload);
        }
        match result {
            // The function's outputs were checked; the wrapper's are what the block
            // returns.
            Some(Ok(())) if out.iter().all(|t| !t.defined()) => {
                Err(RunError::Misuse(Misuse::WrapperDropped))
            }
            Some(Ok(())) => Ok(out),
            Some(Err(e)) => Err(e),
            None => Err(RunError::Misuse(Misuse::NotRun)),
        }
    }

    /// Sets (or, with `None`, removes) the wrapper each top-level block's function runs
    /// through, in the forward and in each recomputation, and a nested block's when it
    /// is recomputed outside its top-level block's run: ZeRO-3 gathers a block's
    /// weights around it (`memsave_step`'s data parallel setup sets it).
    pub fn set_wrapper(&self, wrapper: Option<BlockWrapper>) {
        self.lock().wrapper = wrapper;
    }

    /// Which of `params` each top-level block uses, by name in the order first run
    /// (all calls of a name together; each list in `params`' order): `step` runs a
    /// forward of these blocks once (and whatever else it does, but no backward of its
    /// own is needed), every top-level block kept and run on its inputs detached, and
    /// a parameter is a block's when the block's outputs depend on it through
    /// autograd. What ZeRO-3 needs to shard a model of blocks one unit per block.
    ///
    /// Warning: a parameter used outside every block, or read without autograd, is in
    /// no list; one two blocks use is in both. Run `step` in evaluation mode (or expect
    /// BatchNorm's running statistics to move once). The levers, the wrapper, the
    /// observer (told nothing of this forward) and [`last_forward`](Self::last_forward)
    /// are as they were afterwards.
    ///
    /// # Errors
    /// `step`'s error; [`CheckpointError::Torch`] when libtorch fails.
    pub fn f_block_parameters<F, T, E>(
        &self,
        params: &[Tensor],
        step: F,
    ) -> Result<Vec<(String, Vec<Tensor>)>>
    where
        F: FnOnce() -> std::result::Result<T, E>,
        E: fmt::Display,
    {
        let trainable: Vec<usize> = (0..params.len())
            .filter(|&i| params[i].requires_grad())
            .collect();
        // Tensors are `Send`, not `Sync`: the wrapper (`Sync`) holds them in a mutex.
        let inputs: Mutex<Vec<Tensor>> = Mutex::new(
            trainable
                .iter()
                .map(|&i| params[i].shallow_clone())
                .collect(),
        );
        type Found = Vec<(String, Vec<bool>)>;
        let found: Arc<Mutex<(Found, Option<String>)>> = Arc::new(Mutex::new((Vec::new(), None)));
        let record = Arc::clone(&found);
        let n = params.len();
        let wrapper: BlockWrapper = Arc::new(move |name, xs, f| {
            let detached: Vec<Tensor> = xs
                .iter()
                .map(|x| {
                    if x.defined() {
                        x.detach()
                    } else {
                        x.shallow_clone()
                    }
                })
                .collect();
            let out = f(&detached);
            let used = (|| -> std::result::Result<Vec<usize>, tch::TchError> {
                let mut total: Option<Tensor> = None;
                for o in out.iter().filter(|o| o.defined() && o.requires_grad()) {
                    let s = o.f_sum(tch::Kind::Float)?;
                    total = Some(match total {
                        Some(t) => t.f_add(&s)?,
                        None => s,
                    });
                }
                let inputs = inputs.lock().unwrap_or_else(|e| e.into_inner());
                let (Some(total), false) = (total, inputs.is_empty()) else {
                    return Ok(Vec::new());
                };
                let grads = Tensor::f_run_backward(&[total], &inputs[..], false, false)?;
                Ok(trainable
                    .iter()
                    .zip(&grads)
                    .filter(|(_, g)| g.defined())
                    .map(|(&i, _)| i)
                    .collect())
            })();
            let mut found = record.lock().unwrap_or_else(|e| e.into_inner());
            match used {
                Ok(used) => {
                    let at = match found.0.iter().position(|(n, _)| n == name) {
                        Some(at) => at,
                        None => {
                            found.0.push((name.to_string(), vec![false; n]));
                            found.0.len() - 1
                        }
                    };
                    for i in used {
                        found.0[at].1[i] = true;
                    }
                }
                Err(e) => {
                    found.1.get_or_insert(format!("block {name}: {e}"));
                }
            }
            out
        });
        let outcome = {
            let _levers = LeversBack::save(self);
            let before = {
                let mut state = self.lock();
                Saved {
                    wrapper: state.wrapper.replace(wrapper),
                    observer: state.observer.take(),
                    last: state.last.clone(),
                }
            };
            /// Puts back the wrapper, the observer (told nothing of this forward) and
            /// the last forward's record, however the step ends.
            struct Saved {
                wrapper: Option<BlockWrapper>,
                observer: Option<BlockObserver>,
                last: Vec<BlockRecord>,
            }
            struct Back<'a>(&'a Blocks, Saved);
            impl Drop for Back<'_> {
                fn drop(&mut self) {
                    let mut state = self.0.lock();
                    state.wrapper = self.1.wrapper.take();
                    state.observer = self.1.observer.take();
                    state.last = std::mem::take(&mut self.1.last);
                }
            }
            let _back = Back(self, before);
            self.set_every(BlockLever::Keep);
            step()
        };
        outcome.map_err(|e| {
            CheckpointError::Blocks(format!("the step run to find each block's parameters: {e}"))
        })?;
        let (lists, error) = std::mem::take(&mut *found.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(e) = error {
            return Err(CheckpointError::Torch(e));
        }
        Ok(lists
            .into_iter()
            .map(|(name, used)| {
                let list = (0..n)
                    .filter(|&i| used[i])
                    .map(|i| params[i].shallow_clone())
                    .collect();
                (name, list)
            })
            .collect())
    }

    /// Refuses a second function under a block name within a forward: one name is one
    /// function (its calls are `name#0`, `name#1`, .., as a block with shared weights
    /// run again). Another forward may run other closures (a model's train and eval
    /// forwards); what it runs is checked against the levers' plan. Recomputations
    /// replay the forward's own closures and are not checked.
    fn check_function(&self, name: &str, function: TypeId) -> Result<()> {
        let mut state = self.lock();
        if state.calls.is_none() || !state.replays.is_empty() {
            return Ok(());
        }
        let known = *state.functions.entry(name.to_string()).or_insert(function);
        if known == function {
            return Ok(());
        }
        state.refused = true;
        Err(CheckpointError::Blocks(format!(
            "block name \"{name}\" runs a second function (another closure than at its first call): one name is one function; give this block a name of its own, or run the same closure (a `fn`, or `f.clone()` of one closure: a block needs `'static`, so `&f` of a local closure does not compile) at every call"
        )))
    }

    /// The key and lever of a new call of `name`, and where it is recorded (`None` in a
    /// recomputation, which records nothing).
    fn enter(
        &self,
        name: &str,
        given: Option<BlockLever>,
    ) -> Result<(BlockKey, BlockLever, Option<usize>)> {
        let mut state = self.lock();
        if let Some(replay) = state.replays.last_mut() {
            let call = replay.entry(name.to_string()).or_insert(0);
            let key = BlockKey::new(name, *call);
            *call += 1;
            let lever = given.unwrap_or_else(|| state.lever_of(&key));
            return Ok((key, lever, None));
        }
        let Some(calls) = state.calls.as_mut() else {
            return Err(CheckpointError::Blocks(format!(
                "Blocks::run(\"{name}\") outside Blocks::forward: run the model's forward as blocks.forward(|b| ..)"
            )));
        };
        let call = calls.entry(name.to_string()).or_insert(0);
        let key = BlockKey::new(name, *call);
        *call += 1;
        // Top-level blocks must come as planned; a nested block is its parent's.
        let position = state.recording.iter().filter(|r| r.depth == 0).count();
        if let Some(planned) = state.planned.as_ref().filter(|_| state.depth == 0) {
            if planned.get(position) != Some(&key) {
                let expected = planned
                    .get(position)
                    .map_or("no more blocks".to_string(), |k| format!("block {k}"));
                state.refused = true;
                return Err(CheckpointError::BlocksChanged(format!(
                    "block {position} of the forward is {key} where the levers were set for {expected}; set the levers again for this forward"
                )));
            }
        }
        let lever = given.unwrap_or_else(|| state.lever_of(&key));
        let depth = state.depth;
        state.depth += 1;
        let index = state.recording.len();
        state.recording.push(BlockRecord {
            key: key.clone(),
            depth,
            lever: lever.name(),
            input_bytes: 0,
            output_bytes: 0,
            retained_bytes: 0,
            forward_s: 0.0,
        });
        Ok((key, lever, Some(index)))
    }

    fn apply<F, E>(
        &self,
        lever: &BlockLever,
        key: &BlockKey,
        label: &str,
        inputs: &[&Tensor],
        top: Option<usize>,
        f: F,
    ) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> std::result::Result<Vec<Tensor>, E> + Send + 'static,
        E: fmt::Display,
    {
        let failed = |e: String| CheckpointError::Torch(format!("{label}: {e}"));
        let plain = |f: &F| {
            let xs: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
            match panic::catch_unwind(AssertUnwindSafe(|| f(&xs))) {
                Ok(Ok(out)) => Ok(out),
                Ok(Err(e)) => Err(failed(e.to_string())),
                Err(payload) => Err(failed(memsave_sys::checkpoint::panic_message(&*payload))),
            }
        };
        match lever {
            BlockLever::Keep => plain(&f),
            BlockLever::Store { hooks, .. } => {
                if self.lock().wrapper.is_some() {
                    // Its hooks would sit inside the wrapper's (ZeRO-3's, which must
                    // see the gathered weights autograd saves) and take those too.
                    return Err(CheckpointError::Blocks(format!(
                        "{label}: its saves cannot go to a store while its function runs inside a block wrapper (ZeRO-3's units): the store would keep the gathered weights; recompute the block instead (with its inputs in files, if memory is short)"
                    )));
                }
                // While a step is profiled, backward's first read of a top-level
                // block's saves (or of a block's nested in it) is marked.
                let (profiled, enclosing) = {
                    let state = self.lock();
                    (state.profiler.is_some(), state.stored_top.clone())
                };
                let mark = match top {
                    Some(index) if profiled => {
                        Some((index, Arc::new(std::sync::atomic::AtomicBool::new(false))))
                    }
                    None if profiled => enclosing.clone(),
                    _ => None,
                };
                let hooks: Arc<dyn RawHooks> = match &mark {
                    Some((index, marked)) => Arc::new(MarksBackward {
                        inner: Arc::clone(hooks),
                        blocks: self.clone(),
                        index: *index,
                        marked: Arc::clone(marked),
                    }),
                    None => Arc::clone(hooks),
                };
                let frame = memsave_sys::hooks::push(hooks).map_err(|e| failed(e.to_string()))?;
                if top.is_some() {
                    self.lock().stored_top = mark;
                }
                let out = plain(&f);
                if top.is_some() {
                    self.lock().stored_top = enclosing;
                }
                frame.exit().map_err(|e| failed(e.to_string()))?;
                out
            }
            BlockLever::Recompute | BlockLever::RecomputeStoringInputs { .. } => {
                let store = match lever {
                    BlockLever::RecomputeStoringInputs { store } => Some(self.counted(store)),
                    _ => None,
                };
                // The first run is the forward's; every later one is a recomputation,
                // which replays the inner blocks' call indices from here.
                let runs = AtomicUsize::new(0);
                let snapshot = {
                    let state = self.lock();
                    match state.replays.last() {
                        Some(replay) => replay.clone(),
                        None => state.calls.clone().unwrap_or_default(),
                    }
                };
                let blocks = self.clone();
                let key = key.clone();
                let checkpoint = self.lock().checkpoint;
                checkpoint.try_run_named(inputs, label, store, move |xs| {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        return f(xs);
                    }
                    /// Pops the replay pushed below and tells the observer the
                    /// recomputation ended, however it ends.
                    struct Replaying<'a>(&'a Blocks, &'a BlockKey);
                    impl Drop for Replaying<'_> {
                        fn drop(&mut self) {
                            self.0.lock().replays.pop();
                            self.0.notify(|| BlockNotice::End {
                                key: self.1.clone(),
                            });
                        }
                    }
                    blocks.notify(|| BlockNotice::Start {
                        key: key.clone(),
                        recompute: true,
                    });
                    blocks.lock().replays.push(snapshot.clone());
                    let _replaying = Replaying(&blocks, &key);
                    if let (Some(i), Some(profiler)) = (top, blocks.lock().profiler.as_mut()) {
                        profiler.event(Event::Recompute(i));
                    }
                    f(xs)
                })
            }
        }
    }

    /// Sets the lever of every call without one of its own (and forgets those of
    /// single calls): `set_every(BlockLever::Recompute)` checkpoints every block, as
    /// `checkpoint: {every_layer: true}` does for a chain.
    pub fn set_every(&self, lever: BlockLever) {
        let mut state = self.lock();
        state.every = lever;
        state.levers.clear();
        state.planned = None;
    }

    /// Sets the lever of one call, one of the last forward's (see
    /// [`keys`](Self::keys)); from then on, forwards must run the same top-level blocks
    /// in the same order. Before any forward, any key is taken, and the first forward
    /// fails ([`CheckpointError::BlocksChanged`]) if it does not run them all (levers
    /// planned for a model built the same way, e.g. `fit`'s choice for a new model).
    ///
    /// # Errors
    /// [`CheckpointError::Blocks`] naming the key when the last forward did not run it.
    pub fn set(&self, key: BlockKey, lever: BlockLever) -> Result<()> {
        self.assign([(key, lever)])
    }

    /// Sets exactly these levers: every other call is kept ([`set_every`] with
    /// [`BlockLever::Keep`], then [`assign`](Self::assign)), as a plan chosen for the
    /// whole model (`fit`'s) means.
    ///
    /// # Errors
    /// As [`assign`](Self::assign); the blocks are then all kept.
    ///
    /// [`set_every`]: Self::set_every
    pub fn set_levers(
        &self,
        levers: impl IntoIterator<Item = (BlockKey, BlockLever)>,
    ) -> Result<()> {
        self.set_every(BlockLever::Keep);
        self.assign(levers)
    }

    /// [`set`](Self::set) for several calls at once; nothing changes when one key is
    /// unknown.
    ///
    /// # Errors
    /// As [`set`](Self::set).
    pub fn assign(&self, levers: impl IntoIterator<Item = (BlockKey, BlockLever)>) -> Result<()> {
        let mut state = self.lock();
        let levers: Vec<(BlockKey, BlockLever)> = levers.into_iter().collect();
        if levers.is_empty() {
            // Nothing assigned: nothing to plan the blocks' order for either.
            return Ok(());
        }
        if state.last.is_empty() {
            state.levers.extend(levers);
            return Ok(());
        }
        let keys: Vec<BlockKey> = state.last.iter().map(|r| r.key.clone()).collect();
        if let Some((key, _)) = levers.iter().find(|(k, _)| !keys.contains(k)) {
            return Err(CheckpointError::Blocks(format!(
                "the last forward ran no block {key}; its blocks are {}",
                keys.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        state.levers.extend(levers);
        state.planned = Some(
            state
                .last
                .iter()
                .filter(|r| r.depth == 0)
                .map(|r| r.key.clone())
                .collect(),
        );
        Ok(())
    }

    /// The levers set, for a person to read (`layer 2#0: recompute`, `every block:
    /// recompute`): every lever set for one call (with `keeps`, those that keep too),
    /// and the lever of every call unless it keeps; `None` when that is nothing.
    pub(crate) fn levers_set(&self, keeps: bool) -> Option<String> {
        let state = self.lock();
        // In the forward's order (as last run, then as planned), then by name: `layer 2`
        // before `layer 10`.
        let order: Vec<&BlockKey> = (state.last.iter().map(|r| &r.key))
            .chain(state.planned.iter().flatten())
            .collect();
        let position = |key: &BlockKey| order.iter().position(|k| *k == key);
        let mut pairs: Vec<(&BlockKey, &BlockLever)> = state
            .levers
            .iter()
            .filter(|(_, lever)| keeps || !matches!(lever, BlockLever::Keep))
            .collect();
        pairs.sort_by(|(a, _), (b, _)| {
            let (pa, pb) = (position(a), position(b));
            (pa.is_none().cmp(&pb.is_none()).then(pa.cmp(&pb)))
                .then_with(|| natural(&a.name, &b.name))
                .then(a.call.cmp(&b.call))
        });
        let mut set: Vec<String> = pairs
            .into_iter()
            .map(|(key, lever)| format!("{key}: {}", lever.name()))
            .collect();
        if !matches!(state.every, BlockLever::Keep) {
            set.insert(0, format!("every block: {}", state.every.name()));
        }
        (!set.is_empty()).then(|| set.join(", "))
    }

    /// Drops the counters of `stores` (a chain's boundary stores it no longer uses),
    /// so that the stores themselves can go (a directory of files each).
    pub(crate) fn release_stores(&self, stores: &[Lever]) {
        self.lock()
            .stores
            .retain(|l| !stores.iter().any(|s| Arc::ptr_eq(&s.0, &l.0)));
    }

    /// The levers as set now (for every call, for single calls, and the order of
    /// top-level blocks they were assigned for), to put back with
    /// [`restore_levers`](Self::restore_levers): what a caller that tries other
    /// levers for a while (`memsave_fit::fit`) leaves behind as it found it.
    pub fn levers_snapshot(&self) -> LeversSnapshot {
        let state = self.lock();
        LeversSnapshot {
            every: state.every.clone(),
            levers: state.levers.clone(),
            planned: state.planned.clone(),
        }
    }

    /// Puts back the levers of a [`levers_snapshot`](Self::levers_snapshot).
    pub fn restore_levers(&self, snapshot: LeversSnapshot) {
        let mut state = self.lock();
        state.every = snapshot.every;
        state.levers = snapshot.levers;
        state.planned = snapshot.planned;
    }

    /// Forgets the last forward's record and the order of top-level blocks levers were
    /// assigned for: the next forward runs other blocks (a chain's blocks change with
    /// its plan), and levers set before it are checked against it.
    pub(crate) fn forget_forward(&self) {
        let mut state = self.lock();
        state.last.clear();
        state.planned = None;
    }

    /// The lever `key` runs under.
    pub fn lever(&self, key: &BlockKey) -> BlockLever {
        self.lock().lever_of(key)
    }

    /// The calls of the last forward, in the order they started.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.lock().last.iter().map(|r| r.key.clone()).collect()
    }

    /// What each block call did in the last forward, in the order they started.
    pub fn last_forward(&self) -> Vec<BlockRecord> {
        self.lock().last.clone()
    }
}

impl State {
    fn lever_of(&self, key: &BlockKey) -> BlockLever {
        self.levers
            .get(key)
            .cloned()
            .unwrap_or_else(|| self.every.clone())
    }
}

/// Bytes of the distinct storages of `tensors` (a view of an input counts once).
fn distinct_bytes<'a>(tensors: impl Iterator<Item = &'a Tensor>) -> u64 {
    let mut seen = Vec::new();
    let mut bytes = 0;
    for t in tensors.filter(|t| t.defined()) {
        let ptr = t.data_ptr() as usize;
        let n = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        if !seen.contains(&ptr) {
            seen.push(ptr);
            bytes += n;
        }
    }
    bytes
}

/// Why a block's run failed: its own function's error, or what it must not do.
enum RunError<E> {
    /// The error the block's function returned.
    Function(E),
    /// What the block did wrong.
    Misuse(Misuse),
}

impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Function(e) => e.fmt(f),
            RunError::Misuse(m) => m.fmt(f),
        }
    }
}

/// What a block must not do; each message says what to do instead.
#[derive(Debug, thiserror::Error)]
enum Misuse {
    /// An input changed in place under grad mode.
    #[error("it modified its input {input} in place; a block must leave its inputs as they are (autograd and a recomputation read them): compute out of place, or on a copy (`xs[{input}].copy()`)")]
    InPlace {
        /// The input's position.
        input: usize,
    },
    /// No defined tensor among the outputs.
    #[error("it returned no tensor; a block returns at least one output (return its input, or run the code outside a block)")]
    NoTensor,
    /// The block wrapper ([`Blocks::set_wrapper`]) returned without running it.
    #[error("the block wrapper returned without running the block's function")]
    NotRun,
    /// The block wrapper ran the function but returned no tensor of its own.
    #[error("the block wrapper returned no tensor, though the block's function returned some: a wrapper returns what the function it runs returned")]
    WrapperDropped,
}

/// What a block's run did wrong, if anything: an input changed in place (its version
/// moved from `versions`, watched under grad mode only), or no tensor returned.
fn misuse(xs: &[Tensor], versions: &[Option<u64>], out: &[Tensor]) -> Option<Misuse> {
    for (input, (x, before)) in xs.iter().zip(versions).enumerate() {
        if let Some(before) = before {
            if memsave_sys::tensor::version(x).ok() != Some(*before) {
                return Some(Misuse::InPlace { input });
            }
        }
    }
    out.iter().all(|t| !t.defined()).then_some(Misuse::NoTensor)
}

/// A module that block functions can capture: tch's modules are `Send` but not `Sync`,
/// while a block's function must be `Send + 'static` (a recomputation may run it on
/// another thread), so each function captures a clone of this handle (an `Arc` of a
/// `Mutex`) and locks it for the call. `Shared<M>` is itself a `Module` or `ModuleT`
/// when `M` is.
///
/// ```
/// use memsave_checkpoint::Shared;
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let lin = Shared::new(nn::linear(vs.root(), 4, 4, Default::default()));
/// let f = { let lin = lin.clone(); move |x: &Tensor| lin.forward(x).relu() };
/// assert_eq!(f(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu))).size(), [2, 4]);
/// ```
///
/// Trap: the lock is held for one call only; a module that calls itself back through
/// the same handle would wait for itself.
pub struct Shared<M>(Arc<Mutex<M>>);

impl<M> Clone for Shared<M> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<M> Shared<M> {
    /// Shares `module`.
    pub fn new(module: M) -> Self {
        Self(Arc::new(Mutex::new(module)))
    }

    /// Runs `f` on the module (locked for the call).
    pub fn with<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        let module = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(&module)
    }
}

impl<M: fmt::Debug> fmt::Debug for Shared<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with(|m| m.fmt(f))
    }
}

impl<M: tch::nn::Module> tch::nn::Module for Shared<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.with(|m| m.forward(xs))
    }
}

impl<M: tch::nn::ModuleT> Shared<M> {
    /// The module's `forward_t` (BatchNorm's batch statistics and dropout when `train`).
    /// (Not the `ModuleT` trait: tch implements it for every `Module`.)
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.with(|m| m.forward_t(xs, train))
    }
}
