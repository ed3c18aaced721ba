//! The `memsave` binary: exit codes, messages, and result files that are written
//! atomically or not at all.
use crate::common::memsave;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

const BAD: &str = "suite: bad
models:
  - {name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - baseline
  - checkpoint: {budget: 60MB!}
";

#[test]
fn check_reports_an_invalid_suite_with_its_position_and_exit_code_2() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.yaml"), BAD).unwrap();
    let out = memsave(&["check", "bad.yaml"], dir.path());
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("bad.yaml:6:26: strategies[1].checkpoint.budget: invalid size '60MB!'"),
        "{err}"
    );
}

#[test]
fn check_accepts_valid_and_bundled_suites() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(&["check", "seed"], dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("seed: ok"));
    let out = memsave(&["check", "missing.yaml"], dir.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("missing.yaml: cannot read"));
}

#[test]
fn suites_lists_the_bundled_suites_from_any_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(&["suites"], dir.path());
    assert_eq!(out.status.code(), Some(0));
    let listing = text(&out.stdout);
    for name in ["seed", "transformer", "quick"] {
        assert!(listing.contains(name), "{listing}");
    }
    assert!(listing.contains("1 opt-in"), "{listing}");
    let out = memsave(&["suites", "quick"], dir.path());
    assert!(text(&out.stdout).contains("suite: quick"));
}

#[test]
fn an_invalid_suite_never_touches_existing_results() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.yaml"), BAD).unwrap();
    let good = "{\"suite\": \"a good earlier result\"}\n";
    std::fs::write(dir.path().join("out.json"), good).unwrap();
    let out = memsave(
        &[
            "bench", "bad.yaml", "--json", "out.json", "--csv", "out.csv",
        ],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out.json")).unwrap(),
        good
    );
    assert!(!dir.path().join("out.csv").exists());
}

/// A two-layer suite on `device: cuda`.
fn cuda_suite() -> String {
    BAD.replace("suite: bad", "suite: cuda\ndevice: cuda")
        .replace("budget: 60MB!", "segments: 2")
}

#[test]
fn a_run_that_fails_as_a_whole_exits_1_and_keeps_old_results() {
    // Meaningful on a machine without CUDA, where `device: cuda` fails the run as a
    // whole; with CUDA the same command must succeed instead (tested in full by
    // `a_tiny_suite_runs_on_cuda`).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cuda.yaml"), cuda_suite()).unwrap();
    let good = "{\"suite\": \"a good earlier result\"}\n";
    std::fs::write(dir.path().join("out.json"), good).unwrap();
    let out = memsave(&["bench", "cuda.yaml", "--json", "out.json"], dir.path());
    let written = std::fs::read_to_string(dir.path().join("out.json")).unwrap();
    if tch::Cuda::is_available() {
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_ne!(written, good);
    } else {
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains("device cuda: not available"));
        assert_eq!(written, good);
    }
}

/// `memsave fit` on CUDA counts the whole device as on the CPU: its measured peak is
/// within the budget and breaks down into the parameters, the input and the rest, at
/// sizes that are multiples of the caching allocator's 512-byte blocks.
#[test]
#[ignore = "needs CUDA"]
fn fit_on_cuda_counts_the_whole_device() {
    let (l, b, h) = (2u64, 4u64, 128u64);
    let params = l * (h * h + h) * 4;
    let yaml = format!(
        "suite: cuda
device: cuda
models:
  - {{name: m, kind: residual_linear, layers: {l}, hidden: {h}, batch: [{b}]}}
strategies:
  - baseline
"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cuda.yaml"), yaml).unwrap();
    let out = memsave(
        &[
            "fit",
            "cuda.yaml",
            "--model",
            "m",
            "--budget",
            "64MiB",
            "--json",
            "fit.json",
        ],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("fit.json")).unwrap())
            .unwrap();
    let measured = json["measured_peak_bytes"].as_u64().unwrap();
    assert!(measured <= 64 << 20, "{measured}");
    let breakdown = &json["breakdown"];
    assert_eq!(
        breakdown["parameters"].as_u64(),
        Some(params),
        "{breakdown}"
    );
    assert_eq!(breakdown["input"].as_u64(), Some(b * h * 4), "{breakdown}");
    let parts: u64 = ["parameters", "optimizer_state", "input", "step"]
        .iter()
        .map(|k| breakdown[k].as_u64().unwrap())
        .sum();
    assert_eq!(parts, measured, "{breakdown}");
    // The traced split by role is the CPU's only.
    assert!(breakdown["step_by_role"].is_null(), "{breakdown}");
}

