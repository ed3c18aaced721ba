//! The `optimizer:` technique: which `memsave-optim` optimizer steps inside the
//! measured step, with which hyperparameters, state precision, where, and whether
//! inside backward.
//!
//! Each hyperparameter is checked at its own position (`lr: -1` is reported at the
//! `-1`); what depends on two keys (momentum with adamw, betas or eps with sgd, a state
//! precision for sgd without momentum) at the position of the `optimizer:` mapping.
use super::values::validated_map;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::marker::PhantomData;

pub use memsave_step::{OptimizerKind, OptimizerSpec, StatePlacement, StatePrecision};

/// What the mapping may hold, for the messages of a wrong type or an unknown key.
const EXPECTING: &str = "optimizer arguments: {kind: adamw|sgd, lr, betas: [b1, b2], eps, weight_decay, momentum, state: f32|bf16|int8, in_backward: bool, placement: device|cpu|disk}";

/// The range of a hyperparameter that is one number, and how to say it.
trait Scalar {
    const EXPECTED: &'static str;
    fn accepts(v: f64) -> bool;
}

/// `lr`, `eps`, `weight_decay`: finite and at least 0 (0 is allowed, as in PyTorch).
struct NonNegative;
impl Scalar for NonNegative {
    const EXPECTED: &'static str = "a finite number >= 0";
    fn accepts(v: f64) -> bool {
        v.is_finite() && v >= 0.0
    }
}

/// `momentum`: in [0, 1). PyTorch takes any momentum >= 0, but from 1 on the buffer
/// grows without bound, which no suite means.
struct Fraction;
impl Scalar for Fraction {
    const EXPECTED: &'static str = "a number in [0, 1)";
    fn accepts(v: f64) -> bool {
        (0.0..1.0).contains(&v)
    }
}

/// One number in the range of `S`, refused at its own position otherwise.
struct Number<S>(f64, PhantomData<S>);

