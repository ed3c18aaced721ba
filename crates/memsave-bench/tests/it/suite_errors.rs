//! Every class of bad input is rejected with `file:line:column` and a message that says
//! what is wrong; valid suites parse with defaults and canonical names.
use memsave_bench::{
    bundled, CheckpointSpec, ModelKind, ModelSpec, ScalerSpec, StrategySpec, Suite, Technique,
    BUNDLED,
};

const BASE: &str = "suite: t
models:
  - {name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - baseline
";

/// `BASE` with `from` replaced by `to`, parsed; returns the error text.
fn error_of(yaml: &str) -> String {
    match Suite::from_yaml(yaml, "bad.yaml") {
        Ok(s) => panic!("accepted an invalid suite: {s:?}\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

fn edited(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "{from}");
    BASE.replace(from, to)
}

fn with_strategy(line: &str) -> String {
    format!("{BASE}  - {line}\n")
}

fn assert_error(yaml: &str, position: &str, needle: &str) {
    let e = error_of(yaml);
    assert!(
        e.starts_with(&format!("bad.yaml:{position}: ")),
        "expected position {position} in: {e}"
    );
    assert!(e.contains(needle), "expected '{needle}' in: {e}");
    assert!(!e.contains(" at line "), "position repeated: {e}");
}

#[test]
fn syntax_errors_have_a_position() {
    assert_error(
        &with_strategy("{checkpoint: {segments: 2}"),
        "7:1",
        "did not find expected ',' or '}'",
    );
    assert_error("suite: \"t\n", "2:1", "unexpected end of stream");
    assert_error(
        "suite: t\n models: x\n",
        "2:8",
        "mapping values are not allowed",
    );
}

#[test]
fn unknown_keys_are_rejected() {
    assert_error(
        &edited("batch: [4]", "batch: [4], colour: red"),
        "3:72",
        "unknown field `colour`",
    );
    assert_error(
        &edited("suite: t", "suite: t\nrepeat: 3"),
        "2:1",
        "unknown field `repeat`",
    );
    assert_error(
        &with_strategy("checkpoint: {segment: 2}"),
        "6:18",
        "unknown field `segment`",
    );
}

#[test]
fn wrong_types_are_rejected() {
    assert_error(
        &edited("layers: 2", "layers: two"),
        "3:46",
        "expected a positive integer",
    );
    assert_error(
        &edited("batch: [4]", "batch: 4"),
        "3:67",
        "expected a sequence",
    );
    assert_error(
        &edited("  - baseline", "  - [baseline]"),
        "5:5",
        "a strategy",
    );
}

#[test]
fn zero_and_negative_sizes_are_rejected() {
    assert_error(
        &edited("layers: 2", "layers: 0"),
        "3:46",
        "must be positive, got 0",
    );
    assert_error(
        &edited("hidden: 8", "hidden: -8"),
        "3:57",
        "must be positive, got -8",
    );
    assert_error(
        &edited("batch: [4]", "batch: [4, 0]"),
        "3:71",
        "must be positive, got 0",
    );
    assert_error(
        &edited("batch: [4]", "batch: []"),
        "3:5",
        "at least one dimension",
    );
    assert_error(
        &edited("hidden: 8", "hidden: 0.5"),
        "3:57",
        "expected a positive integer",
    );
    assert_error(
        &edited("suite: t", "suite: t\nrepeats: 0"),
        "2:10",
        "must be positive",
    );
    assert_error(
        &with_strategy("accumulate: {micro_batches: 0}"),
        "6:33",
        "must be positive",
    );
    assert_error(
        &with_strategy("checkpoint: {budget: 0}"),
        "6:26",
        "a size must be positive",
    );
}

#[test]
fn unknown_strategies_and_dtypes_are_rejected() {
    assert_error(
        &with_strategy("checkpont: {segments: 2}"),
        "6:5",
        "unknown strategy 'checkpont'",
    );
    assert_error(
        &with_strategy("gradient_magic"),
        "6:5",
        "unknown strategy 'gradient_magic'",
    );
    assert_error(
        &with_strategy("autocast: {dtype: bf8}"),
        "6:23",
        "unknown dtype 'bf8', expected bf16 or fp16",
    );
    assert_error(&with_strategy("checkpoint"), "6:5", "needs arguments");
    assert_error(
        &with_strategy("checkpoint: {segments: 2, nested: true}"),
        "6:17",
        "exactly one of",
    );
    assert_error(
        &edited("kind: residual_linear", "kind: lstm"),
        "3:21",
        "unknown variant `lstm`",
    );
}

#[test]
fn unparsable_sizes_are_rejected() {
    assert_error(
        &with_strategy("checkpoint: {budget: 60MB!}"),
        "6:26",
        "invalid size '60MB!'",
    );
    assert_error(
        &edited("suite: t", "suite: t\nmemory_limit: lots"),
        "2:15",
        "invalid size 'lots'",
    );
}

#[test]
fn inconsistent_entries_are_rejected_at_the_entry() {
    assert_error(
        &with_strategy("baseline"),
        "6:5",
        "duplicate strategy name 'baseline'",
    );
    assert_error(
        &edited(
            "strategies:",
            "  - {name: a, kind: residual_mlp, layers: 1, hidden: 4, batch: [2]}\nstrategies:",
        ),
        "4:5",
        "duplicate model name 'a'",
    );
    assert_error(
        &edited("kind: residual_linear", "kind: transformer, heads: 3"),
        "3:5",
        "heads (3) must divide hidden (8)",
    );
    assert_error(
        &edited("kind: residual_linear", "kind: transformer, heads: 2"),
        "3:5",
        "[batch, sequence]",
    );
    assert_error(
        &edited("hidden: 8", "hidden: 8, heads: 2"),
        "3:5",
        "heads only applies to kind transformer",
    );
    assert_error(
        &with_strategy("{name: x, with: [baseline, {checkpoint: {segments: 2}}]}"),
        "6:5",
        "baseline cannot be combined",
    );
    assert_error(
        &with_strategy("{with: [{autocast: {dtype: bf16}}, {autocast: {dtype: fp16}}]}"),
        "6:5",
        "only one autocast",
    );
    assert_error(
        &edited("strategies:\n  - baseline\n", "strategies: []\n"),
        "4:13",
        "strategies: must list at least one entry",
    );
    assert_error(
        &edited("strategies:\n  - baseline\n", "strategies:\n"),
        "4:12",
        "strategies: must list at least one entry",
    );
}

#[test]
fn files_that_cannot_be_read_say_so() {
    let e = Suite::from_file("/nonexistent/suite.yaml").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/suite.yaml: cannot read"),
        "{e}"
    );
}

#[test]
fn canonical_names() {
    let yaml = format!(
        "{BASE}  - inplace_add
  - add_out
  - safe_residual
  - checkpoint: {{segments: 3}}
  - checkpoint: {{every_layer: true}}
  - checkpoint: {{nested: true}}
  - checkpoint: {{budget: 60MiB}}
  - autocast: {{dtype: bf16}}
  - accumulate: {{micro_batches: 4}}
  - {{name: ckpt+bf16, with: [{{checkpoint: {{segments: 3}}}}, {{autocast: {{dtype: bf16}}}}]}}
  - {{with: [{{checkpoint: {{nested: true}}}}, {{accumulate: {{micro_batches: 2}}}}]}}
  - {{name: half, autocast: {{dtype: fp16}}}}
"
    );
    let suite = Suite::from_yaml(&yaml, "names.yaml").unwrap();
    let names: Vec<&str> = suite.strategies.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "baseline",
            "inplace_add",
            "add_out",
            "safe_residual",
            "checkpoint(segments=3)",
            "checkpoint(every_layer=true)",
            "checkpoint(nested=true)",
            "checkpoint(budget=60MiB)",
            "autocast(dtype=bf16)",
            "accumulate(micro_batches=4)",
            "ckpt+bf16",
            "checkpoint(nested=true)+accumulate(micro_batches=2)",
            "half",
        ]
    );
    assert!(suite.strategies[0].is_baseline());
    assert!(!suite.strategies[1].is_baseline());
    assert_eq!(
        suite.strategies[7].techniques,
        [Technique::Checkpoint(CheckpointSpec::Budget(
            memsave_bench::Size {
                bytes: 60 << 20,
                text: "60MiB".into()
            }
        ))]
    );
    assert_eq!(suite.strategies[10].techniques.len(), 2);
}

