//! Every technique of the single-process step on two ranks through `memsave bench`
//! (each rank steps through memsave-step's engine with data parallel): each case runs
//! and reports what its technique reports on one process, and the traffic data
//! parallel and ZeRO send. What cannot run on ranks is `unavailable`, with the
//! technique named, decided before any rank starts. Expected figures are worked out
//! here from the model's size and the algorithms, not by the code under test.
use memsave_bench::{availability, run_suite, CaseResult, Report, RunOptions, Status, Suite};
use serial_test::serial;
use std::process::Command;

/// Three residual MLP blocks of width 16, expansion 2: 3 × (16 × 32 + 32 + 32 × 16 +
/// 16) = 3216 f32 values.
const NUMEL: u64 = 3216;
/// One f32 used-flag per parameter (4 a block), all-reduced with the gradients: on
/// two ranks a ring all-reduce sends as many bytes as it reduces.
const FLAGS: u64 = 4 * 12;
const SUITE: &str = "suite: techniques
seed: 0
threads: 1
warmup: 1
repeats: 1
world_size: 2
models:
  - {name: mlp, kind: residual_mlp, layers: 3, hidden: 16, expansion: 2, batch: [8, 32]}
strategies:
  - baseline
  - {name: offload-disk, with: [{offload: {to: disk}}]}
  - {name: offload-cpu, with: [{offload: {to: cpu}}]}
  - {name: compress-int8, with: [{compress: {dtype: int8}}]}
  - {name: compress-bf16, with: [{compress: {dtype: bf16}}]}
  - {name: every-layer, with: [{checkpoint: {every_layer: true}}]}
  - {name: segments, with: [{checkpoint: {segments: 3}}]}
  - {name: budget, with: [{checkpoint: {budget: 1MiB}}]}
  - {name: accumulate, with: [{accumulate: {micro_batches: 2}}]}
  - {name: autocast, with: [{autocast: {dtype: bf16}}]}
  - {name: scaler, with: [grad_scaler]}
  - {name: scaler+sgd, with: [grad_scaler, {optimizer: {kind: sgd, momentum: 0.9, placement: cpu}}]}
  - {name: adamw-int8-disk, with: [{optimizer: {kind: adamw, state: int8, placement: disk}}]}
  - {name: zero1+offload_grads, with: [{zero: 1}, {optimizer: {kind: sgd, momentum: 0.9}}, {offload_grads: {to: disk}}, {accumulate: {micro_batches: 2}}]}
  - {name: zero2+ckpt+compress, with: [{zero: 2}, {optimizer: {kind: adamw}}, {checkpoint: {every_layer: true}}, {compress: {dtype: int8}}]}
";

fn case<'r>(report: &'r Report, strategy: &str) -> &'r CaseResult {
    report
        .cases
        .iter()
        .find(|c| c.strategy == strategy)
        .unwrap_or_else(|| panic!("no case {strategy}"))
}

/// `memsave bench` on the suite `yaml` (written as `name.yaml` in `dir`), with its
/// JSON report in `name.json` there: the process's output and the report's path.
fn bench(
    dir: &std::path::Path,
    name: &str,
    yaml: &str,
) -> (std::process::Output, std::path::PathBuf) {
    let suite = dir.join(format!("{name}.yaml"));
    std::fs::write(&suite, yaml).unwrap();
    let json = dir.join(format!("{name}.json"));
    let out = Command::new(env!("CARGO_BIN_EXE_memsave"))
        .arg("bench")
        .arg(&suite)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("memsave runs");
    (out, json)
}

