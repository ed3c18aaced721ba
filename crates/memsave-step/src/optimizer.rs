//! The optimizer of a case (`optimizer:` technique): built once per case, stepped
//! after backward or from inside it, and its state bytes reported; whole, sharded
//! over the ranks of a process group (ZeRO-1/2, [`CaseOptimizer::build_sharded`]), or
//! over ZeRO-3's parameter shards ([`CaseOptimizer::build_over_shards`]).
use crate::error::StepError;
use crate::levers::{OptimizerRule, OptimizerSpec, StatePlacement};
use memsave_amp::GradScaler;
use memsave_dist::{Fsdp, ProcessGroup, ZeroOptimizer, ZeroStage};
use memsave_hooks::OnComplete;
use memsave_optim::{AdamW, InBackward, Observer, Optimizer, Rule, Sgd};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// Why an optimizer stepping in backward cannot run under an enabled `GradScaler`.
pub(crate) const SCALER_IN_BACKWARD: &str = "a GradScaler cannot be combined with an optimizer stepping in backward (in_backward): each parameter's step would see its gradient multiplied by the loss scale; drop the scaler or step the optimizer after backward";

/// Why an enabled `GradScaler` cannot run with a ZeRO optimizer.
pub(crate) const SCALER_WITH_ZERO: &str = "grad_scaler cannot run with zero: the sharded optimizer's step has no unscale or inf/NaN check (each rank holds only its shard of the gradients); drop grad_scaler, or run data parallel without zero";

/// Why an optimizer stepping in backward cannot be sharded (ZeRO).
pub(crate) const IN_BACKWARD_ZERO: &str = "optimizer in_backward cannot run with zero: zero steps each rank's shard of the parameters after backward, from gradients reduced over the ranks; drop in_backward";

