//! `fit` and `auto_batch` in the harness and the CLI: what each keeps of the batch,
//! budgets met to the byte, the JSON of `memsave fit`, and bad input.
use crate::common::memsave;
use memsave_bench::{run_suite, RunOptions, Status, Suite};
use serial_test::{parallel, serial};
use std::path::Path;
use std::process::Output;

const MODEL: &str =
    "  - {name: mlp, kind: residual_mlp, layers: 4, hidden: 32, expansion: 2, batch: [16, 16]}\n";

fn suite(strategies: &str) -> Suite {
    let yaml = format!(
        "suite: fit-test\nwarmup: 0\nrepeats: 1\nmodels:\n{MODEL}strategies:\n{strategies}"
    );
    Suite::from_yaml(&yaml, "fit-test.yaml").unwrap()
}

#[test]
#[serial]
fn halving_shrinks_the_batch_and_fit_keeps_it_within_the_same_budget() {
    let base = run_suite(&suite("  - baseline\n"), &RunOptions::default()).unwrap();
    let peak = base.cases[0].peak_bytes.unwrap();
    let budget = peak * 45 / 100;
    // auto_batch's budget is a capacity above what the process holds (the parameters
    // and the batch); fit's is the whole device: the same device is that and those.
    let least = memsave_bench::least_memory(
        &suite("  - baseline\n").models[0],
        &memsave_fit::FitRequest::new(1),
        None,
    );
    let device = budget + least.parameters.unwrap() + least.step_batch.unwrap();
    let strategies = format!(
        "  - baseline\n  - auto_batch: {{policy: halving, budget: {budget}B}}\n  - fit: {{budget: {device}B}}\n"
    );
    let report = run_suite(&suite(&strategies), &RunOptions::default()).unwrap();
    let [plain, halving, fit] = &report.cases[..] else {
        panic!("three cases expected");
    };
    assert_eq!(plain.global_batch, Some(16));
    assert_eq!(plain.tries, None);

    assert_eq!(halving.status, Status::Ok, "{:?}", halving.error);
    let batch = halving.global_batch.unwrap();
    assert!(
        batch < 16,
        "halving kept the batch of 16 at 45% of its peak"
    );
    assert_eq!(16 % batch, 0, "halved from 16: {batch}");
    assert_eq!(
        halving.tries,
        Some((16 / batch).trailing_zeros() as usize + 1)
    );
    assert!(halving.peak_bytes.unwrap() <= budget);
    assert!(
        !halving.has_baseline,
        "another batch: no gradient comparison"
    );

    assert_eq!(fit.status, Status::Ok, "{:?}", fit.error);
    assert_eq!(fit.global_batch, Some(16), "fit keeps the global batch");
    assert_eq!(fit.tries, Some(1));
    assert!(
        fit.peak_bytes.unwrap() <= budget,
        "{} > {budget}",
        fit.peak_bytes.unwrap()
    );
    let on_device = fit.fit_device_peak_bytes.unwrap();
    assert!(on_device <= device, "{on_device} > {device}");
    // The parameters and the batch are in fit's figure (not in the table's).
    assert!(on_device > device - budget, "{on_device}");
    // Lossless levers only: the gradients of the whole batch, up to the order of the
    // micro-batches' sums.
    assert!(fit.grad_rel_l2.unwrap() < 1e-5, "{:?}", fit.grad_rel_l2);
    let table = report.to_table();
    assert!(table.contains("16 (1 try)"), "{table}");
    let chosen = fit.choice.as_deref().unwrap();
    assert!(
        table.contains(&format!(
            "mlp / fit(budget={device}B): chose {chosen}, measured by fit at {} on the device",
            memsave_meter::Bytes(on_device)
        )),
        "{table}"
    );
}

