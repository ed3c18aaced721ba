//! The `optimizer:` technique: parsing, exact state bytes, the step inside backward,
//! and cases left as they found the model.
use memsave_bench::{run_suite, OptimizerKind, RunOptions, Status, Suite, Technique};
use serial_test::serial;

fn parse(strategy: &str) -> Result<Suite, String> {
    let yaml = format!(
        "suite: t
models:
  - {{name: a, kind: residual_mlp, layers: 2, hidden: 8, expansion: 2, batch: [4]}}
strategies:
  - {strategy}
"
    );
    Suite::from_yaml(&yaml, "t.yaml").map_err(|e| e.to_string())
}

#[test]
fn optimizer_entries_parse_with_defaults_and_canonical_names() {
    let suite = parse("optimizer: {}").unwrap();
    let s = &suite.strategies[0];
    assert_eq!(s.name, "optimizer(kind=adamw)");
    let Technique::Optimizer(spec) = s.techniques[0] else {
        panic!("{s:?}")
    };
    assert_eq!(spec.kind, OptimizerKind::Adamw);
    assert!(!spec.in_backward);

    let suite =
        parse("optimizer: {kind: adamw, state: int8, in_backward: true, placement: disk}").unwrap();
    assert_eq!(
        suite.strategies[0].name,
        "optimizer(kind=adamw, state=int8, in_backward=true, placement=disk)"
    );
}

#[test]
fn bad_optimizer_entries_say_what_is_wrong_and_where() {
    for (entry, needle) in [
        ("optimizer: {kind: lamb}", "unknown variant `lamb`"),
        ("optimizer: {state: fp4}", "unknown variant `fp4`"),
        (
            "optimizer: {learning_rate: 0.1}",
            "unknown field `learning_rate`",
        ),
        (
            "optimizer: {kind: sgd, state: int8}",
            "sgd without momentum keeps no state",
        ),
        (
            "optimizer",
            "needs arguments, e.g. {optimizer: {kind: adamw}}",
        ),
    ] {
        let e = parse(entry).unwrap_err();
        assert!(e.starts_with("t.yaml:5:"), "{entry}: {e}");
        assert!(e.contains(needle), "{entry}: expected '{needle}' in {e}");
    }
}

/// Runs the residual MLP (`layers` blocks of Linear(h, e*h), GELU, Linear(e*h, h)).
fn run(strategies: &str) -> memsave_bench::Report {
    let yaml = format!(
        "suite: t
threads: 1
warmup: 1
repeats: 1
models:
  - {{name: mlp, kind: residual_mlp, layers: 4, hidden: 16, expansion: 4, batch: [8, 4]}}
strategies:
{strategies}"
    );
    let suite = Suite::from_yaml(&yaml, "t.yaml").unwrap();
    run_suite(&suite, &RunOptions::default()).unwrap()
}

