//! ResNet (He et al. 2015) as tch's `vision::resnet` and torchvision's `resnet18..152`.
//!
//! The network is a chain of blocks: the stem (`conv1`, `bn1`, ReLU, 3x3 max pool of
//! stride 2), every basic or bottleneck residual block
//! of `layer1..layer4` in order, and the head (global average pool, flatten, `fc`).
//! Variables have tch's names, which are torchvision's less the BatchNorm's
//! `num_batches_tracked` (tch's BatchNorm has no batch counter): `conv1.weight`,
//! `bn1.running_mean`, `layer2.0.downsample.1.weight`, `fc.bias`, ...
//!
//! The forward calls the same ATen operations as torchvision's, in the same order and
//! with the same in-place ones (ReLU after BatchNorm and after the residual sum, the
//! residual sum itself), so that a training step allocates what PyTorch's does.
//! Initialization follows torchvision: convolutions from a normal of standard
//! deviation `sqrt(2 / fan_out)`, BatchNorm weight 1 and bias 0, `fc` uniform in
//! `±1/sqrt(fan_in)`; it does not draw the same numbers as torchvision or tch.
use crate::error::{at_least_one, ModelError};
use crate::network::{Layer, Network, Task};
use tch::nn::{self, ModuleT};
use tch::Tensor;

/// The depths a ResNet may have.
pub const DEPTHS: [i64; 5] = [18, 34, 50, 101, 152];

/// Total downsampling of a ResNet (and of a MobileNetV2): an image must be at least
/// this many pixels high and wide.
pub const STRIDE: i64 = 32;

/// A ResNet's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ResNetConfig {
    /// 18, 34 (basic blocks), 50, 101 or 152 (bottleneck blocks).
    pub depth: i64,
    /// Number of classes of the final linear layer.
    pub classes: i64,
    /// One image's shape, `[channels, height, width]`. tch's and torchvision's models
    /// take 3 channels; another count changes only `conv1.weight`'s shape.
    pub image: [i64; 3],
}

impl Default for ResNetConfig {
    fn default() -> Self {
        Self {
            depth: 18,
            classes: 1000,
            image: [3, 224, 224],
        }
    }
}

impl ResNetConfig {
    /// Checks the configuration: a depth of [`DEPTHS`], at least one class, at least
    /// one channel, and an image at least [`STRIDE`] (32) pixels high and wide.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `depth`, `classes` or `image`.
    pub fn validate(&self) -> Result<(), ModelError> {
        if !DEPTHS.contains(&self.depth) {
            return Err(ModelError::config(
                "depth",
                format!(
                    "a ResNet's depth must be one of 18, 34, 50, 101 or 152, got {}",
                    self.depth
                ),
            ));
        }
        at_least_one(&[("classes", self.classes)])?;
        validate_image(&self.image, "ResNet")
    }

    /// Blocks per stage (`layer1..layer4`) and whether they are bottleneck blocks.
    fn stages(&self) -> ([i64; 4], bool) {
        match self.depth {
            18 => ([2, 2, 2, 2], false),
            34 => ([3, 4, 6, 3], false),
            50 => ([3, 4, 6, 3], true),
            101 => ([3, 4, 23, 3], true),
            _ => ([3, 8, 36, 3], true),
        }
    }
}

/// Refuses an image without channels or smaller than [`STRIDE`] (`network` names the
/// network in the message).
pub(crate) fn validate_image(image: &[i64; 3], network: &str) -> Result<(), ModelError> {
    let [channels, height, width] = *image;
    if channels < 1 {
        return Err(ModelError::config(
            "image",
            format!("must have at least 1 channel, got {channels} in {image:?}"),
        ));
    }
    if height < STRIDE || width < STRIDE {
        return Err(ModelError::config(
            "image",
            format!(
                "height and width must be at least {STRIDE} ({network}'s total stride), got {height}x{width} in {image:?}"
            ),
        ));
    }
    Ok(())
}

