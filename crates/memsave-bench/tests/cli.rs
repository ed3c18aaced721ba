//! The `memsave` binary: exit codes, messages, and result files that are written
//! atomically or not at all.
use std::path::Path;
use std::process::{Command, Output};

fn memsave(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the memsave binary runs")
}

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

#[test]
fn a_run_that_fails_as_a_whole_exits_1_and_keeps_old_results() {
    if tch::Cuda::is_available() {
        return; // the failure below needs a machine without CUDA
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("cuda.yaml"),
        BAD.replace("suite: bad", "suite: cuda\ndevice: cuda")
            .replace("budget: 60MB!", "segments: 2"),
    )
    .unwrap();
    let good = "{\"suite\": \"a good earlier result\"}\n";
    std::fs::write(dir.path().join("out.json"), good).unwrap();
    let out = memsave(&["bench", "cuda.yaml", "--json", "out.json"], dir.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("not available"));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out.json")).unwrap(),
        good
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
    for key in ["suite", "device", "libtorch", "threads", "cases"] {
        assert!(json.get(key).is_some(), "{key}");
    }
    let first = &json["cases"][0];
    assert!(first["peak_bytes"].is_u64());
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