#[test]
#[serial]
fn adamw_state_bytes_are_two_f32_moments_per_parameter_and_the_weights_come_back() {
    let report = run("  - {name: ckpt, with: [{checkpoint: {every_layer: true}}]}
  - {name: ckpt+adamw, with: [{checkpoint: {every_layer: true}}, {optimizer: {kind: adamw}}]}
  - {name: ckpt+adamw-in-backward, with: [{checkpoint: {every_layer: true}}, {optimizer: {kind: adamw, in_backward: true}}]}
  - {name: ckpt+sgd, with: [{checkpoint: {every_layer: true}}, {optimizer: {kind: sgd}}]}
  - {name: ckpt+adamw-int8, with: [{checkpoint: {every_layer: true}}, {optimizer: {kind: adamw, state: int8}}]}
  - baseline
  - {name: in-backward+accumulate, with: [{accumulate: {micro_batches: 2}}, {optimizer: {in_backward: true}}]}
");
    let case = |name: &str| {
        let c = report.cases.iter().find(|c| c.strategy == name).unwrap();
        assert!(
            c.status == Status::Ok || name.contains("accumulate"),
            "{name}: {:?}",
            c.error
        );
        c
    };
    // 4 blocks of (16x64 + 64) + (64x16 + 16) parameters.
    let (h, e, l) = (16u64, 4u64, 4u64);
    let params = l * (h * e * h + e * h + e * h * h + h);
    assert_eq!(
        case("ckpt+adamw").optimizer_state_bytes,
        Some(2 * 4 * params)
    );
    assert_eq!(
        case("ckpt+adamw-in-backward").optimizer_state_bytes,
        Some(2 * 4 * params)
    );
    assert_eq!(case("ckpt+sgd").optimizer_state_bytes, Some(0));
    assert_eq!(case("ckpt").optimizer_state_bytes, None);
    // int8: one byte per value and one f32 scale per block of 256 values, per tensor.
    let blocks: u64 = [h * e * h, e * h, e * h * h, h]
        .iter()
        .map(|n| n.div_ceil(256))
        .sum::<u64>()
        * l;
    assert_eq!(
        case("ckpt+adamw-int8").optimizer_state_bytes,
        Some(2 * (params + 4 * blocks))
    );

    // With every-layer checkpointing the peak sits in backward among the gradients;
    // stepping inside backward frees each gradient at once and lowers it.
    let after = case("ckpt+adamw").peak_bytes.unwrap();
    let inside = case("ckpt+adamw-in-backward").peak_bytes.unwrap();
    assert!(inside < after, "in backward {inside} vs after {after}");
    assert_eq!(
        case("ckpt+adamw").peak_phase,
        Some(memsave_bench::PeakPhase::Backward)
    );

    // Every case started from the same weights: the checkpoint case's gradients equal
    // the baseline's, measured after three optimizer cases changed the weights.
    assert_eq!(case("ckpt").grad_max_abs_diff, Some(0.0));
    assert_eq!(case("ckpt").start_bytes, case("baseline").start_bytes);

    let refused = case("in-backward+accumulate");
    assert_eq!(refused.status, Status::Unavailable);
    assert!(
        refused.error.as_deref().unwrap().contains("micro-batches"),
        "{:?}",
        refused.error
    );
}

#[test]
#[serial]
fn gradients_in_files_keep_the_accumulated_gradients_and_let_the_step_in_backward_accumulate() {
    let report = run("  - baseline
  - {name: acc, with: [{accumulate: {micro_batches: 4}}]}
  - {name: acc+files, with: [{accumulate: {micro_batches: 4}}, {offload_grads: {to: disk}}]}
  - {name: acc+files+adamw-in-backward, with: [{accumulate: {micro_batches: 2}}, {offload_grads: {to: disk}}, {optimizer: {kind: adamw, in_backward: true}}]}
  - {name: files+scaler, with: [{offload_grads: {to: disk}}, grad_scaler]}
  - {with: [{accumulate: {micro_batches: 4}}, {offload_grads: {to: disk, at_least: 1KiB}}]}
  - {name: acc+weights-in-files+adamw-in-backward, with: [{accumulate: {micro_batches: 2}}, {offload_grads: {to: disk, at_least: 1KiB}}, {optimizer: {kind: adamw, in_backward: true}}]}
");
    let case = |name: &str| report.cases.iter().find(|c| c.strategy == name).unwrap();
    for name in ["acc", "acc+files", "acc+files+adamw-in-backward"] {
        assert_eq!(
            case(name).status,
            Status::Ok,
            "{name}: {:?}",
            case(name).error
        );
    }
    // Bitwise the gradients plain accumulation makes: the same difference from the
    // whole batch's.
    assert!(case("acc+files").grad_max_abs_diff.is_some());
    assert_eq!(
        case("acc+files").grad_max_abs_diff,
        case("acc").grad_max_abs_diff
    );
    assert_eq!(case("acc+files").grad_rel_l2, case("acc").grad_rel_l2);
    // From the second micro-batch on, plain accumulation holds every gradient; in
    // files, at most one parameter's gradient and its stored sum are in memory.
    let (h, e, l) = (16u64, 4u64, 4u64);
    let grads = 4 * l * (h * e * h + e * h + e * h * h + h);
    let largest = 4 * h * e * h;
    let plain = case("acc").peak_bytes.unwrap();
    let files = case("acc+files").peak_bytes.unwrap();
    assert!(
        files + grads <= plain + 2 * largest,
        "in files {files} vs in memory {plain} (gradients {grads})"
    );
    assert_eq!(
        case("acc+files+adamw-in-backward").optimizer_state_bytes,
        Some(2 * grads)
    );
    // Gradients per parameter group: the weights' (4 KiB each) in files, the biases'
    // (64 and 256 B) in memory. Bitwise plain accumulation too, below the plain peak.
    let weights = case("accumulate(micro_batches=4)+offload_grads(to=disk, at_least=1KiB)");
    assert_eq!(weights.status, Status::Ok, "{:?}", weights.error);
    assert_eq!(weights.grad_max_abs_diff, case("acc").grad_max_abs_diff);
    assert_eq!(weights.grad_rel_l2, case("acc").grad_rel_l2);
    assert!(
        weights.peak_bytes.unwrap() < plain,
        "{:?} vs {plain}",
        weights.peak_bytes
    );
    let stepped = case("acc+weights-in-files+adamw-in-backward");
    assert_eq!(stepped.status, Status::Ok, "{:?}", stepped.error);
    assert_eq!(stepped.optimizer_state_bytes, Some(2 * grads));
    let refused = case("files+scaler");
    assert_eq!(refused.status, Status::Unavailable);
    assert!(
        refused.error.as_deref().unwrap().contains("grad_scaler"),
        "{:?}",
        refused.error
    );
}