/// The optimizer, stepping after backward or from hooks inside it.
enum Stepper<R: Rule> {
    After(Optimizer<R>),
    InBackward(InBackward<R>),
    /// Stepped in backward one parameter at a time by a `GradOffload`'s
    /// `on_complete`, which holds the parameters' hook slots.
    Offloaded(Arc<Mutex<Optimizer<R>>>),
    /// Stepped in backward one shard at a time by ZeRO-3 (`Fsdp::step_in_backward`),
    /// as each unit's gradients are reduce-scattered into its shard.
    ShardsInBackward(Arc<Mutex<Optimizer<R>>>),
    /// Only while switching to `Offloaded`.
    Switching,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<R: Rule> Stepper<R> {
    fn new(opt: Optimizer<R>, in_backward: bool, params: &[Tensor]) -> Result<Self, StepError> {
        if in_backward {
            Ok(Stepper::InBackward(
                opt.step_in_backward(params).map_err(optimizer_error)?,
            ))
        } else {
            Ok(Stepper::After(opt))
        }
    }

    /// For an optimizer in backward whose gradients a `GradOffload` keeps: its hooks
    /// move to the offload (which gets the returned function as `on_complete`) and it
    /// stays stepped that way. `None` for an optimizer stepping after backward.
    fn param_stepper(&mut self, params: &[Tensor]) -> Result<Option<OnComplete>, StepError> {
        if let Stepper::InBackward(_) = self {
            let Stepper::InBackward(hooked) = std::mem::replace(self, Stepper::Switching) else {
                unreachable!("matched above")
            };
            let opt = hooked.into_inner().map_err(optimizer_error)?;
            *self = Stepper::Offloaded(Arc::new(Mutex::new(opt)));
        }
        let Stepper::Offloaded(shared) = self else {
            return Ok(None);
        };
        // The offload numbers the step's parameters; the optimizer, its own.
        let index: Vec<usize> = {
            let opt = lock(shared);
            params
                .iter()
                .map(|p| {
                    opt.params()
                        .iter()
                        .position(|q| q.data_ptr() == p.data_ptr() && q.size() == p.size())
                        .ok_or_else(|| {
                            StepError::invalid(format!(
                                "a parameter of shape {:?} is not the optimizer's",
                                p.size()
                            ))
                        })
                })
                .collect::<Result<_, StepError>>()?
        };
        let shared = Arc::clone(shared);
        Ok(Some(Box::new(move |i: usize, p: &Tensor| {
            let mut opt = shared
                .try_lock()
                .map_err(|_| "the optimizer is in use during backward")?;
            opt.f_step_param(index[i])?;
            memsave_sys::tensor::set_grad_none(p)?;
            Ok(())
        })))
    }

    fn step(&mut self, scaler: Option<&mut GradScaler>) -> Result<(), StepError> {
        let Stepper::After(opt) = self else {
            // Stepped by the hooks during backward, from gradients a scaler would have
            // scaled: refused rather than passed over, so the mistake is not silent.
            if self.steps_in_backward() && scaler.is_some_and(|s| s.is_enabled()) {
                return Err(StepError::invalid(SCALER_IN_BACKWARD));
            }
            return Ok(());
        };
        match scaler {
            Some(scaler) => {
                opt.f_step_scaled(scaler).map_err(optimizer_error)?;
                scaler
                    .f_update()
                    .map_err(|e| StepError::lever("grad_scaler", e))?;
            }
            None => opt.f_step().map_err(optimizer_error)?,
        }
        opt.f_zero_grad(true).map_err(optimizer_error)
    }

    fn steps_in_backward(&self) -> bool {
        matches!(
            self,
            Stepper::InBackward(_) | Stepper::Offloaded(_) | Stepper::ShardsInBackward(_)
        )
    }

    fn state_bytes(&self) -> u64 {
        match self {
            Stepper::After(opt) => opt.state_bytes(),
            Stepper::InBackward(hooked) => hooked.optimizer().state_bytes(),
            Stepper::Offloaded(shared) | Stepper::ShardsInBackward(shared) => {
                lock(shared).state_bytes()
            }
            Stepper::Switching => 0,
        }
    }

    fn state_tensors(&self) -> Vec<Tensor> {
        match self {
            Stepper::After(opt) => opt.state_tensors(),
            Stepper::InBackward(hooked) => hooked.optimizer().state_tensors(),
            Stepper::Offloaded(shared) | Stepper::ShardsInBackward(shared) => {
                lock(shared).state_tensors()
            }
            Stepper::Switching => Vec::new(),
        }
    }

    fn set_observer(&mut self, observer: Option<Arc<dyn Observer>>) {
        match self {
            Stepper::After(opt) => opt.set_observer(observer),
            Stepper::InBackward(hooked) => hooked.optimizer().set_observer(observer),
            Stepper::Offloaded(shared) | Stepper::ShardsInBackward(shared) => {
                lock(shared).set_observer(observer)
            }
            Stepper::Switching => {}
        }
    }

    /// Runs `f` on the optimizer, wherever it is held.
    fn with<T>(&mut self, f: impl FnOnce(&mut Optimizer<R>) -> T) -> Option<T> {
        match self {
            Stepper::After(opt) => Some(f(opt)),
            Stepper::InBackward(hooked) => Some(f(&mut hooked.optimizer())),
            Stepper::Offloaded(shared) | Stepper::ShardsInBackward(shared) => {
                Some(f(&mut lock(shared)))
            }
            Stepper::Switching => None,
        }
    }

    fn params(&self) -> Vec<Tensor> {
        let copy = |p: &[Tensor]| p.iter().map(Tensor::shallow_clone).collect();
        match self {
            Stepper::After(opt) => copy(opt.params()),
            Stepper::InBackward(hooked) => copy(hooked.optimizer().params()),
            Stepper::Offloaded(shared) | Stepper::ShardsInBackward(shared) => {
                copy(lock(shared).params())
            }
            Stepper::Switching => Vec::new(),
        }
    }
}

/// A case's optimizer, with a temporary directory for `placement: disk` that lives as
/// long as it does: whole ([`build`](Self::build)), or this rank's ZeRO shard of it
/// ([`build_sharded`](Self::build_sharded)), whose [`state_bytes`](Self::state_bytes)
/// are the shard's.
pub struct CaseOptimizer {
    stepper: Box<dyn Step>,
    _dir: Option<tempfile::TempDir>,
}

/// What the runner needs of either rule's [`Stepper`].
trait Step {
    fn step(&mut self, scaler: Option<&mut GradScaler>) -> Result<(), StepError>;
    fn steps_in_backward(&self) -> bool;
    fn state_bytes(&self) -> u64;
    fn state_tensors(&self) -> Vec<Tensor>;
    fn set_observer(&mut self, observer: Option<Arc<dyn Observer>>);
    fn param_stepper(&mut self, params: &[Tensor]) -> Result<Option<OnComplete>, StepError>;
    /// The ZeRO stage of a sharded optimizer; `None` for a whole one.
    fn zero_stage(&self) -> Option<ZeroStage> {
        None
    }
    /// The tensors it steps; none for ZeRO-1/2, whose flat slices are its own.
    fn params(&self) -> Vec<Tensor>;
    /// Whether ZeRO-3 steps it in backward (`Fsdp::step_in_backward`).
    fn steps_shards_in_backward(&self) -> bool {
        false
    }
    /// Sets the learning rate of `group` (every group: `None`).
    fn set_lr(&mut self, group: Option<usize>, lr: f64) -> Result<(), StepError>;
    /// The learning rate of each group.
    fn lrs(&mut self) -> Vec<f64>;
    /// Writes the state to `path` (`Optimizer::save`).
    fn save(&mut self, path: &Path) -> Result<(), StepError> {
        let _ = path;
        Err(StepError::invalid(SHARDED_SAVE))
    }
    /// Reads the state from `path` (`Optimizer::load`).
    fn load(&mut self, path: &Path) -> Result<(), StepError> {
        let _ = path;
        Err(StepError::invalid(SHARDED_SAVE))
    }
    /// `Fsdp::save_sharded` with this optimizer (over `fsdp`'s shards).
    fn save_sharded(&mut self, fsdp: &Fsdp, dir: &Path, step: u64) -> Result<(), StepError> {
        let _ = (fsdp, dir, step);
        Err(StepError::invalid(SHARDED_SAVE))
    }
    /// `Fsdp::load_sharded` into this optimizer; the step saved.
    fn load_sharded(&mut self, fsdp: &Fsdp, dir: &Path) -> Result<u64, StepError> {
        let _ = (fsdp, dir);
        Err(StepError::invalid(SHARDED_SAVE))
    }
}

/// Why a ZeRO-1/2 optimizer's state is not saved through the trainer.
const SHARDED_SAVE: &str = "a ZeRO optimizer's state is sharded over the ranks: save and load it with memsave_dist's sharded checkpoint, not through the trainer";

/// Sets `lr` on `group` of `opt`, or on every group.
fn set_lr<R: Rule>(opt: &mut Optimizer<R>, group: Option<usize>, lr: f64) -> Result<(), StepError> {
    let set = match group {
        None => opt.set_lr(lr),
        Some(g) => {
            let Some(mut config) = opt.groups().get(g).cloned() else {
                return Err(StepError::invalid(format!(
                    "parameter group {g} does not exist: the optimizer has {}",
                    opt.groups().len()
                )));
            };
            config.set_lr(lr);
            opt.set_group(g, config)
        }
    };
    set.map_err(|e| StepError::invalid(e.to_string()))
}

/// The optimizer is being switched to a gradient offload's stepping.
fn switching() -> StepError {
    StepError::invalid("the optimizer is being handed to the gradient offload")
}

/// A ZeRO optimizer (`memsave_dist::ZeroOptimizer`): this rank's shard of the state,
/// stepped after backward from the gradients reduced over the ranks.
struct Sharded<R: Rule>(ZeroOptimizer<R>);

impl<R: Rule> Step for Sharded<R> {
    fn step(&mut self, scaler: Option<&mut GradScaler>) -> Result<(), StepError> {
        // A disabled scaler scales nothing; an enabled one is refused before the step.
        if scaler.is_some_and(|s| s.is_enabled()) {
            return Err(StepError::invalid(SCALER_WITH_ZERO));
        }
        self.0.f_step().map_err(zero_error)?;
        self.0.f_zero_grad(true).map_err(zero_error)
    }
    fn steps_in_backward(&self) -> bool {
        false
    }
    fn state_bytes(&self) -> u64 {
        self.0.state_bytes()
    }
    fn state_tensors(&self) -> Vec<Tensor> {
        self.0.state_tensors()
    }
    fn set_observer(&mut self, observer: Option<Arc<dyn Observer>>) {
        self.0.inner_mut().set_observer(observer);
    }
    fn param_stepper(&mut self, _params: &[Tensor]) -> Result<Option<OnComplete>, StepError> {
        Ok(None)
    }
    fn zero_stage(&self) -> Option<ZeroStage> {
        Some(self.0.stage())
    }
    fn params(&self) -> Vec<Tensor> {
        Vec::new()
    }
    fn set_lr(&mut self, group: Option<usize>, lr: f64) -> Result<(), StepError> {
        set_lr(self.0.inner_mut(), group, lr)
    }
    fn lrs(&mut self) -> Vec<f64> {
        self.0.inner_mut().groups().iter().map(Rule::lr).collect()
    }
}

impl<R: Rule> Step for Stepper<R> {
    fn step(&mut self, scaler: Option<&mut GradScaler>) -> Result<(), StepError> {
        Stepper::step(self, scaler)
    }
    fn steps_in_backward(&self) -> bool {
        Stepper::steps_in_backward(self)
    }
    fn state_bytes(&self) -> u64 {
        Stepper::state_bytes(self)
    }
    fn state_tensors(&self) -> Vec<Tensor> {
        Stepper::state_tensors(self)
    }
    fn set_observer(&mut self, observer: Option<Arc<dyn Observer>>) {
        Stepper::set_observer(self, observer);
    }
    fn param_stepper(&mut self, params: &[Tensor]) -> Result<Option<OnComplete>, StepError> {
        Stepper::param_stepper(self, params)
    }
    fn params(&self) -> Vec<Tensor> {
        Stepper::params(self)
    }
    fn steps_shards_in_backward(&self) -> bool {
        matches!(self, Stepper::ShardsInBackward(_))
    }
    fn set_lr(&mut self, group: Option<usize>, lr: f64) -> Result<(), StepError> {
        self.with(|opt| set_lr(opt, group, lr))
            .unwrap_or_else(|| Err(switching()))
    }
    fn lrs(&mut self) -> Vec<f64> {
        self.with(|opt| opt.groups().iter().map(Rule::lr).collect())
            .unwrap_or_default()
    }
    fn save(&mut self, path: &Path) -> Result<(), StepError> {
        self.with(|opt| opt.save(path).map_err(optimizer_error))
            .unwrap_or_else(|| Err(switching()))
    }
    fn load(&mut self, path: &Path) -> Result<(), StepError> {
        self.with(|opt| opt.load(path).map_err(optimizer_error))
            .unwrap_or_else(|| Err(switching()))
    }
    fn save_sharded(&mut self, fsdp: &Fsdp, dir: &Path, step: u64) -> Result<(), StepError> {
        self.with(|opt| fsdp.save_sharded(dir, opt, step).map_err(zero_error))
            .unwrap_or_else(|| Err(switching()))
    }
    fn load_sharded(&mut self, fsdp: &Fsdp, dir: &Path) -> Result<u64, StepError> {
        self.with(|opt| fsdp.load_sharded(dir, opt).map_err(zero_error))
            .unwrap_or_else(|| Err(switching()))
    }
}

impl CaseOptimizer {
    /// The optimizer `spec` asks for over `params`, with the hyperparameters of
    /// [`OptimizerSpec::rule`] (each one not given is the kind's default: `lr: 1e-3`
    /// for both kinds, PyTorch's defaults for the rest). An invalid spec (a negative
    /// `lr`, `momentum` with AdamW, ...) is an error here, before any step.
    pub fn build(spec: &OptimizerSpec, params: &[Tensor]) -> Result<Self, StepError> {
        let rule = spec.rule().map_err(|e| StepError::invalid(e.to_string()))?;
        let dir = state_dir(spec)?;
        let options = spec.options(dir.as_ref().map(tempfile::TempDir::path));
        let stepper: Box<dyn Step> = match rule {
            OptimizerRule::AdamW(config) => {
                let opt = AdamW::with_options(params, config, options).map_err(optimizer_error)?;
                Box::new(Stepper::new(opt, spec.in_backward, params)?)
            }
            OptimizerRule::Sgd(config) => {
                let opt = Sgd::with_options(params, config, options).map_err(optimizer_error)?;
                Box::new(Stepper::new(opt, spec.in_backward, params)?)
            }
        };
        Ok(Self { stepper, _dir: dir })
    }