/// A convolution without bias, initialized as torchvision does (Kaiming normal,
/// fan-out, ReLU gain).
pub(crate) fn conv(
    p: nn::Path,
    c_in: i64,
    c_out: i64,
    ksize: i64,
    stride: i64,
    groups: i64,
) -> nn::Conv2D {
    let config = nn::ConvConfig {
        stride,
        padding: (ksize - 1) / 2,
        groups,
        bias: false,
        ws_init: nn::Init::Kaiming {
            dist: nn::init::NormalOrUniform::Normal,
            fan: nn::init::FanInOut::FanOut,
            non_linearity: nn::init::NonLinearity::ReLU,
        },
        ..Default::default()
    };
    nn::conv2d(p, c_in, c_out, ksize, config)
}

/// A BatchNorm over `c` channels with torchvision's defaults (eps 1e-5, momentum 0.1,
/// weight 1, bias 0); in training mode it normalizes with the batch's statistics and
/// updates its running ones.
pub(crate) fn batch_norm(p: nn::Path, c: i64) -> nn::BatchNorm {
    let config = nn::BatchNormConfig {
        eps: 1e-5,
        momentum: 0.1,
        ws_init: nn::Init::Const(1.),
        bs_init: nn::Init::Const(0.),
        ..Default::default()
    };
    nn::batch_norm2d(p, c, config)
}

/// The stem: 7x7 convolution of stride 2, BatchNorm, ReLU (in place), 3x3 max pool of
/// stride 2.
#[derive(Debug)]
struct Stem {
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
}

impl ModuleT for Stem {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut ys = xs.apply(&self.conv1).apply_t(&self.bn1, train);
        let _ = ys.relu_();
        ys.max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false)
    }
}

/// The shortcut of a block that changes the shape: 1x1 convolution and BatchNorm.
#[derive(Debug)]
struct Downsample {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
}

impl Downsample {
    fn new(p: nn::Path, c_in: i64, c_out: i64, stride: i64) -> Option<Downsample> {
        (stride != 1 || c_in != c_out).then(|| Downsample {
            conv: conv(&p / "0", c_in, c_out, 1, stride, 1),
            bn: batch_norm(&p / "1", c_out),
        })
    }

    /// The block's identity: `xs` itself, or its projection.
    fn identity(this: &Option<Downsample>, xs: &Tensor, train: bool) -> Tensor {
        match this {
            Some(d) => xs.apply(&d.conv).apply_t(&d.bn, train),
            None => xs.shallow_clone(),
        }
    }
}

/// Adds the identity into the residual branch in place, then ReLU in place.
fn merge(mut out: Tensor, identity: &Tensor) -> Tensor {
    out += identity;
    let _ = out.relu_();
    out
}

/// A basic block (ResNet-18/34): two 3x3 convolutions with BatchNorm, the first with
/// ReLU, summed with the (projected) input, then ReLU.
#[derive(Debug)]
struct BasicBlock {
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    conv2: nn::Conv2D,
    bn2: nn::BatchNorm,
    downsample: Option<Downsample>,
}

impl BasicBlock {
    fn new(p: nn::Path, c_in: i64, c_out: i64, stride: i64) -> BasicBlock {
        BasicBlock {
            conv1: conv(&p / "conv1", c_in, c_out, 3, stride, 1),
            bn1: batch_norm(&p / "bn1", c_out),
            conv2: conv(&p / "conv2", c_out, c_out, 3, 1, 1),
            bn2: batch_norm(&p / "bn2", c_out),
            downsample: Downsample::new(&p / "downsample", c_in, c_out, stride),
        }
    }
}

impl ModuleT for BasicBlock {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut out = xs.apply(&self.conv1).apply_t(&self.bn1, train);
        let _ = out.relu_();
        let out = out.apply(&self.conv2).apply_t(&self.bn2, train);
        let identity = Downsample::identity(&self.downsample, xs, train);
        merge(out, &identity)
    }
}

/// A bottleneck block (ResNet-50/101/152): 1x1 reduction, 3x3 convolution (carrying
/// the stride, as torchvision's "ResNet v1.5"), 1x1 expansion by 4, each with
/// BatchNorm, the first two with ReLU, summed with the (projected) input, then ReLU.
#[derive(Debug)]
struct Bottleneck {
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    conv2: nn::Conv2D,
    bn2: nn::BatchNorm,
    conv3: nn::Conv2D,
    bn3: nn::BatchNorm,
    downsample: Option<Downsample>,
}

/// A bottleneck block's output channels per channel of its 3x3 convolution.
const EXPANSION: i64 = 4;

