//! The suite file: a serde model of the YAML with every check done while parsing, so
//! that each error carries the file, line and column of the offending item.
//!
//! Checks run inside the deserializers of the items they concern (a positive size, a
//! known dtype, a model's heads, a name already used), which is where serde_yaml knows
//! the position; [`SuiteError`] turns that position into `file:line:column`.
use memsave_meter::Bytes;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;

/// A benchmark suite: models, strategies, and how to run them.
#[derive(Debug, Clone, PartialEq)]
pub struct Suite {
    /// The suite's name, copied into the report.
    pub suite: String,
    /// Where to run (default `cpu`).
    pub device: DeviceChoice,
    /// libtorch intra-op threads (default: libtorch's choice).
    pub threads: Option<usize>,
    /// Seed of the parameters and inputs (default 0).
    pub seed: u64,
    /// Unmeasured steps before the measured ones (default 1).
    pub warmup: usize,
    /// Measured steps per case (default 3).
    pub repeats: usize,
    /// Simulated device capacity (CPU only): allocations past it fail.
    pub memory_limit: Option<Size>,
    /// The models, in order.
    pub models: Vec<ModelSpec>,
    /// The strategies, each run on every model.
    pub strategies: Vec<StrategySpec>,
}

/// `device:` in a suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The CPU, metered by memsave's counting allocator.
    Cpu,
    /// The first CUDA device.
    Cuda,
    /// CUDA when available, else the CPU.
    Auto,
}

/// The network a model entry builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// `x = x + Linear(x)`: the seed's network.
    ResidualLinear,
    /// `x = x + Linear(GELU(Linear(x)))` with an `expansion`-times wider middle.
    ResidualMlp,
    /// Pre-LN blocks: causal self-attention and a 4x MLP, each with a residual.
    Transformer,
}

impl ModelKind {
    /// The name used in YAML.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::ResidualLinear => "residual_linear",
            ModelKind::ResidualMlp => "residual_mlp",
            ModelKind::Transformer => "transformer",
        }
    }
}

/// One `models:` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Unique within the suite.
    pub name: String,
    /// The network.
    pub kind: ModelKind,
    /// Number of blocks.
    pub layers: usize,
    /// Width of the residual stream (the input's last dimension).
    pub hidden: i64,
    /// The input's leading dimensions; the input is `batch + [hidden]`. Accumulation
    /// splits the first one.
    pub batch: Vec<i64>,
    /// Width factor of the MLP middle (`residual_mlp`, default 4).
    pub expansion: i64,
    /// Attention heads (`transformer` only, must divide `hidden`).
    pub heads: Option<i64>,
    /// When false the model runs only if `--filter` names it (opt-in models too big
    /// for a default run).
    pub enabled: bool,
}

impl ModelSpec {
    /// The input's shape, `batch + [hidden]`.
    pub fn input_shape(&self) -> Vec<i64> {
        let mut shape = self.batch.clone();
        shape.push(self.hidden);
        shape
    }
}

/// A byte size as written in the suite (`60MiB`, `8 GiB`, `1048576`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    /// The size in bytes.
    pub bytes: u64,
    /// The text as written, used in canonical names.
    pub text: String,
}

/// A reduced-precision dtype for autocast, with the spelling the suite used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dtype {
    /// The libtorch kind (`BFloat16` or `Half`).
    pub kind: tch::Kind,
    /// The text as written (`bf16`, `fp16`, ...).
    pub text: String,
}

/// What a `checkpoint:` entry asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointSpec {
    /// `{segments: k}`: `checkpoint_sequential` with k segments.
    Segments(usize),
    /// `{every_layer: true}`.
    EveryLayer,
    /// `{nested: true}`: recursive halving.
    Nested,
    /// `{budget: SIZE}`: least recomputation under a peak budget.
    Budget(Size),
}

/// One memory-saving technique.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Technique {
    /// Plain training: `x = x + f(x)`.
    Baseline,
    /// The seed's `x += f(x)`: mutates a tensor saved for backward.
    InplaceAdd,
    /// The seed's `torch.add(x, f(x), out=x)`: no autograd through `out=`.
    AddOut,
    /// memsave-inplace's `residual_add`: in place only when provably safe.
    SafeResidual,
    /// Gradient checkpointing with a plan.
    Checkpoint(CheckpointSpec),
    /// Autocast of the forward to a reduced dtype.
    Autocast(Dtype),
    /// Gradient accumulation over micro-batches of the first batch dimension.
    Accumulate {
        /// Number of micro-batches.
        micro_batches: usize,
    },
}