    /// The optimizer `spec` asks for over `params`, sharded over the ranks of `group`
    /// at ZeRO `stage` (`memsave_dist::ZeroOptimizer`): this rank keeps and updates
    /// 1/N of the state (and, at stage 2, of the gradients), with `spec`'s state
    /// precision and placement (`disk`: a temporary directory of this process's, the
    /// shard's files in `rank-R` below it). Building it is a collective: every rank
    /// builds it over the same parameters, and rank 0's values are copied to all.
    ///
    /// `in_backward` is refused (the shard is stepped after backward, from gradients
    /// reduced over the ranks), as is any parameter that is not a contiguous f32 CPU
    /// tensor requiring grad.
    pub fn build_sharded(
        spec: &OptimizerSpec,
        params: &[Tensor],
        group: &ProcessGroup,
        stage: ZeroStage,
    ) -> Result<Self, StepError> {
        if spec.in_backward {
            return Err(StepError::invalid(IN_BACKWARD_ZERO));
        }
        let rule = spec.rule().map_err(|e| StepError::invalid(e.to_string()))?;
        let dir = state_dir(spec)?;
        let options = spec.options(dir.as_ref().map(tempfile::TempDir::path));
        let stepper: Box<dyn Step> = match rule {
            OptimizerRule::AdamW(config) => Box::new(Sharded(
                ZeroOptimizer::new(group, params, config, options, stage).map_err(zero_error)?,
            )),
            OptimizerRule::Sgd(config) => Box::new(Sharded(
                ZeroOptimizer::new(group, params, config, options, stage).map_err(zero_error)?,
            )),
        };
        Ok(Self { stepper, _dir: dir })
    }

