//! `fit` on a step that a micro-batch of one example spoils: BatchNorm1d on
//! `[batch, width]` gets one value per channel and libtorch writes a NaN running
//! variance. Such splits are run (with every lever allowed, or `exhaustive`) but never
//! chosen, and never the configuration the error for a budget nothing fits names.
//! The batch (64 rows of width 8) outweighs the weights, so one example per micro-batch
//! is the least memory a split reaches.
use crate::common::Norm1d;
use memsave_fit::{fit, Allow, Choice, FitError, FitRequest};
use memsave_step::{f_step, StepConfig, Workload};
use serial_test::serial;
use tch::Device;

const BATCH: i64 = 64;
const WIDTH: i64 = 8;

fn smallest_micro_batch(choice: &Choice) -> i64 {
    BATCH / choice.micro_batches as i64
}

fn plain_peak(model: &Norm1d) -> u64 {
    memsave_meter::install();
    let x = model.batch(BATCH).unwrap();
    let peak = f_step(model, &x, &StepConfig::baseline(), Device::Cpu, false, None)
        .unwrap()
        .peak_bytes;
    memsave_accum::free_grads(&model.parameters()).unwrap();
    peak
}

#[test]
#[serial]
fn one_example_splits_are_run_but_never_chosen() {
    let mut model = Norm1d::new(BATCH, WIDTH);
    let plain = plain_peak(&model);
    let mut request = FitRequest::new(plain * 6 / 10);
    request.allow = Allow {
        micro_batches: true,
        ..Allow::default()
    };
    request.exhaustive = true;
    let report = fit(&mut model, &request).unwrap_or_else(|e| panic!("fit: {e}"));
    let spoiled = report
        .candidates
        .iter()
        .filter(|c| smallest_micro_batch(&c.choice) == 1)
        .filter(|c| {
            assert_eq!(c.measured_peak_bytes, None, "{}", c.choice.strategy);
            c.note
                .as_ref()
                .is_some_and(|n| n.contains("one value per channel"))
        })
        .count();
    assert!(
        spoiled > 0,
        "no one-example split was run: {}",
        report.to_text()
    );
    assert!(
        smallest_micro_batch(&report.choice) >= 2,
        "{}",
        report.to_text()
    );
}

/// Fits below what anything reaches with `allow`, then at the budget the error
/// suggests: that one must work, with no micro-batch of one example. Returns the
/// error's text and the configuration it names.
fn fit_at_the_suggested_budget(allow: Allow) -> (String, String) {
    let mut model = Norm1d::new(BATCH, WIDTH);
    let plain = plain_peak(&model);
    let mut request = FitRequest::new(plain / 100);
    request.allow = allow;
    let e = match fit(&mut model, &request) {
        Err(e) => e,
        Ok(report) => panic!("fit at a hundredth of {plain} B: {}", report.to_text()),
    };
    let message = e.to_string();
    println!("{message}");
    let FitError::Infeasible {
        smallest_bytes: smallest,
        how,
        ..
    } = e
    else {
        panic!("expected nothing to fit a hundredth of {plain} B: {message}");
    };
    // The configuration named has no micro-batch of one example.
    if let Some(rest) = how.split("micro_batches=").nth(1) {
        let k: i64 = rest
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|d| d.parse().ok())
            .unwrap_or_else(|| panic!("a count of micro-batches in {how}"));
        assert!(BATCH / k >= 2, "{message}");
    }
    request.budget_bytes = smallest;
    let report = fit(&mut model, &request)
        .unwrap_or_else(|e| panic!("fit at the suggested {smallest} B ({message}): {e}"));
    assert!(
        smallest_micro_batch(&report.choice) >= 2,
        "{}",
        report.to_text()
    );
    (message, how)
}

#[test]
#[serial]
fn the_budget_fit_suggests_is_never_one_only_one_example_splits_reach() {
    let (message, _) = fit_at_the_suggested_budget(Allow::all());
    assert!(message.contains("running statistics NaN"), "{message}");
}

#[test]
#[serial]
fn without_splits_the_budget_fit_suggests_is_one_the_whole_batch_reaches() {
    // Lossless levers only: with BatchNorm no split; the least memory is the whole
    // batch's at once.
    let (message, how) = fit_at_the_suggested_budget(Allow::default());
    assert!(!how.contains("accumulate"), "{message}");
    // ... and says what micro-batches, lossy here, would reach (two examples each
    // at least: one spoils the statistics, which it does not say of splits it
    // cannot take).
    let hint = message
        .split("allowing lossy levers (micro-batches) would need ")
        .nth(1)
        .unwrap_or_else(|| panic!("no hint for micro-batches: {message}"));
    assert!(hint.contains("accumulate(micro_batches="), "{message}");
    assert!(!hint.contains("micro_batches=64"), "{message}");
    assert!(!message.contains("running statistics NaN"), "{message}");
}

/// Issue "Trust III" item 10: a batch of one example on a BatchNorm net spoils the
/// statistics whatever the budget; `fit` said to give a larger budget, and now says the
/// batch must have 2 or more examples.
#[test]
#[serial]
fn a_batch_of_one_is_told_to_grow_not_given_a_budget() {
    let mut model = Norm1d::new(1, WIDTH);
    let mut request = FitRequest::new(1 << 30);
    request.global_batch = Some(1);
    let e = fit(&mut model, &request).expect_err("one value per channel");
    assert_eq!(e, FitError::BatchOfOne { world_size: 1 }, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("the batch must have 2 or more examples") && !text.contains("budget of"),
        "{text}"
    );
}
