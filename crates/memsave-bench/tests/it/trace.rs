//! `memsave trace` through the library: the seed network's bytes by category against
//! the harness's own measurement, and the categories against the meter at every event.
use memsave_bench::trace::END_OF_FORWARD;
use memsave_bench::{bundled, run_suite, trace_case, RunOptions, Status, Suite};
use memsave_trace::{Category, Trace};
use proptest::prelude::*;
use serial_test::serial;

fn suite(name: &str) -> Suite {
    Suite::from_yaml(bundled(name).unwrap().source, &format!("{name}.yaml")).unwrap()
}

/// At every event the categories add up to the meter's count right after it.
fn assert_adds_up(trace: &Trace) {
    assert!(!trace.events.is_empty());
    for (i, (bytes, event)) in trace.timeline().iter().zip(&trace.events).enumerate() {
        assert_eq!(
            bytes.total(),
            event.allocated_after,
            "event {i}: {bytes:?} against the meter's {}",
            event.allocated_after
        );
    }
}

/// Every storage allocated while a recomputation ran is `recompute` (none
/// `temporary`) and knows its recomputation; outside them, none is `recompute`.
fn assert_recompute_exactly_inside_recomputations(trace: &Trace) {
    for b in &trace.blocks {
        let Some(at) = b.alloc_event else { continue };
        let inside = trace
            .recomputations
            .iter()
            .any(|r| r.start <= at && r.end.is_none_or(|end| at < end));
        if inside {
            assert_eq!(b.category, Category::Recompute, "{b:?}");
            assert!(b.recomputation.is_some(), "{b:?}");
        } else {
            assert_ne!(b.category, Category::Recompute, "{b:?}");
        }
    }
}

/// The seed network: 10 layers of `x = x + Linear(512, 512)(x)` on `[50, 100, 512]`.
#[test]
#[serial]
fn seed_saved_activations_and_gradients_match_the_harness_to_the_byte() {
    let seed = suite("seed");
    let options = RunOptions {
        filter: Some(regex::Regex::new("^seed-residual/baseline$").unwrap()),
        repeats: Some(1),
        warmup: Some(0),
        ..RunOptions::default()
    };
    let report = run_suite(&seed, &options).unwrap();
    let case = &report.cases[0];
    assert_eq!(case.status, Status::Ok, "{:?}", case.error);
    let retained = case.retained_after_forward_bytes.unwrap();

    let traced = trace_case(&seed, "seed-residual", "baseline").unwrap();
    let step = traced.step.as_ref().unwrap();
    assert_eq!(step.retained_after_forward_bytes, retained);
    let trace = &traced.trace;
    assert_adds_up(trace);
    let forward = trace.bytes_at_mark(END_OF_FORWARD).unwrap();
    assert_eq!(forward[Category::SavedActivation], retained);
    // Nine layer inputs and the output (which the loss saves), 50 * 100 * 512 floats each.
    assert_eq!(forward[Category::SavedActivation], 10 * 50 * 100 * 512 * 4);
    let parameters = 10 * (512 * 512 + 512) * 4;
    assert_eq!(traced.parameter_bytes, parameters);
    let end = trace.end_bytes();
    assert_eq!(end[Category::Gradient], parameters);
    assert_eq!(end[Category::Parameter], parameters);
    assert_eq!(end[Category::Input], 50 * 100 * 512 * 4);
    // What each layer keeps: its input, a saved tensor of AddmmBackward0 (saved while
    // aten::addmm ran); the first layer's input is the caller's.
    let saved: Vec<_> = trace
        .blocks
        .iter()
        .filter(|b| b.category == Category::SavedActivation)
        .collect();
    assert_eq!(saved.len(), 10);
    for i in 1..10 {
        let mark = format!("layer {i}");
        let b = saved
            .iter()
            .find(|b| b.mark.as_deref() == Some(mark.as_str()))
            .unwrap_or_else(|| panic!("no saved activation marked {mark}"));
        assert_eq!(b.saved_by.as_deref(), Some("aten::addmm"));
        // The node that saved it, as PyTorch names it (its `_saved_mat1`).
        assert_eq!(b.saved_for.as_deref(), Some("AddmmBackward0"));
        assert_eq!(b.role(), "saved_activation of AddmmBackward0");
        // Linear flattens its 3-d input with a view before addmm.
        assert_eq!(b.producer.as_deref(), Some("ViewBackward0"));
        assert_eq!(b.bytes, 50 * 100 * 512 * 4);
    }
    assert_eq!(trace.unplaced_notes, 0);
}

