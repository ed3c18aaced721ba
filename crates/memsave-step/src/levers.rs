//! The levers a training step can pull: the optimizer stepped inside the step
//! (`memsave-optim`), and what the saved-tensor hooks do with saved activations
//! (`memsave-hooks`).
//!
//! Plain Rust values: reading them from a file is the caller's business (the harness,
//! `memsave-bench`, parses its YAML suites into them and checks each key there).
use memsave_optim::{AdamWConfig, OptimError, Options, Placement, Rule, SgdConfig, State};
use std::path::Path;

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// `memsave_optim::AdamW`: two moments per parameter. Defaults `lr = 1e-3`,
    /// `betas = (0.9, 0.999)`, `eps = 1e-8`, `weight_decay = 1e-2` (PyTorch's).
    #[default]
    Adamw,
    /// `memsave_optim::Sgd`. Defaults `lr = 1e-3` (the value the harness always used;
    /// PyTorch's SGD required an lr until it took this default), `momentum = 0`,
    /// `weight_decay = 0`. Without momentum it keeps no state at all; with
    /// `momentum > 0`, one momentum buffer per parameter (dampening 0, no Nesterov).
    Sgd,
}

/// The precision of the optimizer's state buffers (`memsave_optim::State`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatePlacement {
    /// On the parameters' device.
    #[default]
    Device,
    /// In host memory (the same as [`Device`](Self::Device) on the CPU).
    Cpu,
    /// In files of a temporary directory made for the case.
    Disk,
}

/// Which optimizer a step runs, with which hyperparameters, state precision and
/// placement; `OptimizerSpec::default()` is AdamW with every default.
///
/// The hyperparameters are `None` when not given, which means the kind's default (see
/// [`OptimizerKind`]); [`rule`](Self::rule) fills them in. `betas` and `eps` are
/// AdamW's only and `momentum` is SGD's only: [`rule`](Self::rule) refuses them on the
/// other kind rather than ignoring them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OptimizerSpec {
    /// The update rule (default AdamW).
    pub kind: OptimizerKind,
    /// The state's precision (default f32). SGD without momentum has no state, so
    /// this changes nothing for it.
    pub state: StatePrecision,
    /// `true` steps each parameter from a post-accumulate-grad hook and frees its
    /// gradient at once (default false: one step after backward).
    pub in_backward: bool,
    /// Where the state lives between steps (default: on the parameters' device).
    pub placement: StatePlacement,
    /// The learning rate (default 1e-3 for both kinds).
    pub lr: Option<f64>,
    /// `(beta1, beta2)`, AdamW's moment decay rates (default (0.9, 0.999)).
    pub betas: Option<(f64, f64)>,
    /// Added to AdamW's denominator (default 1e-8).
    pub eps: Option<f64>,
    /// Decoupled decay for AdamW (default 1e-2), an L2 penalty added to the gradient
    /// for SGD (default 0).
    pub weight_decay: Option<f64>,
    /// SGD's momentum factor (default 0: no momentum buffer). Any value other than 0
    /// gives SGD one buffer per parameter, which `state` and `placement` then apply
    /// to.
    pub momentum: Option<f64>,
}

/// An [`OptimizerSpec`]'s update rule with every hyperparameter filled in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerRule {
    /// `kind: adamw`.
    AdamW(AdamWConfig),
    /// `kind: sgd`.
    Sgd(SgdConfig),
}

impl OptimizerSpec {
    /// The update rule: the kind's defaults with the hyperparameters given replaced,
    /// checked with the rule's own validation (finite, non-negative values, betas in
    /// [0, 1)). Refuses `betas` or `eps` with SGD and `momentum` with AdamW, which the
    /// rule would otherwise ignore. Every optimizer the harness builds from a spec
    /// (`CaseOptimizer` and the ranks of a distributed case) takes its rule from here.
    pub fn rule(&self) -> Result<OptimizerRule, OptimError> {
        match self.kind {
            OptimizerKind::Adamw => {
                if self.momentum.is_some() {
                    return Err(OptimError::Config(
                        "momentum is an option of sgd; adamw's moments decay by betas".into(),
                    ));
                }
                let default = AdamWConfig::default();
                let config = AdamWConfig {
                    lr: self.lr.unwrap_or(default.lr),
                    betas: self.betas.unwrap_or(default.betas),
                    eps: self.eps.unwrap_or(default.eps),
                    weight_decay: self.weight_decay.unwrap_or(default.weight_decay),
                };
                config.validate()?;
                Ok(OptimizerRule::AdamW(config))
            }
            OptimizerKind::Sgd => {
                if self.betas.is_some() || self.eps.is_some() {
                    return Err(OptimError::Config(
                        "betas and eps are options of adamw; sgd takes lr, momentum and weight_decay".into(),
                    ));
                }
                let default = SgdConfig::default();
                let config = SgdConfig {
                    lr: self.lr.unwrap_or(default.lr),
                    momentum: self.momentum.unwrap_or(default.momentum),
                    weight_decay: self.weight_decay.unwrap_or(default.weight_decay),
                    ..default
                };
                config.validate()?;
                Ok(OptimizerRule::Sgd(config))
            }
        }
    }

