//! The data model of a suite: what the YAML describes once it is parsed and checked.
use super::strategy::StrategySpec;
use super::values::Size;
use memsave_models::{
    Architecture, EncoderDecoderConfig, LlamaConfig, MobileNetV2Config, ResNetConfig, UNetConfig,
    VitConfig,
};

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
///
/// The first three are the harness's own residual stacks, sized by [`ModelSpec`]'s
/// `layers`, `hidden`, `expansion` and `heads`; [`Zoo`](ModelKind::Zoo) is a real
/// architecture of `memsave-models` (`kind: resnet`, `mobilenet_v2`, `llama` or
/// `vit` in a suite), which carries its whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelKind {
    /// `x = x + Linear(x)`: the seed's network.
    ResidualLinear,
    /// `x = x + Linear(GELU(Linear(x)))` with an `expansion`-times wider middle.
    ResidualMlp,
    /// Pre-LN blocks: causal self-attention and a 4x MLP, each with a residual.
    Transformer,
    /// A network of the zoo (`memsave_models`): ResNet, MobileNetV2, a LLaMA-style
    /// decoder or a vision transformer, trained with the cross-entropy against a
    /// synthetic target (the three kinds above use the mean square of the output).
    Zoo(Architecture),
}

impl ModelKind {
    /// The name used in YAML.
    pub fn as_str(&self) -> &'static str {
        match self {
            ModelKind::ResidualLinear => "residual_linear",
            ModelKind::ResidualMlp => "residual_mlp",
            ModelKind::Transformer => "transformer",
            ModelKind::Zoo(architecture) => architecture.kind(),
        }
    }

    /// The zoo network's architecture, `None` for the harness's own kinds.
    pub fn architecture(&self) -> Option<&Architecture> {
        match self {
            ModelKind::Zoo(architecture) => Some(architecture),
            _ => None,
        }
    }
}

