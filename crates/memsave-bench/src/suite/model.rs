//! The data model of a suite: what the YAML describes once it is parsed and checked.
use super::strategy::StrategySpec;

/// Most blocks a model may have. Building a model is linear in its depth; this keeps a
/// typo (`layers: 100000000`) from building for minutes before the first case runs.
pub const MAX_LAYERS: u64 = 10_000;

/// Largest single dimension: `hidden`, each `batch` entry, `expansion` and `heads`.
pub const MAX_DIMENSION: u64 = 1 << 24;

/// Most parameters (elements, 16 GiB in f32) a model may have.
pub const MAX_PARAMETERS: u64 = 1 << 32;

/// Most elements (16 GiB in f32) a model's input may have.
pub const MAX_INPUT_ELEMENTS: u64 = 1 << 32;

/// Most libtorch threads a suite may ask for.
pub const MAX_THREADS: u64 = 1024;

/// Most ranks (`world_size`) a suite may ask for: each is a process on this machine.
pub const MAX_WORLD_SIZE: u64 = 64;

/// A benchmark suite: models, strategies, and how to run them.
#[derive(Debug, Clone, PartialEq)]
pub struct Suite {
    /// The suite's name, copied into the report.
    pub suite: String,
    /// Where to run (default `cpu`).
    pub device: DeviceChoice,
    /// libtorch intra-op threads (default: libtorch's choice).
    pub threads: Option<usize>,
    /// Seed of the parameters and inputs (default 0).
    pub seed: u64,
    /// Unmeasured steps before the measured ones (default 1).
    pub warmup: usize,
    /// Measured steps per case (default 3).
    pub repeats: usize,
    /// Simulated device capacity (CPU only): allocations past it fail.
    pub memory_limit: Option<Size>,
    /// The models, in order.
    pub models: Vec<ModelSpec>,
    /// The strategies, each run on every model.
    pub strategies: Vec<StrategySpec>,
    /// `world_size: N`: every case runs on N ranks (processes on 127.0.0.1 started by
    /// the launcher), data parallel or ZeRO (see [`crate::distributed`]).
    pub world_size: Option<usize>,
    /// The YAML text the suite was parsed from (the ranks of a distributed run read it
    /// again); `None` for a suite built otherwise.
    pub source: Option<String>,
}

/// `device:` in a suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The CPU, metered by memsave's counting allocator.
    Cpu,
    /// The first CUDA device.
    Cuda,
    /// CUDA when available, else the CPU.
    Auto,
}

/// The network a model entry builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// `x = x + Linear(x)`: the seed's network.
    ResidualLinear,
    /// `x = x + Linear(GELU(Linear(x)))` with an `expansion`-times wider middle.
    ResidualMlp,
    /// Pre-LN blocks: causal self-attention and a 4x MLP, each with a residual.
    Transformer,
}

impl ModelKind {
    /// The name used in YAML.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::ResidualLinear => "residual_linear",
            ModelKind::ResidualMlp => "residual_mlp",
            ModelKind::Transformer => "transformer",
        }
    }
}

/// One `models:` entry. Parsing guarantees the limits above ([`MAX_LAYERS`],
/// [`MAX_DIMENSION`], [`MAX_PARAMETERS`], [`MAX_INPUT_ELEMENTS`]); a spec built by
/// hand is not checked, and [`parameter_count`](Self::parameter_count) and
/// [`input_elements`](Self::input_elements) say `None` when it overflows.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Unique within the suite.
    pub name: String,
    /// The network.
    pub kind: ModelKind,
    /// Number of blocks.
    pub layers: usize,
    /// Width of the residual stream (the input's last dimension).
    pub hidden: i64,
    /// The input's leading dimensions; the input is `batch + [hidden]`. Accumulation
    /// splits the first one.
    pub batch: Vec<i64>,
    /// Width factor of the MLP middle (`residual_mlp`, default 4).
    pub expansion: i64,
    /// Attention heads (`transformer` only, must divide `hidden`).
    pub heads: Option<i64>,
    /// When false the model runs only if `--filter` names it (opt-in models too big
    /// for a default run).
    pub enabled: bool,
}

