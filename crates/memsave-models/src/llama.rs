//! A LLaMA-style decoder (Touvron et al. 2023) as tch's `examples/llama`: token
//! embedding, RMSNorm, rotary position embeddings, SwiGLU, causal attention with
//! optional grouped-query attention, and a tied or untied output head.
use crate::error::ModelError;
use crate::network::Network;
use tch::nn;

/// A LLaMA-style decoder's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: i64,
    /// Width of the residual stream.
    pub dim: i64,
    /// Number of decoder blocks.
    pub layers: i64,
    /// Attention heads (must divide `dim`).
    pub heads: i64,
    /// Key/value heads (grouped-query attention; must divide `heads`; `heads` for
    /// plain multi-head attention).
    pub kv_heads: i64,
    /// Width of the SwiGLU's middle; `None` for LLaMA's rule (two thirds of `4 * dim`,
    /// rounded up to a multiple of 256).
    pub hidden: Option<i64>,
    /// Tokens per example.
    pub seq: i64,
    /// Whether the output head shares the embedding's weight.
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
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        Err(ModelError::config("dim", "llama is not built yet"))
    }
}

/// Builds a LLaMA-style decoder under `p`.
pub fn llama(p: &nn::Path, config: &LlamaConfig) -> Result<Network, ModelError> {
    let _ = (p, config);
    Err(ModelError::config("dim", "llama is not built yet"))
}
