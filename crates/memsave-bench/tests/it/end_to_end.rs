//! The bundled quick suite through the library, with exact bytes from formulas.
use crate::common::case;
use memsave_bench::{bundled, run_suite, Report, RunOptions, Status, Suite};
use serial_test::serial;

fn quick() -> Suite {
    Suite::from_yaml(bundled("quick").unwrap().source, "quick.yaml").unwrap()
}

/// The libtorch version, known independently of the bridge: the version this project
/// pins (README, `libtorch-setup.sh`), checked against the installed package's own
/// `version.py` (or a libtorch zip's `build-version`) when `LIBTORCH` points at one.
fn expected_libtorch_version() -> &'static str {
    const PINNED: &str = "2.13.0";
    if let Ok(root) = std::env::var("LIBTORCH") {
        let root = std::path::Path::new(&root);
        for (file, prefix) in [("version.py", "__version__ = '"), ("build-version", "")] {
            let Ok(text) = std::fs::read_to_string(root.join(file)) else {
                continue;
            };
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix(prefix))
                .unwrap_or_else(|| panic!("no version in {file}"));
            let installed = line.split(['+', '\'']).next().unwrap().trim();
            assert_eq!(installed, PINNED, "the libtorch at {}", root.display());
        }
    }
    PINNED
}

#[test]
#[serial]
fn quick_suite_measures_exact_bytes_and_survives_failing_cases() {
    let suite = quick();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    assert_eq!(report.suite, "quick");
    assert_eq!(report.device, "cpu");
    assert_eq!(report.schema_version, 2);
    assert_eq!(report.libtorch_version, expected_libtorch_version());
    assert_eq!(
        report.cases.len(),
        suite.models.len() * suite.strategies.len()
    );
    // Reported in suite order.
    for (i, c) in report.cases.iter().enumerate() {
        assert_eq!(c.model, suite.models[i / suite.strategies.len()].name);
        assert_eq!(
            c.strategy,
            suite.strategies[i % suite.strategies.len()].name
        );
    }

    // The seed's network, `linear`: L = 4 layers, input [B, S, H] = [4, 8, 32].
    let (l, b, s, h) = (4u64, 4u64, 8u64, 32u64);
    let activation = b * s * h * 4;
    let params = l * (h * h + h) * 4;
    let base = case(&report, "linear", "baseline");
    assert_eq!(base.status, Status::Ok, "{:?}", base.error);
    assert_eq!(base.start_bytes, Some(params + activation));
    // Every layer saves its input for backward; the output is the last of them.
    assert_eq!(base.retained_after_forward_bytes, Some(l * activation));
    assert_eq!(base.trace.len(), l as usize);
    for (i, t) in base.trace.iter().enumerate() {
        assert_eq!(t.mark, format!("layer {i}"));
        assert_eq!(t.after - t.before, activation, "layer {i}");
        assert_eq!(t.before, params + activation + i as u64 * activation);
    }
    assert!(base.peak_bytes.unwrap() >= l * activation);
    assert!(base.is_baseline && !base.has_baseline);
    assert_eq!(base.grad_max_abs_diff, None);
    let t = base.step_time_s.unwrap();
    assert!(t.min <= t.median && t.median <= t.max && t.min > 0.0);

    // The seed's failing variants are recorded with libtorch's text, not fatal.
    for model in ["linear", "mlp", "gpt"] {
        let inplace = case(&report, model, "inplace_add");
        assert_eq!(inplace.status, Status::Error);
        assert!(
            inplace
                .error
                .as_deref()
                .unwrap()
                .contains("modified by an inplace operation"),
            "{:?}",
            inplace.error
        );
        assert_eq!(inplace.peak_bytes, None);
        let add_out = case(&report, model, "add_out");
        assert_eq!(add_out.status, Status::Error);
        assert!(add_out
            .error
            .as_deref()
            .unwrap()
            .contains("don't support automatic differentiation"));
    }

    // Cases after the failing ones still ran, from a clean start.
    for c in report.cases.iter().filter(|c| c.model == "linear") {
        if c.status == Status::Ok {
            assert_eq!(c.start_bytes, base.start_bytes, "{}", c.strategy);
        }
    }
    for strategy in [
        "safe_residual",
        "checkpoint(segments=2)",
        "checkpoint(every_layer=true)",
        "checkpoint(nested=true)",
    ] {
        let c = case(&report, "linear", strategy);
        assert_eq!(c.status, Status::Ok, "{strategy}: {:?}", c.error);
        assert_eq!(c.grad_max_abs_diff, Some(0.0), "{strategy}");
        assert!(
            c.has_baseline && !c.grad_diverged && !c.is_baseline,
            "{strategy}"
        );
    }
    assert_eq!(
        case(&report, "linear", "safe_residual").peak_bytes,
        base.peak_bytes
    );

    // Accumulation: the full-batch gradient up to rounding, half the activations.
    let acc = case(&report, "linear", "accumulate(micro_batches=2)");
    assert_eq!(acc.status, Status::Ok, "{:?}", acc.error);
    assert!(acc.grad_max_abs_diff.unwrap() < 1e-5);
    // The first micro-batch keeps half the activations; the second keeps half too,
    // plus the f32 gradients the first one accumulated (one per parameter). The
    // retained figure is the larger of the two, so it lies between these bounds, and
    // with the gradients alive it is the upper one exactly.
    let half = l * activation / 2;
    let grads = params;
    let retained = acc.retained_after_forward_bytes.unwrap();
    assert!(retained >= half, "{retained} < half the activations {half}");
    assert!(
        retained <= half + grads,
        "{retained} > half the activations {half} + gradients {grads}"
    );
    assert_eq!(retained, half + grads);

    // The loss scaler: a power-of-two scale changes no gradient bit, and its state
    // (a 0-dim f32 scale and an i32 growth tracker) lives for the case.
    let scaled = case(&report, "linear", "grad_scaler");
    assert_eq!(scaled.status, Status::Ok, "{:?}", scaled.error);
    assert_eq!(scaled.grad_max_abs_diff, Some(0.0));

    // Autocast and combinations run, with a small gradient error.
    for strategy in ["autocast(dtype=bf16)", "ckpt+bf16+accum"] {
        let c = case(&report, "gpt", strategy);
        assert_eq!(c.status, Status::Ok, "{strategy}: {:?}", c.error);
        assert!(c.grad_max_abs_diff.unwrap() < 0.05, "{strategy}");
    }

    // The renderings hold every case.
    let table = report.to_table();
    assert!(table.contains("checkpoint(every_layer=true)"));
    let csv = report.to_csv();
    assert_eq!(csv.lines().count(), report.cases.len() + 1);
    let back = Report::from_json(&report.to_json()).unwrap();
    assert_eq!(back, report);
}

