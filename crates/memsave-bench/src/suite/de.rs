//! Deserialization of a suite with every check done while parsing, so that each error
//! carries the position serde_yaml knows for the offending item.
//!
//! Checks run inside the deserializers of the items they concern (a positive size, a
//! known dtype, a model's heads, a name already used). Uniqueness of names is checked
//! by the list that holds them: the list hands the set of names seen so far to each
//! entry's deserializer (a `DeserializeSeed`), so no state outlives one parse.
use super::model::{
    DeviceChoice, ModelKind, ModelSpec, ModelSpecError, Suite, MAX_DIMENSION, MAX_LAYERS,
    MAX_THREADS, MAX_WORLD_SIZE,
};
use super::strategy::{deserialize_strategy, StrategySpec};
use super::values::{claim_name, Positive, Size};
use memsave_models::{
    Architecture, EncoderDecoderConfig, LlamaConfig, MobileNetV2Config, ResNetConfig, UNetConfig,
    VitConfig,
};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;

/// A model of the harness's own kinds as written (the zoo's are read by
/// [`ModelFields::finish`]).
struct RawModel {
    name: String,
    kind: ModelKind,
    layers: Positive<MAX_LAYERS>,
    hidden: Positive<MAX_DIMENSION>,
    batch: Vec<Positive<MAX_DIMENSION>>,
    expansion: Option<Positive<MAX_DIMENSION>>,
    heads: Option<Positive<MAX_DIMENSION>>,
    enabled: bool,
}

