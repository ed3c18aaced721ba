//! `GradScaler`: dynamic loss scaling with PyTorch's rules.
use crate::config::GradScalerConfig;
use crate::error::{AmpError, Result};
use crate::outcome::StepOutcome;
use crate::state::GradScalerState;
use std::collections::HashMap;
use tch::{nn, Device, Kind, Tensor};

/// Where one optimizer (one parameter set) is in the current iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Ready,
    Unscaled,
    Stepped,
}

/// Per-optimizer bookkeeping between two `update`s.
#[derive(Debug)]
struct OptimizerState {
    stage: Stage,
    found_inf_per_device: Vec<(Device, Tensor)>,
}

/// Identifies an optimizer by the storages of its parameters, which stay put while
/// training (optimizers update them in place).
type ParamsKey = Vec<usize>;

/// The shape of a 0-dim tensor, as PyTorch keeps the scale and the flags.
const SCALAR: [i64; 0] = [];

fn params_key(params: &[Tensor]) -> ParamsKey {
    let mut key: Vec<usize> = params.iter().map(|p| p.data_ptr() as usize).collect();
    key.sort_unstable();
    key
}

/// Dynamic loss scaling, `torch.amp.GradScaler` with the same rules and defaults.
///
/// One iteration: `let scaled = scaler.f_scale(&loss)?; scaled.f_backward()?;
/// scaler.f_step(&mut opt)?; scaler.f_update()?;`. Optionally call
/// [`f_unscale_`](Self::f_unscale_) before `step` to clip or inspect true gradients.
///
/// The rules a test can check:
/// - `step` unscales the gradients (unless `unscale_` already did) and runs the
///   optimizer only when every gradient is finite; otherwise it skips the step and
///   the parameters stay bit-identical.
/// - `update` multiplies the scale by `backoff_factor` and resets the growth tracker
///   when any inf/NaN was found since the last update; otherwise it increments the
///   tracker, and when the tracker reaches `growth_interval` multiplies the scale by
///   `growth_factor` (only if the result is finite) and resets the tracker.
/// - `unscale_` twice for the same optimizer before `update` is an error, and so is
///   `unscale_` after `step`, or `step` twice.
///
/// Traps: the scale lives on the device of the first loss passed to `scale`; the
/// gradients must not be fp16 (keep f32 master parameters); `update` must run once
/// per iteration after all `step`s, or the next `unscale_`/`step` is refused.
#[derive(Debug, Default)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: Option<Tensor>,
    growth_tracker: Option<Tensor>,
    init_growth_tracker: i64,
    per_optimizer: HashMap<ParamsKey, OptimizerState>,
}

