//! The `optimizer:` technique: which `memsave-optim` optimizer steps inside the
//! measured step, with which state precision, where, and whether inside backward.
use super::de::validated_map;
use serde::de::Deserializer;
use serde::Deserialize;

pub use memsave_plan::{OptimizerKind, OptimizerSpec, StatePlacement, StatePrecision};

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