/// `fit` combined with `optimizer` steps that optimizer: its state is measured, the
/// plain step with the same optimizer is the reference, and the choice fits the
/// budget; `fit` with another technique is refused.
#[test]
#[serial]
fn fit_with_an_optimizer_steps_it_within_the_budget() {
    // A warm-up step makes the state before the measured one, as fit's runs do.
    let suite = |strategies: &str| {
        let yaml = format!(
            "suite: fit-opt\nwarmup: 1\nrepeats: 1\nmodels:\n{MODEL}strategies:\n{strategies}"
        );
        Suite::from_yaml(&yaml, "fit-opt.yaml").unwrap()
    };
    let adamw = "  - {name: adamw, with: [{optimizer: {kind: adamw}}]}\n";
    let base = run_suite(&suite(adamw), &RunOptions::default()).unwrap();
    let plain = &base.cases[0];
    assert_eq!(plain.status, Status::Ok, "{:?}", plain.error);
    let (peak, state) = (
        plain.peak_bytes.unwrap(),
        plain.optimizer_state_bytes.unwrap(),
    );
    assert!(state > 0);
    let budget = peak / 2;
    let strategies = format!(
        "{adamw}  - {{name: fit-adamw, with: [{{fit: {{budget: {budget}B}}}}, {{optimizer: {{kind: adamw}}}}]}}\n"
    );
    let report = run_suite(&suite(&strategies), &RunOptions::default()).unwrap();
    let fit = &report.cases[1];
    assert_eq!(fit.status, Status::Ok, "{:?}", fit.error);
    assert!(
        fit.peak_bytes.unwrap() <= budget,
        "{:?} > {budget}",
        fit.peak_bytes
    );
    // The case stepped AdamW (a case without an optimizer has no state figure).
    assert!(fit.optimizer_state_bytes.is_some(), "{:?}", fit.choice);
    assert_eq!(fit.tries, Some(1));
    let err =
        error_of("  - {with: [{fit: {budget: 1MiB}}, {optimizer: {kind: sgd}}, safe_residual]}\n");
    assert!(err.contains("combines only with optimizer"), "{err}");
}

#[test]
#[serial]
fn halving_without_a_budget_says_what_it_needs() {
    let report = run_suite(
        &suite("  - auto_batch: {policy: halving}\n"),
        &RunOptions::default(),
    )
    .unwrap();
    let case = &report.cases[0];
    assert_eq!(case.status, Status::Error);
    assert!(
        case.error
            .as_deref()
            .unwrap()
            .contains("auto_batch needs a budget"),
        "{:?}",
        case.error
    );
}

