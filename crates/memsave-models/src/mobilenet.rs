//! MobileNetV2 (Sandler et al. 2018) as tch's `vision::mobilenet::v2` and
//! torchvision's `mobilenet_v2`.
use crate::error::ModelError;
use crate::network::Network;
use tch::nn;

/// A MobileNetV2's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct MobileNetV2Config {
    /// Number of classes of the final linear layer.
    pub classes: i64,
    /// One image's shape, `[channels, height, width]`.
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
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        Err(ModelError::config("image", "mobilenet_v2 is not built yet"))
    }
}

/// Builds a MobileNetV2 under `p`.
pub fn mobilenet_v2(p: &nn::Path, config: &MobileNetV2Config) -> Result<Network, ModelError> {
    let _ = (p, config);
    Err(ModelError::config("image", "mobilenet_v2 is not built yet"))
}