    /// The optimizer `spec` asks for over the shards of ZeRO-3 (`fsdp`'s parameters,
    /// each parameter's part of this rank's 1/N of its unit), with every rule, state
    /// precision and placement [`build`](Self::build) takes (8-bit state's blocks then
    /// run over each parameter's shard from its first value, not over each whole
    /// parameter). A parameter no rank used in a step keeps no gradient and is skipped.
    /// With `in_backward` it is handed to `Fsdp::step_in_backward`: each shard steps as
    /// soon as its unit's gradients are reduce-scattered into it, and
    /// [`step`](Self::step) does nothing.
    pub fn build_over_shards(spec: &OptimizerSpec, fsdp: &Fsdp) -> Result<Self, StepError> {
        if !spec.in_backward && fsdp.shard_dir().is_some() {
            return Err(StepError::invalid(
                crate::parallel::OFFLOAD_PARAMS_AFTER_BACKWARD,
            ));
        }
        let shards = fsdp.parameters();
        if !spec.in_backward {
            return Self::build(spec, &shards);
        }
        let rule = spec.rule().map_err(|e| StepError::invalid(e.to_string()))?;
        let dir = state_dir(spec)?;
        let options = spec.options(dir.as_ref().map(tempfile::TempDir::path));
        let hooked = |e| StepError::lever("zero", e);
        let stepper: Box<dyn Step> = match rule {
            OptimizerRule::AdamW(config) => {
                let opt = AdamW::with_options(&shards, config, options).map_err(optimizer_error)?;
                Box::new(Stepper::ShardsInBackward(
                    fsdp.step_in_backward(opt).map_err(hooked)?,
                ))
            }
            OptimizerRule::Sgd(config) => {
                let opt = Sgd::with_options(&shards, config, options).map_err(optimizer_error)?;
                Box::new(Stepper::ShardsInBackward(
                    fsdp.step_in_backward(opt).map_err(hooked)?,
                ))
            }
        };
        Ok(Self { stepper, _dir: dir })
    }

