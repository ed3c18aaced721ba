//! A LLaMA-style decoder (Touvron et al. 2023) as tch's `examples/llama`: token
//! embedding, RMSNorm, rotary position embeddings, SwiGLU, causal attention with
//! optional grouped-query attention, and a tied or untied output head.
//!
//! Variable names are those of tch's example, so a `VarStore` saved from it loads here:
//!
//! | name | shape |
//! | --- | --- |
//! | `transformer.wte.weight` | `[vocab, dim]` |
//! | `transformer.h.{i}.rms_1.scale` | `[dim]` |
//! | `transformer.h.{i}.attn.c_attn.weight` | `[(heads + 2 * kv_heads) * head_dim, dim]` (q, k, v stacked) |
//! | `transformer.h.{i}.attn.c_proj.weight` | `[dim, dim]` |
//! | `transformer.h.{i}.rms_2.scale` | `[dim]` |
//! | `transformer.h.{i}.mlp.c_fc1.weight` | `[hidden, dim]` (LLaMA's `w1`, the gated branch) |
//! | `transformer.h.{i}.mlp.c_fc2.weight` | `[hidden, dim]` (LLaMA's `w3`) |
//! | `transformer.h.{i}.mlp.c_proj.weight` | `[dim, hidden]` (LLaMA's `w2`) |
//! | `transformer.ln_f.scale` | `[dim]` |
//! | `lm_head.weight` | `[vocab, dim]`, absent when the head is tied |
//!
//! With `kv_heads == heads` and `hidden: None` the shapes are exactly the example's.
//! Rotary embeddings rotate interleaved pairs `(x[2i], x[2i+1])` of each head, as the
//! example and Meta's reference do (not the half-split `rotate_half` layout of Hugging
//! Face's port: weights converted for that layout give wrong outputs here).
//!
//! Unlike the example (inference of the last position only), the head returns logits
//! for every position, `[batch, seq, vocab]`, and attention is PyTorch's
//! `scaled_dot_product_attention` with `is_causal`. The PyTorch counterpart,
//! `scripts/reference/zoo_models.py`'s `llama`, runs the same ATen ops in the same
//! order, so a training step allocates the same bytes on both sides.
use crate::error::{at_least_one, ModelError};
use crate::network::{Layer, Network, Task};
use tch::nn::{self, Init, ModuleT};
use tch::{Kind, Tensor};

/// A LLaMA-style decoder's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: i64,
    /// Width of the residual stream.
    pub dim: i64,
    /// Number of decoder blocks.
    pub layers: i64,
    /// Attention heads (must divide `dim`, with an even quotient for the rotary
    /// embeddings).
    pub heads: i64,
    /// Key/value heads (grouped-query attention; must divide `heads`; `heads` for
    /// plain multi-head attention).
    pub kv_heads: i64,
    /// Width of the SwiGLU's middle; `None` for LLaMA's rule (two thirds of `4 * dim`,
    /// rounded up to a multiple of 256).
    pub hidden: Option<i64>,
    /// Tokens per example (also the length of the rotary table: longer inputs are
    /// refused).
    pub seq: i64,
    /// Whether the output head shares the embedding's weight (no `lm_head` variable).
    pub tied: bool,
    /// RMSNorm's epsilon.
    pub norm_eps: f64,
    /// Base of the rotary embeddings' frequencies.
    pub rope_theta: f64,
}

impl Default for LlamaConfig {
    fn default() -> Self {
        Self {
            vocab: 32000,
            dim: 256,
            layers: 4,
            heads: 8,
            kv_heads: 8,
            hidden: None,
            seq: 128,
            tied: false,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
        }
    }
}

impl LlamaConfig {
    /// Checks the configuration: sizes at least 1, `heads` dividing `dim` into an even
    /// head width, `kv_heads` dividing `heads`, a positive `norm_eps` and `rope_theta`.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key at fault (`vocab`, `dim`, `layers`,
    /// `heads`, `kv_heads`, `hidden`, `seq`, `norm_eps`, `rope_theta`).
    pub fn validate(&self) -> Result<(), ModelError> {
        at_least_one(&[
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("seq", self.seq),
        ])?;
        if let Some(hidden) = self.hidden {
            if hidden < 1 {
                return Err(ModelError::config(
                    "hidden",
                    format!("must be at least 1 (or left out for LLaMA's rule), got {hidden}"),
                ));
            }
        }
        if self.dim % self.heads != 0 {
            return Err(ModelError::config(
                "heads",
                format!(
                    "must divide dim: dim {} is not a multiple of heads {}",
                    self.dim, self.heads
                ),
            ));
        }
        let head_dim = self.dim / self.heads;
        if head_dim % 2 != 0 {
            return Err(ModelError::config(
                "heads",
                format!(
                    "must leave an even head width for the rotary embeddings: dim {} / heads {} = {head_dim}",
                    self.dim, self.heads
                ),
            ));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(ModelError::config(
                "kv_heads",
                format!(
                    "must divide heads: heads {} is not a multiple of kv_heads {}",
                    self.heads, self.kv_heads
                ),
            ));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(ModelError::config(
                "norm_eps",
                format!("must be positive and finite, got {}", self.norm_eps),
            ));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return Err(ModelError::config(
                "rope_theta",
                format!("must be positive and finite, got {}", self.rope_theta),
            ));
        }
        Ok(())
    }

