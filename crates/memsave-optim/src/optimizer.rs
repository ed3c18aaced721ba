//! The optimizer shared by every update rule: parameters in groups, per-parameter
//! state at a chosen precision and placement, the step, and the gradients.
use std::fmt::Debug;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tch::{Kind, Tensor};

use crate::error::{OptimError, Result};
use crate::number::number;
use crate::observe::{Observer, ObserverSlot};
use crate::placement::{Placement, StateStore};
use crate::scratch::Scratch;
use crate::state::{Buffer, BufferLayout, ParamState, Sign, State};

/// An update rule with its hyper-parameters (one per parameter group): AdamW's or
/// SGD's. The optimizer hands it f32 chunks of a parameter, its gradient and its state
/// buffers; the rule updates the parameter and the buffers in place.
pub trait Rule: Clone + Debug + Send + Serialize + DeserializeOwned + 'static {
    /// The name saved states carry, checked when loading.
    const NAME: &'static str;
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Changes the learning rate, unchecked: [`Optimizer::set_lr`] checks the result
    /// with [`Rule::validate`] before it keeps it.
    fn set_lr(&mut self, lr: f64);
    /// Refuses hyper-parameters out of range (negative, infinite or NaN ones among
    /// them). Every way of giving an optimizer hyper-parameters goes through it: the
    /// constructors, [`Optimizer::add_param_group`], [`Optimizer::set_lr`],
    /// [`Optimizer::set_group`] and [`Optimizer::load_state_dict`].
    fn validate(&self) -> Result<()>;
    /// The state buffers each parameter needs, with whether they can be negative.
    fn buffers(&self) -> &'static [(&'static str, Sign)];
    /// Updates `param` in place from `grad`, reading and updating `buffers` (in the
    /// order of [`Rule::buffers`], zeros before the first step). `step` counts this
    /// parameter's updates, 1 for the first. Runs under `no_grad`.
    ///
    /// `param`, `grad` and the buffers are 1-dim chunks of the same length: a large
    /// parameter is updated a chunk at a time (see [`Scratch`]).
    ///
    /// Warning: tch's ops that take a number (`f_mul_scalar_`, `f_add_scalar_`,
    /// `Tensor::f_scalar_tensor`, ...) panic when they fail, out of memory included,
    /// even in their `f_` form (the number's `Scalar` panics when dropped after a failed
    /// op). Take numbers from [`Scratch::number`] (0-dim tensors of `param`'s kind) and
    /// pass them to the tensor forms instead (`f_mul_`, `f_addcmul_`), take every buffer
    /// from [`Scratch::empty_like`] (and write into it with the `_out` forms), and ask
    /// for them all before the first write, so that running out of memory leaves
    /// `param` and `buffers` as they were, as AdamW and SGD do: the later chunks of a
    /// parameter get the first chunk's back and allocate nothing.
    fn update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buffers: &mut [Tensor],
        step: u64,
        scratch: &mut Scratch,
    ) -> Result<(), tch::TchError>;
}

/// Options that hold for all the parameters of an optimizer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Options {
    /// Precision of the state buffers.
    pub state: State,
    /// Where the state buffers live between steps.
    pub placement: Placement,
    /// Clip the gradients, all together, to this L2 norm before each [`Optimizer::f_step`]
    /// (PyTorch's `clip_grad_norm_` with `max_norm`). Needs every gradient before the
    /// first update, so [`Optimizer::step_in_backward`] refuses it.
    pub max_grad_norm: Option<f64>,
}

/// An optimizer: an update rule applied to groups of parameters, with state kept at
/// [`Options::state`] precision in [`Options::placement`].
///
/// Use it through [`crate::AdamW`] or [`crate::Sgd`].
#[derive(Debug)]
pub struct Optimizer<R: Rule> {
    pub(crate) params: Vec<Tensor>,
    pub(crate) group_of: Vec<usize>,
    pub(crate) groups: Vec<R>,
    pub(crate) states: Vec<ParamState>,
    pub(crate) options: Options,
    pub(crate) store: StateStore,
    pub(crate) observer: ObserverSlot,
    /// Set by [`Optimizer::step_in_backward`] (cleared by `InBackward::into_inner`):
    /// the steps run inside backward, where no GradScaler can unscale them.
    pub(crate) in_backward: bool,
    /// Set by [`Optimizer::f_step_scaled`] with an enabled scaler: the training loop
    /// scales its loss, so stepping inside backward would step scaled gradients.
    pub(crate) scaled: bool,
}