fn error_of(strategies: &str) -> String {
    let yaml = format!("suite: bad\nmodels:\n{MODEL}strategies:\n{strategies}");
    match Suite::from_yaml(&yaml, "bad.yaml") {
        Ok(s) => panic!("accepted {s:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
#[serial]
fn bad_entries_are_errors_at_their_place() {
    let e = error_of("  - auto_batch: {policy: doubling}\n");
    assert!(e.starts_with("bad.yaml:5:"), "{e}");
    assert!(
        e.contains("unknown policy 'doubling', expected halving"),
        "{e}"
    );
    let e = error_of("  - fit: {budget: 0}\n");
    assert!(e.starts_with("bad.yaml:5:"), "{e}");
    assert!(e.contains("positive") || e.contains("zero"), "{e}");
    let e = error_of("  - fit: {budget: 1MiB, allow: [fp4]}\n");
    assert!(e.contains("unknown lever 'fp4'"), "{e}");
    assert!(e.contains("micro_batches"), "the levers listed: {e}");
    let e = error_of("  - {with: [{fit: {budget: 1MiB}}, {checkpoint: {segments: 2}}]}\n");
    assert!(e.contains("fit chooses every lever itself"), "{e}");
    let e = error_of("  - fit\n");
    assert!(e.contains("needs arguments"), "{e}");
}

/// `memsave fit ARGS --json fit.json` in `dir`, which must succeed; its JSON.
fn fit_json(args: &[&str], dir: &Path) -> serde_json::Value {
    let args: Vec<&str> = ["fit"]
        .iter()
        .chain(args)
        .chain(&["--json", "fit.json"])
        .copied()
        .collect();
    let out = memsave(&args, dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(dir.join("fit.json")).unwrap()).unwrap()
}

#[test]
#[serial]
fn the_cli_writes_the_choice_and_its_measurement() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(
        &[
            "fit", "quick", "--model", "mlp", "--budget", "64KiB", "--json", "fit.json", "--plot",
            "fit.svg",
        ],
        dir.path(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("choice: "), "{stdout}");
    assert!(stdout.contains("Pareto front"), "{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("fit.json")).unwrap())
            .unwrap();
    assert_eq!(json["model"], "mlp");
    assert_eq!(json["budget_bytes"], 64 * 1024);
    assert_eq!(json["global_batch"], 4);
    for key in [
        "predicted_peak_bytes",
        "measured_peak_bytes",
        "predicted_step_time_s",
        "measured_step_time_s",
        "tries",
    ] {
        assert!(json[key].is_number(), "{key}: {}", json[key]);
    }
    assert!(json["choice"]["strategy"].is_string());
    assert!(json["choice"]["micro_batches"].as_u64().unwrap() >= 1);
    assert!(json["front"].as_array().is_some_and(|f| !f.is_empty()));
    assert!(json["measured_peak_bytes"].as_u64().unwrap() <= 64 * 1024);
    // The JSON says what the budget counts, and where the bytes were at the peak.
    let counts = json["budget_counts"].as_str().unwrap();
    for part in ["parameters", "optimizer's state", "input", "gradients"] {
        assert!(counts.contains(part), "{part}: {counts}");
    }
    let parts: u64 = ["parameters", "optimizer_state", "input", "step"]
        .iter()
        .map(|k| json["breakdown"][k].as_u64().unwrap())
        .sum();
    assert_eq!(Some(parts), json["measured_peak_bytes"].as_u64());
    assert!(json["breakdown"]["parameters"].as_u64().unwrap() > 0);
    let svg = std::fs::read_to_string(dir.path().join("fit.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("budget"));
}

/// `micro-batches` (issue #25): the lever fit needs allowed before it splits a batch whose
/// samples a BatchNorm in training mode couples. Accepted on the command line and in a
/// suite; on a model without such an op it changes nothing.
#[test]
#[serial]
fn the_micro_batches_lever_is_accepted_in_the_cli_and_the_suite() {
    let dir = tempfile::tempdir().unwrap();
    let with = fit_json(
        &[
            "quick",
            "--model",
            "mlp",
            "--budget",
            "64KiB",
            "--allow",
            "micro-batches",
        ],
        dir.path(),
    );
    assert!(with["measured_peak_bytes"].as_u64().unwrap() <= 64 * 1024);
    assert!(with["choice"]["micro_batches"].as_u64().unwrap() >= 1);
    let suite = suite("  - fit: {budget: 1MiB, allow: [micro_batches, bf16]}\n");
    assert_eq!(suite.strategies.len(), 1);
}

#[test]
#[serial]
fn the_cli_rejects_bad_input_with_exit_code_2() {
    let dir = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (
            &["fit", "quick", "--model", "mlp", "--budget", "0"][..],
            "positive",
        ),
        (
            &["fit", "quick", "--model", "mlp", "--budget", "lots"][..],
            "lots",
        ),
        (
            &[
                "fit",
                "quick",
                "--model",
                "mlp",
                "--budget",
                "1MiB",
                "--global-batch",
                "0",
            ][..],
            "global-batch",
        ),
        (
            &["fit", "quick", "--model", "nope", "--budget", "1MiB"][..],
            "no model 'nope'",
        ),
        (
            &[
                "fit", "quick", "--model", "mlp", "--budget", "1MiB", "--allow", "fp4",
            ][..],
            "fp4",
        ),
    ] {
        let out = memsave(args, dir.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
#[serial]
fn the_cli_names_the_smallest_budget_when_nothing_fits() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(
        &["fit", "quick", "--model", "mlp", "--budget", "64B"],
        dir.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no configuration fits 64 B"), "{err}");
    assert!(err.contains("give a budget of at least"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Past about 32768 elements libtorch's reductions split their work between
/// threads, with scratch buffers of their own: a chain 256 wide on 40 rows makes a
/// few allocations more at 4 examples than at 2, which are the sizes `fit` probes
/// for a batch of 16. Every configuration `--exhaustive` runs must still be
/// predicted within 5% of its measured peak, the plain step included (its peak moves
/// from the end of backward to its start as the batch grows).
#[test]
#[serial]
fn peaks_are_predicted_within_5_percent_where_small_runs_allocate_differently() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("chain.yaml"),
        "suite: chain\nthreads: 2\nmodels:\n  - {name: chain, kind: residual_linear, layers: 4, hidden: 256, batch: [16, 40]}\nstrategies:\n  - baseline\n",
    )
    .unwrap();
    let json = fit_json(
        &[
            "chain.yaml",
            "--model",
            "chain",
            "--budget",
            "64MiB",
            "--exhaustive",
        ],
        dir.path(),
    );
    assert_eq!(json["tries"], 1);
    let mut checked = 0;
    for c in json["candidates"].as_array().unwrap() {
        let (Some(predicted), Some(measured)) = (
            c["predicted_peak_bytes"].as_u64(),
            c["measured_peak_bytes"].as_u64(),
        ) else {
            continue;
        };
        let error = (predicted as f64 - measured as f64).abs() / measured as f64;
        assert!(
            error <= 0.05,
            "{}: predicted {predicted}, measured {measured}",
            c["choice"]["strategy"]
        );
        checked += 1;
    }
    let strategies: Vec<&str> = json["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["choice"]["strategy"].as_str())
        .collect();
    assert!(strategies.contains(&"baseline"), "{strategies:?}");
    assert!(checked >= 4, "only {checked} configurations measured");
}

/// `fit`'s budget is the whole device: the plain step's predicted peak is the harness's
/// `peak_bytes` (above what persists from step to step, after its warm-up) plus the
/// parameters, the optimizer's state and the input, to the byte; a budget with room
/// for that and fit's margin of the step's own bytes is met by the plain step, and one
/// without room for the state is not.
#[test]
#[serial]
fn fit_counts_the_optimizer_state_and_the_parameters_the_harness_leaves_out() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "suite: opt\nwarmup: 1\nrepeats: 1\nmodels:\n  - {name: mlp, kind: residual_mlp, layers: 3, hidden: 64, expansion: 2, batch: [8, 8]}\nstrategies:\n  - {name: adamw, with: [{optimizer: {kind: adamw}}]}\n";
    std::fs::write(dir.path().join("opt.yaml"), yaml).unwrap();
    let report = run_suite(
        &Suite::from_yaml(yaml, "opt.yaml").unwrap(),
        &RunOptions::default(),
    )
    .unwrap();
    let case = &report.cases[0];
    assert_eq!(case.status, Status::Ok, "{:?}", case.error);
    let peak = case.peak_bytes.unwrap();
    let state = case.optimizer_state_bytes.unwrap();
    assert!(state > 0);
    // 3 blocks of Linear(64, 128) and Linear(128, 64) with biases, f32.
    let parameters = 3 * (64 * 128 + 128 + 128 * 64 + 64) * 4;
    assert_eq!(state, 2 * parameters, "AdamW's two moments");
    let input = Suite::from_yaml(yaml, "opt.yaml").unwrap().models[0]
        .batch_bytes()
        .unwrap();
    let whole = peak + parameters + state + input;
    // Room for the peak with fit's 5% margin of the step's own bytes.
    let budget = whole + peak / 18;
    let json = fit_json(
        &[
            "opt.yaml",
            "--model",
            "mlp",
            "--budget",
            &format!("{budget}B"),
        ],
        dir.path(),
    );
    let plain = json["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["choice"]["strategy"] == "baseline")
        .expect("the plain step is a candidate");
    assert_eq!(plain["predicted_peak_bytes"].as_u64(), Some(whole));
    assert_eq!(plain["predicted_fits"], true);
    assert!(json["measured_peak_bytes"].as_u64().unwrap() <= budget);
    assert_eq!(json["tries"], 1);
    let breakdown = &json["breakdown"];
    assert_eq!(
        breakdown["parameters"].as_u64(),
        Some(parameters),
        "{breakdown}"
    );
    assert_eq!(
        breakdown["optimizer_state"].as_u64(),
        Some(state),
        "{breakdown}"
    );
    // Without room for the state, the plain step does not fit.
    let json = fit_json(
        &[
            "opt.yaml",
            "--model",
            "mlp",
            "--budget",
            &format!("{}B", whole - state / 2),
        ],
        dir.path(),
    );
    assert_ne!(json["choice"]["strategy"], "baseline", "{}", json["choice"]);
}

/// `memsave fit` on a suite of one model `m`, with `extra` suite lines.
fn fit_small(dir: &Path, model: &str, extra: &str, args: &[&str]) -> Output {
    std::fs::write(
        dir.join("m.yaml"),
        format!("suite: m\n{extra}models:\n  - {{name: m, {model}}}\nstrategies:\n  - baseline\n"),
    )
    .unwrap();
    let mut all = vec!["fit", "m.yaml", "--model", "m"];
    all.extend(args);
    memsave(&all, dir)
}

/// Asserts `stderr` is one `error:` line without C++ frames or a panic.
fn assert_one_error_line(stderr: &str) {
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for needle in ["frame #", "Exception raised from", "panicked"] {
        assert!(!stderr.contains(needle), "{needle}: {stderr}");
    }
}

#[test]
#[serial]
fn a_model_over_the_suite_s_memory_limit_is_refused_before_building() {
    // 4 × (512 × 512 + 512) f32 parameters: 4,202,496 bytes, 4.01 MiB; with the
    // largest gradient (1 MiB) and the input (16 KiB), 5,267,456 bytes, 5.02 MiB.
    let dir = tempfile::tempdir().unwrap();
    let out = fit_small(
        dir.path(),
        "kind: residual_linear, layers: 4, hidden: 512, batch: [8]",
        "memory_limit: 2MiB\n",
        &["--budget", "8MiB"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_one_error_line(&err);
    assert!(err.contains("model 'm' needs at least 5.02 MiB"), "{err}");
    assert!(err.contains("parameters 4.01 MiB"), "{err}");
    assert!(
        err.contains("more than the suite's memory_limit of 2.00 MiB"),
        "{err}"
    );
    assert!(err.contains("nothing was built"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
#[serial]
fn the_issue_s_four_billion_parameters_are_refused_at_once_with_their_bytes() {
    // 60 × (8192 × 8192 + 8192) = 4,027,023,360 parameters, just under the limit:
    // 16,108,093,440 bytes in f32, 15.00 GiB.
    let dir = tempfile::tempdir().unwrap();
    let out = fit_small(
        dir.path(),
        "kind: residual_linear, layers: 60, hidden: 8192, batch: [4]",
        "memory_limit: 8GiB\n",
        &["--budget", "1GiB"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_one_error_line(&err);
    assert!(err.contains("parameters 15.00 GiB"), "{err}");
    assert!(err.contains("memory_limit of 8.00 GiB"), "{err}");
}

#[test]
#[serial]
fn a_budget_below_the_parameters_and_the_largest_gradient_is_refused_before_building() {
    // 4 × (512 × 512 + 512) f32 parameters: 4,202,496 bytes; each Linear(512, 512)
    // weight's gradient is 512 × 512 × 4 bytes = 1 MiB; the input 8 × 512 × 4 bytes
    // = 16 KiB: 5,267,456 bytes, 5.0234 MiB, on the device in any step (shown rounded
    // up, 5.03 MiB, so that the budget it names is enough when copied).
    let dir = tempfile::tempdir().unwrap();
    let out = fit_small(
        dir.path(),
        "kind: residual_linear, layers: 4, hidden: 512, batch: [8]",
        "",
        &["--budget", "5MiB"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_one_error_line(&err);
    assert!(err.contains("no configuration fits 5.00 MiB"), "{err}");
    assert!(
        err.contains("parameters 4.01 MiB, largest gradient 1.00 MiB, batch 16.00 KiB"),
        "{err}"
    );
    assert!(err.contains("give a budget of at least 5.03 MiB"), "{err}");
    assert!(err.contains("nothing was built"), "{err}");
}

#[test]
#[serial]
fn a_global_batch_over_the_suite_s_limits_is_refused_in_the_suite_s_words() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(
        &[
            "fit",
            "quick",
            "--model",
            "mlp",
            "--budget",
            "1MiB",
            "--global-batch",
            "1000000000",
        ],
        dir.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_one_error_line(&err);
    assert_eq!(
        err.trim_end(),
        "error: --global-batch 1000000000: must be at most 16777216, got 1000000000"
    );
    // Within the dimension's limit, over the input's: the suite's message for the
    // same model with that batch.
    let suite_error = Suite::from_yaml(
        "suite: s\nmodels:\n  - {name: seed-residual, kind: residual_linear, layers: 10, hidden: 512, batch: [16000000, 100]}\nstrategies:\n  - baseline\n",
        "s.yaml",
    )
    .unwrap_err()
    .to_string();
    // `s.yaml:3:5: models[0]: model 'seed-residual': ...`
    let (_, words) = suite_error.split_once("models[0]: ").unwrap();
    let out = memsave(
        &[
            "fit",
            "seed",
            "--model",
            "seed-residual",
            "--budget",
            "40MiB",
            "--global-batch",
            "16000000",
        ],
        dir.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_one_error_line(&err);
    assert!(
        words.contains("an input of 819200000000 elements"),
        "{words}"
    );
    assert_eq!(
        err.trim_end(),
        format!("error: --global-batch 16000000: {words}")
    );
}

#[test]
#[serial]
fn fit_says_what_it_is_doing_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(
        &["fit", "quick", "--model", "mlp", "--budget", "64KiB"],
        dir.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    // Not a terminal: a line per phase, the first split first.
    assert_eq!(
        lines.first().copied(),
        Some("fit: predicting 1 micro-batch of 4 from small runs"),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("fit: running ")
                && l.ends_with(" at its real size under the budget")),
        "{err}"
    );
    assert!(lines.iter().all(|l| l.starts_with("fit: ")), "{err}");
}

#[test]
#[serial]
fn the_largest_parameter_is_the_widest_weight_built() {
    for model in [
        "{name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [2]}",
        "{name: a, kind: residual_mlp, layers: 2, hidden: 8, expansion: 3, batch: [2]}",
        "{name: a, kind: transformer, layers: 2, hidden: 8, heads: 2, batch: [2, 3]}",
    ] {
        let suite = Suite::from_yaml(
            &format!("suite: s\nmodels:\n  - {model}\nstrategies:\n  - baseline\n"),
            "s.yaml",
        )
        .unwrap();
        let spec = &suite.models[0];
        let built = memsave_bench::models::Model::build(spec, tch::Device::Cpu).unwrap();
        let widest = built.params().iter().map(|p| p.numel() as u64).max();
        assert_eq!(spec.largest_parameter(), widest, "{model}");
    }
}

/// The one model of `yaml`'s models list, parsed.
fn model_of(model: &str) -> memsave_bench::ModelSpec {
    let yaml = format!("suite: s\nmodels:\n  - {model}\nstrategies:\n  - baseline\n");
    Suite::from_yaml(&yaml, "s.yaml").unwrap().models.remove(0)
}

const LINEAR: &str = "{name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}";

/// SGD with momentum keeps one buffer per parameter (at the state's precision, or one
/// byte a value with `int8_state` allowed); without momentum none. The model has
/// 2 × (8 × 8 + 8) = 144 parameters: 576 bytes in f32.
#[test]
fn least_memory_counts_sgd_s_momentum_buffer() {
    use memsave_bench::{least_memory, OptimizerKind, OptimizerSpec, StatePrecision};
    let spec = model_of(LINEAR);
    let request = memsave_fit::FitRequest::new(1 << 20);
    let mut int8_allowed = memsave_fit::FitRequest::new(1 << 20);
    int8_allowed.allow.int8_state = true;
    let sgd = |momentum: Option<f64>, state| OptimizerSpec {
        kind: OptimizerKind::Sgd,
        momentum,
        state,
        ..Default::default()
    };
    for (optimizer, request, state_bytes) in [
        (sgd(Some(0.9), StatePrecision::F32), &request, 576),
        (sgd(Some(0.9), StatePrecision::Bf16), &request, 288),
        (sgd(Some(0.9), StatePrecision::Int8), &request, 144),
        (sgd(Some(0.9), StatePrecision::F32), &int8_allowed, 144),
        (sgd(None, StatePrecision::F32), &request, 0),
        (sgd(Some(0.0), StatePrecision::F32), &request, 0),
        (sgd(None, StatePrecision::F32), &int8_allowed, 0),
        // AdamW: two moments.
        (OptimizerSpec::default(), &request, 1152),
        (OptimizerSpec::default(), &int8_allowed, 288),
    ] {
        let least = least_memory(&spec, request, Some(&optimizer));
        assert_eq!(
            least.optimizer_state,
            Some(state_bytes),
            "{optimizer:?}, int8_state allowed: {}",
            request.allow.int8_state
        );
        assert_eq!(least.parameters, Some(576));
        assert_eq!(least.weights_copy, Some(576));
        // The largest parameter (an 8 × 8 weight): 64 of the 144 values' state.
        assert_eq!(least.largest_state, Some(state_bytes / 144 * 64));
        // On one process the state may wait in files but for the largest parameter's
        // (64 values: one chunk), and the parameters too but for the largest (256
        // bytes, held while it runs); on two ranks each holds half of it all (and of
        // the parameters and batch). The gradient of that weight is 256 bytes, the
        // batch 128.
        assert_eq!(
            least.in_budget(1),
            Some(256 + 256 + state_bytes / 144 * 64 + 128)
        );
        // With the parameters kept on the device (--no-offload-params), all of them.
        let kept = memsave_fit::FitRequest {
            offload_params: false,
            ..request.clone()
        };
        assert_eq!(
            least_memory(&spec, &kept, Some(&optimizer)).in_budget(1),
            Some(576 + 256 + state_bytes / 144 * 64 + 128)
        );
        assert_eq!(least.in_budget(2), Some(288 + 256 + state_bytes / 2 + 64));
    }
    let none = least_memory(&spec, &request, None);
    assert_eq!(none.optimizer_state, Some(0));
    assert_eq!(none.weights_copy, Some(0));
}

/// The batch counts at the bytes of its dtypes: the harness's f32 input, the zoo's
/// f32 images with an int64 label each, LLaMA's int64 token ids with their int64 next
/// tokens as target.
#[test]
fn least_memory_counts_the_batch_at_its_dtypes_bytes() {
    use memsave_bench::least_memory;
    let request = memsave_fit::FitRequest::new(1 << 20);
    // [4, 8] f32: 128 bytes.
    let linear = least_memory(&model_of(LINEAR), &request, None);
    assert_eq!(linear.batch, Some(128));
    // 3 × 4 token ids and 3 × 4 targets, 8 bytes each: 96 + 96.
    let llama = model_of(
        "{name: l, kind: llama, vocab: 16, dim: 8, layers: 1, heads: 2, seq: 4, batch: 3}",
    );
    assert_eq!(least_memory(&llama, &request, None).batch, Some(192));
    // A global batch of 6 is a new batch besides the suite's: 6 × 4 × 8 × 2 = 384 more.
    let mut global = memsave_fit::FitRequest::new(1 << 20);
    global.global_batch = Some(6);
    assert_eq!(least_memory(&llama, &global, None).batch, Some(576));
    // 2 images of 3 × 8 × 8 f32 (1536 bytes) and 2 int64 labels (16 bytes).
    let vit = model_of(
        "{name: v, kind: vit, image: [3, 8, 8], patch: 4, dim: 8, layers: 1, heads: 2, mlp: 16, classes: 5, batch: 2}",
    );
    assert_eq!(least_memory(&vit, &request, None).batch, Some(1552));
}

#[test]
#[parallel]
fn a_global_batch_refused_by_fit_keeps_the_suite_s_error_as_its_cause() {
    let suite = Suite::from_yaml(
        &format!("suite: s\nmodels:\n  - {LINEAR}\nstrategies:\n  - baseline\n"),
        "s.yaml",
    )
    .unwrap();
    let mut request = memsave_fit::FitRequest::new(1 << 20);
    request.global_batch = Some(0);
    let e = memsave_bench::fit_model(&suite, "a", &request, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a global batch of 0: must be positive, got 0"
    );
    let cause = std::error::Error::source(&e).expect("the suite's error as the cause");
    assert_eq!(
        cause.downcast_ref::<memsave_bench::ModelSpecError>(),
        Some(&memsave_bench::ModelSpecError::BatchNotPositive { batch: 0 })
    );
}

/// `memsave fit` steps the suite's first optimizer with its hyperparameters (the
/// state's precision, its placement and the step in backward are fit's to choose).
#[test]
fn fit_takes_the_suite_s_optimizer_with_its_hyperparameters() {
    use memsave_bench::{OptimizerKind, OptimizerSpec};
    let suite = |strategies: &str| {
        Suite::from_yaml(
            &format!("suite: s\nmodels:\n  - {LINEAR}\nstrategies:\n{strategies}"),
            "s.yaml",
        )
        .unwrap()
    };
    let sgd = suite(
        "  - baseline\n  - {name: o, with: [{optimizer: {kind: sgd, lr: 0.1, momentum: 0.9, weight_decay: 0.01, state: bf16, in_backward: true}}]}\n  - optimizer: {kind: adamw}\n",
    );
    assert_eq!(
        memsave_bench::fit::suite_optimizer(&sgd),
        Some(OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr: Some(0.1),
            momentum: Some(0.9),
            weight_decay: Some(0.01),
            ..Default::default()
        })
    );
    let adamw = suite(
        "  - optimizer: {kind: adamw, lr: 3e-4, betas: [0.9, 0.95], eps: 1e-6, weight_decay: 0.1, placement: cpu}\n",
    );
    assert_eq!(
        memsave_bench::fit::suite_optimizer(&adamw),
        Some(OptimizerSpec {
            kind: OptimizerKind::Adamw,
            lr: Some(3e-4),
            betas: Some((0.9, 0.95)),
            eps: Some(1e-6),
            weight_decay: Some(0.1),
            ..Default::default()
        })
    );
    assert_eq!(
        memsave_bench::fit::suite_optimizer(&suite("  - baseline\n")),
        None
    );
}

/// The CLI hands the suite's SGD momentum to fit: the momentum buffer (576 bytes) is
/// counted in what the model needs before its first step, over the suite's
/// memory_limit of 1000 bytes; without it the model would need 960 bytes.
#[test]
#[serial]
fn the_cli_counts_the_suite_s_sgd_momentum_before_building() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("m.yaml"),
        format!("suite: m\nmemory_limit: 1000B\nmodels:\n  - {LINEAR}\nstrategies:\n  - optimizer: {{kind: sgd, lr: 0.1, momentum: 0.9}}\n"),
    )
    .unwrap();
    let out = memsave(
        &["fit", "m.yaml", "--model", "a", "--budget", "1KiB"],
        dir.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_one_error_line(&err);
    // 576 parameters + 576 momentum + 256 largest gradient + 128 input = 1536 bytes.
    assert!(
        err.contains(
            "model 'a' needs at least 1.50 KiB before its first step (parameters 576 B, \
             optimizer state 576 B, largest gradient 256 B, batch 128 B), more than the \
             suite's memory_limit of 1000 B"
        ),
        "{err}"
    );
}

/// A suite's `fit: {allow: [...]}` and `memsave fit --allow` name the same typed
/// levers, which turn into fit's `Allow` in one place.
/// `uniform: true` is read, named in the strategy's name, and absent by default.
#[test]
fn a_suite_s_fit_may_ask_for_uniform_levers() {
    use memsave_bench::Technique;
    let suite = suite(
        "  - fit: {budget: 1MiB, uniform: true}\n  - fit: {budget: 1MiB, allow: [bf16], uniform: true}\n  - fit: {budget: 1MiB}\n",
    );
    let names: Vec<&str> = suite.strategies.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "fit(budget=1MiB, uniform)",
            "fit(budget=1MiB, allow=bf16, uniform)",
            "fit(budget=1MiB)"
        ]
    );
    let uniform: Vec<bool> = suite
        .strategies
        .iter()
        .map(|s| match &s.techniques[0] {
            Technique::Fit(spec) => spec.uniform,
            t => panic!("a fit strategy: {t:?}"),
        })
        .collect();
    assert_eq!(uniform, [true, true, false]);
}

#[test]
fn the_suite_s_allow_and_the_cli_s_allow_are_the_same_levers() {
    use clap::ValueEnum;
    use memsave_bench::{FitLever, Technique};
    let suite =
        suite("  - fit: {budget: 1MiB, allow: [micro_batches, bf16, int8_state, compress]}\n");
    let Technique::Fit(spec) = &suite.strategies[0].techniques[0] else {
        panic!("a fit strategy: {:?}", suite.strategies[0]);
    };
    assert_eq!(
        spec.allow,
        [
            FitLever::MicroBatches,
            FitLever::Bf16,
            FitLever::Int8State,
            FitLever::Compress
        ]
    );
    assert_eq!(spec.allowed(), memsave_fit::Allow::all());
    assert_eq!(
        suite.strategies[0].name,
        "fit(budget=1MiB, allow=micro_batches+bf16+int8_state+compress)"
    );
    assert_eq!(
        FitLever::allow(&[FitLever::Bf16]),
        memsave_fit::Allow {
            bf16: true,
            ..Default::default()
        }
    );
    for (cli, suite_name, lever) in [
        ("bf16", "bf16", FitLever::Bf16),
        ("compress", "compress", FitLever::Compress),
        ("int8-state", "int8_state", FitLever::Int8State),
        ("micro-batches", "micro_batches", FitLever::MicroBatches),
    ] {
        assert_eq!(FitLever::from_str(cli, false), Ok(lever));
        assert_eq!(lever.as_str(), suite_name);
    }
}

/// `memsave fit --help` says what the budget counts.
#[test]
#[parallel]
fn fit_s_help_says_the_budget_is_the_whole_device() {
    let dir = tempfile::tempdir().unwrap();
    let out = memsave(&["fit", "--help"], dir.path());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for part in [
        "the whole device",
        "the parameters, the optimizer's state, the input",
        "per rank",
    ] {
        assert!(help.contains(part), "{part}: {help}");
    }
}
