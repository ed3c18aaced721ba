//! `CheckpointedSequential`: a chain of layers run under a checkpointing plan.
use crate::blocks::{BlockLever, Blocks, LeversSnapshot};
use crate::error::{catching_panics, CheckpointError, Result};
use crate::function::Checkpoint;
use crate::layers::SharedLayer;
use crate::levers::{profile_levers, BoundaryStore, Lever, LeverProfile, LeverStats};
use crate::plan::Plan;
use crate::profile::{profile_chain, ChainProfile};
use crate::schedule::{Block, Schedule};
use crate::solver::{predict_with_levers, Prediction, Solver};
use memsave_meter::Bytes;
use std::fmt;
use std::sync::Arc;
use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

/// A sequence of layers (tch `Module`s or closures) whose forward follows a [`Plan`].
///
/// ```
/// use memsave_checkpoint::{CheckpointedSequential, Plan};
/// use tch::nn::{self, Module, ModuleT};
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
    levers: Vec<Lever>,
    lever_profiles: Vec<LeverProfile>,
    /// The engine every forward runs on: the schedule's checkpoints are its blocks
    /// (`layers a..b`), and under [`Plan::PerLayer`] every layer is one (`layer i`).
    blocks: Blocks,
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
            // Recomputations stop between layers (see run_blocks), never inside one.
            checkpoint: Checkpoint::new().early_stop(false),
            levers: Vec::new(),
            lever_profiles: Vec::new(),
            blocks: Blocks::new(),
        }
    }

    /// Appends a module. The plan falls back to [`Plan::None`] (a changed chain needs a
    /// new plan, and a new profile for [`Plan::Budget`]).
    ///
    /// A `Module` ignores the train flag; add layers whose forward depends on it
    /// (BatchNorm, dropout) with [`add_t`](Self::add_t).
    #[allow(clippy::should_implement_trait)] // tch's `nn::Sequential::add`, which users know
    pub fn add<M: Module + 'static>(self, module: M) -> Self {
        self.add_t(module)
    }

    /// Appends a module whose forward takes a train flag (tch's `ModuleT`: BatchNorm,
    /// dropout, tch's `SequentialT`, `FuncT`). [`f_forward_t`](Self::f_forward_t) hands
    /// it the flag; a checkpoint's recomputation in backward runs it with the same flag
    /// as the forward did. Under every plan a training step updates each BatchNorm
    /// running statistic once, as a plain step does (the recomputation's update is
    /// undone; PyTorch's checkpoint updates them a second time). The plan falls back to
    /// [`Plan::None`] as with [`add`](Self::add).
    pub fn add_t<M: ModuleT + 'static>(mut self, module: M) -> Self {
        self.layers.push(SharedLayer::new(Box::new(module)));
        self.keep_every_block();
        self.plan = Plan::None;
        self.schedule = Schedule::plain(self.layers.len());
        self.profile = None;
        self.lever_profiles.clear();
        self
    }

    /// Boundary stores a [`Plan::Budget`] may use besides recomputation: per top-level
    /// checkpoint, the solver keeps its input in memory or hands it to one of `stores`
    /// (store `i` in [`Schedule::stored`]), whichever gives the least step time within
    /// the budget, from costs [`profile`](Self::profile) measures on the real boundaries
    /// (bytes each store keeps in memory, its peaks, its seconds).
    ///
    /// None by default: plans are recompute-only and do not change. Setting levers drops
    /// the profile (it has to measure them) and the plan (back to [`Plan::None`]). Traps:
    /// - a lossy store (a compression codec) changes gradients; the solver uses it
    ///   whenever it is the fastest way to fit, so give only lossless stores when
    ///   gradients must stay bitwise equal;
    /// - only other plans' schedules ignore the stores; [`Plan::None`], `Segments`,
    ///   `EveryLayer` and `Nested` never store.
    pub fn with_levers(mut self, stores: Vec<Arc<dyn BoundaryStore>>) -> Self {
        self.set_levers(stores);
        self
    }

    /// [`with_levers`](Self::with_levers) on a chain you hold by reference.
    pub fn set_levers(&mut self, stores: Vec<Arc<dyn BoundaryStore>>) {
        // The blocks count what each store takes; the chain reads the same counters.
        self.blocks.release_stores(&self.levers);
        self.keep_every_block();
        self.levers = stores
            .into_iter()
            .map(|store| self.blocks.counted(&store))
            .collect();
        self.plan = Plan::None;
        self.schedule = Schedule::plain(self.layers.len());
        self.profile = None;
        self.lever_profiles.clear();
    }

    /// Whether levers are set.
    pub fn has_levers(&self) -> bool {
        !self.levers.is_empty()
    }

    /// What each store took from the forwards so far (the profile's calibration not
    /// counted), in the order of [`with_levers`](Self::with_levers).
    pub fn lever_stats(&self) -> Vec<LeverStats> {
        self.levers.iter().map(Lever::stats).collect()
    }

    /// The stores' measured costs per boundary (empty before [`profile`](Self::profile)
    /// or without levers).
    pub fn lever_profiles(&self) -> &[LeverProfile] {
        &self.lever_profiles
    }

    /// Appends a closure layer.
    pub fn add_fn<F>(self, f: F) -> Self
    where
        F: Fn(&Tensor) -> Tensor + Send + 'static,
    {
        self.add(nn::func(f))
    }

    /// Appends a closure layer that takes the train flag (tch's `nn::func_t`).
    pub fn add_fn_t<F>(self, f: F) -> Self
    where
        F: Fn(&Tensor, bool) -> Tensor + Send + 'static,
    {
        self.add_t(nn::func_t(f))
    }

    /// Whether checkpoints restore the RNG state for their recompute (default `true`).
    /// Changing it drops the profile, which measured the other setting.
    pub fn preserve_rng(mut self, preserve: bool) -> Self {
        self.checkpoint = self.checkpoint.preserve_rng(preserve);
        self.blocks.preserve_rng(preserve);
        self.profile = None;
        self.lever_profiles.clear();
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
    /// forward and backward time) and the `loss` on the chain's output, and each lever
    /// (see [`with_levers`](Self::with_levers)) on each boundary. Needed by
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
        self.lever_profiles = if self.levers.is_empty() {
            Vec::new()
        } else {
            let saves_output: Vec<bool> = profile.elements.iter().map(|e| e.saves_output).collect();
            profile_levers(&self.layers, example, &saves_output, &self.levers)?
        };
        Ok(self.profile.insert(profile))
    }

    /// Chooses the plan; [`Plan::Budget`] solves for a schedule and needs a profile.
    /// Levers set on [`blocks`](Self::blocks) are dropped, except when the plan was
    /// [`Plan::PerLayer`] and stays so (set levers per layer after this).
    pub fn set_plan(&mut self, plan: Plan) -> Result<()> {
        let n = self.layers.len();
        self.schedule = match plan {
            Plan::None | Plan::PerLayer => Schedule::plain(n),
            Plan::EveryLayer => Schedule::every_layer(n),
            Plan::Segments(k) => Schedule::segments(n, k)?,
            Plan::Nested => Schedule::nested(n),
            Plan::Budget(bytes) => {
                let profile = self.profile.as_ref().ok_or(CheckpointError::NotProfiled)?;
                Solver::with_levers(profile, &self.lever_profiles).solve_budget(bytes)?
            }
        };
        if plan != Plan::PerLayer || self.plan != Plan::PerLayer {
            // The schedule decides every checkpoint's lever; levers per layer start
            // from every layer kept.
            self.blocks.set_every(BlockLever::Keep);
        }
        // The next forward runs the blocks of this plan: levers per layer are checked
        // against it, not against the last one's.
        self.blocks.forget_forward();
        self.plan = plan;
        Ok(())
    }

    /// Follows an explicit schedule (for example one from [`Solver`]). Its stored
    /// boundaries must name levers set by [`with_levers`](Self::with_levers).
    pub fn set_schedule(&mut self, schedule: Schedule) -> Result<()> {
        if let Some(b) = schedule
            .stored()
            .iter()
            .find(|b| b.lever >= self.levers.len())
        {
            return Err(CheckpointError::InvalidPlan(format!(
                "the schedule stores boundary {} with store {}, but {} stores are set (with_levers)",
                b.layer,
                b.lever,
                self.levers.len()
            )));
        }
        self.schedule = Schedule::new(schedule.blocks().to_vec(), self.layers.len())?
            .with_stored(schedule.stored().to_vec())?;
        if self.plan == Plan::PerLayer {
            self.plan = Plan::None;
        }
        self.keep_every_block();
        Ok(())
    }

    /// Predicted peak and time of the current schedule; needs a profile.
    /// `None` under [`Plan::PerLayer`], whose levers the blocks planner predicts
    /// ([`Blocks::profile`]).
    pub fn predict(&self) -> Option<Prediction> {
        if self.plan == Plan::PerLayer {
            return None;
        }
        self.profile
            .as_ref()
            .map(|p| predict_with_levers(p, &self.lever_profiles, &self.schedule))
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
        if self.plan == Plan::PerLayer {
            let levers = self.blocks.levers_set(false);
            out.push_str(&format!(
                "\nlevers per layer: {}",
                levers.as_deref().unwrap_or("every layer kept")
            ));
        } else if let Some(p) = self.predict() {
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
        if !self.levers.is_empty() {
            out.push_str(&self.explain_boundaries());
        }
        out
    }

    /// One line per top-level checkpoint boundary: kept or stored, and why.
    fn explain_boundaries(&self) -> String {
        let mut out = String::from("\nboundaries (inputs of top-level checkpoints):");
        let profile = self.profile.as_ref();
        for block in self.schedule.blocks() {
            let Block::Checkpoint { start, end, .. } = block else {
                continue;
            };
            let bytes = profile.map(|p| p.elements[*start].input_bytes);
            let size = bytes.map_or(String::new(), |b| format!(" ({})", Bytes(b)));
            let costs: Vec<(usize, &LeverProfile, crate::levers::BoundaryCost)> = self
                .lever_profiles
                .iter()
                .enumerate()
                .filter_map(|(j, lp)| {
                    lp.boundaries
                        .get(*start)
                        .copied()
                        .flatten()
                        .map(|c| (j, lp, c))
                })
                .collect();
            let line = match self.schedule.lever_at(*start) {
                Some(j) => {
                    let name = self.levers[j].0.name();
                    match costs.iter().find(|(i, ..)| *i == j) {
                        Some((_, lp, c)) => format!(
                            "stored by {name}{}: keeps {} in memory instead, for {:.2} ms store + {:.2} ms restore; \
                             keeping it would not fit the budget as fast",
                            if lp.lossless { "" } else { " (lossy)" },
                            Bytes(c.resident_bytes),
                            c.store_time_s * 1e3,
                            c.restore_time_s * 1e3
                        ),
                        None => format!("stored by {name}"),
                    }
                }
                None if *start == 0 => "kept: the chain's input, which the caller holds".to_owned(),
                None if costs.is_empty() => {
                    "kept: no store can free it (the layer before keeps its output for backward)"
                        .to_owned()
                }
                None => {
                    let cheapest = costs
                        .iter()
                        .map(|(_, lp, c)| {
                            format!(
                                "{} would keep {} for {:.2} ms",
                                lp.name,
                                Bytes(c.resident_bytes),
                                (c.store_time_s + c.restore_time_s) * 1e3
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", ");
                    format!("kept: the budget is met faster without storing it ({cheapest})")
                }
            };
            out.push_str(&format!(
                "\n  layer {start} (ckpt[{start}..{end}]){size}: {line}"
            ));
        }
        out
    }

    /// Runs the chain on `x` in training mode following the schedule; a panicking layer
    /// becomes an `Err`. The same as [`f_forward_t(x, true)`](Self::f_forward_t).
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor> {
        self.f_forward_t(x, true)
    }

    /// Runs the chain on `x` following the schedule, each layer with the train flag
    /// `train` (BatchNorm's batch statistics and dropout when true); a panicking layer
    /// becomes an `Err`. For evaluation, pass `false` and run under `tch::no_grad`:
    /// without grad nothing is saved, so the plan changes nothing.
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let store_for = |start: usize| {
            self.schedule
                .lever_at(start)
                .and_then(|j| self.levers.get(j).cloned())
        };
        let per_layer = self.plan == Plan::PerLayer;
        if let Some(set) = (!per_layer).then(|| self.blocks.levers_set(true)).flatten() {
            return Err(CheckpointError::Blocks(format!(
                "levers are set on the chain's blocks ({set}), but plan {} runs its schedule, which decides every checkpoint's lever: for a lever per layer, set Plan::PerLayer first, then the levers",
                self.plan
            )));
        }
        let run = Run {
            train,
            engine: &self.blocks,
            store_for: &store_for,
            per_layer,
        };
        let blocks = self.schedule.blocks();
        if !per_layer && blocks.iter().all(|b| matches!(b, Block::Layer(_))) {
            // Nothing runs as a block: the layers run directly, from any number of
            // threads at once (the engine runs one forward at a time).
            return catching_panics("a layer panicked", || {
                run_blocks(&self.layers, blocks, x, run)
            });
        }
        catching_panics("a layer panicked", || {
            self.blocks
                .forward(|engine| run_blocks(&self.layers, blocks, x, Run { engine, ..run }))?
        })
    }

    /// The plan, its schedule and the levers on [`blocks`](Self::blocks) as they are,
    /// to put back with [`restore_plan`](Self::restore_plan) (a budget's schedule
    /// without solving it again).
    pub fn plan_snapshot(&self) -> PlanSnapshot {
        PlanSnapshot {
            plan: self.plan,
            schedule: self.schedule.clone(),
            levers: self.blocks.levers_snapshot(),
            stores: self.levers.iter().map(|l| Arc::clone(&l.0)).collect(),
        }
    }

    /// Puts back a [`plan_snapshot`](Self::plan_snapshot) of this chain (its layers
    /// unchanged since: a schedule of another length is refused; its boundary stores
    /// unchanged since: a schedule that stores a boundary after
    /// [`set_levers`](Self::set_levers) replaced the stores is refused, since its
    /// store numbers would name other stores, or none).
    ///
    /// # Errors
    /// [`CheckpointError::InvalidPlan`] when the snapshot's schedule does not fit the
    /// chain or its stores; the chain is then left as it was.
    pub fn restore_plan(&mut self, snapshot: PlanSnapshot) -> Result<()> {
        let same_stores = snapshot.stores.len() == self.levers.len()
            && (snapshot.stores.iter())
                .zip(&self.levers)
                .all(|(a, b)| Arc::ptr_eq(a, &b.0));
        if let (false, Some(b)) = (same_stores, snapshot.schedule.stored().first()) {
            return Err(CheckpointError::InvalidPlan(format!(
                "the snapshot's schedule stores boundary {} with store {}, but the chain's stores were replaced (set_levers) since the snapshot: solve the plan again (set_plan)",
                b.layer, b.lever
            )));
        }
        let schedule = Schedule::new(snapshot.schedule.blocks().to_vec(), self.layers.len())?
            .with_stored(snapshot.schedule.stored().to_vec())?;
        self.schedule = schedule;
        self.plan = snapshot.plan;
        self.blocks.forget_forward();
        self.blocks.restore_levers(snapshot.levers);
        Ok(())
    }

    /// Every block kept and the last forward forgotten: the schedule decides the
    /// levers again, and the next forward runs other blocks.
    fn keep_every_block(&self) {
        self.blocks.set_every(BlockLever::Keep);
        self.blocks.forget_forward();
    }

    /// The engine the chain's forward runs on. Under [`Plan::PerLayer`], layer `i` is
    /// the block `layer i` (call 0) and runs under the lever set here for it
    /// ([`Blocks::set`], [`Blocks::set_levers`]; kept by default): a lever per layer,
    /// as for any model of blocks. Under the other plans, the schedule's checkpoints
    /// are its blocks (`layers a..b`, recomputed, their inputs in a store where the
    /// schedule says so) and levers set here are refused by the next forward: set
    /// [`Plan::PerLayer`] first. [`Blocks::last_forward`] tells what each block did.
    ///
    /// ```
    /// use memsave_checkpoint::{BlockKey, BlockLever, CheckpointedSequential, Plan};
    /// use tch::nn::{self, Module};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let mut seq = CheckpointedSequential::new();
    /// for i in 0..4 {
    ///     let lin = nn::linear(vs.root() / i, 8, 8, Default::default());
    ///     seq = seq.add_fn(move |x| lin.forward(x).tanh());
    /// }
    /// seq.set_plan(Plan::PerLayer)?;
    /// seq.blocks().set(BlockKey::new("layer 2", 0), BlockLever::Recompute)?;
    /// let x = Tensor::rand([4, 8], (Kind::Float, Device::Cpu));
    /// seq.f_forward(&x)?.sum(Kind::Float).backward();
    /// let levers: Vec<String> = seq.blocks().last_forward().into_iter().map(|r| r.lever).collect();
    /// assert_eq!(levers, ["keep", "keep", "recompute", "keep"]);
    /// # Ok::<(), memsave_checkpoint::CheckpointError>(())
    /// ```
    pub fn blocks(&self) -> &Blocks {
        &self.blocks
    }
}

/// A chain's plan, schedule and levers per layer as they were
/// ([`CheckpointedSequential::plan_snapshot`]).
#[derive(Clone)]
pub struct PlanSnapshot {
    plan: Plan,
    schedule: Schedule,
    levers: LeversSnapshot,
    /// The chain's boundary stores when it was taken: the schedule's store numbers
    /// index them.
    stores: Vec<Arc<dyn BoundaryStore>>,
}

impl fmt::Debug for PlanSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stores: Vec<String> = self.stores.iter().map(|s| s.name()).collect();
        f.debug_struct("PlanSnapshot")
            .field("plan", &self.plan)
            .field("schedule", &self.schedule)
            .field("levers", &self.levers)
            .field("stores", &stores)
            .finish()
    }
}

