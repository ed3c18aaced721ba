//! The bundled quick suite through the library, with exact bytes from formulas.
use memsave_bench::{bundled, run_suite, CaseResult, Report, RunOptions, Status, Suite};
use serial_test::serial;

fn quick() -> Suite {
    Suite::from_yaml(bundled("quick").unwrap().source, "quick.yaml").unwrap()
}

fn case<'r>(report: &'r Report, model: &str, strategy: &str) -> &'r CaseResult {
    report
        .cases
        .iter()
        .find(|c| c.model == model && c.strategy == strategy)
        .unwrap_or_else(|| panic!("no case {model}/{strategy}"))
}

#[test]
#[serial]
fn quick_suite_measures_exact_bytes_and_survives_failing_cases() {
    let suite = quick();
    let report = run_suite(&suite, &RunOptions::default()).unwrap();
    assert_eq!(report.suite, "quick");
    assert_eq!(report.device, "cpu");
    assert_eq!(report.libtorch, "2.13.0");
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
    }
    assert_eq!(
        case(&report, "linear", "safe_residual").peak_bytes,
        base.peak_bytes
    );

    // Accumulation: the full-batch gradient up to rounding, half the activations.
    let acc = case(&report, "linear", "accumulate(micro_batches=2)");
    assert_eq!(acc.status, Status::Ok);
    assert!(acc.grad_max_abs_diff.unwrap() < 1e-5);
    let first_micro = l * activation / 2;
    assert!(acc.retained_after_forward_bytes.unwrap() >= first_micro);

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
