//! The suite file: a YAML description of models and strategies, parsed into
//! [`Suite`] with every check done while parsing, so that each error carries the
//! file, line and column of the offending item (`bad.yaml:6:26: ...`).
//!
//! The code is split into the data model ([`Suite`], [`ModelSpec`] and the size
//! limits), the strategy grammar ([`Technique`], [`StrategySpec`] and how a list entry
//! becomes one), deserialization (every check, in the deserializer of the item it
//! concerns, with no state beyond one parse) and errors ([`SuiteError`]).
//!
//! # The format
//!
//! ```yaml
//! suite: NAME                # copied into the report
//! device: cpu                # cpu (default), cuda, or auto (CUDA when available)
//! threads: 2                 # libtorch intra-op threads, 1..=1024 (default: libtorch's)
//! seed: 0                    # parameters and inputs (default 0)
//! warmup: 1                  # unmeasured steps per case (default 1)
//! repeats: 3                 # measured steps per case, at least 1 (default 3)
//! memory_limit: 8GiB         # simulated CPU capacity, positive (default: none)
//! world_size: 2              # run every case on N ranks, 1..=64 (default: one process)
//! models:                    # at least one; names unique
//!   - {name: m, kind: residual_linear, layers: 10, hidden: 512, batch: [50, 100]}
//!   - {name: mlp, kind: residual_mlp, layers: 4, hidden: 256, expansion: 4, batch: [16]}
//!   - {name: gpt, kind: transformer, layers: 6, hidden: 256, heads: 4, batch: [8, 128]}
//!   - {name: big, kind: residual_linear, layers: 10, hidden: 512, batch: [500, 500], enabled: false}
//!   # the zoo (memsave-models): real architectures, cross-entropy on a synthetic batch
//!   - {name: r18, kind: resnet, depth: 18, image: [3, 64, 64], classes: 10, batch: 8}
//!   - {name: mnv2, kind: mobilenet_v2, image: [3, 64, 64], classes: 10, batch: 8}
//!   - {name: llama, kind: llama, vocab: 4096, dim: 256, layers: 6, heads: 8, kv_heads: 4, seq: 128, batch: 4}
//!   - {name: vit, kind: vit, image: [3, 64, 64], patch: 8, dim: 192, layers: 6, heads: 3, mlp: 768, classes: 100, batch: 8}
//! strategies:                # at least one; names unique; each runs on every model
//!   - baseline               # plain training: the reference of ratios and gradient differences
//!   - inplace_add            # the seed's x += f(x)
//!   - add_out                # the seed's add(x, f(x), out=x)
//!   - safe_residual          # memsave-inplace's residual_add
//!   - grad_scaler            # memsave-amp's GradScaler with PyTorch's defaults
//!   - checkpoint: {segments: 3}        # or {every_layer: true}, {nested: true}, {budget: 60MiB}
//!   - autocast: {dtype: bf16}          # or fp16
//!   - accumulate: {micro_batches: 4}   # memsave-accum's GradAccumulator
//!   - compress: {dtype: int8}          # or bf16, fp16, fp8: memsave-hooks' Compress
//!   - offload: {to: disk}              # or {to: disk, dir: PATH}, {to: cpu}
//!   - offload_grads: {to: disk}        # gradients in files between micro-batches
//!   - grad_scaler: {init_scale: 1024, growth_interval: 100}  # also growth_factor, backoff_factor
//!   - {name: ckpt+bf16, with: [{checkpoint: {segments: 3}}, {autocast: {dtype: bf16}}]}
//!   - optimizer: {kind: adamw, state: int8, in_backward: true, placement: device}
//!   - optimizer: {kind: adamw, lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weight_decay: 0.1}
//!   - optimizer: {kind: sgd, lr: 0.1, momentum: 0.9, weight_decay: 0}
//!   - {name: zero2, with: [{zero: 2}, {optimizer: {kind: adamw}}]}  # needs world_size
//!   - {name: zero3, with: [{zero: 3}, {optimizer: {kind: adamw}}]}  # parameters sharded too
//!   - {name: zero3-keep, with: [{zero: {stage: 3, reshard_after_forward: false}}]}
//!   - {name: params-in-files, with: [{offload_params: {to: disk}}, {optimizer: {kind: adamw, in_backward: true}}]}  # world_size: 1 or more
//! ```
//!
//! Each model kind accepts only its own keys. The harness's kinds (`residual_linear`,
//! `residual_mlp`, `transformer`) take `layers`, `hidden`, `batch` (a list: the input's
//! leading dimensions), `expansion` and `heads`, and train on the mean square of the
//! output. The zoo's kinds build `memsave_models`' networks, one checkpointable layer
//! per block, train on the cross-entropy against a synthetic target, and take `batch`
//! as one number (examples per step):
//! - `resnet`: `depth` (18, 34, 50, 101, 152), `image` ([channels, height, width]),
//!   `classes`;
//! - `mobilenet_v2`: `image`, `classes`;
//! - `llama`: `vocab`, `dim`, `layers`, `heads`, `kv_heads` (default `heads`), `hidden`
//!   (the SwiGLU's width; default LLaMA's rule), `seq` (tokens per example), `tied`
//!   (default false);
//! - `vit`: `image`, `patch`, `dim`, `layers`, `heads`, `mlp`, `classes`;
//! - `unet`: `image`, `classes` (per pixel), `base` (channels of the first level),
//!   `levels` (2^levels must divide the image's height and width);
//! - `encoder_decoder`: `vocab`, `dim`, `heads`, `encoder_layers`, `decoder_layers`,
//!   `source` and `target` (tokens per example; the input packs both, `[batch,
//!   source + target]`).
//!
//! `unet` and `encoder_decoder` are not chains: their forward is one layer running
//! named blocks, and their checkpoint plan is `none` or `every_layer` (one checkpoint
//! per block); `segments`, `nested` and budgets are refused when the case runs.
//!
//! Their configuration is checked while parsing by the architecture's own
//! `memsave_models::Architecture::validate` (heads dividing dim, kv_heads dividing
//! heads, an image no smaller than the network's stride, ...), reported at the model
//! entry with the key at fault. A key of another kind is unknown; an unknown key is
//! reported at the key when `kind:` comes before it, else at the entry. The residual
//! updates (`inplace_add`, `add_out`, `safe_residual`) are unavailable on the zoo's
//! networks, whose blocks add as their architecture does.
//!
//! A strategy without `name:` is named canonically: `checkpoint(segments=3)`,
//! `grad_scaler(init_scale=1024, growth_interval=100)`, or the techniques' names joined
//! by `+`. A `with:` list applies at most one technique of each kind (one residual
//! update, one checkpoint plan, ...); `baseline` combines with nothing. Which strategy
//! is the baseline is decided by its techniques, not its name: `{name: ref, with:
//! [baseline]}` is one, a checkpoint strategy named `baseline` is not.
//!
//! `grad_scaler` runs `memsave_amp::GradScaler` in the step: the loss (each weighted
//! micro-loss, with `accumulate`) is scaled before backward, the gradients are
//! unscaled in place and checked for inf/NaN after it, and the scale is updated; the
//! scaler lives for the whole case, so its state (two 4-byte tensors) counts in
//! `start_bytes` from the second step on. Without an `optimizer` the bench steps no
//! optimizer, so a step with inf/NaN gradients shows as a diverged gradient rather than
//! a skipped step.
//!
//! `optimizer` steps a `memsave-optim` optimizer inside the measured step and then
//! frees the gradients (`zero_grad(set_to_none)`), so the peak and time include the
//! update. The optimizer lives for the whole case: its state counts in `start_bytes`
//! from the second step on and is reported as `optimizer_state_bytes`. The case starts
//! from the model's weights and they are restored after it, so every case sees the
//! same model. Its gradients are not compared with the baseline's (they are freed by the step).
//! `in_backward: true` cannot be combined with `accumulate` (every backward would
//! step) unless `offload_grads` keeps the gradients in files until the last
//! micro-batch's backward steps them, nor with `grad_scaler` (the inf check needs every gradient before the first
//! update); such a strategy is reported unavailable with the reason by `memsave bench`,
//! and is an error (exit 2) of `memsave check`, which decides by the same function
//! ([`crate::availability`]).
//!
//! The optimizer's hyperparameters, each optional: `lr` (default 1e-3 for both kinds,
//! the value the harness always used, also recent PyTorch's SGD default), `weight_decay`
//! (AdamW's decoupled decay, default 1e-2; SGD's L2 penalty, default 0), and for
//! `kind: adamw` `betas: [b1, b2]` (default [0.9, 0.999]) and `eps` (default 1e-8), for
//! `kind: sgd` `momentum` (default 0; dampening 0, no Nesterov). `lr`, `eps` and
//! `weight_decay` must be finite and >= 0, each beta and `momentum` in [0, 1); betas or
//! eps with sgd and momentum with adamw are errors, not ignored. SGD without momentum
//! keeps no state (so `state:` must stay f32); with `momentum > 0` it keeps one buffer
//! per parameter, which `state` and `placement` apply to. The canonical name lists the
//! hyperparameters that differ from the kind's defaults: `optimizer(kind=adamw,
//! lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)`.
//!
//! `compress` and `offload` wrap the forward in memsave-hooks' saved-tensor hooks
//! (`Compress`, `DiskOffload`, `SaveOnCpu`), made fresh for each step; the parameters
//! and the step's input pass through untouched. They are one kind: a strategy applies
//! at most one of them. `offload: {to: disk}` writes to `dir:`, which must exist, or
//! else to `memsave-offload` in the system's temporary directory (created); a write
//! that fails makes the case an error naming the directory.
//!
//! # Limits
//!
//! So that a typo cannot build a model for minutes before the first case runs, a
//! model has at most [`MAX_LAYERS`] blocks, every dimension (`hidden`, each `batch`
//! entry, `expansion`, `heads`, and the zoo's `depth`, `classes`, `vocab`, `dim`,
//! `kv_heads`, `seq`, `patch`, `mlp` and each `image` entry) is at most
//! [`MAX_DIMENSION`], the parameters number at most [`MAX_PARAMETERS`] and the input at
//! most [`MAX_INPUT_ELEMENTS`] elements (16 GiB each in f32). The counts are computed
//! in checked arithmetic: an overflow is an error, never a wrapped number. A zoo
//! network's parameters are counted from its layer shapes, nothing built
//! ([`ModelSpec::parameter_count`]).
mod de;
mod error;
mod model;
mod optimizer;
mod strategy;
mod values;

