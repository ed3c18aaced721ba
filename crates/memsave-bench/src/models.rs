//! The suite's networks, built as a `CheckpointedSequential` of per-layer closures so
//! that checkpoint strategies only set a plan: the harness's residual stacks, and the
//! zoo's real architectures (`memsave-models`: ResNet, MobileNetV2, LLaMA, ViT), one
//! layer per block of the network.
//!
//! Every block reads a shared [`LayerContext`]: the residual update in force (the
//! strategy's) and, while a measured forward runs, a recorder of the bytes allocated
//! before and after each block (the seed's `mem_before`/`mem_after`). The recorder is
//! off during checkpoint recomputation in backward, so the trace is the real forward.
use crate::report::TraceEntry;
use crate::strategies::{ResidualUpdate, Unavailable};
use crate::suite::{ModelKind, ModelSpec};
use memsave_checkpoint::{Blocks, CheckpointedSequential};
use memsave_meter::f_memory_allocated;
use memsave_models::{Architecture, ModelError, Network};
use memsave_step::{Batch, LayerWrapper, LayerWrapperSlot, OptimizerSpec, Workload};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, TchError, Tensor};

/// When a block starts and ends, with its index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockEvent {
    /// The block starts (in the forward, and again when a checkpoint recomputes it in
    /// backward).
    Start(usize),
    /// The block ended: returned, or was unwound (a recomputation stopped early, a
    /// failing op).
    End(usize),
}

/// Told when each block starts and ends ([`BlockEvent`]).
pub type BlockObserver = Arc<dyn Fn(BlockEvent) + Send + Sync>;

/// Tells the observer that a block ended when dropped, also while unwinding.
struct EndOfBlock(Option<(BlockObserver, usize)>);

impl Drop for EndOfBlock {
    fn drop(&mut self) {
        if let Some((observer, index)) = self.0.take() {
            observer(BlockEvent::End(index));
        }
    }
}

/// State the blocks of a model share with the runner.
pub struct LayerContext {
    device: Device,
    residual: AtomicU8,
    recording: AtomicBool,
    trace: Mutex<Vec<TraceEntry>>,
    on_block: Mutex<Option<BlockObserver>>,
    /// What every block's forward runs through (ZeRO-3 gathers its weights there).
    wrapper: LayerWrapperSlot,
}

impl std::fmt::Debug for LayerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerContext")
            .field("device", &self.device)
            .field("residual", &self.residual_update())
            .finish_non_exhaustive()
    }
}

impl LayerContext {
    fn new(device: Device) -> Self {
        Self {
            device,
            residual: AtomicU8::new(0),
            recording: AtomicBool::new(false),
            trace: Mutex::new(Vec::new()),
            on_block: Mutex::new(None),
            wrapper: LayerWrapperSlot::default(),
        }
    }

    /// Sets (or, with `None`, removes) the observer told when each block starts and
    /// ends.
    pub fn set_block_observer(&self, observer: Option<BlockObserver>) {
        *self.on_block.lock().unwrap_or_else(|p| p.into_inner()) = observer;
    }

    /// Sets the residual update every block uses from now on.
    pub fn set_residual(&self, update: ResidualUpdate) {
        let code = match update {
            ResidualUpdate::Add => 0,
            ResidualUpdate::InplaceAdd => 1,
            ResidualUpdate::AddOut => 2,
            ResidualUpdate::Safe => 3,
        };
        self.residual.store(code, Ordering::Relaxed);
    }

    fn residual_update(&self) -> ResidualUpdate {
        match self.residual.load(Ordering::Relaxed) {
            1 => ResidualUpdate::InplaceAdd,
            2 => ResidualUpdate::AddOut,
            3 => ResidualUpdate::Safe,
            _ => ResidualUpdate::Add,
        }
    }

    /// Starts recording a fresh per-block trace.
    pub fn start_trace(&self) {
        self.lock_trace().clear();
        self.recording.store(true, Ordering::Relaxed);
    }

