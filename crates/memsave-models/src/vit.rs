//! A vision transformer (Dosovitskiy et al. 2020) as torchvision's `VisionTransformer`:
//! patch embedding, class token, learned position embedding, pre-LN encoder blocks.
//!
//! Variable names and shapes are torchvision's `state_dict` keys (`T` is the number of
//! patches plus one, `E` the width `dim`), so its weights load here:
//!
//! | name | shape |
//! | --- | --- |
//! | `class_token` | `[1, 1, E]` |
//! | `conv_proj.weight`, `conv_proj.bias` | `[E, channels, patch, patch]`, `[E]` |
//! | `encoder.pos_embedding` | `[1, T, E]` |
//! | `encoder.layers.encoder_layer_{i}.ln_1.weight`, `.bias` | `[E]` |
//! | `encoder.layers.encoder_layer_{i}.self_attention.in_proj_weight`, `in_proj_bias` | `[3E, E]`, `[3E]` |
//! | `encoder.layers.encoder_layer_{i}.self_attention.out_proj.weight`, `.bias` | `[E, E]`, `[E]` |
//! | `encoder.layers.encoder_layer_{i}.ln_2.weight`, `.bias` | `[E]` |
//! | `encoder.layers.encoder_layer_{i}.mlp.0.weight`, `.bias` | `[mlp, E]`, `[mlp]` |
//! | `encoder.layers.encoder_layer_{i}.mlp.3.weight`, `.bias` | `[E, mlp]`, `[E]` |
//! | `encoder.ln.weight`, `encoder.ln.bias` | `[E]` |
//! | `heads.head.weight`, `heads.head.bias` | `[classes, E]`, `[classes]` |
//!
//! The forward pass runs the ATen ops torchvision's training step runs, in its order
//! (including `nn.MultiheadAttention`'s packed in-projection, its copy of q/k/v to one
//! contiguous block, and `scaled_dot_product_attention`), so a training step allocates
//! the same bytes as torchvision's. torchvision only takes square 3-channel images;
//! here any `[channels, height, width]` whose sides the patch divides is accepted
//! (`scripts/reference/zoo_models.py`'s `vit` then adapts torchvision's model the same
//! way). Dropout is always 0, as torchvision's default.
use crate::error::{at_least_one, image_sides, ModelError};
use crate::network::{Layer, Network, Task};
use tch::nn::{self, Init, ModuleT};
use tch::Tensor;

/// torchvision's LayerNorm epsilon for the ViT (`partial(nn.LayerNorm, eps=1e-6)`).
const LN_EPS: f64 = 1e-6;

/// A vision transformer's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct VitConfig {
    /// One image's shape, `[channels, height, width]`.
    pub image: [i64; 3],
    /// Side of the square patches (must divide the image's height and width).
    pub patch: i64,
    /// Width of the residual stream.
    pub dim: i64,
    /// Number of encoder blocks.
    pub layers: i64,
    /// Attention heads (must divide `dim`).
    pub heads: i64,
    /// Width of the MLP's middle.
    pub mlp: i64,
    /// Number of classes of the head.
    pub classes: i64,
}

impl Default for VitConfig {
    fn default() -> Self {
        Self {
            image: [3, 224, 224],
            patch: 16,
            dim: 768,
            layers: 12,
            heads: 12,
            mlp: 3072,
            classes: 1000,
        }
    }
}

