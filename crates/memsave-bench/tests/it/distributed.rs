//! Suites with `world_size`: each case runs on ranks started by the launcher (the
//! `memsave` binary's hidden `rank` subcommand), and the JSON reports per rank the
//! optimizer state, the gradients held after backward and the bytes sent per step.
//! Expected figures are worked out here from the model's size, not by the code under
//! test.
use crate::common::{bench_on_ranks, ok_case};
use memsave_bench::{run_suite, CaseResult, Report, RunOptions, Status, Suite};
use serial_test::serial;
use std::path::Path;
use std::process::Command;

/// Three residual linear layers of width 10: 3 × (10 × 10 + 10) = 330 f32 values.
const NUMEL: u64 = 330;
/// One f32 used-flag per parameter (a weight and a bias a layer), all-reduced each step.
const FLAGS: u64 = 4 * 6;
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
    bench_on_ranks(dir, "dist", SUITE, n, filter)
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
        let c = ok_case(&one, strategy);
        assert_eq!(c.world_size, Some(1));
        assert_eq!(figures(c), (2 * f32_bytes, f32_bytes, 0), "{strategy}");
    }
    let single_state = ok_case(&one, "ddp").optimizer_state_bytes.unwrap();
    let single_grads = ok_case(&one, "ddp").gradient_bytes.unwrap();
    // Two ranks, 165 values each (330 divides by 2: no padding).
    let shard = 4 * NUMEL / 2;
    // DDP: everything whole; a ring all-reduce sends 2 (N-1)/N of the gradients.
    assert_eq!(
        figures(ok_case(&two, "ddp")),
        (2 * f32_bytes, f32_bytes, f32_bytes + FLAGS)
    );
    // ZeRO-1: half the state; all-reduce the gradients, all-gather the parameters.
    assert_eq!(
        figures(ok_case(&two, "zero1")),
        (2 * shard, f32_bytes, f32_bytes + shard + FLAGS)
    );
    // ZeRO-2: half the state and half the gradients; each rank sends the half it
    // does not own, then its half of the parameters.
    assert_eq!(
        figures(ok_case(&two, "zero2")),
        (2 * shard, shard, 2 * shard + FLAGS)
    );
    // With two micro-batches ZeRO-2 reduces after each backward.
    assert_eq!(
        figures(ok_case(&two, "zero2+accum")),
        (2 * shard, shard, 3 * shard + FLAGS)
    );
    for c in &two.cases {
        assert_eq!(c.world_size, Some(2));
        assert!(c.peak_bytes.is_some_and(|p| p > 0), "{c:?}");
    }
    // Four ranks: 330 values padded to 332, 83 per rank.
    let c = ok_case(&four, "zero2");
    assert_eq!(c.world_size, Some(4));
    let (state, grads, sent) = figures(c);
    assert_eq!((state, grads), (2 * 4 * 83, 4 * 83));
    // 1/N of one process, plus at most one block (one f32 value) of padding.
    assert!(state <= single_state / 4 + 2 * 4, "{state}");
    assert!(grads <= single_grads / 4 + 4, "{grads}");
    // The flags' ring all-reduce sends 2 (N-1)/N of them.
    assert_eq!(sent, 4 * (332 - 83) + 3 * 4 * 83 + FLAGS * 6 / 4);
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
#[serial]
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
    let e = error_of(&base.replace("{zero: 2}", "{zero: 4}"));
    assert!(e.starts_with("bad.yaml:6:29: "), "{e}");
    assert!(
        e.contains(
            "strategies[0].with[0].zero: a ZeRO stage must be 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters), got 4"
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

#[test]
fn zero_ranks_keep_their_optimizer_state_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = SUITE.replace(
        "  - {name: ddp,",
        "  - {name: zero2-disk, with: [{zero: 2}, {optimizer: {kind: adamw, placement: disk}}]}\n  - {name: ddp-disk, with: [{optimizer: {kind: adamw, placement: disk}}]}\n  - {name: ddp,",
    );
    let path = dir.path().join("disk.yaml");
    std::fs::write(&path, yaml).unwrap();
    let json = dir.path().join("disk.json");
    let out = Command::new(env!("CARGO_BIN_EXE_memsave"))
        .arg("bench")
        .arg(&path)
        .args(["--filter", "disk|zero2$", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // Between steps the state is in files: none in memory, where ZeRO-2 with the
    // state in memory holds its half of the two f32 moments.
    assert_eq!(
        ok_case(&report, "zero2-disk").optimizer_state_bytes,
        Some(0)
    );
    assert_eq!(ok_case(&report, "ddp-disk").optimizer_state_bytes, Some(0));
    assert_eq!(
        ok_case(&report, "zero2").optimizer_state_bytes,
        Some(NUMEL / 2 * 2 * 4)
    );
}

#[test]
fn trace_runs_a_case_on_the_suite_s_world_size() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("dist.yaml"), SUITE).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args([
            "trace",
            "dist.yaml",
            "--model",
            "lin",
            "--strategy",
            "zero2",
        ])
        .args(["--html", "t.html", "--svg", "t.svg"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("rank 0 of 2"), "{stdout}");
    // Rank 0's shard of AdamW's two f32 moments: half of the 330 values.
    let state = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("optimizer_state"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(state.contains("1.29 KiB"), "{state}");
    let html = std::fs::read_to_string(dir.path().join("t.html")).unwrap();
    assert!(html.contains("lin / zero2"));
    let svg = std::fs::read_to_string(dir.path().join("t.svg")).unwrap();
    assert!(svg.contains("<svg"));
}

#[test]
fn check_and_bench_agree_on_what_cannot_run_on_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "suite: d
warmup: 0
repeats: 1
world_size: 2
models:
  - {name: even, kind: residual_linear, layers: 1, hidden: 4, batch: [4]}
  - {name: odd, kind: residual_linear, layers: 1, hidden: 4, batch: [3]}
strategies:
  - {name: ddp, with: [{optimizer: {kind: adamw}}]}
  - {name: ib, with: [{optimizer: {kind: adamw, in_backward: true}}]}
";
    std::fs::write(dir.path().join("d.yaml"), yaml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args(["check", "d.yaml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    // One line for a reason that holds on one model, one for a reason on every model.
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[0].starts_with("error: d.yaml: strategy 'ddp' is unavailable on model 'odd': "));
    assert!(
        lines[0].contains("does not divide by world_size 2"),
        "{err}"
    );
    assert!(lines[1].starts_with("error: d.yaml: strategy 'ib' is unavailable: "));
    assert!(lines[1].contains("in_backward"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args(["bench", "d.yaml", "--json", "d.json"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report =
        Report::from_json(&std::fs::read_to_string(dir.path().join("d.json")).unwrap()).unwrap();
    // Cases by model, then strategy: even/ddp runs; the rest are the lines of check.
    assert_eq!(report.cases[0].status, Status::Ok);
    let unavailable: Vec<&CaseResult> = report.cases[1..].iter().collect();
    assert_eq!(unavailable.len(), 3);
    for c in unavailable {
        assert_eq!(c.status, Status::Unavailable, "{c:?}");
        let reason = c.error.as_deref().unwrap();
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("'{}'", c.strategy))
                    && (l.contains(&format!("model '{}'", c.model)) || !l.contains("on model"))
                    && l.ends_with(reason)),
            "bench: {}/{}: {reason}\ncheck: {err}",
            c.model,
            c.strategy
        );
    }
}

/// Issue "Trust III" item 3: the memory limit (the suite's `memory_limit`, and
/// `--memory-limit` over it) counts on ranks as on one process: a step that allocates
/// above it is an error naming the limit (a 120 KiB limit passed with a 133 KiB peak).
/// The limit is set one byte below what the unlimited run's step reached (every rank's
/// share is the same size, so both reach the same), and at exactly that.
#[test]
#[serial]
fn the_memory_limit_counts_on_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (report, _) = bench(dir.path(), 2, Some("^lin/ddp$"));
    let c = ok_case(&report, "ddp");
    let reached = c.start_bytes.unwrap() + c.peak_bytes.unwrap();
    let run = |suite_limit: u64, cli_limit: Option<u64>| -> CaseResult {
        let yaml = SUITE.replace(
            "world_size: 2\n",
            &format!("world_size: 2\nmemory_limit: {suite_limit}\n"),
        );
        let file = dir.path().join("limited.yaml");
        std::fs::write(&file, yaml).unwrap();
        let json = dir.path().join("limited.json");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_memsave"));
        cmd.arg("bench")
            .arg(&file)
            .args(["--filter", "^lin/ddp$", "--json"])
            .arg(&json);
        if let Some(limit) = cli_limit {
            cmd.args(["--memory-limit", &limit.to_string()]);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let report = Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
        report.cases.into_iter().next().unwrap()
    };
    let over = run(reached - 1, None);
    assert_eq!(over.status, Status::Error, "{over:?}");
    let error = over.error.unwrap_or_default();
    assert!(
        error.contains("out of memory") && error.contains("memory limit"),
        "{error}"
    );
    // --memory-limit wins over the suite's.
    let within = run(reached - 1, Some(reached));
    assert_eq!(within.status, Status::Ok, "{:?}", within.error);
}