    /// Stops recording and returns the trace.
    pub fn stop_trace(&self) -> Vec<TraceEntry> {
        self.recording.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.lock_trace())
    }

    fn lock_trace(&self) -> std::sync::MutexGuard<'_, Vec<TraceEntry>> {
        self.trace.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn allocated(&self) -> u64 {
        f_memory_allocated(self.device).unwrap_or(0)
    }

    /// Runs block `index` on `x`, recording memory around it when a trace is on.
    fn block(&self, index: usize, x: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Tensor {
        let observer = self
            .on_block
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(observer) = &observer {
            observer(BlockEvent::Start(index));
        }
        let _end = EndOfBlock(observer.map(|o| (o, index)));
        if !self.recording.load(Ordering::Relaxed) {
            return self.wrapper.run(index, || f(x));
        }
        let before = self.allocated();
        let y = self.wrapper.run(index, || f(x));
        let after = self.allocated();
        self.lock_trace().push(TraceEntry {
            mark: format!("layer {index}"),
            before,
            after,
        });
        y
    }

    /// `x` plus the branch `fx`, by the update in force. Failures panic with
    /// libtorch's message: a layer closure has no error channel, and
    /// `CheckpointedSequential::f_forward` turns the panic into an `Err`.
    fn residual(&self, x: &Tensor, fx: &Tensor) -> Tensor {
        let result = match self.residual_update() {
            ResidualUpdate::Add => x.f_add(fx),
            ResidualUpdate::InplaceAdd => {
                let mut y = x.shallow_clone();
                y.f_add_(fx)
            }
            ResidualUpdate::AddOut => x.f_add_out(x, fx),
            ResidualUpdate::Safe => {
                return memsave_inplace::f_residual_add(x.shallow_clone(), fx)
                    .unwrap_or_else(|e| panic!("{e}"))
            }
        };
        result.unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A built model: parameters, the layer chain, the context its blocks read, and the
/// suite's input batch. It is the bundled kinds' [`Workload`].
pub struct Model {
    /// The model's name in the suite.
    pub name: String,
    /// The parameters (and, for the zoo's networks, the buffers: BatchNorm's running
    /// statistics, variables that do not require grad).
    pub vs: nn::VarStore,
    /// The blocks, run under a checkpoint plan.
    pub seq: CheckpointedSequential,
    /// Shared with the blocks.
    pub ctx: Arc<LayerContext>,
    /// The suite's input (`batch` as the model spec gives it): floats for the
    /// harness's kinds and the zoo's images, token ids (int64) for `llama`.
    pub input: Tensor,
    /// What the loss compares the output with: the zoo's class labels or next tokens;
    /// `None` for the harness's kinds, whose loss is the mean square of the output.
    pub target: Option<Tensor>,
    /// The zoo network's task (its cross-entropy loss), `None` for the harness's kinds.
    zoo: Option<Network>,
    /// The named blocks of a zoo network that is not a chain (`unet`,
    /// `encoder_decoder`), whose forward is the chain's one layer.
    blocks: Option<Blocks>,
    /// The optimizer `fit` counts and steps ([`Model::with_optimizer`]); `None` as
    /// built (the runner steps the suite's strategies' optimizers itself).
    optimizer: Option<OptimizerSpec>,
    /// A zoo chain's parameters per layer, found once when first asked
    /// ([`Workload::layer_parameters`]).
    layer_params: std::cell::OnceCell<Vec<Vec<Tensor>>>,
}

/// Why a model cannot be built: libtorch failed, or the zoo refused its configuration.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// libtorch failed (out of memory, ...).
    #[error(transparent)]
    Torch(#[from] TchError),
    /// The zoo's architecture refused to build (a configuration a hand-made spec got
    /// wrong: parsed suites are checked already).
    #[error(transparent)]
    Zoo(#[from] ModelError),
}

impl Model {
    /// Builds `spec` on `device`: the parameters, then the spec's input, both from
    /// libtorch's current RNG state (seed it first for a reproducible model). The
    /// harness's kinds get a uniform random input of the spec's shape; the zoo's
    /// [`Network::synthetic_batch`] (images from N(0, 1) with random labels, or random
    /// tokens with their next tokens as target), as `memsave_models::ZooWorkload`
    /// builds it, so the same seed gives the same model and batch.
    pub fn build(spec: &ModelSpec, device: Device) -> Result<Model, BuildError> {
        if let Some(architecture) = spec.kind.architecture() {
            return Self::build_zoo(spec, architecture, device);
        }
        let vs = nn::VarStore::new(device);
        let ctx = Arc::new(LayerContext::new(device));
        let mut seq = CheckpointedSequential::new();
        let h = spec.hidden;
        for i in 0..spec.layers {
            let p = vs.root() / i;
            let ctx = Arc::clone(&ctx);
            seq = match spec.kind {
                ModelKind::ResidualLinear => {
                    let lin = linear(&p / "lin", h, h);
                    seq.add_fn(move |x| ctx.block(i, x, |x| ctx.residual(x, &lin.forward(x))))
                }
                ModelKind::ResidualMlp => {
                    let e = spec.expansion;
                    let up = linear(&p / "up", h, e * h);
                    let down = linear(&p / "down", e * h, h);
                    seq.add_fn(move |x| {
                        ctx.block(i, x, |x| {
                            ctx.residual(x, &down.forward(&up.forward(x).gelu("none")))
                        })
                    })
                }
                ModelKind::Transformer => {
                    let block = PreLnBlock::new(&p, h, spec.heads.unwrap_or(1));
                    seq.add_fn(move |x| ctx.block(i, x, |x| block.forward(x, &ctx)))
                }
                ModelKind::Zoo(_) => unreachable!("built by build_zoo"),
            };
        }
        let input = Tensor::f_rand(spec.input_shape(), (Kind::Float, device))?;
        Ok(Model {
            name: spec.name.clone(),
            vs,
            seq,
            ctx,
            input,
            target: None,
            zoo: None,
            blocks: None,
            optimizer: None,
            layer_params: Default::default(),
        })
    }

    /// A zoo network: each of its blocks one layer of the chain, wrapped like the
    /// harness's blocks (per-block trace, block observer); no residual update to
    /// choose (the blocks add as the architecture does).
    fn build_zoo(
        spec: &ModelSpec,
        architecture: &Architecture,
        device: Device,
    ) -> Result<Model, BuildError> {
        let vs = nn::VarStore::new(device);
        let ctx = Arc::new(LayerContext::new(device));
        let network = architecture.build(&vs.root())?;
        let size = spec.batch.first().copied().unwrap_or(1);
        let Batch { input, target } = network.synthetic_batch(size, device)?;
        let Network {
            layers,
            task,
            example_shape,
            blocks,
        } = network;
        let mut seq = CheckpointedSequential::new();
        for (i, layer) in layers.into_iter().enumerate() {
            let ctx = Arc::clone(&ctx);
            seq = seq.add_fn_t(move |x, train| ctx.block(i, x, |x| layer.forward_t(x, train)));
        }
        Ok(Model {
            name: spec.name.clone(),
            vs,
            seq,
            ctx,
            input,
            target,
            zoo: Some(Network {
                layers: Vec::new(),
                task,
                example_shape,
                blocks: None,
            }),
            blocks,
            optimizer: None,
            layer_params: Default::default(),
        })
    }

    /// This model with `optimizer` as its [`Workload::optimizer`]: the one `fit`
    /// counts and steps. Set here rather than by a wrapper around the model, which
    /// would have to forward each of the trait's provided methods (its blocks, its
    /// trace) and fall back to the defaults silently where it did not.
    pub fn with_optimizer(mut self, optimizer: Option<OptimizerSpec>) -> Model {
        self.optimizer = optimizer;
        self
    }

    /// The trainable parameters, in creation order.
    pub fn params(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    /// The suite's batch: the input and, for the zoo's networks, the target (views).
    pub fn data(&self) -> Batch {
        Batch {
            input: self.input.shallow_clone(),
            target: self.target.as_ref().map(Tensor::shallow_clone),
        }
    }

    /// Whether the model is one of the zoo's networks (cross-entropy loss, no residual
    /// update to choose).
    pub fn is_zoo(&self) -> bool {
        self.zoo.is_some()
    }
}

/// Puts the default CPU generator's state back when dropped, as it was when
/// [`save`](Self::save)d: every case of a model then starts from the random stream the
/// model was built with, so layers that draw random numbers (the zoo's MobileNetV2
/// dropout) draw the same ones in the same step of every case, and gradients compare
/// between strategies. The state is kept in host memory, not as a tensor, so the
/// meter's `start_bytes` do not count it.
pub(crate) struct RandomStreamGuard(Option<Vec<u8>>);

impl RandomStreamGuard {
    pub(crate) fn save() -> Self {
        let state = memsave_sys::rng::cpu_state().ok();
        Self(state.and_then(|t| Vec::<u8>::try_from(&t).ok()))
    }
}

impl Drop for RandomStreamGuard {
    fn drop(&mut self) {
        if let Some(bytes) = &self.0 {
            let _ = memsave_sys::rng::set_cpu_state(&Tensor::from_slice(bytes));
        }
    }
}

/// Whether the residual `update` can be applied to `spec` (what
/// [`Workload::set_residual`] of its built [`Model`] answers), and if not why: the
/// zoo's networks have no residual update to choose, so `inplace_add`, `add_out` and
/// `safe_residual` are unavailable on them.
/// Whether `spec` takes `config`'s checkpoint plan: a network of blocks takes none or
/// `every_layer` only.
pub(crate) fn plan_available(
    spec: &ModelSpec,
    config: &memsave_step::StepConfig,
) -> Result<(), Unavailable> {
    use memsave_checkpoint::Plan;
    use memsave_step::config::PlanChoice;
    let blocks = spec.kind.architecture().is_some_and(|a| a.is_blocks());
    let chain_plan = !matches!(
        config.plan,
        PlanChoice::Fixed(Plan::None) | PlanChoice::Fixed(Plan::EveryLayer)
    );
    if blocks && chain_plan {
        return Err(Unavailable::NotAChain {
            model: spec.name.clone(),
            kind: spec.kind.as_str(),
        });
    }
    Ok(())
}

pub(crate) fn residual_available(
    spec: &ModelSpec,
    update: ResidualUpdate,
) -> Result<(), Unavailable> {
    if spec.kind.architecture().is_some() && update != ResidualUpdate::Add {
        return Err(Unavailable::NoResidualBlocks {
            model: spec.name.clone(),
            kind: spec.kind.as_str(),
            update,
        });
    }
    Ok(())
}

impl Workload for Model {
    fn name(&self) -> &str {
        &self.name
    }

    fn device(&self) -> Device {
        self.ctx.device
    }

    fn layers(&self) -> &CheckpointedSequential {
        &self.seq
    }

    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.seq
    }

    fn blocks(&self) -> Option<&Blocks> {
        self.blocks.as_ref()
    }

    fn optimizer(&self) -> Option<OptimizerSpec> {
        self.optimizer
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.params()
    }

    /// The variables that are not trained (the zoo's BatchNorm running mean, variance
    /// and batch count), in the order of their names; none for the harness's kinds.
    fn buffers(&self) -> Vec<Tensor> {
        memsave_step::var_store_buffers(&self.vs)
    }

    fn global_batch(&self) -> i64 {
        self.input.size().first().copied().unwrap_or(0)
    }

    /// The first `size` examples of the suite's input and target (views); beyond the
    /// suite's batch, both repeated along the first dimension (new tensors).
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        let have = self.global_batch();
        if size <= have {
            return self.data().f_narrow(0, size);
        }
        let times = (size + have - 1) / have.max(1);
        let repeat = |t: &Tensor| -> Result<Tensor, TchError> {
            let mut reps = vec![1i64; t.dim()];
            reps[0] = times;
            t.f_repeat(&reps)?.f_narrow(0, 0, size)
        };
        Ok(Batch {
            input: repeat(&self.input)?,
            target: self.target.as_ref().map(repeat).transpose()?,
        })
    }

    /// The zoo's cross-entropy against the target ([`Network::loss`]); the mean
    /// square of the output for the harness's kinds ([`loss`]).
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, TchError> {
        match &self.zoo {
            Some(network) => network.loss(output, target),
            None => loss(output),
        }
    }

    /// The harness's kinds take every update; the zoo's only [`ResidualUpdate::Add`]
    /// (their blocks add as the architecture does), so the residual-update strategies
    /// are reported unavailable on them.
    fn set_residual(&self, update: ResidualUpdate) -> bool {
        if self.is_zoo() {
            return update == ResidualUpdate::Add;
        }
        self.ctx.set_residual(update);
        true
    }

    /// The harness's kinds: each block's variables (named `{block}.…`, in name
    /// order). The zoo's chains (whose variables are not named by block): the
    /// parameters each layer's output depends on, found once by running each layer on
    /// the first example in evaluation mode
    /// (`CheckpointedSequential::f_layer_parameters`; a tied weight is then in two
    /// layers, which ZeRO-3 refuses). `None` for the zoo's networks of blocks, whose
    /// one layer is the whole forward: ZeRO-3 makes their top-level blocks its units
    /// (`Blocks::f_block_parameters`).
    fn layer_parameters(&self) -> Result<Option<Vec<Vec<Tensor>>>, tch::TchError> {
        if self.is_zoo() {
            if self.blocks.is_some() {
                return Ok(None);
            }
            // Found once; a failure is not kept (the next call tries again).
            let found = match self.layer_params.get() {
                Some(found) => found,
                None => {
                    let first = self.input.f_narrow(0, 0, 1)?;
                    let lists = self
                        .seq
                        .f_layer_parameters(&first, &self.params(), false)
                        .map_err(|e| tch::TchError::Torch(e.to_string()))?;
                    self.layer_params.get_or_init(|| lists)
                }
            };
            return Ok(Some(
                found
                    .iter()
                    .map(|l| l.iter().map(Tensor::shallow_clone).collect())
                    .collect(),
            ));
        }
        let mut named: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut layers: Vec<Vec<Tensor>> = (0..self.seq.len()).map(|_| Vec::new()).collect();
        for (name, t) in named {
            let block = name.split('.').next().and_then(|b| b.parse::<usize>().ok());
            let Some(list) = block.and_then(|b| layers.get_mut(b)) else {
                return Ok(None);
            };
            list.push(t);
        }
        Ok(Some(layers))
    }

    /// Every layer runs through the shared context's wrapper (the zoo's too; the
    /// networks of blocks run their blocks through `Blocks::set_wrapper` under ZeRO-3).
    fn set_layer_wrapper(&self, wrapper: Option<LayerWrapper>) -> bool {
        self.ctx.wrapper.set(wrapper);
        true
    }

    fn start_trace(&self) {
        self.ctx.start_trace();
    }

    fn stop_trace(&self) -> Vec<TraceEntry> {
        self.ctx.stop_trace()
    }
}

/// A linear layer initialized as PyTorch's `nn.Linear`: weight and bias uniform in
/// `±1/sqrt(in)` (tch's default Kaiming init is sqrt(6) times wider, which makes deep
/// residual stacks and their gradients blow up, and gradient errors incomparable).
fn linear(p: nn::Path, inputs: i64, outputs: i64) -> nn::Linear {
    let bound = 1.0 / (inputs as f64).sqrt();
    let init = nn::Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let config = nn::LinearConfig {
        ws_init: init,
        bs_init: Some(init),
        bias: true,
    };
    nn::linear(p, inputs, outputs, config)
}

/// A pre-LN transformer block: causal self-attention, then a 4x GELU MLP, each added
/// to the residual stream (PyTorch's `scaled_dot_product_attention`).
struct PreLnBlock {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
    heads: i64,
}

impl PreLnBlock {
    fn new(p: &nn::Path, h: i64, heads: i64) -> Self {
        let lin = |name: &str, i, o| linear(p / name, i, o);
        Self {
            ln1: nn::layer_norm(p / "ln1", vec![h], Default::default()),
            qkv: lin("qkv", h, 3 * h),
            proj: lin("proj", h, h),
            ln2: nn::layer_norm(p / "ln2", vec![h], Default::default()),
            up: lin("up", h, 4 * h),
            down: lin("down", 4 * h, h),
            heads,
        }
    }

    fn forward(&self, x: &Tensor, ctx: &LayerContext) -> Tensor {
        let (b, s, h) = x.size3().unwrap_or_else(|e| panic!("{e}"));
        let qkv = self.qkv.forward(&self.ln1.forward(x)).chunk(3, -1);
        let split = |t: &Tensor| t.view([b, s, self.heads, h / self.heads]).transpose(1, 2);
        let a = Tensor::scaled_dot_product_attention(
            &split(&qkv[0]),
            &split(&qkv[1]),
            &split(&qkv[2]),
            None::<Tensor>,
            0.0,
            true,
            None,
            false,
        );
        let x = ctx.residual(x, &self.proj.forward(&a.transpose(1, 2).reshape([b, s, h])));
        let mlp = self
            .down
            .forward(&self.up.forward(&self.ln2.forward(&x)).gelu("none"));
        ctx.residual(&x, &mlp)
    }
}

/// The loss of every strategy: the mean of the squared output, in f32.
pub fn loss(output: &Tensor) -> Result<Tensor, tch::TchError> {
    memsave_step::mean_square(output)
}