    /// Width of one attention head, `dim / heads`.
    pub fn head_dim(&self) -> i64 {
        self.dim / self.heads
    }

    /// Width of the SwiGLU's middle: `hidden`, or LLaMA's rule (and tch's example's):
    /// `8 * dim / 3` rounded up to a multiple of 256.
    pub fn hidden_dim(&self) -> i64 {
        self.hidden.unwrap_or_else(|| {
            let n = 8 * self.dim / 3;
            (n - 1) / 256 * 256 + 256
        })
    }
}

/// PyTorch's default for a linear layer's weight: uniform in ±1/√fan_in.
fn linear_init(fan_in: i64) -> Init {
    let bound = 1.0 / (fan_in as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

/// A weight `[out, inp]` named `weight` under `p`, as a bias-free linear layer has.
fn linear_weight(p: &nn::Path, inp: i64, out: i64) -> Result<Tensor, ModelError> {
    Ok(p.f_var("weight", &[out, inp], linear_init(inp))?)
}

/// Root-mean-square normalization as tch's example computes it (mean of squares in
/// f32, times its inverse square root, times `scale`). The scale starts at 1.
#[derive(Debug)]
struct RmsNorm {
    scale: Tensor,
    size: i64,
    eps: f64,
}

impl RmsNorm {
    fn new(p: &nn::Path, size: i64, eps: f64) -> Result<Self, ModelError> {
        let scale = p.f_var("scale", &[size], Init::Const(1.0))?;
        Ok(Self { scale, size, eps })
    }

    fn forward(&self, xs: &Tensor) -> Tensor {
        let mean_square = (xs * xs).mean_dim(-1, true, Kind::Float);
        let normed = xs * (mean_square + self.eps).rsqrt();
        self.scale.reshape([1, 1, self.size]) * normed
    }
}

/// The rotary table: cos and sin of `position * theta^(-2i / head_dim)`, shaped
/// `[seq, 1, head_dim / 2]` to broadcast over `[batch, seq, heads, head_dim / 2]`.
/// Constants shared by every block, not variables.
#[derive(Debug)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    fn new(config: &LlamaConfig, device: tch::Device) -> Result<Self, ModelError> {
        let half = config.head_dim() / 2;
        let mut cos = Vec::with_capacity((config.seq * half) as usize);
        let mut sin = Vec::with_capacity(cos.capacity());
        for position in 0..config.seq {
            for i in 0..half {
                let inv_freq = config
                    .rope_theta
                    .powf(-((2 * i) as f64) / config.head_dim() as f64);
                let angle = position as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |values: &[f32]| -> Result<Tensor, ModelError> {
            Ok(Tensor::f_from_slice(values)?
                .f_reshape([config.seq, 1, half])?
                .f_to_device(device)?)
        };
        Ok(Self {
            cos: table(&cos)?,
            sin: table(&sin)?,
        })
    }

    fn shallow_clone(&self) -> Self {
        Self {
            cos: self.cos.shallow_clone(),
            sin: self.sin.shallow_clone(),
        }
    }

    /// Rotates each interleaved pair of `xs` (`[batch, seq, heads, head_dim]`) by its
    /// position's angles. The table follows the input's dtype and device.
    fn apply(&self, xs: &Tensor) -> Tensor {
        let (_, t, _, head_dim) = xs.size4().expect("llama: rotary input is 4-d");
        let table_len = self.cos.size()[0];
        assert!(
            t <= table_len,
            "llama: a sequence of {t} tokens is longer than the configured seq {table_len}"
        );
        let fit = |table: &Tensor| {
            let table = table.narrow(0, 0, t);
            if table.kind() != xs.kind() || table.device() != xs.device() {
                table.to_device_(xs.device(), xs.kind(), false, false)
            } else {
                table
            }
        };
        let (cos, sin) = (fit(&self.cos), fit(&self.sin));
        let pairs = xs.unflatten(-1, [head_dim / 2, 2]);
        let re = pairs.select(-1, 0);
        let im = pairs.select(-1, 1);
        let rotated_re = &re * &cos - &im * &sin;
        let rotated_im = &re * &sin + &im * &cos;
        Tensor::stack(&[rotated_re, rotated_im], -1).flatten(-2, -1)
    }
}

/// Causal self-attention with rotary embeddings and grouped-query heads.
#[derive(Debug)]
struct Attention {
    c_attn: Tensor,
    c_proj: Tensor,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    rotary: Rotary,
}

impl Attention {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let (b, t, _) = xs.size3().expect("llama: block input is [batch, seq, dim]");
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let qkv = xs.linear::<Tensor>(&self.c_attn, None);
        let parts = qkv.split_with_sizes([h * hd, kv * hd, kv * hd], -1);
        let q = self
            .rotary
            .apply(&parts[0].view([b, t, h, hd]))
            .transpose(1, 2);
        let k = self
            .rotary
            .apply(&parts[1].view([b, t, kv, hd]))
            .transpose(1, 2);
        let v = parts[2].view([b, t, kv, hd]).transpose(1, 2);
        let (k, v) = if kv < h {
            let repeat = |x: &Tensor| {
                x.unsqueeze(2)
                    .expand([b, kv, h / kv, t, hd], false)
                    .reshape([b, h, t, hd])
            };
            (repeat(&k), repeat(&v))
        } else {
            (k, v)
        };
        let y = Tensor::scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, true, None, false,
        );
        let y = y.transpose(1, 2).reshape([b, t, h * hd]);
        y.linear::<Tensor>(&self.c_proj, None)
    }
}