impl ModelSpec {
    /// The input's shape, `batch + [hidden]`.
    pub fn input_shape(&self) -> Vec<i64> {
        let mut shape = self.batch.clone();
        shape.push(self.hidden);
        shape
    }

    /// The number of elements of the input; `None` when it overflows a `u64`.
    pub fn input_elements(&self) -> Option<u64> {
        self.input_shape()
            .into_iter()
            .try_fold(1u64, |n, d| n.checked_mul(u64::try_from(d).ok()?))
    }

    /// The number of trainable parameters (weights and biases of every block);
    /// `None` when it overflows a `u64`.
    pub fn parameter_count(&self) -> Option<u64> {
        let h = u64::try_from(self.hidden).ok()?;
        let linear = |i: u64, o: u64| i.checked_mul(o)?.checked_add(o);
        let per_layer = match self.kind {
            ModelKind::ResidualLinear => linear(h, h)?,
            ModelKind::ResidualMlp => {
                let middle = h.checked_mul(u64::try_from(self.expansion).ok()?)?;
                linear(h, middle)?.checked_add(linear(middle, h)?)?
            }
            ModelKind::Transformer => {
                let layer_norm = h.checked_mul(2)?;
                [
                    layer_norm,
                    linear(h, h.checked_mul(3)?)?,
                    linear(h, h)?,
                    layer_norm,
                    linear(h, h.checked_mul(4)?)?,
                    linear(h.checked_mul(4)?, h)?,
                ]
                .into_iter()
                .try_fold(0u64, u64::checked_add)?
            }
        };
        per_layer.checked_mul(u64::try_from(self.layers).ok()?)
    }

    /// The number of elements of the largest parameter tensor (a layer's widest
    /// weight); `None` when it overflows a `u64`. Its gradient is whole in memory at
    /// some moment of every training step, whatever the step does to save memory.
    pub fn largest_parameter(&self) -> Option<u64> {
        let h = u64::try_from(self.hidden).ok()?;
        match self.kind {
            ModelKind::ResidualLinear => h.checked_mul(h),
            ModelKind::ResidualMlp => h
                .checked_mul(u64::try_from(self.expansion).ok()?)?
                .checked_mul(h),
            // qkv is h x 3h, the MLP's up and down h x 4h.
            ModelKind::Transformer => h.checked_mul(h)?.checked_mul(4),
        }
    }

    /// This model with `batch` examples per step (its input's first dimension) instead
    /// of the suite's, under the limits a suite's model is held to ([`MAX_DIMENSION`]
    /// for the dimension, [`MAX_INPUT_ELEMENTS`] for the input), with the same messages
    /// (`memsave fit --global-batch` checks its value so).
    pub fn with_global_batch(&self, batch: i64) -> Result<ModelSpec, String> {
        match u64::try_from(batch) {
            Ok(0) | Err(_) => return Err(format!("must be positive, got {batch}")),
            Ok(b) if b > MAX_DIMENSION => {
                return Err(format!("must be at most {MAX_DIMENSION}, got {b}"))
            }
            Ok(_) => {}
        }
        let mut spec = self.clone();
        match spec.batch.first_mut() {
            Some(first) => *first = batch,
            None => spec.batch.push(batch),
        }
        super::de::check_size(&spec)?;
        Ok(spec)
    }
}

/// A byte size as written in the suite (`60MiB`, `8 GiB`, `1048576`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    /// The size in bytes.
    pub bytes: u64,
    /// The text as written, used in canonical names.
    pub text: String,
}

/// A reduced-precision dtype for autocast, with the spelling the suite used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dtype {
    /// The libtorch kind (`BFloat16` or `Half`).
    pub kind: tch::Kind,
    /// The text as written (`bf16`, `fp16`, ...).
    pub text: String,
}
