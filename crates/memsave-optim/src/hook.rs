//! The step fused into backward: each parameter is updated, and its gradient freed, as
//! soon as its gradient has been accumulated.
use std::sync::{Arc, Mutex, MutexGuard};

use memsave_sys::grad_hooks::{register_post_accumulate_grad_hook, GradHookHandle};
use tch::Tensor;

use crate::error::{OptimError, Result};
use crate::optimizer::{Optimizer, Rule};

/// An optimizer whose step runs inside backward; see [`Optimizer::step_in_backward`].
///
/// Dropping it uninstalls the hooks (and drops the optimizer);
/// [`InBackward::into_inner`] uninstalls them and gives the optimizer back.
#[derive(Debug)]
pub struct InBackward<R: Rule> {
    optimizer: Arc<Mutex<Optimizer<R>>>,
    hooks: Vec<GradHookHandle>,
}

impl<R: Rule> Optimizer<R> {
    /// Moves the step into backward: installs a post-accumulate-grad hook on each of
    /// `params` (all of them this optimizer's) that updates the parameter and then
    /// drops its gradient, during every backward pass, until the returned
    /// [`InBackward`] is dropped or [`InBackward::into_inner`] is called.
    ///
    /// Memory: a gradient lives only from its accumulation to its update, so after
    /// backward no gradient is held. That lowers the peak only where the peak sits at
    /// the end of backward, among the gradients (as with every-layer checkpointing);
    /// without checkpointing, the peak of a plain network usually sits at the start of
    /// backward, among the activations, and stepping inside backward cannot lower it.
    ///
    /// Results: bitwise the same parameters as [`Optimizer::f_step`] after backward,
    /// because each parameter's update reads only its own gradient and state.
    ///
    /// Refused, with [`OptimError::InBackward`]:
    /// - global gradient-norm clipping ([`crate::Options::max_grad_norm`]): the norm
    ///   needs every gradient before the first update;
    /// - a parameter that already has a gradient: gradient accumulation over
    ///   micro-batches cannot be combined with it, because every backward steps;
    /// - an optimizer that has stepped under an enabled GradScaler
    ///   ([`Optimizer::f_step_scaled`]): a GradScaler needs every gradient unscaled and
    ///   checked for inf/NaN before any update, which cannot happen inside backward,
    ///   and the gradients of a scaled loss stepped as they are make steps `scale` times
    ///   too large (65,536x with the default scale) with SGD. To switch such training
    ///   to stepping in backward without a scaler, load its state into a new optimizer.
    ///   [`Optimizer::f_step_scaled`] is refused, in turn, while the steps run in
    ///   backward.
    ///
    /// Not detected: a loss scaled by a GradScaler that this optimizer never saw
    /// (`scaler.scale(&loss).backward()` with the hooks installed). The hook only sees
    /// a gradient, and a scaled gradient looks like any other; whoever builds the
    /// training loop must not combine the two (`memsave-bench` refuses the strategy).
    ///
    /// Traps: a parameter used twice in a graph gets its gradient accumulated once per
    /// backward, after all its uses, so it is still stepped once. Holding
    /// [`InBackward::optimizer`]'s guard during backward makes the backward fail (it
    /// does not deadlock). A parameter can carry only one such hook (libtorch keeps one
    /// per tensor); a second registration fails.
    pub fn step_in_backward(mut self, params: &[Tensor]) -> Result<InBackward<R>> {
        if self.scaled {
            return Err(OptimError::InBackward(
                "this optimizer has stepped under a GradScaler (f_step_scaled); inside backward each parameter would be updated from the scaled gradient before any unscaling or inf/NaN check (an SGD step 65,536x too large with the default scale); keep stepping after backward with f_step_scaled, or load the state into a new optimizer to step in backward without a scaler".into(),
            ));
        }
        if let Some(norm) = self.options.max_grad_norm {
            return Err(OptimError::InBackward(format!(
                "max_grad_norm = {norm} clips with the norm of all gradients together, which is not known until backward ends; clip per parameter yourself or step after backward"
            )));
        }
        let mut indices = Vec::with_capacity(params.len());
        for p in params {
            let Some(index) = self.params.iter().position(|q| same_tensor(p, q)) else {
                return Err(OptimError::InBackward(format!(
                    "a tensor of shape {:?} is not a parameter of this optimizer",
                    p.size()
                )));
            };
            if p.grad().defined() {
                return Err(OptimError::Parameter {
                    index,
                    shape: p.size(),
                    reason: "already has a gradient: stepping in backward cannot accumulate gradients over micro-batches (every backward steps); clear it with zero_grad(true) first".into(),
                });
            }
            indices.push(index);
        }
        self.in_backward = true;
        let optimizer = Arc::new(Mutex::new(self));
        let mut hooks = Vec::with_capacity(params.len());
        for (p, index) in params.iter().zip(indices) {
            let shared = Arc::clone(&optimizer);
            let hook = register_post_accumulate_grad_hook(
                p,
                Box::new(move |t: &Tensor| {
                    let mut opt = shared.try_lock().map_err(|_| {
                        "the optimizer is in use (is InBackward::optimizer() held during backward?)".to_owned()
                    })?;
                    opt.step_param(index)?;
                    Ok(memsave_sys::tensor::set_grad_none(t)?)
                }),
            )
            .map_err(|e| OptimError::Parameter {
                index,
                shape: p.size(),
                reason: e.to_string(),
            })?;
            hooks.push(hook);
        }
        Ok(InBackward { optimizer, hooks })
    }
}

impl<R: Rule> InBackward<R> {
    /// The optimizer, to change learning rates, save its state or step parameters that
    /// have no hook. Release the guard before the next backward.
    pub fn optimizer(&self) -> MutexGuard<'_, Optimizer<R>> {
        self.optimizer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Uninstalls the hooks and gives the optimizer back.
    pub fn into_inner(mut self) -> Result<Optimizer<R>> {
        for hook in self.hooks.drain(..) {
            hook.remove()?;
        }
        let optimizer = Arc::clone(&self.optimizer);
        drop(self);
        Arc::try_unwrap(optimizer)
            .map_err(|_| OptimError::InBackward("a hook still holds the optimizer".into()))
            .map(|m| {
                let mut opt = m
                    .into_inner()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                opt.in_backward = false;
                opt
            })
    }
}

/// True when both handles are the same tensor (same storage, offset and shape).
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.data_ptr() == b.data_ptr() && a.size() == b.size() && a.stride() == b.stride()
}