#[test]
fn defaults_are_filled_in() {
    let suite = Suite::from_yaml(BASE, "t.yaml").unwrap();
    assert_eq!((suite.warmup, suite.repeats, suite.seed), (1, 3, 0));
    assert_eq!(suite.threads, None);
    assert_eq!(suite.memory_limit, None);
    let m = &suite.models[0];
    assert_eq!(m.kind, ModelKind::ResidualLinear);
    assert!(m.enabled);
    assert_eq!(m.input_shape(), [4, 8]);
}

#[test]
fn bundled_suites_are_valid() {
    for b in BUNDLED {
        let suite = Suite::from_yaml(b.source, &b.file_name())
            .unwrap_or_else(|e| panic!("{}: {e}", b.name));
        assert_eq!(suite.suite, b.name);
        assert!(!b.description().is_empty());
    }
    let seed = Suite::from_yaml(bundled("seed").unwrap().source, "seed.yaml").unwrap();
    let full = seed.models.iter().find(|m| m.batch == [500, 500]).unwrap();
    assert!(!full.enabled, "the full-size model is opt-in");
    assert_eq!(full.hidden, 512);
    assert!(bundled("nope").is_none());
}

#[test]
fn the_issue_example_parses() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/issue_example.yaml");
    let suite = Suite::from_file(path).unwrap();
    assert_eq!(suite.models.len(), 3);
    assert_eq!(suite.strategies.len(), 11);
    assert_eq!(suite.memory_limit.as_ref().map(|s| s.bytes), Some(8 << 30));
    assert_eq!(suite.threads, Some(2));
    assert_eq!(suite.models[2].heads, Some(4));
    assert_eq!(suite.models[1].expansion, 4);
}