impl Technique {
    /// The canonical name: `kind` or `kind(key=value)`.
    pub fn canonical_name(&self) -> String {
        match self {
            Technique::Baseline => "baseline".into(),
            Technique::InplaceAdd => "inplace_add".into(),
            Technique::AddOut => "add_out".into(),
            Technique::SafeResidual => "safe_residual".into(),
            Technique::Checkpoint(CheckpointSpec::Segments(k)) => {
                format!("checkpoint(segments={k})")
            }
            Technique::Checkpoint(CheckpointSpec::EveryLayer) => {
                "checkpoint(every_layer=true)".into()
            }
            Technique::Checkpoint(CheckpointSpec::Nested) => "checkpoint(nested=true)".into(),
            Technique::Checkpoint(CheckpointSpec::Budget(size)) => {
                format!("checkpoint(budget={})", size.text)
            }
            Technique::Autocast(dtype) => format!("autocast(dtype={})", dtype.text),
            Technique::Accumulate { micro_batches } => {
                format!("accumulate(micro_batches={micro_batches})")
            }
        }
    }

    /// Techniques of the same group cannot be combined in one strategy.
    fn group(&self) -> &'static str {
        match self {
            Technique::Baseline => "baseline",
            Technique::InplaceAdd | Technique::AddOut | Technique::SafeResidual => {
                "residual update (inplace_add, add_out, safe_residual)"
            }
            Technique::Checkpoint(_) => "checkpoint",
            Technique::Autocast(_) => "autocast",
            Technique::Accumulate { .. } => "accumulate",
        }
    }
}

/// One `strategies:` entry: a name and the techniques it applies together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StrategySpec {
    /// `name:` if given, else the canonical name (`checkpoint(segments=3)`, or the
    /// techniques' names joined by `+` for an unnamed `with:` list).
    pub name: String,
    /// At least one technique, at most one of each kind.
    pub techniques: Vec<Technique>,
}

impl StrategySpec {
    /// A strategy of one technique under its canonical name.
    pub fn single(technique: Technique) -> Self {
        Self {
            name: technique.canonical_name(),
            techniques: vec![technique],
        }
    }

    /// True for plain `baseline`, the reference of ratios and gradient errors.
    pub fn is_baseline(&self) -> bool {
        self.techniques == [Technique::Baseline]
    }
}

/// A suite that cannot be read or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    /// The file cannot be read.
    #[error("{path}: cannot read the suite: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The YAML is malformed or a value is invalid, at a position.
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        /// The file (or `<string>`).
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What is wrong and what is expected.
        message: String,
    },
}

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
        serde_yaml::from_str(source).map_err(|e| {
            let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
            SuiteError::Invalid {
                file: file.to_owned(),
                line,
                column,
                message: strip_positions(&e.to_string()),
            }
        })
    }
}

/// serde_yaml appends ` at line L column C` (sometimes several times, with context);
/// the position is already in front of the message.
fn strip_positions(message: &str) -> String {
    let re = regex::Regex::new(r" at line \d+ column \d+").expect("valid regex");
    re.replace_all(message, "").into_owned()
}

thread_local! {
    /// Names seen so far in the suite being parsed (models, strategies), so that a
    /// duplicate is reported at its own position.
    static SEEN: RefCell<(HashSet<String>, HashSet<String>)> = RefCell::default();
}

fn claim_name(what: &str, name: &str) -> Result<(), String> {
    SEEN.with(|seen| {
        let mut seen = seen.borrow_mut();
        let set = if what == "model" {
            &mut seen.0
        } else {
            &mut seen.1
        };
        if set.insert(name.to_owned()) {
            Ok(())
        } else {
            Err(format!(
                "duplicate {what} name '{name}': names must be unique within a suite"
            ))
        }
    })
}

/// Deserializes a mapping into `R` with serde's derive, then checks it with `check`;
/// a failed check is reported at the mapping's position.
fn validated_map<'de, D, R, T, F>(
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

/// A strictly positive integer (sizes, counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Positive(u64);

