//! The optimizer's hyperparameters in a suite (`lr`, `betas`, `eps`, `weight_decay`,
//! `momentum`): parsed into the spec, named canonically when they differ from the
//! defaults, refused with `file:line:column` and what is expected when out of range or
//! given to the wrong kind, and reaching the optimizer the harness steps.
use memsave_bench::{
    run_suite, OptimizerKind, OptimizerSpec, RunOptions, Status, Suite, Technique,
};
use serial_test::serial;

const HEAD: &str = "suite: t
models:
  - {name: a, kind: residual_mlp, layers: 2, hidden: 8, expansion: 2, batch: [4]}
strategies:
";

/// The suite with `entry` as its one strategy, on line 5.
fn yaml(entry: &str) -> String {
    format!("{HEAD}  - {entry}\n")
}

fn parse(entry: &str) -> (String, OptimizerSpec) {
    let suite = Suite::from_yaml(&yaml(entry), "t.yaml").unwrap_or_else(|e| panic!("{entry}: {e}"));
    let s = &suite.strategies[0];
    let Technique::Optimizer(spec) = s.techniques[0] else {
        panic!("{s:?}")
    };
    (s.name.clone(), spec)
}

#[test]
fn hyperparameters_parse_into_the_spec() {
    let (name, spec) = parse(
        "optimizer: {kind: adamw, lr: 3e-4, betas: [0.9, 0.95], eps: 1e-8, weight_decay: 0.1}",
    );
    assert_eq!(spec.kind, OptimizerKind::Adamw);
    assert_eq!(spec.lr, Some(3e-4));
    assert_eq!(spec.betas, Some((0.9, 0.95)));
    assert_eq!(spec.eps, Some(1e-8));
    assert_eq!(spec.weight_decay, Some(0.1));
    assert_eq!(spec.momentum, None);
    // eps at its default is left out of the name; the rest differ from AdamW's.
    assert_eq!(
        name,
        "optimizer(kind=adamw, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)"
    );

    let (name, spec) = parse("optimizer: {kind: sgd, lr: 0.1, momentum: 0.9}");
    assert_eq!(spec.kind, OptimizerKind::Sgd);
    assert_eq!((spec.lr, spec.momentum), (Some(0.1), Some(0.9)));
    assert_eq!(
        (spec.betas, spec.eps, spec.weight_decay),
        (None, None, None)
    );
    assert_eq!(name, "optimizer(kind=sgd, lr=0.1, momentum=0.9)");

    // Integers are numbers too; 0 is a valid learning rate and weight decay.
    let (name, spec) = parse("optimizer: {kind: sgd, lr: 1, weight_decay: 0}");
    assert_eq!((spec.lr, spec.weight_decay), (Some(1.0), Some(0.0)));
    assert_eq!(name, "optimizer(kind=sgd, lr=1)");
}

#[test]
fn names_without_hyperparameters_are_unchanged_and_defaults_written_out_are_left_out() {
    for (entry, expected) in [
        ("optimizer: {}", "optimizer(kind=adamw)"),
        ("optimizer: {kind: sgd}", "optimizer(kind=sgd)"),
        (
            "optimizer: {kind: adamw, state: int8, in_backward: true, placement: disk}",
            "optimizer(kind=adamw, state=int8, in_backward=true, placement=disk)",
        ),
        // PyTorch's defaults, written out: the same strategy as `{}`.
        (
            "optimizer: {lr: 0.001, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.01}",
            "optimizer(kind=adamw)",
        ),
        (
            "optimizer: {kind: sgd, lr: 0.001, momentum: 0, weight_decay: 0}",
            "optimizer(kind=sgd)",
        ),
        // AdamW's default weight decay is not SGD's.
        (
            "optimizer: {kind: sgd, weight_decay: 0.01}",
            "optimizer(kind=sgd, weight_decay=0.01)",
        ),
        (
            "optimizer: {kind: adamw, weight_decay: 0}",
            "optimizer(kind=adamw, weight_decay=0)",
        ),
        (
            "optimizer: {kind: sgd, momentum: 0.9, state: bf16, placement: cpu}",
            "optimizer(kind=sgd, momentum=0.9, state=bf16, placement=cpu)",
        ),
    ] {
        assert_eq!(parse(entry).0, expected, "{entry}");
    }
}

#[test]
fn two_strategies_that_differ_only_by_lr_have_different_names() {
    let suite = Suite::from_yaml(
        &format!(
            "{HEAD}  - optimizer: {{kind: adamw, lr: 1e-4}}\n  - optimizer: {{kind: adamw, lr: 2e-4}}\n  - {{with: [{{checkpoint: {{segments: 2}}}}, {{optimizer: {{kind: sgd, lr: 0.5}}}}]}}\n"
        ),
        "t.yaml",
    )
    .unwrap();
    let names: Vec<&str> = suite.strategies.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "optimizer(kind=adamw, lr=1e-4)",
            "optimizer(kind=adamw, lr=2e-4)",
            "checkpoint(segments=2)+optimizer(kind=sgd, lr=0.5)",
        ]
    );
    // The same lr twice is the same canonical name: refused as a duplicate.
    let e = Suite::from_yaml(
        &format!("{HEAD}  - optimizer: {{lr: 1e-4}}\n  - optimizer: {{lr: 0.0001}}\n"),
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("t.yaml:6:"), "{e}");
    assert!(
        e.contains("duplicate strategy name 'optimizer(kind=adamw, lr=1e-4)'"),
        "{e}"
    );
}