impl<R: Rule> Optimizer<R> {
    /// An optimizer over `params` (one group) with f32 state on their device.
    pub fn new(params: &[Tensor], config: R) -> Result<Self> {
        Self::with_options(params, config, Options::default())
    }

    /// An optimizer over `params` (one group) with the given state precision and placement.
    ///
    /// Every parameter must be a contiguous floating-point tensor that requires grad.
    pub fn with_options(params: &[Tensor], config: R, options: Options) -> Result<Self> {
        options.state.validate()?;
        if let Some(norm) = options.max_grad_norm {
            if !(norm > 0.0 && norm.is_finite()) {
                return Err(OptimError::Config(format!(
                    "max_grad_norm must be positive and finite, got {norm}"
                )));
            }
        }
        let store = StateStore::new(&options.placement)?;
        let mut opt = Self {
            params: Vec::new(),
            group_of: Vec::new(),
            groups: Vec::new(),
            states: Vec::new(),
            options,
            store,
            observer: ObserverSlot::default(),
            in_backward: false,
            scaled: false,
        };
        opt.add_param_group(params, config)?;
        Ok(opt)
    }

    /// Adds a group of parameters with its own hyper-parameters; returns its index.
    pub fn add_param_group(&mut self, params: &[Tensor], config: R) -> Result<usize> {
        config.validate()?;
        for (offset, p) in params.iter().enumerate() {
            let index = self.params.len() + offset;
            let reason = if !p.is_floating_point() {
                Some(format!(
                    "has kind {:?}; only floating-point tensors can be optimized",
                    p.kind()
                ))
            } else if !p.requires_grad() {
                Some("does not require grad".to_owned())
            } else if !p.is_contiguous() {
                Some("is not contiguous; pass a contiguous tensor".to_owned())
            } else if self
                .params
                .iter()
                .chain(&params[..offset])
                .any(|q| q.data_ptr() == p.data_ptr() && q.numel() > 0)
            {
                Some("is already optimized by this optimizer".to_owned())
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(OptimError::Parameter {
                    index,
                    shape: p.size(),
                    reason,
                });
            }
        }
        let group = self.groups.len();
        self.groups.push(config);
        for p in params {
            self.params.push(p.shallow_clone());
            self.group_of.push(group);
            self.states.push(ParamState::default());
        }
        Ok(group)
    }

    /// The parameters, in the order they were added.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// The hyper-parameters of each group.
    pub fn groups(&self) -> &[R] {
        &self.groups
    }

    /// Replaces the hyper-parameters of group `group` (between steps), checked as the
    /// constructor checks them; on error nothing changes.
    pub fn set_group(&mut self, group: usize, config: R) -> Result<()> {
        if group >= self.groups.len() {
            return Err(OptimError::Config(format!(
                "parameter group {group} does not exist: the optimizer has {}",
                self.groups.len()
            )));
        }
        config.validate()?;
        self.groups[group] = config;
        Ok(())
    }