    /// The ZeRO stage of an optimizer built by [`build_sharded`](Self::build_sharded);
    /// `None` for a whole one.
    pub fn zero_stage(&self) -> Option<ZeroStage> {
        self.stepper.zero_stage()
    }

    /// Whether it steps exactly `params`, in order (the same tensors).
    pub(crate) fn steps_exactly(&self, params: &[Tensor]) -> bool {
        let own = self.stepper.params();
        own.len() == params.len()
            && own
                .iter()
                .zip(params)
                .all(|(a, b)| a.data_ptr() == b.data_ptr() && a.size() == b.size())
    }

    /// Whether ZeRO-3 steps it in backward ([`build_over_shards`](Self::build_over_shards)
    /// with `in_backward`).
    pub(crate) fn steps_shards_in_backward(&self) -> bool {
        self.stepper.steps_shards_in_backward()
    }

    /// The step after backward (nothing with `in_backward`: the hooks stepped), under
    /// the scaler when there is one, then the gradients freed.
    ///
    /// An enabled scaler with an optimizer that [steps in
    /// backward](Self::steps_in_backward) is an error: its hooks already stepped each
    /// parameter from the scaled gradient (steps `scale` times too large, 65,536 with
    /// the default scale) and nothing here can undo that. [`f_step_with`](crate::f_step_with)
    /// refuses the combination before the forward, which is where to catch it; a
    /// disabled scaler, which scales nothing, is accepted.
    pub fn step(&mut self, scaler: Option<&mut GradScaler>) -> Result<(), StepError> {
        self.stepper.step(scaler)
    }