/// `entry` is refused at line 5, column of the first `at` in it (1-based, after the
/// `  - ` in front of it), with `needle` in the message.
fn assert_refused(entry: &str, at: &str, needle: &str) {
    let e = match Suite::from_yaml(&yaml(entry), "t.yaml") {
        Ok(s) => panic!("accepted {entry}: {s:?}"),
        Err(e) => e.to_string(),
    };
    let column = 4
        + entry
            .find(at)
            .unwrap_or_else(|| panic!("{at} not in {entry}"))
        + 1;
    assert!(
        e.starts_with(&format!("t.yaml:5:{column}: ")),
        "{entry}: expected the position 5:{column} (at '{at}') in: {e}"
    );
    assert!(e.contains(needle), "{entry}: expected '{needle}' in: {e}");
    assert!(!e.contains(" at line "), "position repeated: {e}");
}

#[test]
fn out_of_range_numbers_are_refused_where_they_are_written() {
    const NON_NEGATIVE: &str = "must be a finite number >= 0";
    for (entry, at, needle) in [
        (
            "optimizer: {lr: -0.1}",
            "-0.1",
            "must be a finite number >= 0, got -0.1",
        ),
        (
            "optimizer: {lr: -1}",
            "-1",
            "must be a finite number >= 0, got -1",
        ),
        ("optimizer: {lr: .inf}", ".inf", NON_NEGATIVE),
        ("optimizer: {lr: .nan}", ".nan", NON_NEGATIVE),
        (
            "optimizer: {lr: fast}",
            "fast",
            "expected a finite number >= 0",
        ),
        ("optimizer: {eps: -1e-8}", "-1e-8", NON_NEGATIVE),
        ("optimizer: {weight_decay: -0.01}", "-0.01", NON_NEGATIVE),
        (
            "optimizer: {kind: sgd, weight_decay: .inf}",
            ".inf",
            NON_NEGATIVE,
        ),
        (
            "optimizer: {kind: sgd, momentum: 1}",
            "1}",
            "must be a number in [0, 1), got 1",
        ),
        (
            "optimizer: {kind: sgd, momentum: -0.5}",
            "-0.5",
            "must be a number in [0, 1), got -0.5",
        ),
        (
            "optimizer: {kind: sgd, momentum: .nan}",
            ".nan",
            "must be a number in [0, 1)",
        ),
        (
            "optimizer: {betas: [0.9, 1.0]}",
            "[0.9",
            "must each be in [0, 1), got [0.9, 1]",
        ),
        (
            "optimizer: {betas: [-0.1, 0.999]}",
            "[-0.1",
            "must each be in [0, 1), got [-0.1, 0.999]",
        ),
        (
            "optimizer: {betas: [0.9]}",
            "[0.9",
            "must be two numbers [beta1, beta2], e.g. [0.9, 0.999]; got 1",
        ),
        (
            "optimizer: {betas: [0.9, 0.99, 0.999]}",
            "[0.9",
            "must be two numbers [beta1, beta2], e.g. [0.9, 0.999]; got 3",
        ),
        (
            "optimizer: {betas: 0.9}",
            "0.9",
            "expected two numbers in [0, 1)",
        ),
    ] {
        assert_refused(entry, at, needle);
    }
}

#[test]
fn options_of_the_other_kind_and_unknown_keys_are_refused() {
    // What depends on two keys is reported at the `optimizer:` mapping.
    for (entry, needle) in [
        (
            "optimizer: {kind: adamw, momentum: 0.9}",
            "momentum is for kind sgd; adamw's moments decay by betas",
        ),
        ("optimizer: {momentum: 0.9}", "momentum is for kind sgd"),
        (
            "optimizer: {kind: sgd, betas: [0.9, 0.99]}",
            "betas and eps are for kind adamw; sgd takes lr, momentum and weight_decay",
        ),
        (
            "optimizer: {kind: sgd, eps: 1e-6}",
            "betas and eps are for kind adamw",
        ),
        (
            "optimizer: {kind: sgd, state: int8}",
            "sgd without momentum keeps no state, so state must stay f32 (give momentum > 0",
        ),
        (
            "optimizer: {kind: sgd, momentum: 0, state: bf16}",
            "sgd without momentum keeps no state",
        ),
    ] {
        assert_refused(entry, "{", needle);
    }
    for (entry, at, needle) in [
        (
            "optimizer: {learning_rate: 0.1}",
            "learning_rate",
            "unknown field `learning_rate`, expected one of",
        ),
        (
            "optimizer: {dampening: 0.1}",
            "dampening",
            "unknown field `dampening`",
        ),
        (
            "optimizer: {nesterov: true}",
            "nesterov",
            "unknown field `nesterov`",
        ),
    ] {
        assert_refused(entry, at, needle);
        // The message lists the keys that are accepted.
        let e = Suite::from_yaml(&yaml(entry), "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`momentum`") && e.contains("`betas`"), "{e}");
    }
    // With momentum, SGD keeps a buffer, so its precision can be chosen.
    let (_, spec) = parse("optimizer: {kind: sgd, momentum: 0.9, state: int8}");
    assert_eq!(spec.momentum, Some(0.9));
}