/// One `models:` entry. Parsing guarantees the limits above ([`MAX_LAYERS`],
/// [`MAX_DIMENSION`], [`MAX_PARAMETERS`], [`MAX_INPUT_ELEMENTS`]); a spec built by
/// hand is not checked, and [`parameter_count`](Self::parameter_count) and
/// [`input_elements`](Self::input_elements) say `None` when it overflows.
///
/// A zoo model ([`ModelKind::Zoo`]) keeps its configuration in the architecture:
/// its `layers`, `hidden` and `heads` are 0, 0 and `None` (the architecture's own
/// `layers`, `hidden`, `heads` are in it) and `batch` is `[batch]`, the number of
/// examples per step.
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
    /// The input's shape, `batch + [hidden]`; for a zoo model `[batch]` and one
    /// example's shape (`[batch, channels, height, width]` images, `[batch, seq]`
    /// token ids).
    pub fn input_shape(&self) -> Vec<i64> {
        let mut shape = self.batch.clone();
        match &self.kind {
            ModelKind::Zoo(architecture) => shape.extend(example_shape(architecture)),
            _ => shape.push(self.hidden),
        }
        shape
    }

    /// The number of elements of the input; `None` when it overflows a `u64`.
    pub fn input_elements(&self) -> Option<u64> {
        self.input_shape()
            .into_iter()
            .try_fold(1u64, |n, d| n.checked_mul(u64::try_from(d).ok()?))
    }

    /// The bytes of the batch the model trains on (the suite's, or this spec's after
    /// [`with_global_batch`](Self::with_global_batch)): the input, f32 except LLaMA's
    /// int64 token ids, and a zoo model's int64 target (a class index per image, the
    /// next token at each position); `None` when the count overflows a `u64`.
    ///
    /// Trap: [`input_elements`](Self::input_elements) counts elements, not bytes, and
    /// not the target.
    pub fn batch_bytes(&self) -> Option<u64> {
        const F32: u64 = 4;
        const INT64: u64 = 8;
        let input = self.input_elements()?;
        match self.kind.architecture() {
            None => input.checked_mul(F32),
            // The target has the input's shape: the tokens shifted by one.
            Some(Architecture::Llama(_)) => input.checked_mul(2 * INT64),
            // One class index per pixel.
            Some(Architecture::UNet(c)) => {
                let pixels = u64::try_from(*self.batch.first()?)
                    .ok()?
                    .checked_mul(u64::try_from(c.image[1]).ok()?)?
                    .checked_mul(u64::try_from(c.image[2]).ok()?)?;
                input
                    .checked_mul(F32)?
                    .checked_add(pixels.checked_mul(INT64)?)
            }
            // Source and decoder-input tokens, then the target tokens.
            Some(Architecture::EncoderDecoder(c)) => {
                let targets = u64::try_from(*self.batch.first()?)
                    .ok()?
                    .checked_mul(u64::try_from(c.target).ok()?)?;
                input.checked_add(targets)?.checked_mul(INT64)
            }
            Some(_) => {
                let examples = u64::try_from(*self.batch.first()?).ok()?;
                input
                    .checked_mul(F32)?
                    .checked_add(examples.checked_mul(INT64)?)
            }
        }
    }

    /// The number of trainable parameters (weights and biases of every block);
    /// `None` when it overflows a `u64` (or, for a zoo model, when the configuration
    /// is one its architecture refuses, e.g. a ResNet depth it does not have).
    ///
    /// For a zoo model it is computed from the architecture's layer shapes, nothing
    /// built (`tied: true` counts the shared embedding once); buffers (BatchNorm's
    /// running statistics) are not parameters.
    pub fn parameter_count(&self) -> Option<u64> {
        if let ModelKind::Zoo(architecture) = &self.kind {
            return zoo_parameters(architecture).map(|t| t.total);
        }
        let h = u64::try_from(self.hidden).ok()?;
        let linear = |i: u64, o: u64| i.checked_mul(o)?.checked_add(o);
        let per_layer = match self.kind {
            ModelKind::ResidualLinear => linear(h, h)?,
            ModelKind::ResidualMlp => {
                let middle = h.checked_mul(u64::try_from(self.expansion).ok()?)?;
                linear(h, middle)?.checked_add(linear(middle, h)?)?
            }
            ModelKind::Zoo(_) => return None,
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
        if let ModelKind::Zoo(architecture) = &self.kind {
            return zoo_parameters(architecture).map(|t| t.largest);
        }
        let h = u64::try_from(self.hidden).ok()?;
        match self.kind {
            ModelKind::Zoo(_) => None,
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
    pub fn with_global_batch(&self, batch: i64) -> Result<ModelSpec, ModelSpecError> {
        match u64::try_from(batch) {
            Ok(0) | Err(_) => return Err(ModelSpecError::BatchNotPositive { batch }),
            Ok(b) if b > MAX_DIMENSION => return Err(ModelSpecError::BatchTooLarge { batch: b }),
            Ok(_) => {}
        }
        let mut spec = self.clone();
        match spec.batch.first_mut() {
            Some(first) => *first = batch,
            None => spec.batch.push(batch),
        }
        spec.check_limits()?;
        Ok(spec)
    }

    /// The limits on the whole model ([`MAX_PARAMETERS`], [`MAX_INPUT_ELEMENTS`]), in
    /// checked arithmetic (each dimension is already within its own limit).
    pub(super) fn check_limits(&self) -> Result<(), ModelSpecError> {
        // What to reduce, in the keys of the model's kind.
        let (shrink_parameters, shrink_input) = match self.kind.architecture() {
            None => ("layers, hidden or expansion", "batch or hidden"),
            Some(Architecture::ResNet(_)) => ("depth or classes", "batch or image"),
            Some(Architecture::MobileNetV2(_)) => ("classes", "batch or image"),
            Some(Architecture::Llama(_)) => ("vocab, dim, layers or hidden", "batch or seq"),
            Some(Architecture::Vit(_)) => ("dim, layers, mlp or classes", "batch or image"),
            Some(Architecture::UNet(_)) => ("base, levels or classes", "batch or image"),
            Some(Architecture::EncoderDecoder(_)) => (
                "vocab, dim, encoder_layers or decoder_layers",
                "batch, source or target",
            ),
        };
        let model = || self.name.clone();
        match self.parameter_count() {
            Some(n) if n <= MAX_PARAMETERS => {}
            Some(parameters) => {
                return Err(ModelSpecError::TooManyParameters {
                    model: model(),
                    parameters,
                    reduce: shrink_parameters,
                })
            }
            None => {
                return Err(ModelSpecError::ParameterCountOverflow {
                    model: model(),
                    reduce: shrink_parameters,
                })
            }
        }
        match self.input_elements() {
            Some(n) if n <= MAX_INPUT_ELEMENTS => Ok(()),
            Some(elements) => Err(ModelSpecError::InputTooLarge {
                model: model(),
                elements,
                reduce: shrink_input,
            }),
            None => Err(ModelSpecError::InputOverflow {
                model: model(),
                reduce: shrink_input,
            }),
        }
    }
}

/// Why a model entry is invalid, or a batch it is asked to run at
/// ([`ModelSpec::with_global_batch`]) is out of the limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelSpecError {
    /// `batch: []`.
    #[error("model '{model}': batch must list at least one dimension")]
    EmptyBatch {
        /// The model's name.
        model: String,
    },
    /// `expansion` on a kind other than `residual_mlp`.
    #[error("model '{model}': expansion only applies to kind residual_mlp")]
    ExpansionNotApplicable {
        /// The model's name.
        model: String,
    },
    /// A transformer without `heads`.
    #[error("model '{model}': a transformer needs heads")]
    TransformerNeedsHeads {
        /// The model's name.
        model: String,
    },
    /// `heads` that does not divide `hidden`.
    #[error("model '{model}': heads ({heads}) must divide hidden ({hidden})")]
    HeadsMustDivideHidden {
        /// The model's name.
        model: String,
        /// `heads:`.
        heads: u64,
        /// `hidden:`.
        hidden: u64,
    },
    /// A transformer's `batch` that is not `[batch, sequence]`.
    #[error(
        "model '{model}': a transformer's batch is [batch, sequence], got {dimensions} dimensions"
    )]
    TransformerBatch {
        /// The model's name.
        model: String,
        /// How many `batch` lists.
        dimensions: usize,
    },
    /// `heads` on a kind other than `transformer`.
    #[error("model '{model}': heads only applies to kind transformer")]
    HeadsNotApplicable {
        /// The model's name.
        model: String,
    },
    /// More parameters than [`MAX_PARAMETERS`].
    #[error(
        "model '{model}': {parameters} parameters, more than the limit of {MAX_PARAMETERS} \
         (16 GiB in f32); reduce {reduce}"
    )]
    TooManyParameters {
        /// The model's name.
        model: String,
        /// How many.
        parameters: u64,
        /// The keys to make smaller.
        reduce: &'static str,
    },
    /// A parameter count past 64 bits.
    #[error(
        "model '{model}': the parameter count overflows 64 bits (limit {MAX_PARAMETERS}); \
         reduce {reduce}"
    )]
    ParameterCountOverflow {
        /// The model's name.
        model: String,
        /// The keys to make smaller.
        reduce: &'static str,
    },
    /// An input of more than [`MAX_INPUT_ELEMENTS`] elements.
    #[error(
        "model '{model}': an input of {elements} elements, more than the limit of \
         {MAX_INPUT_ELEMENTS} (16 GiB in f32); reduce {reduce}"
    )]
    InputTooLarge {
        /// The model's name.
        model: String,
        /// How many.
        elements: u64,
        /// The keys to make smaller.
        reduce: &'static str,
    },
    /// An input element count past 64 bits.
    #[error(
        "model '{model}': the input's element count overflows 64 bits (limit \
         {MAX_INPUT_ELEMENTS}); reduce {reduce}"
    )]
    InputOverflow {
        /// The model's name.
        model: String,
        /// The keys to make smaller.
        reduce: &'static str,
    },
    /// A batch asked for (`--global-batch`) of 0 or less.
    #[error("must be positive, got {batch}")]
    BatchNotPositive {
        /// The batch asked for.
        batch: i64,
    },
    /// A batch asked for above [`MAX_DIMENSION`].
    #[error("must be at most {MAX_DIMENSION}, got {batch}")]
    BatchTooLarge {
        /// The batch asked for.
        batch: u64,
    },
}

