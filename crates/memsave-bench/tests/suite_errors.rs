//! Every class of bad input is rejected with `file:line:column` and a message that says
//! what is wrong; valid suites parse with defaults and canonical names.
use memsave_bench::{bundled, CheckpointSpec, ModelKind, Suite, Technique, BUNDLED};

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