/// Runs the residual MLP (`layers` blocks of Linear(h, e*h), GELU, Linear(e*h, h)).
fn run(strategies: &str) -> memsave_bench::Report {
    let yaml = format!(
        "suite: t
threads: 1
warmup: 1
repeats: 1
models:
  - {{name: mlp, kind: residual_mlp, layers: 2, hidden: 16, expansion: 4, batch: [8, 4]}}
strategies:
{strategies}"
    );
    let suite = Suite::from_yaml(&yaml, "t.yaml").unwrap();
    run_suite(&suite, &RunOptions::default()).unwrap()
}

/// Through the harness: SGD's momentum reaches the optimizer the case steps, which then
/// keeps one buffer per parameter at the precision asked for.
#[test]
#[serial]
fn sgd_momentum_keeps_a_buffer_per_parameter_in_the_harness() {
    let report = run("  - {name: sgd, optimizer: {kind: sgd, lr: 0.1}}
  - {name: sgd-momentum, optimizer: {kind: sgd, lr: 0.1, momentum: 0.9}}
  - {name: sgd-momentum-bf16, optimizer: {kind: sgd, momentum: 0.9, state: bf16, in_backward: true}}
  - {name: adamw-lr, optimizer: {kind: adamw, lr: 3e-4, betas: [0.8, 0.9], weight_decay: 0}}
");
    let case = |name: &str| {
        let c = report.cases.iter().find(|c| c.strategy == name).unwrap();
        assert_eq!(c.status, Status::Ok, "{name}: {:?}", c.error);
        c
    };
    let (h, e, l) = (16u64, 4u64, 2u64);
    let params = l * (h * e * h + e * h + e * h * h + h);
    assert_eq!(case("sgd").optimizer_state_bytes, Some(0));
    assert_eq!(case("sgd-momentum").optimizer_state_bytes, Some(4 * params));
    assert_eq!(
        case("sgd-momentum-bf16").optimizer_state_bytes,
        Some(2 * params)
    );
    assert_eq!(case("adamw-lr").optimizer_state_bytes, Some(2 * 4 * params));
}

/// On ranks (`world_size: 2`, the optimizer built in `distributed.rs`): SGD's momentum
/// buffer is there whole under data parallel and halved under ZeRO-1, and absent
/// without momentum.
#[test]
fn sgd_momentum_reaches_the_optimizers_of_the_ranks() {
    // Three residual linear layers of width 10: 3 x (10 x 10 + 10) = 330 f32 values,
    // 165 per rank.
    const NUMEL: u64 = 330;
    let dir = tempfile::tempdir().unwrap();
    let suite = dir.path().join("dist.yaml");
    std::fs::write(
        &suite,
        "suite: dist
threads: 1
warmup: 1
repeats: 1
world_size: 2
models:
  - {name: lin, kind: residual_linear, layers: 3, hidden: 10, batch: [8]}
strategies:
  - {name: ddp-sgd, with: [{optimizer: {kind: sgd, lr: 0.01}}]}
  - {name: ddp-momentum, with: [{optimizer: {kind: sgd, lr: 0.01, momentum: 0.9}}]}
  - {name: zero1-momentum, with: [{zero: 1}, {optimizer: {kind: sgd, momentum: 0.5, weight_decay: 0.1}}]}
  - {name: zero1-adamw, with: [{zero: 1}, {optimizer: {kind: adamw, lr: 3e-4, betas: [0.8, 0.9]}}]}
",
    )
    .unwrap();
    let json = dir.path().join("dist.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memsave"))
        .arg("bench")
        .arg(&suite)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("memsave runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report =
        memsave_bench::Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let state = |name: &str| {
        let c = report.cases.iter().find(|c| c.strategy == name).unwrap();
        assert_eq!(c.status, Status::Ok, "{name}: {:?}", c.error);
        assert_eq!(c.world_size, Some(2));
        c.optimizer_state_bytes
    };
    assert_eq!(state("ddp-sgd"), Some(0));
    assert_eq!(state("ddp-momentum"), Some(4 * NUMEL));
    assert_eq!(state("zero1-momentum"), Some(4 * NUMEL / 2));
    assert_eq!(state("zero1-adamw"), Some(2 * 4 * NUMEL / 2));
}
