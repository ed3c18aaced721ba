//! A U-Net (Ronneberger et al. 2015) for per-pixel classification: a network that is
//! not a chain. Each decoder level concatenates the encoder's feature of its level (the
//! skip) to its upsampled input, so tensors cross from the encoder's blocks to the
//! decoder's; the forward runs as named [`Blocks`] (one block per encoder level, the
//! bottom, one per decoder level, the head), and the chain the step engine sees is one
//! layer that runs them.
//!
//! Per level, two 3x3 convolutions (padding 1, no bias), each followed by BatchNorm and
//! ReLU (in place); 2x2 max pooling of stride 2 between the levels on the way down; on
//! the way up a 2x2 transposed convolution of stride 2 halves the channels, the skip
//! is concatenated before it (`cat([skip, up], 1)`), and two conv-BN-ReLU follow. A
//! 1x1 convolution gives the logits `[batch, classes, height, width]`. Channels are
//! `base * 2^level`, the bottom's `base * 2^levels`.
//!
//! | block | inputs | variables |
//! | --- | --- | --- |
//! | `enc0` | the image | `enc0.conv1.weight`, `enc0.bn1.*`, `enc0.conv2.weight`, `enc0.bn2.*` |
//! | `enc{i}`, `i` in `1..levels` | `enc{i-1}`'s output | the same under `enc{i}` (max pool first) |
//! | `bottom` | the last encoder level's output | the same under `bottom` (max pool first) |
//! | `dec{i}`, `i` from `levels - 1` down to 0 | the level below (`bottom` or `dec{i+1}`), `enc{i}`'s output | `dec{i}.up.weight`, `dec{i}.up.bias`, then as an encoder level |
//! | `head` | `dec0`'s output | `head.weight`, `head.bias` |
//!
//! (`*` is BatchNorm's `weight`, `bias`, `running_mean` and `running_var`.)
//!
//! `scripts/reference/zoo_models.py`'s `unet` is the PyTorch counterpart: the same
//! variables and ATen ops in the same order, so a training step allocates the same
//! bytes on both sides. BatchNorm runs with the batch's statistics in training and
//! updates its running statistics once per step, also when its block is recomputed.
use crate::error::{at_least_one, image_sides, ModelError};
use crate::network::{forward_blocks, only, Layer, Network, Task};
use crate::resnet::{batch_norm, catch_build, conv};
use memsave_checkpoint::{Blocks, Shared};
use tch::nn::{self, ModuleT};
use tch::Tensor;

/// The most levels a U-Net may have (each halves the image and doubles the channels).
pub const MAX_LEVELS: i64 = 16;

/// A U-Net's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct UNetConfig {
    /// One image's shape, `[channels, height, width]`; `2^levels` must divide the
    /// height and the width.
    pub image: [i64; 3],
    /// Number of classes per pixel.
    pub classes: i64,
    /// Channels of the first level (each level below doubles them).
    pub base: i64,
    /// Number of 2x2 poolings down (and transposed convolutions up): the encoder has
    /// `levels` levels above the bottom.
    pub levels: i64,
}

impl Default for UNetConfig {
    fn default() -> Self {
        Self {
            image: [3, 128, 128],
            classes: 2,
            base: 64,
            levels: 4,
        }
    }
}

impl UNetConfig {
    /// Checks the configuration: sizes at least 1, `levels` at most [`MAX_LEVELS`],
    /// `2^levels` dividing the image's height and width.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key at fault (`image`, `classes`, `base`,
    /// `levels`).
    pub fn validate(&self) -> Result<(), ModelError> {
        image_sides(self.image)?;
        let [_, height, width] = self.image;
        at_least_one(&[
            ("classes", self.classes),
            ("base", self.base),
            ("levels", self.levels),
        ])?;
        if self.levels > MAX_LEVELS {
            return Err(ModelError::config(
                "levels",
                format!("must be at most {MAX_LEVELS}, got {}", self.levels),
            ));
        }
        let stride = 1i64 << self.levels;
        if height % stride != 0 || width % stride != 0 {
            return Err(ModelError::config(
                "levels",
                format!(
                    "2^levels must divide the image's height and width: 2^{} = {stride} does not divide {height}x{width}",
                    self.levels
                ),
            ));
        }
        if self.base.checked_mul(stride).is_none() {
            return Err(ModelError::config(
                "base",
                format!(
                    "base * 2^levels overflows: base {} with levels {}",
                    self.base, self.levels
                ),
            ));
        }
        Ok(())
    }

    /// Channels at `level` (0 the first, `levels` the bottom): `base * 2^level`.
    pub fn channels(&self, level: i64) -> i64 {
        self.base << level
    }
}

/// Two 3x3 convolutions, each with BatchNorm and ReLU in place; with `pool`, a 2x2
/// max pool of stride 2 first.
#[derive(Debug)]
struct Level {
    pool: bool,
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    conv2: nn::Conv2D,
    bn2: nn::BatchNorm,
}