/// How [`run_blocks`] runs: the train flag, the engine, the store of the input of a
/// checkpoint starting at a layer (top level only: a checkpoint's recompute runs its
/// inner checkpoints with none), and whether each plain layer is a block of its own.
#[derive(Clone, Copy)]
struct Run<'a> {
    train: bool,
    engine: &'a Blocks,
    store_for: &'a dyn Fn(usize) -> Option<Lever>,
    per_layer: bool,
}

impl CheckpointedSequential {
    /// Which of `params` each layer uses, one list per layer (in `params`' order):
    /// each layer runs once on its input (the previous layer's output, detached, from
    /// `x` on, with the train flag `train`, outside the plan), and a parameter is the
    /// layer's when the layer's output depends on it through autograd (its gradient
    /// from that output is defined). This is what ZeRO-3 needs to shard a chain one
    /// unit per layer (`memsave_step::Workload::layer_parameters`) when its variables
    /// are not named by layer. A parameter two layers use is in both lists.
    ///
    /// Warning: a parameter a layer reads without autograd (under `no_grad`, through
    /// `.detach()`, or only as an integer index) is not found; nor is anything in a
    /// layer that takes another path with other inputs. With `train` true, BatchNorm
    /// updates its running statistics once here: pass `false` unless that is wanted.
    ///
    /// # Errors
    /// [`CheckpointError::Torch`] when a layer panics or libtorch fails.
    pub fn f_layer_parameters(
        &self,
        x: &Tensor,
        params: &[Tensor],
        train: bool,
    ) -> Result<Vec<Vec<Tensor>>> {
        let torch = |e: tch::TchError| CheckpointError::Torch(e.to_string());
        let trainable: Vec<(usize, &Tensor)> = params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.requires_grad())
            .collect();
        let inputs: Vec<&Tensor> = trainable.iter().map(|(_, p)| *p).collect();
        let mut h = x.detach();
        let mut lists = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let y = catching_panics(&format!("layer {i} panicked"), || {
                Ok(layer.forward_t(&h, train))
            })?;
            let mut used = Vec::new();
            if y.requires_grad() && !inputs.is_empty() {
                let total = y.f_sum(tch::Kind::Float).map_err(torch)?;
                let grads =
                    Tensor::f_run_backward(&[total], &inputs, false, false).map_err(torch)?;
                for ((index, _), g) in trainable.iter().zip(&grads) {
                    if g.defined() {
                        used.push(params[*index].shallow_clone());
                    }
                }
            }
            lists.push(used);
            h = y.detach();
        }
        Ok(lists)
    }
}