impl<'de, S: Scalar> Deserialize<'de> for Number<S> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<S>(PhantomData<S>);
        impl<S: Scalar> Visitor<'_> for V<S> {
            type Value = Number<S>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(S::EXPECTED)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Number<S>, E> {
                if S::accepts(v) {
                    Ok(Number(v, PhantomData))
                } else {
                    Err(E::custom(format!("must be {}, got {v}", S::EXPECTED)))
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Number<S>, E> {
                self.visit_f64(v as f64)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Number<S>, E> {
                self.visit_f64(v as f64)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// `betas: [beta1, beta2]`: two numbers, each in [0, 1).
struct Betas(f64, f64);

impl<'de> Deserialize<'de> for Betas {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Betas;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("two numbers in [0, 1), e.g. [0.9, 0.999]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Betas, A::Error> {
                let mut values = Vec::new();
                while let Some(v) = seq.next_element::<f64>()? {
                    values.push(v);
                }
                let [b1, b2] = values[..] else {
                    return Err(de::Error::custom(format!(
                        "must be two numbers [beta1, beta2], e.g. [0.9, 0.999]; got {}",
                        values.len()
                    )));
                };
                if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
                    return Err(de::Error::custom(format!(
                        "must each be in [0, 1), got [{b1}, {b2}]"
                    )));
                }
                Ok(Betas(b1, b2))
            }
        }
        d.deserialize_seq(V)
    }
}

/// The suite's spelling of the library's enums (`kind: adamw`, `state: int8`,
/// `placement: disk`): `memsave-step` keeps its types free of any file format, so the
/// words are read here and turned into its values. Each mirror has the library type's
/// name and variants, so serde's messages (unknown variant `lamb`, expected `adamw`
/// or `sgd`) read as they did when the library derived them.
mod words {
    use serde::Deserialize;

    #[derive(Debug, Clone, Copy, Default, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub(super) enum OptimizerKind {
        #[default]
        Adamw,
        Sgd,
    }

    impl From<OptimizerKind> for super::OptimizerKind {
        fn from(kind: OptimizerKind) -> Self {
            match kind {
                OptimizerKind::Adamw => Self::Adamw,
                OptimizerKind::Sgd => Self::Sgd,
            }
        }
    }

    #[derive(Debug, Clone, Copy, Default, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub(super) enum StatePrecision {
        #[default]
        F32,
        Bf16,
        Int8,
    }

    impl From<StatePrecision> for super::StatePrecision {
        fn from(state: StatePrecision) -> Self {
            match state {
                StatePrecision::F32 => Self::F32,
                StatePrecision::Bf16 => Self::Bf16,
                StatePrecision::Int8 => Self::Int8,
            }
        }
    }

    #[derive(Debug, Clone, Copy, Default, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub(super) enum StatePlacement {
        #[default]
        Device,
        Cpu,
        Disk,
    }

    impl From<StatePlacement> for super::StatePlacement {
        fn from(placement: StatePlacement) -> Self {
            match placement {
                StatePlacement::Device => Self::Device,
                StatePlacement::Cpu => Self::Cpu,
                StatePlacement::Disk => Self::Disk,
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOptimizer {
    #[serde(default)]
    kind: words::OptimizerKind,
    #[serde(default)]
    state: words::StatePrecision,
    #[serde(default)]
    in_backward: bool,
    #[serde(default)]
    placement: words::StatePlacement,
    lr: Option<Number<NonNegative>>,
    betas: Option<Betas>,
    eps: Option<Number<NonNegative>>,
    weight_decay: Option<Number<NonNegative>>,
    momentum: Option<Number<Fraction>>,
}

impl RawOptimizer {
    /// The checks that need two keys.
    fn check(self) -> Result<OptimizerSpec, OptimizerArgsError> {
        let spec = OptimizerSpec {
            kind: self.kind.into(),
            state: self.state.into(),
            in_backward: self.in_backward,
            placement: self.placement.into(),
            lr: self.lr.map(|n| n.0),
            betas: self.betas.map(|b| (b.0, b.1)),
            eps: self.eps.map(|n| n.0),
            weight_decay: self.weight_decay.map(|n| n.0),
            momentum: self.momentum.map(|n| n.0),
        };
        match spec.kind {
            OptimizerKind::Adamw if spec.momentum.is_some() => {
                return Err(OptimizerArgsError::MomentumWithAdamw)
            }
            OptimizerKind::Sgd if spec.betas.is_some() || spec.eps.is_some() => {
                return Err(OptimizerArgsError::BetasWithSgd)
            }
            OptimizerKind::Sgd
                if spec.state != StatePrecision::F32 && spec.momentum.unwrap_or(0.0) == 0.0 =>
            {
                return Err(OptimizerArgsError::StateWithoutMomentum)
            }
            _ => {}
        }
        // The same rules the optimizer will apply, so nothing fails later.
        spec.rule()?;
        Ok(spec)
    }
}

/// Why `optimizer:` arguments are invalid together (each key alone is checked where
/// it is read).
#[derive(Debug, thiserror::Error)]
enum OptimizerArgsError {
    #[error("optimizer: momentum is for kind sgd; adamw's moments decay by betas: [b1, b2]")]
    MomentumWithAdamw,
    #[error(
        "optimizer: betas and eps are for kind adamw; sgd takes lr, momentum and weight_decay"
    )]
    BetasWithSgd,
    #[error("optimizer: sgd without momentum keeps no state, so state must stay f32 (give momentum > 0 for a momentum buffer)")]
    StateWithoutMomentum,
    /// The optimizer's own checks refuse the hyperparameters.
    #[error(transparent)]
    Rule(#[from] memsave_optim::OptimError),
}

/// `{optimizer: {...}}`, checked where it is written.
pub(super) fn optimizer_args<'de, D: Deserializer<'de>>(d: D) -> Result<OptimizerSpec, D::Error> {
    validated_map(d, EXPECTING, RawOptimizer::check)
}

/// Newtype so `map.next_value` runs [`optimizer_args`].
pub(super) struct OptimizerArgs(pub(super) OptimizerSpec);

impl<'de> Deserialize<'de> for OptimizerArgs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        optimizer_args(d).map(OptimizerArgs)
    }
}
