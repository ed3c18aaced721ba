//! The strategy grammar: techniques, their canonical names, and how a `strategies:`
//! entry (a name, a one-key mapping, or `{name, with: [...]}`) becomes a
//! [`StrategySpec`].
use super::optimizer::{OptimizerArgs, OptimizerSpec};
use super::values::{claim_name, validated_map, Dtype, Positive, Size};
use memsave_amp::GradScalerConfig;
use memsave_fit::Allow;
pub use memsave_step::{CompressDtype, OffloadSpec};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;

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
    /// `{budget: SIZE, offload: true, compress: DTYPE}`: the budget's solver may also
    /// keep checkpoint inputs on disk (`offload: true`: a temporary directory of the
    /// case's own) or compressed with the codec (`compress:`), at least one of them.
    BudgetWithLevers {
        /// The budget.
        budget: Size,
        /// `offload: true`.
        offload: bool,
        /// `compress: DTYPE`.
        compress: Option<CompressDtype>,
    },
}

/// What a `grad_scaler` entry asks for: `memsave_amp::GradScaler`'s knobs, each left
/// out taking PyTorch's default (see [`GradScalerConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerSpec {
    /// The scale before the first update (default 65536).
    pub init_scale: Option<f64>,
    /// Growth after `growth_interval` finite steps (default 2).
    pub growth_factor: Option<f64>,
    /// Backoff after a step with inf/NaN gradients (default 0.5).
    pub backoff_factor: Option<f64>,
    /// Finite steps before the scale grows (default 2000).
    pub growth_interval: Option<i64>,
}

impl ScalerSpec {
    /// The scaler's configuration, defaults filled in.
    pub fn config(&self) -> GradScalerConfig {
        let default = GradScalerConfig::default();
        GradScalerConfig {
            init_scale: self.init_scale.unwrap_or(default.init_scale),
            growth_factor: self.growth_factor.unwrap_or(default.growth_factor),
            backoff_factor: self.backoff_factor.unwrap_or(default.backoff_factor),
            growth_interval: self.growth_interval.unwrap_or(default.growth_interval),
            enabled: true,
        }
    }