impl RawModel {
    fn check(self) -> Result<ModelSpec, ModelSpecError> {
        let model = || self.name.clone();
        if self.batch.is_empty() {
            return Err(ModelSpecError::EmptyBatch { model: model() });
        }
        if self.expansion.is_some() && self.kind != ModelKind::ResidualMlp {
            return Err(ModelSpecError::ExpansionNotApplicable { model: model() });
        }
        match (&self.kind, self.heads) {
            (ModelKind::Transformer, None) => {
                return Err(ModelSpecError::TransformerNeedsHeads { model: model() })
            }
            (ModelKind::Transformer, Some(heads)) if self.hidden.0 % heads.0 != 0 => {
                return Err(ModelSpecError::HeadsMustDivideHidden {
                    model: model(),
                    heads: heads.0,
                    hidden: self.hidden.0,
                })
            }
            (ModelKind::Transformer, _) if self.batch.len() != 2 => {
                return Err(ModelSpecError::TransformerBatch {
                    model: model(),
                    dimensions: self.batch.len(),
                })
            }
            (kind, Some(_)) if *kind != ModelKind::Transformer => {
                return Err(ModelSpecError::HeadsNotApplicable { model: model() })
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
        spec.check_limits()?;
        Ok(spec)
    }
}

/// What `kind:` names, before the rest of the entry is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
enum KindName {
    #[serde(rename = "residual_linear")]
    ResidualLinear,
    #[serde(rename = "residual_mlp")]
    ResidualMlp,
    #[serde(rename = "transformer")]
    Transformer,
    #[serde(rename = "resnet")]
    ResNet,
    #[serde(rename = "mobilenet_v2")]
    MobileNetV2,
    #[serde(rename = "llama")]
    Llama,
    #[serde(rename = "vit")]
    Vit,
    #[serde(rename = "unet")]
    UNet,
    #[serde(rename = "encoder_decoder")]
    EncoderDecoder,
}

/// The keys of the harness's own kinds, in the order of their "expected one of" list.
const OWN_KEYS: &[&str] = &[
    "name",
    "kind",
    "layers",
    "hidden",
    "batch",
    "expansion",
    "heads",
    "enabled",
];
const RESNET_KEYS: &[&str] = &[
    "name", "kind", "depth", "image", "classes", "batch", "enabled",
];
const MOBILENET_KEYS: &[&str] = &["name", "kind", "image", "classes", "batch", "enabled"];
const LLAMA_KEYS: &[&str] = &[
    "name", "kind", "vocab", "dim", "layers", "heads", "kv_heads", "hidden", "seq", "tied",
    "batch", "enabled",
];
const VIT_KEYS: &[&str] = &[
    "name", "kind", "image", "patch", "dim", "layers", "heads", "mlp", "classes", "batch",
    "enabled",
];
const UNET_KEYS: &[&str] = &[
    "name", "kind", "image", "classes", "base", "levels", "batch", "enabled",
];
const ENCODER_DECODER_KEYS: &[&str] = &[
    "name",
    "kind",
    "vocab",
    "dim",
    "heads",
    "encoder_layers",
    "decoder_layers",
    "source",
    "target",
    "batch",
    "enabled",
];
/// Every kind's keys: what an entry may hold before its `kind:` is read.
const ANY_KEYS: &[&str] = &[
    "name",
    "kind",
    "layers",
    "hidden",
    "batch",
    "expansion",
    "heads",
    "enabled",
    "depth",
    "image",
    "classes",
    "vocab",
    "dim",
    "kv_heads",
    "seq",
    "tied",
    "patch",
    "mlp",
    "base",
    "levels",
    "encoder_layers",
    "decoder_layers",
    "source",
    "target",
];

impl KindName {
    /// The keys an entry of this kind accepts.
    fn keys(self) -> &'static [&'static str] {
        match self {
            KindName::ResidualLinear | KindName::ResidualMlp | KindName::Transformer => OWN_KEYS,
            KindName::ResNet => RESNET_KEYS,
            KindName::MobileNetV2 => MOBILENET_KEYS,
            KindName::Llama => LLAMA_KEYS,
            KindName::Vit => VIT_KEYS,
            KindName::UNet => UNET_KEYS,
            KindName::EncoderDecoder => ENCODER_DECODER_KEYS,
        }
    }

    fn is_zoo(self) -> bool {
        self.keys() != OWN_KEYS
    }
}

/// Reads a mapping key that must be one of `0`; another is refused at the key's own
/// position with serde's "unknown field" message.
struct Key(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for Key {
    type Value = &'static str;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<&'static str, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for Key {
    type Value = &'static str;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<&'static str, E> {
        self.0
            .iter()
            .copied()
            .find(|k| *k == v)
            .ok_or_else(|| E::unknown_field(v, self.0))
    }
}

/// `batch:` read before `kind:`: a list (the harness's kinds) or a number (the zoo's).
enum BatchValue {
    List(Vec<Positive<MAX_DIMENSION>>),
    One(Positive<MAX_DIMENSION>),
}

impl<'de> Deserialize<'de> for BatchValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BatchValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a sequence (kinds residual_linear, residual_mlp, transformer) or a positive integer (the zoo's kinds)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BatchValue, A::Error> {
                let mut list = Vec::new();
                while let Some(b) = seq.next_element()? {
                    list.push(b);
                }
                Ok(BatchValue::List(list))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<BatchValue, E> {
                Positive::deserialize(de::value::U64Deserializer::new(v)).map(BatchValue::One)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<BatchValue, E> {
                Positive::deserialize(de::value::I64Deserializer::new(v)).map(BatchValue::One)
            }
        }
        d.deserialize_any(V)
    }
}

/// `image: [channels, height, width]`, each positive; another length is refused at the
/// list's position.
struct Image([i64; 3]);

impl<'de> Deserialize<'de> for Image {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Image;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an image shape [channels, height, width]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Image, A::Error> {
                let mut dims = Vec::new();
                while let Some(d) = seq.next_element::<Positive<MAX_DIMENSION>>()? {
                    dims.push(d.i64());
                }
                <[i64; 3]>::try_from(dims.as_slice())
                    .map(Image)
                    .map_err(|_| {
                        de::Error::custom(format!(
                            "an image is [channels, height, width], got {} dimensions",
                            dims.len()
                        ))
                    })
            }
        }
        d.deserialize_seq(V)
    }
}

/// The keys of one `models:` entry as read so far, any kind's.
#[derive(Default)]
struct ModelFields {
    seen: Vec<&'static str>,
    name: Option<String>,
    kind: Option<KindName>,
    enabled: Option<bool>,
    layers: Option<Positive<MAX_LAYERS>>,
    hidden: Option<Positive<MAX_DIMENSION>>,
    batch: Option<BatchValue>,
    expansion: Option<Positive<MAX_DIMENSION>>,
    heads: Option<Positive<MAX_DIMENSION>>,
    depth: Option<Positive<MAX_DIMENSION>>,
    image: Option<Image>,
    classes: Option<Positive<MAX_DIMENSION>>,
    vocab: Option<Positive<MAX_DIMENSION>>,
    dim: Option<Positive<MAX_DIMENSION>>,
    kv_heads: Option<Positive<MAX_DIMENSION>>,
    seq: Option<Positive<MAX_DIMENSION>>,
    tied: Option<bool>,
    patch: Option<Positive<MAX_DIMENSION>>,
    mlp: Option<Positive<MAX_DIMENSION>>,
    base: Option<Positive<MAX_DIMENSION>>,
    levels: Option<Positive<MAX_DIMENSION>>,
    encoder_layers: Option<Positive<MAX_DIMENSION>>,
    decoder_layers: Option<Positive<MAX_DIMENSION>>,
    source: Option<Positive<MAX_DIMENSION>>,
    target: Option<Positive<MAX_DIMENSION>>,
}

