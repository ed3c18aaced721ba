//! An encoder–decoder transformer (Vaswani et al. 2017, pre-LN): a network that is not
//! a chain. Every decoder block reads the encoder's output (its keys and values come
//! from it), so one tensor crosses into every decoder block; the forward runs as named
//! [`Blocks`] and the chain the step engine sees is one layer that runs them.
//!
//! Trained with teacher forcing. The input packs each example's source tokens and
//! the decoder's input tokens in one int64 row, `[batch, source + target]`, the source
//! first (the step's batch has one input); the target is `[batch, target]`, the
//! decoder's input shifted by one, and the loss the mean cross-entropy of the logits
//! `[batch, target, vocab]` against it ([`Task::Seq2Seq`]).
//!
//! | block | inputs | outputs |
//! | --- | --- | --- |
//! | `embed` | the packed tokens | the source's embedding `[batch, source, dim]`, the decoder input's `[batch, target, dim]` |
//! | `enc{i}` | the source stream | LN, self-attention, residual; LN, MLP (4x, GELU), residual |
//! | `enc_ln` | the source stream | the encoder's output (final LayerNorm) |
//! | `dec{i}` | the decoder stream, the encoder's output | LN, causal self-attention, residual; LN, cross-attention (queries from the stream, keys and values from the encoder's output), residual; LN, MLP, residual |
//! | `head` | the decoder stream | final LayerNorm, linear to the logits (no bias) |
//!
//! Variables: `encoder.embed_tokens.weight` `[vocab, dim]`,
//! `encoder.embed_positions.weight` `[source, dim]`, `encoder.layers.{i}.ln_1`,
//! `.self_attn.qkv` (`[3 dim, dim]`, q, k, v stacked), `.self_attn.out`, `.ln_2`,
//! `.mlp.fc1` (`[4 dim, dim]`), `.mlp.fc2`, `encoder.ln`; `decoder.embed_tokens`,
//! `decoder.embed_positions` (`[target, dim]`), `decoder.layers.{i}.ln_1`,
//! `.self_attn.qkv`, `.self_attn.out`, `.ln_2`, `.cross_attn.q` (`[dim, dim]`),
//! `.cross_attn.kv` (`[2 dim, dim]`, k and v stacked), `.cross_attn.out`, `.ln_3`,
//! `.mlp.fc1`, `.mlp.fc2`, `decoder.ln`, `lm_head.weight` `[vocab, dim]`; linear layers
//! and LayerNorms have a `weight` and a `bias`. Attention is libtorch's
//! `scaled_dot_product_attention`, dropout none.
//!
//! `scripts/reference/zoo_models.py`'s `encoder_decoder` is the PyTorch counterpart:
//! the same variables and ATen ops in the same order, so a training step allocates the
//! same bytes on both sides.
use crate::error::{at_least_one, ModelError};
use crate::network::{forward_blocks, only, Layer, Network, Task};
use memsave_checkpoint::{Blocks, Shared};
use tch::nn::{self, Init, ModuleT};
use tch::{TchError, Tensor};

/// LayerNorm's epsilon (PyTorch's default).
const LN_EPS: f64 = 1e-5;

/// An encoder–decoder transformer's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderDecoderConfig {
    /// Vocabulary size, shared by source and target (each has its own embedding).
    pub vocab: i64,
    /// Width of the residual streams (the MLPs' middle is `4 * dim`).
    pub dim: i64,
    /// Attention heads (must divide `dim`).
    pub heads: i64,
    /// Number of encoder blocks.
    pub encoder_layers: i64,
    /// Number of decoder blocks.
    pub decoder_layers: i64,
    /// Source tokens per example.
    pub source: i64,
    /// Target tokens per example (the decoder's input and the target alike).
    pub target: i64,
}

impl Default for EncoderDecoderConfig {
    fn default() -> Self {
        Self {
            vocab: 32000,
            dim: 512,
            heads: 8,
            encoder_layers: 6,
            decoder_layers: 6,
            source: 128,
            target: 128,
        }
    }
}