    /// The knobs given, as `key=value`, in a fixed order.
    fn args(&self) -> Vec<String> {
        let floats = [
            ("init_scale", self.init_scale),
            ("growth_factor", self.growth_factor),
            ("backoff_factor", self.backoff_factor),
        ];
        let mut args: Vec<String> = floats
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
            .collect();
        if let Some(n) = self.growth_interval {
            args.push(format!("growth_interval={n}"));
        }
        args
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompressArgs {
    dtype: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OffloadArgs {
    to: String,
    dir: Option<String>,
    max_in_flight: Option<Size>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OffloadGradsArgs {
    to: String,
    at_least: Option<Size>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OffloadParamsArgs {
    to: String,
}

fn compress_args(args: CompressArgs) -> Result<CompressDtype, StrategyError> {
    match args.dtype.as_str() {
        "bf16" => Ok(CompressDtype::Bf16),
        "fp16" => Ok(CompressDtype::Fp16),
        "fp8" => Ok(CompressDtype::Fp8),
        "int8" => Ok(CompressDtype::Int8),
        _ => Err(StrategyError::UnknownCompressDtype { dtype: args.dtype }),
    }
}

fn offload_args<E: de::Error>(args: OffloadArgs) -> Result<OffloadSpec, E> {
    match (args.to.as_str(), args.dir, args.max_in_flight) {
        ("disk", dir, max_in_flight) => Ok(OffloadSpec::Disk {
            dir,
            max_in_flight: max_in_flight.map(|s| (s.bytes, s.text)),
        }),
        ("cpu", None, None) => Ok(OffloadSpec::Cpu),
        ("cpu", _, _) => Err(E::custom(
            "offload: dir and max_in_flight are for {to: disk} only",
        )),
        (other, _, _) => Err(E::custom(format!(
            "offload: unknown target '{other}', expected disk or cpu"
        ))),
    }
}

/// One memory-saving technique.
#[derive(Debug, Clone, PartialEq)]
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
    /// Gradient accumulation over micro-batches of the first batch dimension, through
    /// `memsave_accum::GradAccumulator`.
    Accumulate {
        /// Number of micro-batches.
        micro_batches: usize,
    },
    /// Dynamic loss scaling through `memsave_amp::GradScaler`: the loss is scaled before
    /// backward, the gradients unscaled and checked for inf/NaN after it, and the scale
    /// updated, once per step.
    GradScaler(ScalerSpec),
    /// A `memsave-optim` optimizer stepped inside the measured step.
    Optimizer(OptimizerSpec),
    /// Saved activations stored smaller (`memsave_hooks::Compress`).
    Compress(CompressDtype),
    /// Saved activations kept on disk or in host memory until backward
    /// (`memsave_hooks::DiskOffload`, `memsave_hooks::SaveOnCpu`).
    Offload(OffloadSpec),
    /// `offload_grads: {to: disk}`: gradients accumulated in files between backward
    /// passes (`memsave_hooks::GradOffload`); an `optimizer` with `in_backward: true`
    /// steps each whole gradient in the last micro-batch's backward. With `at_least:
    /// 64KiB`, only the gradients of parameters of at least that size go to files, the
    /// smaller ones accumulate in memory (`StepConfig::offload_grads_at_least`).
    OffloadGrads(Option<Size>),
    /// `offload_params: {to: disk}`: the parameters in files between their uses
    /// (`memsave_step::ParamsOffload::Disk`: ZeRO-3 with its shards in files, on a
    /// group of one or under `zero: 3`). Runs on ranks only (`world_size: 1` for one
    /// process), and needs an `optimizer` with `in_backward: true`.
    OffloadParams,
    /// `zero: 1 | 2 | 3`: the optimizer's state (stage 1), and the gradients (stage 2),
    /// sharded over the suite's `world_size` ranks (`memsave_dist::ZeroOptimizer`), and
    /// the parameters too (stage 3, `memsave_dist::Fsdp`: one unit per layer; written
    /// `{zero: {stage: 3, reshard_after_forward: false}}` to keep each layer's weights
    /// from its forward to its backward). Needs `world_size`; stages 1 and 2 need an
    /// `optimizer`.
    Zero(ZeroSpec),
    /// HF accelerate's `find_executable_batch_size`: halve the batch on each
    /// out-of-memory error under the simulated capacity (`budget`, else the suite's
    /// `memory_limit`), without raising accumulation, so the global batch shrinks.
    AutoBatch(AutoBatchSpec),
    /// `memsave_fit::fit` chooses the configuration (micro-batches, recompute,
    /// offload, and the allowed lossy levers) for the budget, keeping the global batch.
    /// Combined with `optimizer` (`with: [{fit: ..}, {optimizer: ..}]`), it steps that
    /// optimizer and chooses where it steps and its state's precision; with nothing
    /// else.
    Fit(FitSpec),
}

/// What an `auto_batch:` entry asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoBatchSpec {
    /// The capacity; `None`: the suite's `memory_limit`.
    pub budget: Option<Size>,
}

/// What a `zero:` entry asks for: `zero: 2`, or `zero: {stage: 3,
/// reshard_after_forward: false}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroSpec {
    /// 1, 2 or 3.
    pub stage: u8,
    /// Stage 3 only: free each layer's gathered weights after its forward and gather
    /// them again in backward (default true, FSDP2's `reshard_after_forward`); false
    /// keeps them from the forward to the backward.
    pub reshard_after_forward: bool,
}

impl ZeroSpec {
    /// Stage `stage` with the default options.
    pub fn stage(stage: u8) -> Self {
        Self {
            stage,
            reshard_after_forward: true,
        }
    }
}

/// What a `fit:` entry asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitSpec {
    /// The byte budget.
    pub budget: Size,
    /// Lossy levers allowed, in the order written (`allow: [bf16, compress]`).
    pub allow: Vec<FitLever>,
    /// `uniform: true`: every block of a model of blocks under the same lever (see
    /// `memsave_fit::FitRequest::per_block`), to compare with the per-block choice.
    pub uniform: bool,
}

impl FitSpec {
    /// The levers allowed, as `memsave_fit` takes them.
    pub fn allowed(&self) -> Allow {
        FitLever::allow(&self.allow)
    }
}

/// A lossy lever `fit` may use only when allowed: a suite names it in `fit: {allow:
/// [...]}` with underscores (`int8_state`), `memsave fit --allow` with hyphens
/// (`int8-state`), as each format's other names are written. An unknown name is
/// refused where it is read (at its own line and column in a suite).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum FitLever {
    /// `bf16`: the forward under bf16 autocast ([`Allow::bf16`]).
    Bf16,
    /// `compress`: saved activations compressed to int8 ([`Allow::compress`]).
    Compress,
    /// `int8_state` (`int8-state`): 8-bit blockwise optimizer state
    /// ([`Allow::int8_state`]).
    #[value(name = "int8-state")]
    Int8State,
    /// `micro_batches` (`micro-batches`): micro-batches for a step that couples the
    /// samples of a batch, as BatchNorm in training mode does ([`Allow::micro_batches`];
    /// otherwise micro-batches are lossless and always considered).
    #[value(name = "micro-batches")]
    MicroBatches,
}