/// SwiGLU: `c_proj(silu(c_fc1(x)) * c_fc2(x))`.
#[derive(Debug)]
struct Mlp {
    c_fc1: Tensor,
    c_fc2: Tensor,
    c_proj: Tensor,
}

impl Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let gated =
            xs.linear::<Tensor>(&self.c_fc1, None).silu() * xs.linear::<Tensor>(&self.c_fc2, None);
        gated.linear::<Tensor>(&self.c_proj, None)
    }
}

/// Layer 0: token ids `[batch, seq]` to hidden states `[batch, seq, dim]`.
#[derive(Debug)]
struct Embedding {
    wte: Tensor,
}

impl ModuleT for Embedding {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        Tensor::embedding(&self.wte, xs, -1, false, false)
    }
}

/// One decoder block: `x + attn(rms_1(x))`, then `x + mlp(rms_2(x))`.
#[derive(Debug)]
struct Block {
    rms_1: RmsNorm,
    attn: Attention,
    rms_2: RmsNorm,
    mlp: Mlp,
}

impl ModuleT for Block {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let xs = self.attn.forward(&self.rms_1.forward(xs)) + xs;
        self.mlp.forward(&self.rms_2.forward(&xs)) + xs
    }
}

/// The last layer: final RMSNorm and the output head (`lm_head`, or the embedding's
/// weight when tied), logits `[batch, seq, vocab]`.
#[derive(Debug)]
struct Head {
    ln_f: RmsNorm,
    weight: Tensor,
}

impl ModuleT for Head {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        self.ln_f.forward(xs).linear::<Tensor>(&self.weight, None)
    }
}

/// Builds a LLaMA-style decoder under `p`: layer 0 the token embedding, one layer per
/// decoder block, the last layer the final norm and head. Linear weights start
/// uniform in ±1/√fan_in and the embedding from N(0, 1) (PyTorch's defaults), the
/// norms' scales at 1.
///
/// # Errors
/// [`ModelError::Config`] for a configuration [`LlamaConfig::validate`] refuses,
/// [`ModelError::Torch`] when libtorch fails.
pub fn llama(p: &nn::Path, config: &LlamaConfig) -> Result<Network, ModelError> {
    config.validate()?;
    let (dim, hd, hidden) = (config.dim, config.head_dim(), config.hidden_dim());
    let transformer = p / "transformer";
    let wte = (&transformer / "wte").f_var(
        "weight",
        &[config.vocab, dim],
        Init::Randn {
            mean: 0.0,
            stdev: 1.0,
        },
    )?;
    let rotary = Rotary::new(config, p.device())?;
    let mut layers: Vec<Layer> = Vec::with_capacity(config.layers as usize + 2);
    layers.push(Box::new(Embedding {
        wte: wte.shallow_clone(),
    }));
    for i in 0..config.layers {
        let block = &transformer / "h" / i;
        let attn = &block / "attn";
        let mlp = &block / "mlp";
        layers.push(Box::new(Block {
            rms_1: RmsNorm::new(&(&block / "rms_1"), dim, config.norm_eps)?,
            attn: Attention {
                c_attn: linear_weight(
                    &(&attn / "c_attn"),
                    dim,
                    (config.heads + 2 * config.kv_heads) * hd,
                )?,
                c_proj: linear_weight(&(&attn / "c_proj"), config.heads * hd, dim)?,
                heads: config.heads,
                kv_heads: config.kv_heads,
                head_dim: hd,
                rotary: rotary.shallow_clone(),
            },
            rms_2: RmsNorm::new(&(&block / "rms_2"), dim, config.norm_eps)?,
            mlp: Mlp {
                c_fc1: linear_weight(&(&mlp / "c_fc1"), dim, hidden)?,
                c_fc2: linear_weight(&(&mlp / "c_fc2"), dim, hidden)?,
                c_proj: linear_weight(&(&mlp / "c_proj"), hidden, dim)?,
            },
        }));
    }
    let ln_f = RmsNorm::new(&(&transformer / "ln_f"), dim, config.norm_eps)?;
    let weight = if config.tied {
        wte
    } else {
        linear_weight(&(p / "lm_head"), dim, config.vocab)?
    };
    layers.push(Box::new(Head { ln_f, weight }));
    Ok(Network {
        layers,
        task: Task::NextToken {
            vocab: config.vocab,
        },
        example_shape: vec![config.seq],
        blocks: None,
    })
}
