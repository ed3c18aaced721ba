//! The whole text of each message a suite entry's own checks give (those serde does
//! not write), so that a change of wording, or of the types behind them, is seen.
use memsave_bench::{resolve, ModelSpecError, Suite, Unavailable};

const MODEL: &str = "{name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}";

fn suite_of(model: &str, strategy: &str) -> String {
    format!("suite: t\nmodels:\n  - {model}\nstrategies:\n  - {strategy}\n")
}

/// The message of the error `yaml` is refused with, after its `file:line:column: `
/// (it starts with the entry's path, `models[0]: `).
fn message(yaml: &str) -> String {
    match Suite::from_yaml(yaml, "bad.yaml") {
        Ok(s) => panic!("accepted an invalid suite: {s:?}\n{yaml}"),
        Err(e) => {
            let e = e.to_string();
            let rest = e.strip_prefix("bad.yaml:").expect("a position");
            let (_line_column, message) = rest.split_once(": ").expect("a message");
            message.to_owned()
        }
    }
}

fn model_message(model: &str) -> String {
    message(&suite_of(model, "baseline"))
}

fn strategy_message(strategy: &str) -> String {
    message(&suite_of(MODEL, strategy))
}

#[test]
fn model_entries_say_what_is_wrong_in_these_words() {
    let cases = [
        (
            "{name: a, kind: residual_linear, layers: 2, hidden: 8, batch: []}",
            "model 'a': batch must list at least one dimension",
        ),
        (
            "{name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4], expansion: 2}",
            "model 'a': expansion only applies to kind residual_mlp",
        ),
        (
            "{name: a, kind: transformer, layers: 2, hidden: 8, batch: [4, 3]}",
            "model 'a': a transformer needs heads",
        ),
        (
            "{name: a, kind: transformer, layers: 2, hidden: 8, batch: [4, 3], heads: 3}",
            "model 'a': heads (3) must divide hidden (8)",
        ),
        (
            "{name: a, kind: transformer, layers: 2, hidden: 8, batch: [4], heads: 2}",
            "model 'a': a transformer's batch is [batch, sequence], got 1 dimensions",
        ),
        (
            "{name: a, kind: residual_mlp, layers: 2, hidden: 8, batch: [4], heads: 2}",
            "model 'a': heads only applies to kind transformer",
        ),
        (
            "{name: a, kind: residual_mlp, layers: 1, hidden: 16777216, expansion: 16777216, \
             batch: [1]}",
            "model 'a': the parameter count overflows 64 bits (limit 4294967296); \
             reduce layers, hidden or expansion",
        ),
        (
            "{name: a, kind: residual_linear, layers: 1, hidden: 65536, batch: [1]}",
            "model 'a': 4295032832 parameters, more than the limit of 4294967296 (16 GiB in f32); \
             reduce layers, hidden or expansion",
        ),
        (
            "{name: a, kind: residual_linear, layers: 1, hidden: 8, batch: [16777216, 16777216]}",
            "model 'a': an input of 2251799813685248 elements, more than the limit of 4294967296 \
             (16 GiB in f32); reduce batch or hidden",
        ),
        (
            "{name: a, kind: residual_linear, layers: 1, hidden: 8, \
             batch: [16777216, 16777216, 16777216, 16777216]}",
            "model 'a': the input's element count overflows 64 bits (limit 4294967296); \
             reduce batch or hidden",
        ),
    ];
    for (model, expected) in cases {
        assert_eq!(
            model_message(model),
            format!("models[0]: {expected}"),
            "{model}"
        );
    }
    let twice = format!("suite: t\nmodels:\n  - {MODEL}\n  - {MODEL}\nstrategies:\n  - baseline\n");
    assert_eq!(
        message(&twice),
        "models[1]: duplicate model name 'a': names must be unique within a suite"
    );
}

#[test]
fn strategy_entries_say_what_is_wrong_in_these_words() {
    let cases = [
        (
            "{compress: {dtype: int4}}",
            "compress: unknown dtype 'int4', expected one of bf16, fp16, fp8, int8",
        ),
        (
            "{checkpoint: {budget: 1MiB, compress: int4}}",
            "checkpoint compress: unknown dtype 'int4', expected one of bf16, fp16, fp8, int8",
        ),
        (
            "{checkpoint: {every_layer: false}}",
            "checkpoint: every_layer must be true (leave the strategy out instead)",
        ),
        (
            "{checkpoint: {nested: false}}",
            "checkpoint: nested must be true (leave the strategy out instead)",
        ),
        (
            "{checkpoint: {segments: 2, offload: true}}",
            "checkpoint: offload and compress are levers of the budget planner: give a budget too",
        ),
        (
            "{checkpoint: {budget: 1MiB, offload: false}}",
            "checkpoint: offload must be true (leave it out for recomputation alone)",
        ),
        (
            "{checkpoint: {}}",
            "checkpoint needs one of segments, every_layer, nested, budget",
        ),
        (
            "{checkpoint: {segments: 2, nested: true}}",
            "checkpoint takes exactly one of segments, every_layer, nested, budget",
        ),
        (
            "{name: x, with: []}",
            "`with` must list at least one technique",
        ),
        (
            "{with: [baseline, safe_residual]}",
            "baseline cannot be combined with other techniques",
        ),
        (
            "{with: [{fit: {budget: 1MiB}}, safe_residual]}",
            "fit chooses every lever itself, so it combines only with optimizer (the optimizer it steps)",
        ),
        (
            "{with: [{checkpoint: {segments: 2}}, {checkpoint: {nested: true}}]}",
            "a strategy can apply only one checkpoint; 'checkpoint(nested=true)' repeats it",
        ),
        (
            "{name: ' ', with: [safe_residual]}",
            "a strategy name cannot be empty",
        ),
        (
            "{optimizer: {kind: adamw, momentum: 0.9}}",
            "optimizer: momentum is for kind sgd; adamw's moments decay by betas: [b1, b2]",
        ),
        (
            "{optimizer: {kind: sgd, eps: 0.1}}",
            "optimizer: betas and eps are for kind adamw; sgd takes lr, momentum and weight_decay",
        ),
        (
            "{optimizer: {kind: sgd, state: bf16}}",
            "optimizer: sgd without momentum keeps no state, so state must stay f32 \
             (give momentum > 0 for a momentum buffer)",
        ),
    ];
    for (strategy, expected) in cases {
        // serde_yaml names the mapping the check ran on.
        let path = ["checkpoint", "optimizer"]
            .into_iter()
            .find(|key| strategy.starts_with(&format!("{{{key}:")))
            .map_or("strategies[0]".to_owned(), |key| {
                format!("strategies[0].{key}")
            });
        assert_eq!(
            strategy_message(strategy),
            format!("{path}: {expected}"),
            "{strategy}"
        );
    }
    let twice = suite_of(MODEL, "baseline\n  - baseline");
    assert_eq!(
        message(&twice),
        "strategies[1]: duplicate strategy name 'baseline': names must be unique within a suite"
    );
}

