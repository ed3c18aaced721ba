//! Deserialization of a suite with every check done while parsing, so that each error
//! carries the position serde_yaml knows for the offending item.
//!
//! Checks run inside the deserializers of the items they concern (a positive size, a
//! known dtype, a model's heads, a name already used). Uniqueness of names is checked
//! by the list that holds them: the list hands the set of names seen so far to each
//! entry's deserializer (a `DeserializeSeed`), so no state outlives one parse.
use super::model::{
    DeviceChoice, Dtype, ModelKind, ModelSpec, Size, Suite, MAX_DIMENSION, MAX_INPUT_ELEMENTS,
    MAX_LAYERS, MAX_PARAMETERS, MAX_THREADS, MAX_WORLD_SIZE,
};
use super::strategy::{claim_name, deserialize_strategy, StrategySpec};
use memsave_meter::Bytes;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;

/// Deserializes a mapping into `R` with serde's derive, then checks it with `check`;
/// a failed check is reported at the mapping's position.
pub(super) fn validated_map<'de, D, R, T, F>(
    deserializer: D,
    expecting: &'static str,
    check: F,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    R: Deserialize<'de>,
    F: FnOnce(R) -> Result<T, String>,
{
    struct Checked<R, F> {
        expecting: &'static str,
        check: F,
        raw: PhantomData<R>,
    }
    impl<'de, R, T, F> Visitor<'de> for Checked<R, F>
    where
        R: Deserialize<'de>,
        F: FnOnce(R) -> Result<T, String>,
    {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            let raw = R::deserialize(MapAccessDeserializer::new(map))?;
            (self.check)(raw).map_err(de::Error::custom)
        }
    }
    deserializer.deserialize_map(Checked {
        expecting,
        check,
        raw: PhantomData,
    })
}

/// A strictly positive integer of at most `MAX` (sizes, counts), reported at its own
/// position when out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Positive<const MAX: u64 = { u64::MAX }>(pub(super) u64);

impl<'de, const MAX: u64> Deserialize<'de> for Positive<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<const MAX: u64>;
        impl<const MAX: u64> Visitor<'_> for V<MAX> {
            type Value = Positive<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Positive<MAX>, E> {
                if v == 0 {
                    Err(E::custom("must be positive, got 0"))
                } else if v > MAX {
                    Err(E::custom(format!("must be at most {MAX}, got {v}")))
                } else {
                    Ok(Positive(v))
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Positive<MAX>, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("must be positive, got {v}"))),
                }
            }
        }
        d.deserialize_any(V::<MAX>)
    }
}