impl<'de> Deserialize<'de> for Positive {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Positive;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Positive, E> {
                if v == 0 {
                    Err(E::custom("must be positive, got 0"))
                } else {
                    Ok(Positive(v))
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Positive, E> {
                if v <= 0 {
                    Err(E::custom(format!("must be positive, got {v}")))
                } else {
                    Ok(Positive(v as u64))
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl Positive {
    fn usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }

    fn i64(self) -> i64 {
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
    layers: Positive,
    hidden: Positive,
    batch: Vec<Positive>,
    expansion: Option<Positive>,
    heads: Option<Positive>,
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
        Ok(ModelSpec {
            name: self.name,
            kind: self.kind,
            layers: self.layers.usize(),
            hidden: self.hidden.i64(),
            batch: self.batch.iter().map(|b| b.i64()).collect(),
            expansion: self.expansion.map_or(4, Positive::i64),
            heads: self.heads.map(Positive::i64),
            enabled: self.enabled,
        })
    }
}

impl<'de> Deserialize<'de> for ModelSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        validated_map(
            d,
            "a model: {name, kind, layers, hidden, batch, ...}",
            |raw: RawModel| {
                let spec = raw.check()?;
                claim_name("model", &spec.name)?;
                Ok(spec)
            },
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    segments: Option<Positive>,
    every_layer: Option<bool>,
    nested: Option<bool>,
    budget: Option<Size>,
}

impl RawCheckpoint {
    fn check(self) -> Result<CheckpointSpec, String> {
        let mut plans = Vec::new();
        if let Some(k) = self.segments {
            plans.push(CheckpointSpec::Segments(k.usize()));
        }
        for (flag, key, plan) in [
            (self.every_layer, "every_layer", CheckpointSpec::EveryLayer),
            (self.nested, "nested", CheckpointSpec::Nested),
        ] {
            match flag {
                Some(true) => plans.push(plan),
                Some(false) => {
                    return Err(format!(
                        "checkpoint: {key} must be true (leave the strategy out instead)"
                    ))
                }
                None => {}
            }
        }
        if let Some(size) = self.budget {
            plans.push(CheckpointSpec::Budget(size));
        }
        match plans.len() {
            1 => Ok(plans.remove(0)),
            0 => Err("checkpoint needs one of segments, every_layer, nested, budget".into()),
            _ => {
                Err("checkpoint takes exactly one of segments, every_layer, nested, budget".into())
            }
        }
    }
}

impl<'de> Deserialize<'de> for CheckpointSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        validated_map(
            d,
            "checkpoint arguments: {segments: K} | {every_layer: true} | {nested: true} | {budget: SIZE}",
            RawCheckpoint::check,
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AutocastArgs {
    dtype: Dtype,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AccumulateArgs {
    micro_batches: Positive,
}

const SIMPLE: [&str; 4] = ["baseline", "inplace_add", "add_out", "safe_residual"];
const WITH_ARGS: [&str; 3] = ["checkpoint", "autocast", "accumulate"];

fn simple_technique<E: de::Error>(name: &str) -> Result<Technique, E> {
    match name {
        "baseline" => Ok(Technique::Baseline),
        "inplace_add" => Ok(Technique::InplaceAdd),
        "add_out" => Ok(Technique::AddOut),
        "safe_residual" => Ok(Technique::SafeResidual),
        _ if WITH_ARGS.contains(&name) => Err(E::custom(format!(
            "strategy '{name}' needs arguments, e.g. {{{name}: {}}}",
            example_args(name)
        ))),
        _ => Err(unknown_strategy(name)),
    }
}

fn example_args(name: &str) -> &'static str {
    match name {
        "checkpoint" => "{segments: 3}",
        "autocast" => "{dtype: bf16}",
        _ => "{micro_batches: 4}",
    }
}

fn unknown_strategy<E: de::Error>(name: &str) -> E {
    E::custom(format!(
        "unknown strategy '{name}', expected one of {}, {}",
        SIMPLE.join(", "),
        WITH_ARGS.join(", ")
    ))
}

fn technique_with_args<'de, A: MapAccess<'de>>(
    key: &str,
    map: &mut A,
) -> Result<Technique, A::Error> {
    Ok(match key {
        "checkpoint" => Technique::Checkpoint(map.next_value()?),
        "autocast" => Technique::Autocast(map.next_value::<AutocastArgs>()?.dtype),
        "accumulate" => Technique::Accumulate {
            micro_batches: map.next_value::<AccumulateArgs>()?.micro_batches.usize(),
        },
        _ if SIMPLE.contains(&key) => {
            return Err(de::Error::custom(format!(
                "'{key}' takes no arguments: write it as a plain list item"
            )))
        }
        _ => return Err(unknown_strategy(key)),
    })
}

/// A technique inside a `with:` list: a name or a one-key mapping.
struct WithItem(Technique);

impl<'de> Deserialize<'de> for WithItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WithItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a technique: a name such as baseline, or {checkpoint: {...}}")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<WithItem, E> {
                simple_technique(v).map(WithItem)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WithItem, A::Error> {
                let key: String = map
                    .next_key()?
                    .ok_or_else(|| de::Error::custom("an empty mapping is not a technique"))?;
                if key == "name" || key == "with" {
                    return Err(de::Error::custom(
                        "a technique inside `with` cannot have its own name or with",
                    ));
                }
                let technique = technique_with_args(&key, &mut map)?;
                if map.next_key::<String>()?.is_some() {
                    return Err(de::Error::custom(
                        "one technique per list item inside `with`",
                    ));
                }
                Ok(WithItem(technique))
            }
        }
        d.deserialize_any(V)
    }
}

fn combine(name: Option<String>, techniques: Vec<Technique>) -> Result<StrategySpec, String> {
    if techniques.is_empty() {
        return Err("`with` must list at least one technique".into());
    }
    for (i, t) in techniques.iter().enumerate() {
        if t.group() == "baseline" && techniques.len() > 1 {
            return Err("baseline cannot be combined with other techniques".into());
        }
        if techniques[..i].iter().any(|u| u.group() == t.group()) {
            return Err(format!(
                "a strategy can apply only one {}; '{}' repeats it",
                t.group(),
                t.canonical_name()
            ));
        }
    }
    let name = name.unwrap_or_else(|| {
        techniques
            .iter()
            .map(Technique::canonical_name)
            .collect::<Vec<_>>()
            .join("+")
    });
    if name.trim().is_empty() {
        return Err("a strategy name cannot be empty".into());
    }
    Ok(StrategySpec { name, techniques })
}

impl<'de> Deserialize<'de> for StrategySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StrategySpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "a strategy: a name such as baseline, {checkpoint: {...}}, or {name: ..., with: [...]}",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StrategySpec, E> {
                let spec = StrategySpec::single(simple_technique(v)?);
                claim_name("strategy", &spec.name).map_err(de::Error::custom)?;
                Ok(spec)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StrategySpec, A::Error> {
                let mut name = None;
                let mut with: Option<Vec<WithItem>> = None;
                let mut single = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "name" if name.is_some() => return Err(de::Error::duplicate_field("name")),
                        "name" => name = Some(map.next_value::<String>()?),
                        "with" if with.is_some() => return Err(de::Error::duplicate_field("with")),
                        "with" => with = Some(map.next_value()?),
                        _ if single.is_some() => {
                            return Err(de::Error::custom(
                                "one technique per strategy; combine several with `with: [...]`",
                            ))
                        }
                        _ => single = Some(technique_with_args(&key, &mut map)?),
                    }
                }
                let techniques = match (single, with) {
                    (Some(_), Some(_)) => {
                        return Err(de::Error::custom(
                            "a strategy has either one technique or a `with` list, not both",
                        ))
                    }
                    (Some(t), None) => vec![t],
                    (None, Some(items)) => items.into_iter().map(|w| w.0).collect(),
                    (None, None) => {
                        return Err(de::Error::custom(
                            "a strategy needs a technique, e.g. {checkpoint: {segments: 3}}",
                        ))
                    }
                };
                let spec = combine(name, techniques).map_err(de::Error::custom)?;
                claim_name("strategy", &spec.name).map_err(de::Error::custom)?;
                Ok(spec)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSuite {
    suite: String,
    #[serde(default = "cpu")]
    device: DeviceChoice,
    threads: Option<Positive>,
    #[serde(default)]
    seed: u64,
    #[serde(default = "one")]
    warmup: usize,
    #[serde(default = "three")]
    repeats: Positive,
    memory_limit: Option<Size>,
    models: NonEmpty<ModelSpec>,
    strategies: NonEmpty<StrategySpec>,
}

/// A list with at least one item; an empty one is reported at its own position.
struct NonEmpty<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for NonEmpty<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = NonEmpty<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<NonEmpty<T>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                if items.is_empty() {
                    return Err(de::Error::custom("must list at least one entry"));
                }
                Ok(NonEmpty(items))
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
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
        SEEN.with(|seen| *seen.borrow_mut() = Default::default());
        let suite = RawSuite::deserialize(d).map(|raw| Suite {
            suite: raw.suite,
            device: raw.device,
            threads: raw.threads.map(Positive::usize),
            seed: raw.seed,
            warmup: raw.warmup,
            repeats: raw.repeats.usize(),
            memory_limit: raw.memory_limit,
            models: raw.models.0,
            strategies: raw.strategies.0,
        });
        SEEN.with(|seen| *seen.borrow_mut() = Default::default());
        suite
    }
}
