//! `CheckpointedSequential`: a chain of layers run under a checkpointing plan.
use crate::error::{CheckpointError, Result};
use crate::function::Checkpoint;
use crate::layers::SharedLayer;
use crate::plan::Plan;
use crate::profile::{profile_chain, ChainProfile};
use crate::schedule::{Block, Schedule};
use crate::solver::{predict, Prediction, Solver};
use memsave_meter::Bytes;
use memsave_sys::checkpoint::panic_message;
use std::fmt;
use tch::nn::{self, Module};
use tch::Tensor;

/// A sequence of layers (tch `Module`s or closures) whose forward follows a [`Plan`].
///
/// ```
/// use memsave_checkpoint::{CheckpointedSequential, Plan};
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut seq = CheckpointedSequential::new();
/// for i in 0..6 {
///     let lin = nn::linear(vs.root() / i, 8, 8, Default::default());
///     seq = seq.add_fn(move |x| x + lin.forward(x));
/// }
/// seq.set_plan(Plan::Segments(2)).unwrap();
/// let x = Tensor::rand([4, 8], (Kind::Float, Device::Cpu));
/// let loss = seq.f_forward(&x).unwrap().square().mean(Kind::Float);
/// loss.backward();
/// assert!(seq.explain().contains("segments(2)"));
/// ```
pub struct CheckpointedSequential {
    layers: Vec<SharedLayer>,
    plan: Plan,
    schedule: Schedule,
    profile: Option<ChainProfile>,
    checkpoint: Checkpoint,
}

impl Default for CheckpointedSequential {
    fn default() -> Self {
        Self::new()
    }
}

impl CheckpointedSequential {
    /// An empty sequence with [`Plan::None`].
    pub fn new() -> Self {
        Self {
            layers: Vec::new(),
            plan: Plan::None,
            schedule: Schedule::plain(0),
            profile: None,
            checkpoint: Checkpoint::new(),
        }
    }

    /// Appends a module. The plan falls back to [`Plan::None`] (a changed chain needs a
    /// new plan, and a new profile for [`Plan::Budget`]).
    #[allow(clippy::should_implement_trait)] // tch's `nn::Sequential::add`, which users know
    pub fn add<M: Module + 'static>(mut self, module: M) -> Self {
        self.layers.push(SharedLayer::new(Box::new(module)));
        self.plan = Plan::None;
        self.schedule = Schedule::plain(self.layers.len());
        self.profile = None;
        self
    }

    /// Appends a closure layer.
    pub fn add_fn<F>(self, f: F) -> Self
    where
        F: Fn(&Tensor) -> Tensor + Send + 'static,
    {
        self.add(nn::func(f))
    }

    /// Whether checkpoints restore the RNG state for their recompute (default `true`).
    /// Changing it drops the profile, which measured the other setting.
    pub fn preserve_rng(mut self, preserve: bool) -> Self {
        self.checkpoint = self.checkpoint.preserve_rng(preserve);
        self.profile = None;
        self
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// True when there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The current plan.
    pub fn plan(&self) -> Plan {
        self.plan
    }

    /// The schedule the forward follows.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The profile measured by [`profile`](Self::profile), if any.
    pub fn chain_profile(&self) -> Option<&ChainProfile> {
        self.profile.as_ref()
    }

    /// Measures every layer once on `example` (bytes it saves, bytes of its output,
    /// forward and backward time) and the `loss` on the chain's output. Needed by
    /// [`Plan::Budget`] and by the predictions of [`explain`](Self::explain).
    ///
    /// `params` are the model's parameters; their gradients are set to none.
    pub fn profile(
        &mut self,
        example: &Tensor,
        params: &[Tensor],
        loss: impl Fn(&Tensor) -> Tensor,
    ) -> Result<&ChainProfile> {
        let profile = profile_chain(&self.layers, example, params, &loss, self.checkpoint)?;
        Ok(self.profile.insert(profile))
    }

    /// Chooses the plan; [`Plan::Budget`] solves for a schedule and needs a profile.
    pub fn set_plan(&mut self, plan: Plan) -> Result<()> {
        let n = self.layers.len();
        self.schedule = match plan {
            Plan::None => Schedule::plain(n),
            Plan::EveryLayer => Schedule::every_layer(n),
            Plan::Segments(k) => Schedule::segments(n, k)?,
            Plan::Nested => Schedule::nested(n),
            Plan::Budget(bytes) => {
                let profile = self.profile.as_ref().ok_or(CheckpointError::NotProfiled)?;
                Solver::new(profile).solve_budget(bytes)?
            }
        };
        self.plan = plan;
        Ok(())
    }

    /// Follows an explicit schedule (for example one from [`Solver`]).
    pub fn set_schedule(&mut self, schedule: Schedule) -> Result<()> {
        self.schedule = Schedule::new(schedule.blocks().to_vec(), self.layers.len())?;
        Ok(())
    }

    /// Predicted peak and time of the current schedule; needs a profile.
    pub fn predict(&self) -> Option<Prediction> {
        self.profile.as_ref().map(|p| predict(p, &self.schedule))
    }

    /// The plan, its schedule, and (with a profile) the predicted peak and recompute
    /// cost, for a person to read.
    pub fn explain(&self) -> String {
        let mut out = format!(
            "plan {} over {} layers\nschedule: {}\nlayer forwards per step: {} ({} recomputed)",
            self.plan,
            self.layers.len(),
            self.schedule,
            self.schedule.forward_count(),
            self.schedule.forward_count() - self.layers.len()
        );
        if let Some(p) = self.predict() {
            out.push_str(&format!(
                "\npredicted peak above the step's start: {}\npredicted step time: {:.3} s ({:.2}x the baseline's {:.3} s)",
                Bytes(p.peak_bytes),
                p.step_time_s,
                p.time_ratio(),
                p.baseline_time_s
            ));
        } else {
            out.push_str("\n(no profile: call profile() for predicted peak and time)");
        }
        out
    }

    /// Runs the chain on `x` following the schedule; a panicking layer becomes an `Err`.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        let run = || run_blocks(&self.layers, self.schedule.blocks(), x, self.checkpoint);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|payload| {
            Err(CheckpointError::Torch(format!(
                "a layer panicked: {}",
                panic_message(&*payload)
            )))
        })
    }
}

fn run_blocks(
    layers: &[SharedLayer],
    blocks: &[Block],
    x: &Tensor,
    options: Checkpoint,
) -> Result<Tensor> {
    let mut x = x.shallow_clone();
    for block in blocks {
        x = match block {
            Block::Layer(i) => layers[*i].forward(&x),
            Block::Checkpoint { start, end, inner } => {
                let owned: Vec<SharedLayer> = layers.to_vec();
                let inner = inner.clone();
                debug_assert!(start < end);
                let mut out = options.try_run(&[&x], move |xs| {
                    run_blocks(&owned, &inner, &xs[0], options).map(|y| vec![y])
                })?;
                out.remove(0)
            }
        };
    }
    Ok(x)
}

impl Module for CheckpointedSequential {
    /// # Panics
    /// When a layer fails; use [`CheckpointedSequential::f_forward`] for a `Result`.
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.f_forward(xs).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl fmt::Debug for CheckpointedSequential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointedSequential")
            .field("layers", &self.layers.len())
            .field("plan", &self.plan)
            .field("schedule", &self.schedule.to_string())
            .finish()
    }
}
