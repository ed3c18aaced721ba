//! A vision transformer (Dosovitskiy et al. 2020) as torchvision's `VisionTransformer`:
//! patch embedding, class token, learned position embedding, pre-LN encoder blocks.
use crate::error::ModelError;
use crate::network::Network;
use tch::nn;

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
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        Err(ModelError::config("dim", "vit is not built yet"))
    }
}

/// Builds a vision transformer under `p`.
pub fn vit(p: &nn::Path, config: &VitConfig) -> Result<Network, ModelError> {
    let _ = (p, config);
    Err(ModelError::config("dim", "vit is not built yet"))
}
