//! Suites with `world_size`: each case runs on ranks started by the launcher (the
//! `memsave` binary's hidden `rank` subcommand), and the JSON reports per rank the
//! optimizer state, the gradients held after backward and the bytes sent per step.
//! Expected figures are worked out here from the model's size, not by the code under
//! test.
use memsave_bench::{run_suite, CaseResult, Report, RunOptions, Status, Suite};
use std::path::Path;
use std::process::Command;

/// Three residual linear layers of width 10: 3 × (10 × 10 + 10) = 330 f32 values.
const NUMEL: u64 = 330;
const SUITE: &str = "suite: dist
seed: 0
threads: 1
warmup: 1
repeats: 1
world_size: 2
models:
  - {name: lin, kind: residual_linear, layers: 3, hidden: 10, batch: [8]}
strategies:
  - {name: ddp, with: [{optimizer: {kind: adamw}}]}
  - {name: zero1, with: [{zero: 1}, {optimizer: {kind: adamw}}]}
  - {name: zero2, with: [{zero: 2}, {optimizer: {kind: adamw}}]}
  - {name: zero2+accum, with: [{zero: 2}, {optimizer: {kind: adamw}}, {accumulate: {micro_batches: 2}}]}
";

/// Runs the suite on `n` ranks through the CLI; returns the JSON report and the table.
fn bench(dir: &Path, n: usize, filter: Option<&str>) -> (Report, String) {
    let suite = dir.join("dist.yaml");
    std::fs::write(&suite, SUITE).unwrap();
    let json = dir.join(format!("dist{n}.json"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memsave"));
    cmd.arg("bench")
        .arg(&suite)
        .arg("--world-size")
        .arg(n.to_string())
        .arg("--json")
        .arg(&json);
    if let Some(f) = filter {
        cmd.args(["--filter", f]);
    }
    let out = cmd.output().expect("memsave runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (report, stdout)
}

fn case<'r>(report: &'r Report, strategy: &str) -> &'r CaseResult {
    let c = report
        .cases
        .iter()
        .find(|c| c.strategy == strategy)
        .unwrap_or_else(|| panic!("no case {strategy}"));
    assert_eq!(c.status, Status::Ok, "{strategy}: {:?}", c.error);
    c
}

/// (optimizer state, gradients held after backward, bytes sent per step) of a case.
fn figures(c: &CaseResult) -> (u64, u64, u64) {
    (
        c.optimizer_state_bytes.expect("optimizer state"),
        c.gradient_bytes.expect("gradient bytes"),
        c.bytes_sent_per_step.expect("bytes sent"),
    )
}

#[test]
fn per_rank_state_gradients_and_traffic_follow_the_algorithms() {
    let dir = tempfile::tempdir().unwrap();
    let (one, _) = bench(dir.path(), 1, None);
    let (two, table) = bench(dir.path(), 2, None);
    let (four, _) = bench(dir.path(), 4, Some("zero2$"));
    let f32_bytes = 4 * NUMEL;
    // One process: AdamW's two f32 moments and one f32 gradient per value, nothing sent.
    for strategy in ["ddp", "zero1", "zero2", "zero2+accum"] {
        let c = case(&one, strategy);
        assert_eq!(c.world_size, Some(1));
        assert_eq!(figures(c), (2 * f32_bytes, f32_bytes, 0), "{strategy}");
    }
    let single_state = case(&one, "ddp").optimizer_state_bytes.unwrap();
    let single_grads = case(&one, "ddp").gradient_bytes.unwrap();
    // Two ranks, 165 values each (330 divides by 2: no padding).
    let shard = 4 * NUMEL / 2;
    // DDP: everything whole; a ring all-reduce sends 2 (N-1)/N of the gradients.
    assert_eq!(
        figures(case(&two, "ddp")),
        (2 * f32_bytes, f32_bytes, f32_bytes)
    );
    // ZeRO-1: half the state; all-reduce the gradients, all-gather the parameters.
    assert_eq!(
        figures(case(&two, "zero1")),
        (2 * shard, f32_bytes, f32_bytes + shard)
    );
    // ZeRO-2: half the state and half the gradients; each rank sends the half it
    // does not own, then its half of the parameters.
    assert_eq!(figures(case(&two, "zero2")), (2 * shard, shard, 2 * shard));
    // With two micro-batches ZeRO-2 reduces after each backward.
    assert_eq!(
        figures(case(&two, "zero2+accum")),
        (2 * shard, shard, 3 * shard)
    );
    for c in &two.cases {
        assert_eq!(c.world_size, Some(2));
        assert!(c.peak_bytes.is_some_and(|p| p > 0), "{c:?}");
    }
    // Four ranks: 330 values padded to 332, 83 per rank.
    let c = case(&four, "zero2");
    assert_eq!(c.world_size, Some(4));
    let (state, grads, sent) = figures(c);
    assert_eq!((state, grads), (2 * 4 * 83, 4 * 83));
    // 1/N of one process, plus at most one block (one f32 value) of padding.
    assert!(state <= single_state / 4 + 2 * 4, "{state}");
    assert!(grads <= single_grads / 4 + 4, "{grads}");
    assert_eq!(sent, 4 * (332 - 83) + 3 * 4 * 83);
    // The table shows them.
    assert!(table.contains("per rank:"), "{table}");
    assert!(table.contains("sent/step/rank"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("lin") && l.contains("zero2 ") && l.contains("660 B")),
        "{table}"
    );
}

#[test]
fn a_case_that_cannot_run_on_ranks_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "suite: d
warmup: 0
repeats: 1
world_size: 2
models:
  - {name: odd, kind: residual_linear, layers: 1, hidden: 4, batch: [3]}
strategies:
  - {name: zero2, with: [{zero: 2}, {optimizer: {kind: adamw}}]}
";
    let path = dir.path().join("d.yaml");
    std::fs::write(&path, yaml).unwrap();
    let json = dir.path().join("d.json");
    let out = Command::new(env!("CARGO_BIN_EXE_memsave"))
        .arg("bench")
        .arg(&path)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success());
    let report = Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let c = &report.cases[0];
    assert_eq!(c.status, Status::Unavailable);
    assert!(
        c.error
            .as_deref()
            .is_some_and(|e| e.contains("does not divide by world_size 2")),
        "{c:?}"
    );
}