#[test]
fn a_global_batch_out_of_the_limits_is_a_typed_error_in_the_suite_s_words() {
    let suite = Suite::from_yaml(&suite_of(MODEL, "baseline"), "ok.yaml").unwrap();
    let model = &suite.models[0];
    let e = model.with_global_batch(0).unwrap_err();
    assert_eq!(e, ModelSpecError::BatchNotPositive { batch: 0 });
    assert_eq!(e.to_string(), "must be positive, got 0");
    let e = model.with_global_batch(-3).unwrap_err();
    assert_eq!(e.to_string(), "must be positive, got -3");
    let e = model.with_global_batch(1 << 25).unwrap_err();
    assert_eq!(e, ModelSpecError::BatchTooLarge { batch: 1 << 25 });
    assert_eq!(e.to_string(), "must be at most 16777216, got 33554432");
    let wide = Suite::from_yaml(
        &suite_of(
            "{name: w, kind: residual_linear, layers: 1, hidden: 4096, batch: [1]}",
            "baseline",
        ),
        "ok.yaml",
    )
    .unwrap();
    // At the limit, then one example past it.
    assert!(wide.models[0].with_global_batch(1 << 20).is_ok());
    let e = wide.models[0].with_global_batch((1 << 20) + 1).unwrap_err();
    assert!(
        matches!(e, ModelSpecError::InputTooLarge { elements, .. } if elements == 4_294_971_392),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "model 'w': an input of 4294971392 elements, more than the limit of 4294967296 \
         (16 GiB in f32); reduce batch or hidden"
    );
    assert_eq!(model.with_global_batch(8).unwrap().batch, [8]);
}

#[test]
fn strategies_that_cannot_run_say_why_in_these_words() {
    let cases = [
        (
            "{zero: 2}",
            Unavailable::ZeroNeedsRanks,
            "zero shards the training state over ranks: set world_size: N on the suite \
             (or --world-size N)",
        ),
        (
            "{with: [offload_grads: {to: disk}, grad_scaler]}",
            Unavailable::OffloadGradsWithScaler,
            "offload_grads keeps gradients in files, but grad_scaler must check every gradient \
             for inf/NaN at once; drop one",
        ),
        (
            "{with: [{optimizer: {in_backward: true}}, {accumulate: {micro_batches: 2}}]}",
            Unavailable::InBackwardWithAccumulation,
            "optimizer in_backward steps at every backward, so it cannot accumulate over \
             micro-batches in memory; drop accumulate or in_backward, or add offload_grads: \
             {to: disk}",
        ),
        (
            "{with: [{optimizer: {in_backward: true}}, grad_scaler]}",
            Unavailable::InBackwardWithScaler,
            "optimizer in_backward cannot check every gradient for inf/NaN before the first \
             update, so it cannot run with grad_scaler; drop one",
        ),
    ];
    for (strategy, expected, text) in cases {
        let suite = Suite::from_yaml(&suite_of(MODEL, strategy), "ok.yaml").unwrap();
        let e = resolve(&suite.strategies[0]).unwrap_err();
        assert_eq!(e, expected, "{strategy}");
        assert_eq!(e.to_string(), text, "{strategy}");
    }
    let zoo = Suite::from_yaml(
        &suite_of(
            "{name: r, kind: resnet, depth: 18, image: [3, 32, 32], classes: 4, batch: 2}",
            "safe_residual",
        ),
        "ok.yaml",
    )
    .unwrap();
    let why = memsave_bench::availability(&zoo.models[0], &zoo.strategies[0], None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        why,
        "the model 'r' (resnet) has no residual blocks to apply Safe to (the zoo's blocks add \
         as their architecture does)"
    );
}

/// An unknown lever in `fit: {allow: [...]}` is reported at the lever itself.
#[test]
fn an_unknown_fit_lever_is_reported_at_its_own_place() {
    let yaml = suite_of(MODEL, "fit: {budget: 1MiB, allow: [bf16, fp4]}");
    let e = Suite::from_yaml(&yaml, "bad.yaml").unwrap_err().to_string();
    assert_eq!(
        e,
        "bad.yaml:5:39: strategies[0].fit.allow[1]: fit: unknown lever 'fp4' in allow, \
         expected bf16, compress, int8_state or micro_batches"
    );
}