/// A failing strategy still yields a trace, with the step's error beside it.
#[test]
#[serial]
fn a_failing_step_is_traced_and_reported() {
    let quick = suite("quick");
    let traced = trace_case(&quick, "linear", "inplace_add").unwrap();
    let error = traced.step.unwrap_err().to_string();
    assert!(error.contains("in-place operation"), "{error}");
    assert_adds_up(&traced.trace);
}

/// Gradients kept in files take each parameter's one post-accumulate-grad hook during
/// the step: the recorder leaves the slot to them, so the step runs (it failed with
/// "the tensor already has a post-accumulate-grad hook" when the recorder took it) and
/// its peak is the harness's.
#[test]
#[serial]
fn a_step_with_gradients_in_files_is_traced() {
    let yaml = r#"
suite: grads-in-files
device: cpu
threads: 1
seed: 0
warmup: 1
repeats: 1
models:
  - {name: mlp, kind: residual_mlp, layers: 3, hidden: 64, expansion: 2, batch: [8, 8]}
strategies:
  - {name: files, with: [{accumulate: {micro_batches: 2}}, {offload_grads: {to: disk}}, {optimizer: {kind: adamw, in_backward: true}}]}
"#;
    let suite = Suite::from_yaml(yaml, "grads-in-files.yaml").unwrap();
    let traced = trace_case(&suite, "mlp", "files").unwrap();
    let step = traced.step.as_ref().unwrap_or_else(|e| panic!("{e}"));
    assert_adds_up(&traced.trace);
    let options = RunOptions {
        repeats: Some(1),
        ..RunOptions::default()
    };
    let report = run_suite(&suite, &options).unwrap();
    let case = &report.cases[0];
    assert_eq!(case.status, Status::Ok, "{:?}", case.error);
    assert_eq!(Some(step.peak_bytes), case.peak_bytes);
}

/// A model of named blocks (the zoo's U-Net, one layer to the chain): the timeline is
/// marked per block, and each block's recomputation is its own row, in the order
/// backward runs them; what they allocate is `recompute`, nothing outside them is.
#[test]
#[serial]
fn a_model_of_blocks_is_traced_per_block() {
    let zoo = suite("zoo");
    let traced = trace_case(&zoo, "unet-32px", "checkpoint(every_layer=true)").unwrap();
    traced.step.as_ref().unwrap();
    let trace = &traced.trace;
    assert_adds_up(trace);
    let table = trace.recomputation_by_block();
    let rows: Vec<(&str, usize)> = table.iter().map(|b| (b.label.as_str(), b.runs)).collect();
    assert_eq!(
        rows,
        [
            ("block head#0", 1),
            ("block dec0#0", 1),
            ("block dec1#0", 1),
            ("block dec2#0", 1),
            ("block bottom#0", 1),
            ("block enc2#0", 1),
            ("block enc1#0", 1),
            ("block enc0#0", 1)
        ]
    );
    assert_recompute_exactly_inside_recomputations(trace);
    // The forward's allocations are marked by the block that made them.
    assert!(
        trace
            .blocks
            .iter()
            .any(|b| b.mark.as_deref() == Some("block enc1#0")),
        "no storage marked by block enc1#0"
    );
}

#[test]
#[serial]
fn unknown_names_are_an_error_that_lists_the_known_ones() {
    let quick = suite("quick");
    let e = trace_case(&quick, "nope", "baseline").unwrap_err();
    assert!(e.to_string().contains("models: linear, mlp, gpt"), "{e}");
    let e = trace_case(&quick, "linear", "nope").unwrap_err();
    assert!(
        e.to_string().contains("strategies: baseline, inplace_add"),
        "{e}"
    );
}