impl Level {
    fn new(p: nn::Path, c_in: i64, c_out: i64, pool: bool) -> Self {
        Level {
            pool,
            conv1: conv(&p / "conv1", c_in, c_out, 3, 1, 1),
            bn1: batch_norm(&p / "bn1", c_out),
            conv2: conv(&p / "conv2", c_out, c_out, 3, 1, 1),
            bn2: batch_norm(&p / "bn2", c_out),
        }
    }

    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let pooled;
        let xs = if self.pool {
            pooled = xs.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
            &pooled
        } else {
            xs
        };
        let mut ys = xs.apply(&self.conv1).apply_t(&self.bn1, train);
        let _ = ys.relu_();
        let mut ys = ys.apply(&self.conv2).apply_t(&self.bn2, train);
        let _ = ys.relu_();
        ys
    }
}

/// A decoder level: the transposed convolution of the level below, the skip
/// concatenated before it, then a [`Level`] (without pooling).
#[derive(Debug)]
struct Up {
    up: nn::ConvTranspose2D,
    level: Level,
}

impl Up {
    fn forward_t(&self, below: &Tensor, skip: &Tensor, train: bool) -> Tensor {
        let up = below.apply(&self.up);
        let xs = Tensor::cat(&[skip, &up], 1);
        self.level.forward_t(&xs, train)
    }
}

/// The network's one layer: the whole forward, block by block.
#[derive(Debug)]
struct UNet {
    blocks: Blocks,
    down: Vec<Shared<Level>>,
    up: Vec<Shared<Up>>,
    head: Shared<nn::Conv2D>,
}

impl UNet {
    fn forward(&self, b: &Blocks, xs: &Tensor, train: bool) -> memsave_checkpoint::Result<Tensor> {
        let levels = self.up.len();
        let mut skips: Vec<Tensor> = Vec::with_capacity(levels);
        let mut x = xs.shallow_clone();
        for (i, level) in self.down.iter().enumerate() {
            let name = if i == levels {
                "bottom".to_owned()
            } else {
                format!("enc{i}")
            };
            let level = level.clone();
            x = only(b.run(&name, &[&x], move |xs| {
                vec![level.with(|l| l.forward_t(&xs[0], train))]
            })?);
            if i < levels {
                skips.push(x.shallow_clone());
            }
        }
        // `up[i]` is level i's decoder; the deepest runs first.
        for (i, up) in self.up.iter().enumerate().rev() {
            let skip = skips.pop().expect("one skip per decoder level");
            let up = up.clone();
            x = only(b.run(&format!("dec{i}"), &[&x, &skip], move |xs| {
                vec![up.with(|u| u.forward_t(&xs[0], &xs[1], train))]
            })?);
        }
        let head = self.head.clone();
        Ok(only(b.run("head", &[&x], move |xs| {
            vec![head.with(|h| xs[0].apply(h))]
        })?))
    }
}

impl ModuleT for UNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        forward_blocks(&self.blocks, |b| self.forward(b, xs, train))
    }
}

/// Builds a U-Net under `p` (variables as in the [module](self)'s table), as a
/// [`Network`] of one layer that runs the blocks and keeps their handle in
/// [`Network::blocks`]. Convolutions start as torchvision's ResNet's (Kaiming normal,
/// fan-out), the transposed ones and the head as tch's defaults, BatchNorm at weight 1
/// and bias 0.
///
/// # Errors
/// [`ModelError::Config`] for a configuration [`UNetConfig::validate`] refuses,
/// [`ModelError::Torch`] when libtorch fails.
pub fn unet(p: &nn::Path, config: &UNetConfig) -> Result<Network, ModelError> {
    config.validate()?;
    catch_build(|| build(p, config))
}

fn build(p: &nn::Path, config: &UNetConfig) -> Result<Network, ModelError> {
    let levels = config.levels;
    let mut down = Vec::with_capacity(levels as usize + 1);
    let mut c_in = config.image[0];
    for level in 0..=levels {
        let path = if level == levels {
            p / "bottom"
        } else {
            p / format!("enc{level}")
        };
        let c_out = config.channels(level);
        down.push(Shared::new(Level::new(path, c_in, c_out, level > 0)));
        c_in = c_out;
    }
    let mut up = Vec::with_capacity(levels as usize);
    for level in 0..levels {
        let path = p / format!("dec{level}");
        let (c_below, c) = (config.channels(level + 1), config.channels(level));
        let transposed = nn::ConvTransposeConfig {
            stride: 2,
            ..Default::default()
        };
        up.push(Shared::new(Up {
            up: nn::conv_transpose2d(&path / "up", c_below, c, 2, transposed),
            level: Level::new(path, 2 * c, c, false),
        }));
    }
    let head = nn::conv2d(
        p / "head",
        config.channels(0),
        config.classes,
        1,
        Default::default(),
    );
    let blocks = Blocks::new();
    let layer: Layer = Box::new(UNet {
        blocks: blocks.clone(),
        down,
        up,
        head: Shared::new(head),
    });
    Ok(Network {
        layers: vec![layer],
        task: Task::Segmentation {
            classes: config.classes,
        },
        example_shape: config.image.to_vec(),
        blocks: Some(blocks),
    })
}
