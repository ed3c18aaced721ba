//! ResNet (He et al. 2015) as tch's `vision::resnet` and torchvision's `resnet18..152`.
use crate::error::ModelError;
use crate::network::Network;
use tch::nn;

/// A ResNet's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ResNetConfig {
    /// 18, 34 (basic blocks), 50, 101 or 152 (bottleneck blocks).
    pub depth: i64,
    /// Number of classes of the final linear layer.
    pub classes: i64,
    /// One image's shape, `[channels, height, width]`.
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
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        Err(ModelError::config("depth", "resnet is not built yet"))
    }
}

/// Builds a ResNet under `p`.
pub fn resnet(p: &nn::Path, config: &ResNetConfig) -> Result<Network, ModelError> {
    let _ = (p, config);
    Err(ModelError::config("depth", "resnet is not built yet"))
}
