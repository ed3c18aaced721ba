//! A model built before `memsave_meter::install()` has storages the meter never sees:
//! `fit`'s budget (the whole device) counts its parameters and data all the same, so a
//! fit of it gives the figures of a fit of the same model built after. A binary of its
//! own: the model must be built in a process where the meter is not installed yet.
#[allow(dead_code)]
#[path = "../../memsave-step/tests/it/common.rs"]
mod common;

use common::Mlp;
use memsave_fit::{fit, FitReport, FitRequest};
use memsave_step::Workload;

fn baseline(report: &FitReport) -> (Option<u64>, Option<u64>) {
    let c = report
        .candidates
        .iter()
        .find(|c| c.choice.strategy == "baseline")
        .expect("the plain step is a candidate");
    (c.predicted_peak_bytes, c.measured_peak_bytes)
}

#[test]
fn a_model_built_before_the_meter_is_counted_as_one_built_after() {
    let mut before = Mlp::new(3, 64, 8, 16);
    memsave_meter::install();
    let counted = |m: &Mlp| memsave_sys::alloc::is_counted(&m.parameters()[0]).unwrap();
    assert!(!counted(&before), "the meter sees a storage made before it");
    // 3 × (64 × 128 + 128 + 128 × 64 + 64) f32 parameters; 8 × 16 × 64 f32 of data.
    let parameters = 3 * (64 * 128 + 128 + 128 * 64 + 64) * 4;
    let data = 8 * 16 * 64 * 4;
    let request = FitRequest::new(1 << 30);
    // One model at a time: the other's bytes would stand in for those unseen.
    let a = fit(&mut before, &request).unwrap();
    drop(before);
    let mut after = Mlp::new(3, 64, 8, 16);
    assert!(counted(&after));
    let b = fit(&mut after, &request).unwrap();
    for report in [&a, &b] {
        assert_eq!(
            report.breakdown.parameters,
            parameters,
            "{}",
            report.to_text()
        );
        assert_eq!(report.breakdown.input, data, "{}", report.to_text());
        assert_eq!(report.breakdown.total(), report.measured_peak_bytes);
    }
    assert_eq!(baseline(&a).0, baseline(&b).0);
    assert!(baseline(&a).0.unwrap() > parameters + data);
    assert_eq!(a.measured_peak_bytes, b.measured_peak_bytes);
}