/// `Some(value)` or serde's "missing field" error.
fn required<T, E: de::Error>(value: Option<T>, key: &'static str) -> Result<T, E> {
    value.ok_or_else(|| E::missing_field(key))
}

impl ModelFields {
    /// Reads the entry key by key. Each key is checked when it is read against the keys
    /// of the kind when `kind:` came before it (of any kind otherwise), so that an
    /// unknown key is reported at its own position in the usual case.
    fn read<'de, A: MapAccess<'de>>(mut map: A) -> Result<ModelFields, A::Error> {
        let mut f = ModelFields::default();
        while let Some(key) = map.next_key_seed(Key(f.kind.map_or(ANY_KEYS, KindName::keys)))? {
            if f.seen.contains(&key) {
                return Err(de::Error::duplicate_field(key));
            }
            f.seen.push(key);
            match key {
                "name" => f.name = Some(map.next_value()?),
                "kind" => f.kind = Some(map.next_value()?),
                "enabled" => f.enabled = Some(map.next_value()?),
                "layers" => f.layers = Some(map.next_value()?),
                "hidden" => f.hidden = Some(map.next_value()?),
                "batch" => {
                    f.batch = Some(match f.kind {
                        Some(kind) if kind.is_zoo() => BatchValue::One(map.next_value()?),
                        Some(_) => BatchValue::List(map.next_value()?),
                        None => map.next_value()?,
                    })
                }
                "expansion" => f.expansion = Some(map.next_value()?),
                "heads" => f.heads = Some(map.next_value()?),
                "depth" => f.depth = Some(map.next_value()?),
                "image" => f.image = Some(map.next_value()?),
                "classes" => f.classes = Some(map.next_value()?),
                "vocab" => f.vocab = Some(map.next_value()?),
                "dim" => f.dim = Some(map.next_value()?),
                "kv_heads" => f.kv_heads = Some(map.next_value()?),
                "seq" => f.seq = Some(map.next_value()?),
                "tied" => f.tied = Some(map.next_value()?),
                "patch" => f.patch = Some(map.next_value()?),
                "mlp" => f.mlp = Some(map.next_value()?),
                "base" => f.base = Some(map.next_value()?),
                "levels" => f.levels = Some(map.next_value()?),
                "encoder_layers" => f.encoder_layers = Some(map.next_value()?),
                "decoder_layers" => f.decoder_layers = Some(map.next_value()?),
                "source" => f.source = Some(map.next_value()?),
                "target" => f.target = Some(map.next_value()?),
                other => unreachable!("Key admits only listed keys, got {other}"),
            }
        }
        Ok(f)
    }

