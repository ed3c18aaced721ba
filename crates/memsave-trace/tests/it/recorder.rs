//! The recorder's rules: one recording at a time, off again after a panic, CUDA refused.
use memsave_trace::{record, Category, TraceError};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

#[test]
#[serial]
fn recordings_do_not_nest() {
    let (inner, outer) = record(Device::Cpu, |_| record(Device::Cpu, |_| ()).map(|_| ())).unwrap();
    assert!(
        matches!(inner, Err(TraceError::AlreadyRecording)),
        "{inner:?}"
    );
    assert!(outer.events.len() >= outer.initial_events);
}

#[test]
#[serial]
fn a_panicking_step_stops_the_recording() {
    let panicked = std::panic::catch_unwind(|| {
        let _ = record(Device::Cpu, |_| panic!("boom"));
    });
    assert!(panicked.is_err());
    // The next recording starts: the first one was stopped while unwinding.
    let (_, trace) = record(Device::Cpu, |_| {
        let t = Tensor::zeros([256], (Kind::Float, Device::Cpu));
        drop(t);
    })
    .unwrap();
    let during: Vec<_> = trace.events[trace.initial_events..]
        .iter()
        .map(|e| e.bytes)
        .collect();
    assert_eq!(during, [1024, -1024]);
    assert_eq!(
        trace.blocks[trace.events[trace.initial_events].block].category,
        Category::Temporary
    );
}

#[test]
fn cuda_is_refused_with_a_reason() {
    let e = record(Device::Cuda(0), |_| ()).unwrap_err();
    let message = e.to_string();
    assert!(message.contains("CPU's counting allocator only"), "{e}");
    assert!(message.contains("record the step on Device::Cpu"), "{e}");
    assert!(!message.contains('\n'), "one line: {e}");
}