impl VitConfig {
    /// Checks the configuration: sizes at least 1, `patch` dividing the image's height
    /// and width, `heads` dividing `dim`.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key at fault (`image`, `patch`, `dim`,
    /// `layers`, `heads`, `mlp`, `classes`).
    pub fn validate(&self) -> Result<(), ModelError> {
        image_sides(self.image)?;
        let [_, height, width] = self.image;
        at_least_one(&[
            ("patch", self.patch),
            ("dim", self.dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("mlp", self.mlp),
            ("classes", self.classes),
        ])?;
        if height % self.patch != 0 || width % self.patch != 0 {
            return Err(ModelError::config(
                "patch",
                format!(
                    "must divide the image's height and width: patch {} does not divide {height}x{width}",
                    self.patch
                ),
            ));
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
        Ok(())
    }

    /// Tokens per image: the patches plus the class token.
    pub fn seq_length(&self) -> i64 {
        (self.image[1] / self.patch) * (self.image[2] / self.patch) + 1
    }
}

/// Xavier (Glorot) uniform for a weight `[out, inp]`.
fn xavier_uniform(inp: i64, out: i64) -> Init {
    let bound = (6.0 / (inp + out) as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

/// A linear layer `weight [out, inp]`, `bias [out]` under `p`.
fn linear(
    p: &nn::Path,
    inp: i64,
    out: i64,
    weight: Init,
    bias: Init,
) -> Result<nn::Linear, ModelError> {
    Ok(nn::Linear {
        ws: p.f_var("weight", &[out, inp], weight)?,
        bs: Some(p.f_var("bias", &[out], bias)?),
    })
}

fn layer_norm(p: &nn::Path, dim: i64) -> nn::LayerNorm {
    nn::layer_norm(
        p,
        vec![dim],
        nn::LayerNormConfig {
            eps: LN_EPS,
            ..Default::default()
        },
    )
}

/// Layer 0: `conv_proj` (one patch per output pixel), flattened to `[batch, E, T-1]`
/// and transposed to tokens, the class token prepended, the position embedding added.
#[derive(Debug)]
struct PatchEmbedding {
    conv_weight: Tensor,
    conv_bias: Tensor,
    patch: i64,
    class_token: Tensor,
    pos_embedding: Tensor,
    dim: i64,
}

impl ModuleT for PatchEmbedding {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let n = xs.size()[0];
        let patches = xs.conv2d(
            &self.conv_weight,
            Some(&self.conv_bias),
            [self.patch, self.patch],
            [0, 0],
            [1, 1],
            1,
        );
        let (_, _, n_h, n_w) = patches
            .size4()
            .expect("vit: conv_proj output is [batch, dim, h, w]");
        let tokens = patches.reshape([n, self.dim, n_h * n_w]).permute([0, 2, 1]);
        let class_token = self.class_token.expand([n, -1, -1], false);
        let xs = Tensor::cat(&[class_token, tokens], 1);
        (xs + &self.pos_embedding).dropout(0.0, train)
    }
}

/// One pre-LN encoder block: `x + attention(ln_1(x))`, then `x + mlp(ln_2(x))`, with
/// the attention as `nn.MultiheadAttention(batch_first=True)` computes it in training
/// with `need_weights=False`. (In evaluation without gradients PyTorch takes its fused
/// fast path instead; the result is the same, the ops and bytes are not.)
#[derive(Debug)]
struct EncoderBlock {
    ln_1: nn::LayerNorm,
    in_proj_weight: Tensor,
    in_proj_bias: Tensor,
    out_proj: nn::Linear,
    ln_2: nn::LayerNorm,
    mlp_0: nn::Linear,
    mlp_3: nn::Linear,
    heads: i64,
}

impl EncoderBlock {
    fn self_attention(&self, xs: &Tensor) -> Tensor {
        let (bsz, tgt_len, embed_dim) = xs.size3().expect("vit: block input is [batch, T, E]");
        let (heads, head_dim) = (self.heads, embed_dim / self.heads);
        // Sequence first, then the packed in-projection, split into q, k, v through one
        // contiguous [3, T, batch, E] copy.
        let query = xs.transpose(1, 0);
        let proj = query
            .linear(&self.in_proj_weight, Some(&self.in_proj_bias))
            .unflatten(-1, [3, embed_dim])
            .unsqueeze(0)
            .transpose(0, -2)
            .squeeze_dim(-2)
            .contiguous();
        let split = |i: i64| {
            proj.select(0, i)
                .view([tgt_len, bsz * heads, head_dim])
                .transpose(0, 1)
                .view([bsz, heads, tgt_len, head_dim])
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let attn = Tensor::scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, false, None, false,
        );
        attn.permute([2, 0, 1, 3])
            .reshape([bsz * tgt_len, embed_dim])
            .apply(&self.out_proj)
            .view([tgt_len, bsz, embed_dim])
            .transpose(1, 0)
    }
}

impl ModuleT for EncoderBlock {
    fn forward_t(&self, input: &Tensor, train: bool) -> Tensor {
        let xs = self.self_attention(&input.apply(&self.ln_1));
        let xs = xs.dropout(0.0, train) + input;
        let ys = xs
            .apply(&self.ln_2)
            .apply(&self.mlp_0)
            .gelu("none")
            .dropout(0.0, train)
            .apply(&self.mlp_3)
            .dropout(0.0, train);
        xs + ys
    }
}

/// The last layer: `encoder.ln`, the class token's output, `heads.head`.
#[derive(Debug)]
struct Head {
    ln: nn::LayerNorm,
    head: nn::Linear,
}

impl ModuleT for Head {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        xs.apply(&self.ln).select(1, 0).apply(&self.head)
    }
}

/// Builds a vision transformer under `p`: layer 0 the patch embedding (with class token
/// and position embedding), one layer per encoder block, the last layer the final
/// LayerNorm and the head. Initialized as torchvision initializes its model, except
/// that `conv_proj`'s truncated normal is a plain normal (same standard deviation).
///
/// # Errors
/// [`ModelError::Config`] for a configuration [`VitConfig::validate`] refuses,
/// [`ModelError::Torch`] when libtorch fails.
pub fn vit(p: &nn::Path, config: &VitConfig) -> Result<Network, ModelError> {
    config.validate()?;
    let (dim, patch, channels) = (config.dim, config.patch, config.image[0]);
    let fan_in = channels * patch * patch;
    let conv_proj = p / "conv_proj";
    let conv_weight = conv_proj.f_var(
        "weight",
        &[dim, channels, patch, patch],
        Init::Randn {
            mean: 0.0,
            stdev: (1.0 / fan_in as f64).sqrt(),
        },
    )?;
    let conv_bias = conv_proj.f_var("bias", &[dim], Init::Const(0.0))?;
    let class_token = p.f_var("class_token", &[1, 1, dim], Init::Const(0.0))?;
    let encoder = p / "encoder";
    let pos_embedding = encoder.f_var(
        "pos_embedding",
        &[1, config.seq_length(), dim],
        Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        },
    )?;
    let mut layers: Vec<Layer> = Vec::with_capacity(config.layers as usize + 2);
    layers.push(Box::new(PatchEmbedding {
        conv_weight,
        conv_bias,
        patch,
        class_token,
        pos_embedding,
        dim,
    }));
    let mlp_bias = Init::Randn {
        mean: 0.0,
        stdev: 1e-6,
    };
    for i in 0..config.layers {
        let block = &encoder / "layers" / format!("encoder_layer_{i}");
        let attention = &block / "self_attention";
        let mlp = &block / "mlp";
        layers.push(Box::new(EncoderBlock {
            ln_1: layer_norm(&(&block / "ln_1"), dim),
            in_proj_weight: attention.f_var(
                "in_proj_weight",
                &[3 * dim, dim],
                xavier_uniform(dim, 3 * dim),
            )?,
            in_proj_bias: attention.f_var("in_proj_bias", &[3 * dim], Init::Const(0.0))?,
            out_proj: linear(
                &(&attention / "out_proj"),
                dim,
                dim,
                Init::Uniform {
                    lo: -1.0 / (dim as f64).sqrt(),
                    up: 1.0 / (dim as f64).sqrt(),
                },
                Init::Const(0.0),
            )?,
            ln_2: layer_norm(&(&block / "ln_2"), dim),
            mlp_0: linear(
                &(&mlp / 0),
                dim,
                config.mlp,
                xavier_uniform(dim, config.mlp),
                mlp_bias,
            )?,
            mlp_3: linear(
                &(&mlp / 3),
                config.mlp,
                dim,
                xavier_uniform(config.mlp, dim),
                mlp_bias,
            )?,
            heads: config.heads,
        }));
    }
    let head = linear(
        &(p / "heads" / "head"),
        dim,
        config.classes,
        Init::Const(0.0),
        Init::Const(0.0),
    )?;
    layers.push(Box::new(Head {
        ln: layer_norm(&(&encoder / "ln"), dim),
        head,
    }));
    Ok(Network {
        layers,
        task: Task::Classification {
            classes: config.classes,
        },
        example_shape: config.image.to_vec(),
        blocks: None,
    })
}