impl FitLever {
    /// Every lever, in the order the messages list them.
    pub const ALL: [FitLever; 4] = [
        FitLever::Bf16,
        FitLever::Compress,
        FitLever::Int8State,
        FitLever::MicroBatches,
    ];

    /// The name in a suite (and in the canonical name of a `fit` strategy).
    pub fn as_str(self) -> &'static str {
        match self {
            FitLever::Bf16 => "bf16",
            FitLever::Compress => "compress",
            FitLever::Int8State => "int8_state",
            FitLever::MicroBatches => "micro_batches",
        }
    }

    /// `levers` as `memsave_fit`'s [`Allow`]: each one on, every other off.
    pub fn allow(levers: &[FitLever]) -> Allow {
        let mut allow = Allow::default();
        for lever in levers {
            match lever {
                FitLever::Bf16 => allow.bf16 = true,
                FitLever::Compress => allow.compress = true,
                FitLever::Int8State => allow.int8_state = true,
                FitLever::MicroBatches => allow.micro_batches = true,
            }
        }
        allow
    }
}

impl fmt::Display for FitLever {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One name of an `allow:` list, refused at its own position when unknown.
impl<'de> Deserialize<'de> for FitLever {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = FitLever;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a lever: bf16, compress, int8_state or micro_batches")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<FitLever, E> {
                FitLever::ALL
                    .into_iter()
                    .find(|lever| lever.as_str() == v)
                    .ok_or_else(|| {
                        E::custom(format!(
                            "fit: unknown lever '{v}' in allow, expected bf16, compress, int8_state or micro_batches"
                        ))
                    })
            }
        }
        d.deserialize_str(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AutoBatchArgs {
    policy: String,
    budget: Option<Size>,
}

fn auto_batch_args<E: de::Error>(args: AutoBatchArgs) -> Result<AutoBatchSpec, E> {
    if args.policy != "halving" {
        return Err(E::custom(format!(
            "auto_batch: unknown policy '{}', expected halving",
            args.policy
        )));
    }
    if args.budget.as_ref().is_some_and(|b| b.bytes == 0) {
        return Err(E::custom("auto_batch: the budget must be positive"));
    }
    Ok(AutoBatchSpec {
        budget: args.budget,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FitArgs {
    budget: Size,
    #[serde(default)]
    allow: Vec<FitLever>,
    #[serde(default)]
    uniform: bool,
}

fn fit_args<E: de::Error>(args: FitArgs) -> Result<FitSpec, E> {
    if args.budget.bytes == 0 {
        return Err(E::custom("fit: the budget must be positive"));
    }
    Ok(FitSpec {
        budget: args.budget,
        allow: args.allow,
        uniform: args.uniform,
    })
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
            Technique::Checkpoint(CheckpointSpec::BudgetWithLevers {
                budget,
                offload,
                compress,
            }) => {
                let mut args = vec![format!("budget={}", budget.text)];
                if *offload {
                    args.push("offload=true".into());
                }
                if let Some(dtype) = compress {
                    args.push(format!("compress={}", dtype.as_str()));
                }
                format!("checkpoint({})", args.join(","))
            }
            Technique::Autocast(dtype) => format!("autocast(dtype={})", dtype.text),
            Technique::Accumulate { micro_batches } => {
                format!("accumulate(micro_batches={micro_batches})")
            }
            Technique::GradScaler(spec) => match spec.args() {
                args if args.is_empty() => "grad_scaler".into(),
                args => format!("grad_scaler({})", args.join(", ")),
            },
            Technique::Optimizer(spec) => format!("optimizer({})", spec.args().join(", ")),
            Technique::Compress(dtype) => format!("compress(dtype={})", dtype.as_str()),
            Technique::Offload(OffloadSpec::Disk { dir, max_in_flight }) => {
                let mut args = vec!["to=disk".to_owned()];
                if let Some(dir) = dir {
                    args.push(format!("dir={dir}"));
                }
                if let Some((_, text)) = max_in_flight {
                    args.push(format!("max_in_flight={text}"));
                }
                format!("offload({})", args.join(", "))
            }
            Technique::Offload(OffloadSpec::Cpu) => "offload(to=cpu)".into(),
            Technique::OffloadGrads(None) => "offload_grads(to=disk)".into(),
            Technique::OffloadGrads(Some(least)) => {
                format!("offload_grads(to=disk, at_least={})", least.text)
            }
            Technique::OffloadParams => "offload_params(to=disk)".into(),
            Technique::Zero(ZeroSpec {
                stage,
                reshard_after_forward: true,
            }) => format!("zero(stage={stage})"),
            Technique::Zero(ZeroSpec { stage, .. }) => {
                format!("zero(stage={stage}, reshard_after_forward=false)")
            }
            Technique::AutoBatch(AutoBatchSpec { budget: None }) => {
                "auto_batch(policy=halving)".into()
            }
            Technique::AutoBatch(AutoBatchSpec { budget: Some(b) }) => {
                format!("auto_batch(policy=halving, budget={})", b.text)
            }
            Technique::Fit(spec) => {
                let mut name = format!("fit(budget={}", spec.budget.text);
                if !spec.allow.is_empty() {
                    let allow: Vec<&str> = spec.allow.iter().map(|l| l.as_str()).collect();
                    name.push_str(&format!(", allow={}", allow.join("+")));
                }
                if spec.uniform {
                    name.push_str(", uniform");
                }
                name + ")"
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
            Technique::GradScaler(_) => "grad_scaler",
            Technique::Optimizer(_) => "optimizer",
            Technique::Compress(_) | Technique::Offload(_) => {
                "saved-tensor hook (compress, offload)"
            }
            Technique::OffloadGrads(_) => "offload_grads",
            Technique::OffloadParams => "offload_params",
            Technique::Zero(_) => "zero",
            Technique::AutoBatch(_) => "auto_batch",
            Technique::Fit(_) => "fit",
        }
    }
}

/// One `strategies:` entry: a name and the techniques it applies together.
#[derive(Debug, Clone, PartialEq)]
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

    /// True when the strategy applies no memory-saving technique (`baseline`, under any
    /// name): the reference of ratios and gradient differences. Decided by the
    /// techniques, never by the name, so `{name: ref, with: [baseline]}` is a baseline
    /// and a checkpoint strategy named `baseline` is not.
    pub fn is_baseline(&self) -> bool {
        self.techniques == [Technique::Baseline]
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    segments: Option<Positive>,
    every_layer: Option<bool>,
    nested: Option<bool>,
    budget: Option<Size>,
    offload: Option<bool>,
    compress: Option<String>,
}

impl RawCheckpoint {
    fn check(self) -> Result<CheckpointSpec, StrategyError> {
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
                Some(false) => return Err(StrategyError::CheckpointFlagFalse { key }),
                None => {}
            }
        }
        let offload = self.offload.unwrap_or(false);
        let compress = match self.compress {
            Some(dtype) => Some(
                compress_args(CompressArgs { dtype })
                    .map_err(|e| StrategyError::InCheckpoint(Box::new(e)))?,
            ),
            None => None,
        };
        if self.budget.is_none() && (self.offload.is_some() || compress.is_some()) {
            return Err(StrategyError::LeversWithoutBudget);
        }
        if self.offload == Some(false) && compress.is_none() {
            return Err(StrategyError::OffloadFalse);
        }
        if let Some(size) = self.budget {
            plans.push(if offload || compress.is_some() {
                CheckpointSpec::BudgetWithLevers {
                    budget: size,
                    offload,
                    compress,
                }
            } else {
                CheckpointSpec::Budget(size)
            });
        }
        match plans.len() {
            1 => Ok(plans.remove(0)),
            0 => Err(StrategyError::NoCheckpointPlan),
            _ => Err(StrategyError::SeveralCheckpointPlans),
        }
    }
}

impl<'de> Deserialize<'de> for CheckpointSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        validated_map(
            d,
            "checkpoint arguments: {segments: K} | {every_layer: true} | {nested: true} | {budget: SIZE[, offload: true][, compress: DTYPE]}",
            RawCheckpoint::check,
        )
    }
}

