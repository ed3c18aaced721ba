//! MobileNetV2 (Sandler et al. 2018) as tch's `vision::mobilenet::v2` and
//! torchvision's `mobilenet_v2` (width multiplier 1).
//!
//! The network is a chain of blocks: the first 3x3 convolution of stride 2 with
//! BatchNorm and ReLU6 (`features.0`), the 17 inverted residual blocks
//! (`features.1..17`), the last 1x1 convolution to 1280 channels with BatchNorm and
//! ReLU6 (`features.18`), and the head: global average pool, flatten, dropout of
//! probability 0.2 in training, linear layer (`classifier.1`). Variables have tch's
//! names, which are torchvision's less BatchNorm's `num_batches_tracked`.
//!
//! The forward calls the same ATen operations as torchvision's, in the same order and
//! with the same in-place ones (ReLU6 after every BatchNorm but the projections'), so
//! that a training step allocates what PyTorch's does. tch's own model differs in
//! two places that change neither the variables nor (beyond rounding) the logits: it
//! applies ReLU6 out of place and pools with two means over one dimension each.
//!
//! Dropout, as in torchvision and tch, draws from libtorch's CPU random stream in
//! training; a checkpointed head replays the same draws when it is recomputed. Seed
//! (`tch::manual_seed`) for the same masks every run.
//!
//! Initialization follows torchvision: convolutions from a normal of standard
//! deviation `sqrt(2 / fan_out)`, BatchNorm weight 1 and bias 0, the classifier's
//! weight from N(0, 0.01²) and its bias 0.
use crate::error::{at_least_one, ModelError};
use crate::network::{Layer, Network, Task};
use crate::resnet::{batch_norm, catch_build, conv, validate_image};
use tch::nn::{self, ModuleT};
use tch::Tensor;

/// A MobileNetV2's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct MobileNetV2Config {
    /// Number of classes of the final linear layer.
    pub classes: i64,
    /// One image's shape, `[channels, height, width]`, at least 32 pixels high and
    /// wide (the network's total stride). tch's and torchvision's models take 3
    /// channels; another count changes only `features.0.0.weight`'s shape.
    pub image: [i64; 3],
}

impl Default for MobileNetV2Config {
    fn default() -> Self {
        Self {
            classes: 1000,
            image: [3, 224, 224],
        }
    }
}

impl MobileNetV2Config {
    /// Checks the configuration: at least one class, at least one channel, and an
    /// image at least 32 pixels (the total stride) high and wide.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `classes` or `image`.
    pub fn validate(&self) -> Result<(), ModelError> {
        at_least_one(&[("classes", self.classes)])?;
        validate_image(&self.image, "MobileNetV2")
    }
}

/// Probability of dropping a feature before the classifier, in training.
pub const DROPOUT: f64 = 0.2;

/// Channels of the last convolution, the classifier's input.
const LAST_CHANNELS: i64 = 1280;

/// Channels of the first convolution.
const FIRST_CHANNELS: i64 = 32;

/// The inverted residual stages: expansion ratio, output channels, blocks, stride of
/// the first block.
const STAGES: [(i64, i64, i64, i64); 7] = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
];

/// Convolution (`p.0`), BatchNorm (`p.1`), ReLU6 in place.
#[derive(Debug)]
struct ConvBnRelu6 {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
}

impl ConvBnRelu6 {
    fn new(p: nn::Path, c_in: i64, c_out: i64, ksize: i64, stride: i64, groups: i64) -> Self {
        ConvBnRelu6 {
            conv: conv(&p / 0, c_in, c_out, ksize, stride, groups),
            bn: batch_norm(&p / 1, c_out),
        }
    }
}

impl ModuleT for ConvBnRelu6 {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut ys = xs.apply(&self.conv).apply_t(&self.bn, train);
        // relu6_ is hardtanh_(0, 6), what torchvision's ReLU6(inplace=True) calls.
        let _ = ys.relu6_();
        ys
    }
}