    /// The optimizer's options: `state` and `placement`, with
    /// [`StatePlacement::Disk`] in `state_dir` (the caller makes and keeps the directory; without one, disk falls
    /// back to the device). No gradient clipping.
    pub fn options(&self, state_dir: Option<&Path>) -> Options {
        Options {
            state: match self.state {
                StatePrecision::F32 => State::F32,
                StatePrecision::Bf16 => State::Bf16,
                StatePrecision::Int8 => State::Int8Blockwise { block: 256 },
            },
            placement: match (self.placement, state_dir) {
                (StatePlacement::Disk, Some(dir)) => Placement::Disk(dir.to_path_buf()),
                (StatePlacement::Cpu, _) => Placement::Cpu,
                _ => Placement::Device,
            },
            max_grad_norm: None,
        }
    }

    /// `key=value` for the kind and every key that differs from its default (for the
    /// kind), so that two specs with different hyperparameters have different
    /// arguments: the strategy's canonical name is built from them. Numbers are written
    /// in the shorter of plain and exponent notation (`lr=3e-4`, `lr=0.1`), each exact.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![format!(
            "kind={}",
            match self.kind {
                OptimizerKind::Adamw => "adamw",
                OptimizerKind::Sgd => "sgd",
            }
        )];
        let (lr, weight_decay) = match self.kind {
            OptimizerKind::Adamw => {
                let d = AdamWConfig::default();
                (d.lr, d.weight_decay)
            }
            OptimizerKind::Sgd => {
                let d = SgdConfig::default();
                (d.lr, d.weight_decay)
            }
        };
        let adamw = AdamWConfig::default();
        let sgd = SgdConfig::default();
        push_number(&mut args, "lr", self.lr, lr);
        if let Some((b1, b2)) = self.betas.filter(|b| *b != adamw.betas) {
            args.push(format!(
                "betas=({}, {})",
                short_number(b1),
                short_number(b2)
            ));
        }
        push_number(&mut args, "eps", self.eps, adamw.eps);
        push_number(&mut args, "weight_decay", self.weight_decay, weight_decay);
        push_number(&mut args, "momentum", self.momentum, sgd.momentum);
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

/// `key=value` onto `args` when `value` is given and differs from `default`.
fn push_number(args: &mut Vec<String>, key: &str, value: Option<f64>, default: f64) {
    if let Some(v) = value.filter(|v| *v != default) {
        args.push(format!("{key}={}", short_number(v)));
    }
}

/// `v` in the shorter of Rust's plain and exponent notations (both give the shortest
/// digits that read back as `v`), plain on a tie: `0.1`, `3e-4`, `1e-8`.
fn short_number(v: f64) -> String {
    let plain = format!("{v}");
    let exponent = format!("{v:e}");
    if exponent.len() < plain.len() {
        exponent
    } else {
        plain
    }
}

/// The codec saved activations are stored with.
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
    /// The codec's short name (`bf16`, `fp16`, `fp8`, `int8`), as strategy names and
    /// reports write it.
    pub fn as_str(self) -> &'static str {
        match self {
            CompressDtype::Bf16 => "bf16",
            CompressDtype::Fp16 => "fp16",
            CompressDtype::Fp8 => "fp8",
            CompressDtype::Int8 => "int8",
        }
    }
}

/// Where offloaded saved activations are kept until backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OffloadSpec {
    /// In files (`memsave_hooks::DiskOffload`), in `dir` (default: a
    /// `memsave-offload` folder in the system's temporary directory, created if
    /// missing).
    Disk {
        /// The directory, as the user wrote it.
        dir: Option<String>,
        /// Bytes that may wait for the writer thread (the forward waits beyond that),
        /// with the size as the user wrote it (`64MiB`), for names and reports; `None`
        /// for `DiskOffload`'s default.
        max_in_flight: Option<(u64, String)>,
    },
    /// CUDA activations in pinned host memory (`memsave_hooks::SaveOnCpu`; nothing to
    /// do on the CPU).
    Cpu,
}
