//! `memsave bench` times every step with glibc's `malloc` settled: its mmap threshold
//! raised to the cap before the first timed step, whatever ran before. In a process of
//! its own (this file), so that the state before the run is glibc's own: not a module of
//! `tests/it`, whose earlier tests would have raised the threshold already, so this one
//! could not fail.
use memsave_bench::{run_suite_with, Observer, RunOptions, Suite};
use memsave_sys::alloc::c_mapped_blocks;

/// Whether glibc gives a fresh block of `bytes` a mapping of its own (freeing it raises
/// the threshold to its size if it did).
fn mapped_on_its_own(bytes: usize) -> bool {
    let before = c_mapped_blocks().expect("glibc says how many blocks it maps");
    let block = std::hint::black_box(Vec::<u8>::with_capacity(bytes));
    let during = c_mapped_blocks().unwrap();
    drop(block);
    during == before + 1
}

/// Asks glibc about a 31 MiB block at the first timed step.
#[derive(Default)]
struct AtFirstTimedStep(Option<bool>);

impl Observer for AtFirstTimedStep {
    fn timed_step(&mut self, _model: &str, _strategy: &str, _round: usize, _rounds: usize) {
        if self.0.is_none() {
            self.0 = Some(mapped_on_its_own(31 << 20));
        }
    }
}

#[test]
fn glibc_serves_blocks_up_to_its_cap_from_the_heap_at_the_first_timed_step() {
    // Layers of width 16 on 8 rows: no tensor anywhere near a MiB.
    let suite = Suite::from_yaml(
        "
suite: settle
warmup: 0
repeats: 1
models:
  - {name: tiny, kind: residual_linear, layers: 2, hidden: 16, batch: [8]}
strategies:
  - baseline
",
        "settle.yaml",
    )
    .unwrap();
    // glibc's own state: a 24 MiB block is mapped (and its free raises the threshold
    // to 24 MiB, no further).
    assert!(mapped_on_its_own(24 << 20), "glibc starts below 24 MiB");
    let mut probe = AtFirstTimedStep::default();
    run_suite_with(&suite, &RunOptions::default(), &mut probe).unwrap();
    // Nothing but the run's settling frees a block near 32 MiB in this process.
    assert_eq!(
        probe.0,
        Some(false),
        "a 31 MiB block was given a mapping of its own at the first timed step (None: no step was timed)"
    );
}