impl Bottleneck {
    fn new(p: nn::Path, c_in: i64, width: i64, stride: i64) -> Bottleneck {
        let c_out = EXPANSION * width;
        Bottleneck {
            conv1: conv(&p / "conv1", c_in, width, 1, 1, 1),
            bn1: batch_norm(&p / "bn1", width),
            conv2: conv(&p / "conv2", width, width, 3, stride, 1),
            bn2: batch_norm(&p / "bn2", width),
            conv3: conv(&p / "conv3", width, c_out, 1, 1, 1),
            bn3: batch_norm(&p / "bn3", c_out),
            downsample: Downsample::new(&p / "downsample", c_in, c_out, stride),
        }
    }
}

impl ModuleT for Bottleneck {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut out = xs.apply(&self.conv1).apply_t(&self.bn1, train);
        let _ = out.relu_();
        let mut out = out.apply(&self.conv2).apply_t(&self.bn2, train);
        let _ = out.relu_();
        let out = out.apply(&self.conv3).apply_t(&self.bn3, train);
        let identity = Downsample::identity(&self.downsample, xs, train);
        merge(out, &identity)
    }
}

/// The head: global average pool, flatten, linear layer to the logits.
#[derive(Debug)]
struct Head {
    fc: nn::Linear,
}

impl ModuleT for Head {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        xs.adaptive_avg_pool2d([1, 1])
            .flatten(1, -1)
            .apply(&self.fc)
    }
}

/// A linear layer initialized as PyTorch's `nn.Linear` (weight and bias uniform in
/// `±1/sqrt(c_in)`).
pub(crate) fn linear(p: nn::Path, c_in: i64, c_out: i64) -> nn::Linear {
    let bound = 1.0 / (c_in as f64).sqrt();
    let init = nn::Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let config = nn::LinearConfig {
        ws_init: init,
        bs_init: Some(init),
        bias: true,
    };
    nn::linear(p, c_in, c_out, config)
}

/// Builds a ResNet under `p`: the stem, then every residual block of `layer1` to
/// `layer4`, then the head, one [`Layer`] each (10 layers for ResNet-18, 18 for
/// ResNet-34 and -50, 35 for -101, 52 for -152).
///
/// # Errors
/// [`ModelError::Config`] for a configuration [`ResNetConfig::validate`] refuses,
/// [`ModelError::Torch`] when libtorch fails.
pub fn resnet(p: &nn::Path, config: &ResNetConfig) -> Result<Network, ModelError> {
    config.validate()?;
    catch_build(|| build(p, config))
}

/// Runs a builder, turning a panic of tch's layer constructors (libtorch refusing to
/// allocate a parameter) into [`ModelError::Torch`] with its first line.
pub(crate) fn catch_build(
    build: impl FnOnce() -> Result<Network, ModelError>,
) -> Result<Network, ModelError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(build)).unwrap_or_else(|payload| {
        let text = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("a layer's constructor panicked");
        Err(ModelError::Torch(
            text.lines().next().unwrap_or_default().to_owned(),
        ))
    })
}

fn build(p: &nn::Path, config: &ResNetConfig) -> Result<Network, ModelError> {
    let (counts, bottleneck) = config.stages();
    let mut layers: Vec<Layer> = Vec::new();
    layers.push(Box::new(Stem {
        conv1: conv(p / "conv1", config.image[0], 64, 7, 2, 1),
        bn1: batch_norm(p / "bn1", 64),
    }));
    let expansion = if bottleneck { EXPANSION } else { 1 };
    let mut c_in = 64;
    for (stage, (&count, width)) in counts.iter().zip([64, 128, 256, 512]).enumerate() {
        let stage_path = p / format!("layer{}", stage + 1);
        for index in 0..count {
            let stride = if stage > 0 && index == 0 { 2 } else { 1 };
            let block_path = &stage_path / index;
            if bottleneck {
                layers.push(Box::new(Bottleneck::new(block_path, c_in, width, stride)));
            } else {
                layers.push(Box::new(BasicBlock::new(block_path, c_in, width, stride)));
            }
            c_in = width * expansion;
        }
    }
    layers.push(Box::new(Head {
        fc: linear(p / "fc", c_in, config.classes),
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