#[test]
#[serial]
fn filters_select_cases_and_opt_in_models() {
    let yaml = "suite: f
warmup: 0
repeats: 2
models:
  - {name: small, kind: residual_linear, layers: 2, hidden: 8, batch: [2]}
  - {name: big, kind: residual_linear, layers: 2, hidden: 16, batch: [2], enabled: false}
strategies:
  - baseline
  - checkpoint: {segments: 2}
";
    let suite = Suite::from_yaml(yaml, "f.yaml").unwrap();
    let names = |options: &RunOptions| -> Vec<String> {
        let report = run_suite(&suite, options).unwrap();
        report
            .cases
            .iter()
            .map(|c| format!("{}/{}", c.model, c.strategy))
            .collect()
    };
    assert_eq!(
        names(&RunOptions::default()),
        ["small/baseline", "small/checkpoint(segments=2)"]
    );
    let only = RunOptions {
        filter: Some(regex::Regex::new("^big/base").unwrap()),
        ..Default::default()
    };
    assert_eq!(names(&only), ["big/baseline"]);
    // Without a baseline case the gradient error is still computed.
    let report = run_suite(
        &suite,
        &RunOptions {
            filter: Some(regex::Regex::new("checkpoint").unwrap()),
            repeats: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(report.cases.len(), 1);
    assert_eq!(report.cases[0].grad_max_abs_diff, Some(0.0));
}

#[test]
#[serial]
fn a_memory_limit_makes_cases_fail_not_the_run() {
    let yaml = "suite: l
warmup: 0
repeats: 1
memory_limit: 64KiB
models:
  - {name: m, kind: residual_linear, layers: 4, hidden: 64, batch: [64]}
strategies:
  - baseline
  - accumulate: {micro_batches: 8}
";
    let suite = Suite::from_yaml(yaml, "l.yaml").unwrap();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    assert_eq!(report.cases[0].status, Status::Error);
    assert!(
        report.cases[0].error.as_deref().unwrap().contains("memory"),
        "{:?}",
        report.cases[0].error
    );
    // The limit is lifted after the run.
    assert_eq!(memsave_meter::memory_limit(tch::Device::Cpu), None);
}

#[test]
#[serial]
fn the_baseline_is_found_by_technique_and_divergence_is_not_a_missing_baseline() {
    let yaml = "suite: refs
warmup: 1
repeats: 1
models:
  - {name: m, kind: residual_linear, layers: 12, hidden: 32, batch: [4, 8]}
strategies:
  - {name: baseline, checkpoint: {segments: 3}}
  - {name: ref, with: [baseline]}
  - grad_scaler
  - {name: overflow, grad_scaler: {init_scale: 3.0e38}}
";
    let suite = Suite::from_yaml(yaml, "refs.yaml").unwrap();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    let named_baseline = case(&report, "m", "baseline");
    let reference = case(&report, "m", "ref");
    assert_eq!(reference.status, Status::Ok, "{:?}", reference.error);
    assert!(reference.is_baseline && !named_baseline.is_baseline);
    assert_eq!(
        report.baseline("m").map(|c| c.strategy.as_str()),
        Some("ref")
    );
    assert_eq!(report.ratios(reference).0, Some(1.0));
    // The checkpoint strategy called `baseline` is compared with `ref`, not itself.
    assert!(named_baseline.has_baseline);
    assert_eq!(named_baseline.grad_max_abs_diff, Some(0.0));
    let (peak_ratio, _) = report.ratios(named_baseline);
    assert_eq!(
        peak_ratio,
        Some(named_baseline.peak_bytes.unwrap() as f64 / reference.peak_bytes.unwrap() as f64)
    );
    assert_ne!(peak_ratio, Some(1.0));

    // The scaler's state, made in the warm-up step, is alive at the measured step's
    // start: a 0-dim f32 scale and a 0-dim i32 growth tracker.
    let scaled = case(&report, "m", "grad_scaler");
    assert_eq!(scaled.status, Status::Ok, "{:?}", scaled.error);
    assert_eq!(
        scaled.start_bytes,
        Some(reference.start_bytes.unwrap() + 4 + 4)
    );
    assert_eq!(scaled.grad_max_abs_diff, Some(0.0));

    // A scale near f32's maximum overflows the scaled loss (12 residual layers make
    // it larger than 2), also after the warm-up step halved the scale: the gradients
    // are not finite, which is "diverged", not "no baseline".
    let overflow = case(&report, "m", "overflow");
    assert_eq!(overflow.status, Status::Ok, "{:?}", overflow.error);
    assert!(overflow.has_baseline && overflow.grad_diverged);
    assert_eq!(overflow.grad_max_abs_diff, None);
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let cases = json["cases"].as_array().unwrap();
    assert_eq!(json["schema_version"], 2);
    assert_eq!(cases[3]["strategy"], "overflow");
    assert_eq!(cases[3]["grad_max_abs_diff"], serde_json::Value::Null);
    assert_eq!(cases[3]["grad_diverged"], true);
    assert_eq!(cases[3]["has_baseline"], true);
    assert_eq!(cases[1]["is_baseline"], true);
    assert_eq!(cases[1]["has_baseline"], false);
    assert_eq!(cases[1]["grad_diverged"], false);
    let table = report.to_table();
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("no row {name} in\n{table}"))
            .to_owned()
    };
    // The grad diff column comes before the last three, `peak at`, `opt state`
    // (`-` here) and `batch`.
    let grad_cell = |name: &str| {
        let r = row(name);
        let cells: Vec<&str> = r.split_whitespace().collect();
        cells[cells.len() - 4].to_owned()
    };
    assert_eq!(grad_cell("overflow"), "diverged", "{table}");
    assert!(row("ref").contains("1.00x"), "{table}");
    assert_eq!(grad_cell("ref"), "-", "{table}");
    assert!(
        row("ref")
            .split_whitespace()
            .rev()
            .take(3)
            .eq(["4", "-", "backward"]),
        "{table}"
    );
}