#[test]
#[ignore = "needs CUDA"]
fn a_tiny_suite_runs_on_cuda() {
    // Sizes that are multiples of the CUDA caching allocator's 512-byte blocks, so
    // its `memory_allocated` counts the same bytes as the formulas.
    let (l, b, h) = (2u64, 4u64, 128u64);
    let activation = b * h * 4;
    let params = l * (h * h + h) * 4;
    let yaml = format!(
        "suite: cuda
device: cuda
warmup: 1
repeats: 2
models:
  - {{name: m, kind: residual_linear, layers: {l}, hidden: {h}, batch: [{b}]}}
strategies:
  - baseline
  - checkpoint: {{every_layer: true}}
  - accumulate: {{micro_batches: 2}}
"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cuda.yaml"), yaml).unwrap();
    let out = memsave(&["bench", "cuda.yaml", "--json", "out.json"], dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out.json")).unwrap())
            .unwrap();
    assert_eq!(json["device"], "cuda:0");
    let cases = json["cases"].as_array().unwrap();
    for c in cases {
        assert_eq!(c["status"], "ok", "{c}");
        // Parameters and input, plus whatever cuBLAS keeps from the warm-up.
        assert!(
            c["start_bytes"].as_u64().unwrap() >= params + b * h * 4,
            "{c}"
        );
        assert!(c["step_time_s"]["min"].as_f64().unwrap() > 0.0, "{c}");
    }
    let base = &cases[0];
    // Every layer keeps its input for backward; the output is the last of them.
    assert_eq!(
        base["retained_after_forward_bytes"],
        l * activation,
        "{base}"
    );
    assert!(
        base["peak_bytes"].as_u64().unwrap() >= l * activation,
        "{base}"
    );
    let trace = base["trace"].as_array().unwrap();
    assert_eq!(trace.len(), l as usize);
    for t in trace {
        let grew = t["after"].as_u64().unwrap() - t["before"].as_u64().unwrap();
        assert_eq!(grew, activation, "{t}");
    }
    // Recomputation gives the same gradients; accumulation the same up to rounding.
    assert_eq!(cases[1]["grad_max_abs_diff"], 0.0, "{}", cases[1]);
    assert!(
        cases[2]["grad_max_abs_diff"].as_f64().unwrap() < 1e-5,
        "{}",
        cases[2]
    );
    assert_eq!(
        cases[2]["retained_after_forward_bytes"],
        l * activation / 2 + params,
        "{}",
        cases[2]
    );
}

#[test]
fn bench_writes_json_csv_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("out.json"), "old").unwrap();
    let out = memsave(
        &[
            "bench", "quick", "--filter", "^linear/", "--json", "out.json", "--csv", "out.csv",
            "--plot", "plots",
        ],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.contains("×base"), "{table}");
    assert!(table.contains("inplace_add"), "{table}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out.json")).unwrap())
            .unwrap();
    for key in ["suite", "device", "libtorch_version", "threads", "cases"] {
        assert!(json.get(key).is_some(), "{key}");
    }
    assert_eq!(json["schema_version"], 2);
    let first = &json["cases"][0];
    assert!(first["peak_bytes"].is_u64());
    for key in ["is_baseline", "has_baseline", "grad_diverged"] {
        assert!(first[key].is_boolean(), "{key}");
    }
    // Panics inside cases (add_out's layer) are recorded, not printed.
    assert!(
        !text(&out.stderr).contains("panicked at"),
        "{}",
        text(&out.stderr)
    );
    assert!(first["step_time_s"]["median"].is_f64());
    assert!(first["trace"][0]["before"].is_u64());
    let csv = std::fs::read_to_string(dir.path().join("out.csv")).unwrap();
    assert!(csv.starts_with("model,strategy,status,"));
    for plot in ["linear-trace.svg", "linear-pareto.svg", "linear-peak.svg"] {
        let svg = std::fs::read_to_string(dir.path().join("plots").join(plot)).unwrap();
        assert!(svg.contains("<svg"), "{plot}");
    }
    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn bad_command_lines_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(&["bench", "--repeats", "0"], dir.path());
    assert_eq!(out.status.code(), Some(2));
    let out = memsave(&["bench", "--memory-limit", "60MB!"], dir.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("invalid size"));
    let out = memsave(&["bench", "--filter", "("], dir.path());
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_zero_memory_limit_is_rejected_as_in_a_suite() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(&["bench", "quick", "--memory-limit", "0"], dir.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("a size must be positive, got '0'"),
        "{}",
        text(&out.stderr)
    );
    assert!(text(&out.stdout).is_empty());
}

#[test]
fn unwritable_outputs_are_reported_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("taken")).unwrap();
    std::fs::write(dir.path().join("file"), "").unwrap();
    for (args, message) in [
        (
            ["--json", "missing/out.json"],
            "--json missing/out.json: the directory missing does not exist",
        ),
        (
            ["--csv", "taken"],
            "--csv taken: is a directory, not a file",
        ),
        (
            ["--plot", "file/plots"],
            "--plot file/plots: file is not a directory",
        ),
    ] {
        let mut command = vec!["bench", "quick", "--filter", "^linear/baseline$"];
        command.extend(args);
        let out = memsave(&command, dir.path());
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(message), "{err}");
        // Nothing ran: no progress line, no table.
        assert!(!err.contains("[1/1]"), "{err}");
        assert!(text(&out.stdout).is_empty(), "{}", text(&out.stdout));
    }
}