    /// Whether the optimizer steps inside backward (built `in_backward`, stepped from
    /// its hooks or, after [`param_stepper`](Self::param_stepper), from a gradient
    /// offload): each parameter is updated from its gradient as backward produces it,
    /// before anything could unscale or check it, so it cannot run under a loss scaler.
    pub fn steps_in_backward(&self) -> bool {
        self.stepper.steps_in_backward()
    }

    /// For an optimizer built `in_backward`, when the step's gradients are offloaded
    /// (`memsave_hooks::GradOffload`, which takes the parameters' hook slots): the
    /// function to give the offload as `on_complete`, stepping one parameter of
    /// `params` and freeing its gradient. From then on the optimizer is stepped only
    /// that way. `None` for one stepping after backward.
    pub fn param_stepper(&mut self, params: &[Tensor]) -> Result<Option<OnComplete>, StepError> {
        self.stepper.param_stepper(params)
    }

    /// Bytes of optimizer state held in memory now.
    pub fn state_bytes(&self) -> u64 {
        self.stepper.state_bytes()
    }

    /// The state tensors held in memory now (what [`state_bytes`](Self::state_bytes)
    /// counts), to register with a memory recorder.
    pub fn state_tensors(&self) -> Vec<Tensor> {
        self.stepper.state_tensors()
    }

    /// Sets the learning rate of every parameter group (PyTorch's
    /// `for g in opt.param_groups: g["lr"] = lr`), between steps. A negative, infinite
    /// or NaN rate is refused and nothing changes.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), StepError> {
        self.stepper.set_lr(None, lr)
    }

    /// Sets the learning rate of parameter group `group` only (PyTorch's
    /// `opt.param_groups[group]["lr"] = lr`); a group that does not exist is refused.
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<(), StepError> {
        self.stepper.set_lr(Some(group), lr)
    }

    /// The learning rate of each parameter group, in order (a scheduler's
    /// `get_last_lr()`).
    pub fn lrs(&mut self) -> Vec<f64> {
        self.stepper.lrs()
    }

    /// Writes the optimizer's state (step counts, moments, hyper-parameters) to `path`
    /// (`memsave_optim::Optimizer::save`, with a CRC-32 per tensor). A ZeRO-1/2
    /// optimizer's state is refused: it is sharded over the ranks.
    pub fn save(&mut self, path: impl AsRef<Path>) -> Result<(), StepError> {
        self.stepper.save(path.as_ref())
    }