impl<const MAX: u64> Positive<MAX> {
    pub(super) fn usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }

    pub(super) fn i64(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as 60MiB, 8 GiB or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                if v == 0 {
                    return Err(E::custom("a size must be positive, got 0"));
                }
                Ok(Size {
                    bytes: v,
                    text: v.to_string(),
                })
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                Err(E::custom(format!("a size must be positive, got {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                let bytes: Bytes = v.parse().map_err(E::custom)?;
                if bytes.0 == 0 {
                    return Err(E::custom(format!("a size must be positive, got '{v}'")));
                }
                Ok(Size {
                    bytes: bytes.0,
                    text: v.trim().to_owned(),
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Dtype {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Dtype;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a dtype: bf16 or fp16")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Dtype, E> {
                let kind = match v {
                    "bf16" | "bfloat16" => tch::Kind::BFloat16,
                    "fp16" | "f16" | "float16" | "half" => tch::Kind::Half,
                    _ => {
                        return Err(E::custom(format!(
                            "unknown dtype '{v}', expected bf16 or fp16"
                        )))
                    }
                };
                Ok(Dtype {
                    kind,
                    text: v.to_owned(),
                })
            }
        }
        d.deserialize_str(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    kind: ModelKind,
    layers: Positive<MAX_LAYERS>,
    hidden: Positive<MAX_DIMENSION>,
    batch: Vec<Positive<MAX_DIMENSION>>,
    expansion: Option<Positive<MAX_DIMENSION>>,
    heads: Option<Positive<MAX_DIMENSION>>,
    #[serde(default = "yes")]
    enabled: bool,
}

fn yes() -> bool {
    true
}

impl RawModel {
    fn check(self) -> Result<ModelSpec, String> {
        let name = &self.name;
        if self.batch.is_empty() {
            return Err(format!(
                "model '{name}': batch must list at least one dimension"
            ));
        }
        if self.expansion.is_some() && self.kind != ModelKind::ResidualMlp {
            return Err(format!(
                "model '{name}': expansion only applies to kind residual_mlp"
            ));
        }
        match (self.kind, self.heads) {
            (ModelKind::Transformer, None) => {
                return Err(format!("model '{name}': a transformer needs heads"))
            }
            (ModelKind::Transformer, Some(heads)) if self.hidden.0 % heads.0 != 0 => {
                return Err(format!(
                    "model '{name}': heads ({}) must divide hidden ({})",
                    heads.0, self.hidden.0
                ))
            }
            (ModelKind::Transformer, _) if self.batch.len() != 2 => {
                return Err(format!(
                    "model '{name}': a transformer's batch is [batch, sequence], got {} dimensions",
                    self.batch.len()
                ))
            }
            (kind, Some(_)) if kind != ModelKind::Transformer => {
                return Err(format!(
                    "model '{name}': heads only applies to kind transformer"
                ))
            }
            _ => {}
        }
        let spec = ModelSpec {
            name: self.name,
            kind: self.kind,
            layers: self.layers.usize(),
            hidden: self.hidden.i64(),
            batch: self.batch.iter().map(|b| b.i64()).collect(),
            expansion: self.expansion.map_or(4, Positive::i64),
            heads: self.heads.map(Positive::i64),
            enabled: self.enabled,
        };
        check_size(&spec)?;
        Ok(spec)
    }
}

/// The limits on the whole model, in checked arithmetic (each dimension is already
/// within its own limit).
pub(super) fn check_size(spec: &ModelSpec) -> Result<(), String> {
    let name = &spec.name;
    match spec.parameter_count() {
        Some(n) if n <= MAX_PARAMETERS => {}
        Some(n) => {
            return Err(format!(
                "model '{name}': {n} parameters, more than the limit of {MAX_PARAMETERS} (16 GiB in f32); \
                 reduce layers, hidden or expansion"
            ))
        }
        None => {
            return Err(format!(
                "model '{name}': the parameter count overflows 64 bits (limit {MAX_PARAMETERS}); \
                 reduce layers, hidden or expansion"
            ))
        }
    }
    match spec.input_elements() {
        Some(n) if n <= MAX_INPUT_ELEMENTS => Ok(()),
        Some(n) => Err(format!(
            "model '{name}': an input of {n} elements, more than the limit of {MAX_INPUT_ELEMENTS} \
             (16 GiB in f32); reduce batch or hidden"
        )),
        None => Err(format!(
            "model '{name}': the input's element count overflows 64 bits (limit {MAX_INPUT_ELEMENTS}); \
             reduce batch or hidden"
        )),
    }
}

/// Reads one model; with `seen`, a name already in it is an error at this entry.
fn deserialize_model<'de, D: Deserializer<'de>>(
    d: D,
    seen: Option<&mut HashSet<String>>,
) -> Result<ModelSpec, D::Error> {
    validated_map(
        d,
        "a model: {name, kind, layers, hidden, batch, ...}",
        |raw: RawModel| {
            let spec = raw.check()?;
            claim_name(seen, "model", &spec.name)?;
            Ok(spec)
        },
    )
}

/// One model on its own; names are checked for uniqueness only inside a suite.
impl<'de> Deserialize<'de> for ModelSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_model(d, None)
    }
}

/// An entry whose name must be unique within its list.
trait Named: Sized {
    fn deserialize_unique<'de, D: Deserializer<'de>>(
        d: D,
        seen: &mut HashSet<String>,
    ) -> Result<Self, D::Error>;
}

impl Named for ModelSpec {
    fn deserialize_unique<'de, D: Deserializer<'de>>(
        d: D,
        seen: &mut HashSet<String>,
    ) -> Result<Self, D::Error> {
        deserialize_model(d, Some(seen))
    }
}

impl Named for StrategySpec {
    fn deserialize_unique<'de, D: Deserializer<'de>>(
        d: D,
        seen: &mut HashSet<String>,
    ) -> Result<Self, D::Error> {
        deserialize_strategy(d, Some(seen))
    }
}

/// The seed that reads one entry of a [`UniqueList`] against the names before it.
struct Unique<'a, T> {
    seen: &'a mut HashSet<String>,
    entry: PhantomData<T>,
}

impl<'de, T: Named> DeserializeSeed<'de> for Unique<'_, T> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        T::deserialize_unique(d, self.seen)
    }
}

/// A list with at least one entry and unique names; an empty list is reported at its
/// own position, a duplicate at the entry that repeats a name.
struct UniqueList<T>(Vec<T>);

impl<'de, T: Named> Deserialize<'de> for UniqueList<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Named> Visitor<'de> for V<T> {
            type Value = UniqueList<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueList<T>, A::Error> {
                let mut seen = HashSet::new();
                let mut items = Vec::new();
                while let Some(item) = seq.next_element_seed(Unique {
                    seen: &mut seen,
                    entry: PhantomData,
                })? {
                    items.push(item);
                }
                if items.is_empty() {
                    return Err(de::Error::custom("must list at least one entry"));
                }
                Ok(UniqueList(items))
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSuite {
    suite: String,
    #[serde(default = "cpu")]
    device: DeviceChoice,
    threads: Option<Positive<MAX_THREADS>>,
    #[serde(default)]
    seed: u64,
    #[serde(default = "one")]
    warmup: usize,
    #[serde(default = "three")]
    repeats: Positive,
    memory_limit: Option<Size>,
    world_size: Option<Positive<MAX_WORLD_SIZE>>,
    models: UniqueList<ModelSpec>,
    strategies: UniqueList<StrategySpec>,
}

fn cpu() -> DeviceChoice {
    DeviceChoice::Cpu
}

fn one() -> usize {
    1
}

fn three() -> Positive {
    Positive(3)
}

impl<'de> Deserialize<'de> for Suite {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        RawSuite::deserialize(d).map(|raw| Suite {
            suite: raw.suite,
            device: raw.device,
            threads: raw.threads.map(Positive::usize),
            seed: raw.seed,
            warmup: raw.warmup,
            repeats: raw.repeats.usize(),
            memory_limit: raw.memory_limit,
            models: raw.models.0,
            strategies: raw.strategies.0,
            world_size: raw.world_size.map(Positive::usize),
            source: None,
        })
    }
}