    /// The model the entry describes, with every check of its kind: the harness's
    /// kinds by [`RawModel::check`], the zoo's by their architecture's `validate`
    /// (the rules live in `memsave-models`), then the size limits.
    fn finish<E: de::Error>(self) -> Result<ModelSpec, E> {
        let name = required(self.name, "name")?;
        let kind = required(self.kind, "kind")?;
        // Keys read before `kind:` were checked against every kind's.
        if let Some(key) = self.seen.iter().find(|k| !kind.keys().contains(k)) {
            return Err(E::unknown_field(key, kind.keys()));
        }
        let enabled = self.enabled.unwrap_or(true);
        let batch = self.batch;
        let architecture = match kind {
            KindName::ResidualLinear | KindName::ResidualMlp | KindName::Transformer => {
                let layers = required(self.layers, "layers")?;
                let hidden = required(self.hidden, "hidden")?;
                let batch = match required(batch, "batch")? {
                    BatchValue::List(list) => list,
                    BatchValue::One(b) => {
                        return Err(E::invalid_type(
                            de::Unexpected::Unsigned(b.0),
                            &"a sequence",
                        ))
                    }
                };
                let raw = RawModel {
                    name,
                    kind: match kind {
                        KindName::ResidualLinear => ModelKind::ResidualLinear,
                        KindName::ResidualMlp => ModelKind::ResidualMlp,
                        _ => ModelKind::Transformer,
                    },
                    layers,
                    hidden,
                    batch,
                    expansion: self.expansion,
                    heads: self.heads,
                    enabled,
                };
                return raw.check().map_err(E::custom);
            }
            KindName::ResNet => Architecture::ResNet(ResNetConfig {
                depth: required(self.depth, "depth")?.i64(),
                classes: required(self.classes, "classes")?.i64(),
                image: required(self.image, "image")?.0,
            }),
            KindName::MobileNetV2 => Architecture::MobileNetV2(MobileNetV2Config {
                classes: required(self.classes, "classes")?.i64(),
                image: required(self.image, "image")?.0,
            }),
            KindName::Llama => {
                let heads = required(self.heads, "heads")?.i64();
                Architecture::Llama(LlamaConfig {
                    vocab: required(self.vocab, "vocab")?.i64(),
                    dim: required(self.dim, "dim")?.i64(),
                    layers: required(self.layers, "layers")?.i64(),
                    heads,
                    kv_heads: self.kv_heads.map_or(heads, Positive::i64),
                    hidden: self.hidden.map(Positive::i64),
                    seq: required(self.seq, "seq")?.i64(),
                    tied: self.tied.unwrap_or(false),
                    ..LlamaConfig::default()
                })
            }
            KindName::Vit => Architecture::Vit(VitConfig {
                image: required(self.image, "image")?.0,
                patch: required(self.patch, "patch")?.i64(),
                dim: required(self.dim, "dim")?.i64(),
                layers: required(self.layers, "layers")?.i64(),
                heads: required(self.heads, "heads")?.i64(),
                mlp: required(self.mlp, "mlp")?.i64(),
                classes: required(self.classes, "classes")?.i64(),
            }),
            KindName::UNet => Architecture::UNet(UNetConfig {
                image: required(self.image, "image")?.0,
                classes: required(self.classes, "classes")?.i64(),
                base: required(self.base, "base")?.i64(),
                levels: required(self.levels, "levels")?.i64(),
            }),
            KindName::EncoderDecoder => Architecture::EncoderDecoder(EncoderDecoderConfig {
                vocab: required(self.vocab, "vocab")?.i64(),
                dim: required(self.dim, "dim")?.i64(),
                heads: required(self.heads, "heads")?.i64(),
                encoder_layers: required(self.encoder_layers, "encoder_layers")?.i64(),
                decoder_layers: required(self.decoder_layers, "decoder_layers")?.i64(),
                source: required(self.source, "source")?.i64(),
                target: required(self.target, "target")?.i64(),
            }),
        };
        let batch = match required(batch, "batch")? {
            BatchValue::One(b) => b.i64(),
            BatchValue::List(_) => {
                return Err(E::invalid_type(
                    de::Unexpected::Seq,
                    &"a positive integer (the number of examples per step)",
                ))
            }
        };
        architecture
            .validate()
            .map_err(|e| E::custom(format!("model '{name}': {e}")))?;
        let spec = ModelSpec {
            name,
            kind: ModelKind::Zoo(architecture),
            layers: 0,
            hidden: 0,
            batch: vec![batch],
            expansion: 4,
            heads: None,
            enabled,
        };
        spec.check_limits().map_err(E::custom)?;
        Ok(spec)
    }
}

/// Reads one model; with `seen`, a name already in it is an error at this entry.
fn deserialize_model<'de, D: Deserializer<'de>>(
    d: D,
    seen: Option<&mut HashSet<String>>,
) -> Result<ModelSpec, D::Error> {
    struct V<'a>(Option<&'a mut HashSet<String>>);
    impl<'de> Visitor<'de> for V<'_> {
        type Value = ModelSpec;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a model: {name, kind, layers, hidden, batch, ...}")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ModelSpec, A::Error> {
            let spec = ModelFields::read(map)?.finish()?;
            claim_name(self.0, "model", &spec.name).map_err(de::Error::custom)?;
            Ok(spec)
        }
    }
    d.deserialize_map(V(seen))
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