/// One example's shape: the image for the convolutional nets and the ViT, `[seq]`
/// token ids for the decoder, `[source + target]` token ids for the encoder–decoder.
fn example_shape(architecture: &Architecture) -> Vec<i64> {
    match architecture {
        Architecture::ResNet(ResNetConfig { image, .. })
        | Architecture::MobileNetV2(MobileNetV2Config { image, .. })
        | Architecture::Vit(VitConfig { image, .. })
        | Architecture::UNet(UNetConfig { image, .. }) => image.to_vec(),
        Architecture::Llama(LlamaConfig { seq, .. }) => vec![*seq],
        Architecture::EncoderDecoder(EncoderDecoderConfig { source, target, .. }) => {
            vec![source.saturating_add(*target)]
        }
    }
}

/// The parameter tensors of a zoo network, counted: their total number of elements
/// and the largest one's.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    total: u64,
    largest: u64,
}

impl Tally {
    /// Counts a tensor of shape `dims`; `None` on an overflow or a negative size.
    fn add(&mut self, dims: &[i64]) -> Option<()> {
        let n = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?))?;
        self.total = self.total.checked_add(n)?;
        self.largest = self.largest.max(n);
        Some(())
    }

    /// A convolution's weight (no bias) and the BatchNorm after it (weight and bias).
    fn conv_bn(&mut self, out: i64, per_group_in: i64, kernel: i64) -> Option<()> {
        self.add(&[out, per_group_in, kernel, kernel])?;
        self.add(&[out])?;
        self.add(&[out])
    }

    /// A linear layer's weight `[out, in]` and, with `bias`, its bias.
    fn linear(&mut self, inputs: i64, out: i64, bias: bool) -> Option<()> {
        self.add(&[out, inputs])?;
        if bias {
            self.add(&[out])?;
        }
        Some(())
    }

    /// `times` copies of `other`'s tensors added.
    fn add_times(&mut self, other: Tally, times: i64) -> Option<()> {
        let times = u64::try_from(times).ok()?;
        self.total = self.total.checked_add(other.total.checked_mul(times)?)?;
        if times > 0 {
            self.largest = self.largest.max(other.largest);
        }
        Some(())
    }
}