/// `{grad_scaler: {...}}`: the knobs, checked with the scaler's own rules.
fn scaler_args<'de, D: Deserializer<'de>>(d: D) -> Result<ScalerSpec, D::Error> {
    validated_map(
        d,
        "grad_scaler arguments: {init_scale, growth_factor, backoff_factor, growth_interval}",
        |spec: ScalerSpec| spec.config().validate().map(|()| spec),
    )
}

struct ScalerArgs(ScalerSpec);

impl<'de> Deserialize<'de> for ScalerArgs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        scaler_args(d).map(ScalerArgs)
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

/// Techniques written as a plain name.
const PLAIN: [&str; 5] = [
    "baseline",
    "inplace_add",
    "add_out",
    "safe_residual",
    "grad_scaler",
];
/// Techniques written as `{name: {arguments}}` (`grad_scaler` is both).
const WITH_ARGS: [&str; 12] = [
    "checkpoint",
    "autocast",
    "accumulate",
    "grad_scaler",
    "optimizer",
    "compress",
    "offload",
    "offload_grads",
    "offload_params",
    "zero",
    "auto_batch",
    "fit",
];

fn plain_technique<E: de::Error>(name: &str) -> Result<Technique, E> {
    match name {
        "baseline" => Ok(Technique::Baseline),
        "inplace_add" => Ok(Technique::InplaceAdd),
        "add_out" => Ok(Technique::AddOut),
        "safe_residual" => Ok(Technique::SafeResidual),
        "grad_scaler" => Ok(Technique::GradScaler(ScalerSpec::default())),
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
        "optimizer" => "{kind: adamw}",
        "compress" => "{dtype: int8}",
        "offload" | "offload_grads" | "offload_params" => "{to: disk}",
        "zero" => "2",
        "auto_batch" => "{policy: halving, budget: 40MiB}",
        "fit" => "{budget: 40MiB}",
        _ => "{micro_batches: 4}",
    }
}