#[test]
fn every_technique_of_one_process_runs_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (out, json) = bench(dir.path(), "techniques", SUITE);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = Report::from_json(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report.cases.len(), 15, "{stdout}");
    for c in &report.cases {
        assert_eq!(c.status, Status::Ok, "{}: {:?}", c.strategy, c.error);
        assert_eq!(c.world_size, Some(2), "{}", c.strategy);
        assert!(c.peak_bytes.is_some_and(|p| p > 0), "{c:?}");
    }
    let f32_bytes = 4 * NUMEL;
    let shard = f32_bytes / 2;
    // Data parallel: one all-reduce of every gradient a step (2 (N-1)/N of them: all
    // of them on two ranks), whatever the technique; accumulation reduces only the
    // last micro-batch's backward. Each rank holds every gradient after backward.
    for strategy in [
        "baseline",
        "offload-disk",
        "offload-cpu",
        "compress-int8",
        "compress-bf16",
        "every-layer",
        "segments",
        "budget",
        "accumulate",
        "autocast",
        "scaler",
        "scaler+sgd",
        "adamw-int8-disk",
    ] {
        let c = case(&report, strategy);
        assert_eq!(c.bytes_sent_per_step, Some(f32_bytes + FLAGS), "{strategy}");
        assert_eq!(c.gradient_bytes, Some(f32_bytes), "{strategy}");
    }
    // ZeRO-1 all-reduces the gradients (restored from their files) in its step and
    // all-gathers the parameters; ZeRO-2 sends the half of the gradients it does not
    // own, then its half of the parameters, and holds half the gradients.
    let c = case(&report, "zero1+offload_grads");
    assert_eq!(c.bytes_sent_per_step, Some(f32_bytes + shard + FLAGS));
    let c = case(&report, "zero2+ckpt+compress");
    assert_eq!(c.bytes_sent_per_step, Some(2 * shard + FLAGS));
    assert_eq!(c.gradient_bytes, Some(shard));
    // Half of AdamW's two f32 moments per rank.
    assert_eq!(c.optimizer_state_bytes, Some(2 * shard));
    // The per-rank levers report as on one process: disk offload writes the saved
    // activations, `offload: {to: cpu}` has nothing to move on the CPU.
    let c = case(&report, "offload-disk");
    assert!(c.offloaded_bytes.is_some_and(|b| b > 0), "{c:?}");
    assert_eq!(case(&report, "offload-cpu").offloaded_bytes, Some(0));
    for strategy in ["compress-int8", "compress-bf16"] {
        let c = case(&report, strategy);
        assert!(c.compressed_saved_bytes.is_some_and(|b| b > 0), "{c:?}");
    }
    // Checkpointing every layer keeps less after the forward than the baseline.
    let kept = |s| case(&report, s).retained_after_forward_bytes.unwrap();
    assert!(kept("every-layer") < kept("baseline"), "{stdout}");
    // State on disk: none in memory between steps.
    assert_eq!(
        case(&report, "adamw-int8-disk").optimizer_state_bytes,
        Some(0)
    );
}

/// Strategies the ranks cannot run, each with the technique its reason must name.
const REFUSED: [(&str, &str, &str); 7] = [
    (
        "in_backward",
        "[{optimizer: {kind: adamw, in_backward: true}}]",
        "in_backward",
    ),
    (
        "ddp+offload_grads",
        "[{optimizer: {kind: sgd}}, {offload_grads: {to: disk}}]",
        "offload_grads",
    ),
    (
        "zero2+offload_grads",
        "[{zero: 2}, {optimizer: {kind: sgd}}, {offload_grads: {to: disk}}]",
        "offload_grads",
    ),
    (
        "zero1+scaler",
        "[{zero: 1}, {optimizer: {kind: adamw}}, grad_scaler]",
        "grad_scaler",
    ),
    ("zero-alone", "[{zero: 2}]", "add an optimizer"),
    (
        "auto_batch",
        "[{auto_batch: {policy: halving, budget: 40MiB}}]",
        "auto_batch",
    ),
    ("fit", "[{fit: {budget: 40MiB}}]", "fit"),
];

