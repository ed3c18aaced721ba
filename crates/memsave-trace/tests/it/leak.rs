//! `detect_leak` names what stayed behind.
use memsave_trace::{detect_leak, Category, Recorder};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

/// `total = total + loss` keeps every step's graph: the saved tensors of each step's
/// loss stay behind, one group per step mark.
#[test]
#[serial]
fn the_classic_leak_is_named_by_category_op_and_mark() {
    memsave_meter::install();
    let w = Tensor::ones([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::ones([16, 64], (Kind::Float, Device::Cpu));
    let mut total = Tensor::zeros([], (Kind::Float, Device::Cpu));
    let leak = detect_leak(
        Recorder::new(Device::Cpu)
            .parameters(&[w.shallow_clone()])
            .inputs(&[x.shallow_clone()]),
        4,
        |_, _| {
            // tanh saves its 16 x 64 output for backward: 4,096 bytes a step.
            let loss = x.matmul(&w).tanh().sum(Kind::Float);
            total = &total + &loss;
            Ok::<(), String>(())
        },
    )
    .unwrap();
    assert!(leak.report.is_leaking(), "{leak}");
    let saved: Vec<_> = leak
        .left_behind
        .iter()
        .filter(|l| {
            l.category == Category::SavedActivation && l.op.as_deref() == Some("aten::tanh")
        })
        .collect();
    // Steps 1, 2 and 3 (the first step is not counted), one tanh output each.
    assert_eq!(saved.len(), 3, "{leak}");
    let mut marks: Vec<_> = saved
        .iter()
        .map(|l| l.mark.clone().unwrap_or_default())
        .collect();
    marks.sort();
    assert_eq!(marks, ["step 1", "step 2", "step 3"]);
    for l in &saved {
        assert_eq!((l.bytes, l.count), (16 * 64 * 4, 1), "{leak}");
    }
    drop(total);
}

/// A step without a leak leaves nothing behind.
#[test]
#[serial]
fn a_clean_step_leaves_nothing_behind() {
    memsave_meter::install();
    let w = Tensor::ones([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::ones([16, 64], (Kind::Float, Device::Cpu));
    let mut total = 0.0;
    let leak = detect_leak(Recorder::new(Device::Cpu), 4, |_, _| {
        let loss = x.matmul(&w).tanh().sum(Kind::Float);
        total += loss.double_value(&[]);
        Ok::<(), String>(())
    })
    .unwrap();
    assert!(!leak.report.is_leaking(), "{leak}");
    assert!(leak.left_behind.is_empty(), "{leak}");
    assert!(total > 0.0);
}