/// The trainable parameters of a zoo network, from its layer shapes (torchvision's
/// ResNet and MobileNetV2, tch's LLaMA example, torchvision's ViT). `None` on an
/// overflow or a configuration the architecture does not have.
fn zoo_parameters(architecture: &Architecture) -> Option<Tally> {
    let mut t = Tally::default();
    match architecture {
        Architecture::ResNet(c) => {
            let (blocks, bottleneck): ([i64; 4], bool) = match c.depth {
                18 => ([2, 2, 2, 2], false),
                34 => ([3, 4, 6, 3], false),
                50 => ([3, 4, 6, 3], true),
                101 => ([3, 4, 23, 3], true),
                152 => ([3, 8, 36, 3], true),
                _ => return None,
            };
            let expansion = if bottleneck { 4 } else { 1 };
            t.conv_bn(64, c.image[0], 7)?;
            let mut inputs = 64;
            for (stage, &count) in blocks.iter().enumerate() {
                let planes = 64 << stage;
                let stride = if stage == 0 { 1 } else { 2 };
                for block in 0..count {
                    if bottleneck {
                        t.conv_bn(planes, inputs, 1)?;
                        t.conv_bn(planes, planes, 3)?;
                        t.conv_bn(planes * 4, planes, 1)?;
                    } else {
                        t.conv_bn(planes, inputs, 3)?;
                        t.conv_bn(planes, planes, 3)?;
                    }
                    let downsample = block == 0 && (stride != 1 || inputs != planes * expansion);
                    if downsample {
                        t.conv_bn(planes * expansion, inputs, 1)?;
                    }
                    inputs = planes * expansion;
                }
            }
            t.linear(512 * expansion, c.classes, true)?;
        }
        Architecture::MobileNetV2(c) => {
            // (expansion t, output channels c, repeats n, first stride s)
            const SETTINGS: [(i64, i64, i64); 7] = [
                (1, 16, 1),
                (6, 24, 2),
                (6, 32, 3),
                (6, 64, 4),
                (6, 96, 3),
                (6, 160, 3),
                (6, 320, 1),
            ];
            t.conv_bn(32, c.image[0], 3)?;
            let mut inputs = 32;
            for (expand, out, repeats) in SETTINGS {
                for _ in 0..repeats {
                    let hidden = inputs * expand;
                    if expand != 1 {
                        t.conv_bn(hidden, inputs, 1)?;
                    }
                    t.conv_bn(hidden, 1, 3)?; // depthwise
                    t.conv_bn(out, hidden, 1)?;
                    inputs = out;
                }
            }
            t.conv_bn(1280, inputs, 1)?;
            t.linear(1280, c.classes, true)?;
        }
        Architecture::Llama(c) => {
            let head_dim = c.dim.checked_div(c.heads)?;
            let kv = c.kv_heads.checked_mul(head_dim)?;
            let hidden = c.hidden.unwrap_or_else(|| llama_hidden(c.dim));
            let mut block = Tally::default();
            block.add(&[c.dim])?; // attention RMSNorm
            block.linear(c.dim, c.dim.checked_add(kv.checked_mul(2)?)?, false)?; // q, k, v
            block.linear(c.dim, c.dim, false)?; // output projection
            block.add(&[c.dim])?; // MLP RMSNorm
            block.linear(c.dim, hidden, false)?; // gate
            block.linear(c.dim, hidden, false)?; // up
            block.linear(hidden, c.dim, false)?; // down
            t.add(&[c.vocab, c.dim])?; // token embedding
            t.add_times(block, c.layers)?;
            t.add(&[c.dim])?; // final RMSNorm
            if !c.tied {
                t.linear(c.dim, c.vocab, false)?;
            }
        }
        Architecture::Vit(c) => {
            let [channels, height, width] = c.image;
            let patches = height
                .checked_div(c.patch)?
                .checked_mul(width.checked_div(c.patch)?)?;
            t.add(&[c.dim, channels, c.patch, c.patch])?; // patch embedding
            t.add(&[c.dim])?;
            t.add(&[1, 1, c.dim])?; // class token
            t.add(&[1, patches.checked_add(1)?, c.dim])?; // position embedding
            let mut block = Tally::default();
            block.add(&[c.dim])?; // LayerNorm weight and bias
            block.add(&[c.dim])?;
            block.linear(c.dim, c.dim.checked_mul(3)?, true)?; // in-projection
            block.linear(c.dim, c.dim, true)?; // out-projection
            block.add(&[c.dim])?;
            block.add(&[c.dim])?;
            block.linear(c.dim, c.mlp, true)?;
            block.linear(c.mlp, c.dim, true)?;
            t.add_times(block, c.layers)?;
            t.add(&[c.dim])?; // final LayerNorm
            t.add(&[c.dim])?;
            t.linear(c.dim, c.classes, true)?;
        }
        Architecture::UNet(c) => {
            let channels = |level: i64| -> Option<i64> {
                c.base
                    .checked_mul(1i64.checked_shl(u32::try_from(level).ok()?)?)
                    .filter(|&n| n > 0)
            };
            // Two 3x3 convolutions without bias, each with a BatchNorm.
            let level = |t: &mut Tally, c_in: i64, c_out: i64| -> Option<()> {
                t.conv_bn(c_out, c_in, 3)?;
                t.conv_bn(c_out, c_out, 3)
            };
            let mut inputs = c.image[0];
            for l in 0..=c.levels {
                let out = channels(l)?;
                level(&mut t, inputs, out)?;
                inputs = out;
            }
            for l in 0..c.levels {
                let (below, out) = (channels(l + 1)?, channels(l)?);
                t.add(&[below, out, 2, 2])?; // transposed convolution and its bias
                t.add(&[out])?;
                level(&mut t, out.checked_mul(2)?, out)?;
            }
            t.add(&[c.classes, c.base, 1, 1])?; // head and its bias
            t.add(&[c.classes])?;
        }
        Architecture::EncoderDecoder(c) => {
            let (dim, wide) = (c.dim, c.dim.checked_mul(4)?);
            let layer_norm = |t: &mut Tally| -> Option<()> {
                t.add(&[dim])?;
                t.add(&[dim])
            };
            let mut encoder = Tally::default();
            layer_norm(&mut encoder)?;
            encoder.linear(dim, dim.checked_mul(3)?, true)?; // q, k, v
            encoder.linear(dim, dim, true)?; // output projection
            layer_norm(&mut encoder)?;
            encoder.linear(dim, wide, true)?;
            encoder.linear(wide, dim, true)?;
            let mut decoder = Tally::default();
            layer_norm(&mut decoder)?;
            decoder.linear(dim, dim.checked_mul(3)?, true)?; // self-attention
            decoder.linear(dim, dim, true)?;
            layer_norm(&mut decoder)?;
            decoder.linear(dim, dim, true)?; // cross-attention: q, then k and v
            decoder.linear(dim, dim.checked_mul(2)?, true)?;
            decoder.linear(dim, dim, true)?;
            layer_norm(&mut decoder)?;
            decoder.linear(dim, wide, true)?;
            decoder.linear(wide, dim, true)?;
            t.add(&[c.vocab, dim])?; // source tokens and positions
            t.add(&[c.source, dim])?;
            t.add(&[c.vocab, dim])?; // target tokens and positions
            t.add(&[c.target, dim])?;
            t.add_times(encoder, c.encoder_layers)?;
            layer_norm(&mut t)?;
            t.add_times(decoder, c.decoder_layers)?;
            layer_norm(&mut t)?;
            t.linear(dim, c.vocab, false)?; // head
        }
    }
    Some(t)
}

/// LLaMA's width of the SwiGLU's middle: two thirds of `4 * dim`, rounded up to a
/// multiple of 256 (tch's example).
fn llama_hidden(dim: i64) -> i64 {
    let n = 8 * dim / 3;
    (n + 255) / 256 * 256
}
