//! The levers a training step can pull, as the harness's suites and `fit` name them:
//! the optimizer stepped inside the step (`memsave-optim`), and what the saved-tensor
//! hooks do with saved activations (`memsave-hooks`).
use serde::Deserialize;

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// `memsave_optim::AdamW` with PyTorch's defaults and `lr: 1e-3`: two moments.
    #[default]
    Adamw,
    /// `memsave_optim::Sgd` with PyTorch's defaults and `lr: 1e-3`: no momentum, so no
    /// state at all.
    Sgd,
}

/// The precision of the optimizer's state buffers (`memsave_optim::State`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatePrecision {
    /// 4 bytes per value.
    #[default]
    F32,
    /// 2 bytes per value.
    Bf16,
    /// 8-bit blockwise codes, one f32 scale per 256 values.
    Int8,
}

/// Where the state lives between steps (`memsave_optim::Placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatePlacement {
    /// On the parameters' device.
    #[default]
    Device,
    /// In host memory (the same as `device` on the CPU).
    Cpu,
    /// In files of a temporary directory made for the case.
    Disk,
}

/// What an `optimizer:` entry asks for; every key is optional.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    /// `kind: adamw | sgd` (default adamw).
    #[serde(default)]
    pub kind: OptimizerKind,
    /// `state: f32 | bf16 | int8` (default f32).
    #[serde(default)]
    pub state: StatePrecision,
    /// `in_backward: true` steps each parameter from a post-accumulate-grad hook and
    /// frees its gradient at once (default false: one step after backward).
    #[serde(default)]
    pub in_backward: bool,
    /// `placement: device | cpu | disk` (default device).
    #[serde(default)]
    pub placement: StatePlacement,
}

impl OptimizerSpec {
    /// `key=value` for the kind and every key that differs from its default.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![format!(
            "kind={}",
            match self.kind {
                OptimizerKind::Adamw => "adamw",
                OptimizerKind::Sgd => "sgd",
            }
        )];
        match self.state {
            StatePrecision::F32 => {}
            StatePrecision::Bf16 => args.push("state=bf16".into()),
            StatePrecision::Int8 => args.push("state=int8".into()),
        }
        if self.in_backward {
            args.push("in_backward=true".into());
        }
        match self.placement {
            StatePlacement::Device => {}
            StatePlacement::Cpu => args.push("placement=cpu".into()),
            StatePlacement::Disk => args.push("placement=disk".into()),
        }
        args
    }
}

/// What a `compress:` entry asks for: the codec saved activations are stored with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompressDtype {
    /// `bf16`.
    Bf16,
    /// `fp16`.
    Fp16,
    /// `fp8`: e4m3 with a per-block scale.
    Fp8,
    /// `int8`: blockwise absmax.
    Int8,
}

impl CompressDtype {
    /// The name as written in a suite.
    pub fn as_str(self) -> &'static str {
        match self {
            CompressDtype::Bf16 => "bf16",
            CompressDtype::Fp16 => "fp16",
            CompressDtype::Fp8 => "fp8",
            CompressDtype::Int8 => "int8",
        }
    }
}

/// Where an `offload:` entry keeps saved activations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OffloadSpec {
    /// `{to: disk}`, optionally `dir: PATH` (default: a `memsave-offload` folder in the
    /// system's temporary directory, created if missing).
    Disk {
        /// `dir:` as written.
        dir: Option<String>,
        /// `max_in_flight: SIZE`: bytes that may wait for the writer thread (the
        /// forward waits beyond that); `None` for `DiskOffload`'s default.
        max_in_flight: Option<(u64, String)>,
    },
    /// `{to: cpu}`: CUDA activations in pinned host memory (nothing to do on the CPU).
    Cpu,
}