/// A suite on CUDA is refused in one actionable line (traces read the CPU's allocator).
#[test]
#[serial]
fn a_cuda_suite_is_refused_in_one_line_that_says_what_to_change() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../suites/cuda.yaml");
    let cuda = Suite::from_yaml(&std::fs::read_to_string(path).unwrap(), path).unwrap();
    let e = trace_case(&cuda, "linear", "baseline")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`device: cpu`"), "{e}");
    assert!(e.contains("CPU only"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Every bundled model kind under every technique (the quick suite's small shapes):
    /// the categories add up to the meter at every event.
    #[test]
    #[serial]
    fn categories_add_up_to_the_meter_at_every_event(model in 0usize..3, strategy in 0usize..13) {
        let quick = suite("quick");
        let model = quick.models[model].name.clone();
        let strategy = quick.strategies[strategy].name.clone();
        let traced = trace_case(&quick, &model, &strategy).unwrap();
        assert_adds_up(&traced.trace);
        let end = traced.trace.end_bytes();
        prop_assert_eq!(end[Category::Parameter], traced.parameter_bytes);
        if traced.step.is_ok() {
            prop_assert_eq!(end[Category::Gradient], traced.parameter_bytes);
        }
    }
}

/// A small residual MLP under memsave-optim's optimizer, after backward and inside it,
/// with the state in f32, bf16 and int8, on the device and on disk.
const OPTIMIZER_SUITE: &str = "
suite: trace-optimizer
device: cpu
seed: 0
warmup: 0
repeats: 1
models:
  - {name: mlp, kind: residual_mlp, layers: 3, hidden: 16, expansion: 2, batch: [4, 4]}
strategies:
  - {name: adamw, with: [{optimizer: {kind: adamw}}]}
  - {name: adamw-in-backward, with: [{optimizer: {kind: adamw, in_backward: true}}]}
  - {name: adamw-bf16-in-backward, with: [{optimizer: {kind: adamw, state: bf16, in_backward: true}}]}
  - {name: adamw-int8-disk, with: [{optimizer: {kind: adamw, state: int8, placement: disk}}]}
  - {name: ckpt+sgd-in-backward, with: [{checkpoint: {every_layer: true}}, {optimizer: {kind: sgd, in_backward: true}}]}
";

/// Bytes of state per parameter value: AdamW's two moments at the state's precision;
/// SGD without momentum has none; on disk none is held between steps.
fn state_bytes_per_value(strategy: &str) -> u64 {
    match strategy {
        "adamw" | "adamw-in-backward" => 2 * 4,
        "adamw-bf16-in-backward" => 2 * 2,
        _ => 0,
    }
}

/// The optimizer's state is `optimizer_state` (created in the recorded step's first
/// update, or by the warm-up step before it), to the byte of memsave-optim's own count;
/// gradients are `gradient` also when a step in backward frees them inside backward.
#[test]
#[serial]
fn optimizer_state_and_gradients_are_categorized_to_the_byte() {
    let mut suite = Suite::from_yaml(OPTIMIZER_SUITE, "trace-optimizer.yaml").unwrap();
    // 3 blocks of Linear(16, 32) and Linear(32, 16), f32.
    let parameter_values = 3 * (16 * 32 + 32 + 32 * 16 + 16);
    let parameter_bytes = parameter_values * 4;
    let strategies: Vec<String> = suite.strategies.iter().map(|s| s.name.clone()).collect();
    for warmup in [0, 1] {
        suite.warmup = warmup;
        for strategy in &strategies {
            let case = format!("{strategy}, warm-up {warmup}");
            let options = RunOptions {
                filter: Some(
                    regex::Regex::new(&format!("^mlp/{}$", regex::escape(strategy))).unwrap(),
                ),
                ..RunOptions::default()
            };
            let report = run_suite(&suite, &options).unwrap();
            let harness = &report.cases[0];
            assert_eq!(harness.status, Status::Ok, "{case}: {:?}", harness.error);
            let state_bytes = harness.optimizer_state_bytes.unwrap();
            assert_eq!(
                state_bytes,
                state_bytes_per_value(strategy) * parameter_values,
                "{case}"
            );

            let traced = trace_case(&suite, "mlp", strategy).unwrap();
            traced.step.as_ref().unwrap();
            let trace = &traced.trace;
            let summary = trace.summary(8);
            assert_eq!(traced.parameter_bytes, parameter_bytes);
            assert_adds_up(trace);
            let end = trace.end_bytes();
            assert_eq!(
                end[Category::OptimizerState],
                state_bytes,
                "{case}\n{summary}"
            );
            assert_eq!(
                end[Category::Gradient],
                0,
                "{case}: the step frees them\n{summary}"
            );
            assert_eq!(end[Category::Parameter], parameter_bytes, "{case}");
            // Every parameter's gradient was a `gradient`, whether the optimizer stepped
            // after backward or inside it (where its hook freed the gradient at once).
            let gradients: u64 = trace
                .blocks
                .iter()
                .filter(|b| b.category == Category::Gradient && b.alloc_event.is_some())
                .map(|b| b.bytes)
                .sum();
            assert_eq!(gradients, parameter_bytes, "{case}\n{summary}");
            if !strategy.contains("in-backward") {
                let at_step = trace.bytes_at_mark("optimizer").unwrap();
                assert_eq!(
                    at_step[Category::Gradient],
                    parameter_bytes,
                    "{case}\n{summary}"
                );
            }
            if strategy == "adamw-int8-disk" {
                // On disk between steps, in memory for one parameter's update at a time:
                // the largest parameter's two int8 moments and their f32 scales (one per
                // 256 values: two for a 16 x 32 weight).
                let largest: u64 = 16 * 32;
                let most = trace
                    .timeline()
                    .iter()
                    .map(|b| b[Category::OptimizerState])
                    .max()
                    .unwrap();
                assert_eq!(most, 2 * (largest + 2 * 4), "{case}\n{summary}");
            }
            assert_eq!(end[Category::Other], 0, "{case}\n{summary}");
            assert_eq!(trace.unplaced_notes, 0, "{case}\n{summary}");
        }
    }
}

/// Checkpointing every layer of the quick suite's MLP (3 layers of `x + down(gelu(up(x)))`
/// on `[4, 4, 16]`, up to 32 features): in backward each layer's forward runs again,
/// and what it allocates is `recompute`, per block, no longer `temporary`.
#[test]
#[serial]
fn recomputation_in_backward_is_its_own_category_per_block() {
    let quick = suite("quick");
    let traced = trace_case(&quick, "mlp", "checkpoint(every_layer=true)").unwrap();
    traced.step.as_ref().unwrap();
    let trace = &traced.trace;
    assert_adds_up(trace);
    // Each recomputation allocates up's output (16 x 32 floats, 2,048 B), GELU's
    // (2,048 B), down's (16 x 16, 1,024 B) and the residual sum (1,024 B); at its end
    // up's and GELU's outputs are held for the layer's backward (GELU's input, down's
    // input) and the sum until the checkpoint drops it: 5,120 B.
    let table = trace.recomputation_by_block();
    let rows: Vec<_> = table
        .iter()
        .map(|b| (b.label.as_str(), b.runs, b.allocated_bytes, b.kept_bytes))
        .collect();
    assert_eq!(
        rows,
        [
            ("layer 2", 1, 6144, 5120),
            ("layer 1", 1, 6144, 5120),
            ("layer 0", 1, 6144, 5120)
        ]
    );
    assert!(table.iter().all(|b| b.duration_ns > 0));
    assert_recompute_exactly_inside_recomputations(trace);
    let most = |c: Category| trace.timeline().iter().map(|t| t[c]).max().unwrap();
    // All four at once, just before down's output is freed; at the step's peak (layer
    // 0's backward) up's and GELU's outputs of layer 0.
    assert_eq!(most(Category::Recompute), 6144);
    let peak = trace.bytes_at(trace.peak_event().unwrap() + 1);
    assert_eq!(peak[Category::Recompute], 4096);
    // The summary's table and the snapshot's frames carry it.
    let summary = trace.summary(0);
    assert!(summary.contains("recompute"), "{summary}");
    assert!(
        summary.contains("checkpoint recomputation in backward, by block"),
        "{summary}"
    );
    let pickle = trace.to_snapshot_pickle().unwrap();
    let has = |text: &str| pickle.windows(text.len()).any(|w| w == text.as_bytes());
    assert!(has("memsave:recompute"));
    assert!(has("recomputing layer 1"));
    // Without checkpointing there is nothing to recompute.
    let plain = trace_case(&quick, "mlp", "baseline").unwrap();
    assert!(plain.trace.recomputations.is_empty());
    assert!(plain
        .trace
        .blocks
        .iter()
        .all(|b| b.category != Category::Recompute));
}