#[test]
#[serial]
fn a_failure_while_building_a_model_is_one_readable_line() {
    // Parameters of 2 * (64*64 + 64) * 4 bytes cannot be allocated under 1 KiB.
    let yaml = "suite: small
warmup: 0
repeats: 1
memory_limit: 1KiB
models:
  - {name: m, kind: residual_linear, layers: 2, hidden: 64, batch: [4]}
strategies:
  - baseline
";
    let suite = Suite::from_yaml(yaml, "small.yaml").unwrap();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    let c = &report.cases[0];
    assert_eq!(c.status, Status::Error);
    let error = c.error.as_deref().unwrap();
    assert!(error.starts_with("building the model failed: "), "{error}");
    assert!(error.contains("memory"), "{error}");
    for noise in [
        "Exception raised from",
        "frame #",
        "\\n",
        "\\\"",
        "Torch(\"",
        "\n",
    ] {
        assert!(!error.contains(noise), "{noise:?} in {error}");
    }
    assert!(error.len() < 300, "{} characters: {error}", error.len());
    let csv = report.to_csv();
    assert_eq!(csv.lines().count(), 2, "{csv}");
}

#[test]
#[serial]
fn accumulation_runs_through_the_public_accumulator() {
    // Parameters (66,560 B) and input (16,384 B) fit in 90 KiB more than what is
    // allocated now (tensors earlier tests left), and the first micro-batch's forward
    // does too; its backward's weight gradients do not.
    let yaml = "suite: acc
warmup: 0
repeats: 1
models:
  - {name: m, kind: residual_linear, layers: 4, hidden: 64, batch: [64]}
strategies:
  - accumulate: {micro_batches: 8}
";
    let suite = Suite::from_yaml(yaml, "acc.yaml").unwrap();
    memsave_meter::install();
    let now = memsave_meter::f_memory_allocated(tch::Device::Cpu).unwrap();
    let options = RunOptions {
        memory_limit: Some(now + 90 * 1024),
        ..Default::default()
    };
    let report = run_suite(&suite, &options).unwrap();
    let c = &report.cases[0];
    assert_eq!(c.status, Status::Error);
    // `GradAccumulator`'s own error, naming the micro-batch and its samples.
    let error = c.error.as_deref().unwrap();
    assert!(
        error.starts_with("micro-batch 0 (samples 0..8): "),
        "{error}"
    );
    assert!(error.contains("memory"), "{error}");
}