#[test]
fn model_sizes_are_limited_at_parse_time() {
    // A typo of a depth: rejected at the value, not built for minutes.
    assert_error(
        &edited("layers: 2", "layers: 100000000"),
        "3:46",
        "must be at most 10000, got 100000000",
    );
    assert!(Suite::from_yaml(&edited("layers: 2", "layers: 10000"), "ok.yaml").is_ok());
    // 2^62 would overflow `expansion * hidden` in i64.
    assert_error(
        &edited(
            "kind: residual_linear, layers: 2, hidden: 8,",
            "kind: residual_mlp, layers: 2, hidden: 8, expansion: 4611686018427387904,",
        ),
        "3:68",
        "models[0].expansion: must be at most 16777216, got 4611686018427387904",
    );
    assert_error(
        &edited("batch: [4]", "batch: [4, 20000000]"),
        "3:71",
        "must be at most 16777216",
    );
    // Each dimension within its limit, the whole too big: reported at the model.
    assert_error(
        &edited("hidden: 8", "hidden: 65536"),
        "3:5",
        "model 'a': 8590065664 parameters, more than the limit of 4294967296",
    );
    assert_error(
        &edited(
            "kind: residual_linear, layers: 2, hidden: 8,",
            "kind: residual_mlp, layers: 10000, hidden: 16777216, expansion: 16777216,",
        ),
        "3:5",
        "the parameter count overflows 64 bits",
    );
    assert_error(
        &edited("batch: [4]", "batch: [65536, 65536, 2]"),
        "3:5",
        "an input of 68719476736 elements, more than the limit of 4294967296",
    );
    assert_error(
        &edited("batch: [4]", "batch: [16777216, 16777216, 16777216]"),
        "3:5",
        "the input's element count overflows 64 bits",
    );
    assert_error(
        &edited("suite: t", "suite: t\nthreads: 1000000"),
        "2:10",
        "must be at most 1024",
    );
}