    /// Reads a state written by [`save`](Self::save) into this optimizer, bit for bit;
    /// a state that does not fit (another rule, precision or parameter shapes) or whose
    /// bytes changed is refused and the optimizer keeps its own.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<(), StepError> {
        self.stepper.load(path.as_ref())
    }

    /// Saves a sharded checkpoint of ZeRO-3 training in `dir` (`Fsdp::save_sharded`:
    /// each rank's shards, its part of this optimizer's state, `step` and the RNG state,
    /// committed across the ranks). The optimizer must be `fsdp`'s
    /// ([`build_over_shards`](Self::build_over_shards)). A collective.
    pub(crate) fn save_sharded(
        &mut self,
        fsdp: &Fsdp,
        dir: &Path,
        step: u64,
    ) -> Result<(), StepError> {
        self.stepper.save_sharded(fsdp, dir, step)
    }

    /// Loads a checkpoint written by [`save_sharded`](Self::save_sharded) into `fsdp`'s
    /// shards and this optimizer (all ranks or none); returns its step. A collective.
    pub(crate) fn load_sharded(&mut self, fsdp: &Fsdp, dir: &Path) -> Result<u64, StepError> {
        self.stepper.load_sharded(fsdp, dir)
    }

    /// Shows `observer` the gradients and state the optimizer works with during its
    /// steps (see [`memsave_optim::Observer`]); `None` stops it.
    pub fn set_observer(&mut self, observer: Option<Arc<dyn Observer>>) {
        self.stepper.set_observer(observer);
    }
}

/// The model's weights, copied out of libtorch's memory (so that keeping them does not
/// count as allocated), to put back after a case whose optimizer changed them.
pub struct SavedWeights {
    params: Vec<Tensor>,
    values: Vec<Vec<f32>>,
}

impl SavedWeights {
    /// Copies the values of `params` to host memory.
    pub fn save(params: &[Tensor]) -> Result<Self, StepError> {
        let values = params
            .iter()
            .map(|p| {
                let flat = p
                    .f_detach()
                    .and_then(|d| d.f_reshape([-1]))
                    .and_then(|d| d.f_to_kind(tch::Kind::Float))?;
                Ok(Vec::<f32>::try_from(&flat)?)
            })
            .collect::<Result<_, StepError>>()?;
        Ok(Self {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            values,
        })
    }

    /// Writes the saved values back into the parameters.
    pub fn restore(&self) -> Result<(), StepError> {
        let _no_grad = tch::no_grad_guard();
        for (p, values) in self.params.iter().zip(&self.values) {
            let saved = Tensor::from_slice(values)
                .f_to_device(p.device())
                .and_then(|t| t.f_to_kind(p.kind()))
                .and_then(|t| t.f_view(p.size().as_slice()))?;
            let mut p = p.shallow_clone();
            p.f_copy_(&saved)?;
        }
        Ok(())
    }
}

/// A temporary directory for `placement: disk`, removed when dropped.
fn state_dir(spec: &OptimizerSpec) -> Result<Option<tempfile::TempDir>, StepError> {
    match spec.placement {
        StatePlacement::Disk => tempfile::Builder::new()
            .prefix("memsave-optimizer-")
            .tempdir()
            .map(Some)
            .map_err(|source| StepError::Io {
                what: "cannot make a directory for the optimizer state".into(),
                source,
            }),
        _ => Ok(None),
    }
}

/// An error of a ZeRO optimizer: the sharded optimizer's own (out of memory stays
/// [`StepError::OutOfMemory`]) or the collective's.
fn zero_error(e: memsave_dist::DistError) -> StepError {
    match e {
        memsave_dist::DistError::Optim { source, .. } => optimizer_error(source),
        other => StepError::lever("zero", other),
    }
}

/// An error of the optimizer (`memsave-optim`), as the step reports it: out of memory
/// stays [`StepError::OutOfMemory`].
fn optimizer_error(e: memsave_optim::OptimError) -> StepError {
    if e.is_out_of_memory() {
        StepError::OutOfMemory {
            message: e.to_string(),
            source: Box::new(e),
        }
    } else {
        StepError::Lever {
            lever: "optimizer",
            source: Box::new(e),
        }
    }
}
