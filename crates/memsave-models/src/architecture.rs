//! [`Architecture`]: which network of the zoo, with its configuration.
use crate::encoder_decoder::EncoderDecoderConfig;
use crate::error::ModelError;
use crate::llama::LlamaConfig;
use crate::mobilenet::MobileNetV2Config;
use crate::network::Network;
use crate::resnet::ResNetConfig;
use crate::unet::UNetConfig;
use crate::vit::VitConfig;
use tch::nn;

/// A network of the zoo and its configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum Architecture {
    /// ResNet-18/34/50/101/152 (torchvision's `resnet18`, ...; tch's `vision::resnet`).
    ResNet(ResNetConfig),
    /// MobileNetV2 (torchvision's `mobilenet_v2`; tch's `vision::mobilenet::v2`).
    MobileNetV2(MobileNetV2Config),
    /// A LLaMA-style decoder (tch's `examples/llama`).
    Llama(LlamaConfig),
    /// A vision transformer (torchvision's `VisionTransformer`).
    Vit(VitConfig),
    /// A U-Net for per-pixel classification: not a chain (the encoder's features are
    /// concatenated into the decoder), built as named blocks.
    UNet(UNetConfig),
    /// An encoder–decoder transformer trained with teacher forcing: not a chain
    /// (every decoder block reads the encoder's output), built as named blocks.
    EncoderDecoder(EncoderDecoderConfig),
}

impl Architecture {
    /// The kind's name as a suite writes it (`resnet`, `mobilenet_v2`, `llama`, `vit`,
    /// `unet`, `encoder_decoder`).
    pub fn kind(&self) -> &'static str {
        match self {
            Architecture::ResNet(_) => "resnet",
            Architecture::MobileNetV2(_) => "mobilenet_v2",
            Architecture::Llama(_) => "llama",
            Architecture::Vit(_) => "vit",
            Architecture::UNet(_) => "unet",
            Architecture::EncoderDecoder(_) => "encoder_decoder",
        }
    }

    /// Whether the network is not a chain: its forward runs as
    /// [`Blocks`](memsave_checkpoint::Blocks) (`unet`, `encoder_decoder`), so its
    /// checkpoint plan is none or every block recomputed (`every_layer`), or `fit`'s.
    pub fn is_blocks(&self) -> bool {
        matches!(
            self,
            Architecture::UNet(_) | Architecture::EncoderDecoder(_)
        )
    }

    /// Checks the configuration without building anything.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the key at fault.
    pub fn validate(&self) -> Result<(), ModelError> {
        match self {
            Architecture::ResNet(c) => c.validate(),
            Architecture::MobileNetV2(c) => c.validate(),
            Architecture::Llama(c) => c.validate(),
            Architecture::Vit(c) => c.validate(),
            Architecture::UNet(c) => c.validate(),
            Architecture::EncoderDecoder(c) => c.validate(),
        }
    }

    /// Builds the network's parameters under `p` (with tch's variable names where tch
    /// has the model, torchvision's otherwise) from libtorch's current random stream.
    ///
    /// # Errors
    /// [`ModelError::Config`] for a configuration [`validate`](Self::validate) refuses,
    /// [`ModelError::Torch`] when libtorch fails (out of memory).
    pub fn build(&self, p: &nn::Path) -> Result<Network, ModelError> {
        self.validate()?;
        match self {
            Architecture::ResNet(c) => crate::resnet::resnet(p, c),
            Architecture::MobileNetV2(c) => crate::mobilenet::mobilenet_v2(p, c),
            Architecture::Llama(c) => crate::llama::llama(p, c),
            Architecture::Vit(c) => crate::vit::vit(p, c),
            Architecture::UNet(c) => crate::unet::unet(p, c),
            Architecture::EncoderDecoder(c) => crate::encoder_decoder::encoder_decoder(p, c),
        }
    }
}