#[test]
fn parameter_counts_follow_the_layer_shapes() {
    let model = |kind, hidden, expansion| ModelSpec {
        name: "m".into(),
        kind,
        layers: 3,
        hidden,
        batch: vec![2],
        expansion,
        heads: Some(2),
        enabled: true,
    };
    // Linear(h, h): h*h weights and h biases per layer.
    assert_eq!(
        model(ModelKind::ResidualLinear, 512, 4).parameter_count(),
        Some(3 * (512 * 512 + 512))
    );
    // Linear(8, 16) and Linear(16, 8).
    assert_eq!(
        model(ModelKind::ResidualMlp, 8, 2).parameter_count(),
        Some(3 * ((8 * 16 + 16) + (16 * 8 + 8)))
    );
    // Two LayerNorms (weight, bias), qkv, proj, up, down.
    assert_eq!(
        model(ModelKind::Transformer, 8, 4).parameter_count(),
        Some(3 * (2 * 16 + (8 * 24 + 24) + (8 * 8 + 8) + (8 * 32 + 32) + (32 * 8 + 8)))
    );
    assert_eq!(
        model(ModelKind::ResidualMlp, 1 << 40, 1 << 40).parameter_count(),
        None
    );
    assert_eq!(
        model(ModelKind::ResidualLinear, 8, 4).input_elements(),
        Some(16)
    );
}

#[test]
fn grad_scaler_is_a_technique_with_optional_arguments() {
    let yaml = format!(
        "{BASE}  - grad_scaler
  - grad_scaler: {{init_scale: 1024, growth_interval: 100}}
  - {{with: [{{accumulate: {{micro_batches: 2}}}}, grad_scaler]}}
  - {{name: scaled-bf16, with: [{{autocast: {{dtype: bf16}}}}, {{grad_scaler: {{backoff_factor: 0.25}}}}]}}
"
    );
    let suite = Suite::from_yaml(&yaml, "scaler.yaml").unwrap();
    let names: Vec<&str> = suite.strategies.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "baseline",
            "grad_scaler",
            "grad_scaler(init_scale=1024, growth_interval=100)",
            "accumulate(micro_batches=2)+grad_scaler",
            "scaled-bf16",
        ]
    );
    assert_eq!(
        suite.strategies[1].techniques,
        [Technique::GradScaler(ScalerSpec::default())]
    );
    let Technique::GradScaler(spec) = &suite.strategies[2].techniques[0] else {
        panic!("{:?}", suite.strategies[2]);
    };
    let config = spec.config();
    assert_eq!(config.init_scale, 1024.0);
    assert_eq!(config.growth_interval, 100);
    assert_eq!(config.growth_factor, 2.0, "PyTorch's default");
    assert_eq!(config.backoff_factor, 0.5, "PyTorch's default");

    // The scaler's own rules, at the arguments' position.
    assert_error(
        &with_strategy("grad_scaler: {backoff_factor: 2}"),
        "6:18",
        "strategies[1].grad_scaler: invalid GradScaler setting: backoff_factor must be in (0, 1)",
    );
    assert_error(
        &with_strategy("grad_scaler: {init_scale: 0}"),
        "6:18",
        "init_scale must be finite and > 0",
    );
    assert_error(
        &with_strategy("grad_scaler: {scale: 2}"),
        "6:19",
        "unknown field `scale`",
    );
    assert_error(
        &with_strategy("{with: [grad_scaler, grad_scaler]}"),
        "6:5",
        "only one grad_scaler",
    );
}

