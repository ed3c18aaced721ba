//! Whose bytes a step's peak holds: one more step of a configuration at its real size,
//! recorded allocation by allocation (`memsave-trace`), read at its peak. The
//! measured breakdown ([`PeakBreakdown`](crate::PeakBreakdown)) says how much the
//! parameters, the optimizer's state and the input take and how much the step
//! allocates above them; this says what the step's own bytes are: gradients, saved
//! activations, what recomputation allocates, and the rest.
use super::{step_caught, ProbeError, Setup};
use crate::choice::Choice;
use crate::lockstep::Ranks;
use crate::StepRoles;
use memsave_step::step::{StepEvent, StepObserver};
use memsave_step::workload::Workload;
use memsave_step::OptimizerSpec;
use memsave_trace::{block_runs, Category, OptimizerRoles, Phase, Recorder, Session};
use std::sync::Arc;
use tch::{Device, Tensor};

/// The step's own bytes at the peak of one traced step of `choice` on `batch` examples
/// in `micro_batches`, by role, or `None` where no trace is made: on ranks, off the CPU
/// (the recorder reads the counting allocator's events), or when setting up, stepping,
/// tracing or putting the weights back failed: the figures are left out and the fit
/// stands, since [`fit_with`](crate::fit_with) puts the model's state back as it found
/// it whatever ran (and fails if it cannot).
pub(crate) fn step_roles_at_peak(
    workload: &mut dyn Workload,
    optimizer: Option<OptimizerSpec>,
    choice: &Choice,
    batch: i64,
    micro_batches: usize,
    ranks: &Ranks,
) -> Option<StepRoles> {
    if ranks.group().is_some() || workload.device() != Device::Cpu {
        return None;
    }
    let (mut setup, outside) =
        Setup::new(workload, optimizer, choice, batch, micro_batches, ranks).ok()?;
    let warmed = setup.warm_up(&*workload, micro_batches);
    let traced = warmed.and_then(|()| traced(&mut setup, &*workload));
    let back = setup.put_back(&*workload);
    let at_peak = back.and(traced).ok()??;
    // Before the step: the parameters, the input and the optimizer's state (each its
    // role), and what the process held outside the step (the recorder's `other`).
    let before =
        at_peak[Category::Parameter] + at_peak[Category::OptimizerState] + at_peak[Category::Input];
    let own = at_peak.total().saturating_sub(before + outside.bytes);
    let gradients = at_peak[Category::Gradient];
    let saved_activations = at_peak[Category::SavedActivation];
    let recomputed = at_peak[Category::Recompute];
    Some(StepRoles {
        gradients,
        saved_activations,
        recomputed,
        other: own.saturating_sub(gradients + saved_activations + recomputed),
    })
}

/// One step of the set-up probe under the recorder: the bytes by role right after the
/// event that reached its peak; `None` when the step recorded nothing.
fn traced(
    setup: &mut Setup,
    workload: &dyn Workload,
) -> Result<Option<memsave_trace::CategoryBytes>, ProbeError> {
    let inputs: Vec<Tensor> = std::iter::once(&setup.x.input)
        .chain(setup.x.target.as_ref())
        .map(Tensor::shallow_clone)
        .collect();
    let state = setup
        .optimizer
        .as_ref()
        .map(|o| o.state_tensors())
        .unwrap_or_default();
    let params: Vec<Tensor> = setup.params.iter().map(Tensor::shallow_clone).collect();
    let config = setup.config.clone();
    let device = setup.device;
    let (step, trace) = Recorder::new(device)
        .parameters(&params)
        .inputs(&inputs)
        .optimizer_state(&state)
        // Gradients in files take each parameter's one post-accumulate-grad hook.
        .gradient_hooks(config.offload_grads.is_none())
        .record(|session| {
            if let Some(optimizer) = setup.optimizer.as_mut() {
                optimizer.set_observer(Some(Arc::new(OptimizerRoles(session.clone()))));
            }
            // The caller's own block observer, if any, is put back after the step.
            let theirs = memsave_step::plan::planned_blocks(workload).and_then(|b| b.observer());
            if let Some(blocks) = memsave_step::plan::planned_blocks(workload) {
                blocks.set_observer(Some(block_runs(session)));
            }
            let phases = Phases {
                session,
                params: &params,
            };
            let step = step_caught(
                workload,
                &setup.x,
                &config,
                device,
                setup.optimizer.as_mut(),
                None,
                &phases,
                false,
            );
            if let Some(optimizer) = setup.optimizer.as_mut() {
                optimizer.set_observer(None);
            }
            if let Some(blocks) = memsave_step::plan::planned_blocks(workload) {
                blocks.set_observer(theirs);
            }
            session.phase(Phase::Other);
            step
        })
        .map_err(|e| ProbeError::Failed(format!("tracing the step: {e}")))?;
    step?;
    Ok(trace.peak_event().map(|i| trace.bytes_at(i + 1)))
}

/// Tells the recording session the step's phases, and the gradients the optimizer
/// steps from.
struct Phases<'a> {
    session: &'a Session,
    params: &'a [Tensor],
}

impl StepObserver for Phases<'_> {
    fn step_event(&self, event: StepEvent) {
        match event {
            StepEvent::Forward => self.session.phase(Phase::Forward),
            StepEvent::ForwardDone => {}
            StepEvent::Backward => self.session.phase(Phase::Backward),
            StepEvent::Optimizer => {
                let grads: Vec<Tensor> = self.params.iter().map(Tensor::grad).collect();
                self.session.gradients(&grads);
                self.session.phase(Phase::Optimizer);
            }
        }
    }
}