impl GradScaler {
    /// A scaler with `config`, checked by [`GradScalerConfig::validate`].
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            ..Self::default()
        })
    }

    /// The settings in force (the `init_scale` is the one loaded last, if any).
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// Whether scaling is on; a disabled scaler passes everything through.
    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    /// Multiplies `loss` by the current scale (`scaler.scale(loss)`).
    ///
    /// The first call creates the scale (f32) and growth tracker (i32) on the loss's
    /// device. A disabled scaler returns the loss itself.
    pub fn f_scale(&mut self, loss: &Tensor) -> Result<Tensor> {
        if !self.config.enabled {
            return Ok(loss.shallow_clone());
        }
        let device = loss.device();
        let scale = match &self.scale {
            Some(scale) => scale,
            None => {
                let tracker =
                    Tensor::f_full(SCALAR, self.init_growth_tracker, (Kind::Int, device))?;
                self.growth_tracker = Some(tracker);
                self.scale.insert(Tensor::f_full(
                    SCALAR,
                    self.config.init_scale,
                    (Kind::Float, device),
                )?)
            }
        };
        Ok(loss.f_mul(&scale.f_to_device(device)?)?)
    }

    /// Multiplies `loss` by the current scale.
    ///
    /// # Panics
    /// When libtorch fails; see [`f_scale`](Self::f_scale).
    pub fn scale(&mut self, loss: &Tensor) -> Tensor {
        self.f_scale(loss).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Divides the gradients of `optimizer`'s parameters by the scale in place and
    /// records whether any is inf/NaN (`scaler.unscale_(optimizer)`).
    ///
    /// Call it between backward and [`f_step`](Self::f_step) to clip gradients (e.g.
    /// `optimizer.clip_grad_norm(max)` or [`f_clip_grad_norm_`](crate::f_clip_grad_norm_))
    /// at their true magnitude; `step` then does not unscale again. Calling it twice
    /// before [`f_update`](Self::f_update) is an error, because the gradients would be
    /// divided twice.
    pub fn f_unscale_(&mut self, optimizer: &nn::Optimizer) -> Result<()> {
        self.f_unscale_params_(&optimizer.trainable_variables())
    }

    /// Like [`f_unscale_`](Self::f_unscale_).
    ///
    /// # Panics
    /// On the errors of [`f_unscale_`](Self::f_unscale_).
    pub fn unscale_(&mut self, optimizer: &nn::Optimizer) {
        self.f_unscale_(optimizer).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`f_unscale_`](Self::f_unscale_) for an explicit parameter list (e.g.
    /// `vs.trainable_variables()`); the same list identifies the same optimizer.
    pub fn f_unscale_params_(&mut self, params: &[Tensor]) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        let inv_scale = self.inv_scale("unscale_")?;
        let state = self
            .per_optimizer
            .entry(params_key(params))
            .or_insert_with(|| OptimizerState {
                stage: Stage::Ready,
                found_inf_per_device: Vec::new(),
            });
        match state.stage {
            Stage::Unscaled => return Err(AmpError::AlreadyUnscaled),
            Stage::Stepped => return Err(AmpError::UnscaleAfterStep),
            Stage::Ready => {}
        }
        state.found_inf_per_device = unscale_grads(params, &inv_scale)?;
        state.stage = Stage::Unscaled;
        Ok(())
    }

    /// Unscales the gradients (unless [`f_unscale_`](Self::f_unscale_) already did) and
    /// runs `optimizer.step()` only when all of them are finite (`scaler.step`).
    ///
    /// Returns which happened. A skipped step leaves every parameter bit-identical; the
    /// gradients stay as they are (unscaled), so free them before the next iteration.
    /// A disabled scaler always steps.
    pub fn f_step(&mut self, optimizer: &mut nn::Optimizer) -> Result<StepOutcome> {
        let params = optimizer.trainable_variables();
        self.f_step_params(&params, || -> Result<()> {
            optimizer.step();
            Ok(())
        })
    }

    /// [`f_step`](Self::f_step) for any optimizer: unscales the gradients of `params`
    /// (unless [`f_unscale_params_`](Self::f_unscale_params_) already did) and calls
    /// `step` only when every one of them is finite.
    ///
    /// This is how an optimizer that is not tch's (`memsave_optim::AdamW`, say) gets
    /// PyTorch's `scaler.step(optimizer)`: pass its parameters and a closure that steps
    /// it. On [`StepOutcome::SkippedNonFinite`] `step` is not called, so parameters and
    /// optimizer state stay bit-identical. An error returned by `step` is returned as
    /// is, and the iteration counts as stepped (call [`f_update`](Self::f_update) before
    /// the next one). A disabled scaler always calls `step`.
    pub fn f_step_params<E: From<AmpError>>(
        &mut self,
        params: &[Tensor],
        step: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<StepOutcome, E> {
        if !self.config.enabled {
            step()?;
            return Ok(StepOutcome::Stepped);
        }
        if self.scale.is_none() {
            return Err(AmpError::NotScaled { op: "step" }.into());
        }
        let key = params_key(params);
        let stage = self.per_optimizer.get(&key).map(|s| s.stage);
        match stage {
            Some(Stage::Stepped) => return Err(AmpError::AlreadyStepped.into()),
            Some(Stage::Unscaled) => {}
            Some(Stage::Ready) | None => self.f_unscale_params_(params)?,
        }
        let state = self
            .per_optimizer
            .get_mut(&key)
            .expect("unscale_ recorded this optimizer");
        if state.found_inf_per_device.is_empty() {
            // Nothing was unscaled, so the caller may run backward and step again.
            self.per_optimizer.remove(&key);
            return Err(AmpError::NoGradients.into());
        }
        let mut found_inf = 0.0;
        for (_, t) in &state.found_inf_per_device {
            found_inf += t.f_double_value(&[]).map_err(AmpError::from)?;
        }
        state.stage = Stage::Stepped;
        if found_inf == 0.0 {
            step()?;
            Ok(StepOutcome::Stepped)
        } else {
            Ok(StepOutcome::SkippedNonFinite)
        }
    }

    /// Like [`f_step`](Self::f_step).
    ///
    /// # Panics
    /// On the errors of [`f_step`](Self::f_step).
    pub fn step(&mut self, optimizer: &mut nn::Optimizer) -> StepOutcome {
        self.f_step(optimizer).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Updates the scale from the inf checks of this iteration with libtorch's
    /// `_amp_update_scale_` kernel, and readies every optimizer for the next iteration.
    pub fn f_update(&mut self) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        let (Some(scale), Some(tracker)) = (self.scale.as_mut(), self.growth_tracker.as_ref())
        else {
            return Err(AmpError::NotScaled { op: "update" });
        };
        let device = scale.device();
        let mut found_inf: Option<Tensor> = None;
        for state in self.per_optimizer.values() {
            for (_, t) in &state.found_inf_per_device {
                let t = t.f_to_device(device)?;
                found_inf = Some(match found_inf {
                    None => t,
                    Some(sum) => sum.f_add(&t)?,
                });
            }
        }
        let found_inf = found_inf.ok_or(AmpError::NoInfChecks)?;
        let _updated_in_place = scale.f_internal_amp_update_scale_(
            tracker,
            &found_inf,
            self.config.growth_factor,
            self.config.backoff_factor,
            self.config.growth_interval,
        )?;
        self.per_optimizer.clear();
        Ok(())
    }

    /// Like [`f_update`](Self::f_update).
    ///
    /// # Panics
    /// On the errors of [`f_update`](Self::f_update).
    pub fn update(&mut self) {
        self.f_update().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sets the scale to `new_scale` instead of applying the growth/backoff rules
    /// (`scaler.update(new_scale)`); readies every optimizer for the next iteration.
    pub fn f_update_to(&mut self, new_scale: f64) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        if !(new_scale.is_finite() && new_scale > 0.0) {
            return Err(AmpError::InvalidConfig(format!(
                "the new scale must be finite and > 0, got {new_scale}"
            )));
        }
        let scale = self
            .scale
            .as_mut()
            .ok_or(AmpError::NotScaled { op: "update" })?;
        let _filled_in_place = scale.f_fill_(new_scale)?;
        self.per_optimizer.clear();
        Ok(())
    }

    /// The current scale: `init_scale` before the first `scale`, 1.0 when disabled.
    pub fn f_get_scale(&self) -> Result<f64> {
        if !self.config.enabled {
            return Ok(1.0);
        }
        match &self.scale {
            Some(scale) => Ok(scale.f_double_value(&[])?),
            None => Ok(self.config.init_scale),
        }
    }

    /// The current scale.
    ///
    /// # Panics
    /// When the scale cannot be read back from its device; see
    /// [`f_get_scale`](Self::f_get_scale).
    pub fn get_scale(&self) -> f64 {
        self.f_get_scale().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Consecutive finite steps since the scale last changed (0 before the first
    /// `scale` and when disabled).
    pub fn f_get_growth_tracker(&self) -> Result<i64> {
        match (&self.growth_tracker, self.config.enabled) {
            (Some(t), true) => Ok(t.f_int64_value(&[])?),
            (None, true) => Ok(self.init_growth_tracker),
            (_, false) => Ok(0),
        }
    }

    /// The state to save (`scaler.state_dict()`); `None` for a disabled scaler, which
    /// PyTorch saves as an empty dict.
    pub fn state_dict(&self) -> Result<Option<GradScalerState>> {
        if !self.config.enabled {
            return Ok(None);
        }
        Ok(Some(GradScalerState {
            scale: self.f_get_scale()?,
            growth_factor: self.config.growth_factor,
            backoff_factor: self.config.backoff_factor,
            growth_interval: self.config.growth_interval,
            growth_tracker: self.f_get_growth_tracker()?,
        }))
    }

    /// Restores a saved state (`scaler.load_state_dict(...)`); a disabled scaler
    /// ignores it. `None` (the state of a disabled scaler) is an error, as in PyTorch.
    pub fn load_state_dict(&mut self, state: Option<&GradScalerState>) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        let state = state.ok_or(AmpError::EmptyState)?;
        let config = GradScalerConfig {
            init_scale: state.scale,
            growth_factor: state.growth_factor,
            backoff_factor: state.backoff_factor,
            growth_interval: state.growth_interval,
            enabled: true,
        };
        config.validate()?;
        if state.growth_tracker < 0 || state.growth_tracker > i64::from(i32::MAX) {
            return Err(AmpError::InvalidConfig(format!(
                "_growth_tracker must be in 0..=2^31-1, got {}",
                state.growth_tracker
            )));
        }
        if let Some(scale) = self.scale.as_mut() {
            let _filled_in_place = scale.f_fill_(state.scale)?;
        }
        if let Some(tracker) = self.growth_tracker.as_mut() {
            let _filled_in_place = tracker.f_fill_(state.growth_tracker)?;
        }
        self.init_growth_tracker = state.growth_tracker;
        self.config = config;
        Ok(())
    }

    /// The reciprocal of the scale in f32, computed in f64 as PyTorch does.
    fn inv_scale(&self, op: &'static str) -> Result<Tensor> {
        let scale = self.scale.as_ref().ok_or(AmpError::NotScaled { op })?;
        Ok(scale
            .f_to_kind(Kind::Double)?
            .f_reciprocal()?
            .f_to_kind(Kind::Float)?)
    }
}

/// Unscales every defined gradient in place, grouped by device and dtype as PyTorch's
/// `_unscale_grads_` does; returns one found-inf flag per device.
fn unscale_grads(params: &[Tensor], inv_scale: &Tensor) -> Result<Vec<(Device, Tensor)>> {
    let mut groups: Vec<((Device, Kind), Vec<Tensor>)> = Vec::new();
    for p in params {
        let g = p.f_grad()?;
        if !g.defined() {
            continue;
        }
        let kind = g.kind();
        if kind == Kind::Half {
            return Err(AmpError::Fp16Gradients);
        }
        let key = (g.device(), kind);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, grads)) => grads.push(g),
            None => groups.push((key, vec![g])),
        }
    }
    let mut found_inf_per_device: Vec<(Device, Tensor)> = Vec::new();
    let _no_grad = tch::no_grad_guard();
    for ((device, _), grads) in &groups {
        let found_inf = match found_inf_per_device.iter().find(|(d, _)| d == device) {
            Some((_, t)) => t.shallow_clone(),
            None => {
                let t = Tensor::f_zeros(SCALAR, (Kind::Float, *device))?;
                found_inf_per_device.push((*device, t.shallow_clone()));
                t
            }
        };
        let inv_scale = inv_scale.f_to_device(*device)?;
        memsave_sys::tensor::amp_non_finite_check_and_unscale(grads, &found_inf, &inv_scale)?;
    }
    Ok(found_inf_per_device)
}
