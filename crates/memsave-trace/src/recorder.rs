//! `Recorder`: runs a step with the allocator's recorder on and collects what the step
//! says about its tensors (phases, marks, saves, gradients).
use crate::category::{Category, Phase};
use crate::error::TraceError;
use crate::note::{Note, NoteKind};
use crate::trace::Trace;
use memsave_hooks::{saved_tensors_hooks, HookError, SavedTensorHooks};
use memsave_sys::alloc;
use memsave_sys::grad_hooks::{register_post_accumulate_grad_hook, GradHookHandle};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tch::{Device, Tensor};

#[derive(Debug, Default)]
pub(crate) struct State {
    pub notes: Vec<Note>,
    pub mark: Option<String>,
}

/// Shared between the session, the saved-tensor hooks and the gradient hooks.
#[derive(Debug, Clone, Default)]
struct Shared(Arc<Mutex<State>>);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note(&self, what: NoteKind) {
        let position = alloc::recording_position();
        self.lock().notes.push(Note { position, what });
    }

    fn roles(&self, tensors: &[Tensor], category: Category) {
        for t in tensors.iter().filter(|t| t.defined()) {
            self.note(NoteKind::Role {
                ptr: t.data_ptr() as u64,
                category,
            });
        }
    }
}

/// What the step being recorded can tell the recorder: the phase it is in, marks,
/// and optimizer state and gradients it creates and frees where the recorder cannot
/// see them. Cheap to clone (clones share the
/// recording), so a model can hold one to mark its layers.
#[derive(Debug, Clone)]
pub struct Session {
    shared: Shared,
}

impl Session {
    /// From now on, events belong to `phase`.
    pub fn phase(&self, phase: Phase) {
        self.shared.note(NoteKind::Phase(phase));
    }

    /// Opens a mark (a layer name, say): events and saved tensors from now on carry
    /// it, until the next mark. Like the meter's marks, a mark is a point in time.
    pub fn mark(&self, label: impl Into<String>) {
        let label = label.into();
        self.shared.lock().mark = Some(label.clone());
        self.shared.note(NoteKind::Mark(label));
    }

    /// A checkpoint's recomputation of `label` (the block, `layer 3`) starts: every
    /// storage allocated until [`recomputation_end`](Self::recomputation_end) that has
    /// no other role is [`Category::Recompute`] (what it re-saves for the block's
    /// backward and its forward's temporaries, which would otherwise be `temporary`),
    /// and [`Trace::recomputations`] has its bytes and time. Recomputations may nest:
    /// an end closes the innermost. Call the end also when the recomputation is cut
    /// short (an early stop unwinds the block: end it from a guard's `Drop`).
    ///
    /// Trap: the recorder cannot tell a recomputation from a forward by itself; the
    /// caller knows (a block that runs during backward under a checkpoint is one).
    pub fn recomputation_start(&self, label: impl Into<String>) {
        self.shared.note(NoteKind::RecomputeStart {
            label: label.into(),
            at: Instant::now(),
        });
    }

    /// The innermost recomputation started with
    /// [`recomputation_start`](Self::recomputation_start) ends.
    pub fn recomputation_end(&self) {
        self.shared
            .note(NoteKind::RecomputeEnd { at: Instant::now() });
    }

    /// Marks `tensors` as optimizer state: state an optimizer creates lazily in its
    /// first step, or brings into memory for an update only (state kept on disk).
    ///
    /// A role holds for a storage's whole life, so call this at any time while the
    /// storages are live: after the step for state that stays, or from inside the step
    /// (`memsave_optim::Observer::state`) for state that is freed within it. Storages
    /// already freed are not found (they stay `temporary`; [`Trace::unplaced_notes`]
    /// counts the miss).
    pub fn optimizer_state(&self, tensors: &[Tensor]) {
        self.shared.roles(tensors, Category::OptimizerState);
    }

    /// Marks `tensors` as gradients: for a gradient freed inside the step before the
    /// recorder sees it at the end, such as one an optimizer fused into backward
    /// updates and frees in its post-accumulate-grad hook (call this from that hook,
    /// or from `memsave_optim::Observer::gradient`, while the gradient is live).
    pub fn gradients(&self, tensors: &[Tensor]) {
        self.shared.roles(tensors, Category::Gradient);
    }
}

/// Records the allocations of a step, knowing which tensors are what.
///
/// Tell it the parameters, the inputs and any optimizer state that exists before the
/// step; gradients are found through the parameters (their `.grad` after
/// accumulation), saved activations through saved-tensor hooks. Everything else
/// allocated and freed inside the step is `temporary`; what remains is `other`.
///
/// # Traps
/// - **Install the meter first.** Storages allocated before the counting allocator
///   was installed (`memsave_meter::install()`) are invisible to the meter and so to
///   the recorder: registering them does nothing ([`Trace::unplaced_notes`] counts it).
/// - **Process-wide.** The CPU allocator's recorder sees every thread; a second
///   recording at the same time is refused ([`TraceError::AlreadyRecording`]).
/// - **Checkpoints.** Tensors saved inside a checkpoint go to the checkpoint's own
///   hooks, not to the recorder: what its recomputation allocates in backward shows
///   as `temporary` (or `other`) unless the step tells the recorder when
///   recomputations run ([`Session::recomputation_start`]): then it is `recompute`.
/// - **One grad hook per parameter.** libtorch keeps one post-accumulate-grad hook
///   per tensor; when a parameter has one already (an optimizer fused into backward),
///   its gradient is found from `.grad` at the end of the step only, and a gradient the
///   hook frees is `temporary` unless the hook tells [`Session::gradients`] (memsave-optim's
///   optimizers do, through `Optimizer::set_observer`).
#[derive(Debug)]
pub struct Recorder {
    device: Device,
    parameters: Vec<Tensor>,
    inputs: Vec<Tensor>,
    optimizer_state: Vec<Tensor>,
    gradient_hooks: bool,
}