impl EncoderDecoderConfig {
    /// Checks the configuration: sizes at least 1, `heads` dividing `dim`.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key at fault (`vocab`, `dim`, `heads`,
    /// `encoder_layers`, `decoder_layers`, `source`, `target`).
    pub fn validate(&self) -> Result<(), ModelError> {
        at_least_one(&[
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("heads", self.heads),
            ("encoder_layers", self.encoder_layers),
            ("decoder_layers", self.decoder_layers),
            ("source", self.source),
            ("target", self.target),
        ])?;
        if self.dim % self.heads != 0 {
            return Err(ModelError::config(
                "heads",
                format!(
                    "must divide dim: dim {} is not a multiple of heads {}",
                    self.dim, self.heads
                ),
            ));
        }
        if self.source.checked_add(self.target).is_none() {
            return Err(ModelError::config(
                "target",
                "source + target overflows".to_owned(),
            ));
        }
        Ok(())
    }
}

/// A linear layer: `weight [out, inp]` and, with `bias`, `bias [out]`; weight uniform in
/// ±1/√inp (PyTorch's default), bias 0.
#[derive(Debug)]
struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn new(p: &nn::Path, inp: i64, out: i64, bias: bool) -> Result<Self, ModelError> {
        let bound = 1.0 / (inp as f64).sqrt();
        let weight = p.f_var(
            "weight",
            &[out, inp],
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?;
        let bias = if bias {
            Some(p.f_var("bias", &[out], Init::Const(0.0))?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        xs.f_linear(&self.weight, self.bias.as_ref())
    }
}

/// A LayerNorm over the last dimension: weight 1, bias 0.
#[derive(Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    dim: i64,
}

impl LayerNorm {
    fn new(p: &nn::Path, dim: i64) -> Result<Self, ModelError> {
        Ok(Self {
            weight: p.f_var("weight", &[dim], Init::Const(1.0))?,
            bias: p.f_var("bias", &[dim], Init::Const(0.0))?,
            dim,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        xs.f_layer_norm(
            [self.dim],
            Some(&self.weight),
            Some(&self.bias),
            LN_EPS,
            true,
        )
    }
}

/// `[batch, len, heads * head_dim]` to `[batch, heads, len, head_dim]` (a view).
fn split_heads(xs: &Tensor, heads: i64) -> Result<Tensor, TchError> {
    let (b, t, e) = xs.size3()?;
    xs.f_view([b, t, heads, e / heads])?.f_transpose(1, 2)
}

/// Attention of `q` over `k`, `v` (each `[batch, len, dim]`, views of the projections),
/// back to `[batch, q's len, dim]`.
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: i64,
    causal: bool,
) -> Result<Tensor, TchError> {
    let (b, t, e) = q.size3()?;
    let y = Tensor::f_scaled_dot_product_attention::<Tensor>(
        &split_heads(q, heads)?,
        &split_heads(k, heads)?,
        &split_heads(v, heads)?,
        None,
        0.0,
        causal,
        None,
        false,
    )?;
    y.f_transpose(1, 2)?.f_reshape([b, t, e])
}

/// Self-attention with a packed q, k, v projection.
#[derive(Debug)]
struct SelfAttention {
    qkv: Linear,
    out: Linear,
    heads: i64,
    causal: bool,
}

impl SelfAttention {
    fn new(p: &nn::Path, dim: i64, heads: i64, causal: bool) -> Result<Self, ModelError> {
        Ok(Self {
            qkv: Linear::new(&(p / "qkv"), dim, 3 * dim, true)?,
            out: Linear::new(&(p / "out"), dim, dim, true)?,
            heads,
            causal,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        let dim = xs.size3()?.2;
        let qkv = self.qkv.forward(xs)?.f_split(dim, -1)?;
        let y = attend(&qkv[0], &qkv[1], &qkv[2], self.heads, self.causal)?;
        self.out.forward(&y)
    }
}

/// Cross-attention: queries from the decoder's stream, keys and values (one packed
/// projection) from the encoder's output.
#[derive(Debug)]
struct CrossAttention {
    q: Linear,
    kv: Linear,
    out: Linear,
    heads: i64,
}

impl CrossAttention {
    fn forward(&self, xs: &Tensor, memory: &Tensor) -> Result<Tensor, TchError> {
        let dim = xs.size3()?.2;
        let q = self.q.forward(xs)?;
        let kv = self.kv.forward(memory)?.f_split(dim, -1)?;
        let y = attend(&q, &kv[0], &kv[1], self.heads, false)?;
        self.out.forward(&y)
    }
}

/// `fc2(gelu(fc1(x)))`, 4x wide.
#[derive(Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(p: &nn::Path, dim: i64) -> Result<Self, ModelError> {
        Ok(Self {
            fc1: Linear::new(&(p / "fc1"), dim, 4 * dim, true)?,
            fc2: Linear::new(&(p / "fc2"), 4 * dim, dim, true)?,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        self.fc2.forward(&self.fc1.forward(xs)?.f_gelu("none")?)
    }
}

/// The `embed` block: both token embeddings plus their learned positions.
#[derive(Debug)]
struct Embeddings {
    source_tokens: Tensor,
    source_positions: Tensor,
    target_tokens: Tensor,
    target_positions: Tensor,
    source: i64,
    target: i64,
}

impl Embeddings {
    fn forward(&self, packed: &Tensor) -> Result<Vec<Tensor>, TchError> {
        let (_, width) = packed.size2()?;
        if width != self.source + self.target {
            return Err(TchError::Shape(format!(
                "encoder_decoder: the input packs {} source and {} target tokens per example, got {width} columns",
                self.source, self.target
            )));
        }
        let source = packed.f_narrow(1, 0, self.source)?;
        let target = packed.f_narrow(1, self.source, self.target)?;
        let s = Tensor::f_embedding(&self.source_tokens, &source, -1, false, false)?
            .f_add(&self.source_positions)?;
        let t = Tensor::f_embedding(&self.target_tokens, &target, -1, false, false)?
            .f_add(&self.target_positions)?;
        Ok(vec![s, t])
    }
}

/// An encoder block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Debug)]
struct EncoderLayer {
    ln_1: LayerNorm,
    self_attn: SelfAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl EncoderLayer {
    fn forward(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        let xs = xs.f_add(&self.self_attn.forward(&self.ln_1.forward(xs)?)?)?;
        xs.f_add(&self.mlp.forward(&self.ln_2.forward(&xs)?)?)
    }
}

/// A decoder block: `x + self_attn(ln_1(x))` (causal), `x + cross_attn(ln_2(x),
/// memory)`, `x + mlp(ln_3(x))`.
#[derive(Debug)]
struct DecoderLayer {
    ln_1: LayerNorm,
    self_attn: SelfAttention,
    ln_2: LayerNorm,
    cross_attn: CrossAttention,
    ln_3: LayerNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn forward(&self, xs: &Tensor, memory: &Tensor) -> Result<Tensor, TchError> {
        let xs = xs.f_add(&self.self_attn.forward(&self.ln_1.forward(xs)?)?)?;
        let xs = xs.f_add(&self.cross_attn.forward(&self.ln_2.forward(&xs)?, memory)?)?;
        xs.f_add(&self.mlp.forward(&self.ln_3.forward(&xs)?)?)
    }
}

/// The `head` block: the decoder's final LayerNorm and the bias-free output layer.
#[derive(Debug)]
struct Head {
    ln: LayerNorm,
    lm_head: Linear,
}

/// The network's one layer: the whole forward, block by block.
#[derive(Debug)]
struct EncoderDecoder {
    blocks: Blocks,
    embed: Shared<Embeddings>,
    encoder: Vec<Shared<EncoderLayer>>,
    encoder_ln: Shared<LayerNorm>,
    decoder: Vec<Shared<DecoderLayer>>,
    head: Shared<Head>,
}

impl EncoderDecoder {
    fn forward(&self, b: &Blocks, packed: &Tensor) -> memsave_checkpoint::Result<Tensor> {
        let embed = self.embed.clone();
        let mut streams = b
            .try_run("embed", &[packed], move |xs| {
                embed.with(|m| m.forward(&xs[0]))
            })?
            .into_iter();
        let (mut source, mut target) = match (streams.next(), streams.next()) {
            (Some(s), Some(t)) => (s, t),
            _ => unreachable!("the embed block returns two streams"),
        };
        for (i, layer) in self.encoder.iter().enumerate() {
            let layer = layer.clone();
            source = only(b.try_run(&format!("enc{i}"), &[&source], move |xs| {
                layer.with(|l| l.forward(&xs[0])).map(|y| vec![y])
            })?);
        }
        let ln = self.encoder_ln.clone();
        let memory = only(b.try_run("enc_ln", &[&source], move |xs| {
            ln.with(|l| l.forward(&xs[0])).map(|y| vec![y])
        })?);
        drop(source);
        for (i, layer) in self.decoder.iter().enumerate() {
            let layer = layer.clone();
            target = only(
                b.try_run(&format!("dec{i}"), &[&target, &memory], move |xs| {
                    layer.with(|l| l.forward(&xs[0], &xs[1])).map(|y| vec![y])
                })?,
            );
        }
        drop(memory);
        let head = self.head.clone();
        Ok(only(b.try_run("head", &[&target], move |xs| {
            head.with(|h| h.lm_head.forward(&h.ln.forward(&xs[0])?))
                .map(|y| vec![y])
        })?))
    }
}

impl ModuleT for EncoderDecoder {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        forward_blocks(&self.blocks, |b| self.forward(b, xs))
    }
}

/// An embedding table `[rows, dim]` named `weight` under `p`, from N(0, 0.02).
fn embedding(p: &nn::Path, rows: i64, dim: i64) -> Result<Tensor, ModelError> {
    Ok(p.f_var(
        "weight",
        &[rows, dim],
        Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        },
    )?)
}

/// Builds an encoder–decoder transformer under `p` (variables as in the
/// [module](self)'s documentation), as a [`Network`] of one layer that runs the blocks
/// and keeps their handle in [`Network::blocks`].
///
/// # Errors
/// [`ModelError::Config`] for a configuration [`EncoderDecoderConfig::validate`]
/// refuses, [`ModelError::Torch`] when libtorch fails.
pub fn encoder_decoder(p: &nn::Path, config: &EncoderDecoderConfig) -> Result<Network, ModelError> {
    config.validate()?;
    let (dim, heads) = (config.dim, config.heads);
    let (enc, dec) = (p / "encoder", p / "decoder");
    let embed = Embeddings {
        source_tokens: embedding(&(&enc / "embed_tokens"), config.vocab, dim)?,
        source_positions: embedding(&(&enc / "embed_positions"), config.source, dim)?,
        target_tokens: embedding(&(&dec / "embed_tokens"), config.vocab, dim)?,
        target_positions: embedding(&(&dec / "embed_positions"), config.target, dim)?,
        source: config.source,
        target: config.target,
    };
    let mut encoder = Vec::with_capacity(config.encoder_layers as usize);
    for i in 0..config.encoder_layers {
        let l = &enc / "layers" / i;
        encoder.push(Shared::new(EncoderLayer {
            ln_1: LayerNorm::new(&(&l / "ln_1"), dim)?,
            self_attn: SelfAttention::new(&(&l / "self_attn"), dim, heads, false)?,
            ln_2: LayerNorm::new(&(&l / "ln_2"), dim)?,
            mlp: Mlp::new(&(&l / "mlp"), dim)?,
        }));
    }
    let encoder_ln = LayerNorm::new(&(&enc / "ln"), dim)?;
    let mut decoder = Vec::with_capacity(config.decoder_layers as usize);
    for i in 0..config.decoder_layers {
        let l = &dec / "layers" / i;
        let cross = &l / "cross_attn";
        decoder.push(Shared::new(DecoderLayer {
            ln_1: LayerNorm::new(&(&l / "ln_1"), dim)?,
            self_attn: SelfAttention::new(&(&l / "self_attn"), dim, heads, true)?,
            ln_2: LayerNorm::new(&(&l / "ln_2"), dim)?,
            cross_attn: CrossAttention {
                q: Linear::new(&(&cross / "q"), dim, dim, true)?,
                kv: Linear::new(&(&cross / "kv"), dim, 2 * dim, true)?,
                out: Linear::new(&(&cross / "out"), dim, dim, true)?,
                heads,
            },
            ln_3: LayerNorm::new(&(&l / "ln_3"), dim)?,
            mlp: Mlp::new(&(&l / "mlp"), dim)?,
        }));
    }
    let head = Head {
        ln: LayerNorm::new(&(&dec / "ln"), dim)?,
        lm_head: Linear::new(&(p / "lm_head"), dim, config.vocab, false)?,
    };
    let blocks = Blocks::new();
    let layer: Layer = Box::new(EncoderDecoder {
        blocks: blocks.clone(),
        embed: Shared::new(embed),
        encoder,
        encoder_ln: Shared::new(encoder_ln),
        decoder,
        head: Shared::new(head),
    });
    Ok(Network {
        layers: vec![layer],
        task: Task::Seq2Seq {
            vocab: config.vocab,
            source: config.source,
        },
        example_shape: vec![config.source + config.target],
        blocks: Some(blocks),
    })
}