/// Runs `blocks` on `x`: each checkpoint as a block of `run.engine` (nested ones
/// inside it), each plain layer directly or, with `run.per_layer`, as the block
/// `layer i` under its own lever.
fn run_blocks(
    layers: &[SharedLayer],
    blocks: &[Block],
    x: &Tensor,
    run: Run<'_>,
) -> Result<Tensor> {
    let mut x = x.shallow_clone();
    for block in blocks {
        // In a recomputation that has every tensor it needs, the rest is thrown away:
        // stop between layers rather than unwinding a layer (see Checkpoint::early_stop).
        if memsave_sys::checkpoint::recomputation_done() {
            break;
        }
        x = match block {
            Block::Layer(i) if run.per_layer => {
                let layer = layers[*i].clone();
                let train = run.train;
                let f = move |xs: &[Tensor]| {
                    Ok::<_, std::convert::Infallible>(vec![layer.forward_t(&xs[0], train)])
                };
                let mut out = run
                    .engine
                    .run_block(&format!("layer {i}"), &[&x], None, f)?;
                out.remove(0)
            }
            Block::Layer(i) => layers[*i].forward_t(&x, run.train),
            Block::Checkpoint { start, end, inner } => {
                debug_assert!(start < end);
                let owned: Vec<SharedLayer> = layers.to_vec();
                let inner = inner.clone();
                let (train, engine) = (run.train, run.engine.clone());
                let f = move |xs: &[Tensor]| {
                    let run = Run {
                        train,
                        engine: &engine,
                        store_for: &|_| None,
                        per_layer: false,
                    };
                    run_blocks(&owned, &inner, &xs[0], run).map(|y| vec![y])
                };
                let lever = match (run.store_for)(*start) {
                    Some(store) => BlockLever::RecomputeStoringInputs {
                        store: Arc::clone(&store.0),
                    },
                    None => BlockLever::Recompute,
                };
                let name = format!("layers {start}..{end}");
                let mut out = run.engine.run_block(&name, &[&x], Some(lever), f)?;
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