#[test]
#[serial]
fn what_cannot_run_on_ranks_is_unavailable_before_any_rank_starts() {
    let mut yaml = "suite: refused
warmup: 0
repeats: 1
world_size: 2
models:
  - {name: lin, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - baseline
"
    .to_owned();
    for (name, with, _) in REFUSED {
        yaml.push_str(&format!("  - {{name: {name}, with: {with}}}\n"));
    }
    let suite = Suite::from_yaml(&yaml, "refused.yaml").unwrap();
    // A program that cannot start: a case whose ranks were launched is an error.
    let options = RunOptions {
        rank_program: Some("/nonexistent/memsave".into()),
        ..RunOptions::default()
    };
    let report = run_suite(&suite, &options).unwrap();
    let baseline = case(&report, "baseline");
    assert_eq!(baseline.status, Status::Error, "{baseline:?}");
    assert!(
        baseline
            .error
            .as_deref()
            .is_some_and(|e| e.contains("could not start")),
        "{baseline:?}"
    );
    let model = &suite.models[0];
    for (name, _, names) in REFUSED {
        let c = case(&report, name);
        assert_eq!(c.status, Status::Unavailable, "{name}: {c:?}");
        let reason = c.error.as_deref().unwrap_or_default();
        assert!(reason.contains(names), "{name}: {reason}");
        // `memsave check` asks the same function, from the suite alone.
        let strategy = suite.strategies.iter().find(|s| s.name == name).unwrap();
        assert_eq!(
            availability(model, strategy, Some(2))
                .unwrap_err()
                .to_string(),
            reason,
            "{name}"
        );
    }
}

/// `offload_params: {to: disk}` runs on one rank (`world_size: 1`): the rank holds the
/// 4-byte NaN of its parameters between steps (the weights are in files), with AdamW
/// stepped in backward and with accumulation; without `world_size` it is unavailable,
/// naming what to set, and after backward (no `in_backward`) too.
#[test]
#[serial]
fn offload_params_runs_on_one_rank_with_its_weights_in_files() {
    let yaml = "suite: params
seed: 0
threads: 1
warmup: 1
repeats: 1
world_size: 1
models:
  - {name: mlp, kind: residual_mlp, layers: 3, hidden: 16, expansion: 2, batch: [8, 32]}
strategies:
  - {name: files, with: [{offload_params: {to: disk}}, {optimizer: {kind: adamw, in_backward: true}}]}
  - {name: files+accumulate, with: [{offload_params: {to: disk}}, {optimizer: {kind: adamw, in_backward: true}}, {accumulate: {micro_batches: 2}}]}
  - {name: after-backward, with: [{offload_params: {to: disk}}, {optimizer: {kind: adamw}}]}
";
    let dir = tempfile::tempdir().unwrap();
    let (out, json) = bench(dir.path(), "params", yaml);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = Report::from_json(&std::fs::read_to_string(&json).unwrap())
        .unwrap_or_else(|e| panic!("{e}\n{stdout}"));
    for strategy in ["files", "files+accumulate"] {
        let c = case(&report, strategy);
        assert_eq!(c.status, Status::Ok, "{strategy}: {:?}", c.error);
        assert_eq!(
            c.parameter_bytes,
            Some(4),
            "{strategy}: only the NaN placeholder"
        );
        // AdamW's two moments of every value, on the device between steps.
        assert_eq!(c.optimizer_state_bytes, Some(2 * 4 * NUMEL), "{strategy}");
    }
    let after = case(&report, "after-backward");
    assert_eq!(after.status, Status::Unavailable);
    assert!(
        after
            .error
            .as_deref()
            .is_some_and(|e| e.contains("add in_backward: true")),
        "{after:?}"
    );
    let one = Suite::from_yaml(&yaml.replace("world_size: 1\n", ""), "params.yaml").unwrap();
    let why = availability(&one.models[0], &one.strategies[0], None).unwrap_err();
    assert!(why.to_string().contains("world_size: 1"), "{why}");
}