#[test]
fn zero_without_world_size_is_unavailable() {
    let yaml = "suite: z
warmup: 0
repeats: 1
models:
  - {name: a, kind: residual_linear, layers: 1, hidden: 4, batch: [4]}
strategies:
  - {name: z, with: [{zero: 1}, {optimizer: {kind: adamw}}]}
";
    let suite = Suite::from_yaml(yaml, "z.yaml").unwrap();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    assert_eq!(report.cases[0].status, Status::Unavailable);
    assert!(
        report.cases[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("world_size")),
        "{:?}",
        report.cases[0]
    );
}

fn error_of(yaml: &str) -> String {
    match Suite::from_yaml(yaml, "bad.yaml") {
        Ok(s) => panic!("accepted an invalid suite: {s:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_world_sizes_and_zero_stages_are_errors_at_their_position() {
    let base = "suite: t
world_size: 2
models:
  - {name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - {name: z, with: [{zero: 2}, {optimizer: {kind: adamw}}]}
";
    let e = error_of(&base.replace("world_size: 2", "world_size: 0"));
    assert!(e.starts_with("bad.yaml:2:13: "), "{e}");
    assert!(e.contains("must be positive, got 0"), "{e}");
    let e = error_of(&base.replace("world_size: 2", "world_size: 65"));
    assert!(e.starts_with("bad.yaml:2:13: "), "{e}");
    assert!(e.contains("must be at most 64, got 65"), "{e}");
    let e = error_of(&base.replace("world_size: 2", "world_size: two"));
    assert!(e.starts_with("bad.yaml:2:13: "), "{e}");
    let e = error_of(&base.replace("{zero: 2}", "{zero: 3}"));
    assert!(e.starts_with("bad.yaml:6:29: "), "{e}");
    assert!(
        e.contains(
            "strategies[0].with[0].zero: a ZeRO stage must be 1 (optimizer state sharded) or 2 (and gradients), got 3"
        ),
        "{e}"
    );
    let e = error_of(&base.replace(
        "{zero: 2}, {optimizer: {kind: adamw}}",
        "{zero: 2}, {zero: 1}",
    ));
    assert!(e.starts_with("bad.yaml:6:"), "{e}");
    assert!(e.contains("only one zero"), "{e}");
    // A valid one parses with its world size and canonical names.
    let suite = Suite::from_yaml(
        &base.replace(
            "{name: z, with: [{zero: 2}, {optimizer: {kind: adamw}}]}",
            "{zero: 1}",
        ),
        "ok.yaml",
    )
    .unwrap();
    assert_eq!(suite.world_size, Some(2));
    assert_eq!(suite.strategies[0].name, "zero(stage=1)");
}