fn unknown_strategy<E: de::Error>(name: &str) -> E {
    let mut names: Vec<&str> = PLAIN.to_vec();
    names.extend(WITH_ARGS.iter().filter(|n| !PLAIN.contains(n)));
    E::custom(format!(
        "unknown strategy '{name}', expected one of {}",
        names.join(", ")
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
        "grad_scaler" => Technique::GradScaler(map.next_value::<ScalerArgs>()?.0),
        "optimizer" => Technique::Optimizer(map.next_value::<OptimizerArgs>()?.0),
        "compress" => Technique::Compress(
            compress_args(map.next_value::<CompressArgs>()?).map_err(de::Error::custom)?,
        ),
        "offload" => Technique::Offload(offload_args(map.next_value::<OffloadArgs>()?)?),
        "offload_grads" => match map.next_value::<OffloadGradsArgs>()? {
            OffloadGradsArgs { to, at_least } if to == "disk" => Technique::OffloadGrads(at_least),
            OffloadGradsArgs { to: other, .. } => {
                return Err(de::Error::custom(format!(
                    "offload_grads: unknown target '{other}', expected disk"
                )))
            }
        },
        "offload_params" => match map.next_value::<OffloadParamsArgs>()?.to.as_str() {
            "disk" => Technique::OffloadParams,
            other => {
                return Err(de::Error::custom(format!(
                    "offload_params: unknown target '{other}', expected disk"
                )))
            }
        },
        "zero" => Technique::Zero(map.next_value::<ZeroArgs>()?.0),
        "auto_batch" => Technique::AutoBatch(auto_batch_args(map.next_value::<AutoBatchArgs>()?)?),
        "fit" => Technique::Fit(fit_args(map.next_value::<FitArgs>()?)?),
        _ if PLAIN.contains(&key) => {
            return Err(de::Error::custom(format!(
                "'{key}' takes no arguments: write it as a plain list item"
            )))
        }
        _ => return Err(unknown_strategy(key)),
    })
}

