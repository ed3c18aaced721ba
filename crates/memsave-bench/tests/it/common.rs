//! Helpers more than one module uses.
use memsave_bench::{CaseResult, Report, Status};
use std::path::Path;
use std::process::{Command, Output};

/// Runs the `memsave` binary with `args` in `dir` and waits for it.
pub fn memsave(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the memsave binary runs")
}

/// Runs `memsave launch` with `args` and waits for it.
pub fn launch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memsave"))
        .arg("launch")
        .args(args)
        .output()
        .expect("run memsave launch")
}

/// The case of `model` and `strategy` in `report`.
pub fn case<'r>(report: &'r Report, model: &str, strategy: &str) -> &'r CaseResult {
    report
        .cases
        .iter()
        .find(|c| c.model == model && c.strategy == strategy)
        .unwrap_or_else(|| panic!("no case {model}/{strategy}"))
}

/// Writes `suite` (YAML) to `DIR/STEM.yaml`, runs it on `n` ranks through the CLI
/// (`memsave bench --world-size n`, only the cases `filter` matches) and returns the
/// JSON report and the printed table.
pub fn bench_on_ranks(
    dir: &Path,
    stem: &str,
    suite: &str,
    n: usize,
    filter: Option<&str>,
) -> (Report, String) {
    let file = dir.join(format!("{stem}.yaml"));
    std::fs::write(&file, suite).unwrap();
    let json = dir.join(format!("{stem}-{n}.json"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memsave"));
    cmd.arg("bench")
        .arg(&file)
        .arg("--world-size")
        .arg(n.to_string())
        .arg("--json")
        .arg(&json);
    if let Some(f) = filter {
        cmd.args(["--filter", f]);
    }
    let out = cmd.output().expect("memsave runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // A case's model is thrown away: ZeRO-3 lets its weights go without a word.
    assert!(
        !stderr.contains("dropped without f_restore_full_parameters"),
        "{stderr}"
    );
    let report = Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (report, stdout)
}

/// The case of `strategy` in a one-model `report`, which must have run.
pub fn ok_case<'r>(report: &'r Report, strategy: &str) -> &'r CaseResult {
    let c = report
        .cases
        .iter()
        .find(|c| c.strategy == strategy)
        .unwrap_or_else(|| panic!("no case {strategy}"));
    assert_eq!(c.status, Status::Ok, "{strategy}: {:?}", c.error);
    c
}