pub use error::SuiteError;
pub use model::{
    DeviceChoice, ModelKind, ModelSpec, ModelSpecError, Suite, MAX_DIMENSION, MAX_INPUT_ELEMENTS,
    MAX_LAYERS, MAX_PARAMETERS, MAX_THREADS, MAX_WORLD_SIZE,
};
pub use optimizer::{OptimizerKind, OptimizerSpec, StatePlacement, StatePrecision};
pub use strategy::{
    AutoBatchSpec, CheckpointSpec, CompressDtype, FitLever, FitSpec, OffloadSpec, ScalerSpec,
    StrategySpec, Technique, ZeroSpec,
};
pub use values::{Dtype, Size};

use std::path::Path;

impl Suite {
    /// Reads and validates a suite file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Suite, SuiteError> {
        let path = path.as_ref();
        let source = std::fs::read_to_string(path).map_err(|source| SuiteError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Suite::from_yaml(&source, &path.display().to_string())
    }

    /// Parses and validates `source`; `file` names it in error messages.
    pub fn from_yaml(source: &str, file: &str) -> Result<Suite, SuiteError> {
        let mut suite: Suite =
            serde_yaml::from_str(source).map_err(|e| SuiteError::from_yaml(file, &e))?;
        suite.source = Some(source.to_owned());
        Ok(suite)
    }
}