/// Why a stage is not one.
fn not_a_stage(v: impl fmt::Display) -> String {
    format!(
        "a ZeRO stage must be 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters), got {v}"
    )
}

/// `zero: 1 | 2 | 3` or `zero: {stage: 3, reshard_after_forward: false}`, reported
/// at the value's position when it is neither.
struct ZeroArgs(ZeroSpec);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawZero {
    stage: i64,
    reshard_after_forward: Option<bool>,
}

impl RawZero {
    fn check<E: de::Error>(self) -> Result<ZeroSpec, E> {
        let stage = u8::try_from(self.stage)
            .ok()
            .filter(|s| (1..=3).contains(s))
            .ok_or_else(|| E::custom(not_a_stage(self.stage)))?;
        match self.reshard_after_forward {
            Some(_) if stage != 3 => Err(E::custom(format!(
                "reshard_after_forward is an option of stage 3 (the parameters sharded); stage {stage} keeps every weight on every rank"
            ))),
            reshard => Ok(ZeroSpec {
                stage,
                reshard_after_forward: reshard.unwrap_or(true),
            }),
        }
    }
}

impl<'de> Deserialize<'de> for ZeroArgs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ZeroArgs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a ZeRO stage (1, 2 or 3), or {stage: 3, reshard_after_forward: false}")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ZeroArgs, E> {
                match v {
                    1..=3 => Ok(ZeroArgs(ZeroSpec::stage(v as u8))),
                    _ => Err(E::custom(not_a_stage(v))),
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ZeroArgs, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(not_a_stage(v))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ZeroArgs, A::Error> {
                let raw = RawZero::deserialize(de::value::MapAccessDeserializer::new(map))?;
                raw.check().map(ZeroArgs)
            }
        }
        d.deserialize_any(V)
    }
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
                plain_technique(v).map(WithItem)
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

