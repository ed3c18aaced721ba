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

/// What is allocated between `recomputation_start` and `recomputation_end` is
/// `recompute`, not `temporary`; nested recomputations count their own bytes; what is
/// live at a recomputation's end is what it re-saved.
#[test]
#[serial]
fn recomputations_get_a_category_of_their_own() {
    let floats = |n: i64| Tensor::zeros([n], (Kind::Float, Device::Cpu));
    let (_, trace) = record(Device::Cpu, |s| {
        let before = floats(64); // 256 B, temporary
        drop(before);
        s.recomputation_start("layer 1");
        let kept = floats(256); // 1 KiB, live at the end: re-saved
        let scratch = floats(128); // 512 B, freed inside
        drop(scratch);
        s.recomputation_start("layer 0");
        let inner = floats(32); // 128 B, the inner one's
        s.recomputation_end();
        s.recomputation_end();
        drop(inner);
        drop(kept);
        let after = floats(16); // 64 B, temporary
        drop(after);
    })
    .unwrap();
    let category = |bytes: u64| {
        let b: Vec<_> = trace.blocks.iter().filter(|b| b.bytes == bytes).collect();
        assert_eq!(b.len(), 1, "{bytes} B: {b:?}");
        (b[0].category, b[0].recomputation.clone())
    };
    assert_eq!(category(256), (Category::Temporary, None));
    assert_eq!(category(64), (Category::Temporary, None));
    let layer = |l: &str| Some(l.to_owned());
    assert_eq!(category(1024), (Category::Recompute, layer("layer 1")));
    assert_eq!(category(512), (Category::Recompute, layer("layer 1")));
    assert_eq!(category(128), (Category::Recompute, layer("layer 0")));
    let r = &trace.recomputations;
    assert_eq!(r.len(), 2);
    assert_eq!(
        (r[0].label.as_str(), r[0].allocated_bytes, r[0].kept_bytes),
        ("layer 1", 1024 + 512, 1024)
    );
    assert_eq!(
        (r[1].label.as_str(), r[1].allocated_bytes, r[1].kept_bytes),
        ("layer 0", 128, 128)
    );
    assert!(r.iter().all(|r| r.end.is_some()));
    // The inner one ran inside the outer one.
    assert!(r[0].start < r[1].start && r[1].end <= r[0].end);
    assert!(r[0].duration_ns >= r[1].duration_ns);
    // At its peak (inside both) 1,024 + 128 B are recompute.
    let timeline = trace.timeline();
    let most = timeline.iter().map(|t| t[Category::Recompute]).max();
    assert_eq!(most, Some(1024 + 512));
    assert!(timeline.iter().all(|t| t[Category::Temporary] <= 256));
    let summary = trace.summary(0);
    assert!(
        summary.contains("checkpoint recomputation in backward, by block"),
        "{summary}"
    );
    assert!(summary.contains("layer 1"), "{summary}");
}
