//! The `optimizer:` technique: which `memsave-optim` optimizer steps inside the
//! measured step, with which state precision, where, and whether inside backward.
use super::de::validated_map;
use serde::de::Deserializer;
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
    pub(super) fn args(&self) -> Vec<String> {
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

/// `{optimizer: {...}}`, checked where it is written.
pub(super) fn optimizer_args<'de, D: Deserializer<'de>>(d: D) -> Result<OptimizerSpec, D::Error> {
    validated_map(
        d,
        "optimizer arguments: {kind: adamw|sgd, state: f32|bf16|int8, in_backward: bool, placement: device|cpu|disk}",
        |spec: OptimizerSpec| {
            if spec.kind == OptimizerKind::Sgd && spec.state != StatePrecision::F32 {
                return Err(
                    "optimizer: sgd keeps no state (no momentum), so state must stay f32".into(),
                );
            }
            Ok(spec)
        },
    )
}

/// Newtype so `map.next_value` runs [`optimizer_args`].
pub(super) struct OptimizerArgs(pub(super) OptimizerSpec);

impl<'de> Deserialize<'de> for OptimizerArgs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        optimizer_args(d).map(OptimizerArgs)
    }
}