    /// Sets the learning rate of every group (a scheduler's job), checked as the
    /// constructor checks it: a negative, infinite or NaN rate is an error, and then
    /// no group changes.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        let mut groups = self.groups.clone();
        for g in &mut groups {
            g.set_lr(lr);
            g.validate()?;
        }
        self.groups = groups;
        Ok(())
    }

    /// The options the optimizer was built with.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Number of updates of parameter `index` so far (0 before its first gradient).
    pub fn step_count(&self, index: usize) -> u64 {
        self.states.get(index).map_or(0, |s| s.step)
    }

    /// Bytes of state buffers held in memory now (on the parameters' device, or on the
    /// CPU with [`Placement::Cpu`]); 0 with [`Placement::Disk`] between steps.
    pub fn state_bytes(&self) -> u64 {
        self.states
            .iter()
            .flat_map(|s| &s.buffers)
            .map(Buffer::bytes)
            .sum()
    }

    /// The state tensors held in memory now, every parameter's in order (moments,
    /// momentum; 8-bit codes and their block scales): the tensors
    /// [`Optimizer::state_bytes`] counts. Handles to the same storages, to register
    /// with a memory tool; none before the first step, and none with
    /// [`Placement::Disk`] between steps (see [`Observer`] for the state during a step).
    pub fn state_tensors(&self) -> Vec<Tensor> {
        self.states.iter().flat_map(|s| parts(&s.buffers)).collect()
    }

    /// Shows `observer` every gradient this optimizer reads and every parameter's state
    /// while it is in memory, from the next update on (`None` stops it). One observer at
    /// a time: setting one replaces the previous.
    pub fn set_observer(&mut self, observer: Option<Arc<dyn Observer>>) {
        self.observer = ObserverSlot(observer);
    }

    /// Updates every parameter that has a gradient, under `no_grad`; parameters without
    /// one are skipped and their state is untouched (PyTorch's behaviour).
    ///
    /// With [`Options::max_grad_norm`] the gradients are first scaled, in place, so that
    /// their joint L2 norm is at most that.
    ///
    /// # Errors
    /// Running out of memory (on the device, or under the meter's simulated CPU limit)
    /// is [`OptimError::OutOfMemory`], never a panic. The parameters are updated in
    /// order, so those before the one it names are updated and those after it are
    /// not. The one it names: with [`State::F32`] (every allocation of an update comes
    /// before its first write: a parameter of more than 2^12 values on the CPU (chunks
    /// of an eighth of it, at most 2^16 values), 2^20 elsewhere, is updated a chunk at
    /// a time in the [`Scratch`] its first chunk allocated) it, its state and its step count are as they were. To
    /// finish the step once memory is free, call [`Optimizer::f_step_param`] for it and
    /// each parameter after it (calling `f_step` again would step the parameters
    /// already updated a second time); the bits are those of a step that never failed.
    /// With [`State::Bf16`] and
    /// [`State::Int8Blockwise`] it is updated a chunk of 2^20 values at a time, and the
    /// chunks before the failing one keep their update (its step count is not
    /// advanced). With [`Placement::Cpu`] or [`Placement::Disk`], an error moving the
    /// state back after the update leaves the update done and counted. With
    /// `max_grad_norm`, the gradients are clipped before any update: f32 ones all or
    /// none, half-precision ones possibly some.
    pub fn f_step(&mut self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        if let Some(max_norm) = self.options.max_grad_norm {
            self.clip_grad_norm(max_norm)?;
        }
        for index in 0..self.params.len() {
            self.step_param(index)?;
        }
        Ok(())
    }

    /// The step under loss scaling, PyTorch's `scaler.step(optimizer)`: unscales the
    /// gradients (unless `scaler.f_unscale_params_(opt.params())` already did) and
    /// steps only when every gradient is finite. On
    /// [`StepOutcome::SkippedNonFinite`](memsave_amp::StepOutcome) no parameter is
    /// updated: parameters, state buffers and step counts stay bit-identical. Call
    /// `scaler.f_update()` after it, once per iteration, as with tch's optimizers.
    ///
    /// Not available with [`Optimizer::step_in_backward`]: the inf check needs every
    /// gradient before the first update. On an optimizer that steps in backward (through
    /// [`crate::InBackward::optimizer`]) it is refused with [`OptimError::InBackward`]
    /// and the scaler is left untouched; and once an optimizer has stepped under an
    /// enabled scaler, [`Optimizer::step_in_backward`] refuses it.
    pub fn f_step_scaled(
        &mut self,
        scaler: &mut memsave_amp::GradScaler,
    ) -> Result<memsave_amp::StepOutcome> {
        if self.in_backward {
            return Err(OptimError::InBackward(
                "a GradScaler cannot step an optimizer that steps inside backward: every backward already updated its parameters from the gradients as they came, a scaled loss's without unscaling or an inf/NaN check; drop the scaler, or call InBackward::into_inner and step after backward".into(),
            ));
        }
        if scaler.is_enabled() {
            self.scaled = true;
        }
        let params: Vec<Tensor> = self.params.iter().map(Tensor::shallow_clone).collect();
        scaler.f_step_params(&params, || self.f_step())
    }

    /// [`Optimizer::f_step`], panicking on error.
    pub fn step(&mut self) {
        self.f_step()
            .unwrap_or_else(|e| panic!("optimizer step: {e}"))
    }

    /// Clears the gradients: drops them (`set_to_none`, PyTorch's default, frees their
    /// memory) or fills them with zeros (tch's `zero_grad`, keeps the memory).
    pub fn f_zero_grad(&self, set_to_none: bool) -> Result<()> {
        zero_grad(&self.params, set_to_none)
    }

    /// [`Optimizer::f_zero_grad`], panicking on error.
    pub fn zero_grad(&self, set_to_none: bool) {
        self.f_zero_grad(set_to_none)
            .unwrap_or_else(|e| panic!("optimizer zero_grad: {e}"))
    }

    fn clip_grad_norm(&self, max_norm: f64) -> Result<()> {
        let grads: Vec<Tensor> = self
            .params
            .iter()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .collect();
        if grads.is_empty() {
            return Ok(());
        }
        let mut total = 0.0f64;
        for g in &grads {
            let n = g.f_norm()?.f_to_kind(Kind::Double)?.f_double_value(&[])?;
            total += n * n;
        }
        let coef = max_norm / (total.sqrt() + 1e-6);
        if coef < 1.0 {
            // The factor for each gradient first (see `number`): f32 ones then scale
            // in place without allocating, so out of memory leaves them all as they
            // were (a half-precision gradient's product still needs a converted copy
            // of its factor). A double-precision factor for a double gradient.
            let factors = grads
                .iter()
                .map(|g| {
                    let kind = if g.kind() == Kind::Double {
                        Kind::Double
                    } else {
                        Kind::Float
                    };
                    number(coef, kind, g.device())
                })
                .collect::<Result<Vec<_>, _>>()?;
            for (mut g, factor) in grads.into_iter().zip(&factors) {
                let _ = g.f_mul_(factor)?;
            }
        }
        Ok(())
    }

    /// Updates parameter `index` (in the order the parameters were given) if it has a
    /// gradient, under `no_grad`; returns whether it did. Its gradient is left as it
    /// is. For stepping parameters one at a time from your own hook (e.g.
    /// `memsave_hooks::GradOffload::on_complete`); [`Optimizer::f_step`] steps them all.
    ///
    /// Global gradient-norm clipping ([`Options::max_grad_norm`]) is not applied here.
    /// After an error the parameter and its state may be partly updated, except when
    /// out of memory with [`State::F32`]: see [`Optimizer::f_step`]'s errors.
    pub fn f_step_param(&mut self, index: usize) -> Result<bool> {
        if index >= self.params.len() {
            return Err(OptimError::Config(format!(
                "parameter {index} does not exist: the optimizer has {}",
                self.params.len()
            )));
        }
        let _no_grad = tch::no_grad_guard();
        self.step_param(index)
    }

    /// Updates parameter `index` if it has a gradient; returns whether it did.
    ///
    /// After an error the parameter and its state may be partly updated (see
    /// [`Optimizer::f_step`]'s errors); an out-of-memory error names `index`.
    pub(crate) fn step_param(&mut self, index: usize) -> Result<bool> {
        if !self.params[index].grad().defined() {
            return Ok(false);
        }
        let mut st = std::mem::take(&mut self.states[index]);
        let outcome = self.update_param(index, &mut st);
        self.states[index] = st;
        outcome.map(|()| true).map_err(|e| e.in_parameter(index))
    }

    fn update_param(&self, index: usize, st: &mut ParamState) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let param = &self.params[index];
        let grad = param.grad();
        let rule = &self.groups[self.group_of[index]];
        let state = self.options.state;
        let numel = param.numel() as i64;
        let at = |e: tch::TchError| {
            OptimError::torch_out_of_memory(&e, Some(index)).unwrap_or_else(|| {
                OptimError::Parameter {
                    index,
                    shape: param.size(),
                    reason: e.to_string(),
                }
            })
        };
        let layout = BufferLayout {
            state,
            numel,
            signs: rule.buffers(),
            device: param.device(),
        };
        self.store.fetch(index, st, &layout)?;
        if let Some(observer) = &self.observer.0 {
            observer.gradient(index, &grad);
            observer.state(index, &parts(&st.buffers));
        }
        let flat_param = param.f_view([-1]).map_err(at)?;
        let flat_grad = grad.f_reshape([-1]).map_err(at)?;
        let chunk = state.chunk_len(numel, param.device());
        let step = st.step + 1;
        // In f32 the first chunk allocates all the update needs and the later ones
        // reuse it (so running out of memory changes nothing); the half-precision
        // states allocate as they read and write each chunk anyway, so their scratch is
        // made per chunk and freed before the chunk is written back.
        let reuse = state == State::F32;
        let mut scratch = Scratch::default();
        let mut start = 0;
        while start < numel {
            let len = chunk.min(numel - start);
            if reuse {
                scratch.next_chunk();
            } else {
                scratch = Scratch::default();
            }
            let mut p = flat_param.f_narrow(0, start, len).map_err(at)?;
            // Conversions to f32 go through the scratch too, so that the first chunk
            // allocates all the update needs.
            let mut p32 = if p.kind() == Kind::Float {
                p.shallow_clone()
            } else {
                let mut out = scratch.empty_like_kind(&p, Kind::Float).map_err(at)?;
                out.f_copy_(&p).map_err(at)?;
                out
            };
            let mut g = flat_grad.f_narrow(0, start, len).map_err(at)?;
            if g.kind() != Kind::Float {
                let mut out = scratch.empty_like_kind(&g, Kind::Float).map_err(at)?;
                out.f_copy_(&g).map_err(at)?;
                g = out;
            }
            let mut values = st
                .buffers
                .iter()
                .map(|b| b.read(start, len))
                .collect::<Result<Vec<_>>>()?;
            rule.update(&mut p32, &g, &mut values, step, &mut scratch)
                .map_err(at)?;
            if !reuse {
                scratch = Scratch::default();
            }
            if p.kind() != Kind::Float {
                p.f_copy_(&p32).map_err(at)?;
            }
            for (b, v) in st.buffers.iter_mut().zip(&values) {
                b.write(start, len, v)?;
            }
            start += len;
        }
        st.step = step;
        let before: Vec<usize> = parts(&st.buffers)
            .iter()
            .map(|t| t.data_ptr() as usize)
            .collect();
        self.store.keep(index, st)?;
        if let Some(observer) = &self.observer.0 {
            let kept = parts(&st.buffers);
            if !kept.is_empty() && kept.iter().map(|t| t.data_ptr() as usize).ne(before) {
                observer.state(index, &kept);
            }
        }
        Ok(())
    }
}

/// Clears the gradients of `params`: drops them (`set_to_none`, freeing their memory)
/// or fills them with zeros in place; what [`Optimizer::f_zero_grad`] does, for
/// parameters held elsewhere (a sharded optimizer's full parameters).
pub fn zero_grad(params: &[Tensor], set_to_none: bool) -> Result<()> {
    for p in params {
        if set_to_none {
            memsave_sys::tensor::set_grad_none(p)?;
        } else {
            let mut g = p.grad();
            if g.defined() {
                let _no_grad = tch::no_grad_guard();
                let _ = g.f_zero_()?;
            }
        }
    }
    Ok(())
}

/// Handles to the tensors of `buffers`, in order.
fn parts(buffers: &[Buffer]) -> Vec<Tensor> {
    buffers
        .iter()
        .flat_map(|b| b.parts().into_iter().map(|(_, t)| t.shallow_clone()))
        .collect()
}

/// True for a finite number >= 0; false for a negative one, an infinite one and NaN.
///
/// Infinite hyper-parameters are refused as well: they make no sensible step, and a
/// saved state could not hold them (JSON has no infinity; it would be written as
/// `null` and refused on load).
pub(crate) fn non_negative(x: f64) -> bool {
    x >= 0.0 && x.is_finite()
}