#[test]
fn the_baseline_is_decided_by_techniques_not_names() {
    let yaml = "suite: t
models:
  - {name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - {name: ref, with: [baseline]}
  - {name: baseline, checkpoint: {segments: 2}}
";
    let suite = Suite::from_yaml(yaml, "t.yaml").unwrap();
    assert_eq!(suite.strategies[0].name, "ref");
    assert!(suite.strategies[0].is_baseline());
    assert_eq!(suite.strategies[1].name, "baseline");
    assert!(!suite.strategies[1].is_baseline());
}

#[test]
fn parsing_keeps_no_state_between_parses() {
    // Each parse is independent: the same entry parses again, on the same thread.
    for _ in 0..2 {
        let s: StrategySpec = serde_yaml::from_str("baseline").unwrap();
        assert!(s.is_baseline());
        let m: ModelSpec = serde_yaml::from_str(
            "{name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}",
        )
        .unwrap();
        assert_eq!(m.name, "a");
    }
    // A suite that fails part-way leaves nothing behind for the next one.
    let failing = edited(
        "strategies:\n  - baseline\n",
        "strategies:\n  - baseline\n  - nope\n",
    );
    assert!(Suite::from_yaml(&failing, "bad.yaml").is_err());
    assert!(Suite::from_yaml(BASE, "t.yaml").is_ok());
    // Names are unique per suite, not per thread: duplicates still fail inside one.
    assert_error(&with_strategy("baseline"), "6:5", "duplicate strategy name");
}

#[test]
fn compress_and_offload_parse_combine_and_reject_bad_arguments() {
    let yaml = format!(
        "{BASE}  - compress: {{dtype: int8}}\n  - offload: {{to: disk, dir: /tmp/x}}\n  - offload: {{to: cpu}}\n  - offload: {{to: disk, max_in_flight: 4MiB}}\n  - {{name: c3, with: [{{checkpoint: {{segments: 2}}}}, {{compress: {{dtype: bf16}}}}]}}\n"
    );
    let suite = Suite::from_yaml(&yaml, "t.yaml").unwrap();
    let names: Vec<&str> = suite.strategies.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "baseline",
            "compress(dtype=int8)",
            "offload(to=disk, dir=/tmp/x)",
            "offload(to=cpu)",
            "offload(to=disk, max_in_flight=4MiB)",
            "c3"
        ]
    );
    assert_error(
        &with_strategy("compress: {dtype: int4}"),
        "6:5",
        "compress: unknown dtype 'int4', expected one of bf16, fp16, fp8, int8",
    );
    assert_error(
        &with_strategy("offload: {to: gpu}"),
        "6:5",
        "offload: unknown target 'gpu', expected disk or cpu",
    );
    assert_error(
        &with_strategy("offload: {to: cpu, dir: /tmp}"),
        "6:5",
        "dir and max_in_flight are for {to: disk} only",
    );
    assert_error(
        &with_strategy("offload: {to: cpu, max_in_flight: 1MiB}"),
        "6:5",
        "dir and max_in_flight are for {to: disk} only",
    );
    assert_error(
        &with_strategy("offload: {to: disk, max_in_flight: lots}"),
        "6:40",
        "offload.max_in_flight: invalid size 'lots'",
    );
    assert_error(
        &with_strategy("{with: [{compress: {dtype: int8}}, {offload: {to: disk}}]}"),
        "6:5",
        "only one saved-tensor hook",
    );
}

#[test]
fn budget_levers_parse_and_bad_ones_are_rejected_at_the_entry() {
    let yaml = format!(
        "{BASE}  - checkpoint: {{budget: 18MiB, offload: true, compress: int8}}
  - checkpoint: {{budget: 18MiB, offload: true}}
  - {{name: levers+bf16, with: [{{checkpoint: {{budget: 18MiB, compress: bf16}}}}, {{autocast: {{dtype: bf16}}}}]}}
"
    );
    let suite = Suite::from_yaml(&yaml, "levers.yaml").unwrap();
    let names: Vec<&str> = suite.strategies.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "baseline",
            "checkpoint(budget=18MiB,offload=true,compress=int8)",
            "checkpoint(budget=18MiB,offload=true)",
            "levers+bf16",
        ]
    );
    assert_eq!(
        suite.strategies[2].techniques,
        [Technique::Checkpoint(CheckpointSpec::BudgetWithLevers {
            budget: memsave_bench::Size {
                bytes: 18 << 20,
                text: "18MiB".into()
            },
            offload: true,
            compress: None,
        })]
    );
    assert_eq!(suite.strategies[3].techniques.len(), 2);

    assert_error(
        &with_strategy("checkpoint: {segments: 3, offload: true}"),
        "6:17",
        "give a budget too",
    );
    assert_error(
        &with_strategy("checkpoint: {budget: 18MiB, compress: int4}"),
        "6:17",
        "unknown dtype 'int4'",
    );
    assert_error(
        &with_strategy("checkpoint: {budget: 18MiB, offload: false}"),
        "6:17",
        "offload must be true",
    );
    assert_error(
        &with_strategy("checkpoint: {budget: 18MiB, offload: yes please}"),
        "6:42",
        "checkpoint.offload: invalid type: string \"yes please\", expected a boolean",
    );
}