fn combine(
    name: Option<String>,
    techniques: Vec<Technique>,
) -> Result<StrategySpec, StrategyError> {
    if techniques.is_empty() {
        return Err(StrategyError::EmptyWith);
    }
    for (i, t) in techniques.iter().enumerate() {
        if t.group() == "baseline" && techniques.len() > 1 {
            return Err(StrategyError::BaselineCombined);
        }
        // fit chooses every lever itself; the optimizer it steps is the one thing a
        // strategy can give it.
        if t.group() == "fit"
            && techniques
                .iter()
                .any(|u| !matches!(u.group(), "fit" | "optimizer"))
        {
            return Err(StrategyError::FitCombined);
        }
        if techniques[..i].iter().any(|u| u.group() == t.group()) {
            return Err(StrategyError::Repeated {
                group: t.group(),
                technique: t.canonical_name(),
            });
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
        return Err(StrategyError::EmptyName);
    }
    Ok(StrategySpec { name, techniques })
}

/// Why a `strategies:` entry (or a technique's arguments) is invalid, where serde's
/// own errors (an unknown key, a wrong type) do not say it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum StrategyError {
    /// `compress: {dtype: ...}` with a dtype the codecs do not have.
    #[error("compress: unknown dtype '{dtype}', expected one of bf16, fp16, fp8, int8")]
    UnknownCompressDtype {
        /// The dtype as written.
        dtype: String,
    },
    /// An error in the arguments of `checkpoint:` (its `compress:` lever).
    #[error("checkpoint {0}")]
    InCheckpoint(Box<StrategyError>),
    /// `checkpoint: {every_layer: false}` or `{nested: false}`.
    #[error("checkpoint: {key} must be true (leave the strategy out instead)")]
    CheckpointFlagFalse {
        /// `every_layer` or `nested`.
        key: &'static str,
    },
    /// `offload:` or `compress:` in `checkpoint:` without `budget:`.
    #[error(
        "checkpoint: offload and compress are levers of the budget planner: give a budget too"
    )]
    LeversWithoutBudget,
    /// `checkpoint: {budget: ..., offload: false}` without `compress:`.
    #[error("checkpoint: offload must be true (leave it out for recomputation alone)")]
    OffloadFalse,
    /// `checkpoint: {}`.
    #[error("checkpoint needs one of segments, every_layer, nested, budget")]
    NoCheckpointPlan,
    /// More than one plan in one `checkpoint:`.
    #[error("checkpoint takes exactly one of segments, every_layer, nested, budget")]
    SeveralCheckpointPlans,
    /// `with: []`.
    #[error("`with` must list at least one technique")]
    EmptyWith,
    /// `baseline` with other techniques.
    #[error("baseline cannot be combined with other techniques")]
    BaselineCombined,
    /// `fit` with other techniques than `optimizer`.
    #[error("fit chooses every lever itself, so it combines only with optimizer (the optimizer it steps)")]
    FitCombined,
    /// Two techniques of one group.
    #[error("a strategy can apply only one {group}; '{technique}' repeats it")]
    Repeated {
        /// The group both belong to.
        group: &'static str,
        /// The canonical name of the second.
        technique: String,
    },
    /// `name: ""` (or only spaces).
    #[error("a strategy name cannot be empty")]
    EmptyName,
}

/// Reads one strategy; with `seen`, a name already in it is an error at this entry.
pub(super) fn deserialize_strategy<'de, D: Deserializer<'de>>(
    d: D,
    seen: Option<&mut HashSet<String>>,
) -> Result<StrategySpec, D::Error> {
    struct V<'a> {
        seen: Option<&'a mut HashSet<String>>,
    }
    impl<'de> Visitor<'de> for V<'_> {
        type Value = StrategySpec;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(
                "a strategy: a name such as baseline, {checkpoint: {...}}, or {name: ..., with: [...]}",
            )
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<StrategySpec, E> {
            let spec = StrategySpec::single(plain_technique(v)?);
            claim_name(self.seen, "strategy", &spec.name).map_err(de::Error::custom)?;
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
            claim_name(self.seen, "strategy", &spec.name).map_err(de::Error::custom)?;
            Ok(spec)
        }
    }
    d.deserialize_any(V { seen })
}

/// One strategy on its own; names are checked for uniqueness only inside a suite.
impl<'de> Deserialize<'de> for StrategySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_strategy(d, None)
    }
}