/// An inverted residual block: 1x1 expansion (absent at ratio 1) and 3x3 depthwise
/// convolution, each with BatchNorm and ReLU6, then a 1x1 linear projection with
/// BatchNorm, added to the input when the shape allows (`input + branch`, out of
/// place).
#[derive(Debug)]
struct InvertedResidual {
    expand: Option<ConvBnRelu6>,
    depthwise: ConvBnRelu6,
    project: nn::Conv2D,
    bn: nn::BatchNorm,
    residual: bool,
}

impl InvertedResidual {
    fn new(p: nn::Path, c_in: i64, c_out: i64, stride: i64, ratio: i64) -> Self {
        let hidden = c_in * ratio;
        let p = &p / "conv";
        let mut next = 0;
        let expand = (ratio != 1).then(|| {
            next += 1;
            ConvBnRelu6::new(&p / 0, c_in, hidden, 1, 1, 1)
        });
        InvertedResidual {
            expand,
            depthwise: ConvBnRelu6::new(&p / next, hidden, hidden, 3, stride, hidden),
            project: conv(&p / (next + 1), hidden, c_out, 1, 1, 1),
            bn: batch_norm(&p / (next + 2), c_out),
            residual: stride == 1 && c_in == c_out,
        }
    }
}

impl ModuleT for InvertedResidual {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let hidden = match &self.expand {
            Some(expand) => expand.forward_t(xs, train),
            None => xs.shallow_clone(),
        };
        let ys = self
            .depthwise
            .forward_t(&hidden, train)
            .apply(&self.project)
            .apply_t(&self.bn, train);
        if self.residual {
            xs + ys
        } else {
            ys
        }
    }
}

/// The head: global average pool, flatten, dropout (training only), linear layer.
#[derive(Debug)]
struct Head {
    classifier: nn::Linear,
}

impl ModuleT for Head {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        xs.adaptive_avg_pool2d([1, 1])
            .flatten(1, -1)
            .dropout(DROPOUT, train)
            .apply(&self.classifier)
    }
}

/// Builds a MobileNetV2 under `p`: the first convolution, the 17 inverted residual
/// blocks, the last convolution and the head, one [`Layer`] each (20 layers).
///
/// # Errors
/// [`ModelError::Config`] for a configuration [`MobileNetV2Config::validate`]
/// refuses, [`ModelError::Torch`] when libtorch fails.
pub fn mobilenet_v2(p: &nn::Path, config: &MobileNetV2Config) -> Result<Network, ModelError> {
    config.validate()?;
    catch_build(|| build(p, config))
}

fn build(p: &nn::Path, config: &MobileNetV2Config) -> Result<Network, ModelError> {
    let features = p / "features";
    let mut layers: Vec<Layer> = Vec::new();
    layers.push(Box::new(ConvBnRelu6::new(
        &features / 0,
        config.image[0],
        FIRST_CHANNELS,
        3,
        2,
        1,
    )));
    let mut c_in = FIRST_CHANNELS;
    for &(ratio, c_out, count, first_stride) in STAGES.iter() {
        for index in 0..count {
            let stride = if index == 0 { first_stride } else { 1 };
            let path = &features / layers.len();
            layers.push(Box::new(InvertedResidual::new(
                path, c_in, c_out, stride, ratio,
            )));
            c_in = c_out;
        }
    }
    layers.push(Box::new(ConvBnRelu6::new(
        &features / layers.len(),
        c_in,
        LAST_CHANNELS,
        1,
        1,
        1,
    )));
    let classifier = nn::linear(
        p / "classifier" / 1,
        LAST_CHANNELS,
        config.classes,
        nn::LinearConfig {
            ws_init: nn::Init::Randn {
                mean: 0.,
                stdev: 0.01,
            },
            bs_init: Some(nn::Init::Const(0.)),
            bias: true,
        },
    );
    layers.push(Box::new(Head { classifier }));
    Ok(Network {
        layers,
        task: Task::Classification {
            classes: config.classes,
        },
        example_shape: config.image.to_vec(),
        blocks: None,
    })
}