impl Recorder {
    /// A recorder for `device` with no tensors registered.
    pub fn new(device: Device) -> Self {
        Self {
            device,
            parameters: Vec::new(),
            inputs: Vec::new(),
            optimizer_state: Vec::new(),
            gradient_hooks: true,
        }
    }

    /// Whether the recorder takes each parameter's post-accumulate-grad hook to note
    /// its gradient as backward writes it (default `true`). Turn it off when the step
    /// registers its own hooks on the parameters after the recording starts (gradients
    /// kept in files, for one): libtorch keeps one such hook per tensor, so the step's
    /// would be refused. Gradients are then found from `.grad` at the end of the step,
    /// or through [`Session::gradients`].
    pub fn gradient_hooks(mut self, on: bool) -> Self {
        self.gradient_hooks = on;
        self
    }

    /// The model's parameters (their gradients are found through them).
    pub fn parameters(mut self, tensors: &[Tensor]) -> Self {
        self.parameters
            .extend(tensors.iter().map(Tensor::shallow_clone));
        self
    }

    /// The step's inputs (and targets).
    pub fn inputs(mut self, tensors: &[Tensor]) -> Self {
        self.inputs
            .extend(tensors.iter().map(Tensor::shallow_clone));
        self
    }

    /// Optimizer state that exists before the step.
    pub fn optimizer_state(mut self, tensors: &[Tensor]) -> Self {
        self.optimizer_state
            .extend(tensors.iter().map(Tensor::shallow_clone));
        self
    }

    /// Runs `step` with the recorder on and returns its value and the trace.
    ///
    /// The recorder is off again when this returns, also when `step` panics.
    pub fn record<T>(self, step: impl FnOnce(&Session) -> T) -> Result<(T, Trace), TraceError> {
        if self.device != Device::Cpu {
            return Err(TraceError::UnsupportedDevice(self.device));
        }
        if !alloc::start_recording()? {
            return Err(TraceError::AlreadyRecording);
        }
        let stop = StopOnDrop;
        let shared = Shared::default();
        shared.roles(&self.parameters, Category::Parameter);
        shared.roles(&self.inputs, Category::Input);
        shared.roles(&self.optimizer_state, Category::OptimizerState);
        // Not held past the note: the step may free them (zero_grad with set_to_none).
        shared.roles(&self.grads(), Category::Gradient);
        let grad_hooks = self.grad_hooks(&shared);
        let session = Session {
            shared: shared.clone(),
        };
        let hooks = SaveRecorder {
            shared: shared.clone(),
        };
        let value = saved_tensors_hooks(hooks, || step(&session));
        drop(grad_hooks);
        shared.roles(&self.grads(), Category::Gradient);
        drop(stop);
        let events = alloc::stop_recording();
        let value = value?;
        let notes = std::mem::take(&mut shared.lock().notes);
        Ok((value, Trace::build(self.device, events, notes)))
    }

    fn grads(&self) -> Vec<Tensor> {
        self.parameters.iter().map(Tensor::grad).collect()
    }

    /// A post-accumulate-grad hook per parameter that notes its `.grad` when backward
    /// writes it; parameters that already have such a hook are left alone.
    fn grad_hooks(&self, shared: &Shared) -> Vec<GradHookHandle> {
        if !self.gradient_hooks {
            return Vec::new();
        }
        self.parameters
            .iter()
            .filter(|p| p.requires_grad())
            .filter_map(|p| {
                let shared = shared.clone();
                register_post_accumulate_grad_hook(
                    p,
                    Box::new(move |t: &Tensor| {
                        shared.roles(&[t.grad()], Category::Gradient);
                        Ok(())
                    }),
                )
                .ok()
            })
            .collect()
    }
}

/// Stops the allocator's recorder if the step unwinds; the normal path stops it first.
struct StopOnDrop;

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = alloc::stop_recording();
        }
    }
}

/// Records `recorder`'s step on `device` with nothing registered: see [`Recorder`].
pub fn record<T>(
    device: Device,
    step: impl FnOnce(&Session) -> T,
) -> Result<(T, Trace), TraceError> {
    Recorder::new(device).record(step)
}

/// Saved-tensor hooks that keep every tensor as it is and note who saved it.
struct SaveRecorder {
    shared: Shared,
}

impl SavedTensorHooks for SaveRecorder {
    type Packed = Tensor;

    fn pack(&self, tensor: &Tensor) -> Result<Tensor, HookError> {
        self.pack_saved_by(tensor, None)
    }

    fn records_ops(&self) -> bool {
        true
    }

    fn pack_saved_by(&self, tensor: &Tensor, saved_by: Option<&str>) -> Result<Tensor, HookError> {
        let producer = memsave_hooks::producer_of(tensor)?;
        let mark = self.shared.lock().mark.clone();
        self.shared.note(NoteKind::Saved {
            ptr: tensor.data_ptr() as u64,
            op: saved_by.unwrap_or("unknown").to_owned(),
            producer,
            mark,
        });
        // Detached: a saved output would otherwise hold its own grad_fn, a reference
        // cycle that keeps a graph never run backward alive. Autograd restores the
        // grad_fn when it unpacks; the storage and version counter are shared.
        Ok(tensor.detach())
    }

    fn unpack(&self, packed: &Tensor) -> Result<Tensor, HookError> {
        // The node backward is running is the one whose saved tensor this is.
        if let Some(node) = memsave_sys::hooks::current_autograd_node_name()? {
            self.shared.note(NoteKind::SavedFor {
                ptr: packed.data_ptr() as u64,
                node,
            });
        }
        Ok(packed.shallow_clone())
    }
}
