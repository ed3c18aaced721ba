//! Helpers more than one module uses.
use memsave_bench::{CaseResult, Report};
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