#[test]
fn a_bundled_name_and_a_path_are_never_confused() {
    let dir = tempfile::tempdir().unwrap();
    // A directory named like a bundled suite does not hide it.
    std::fs::create_dir(dir.path().join("quick")).unwrap();
    let out = memsave(&["check", "quick"], dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("quick: ok (suite quick"));
    assert!(text(&out.stderr).contains("running the bundled suite 'quick'"));
    // With a slash it is a path, and a directory is not a suite file.
    let out = memsave(&["check", "./quick"], dir.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("./quick: cannot read the suite"));
    // A file of that name is ambiguous: the error names both.
    std::fs::write(dir.path().join("seed"), "suite: mine\n").unwrap();
    let out = memsave(&["check", "seed"], dir.path());
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("'seed' names both the bundled suite seed and the file ./seed"),
        "{err}"
    );
    let out = memsave(&["check", "./seed"], dir.path());
    assert!(
        text(&out.stderr).contains("./seed:1:1"),
        "{}",
        text(&out.stderr)
    );
}

/// Asserts that `stderr` is one line, `error: ...`, without Rust's backtrace note or
/// libtorch's C++ frames.
fn assert_one_error_line(stderr: &str) {
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for needle in [
        "frame #",
        "Exception raised from",
        "RUST_BACKTRACE",
        "panicked at",
    ] {
        assert!(!stderr.contains(needle), "{needle}: {stderr}");
    }
}

#[test]
fn trace_of_a_failing_step_exits_1_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    // The seed's `x += f(x)` fails at backward.
    let out = memsave(
        &[
            "trace",
            "quick",
            "--model",
            "linear",
            "--strategy",
            "inplace_add",
            "--html",
            "t.html",
        ],
        dir.path(),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_one_error_line(&err);
    assert!(err.contains("the traced step failed: "), "{err}");
    assert!(err.contains("modified by an in-place operation"), "{err}");
    // The trace is still shown and written: it shows where the step failed.
    assert!(text(&out.stdout).contains("peak"), "{}", text(&out.stdout));
    assert!(dir.path().join("t.html").is_file());
}

#[test]
fn trace_out_of_memory_exits_1_with_one_line() {
    // Four layers keep 4 KiB each for backward over parameters of 65 KiB: 300 KiB of
    // simulated capacity runs out in the step.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("lim.yaml"),
        "suite: lim
memory_limit: 300KiB
warmup: 0
repeats: 1
models:
  - {name: m, kind: residual_linear, layers: 4, hidden: 64, batch: [64, 4]}
strategies:
  - baseline
",
    )
    .unwrap();
    let out = memsave(
        &[
            "trace",
            "lim.yaml",
            "--model",
            "m",
            "--strategy",
            "baseline",
        ],
        dir.path(),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_one_error_line(&err);
    assert!(err.contains("out of memory"), "{err}");
    assert!(err.contains("memory limit of 307200 bytes"), "{err}");
}

/// Strategies `bench` cannot run: the step in backward with loss scaling, and with
/// accumulation in memory.
const UNAVAILABLE: &str = "suite: av
warmup: 0
repeats: 1
models:
  - {name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - baseline
  - {name: ib+scaler, with: [grad_scaler, {optimizer: {kind: adamw, in_backward: true}}]}
  - {name: ib+accum, with: [{accumulate: {micro_batches: 2}}, {optimizer: {kind: adamw, in_backward: true}}]}
";

#[test]
fn check_reports_what_bench_marks_unavailable_with_the_same_reason() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("av.yaml"), UNAVAILABLE).unwrap();
    let out = memsave(&["check", "av.yaml"], dir.path());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(text(&out.stdout).is_empty(), "{}", text(&out.stdout));
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[0].starts_with("error: av.yaml: strategy 'ib+scaler' is unavailable: "));
    assert!(lines[0].contains("grad_scaler"), "{err}");
    assert!(lines[1].starts_with("error: av.yaml: strategy 'ib+accum' is unavailable: "));
    assert!(lines[1].contains("accumulate"), "{err}");

    let out = memsave(&["bench", "av.yaml", "--json", "av.json"], dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("av.json")).unwrap())
            .unwrap();
    let cases = json["cases"].as_array().unwrap();
    assert_eq!(cases[0]["status"], "ok");
    for (case, line) in cases[1..].iter().zip(&lines) {
        assert_eq!(case["status"], "unavailable", "{case}");
        let reason = case["error"].as_str().unwrap();
        assert!(line.ends_with(reason), "check: {line}\nbench: {reason}");
    }
}

#[test]
fn check_accepts_every_bundled_suite() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "seed",
        "quick",
        "transformer",
        "optimizer",
        "fit",
        "distributed",
    ] {
        let out = memsave(&["check", name], dir.path());
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
    }
}
