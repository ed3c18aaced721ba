//! Real architectures as memsave workloads: ResNet (18/34/50/101/152), MobileNetV2, a
//! LLaMA-style decoder and a vision transformer, each a chain of blocks (one
//! [`CheckpointedSequential`](memsave_checkpoint::CheckpointedSequential) layer per
//! residual block) built on tch's `nn` with tch's variable names (torchvision's for the
//! ViT, which tch lacks), so that a `VarStore` saved from tch's own model of the same
//! architecture loads into them. Two networks that are not chains, a U-Net and an
//! encoder–decoder transformer, run their forward as named
//! [`Blocks`](memsave_checkpoint::Blocks) (skips and the encoder's output cross
//! blocks): the chain has one layer, and the blocks' levers decide what is
//! checkpointed ([`ZooWorkload::blocks`]).
//!
//! Every block is a `ModuleT`: BatchNorm runs with batch statistics in training and
//! updates its running statistics once per training step under every checkpoint plan.
//!
//! ```no_run
//! use memsave_models::{Architecture, ResNetConfig, ZooWorkload};
//! use memsave_step::Workload;
//! use tch::Device;
//!
//! tch::manual_seed(0);
//! let config = ResNetConfig { depth: 18, classes: 10, image: [3, 64, 64] };
//! let model = ZooWorkload::new("resnet18", &Architecture::ResNet(config), 8, Device::Cpu)?;
//! let batch = model.batch(8)?;
//! let logits = model.layers().f_forward_t(&batch.input, true)?;
//! let loss = model.loss(&logits, batch.target.as_ref())?;
//! loss.backward();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod architecture;
pub mod encoder_decoder;
mod error;
pub mod llama;
pub mod mobilenet;
mod network;
pub mod resnet;
pub mod unet;
pub mod vit;
mod workload;

pub use architecture::Architecture;
pub use encoder_decoder::EncoderDecoderConfig;
pub use error::ModelError;
pub use llama::LlamaConfig;
pub use mobilenet::MobileNetV2Config;
pub use network::{Layer, Network, Task};
pub use resnet::ResNetConfig;
pub use unet::UNetConfig;
pub use vit::VitConfig;
pub use workload::ZooWorkload;