#[test]
#[serial]
fn offload_is_bitwise_and_compression_reports_its_bytes_and_error() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "suite: saved
warmup: 0
repeats: 1
models:
  - {{name: m, kind: residual_linear, layers: 4, hidden: 64, batch: [32]}}
strategies:
  - baseline
  - offload: {{to: disk, dir: {dir}}}
  - compress: {{dtype: int8}}
  - offload: {{to: disk, dir: {dir}/missing}}
",
        dir = dir.path().display()
    );
    let suite = Suite::from_yaml(&yaml, "saved.yaml").unwrap();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    let activation = 32 * 64 * 4;
    let offload = &report.cases[1];
    assert_eq!(offload.status, Status::Ok, "{:?}", offload.error);
    assert_eq!(offload.grad_max_abs_diff, Some(0.0));
    assert_eq!(offload.grad_rel_l2, Some(0.0));
    // The three later layer inputs are written (the first is the suite's input, held
    // anyway), all of them before the forward ends: the harness waits for the writer
    // there, so what the forward keeps is the output alone, whatever the disk's pace.
    assert_eq!(offload.offloaded_bytes, Some(3 * activation));
    assert_eq!(
        report.cases[0].retained_after_forward_bytes,
        Some(4 * activation)
    );
    assert_eq!(offload.retained_after_forward_bytes, Some(activation));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let int8 = &report.cases[2];
    assert_eq!(int8.status, Status::Ok, "{:?}", int8.error);
    // Three inputs of 2,048 values: 1 byte each plus one f32 scale per 1,024.
    assert_eq!(
        int8.compressed_saved_bytes,
        Some(3 * (activation - (2048 + 2 * 4)))
    );
    let rel = int8.grad_rel_l2.unwrap();
    assert!(rel > 0.0 && rel < 3e-2, "{rel}");
    let missing = &report.cases[3];
    assert_eq!(missing.status, Status::Error);
    let error = missing.error.as_deref().unwrap();
    assert!(error.contains("missing: cannot be used"), "{error}");
}
