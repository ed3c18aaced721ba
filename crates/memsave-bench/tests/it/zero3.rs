//! `zero: 3` in suites: parsed (with `reshard_after_forward: false`) and refused at its
//! position like the other techniques, decided unavailable before any rank starts
//! where the engine cannot run it, and run on ranks through the step engine with the
//! per-rank `parameter_bytes`, `gathered_peak_bytes` and bytes sent the algorithm says.
//! Expected figures are worked out here from the model's size, not by the code under
//! test.
use crate::common::{bench_on_ranks, ok_case};
use memsave_bench::{availability, CaseResult, Report, Suite, Technique, ZeroSpec};
use std::path::Path;

/// Three residual linear layers of width 10: units of 10 × 10 + 10 = 110 values.
const UNIT: u64 = 110;
const LAYERS: u64 = 3;
const SUITE: &str = "suite: zero3
seed: 0
threads: 1
warmup: 1
repeats: 1
world_size: 2
models:
  - {name: lin, kind: residual_linear, layers: 3, hidden: 10, batch: [8]}
strategies:
  - {name: ddp, with: [{optimizer: {kind: adamw}}]}
  - {name: zero1, with: [{zero: 1}, {optimizer: {kind: adamw}}]}
  - {name: zero2, with: [{zero: 2}, {optimizer: {kind: adamw}}]}
  - {name: zero3, with: [{zero: 3}, {optimizer: {kind: adamw}}]}
  - {name: zero3-keep, with: [{zero: {stage: 3, reshard_after_forward: false}}, {optimizer: {kind: adamw}}]}
  - {name: zero3-in-backward, with: [{zero: 3}, {optimizer: {kind: adamw, in_backward: true}}]}
  - {name: zero3-ckpt-accum, with: [{zero: 3}, {optimizer: {kind: adamw}}, {checkpoint: {every_layer: true}}, {accumulate: {micro_batches: 2}}]}
  - {name: zero3-grads, with: [{zero: 3}]}
";

/// Runs the suite on `n` ranks through the CLI; returns the JSON report and the table.
fn bench(dir: &Path, n: usize, filter: Option<&str>) -> (Report, String) {
    bench_on_ranks(dir, "zero3", SUITE, n, filter)
}

/// (parameter bytes, gathered peak, bytes sent per step) of a case.
fn figures(c: &CaseResult) -> (u64, Option<u64>, u64) {
    (
        c.parameter_bytes.expect("parameter bytes"),
        c.gathered_peak_bytes,
        c.bytes_sent_per_step.expect("bytes sent"),
    )
}

#[test]
fn zero3_holds_a_shard_of_the_weights_and_sends_what_the_algorithm_says() {
    let dir = tempfile::tempdir().unwrap();
    let (one, _) = bench(dir.path(), 1, Some("ddp|zero3$"));
    let (two, table) = bench(dir.path(), 2, None);
    let (four, _) = bench(dir.path(), 4, Some("zero3$|zero3-keep"));
    let full = 4 * LAYERS * UNIT;
    // Every unit padded to a multiple of N on its own; a rank keeps ceil(110 / N)
    // values of each, and the 4-byte NaN freed weights read from.
    let shard = |n: u64| LAYERS * UNIT.div_ceil(n);
    let parameter_bytes = |n: u64| 4 * shard(n) + 4;
    let padded_unit = |n: u64| 4 * n * UNIT.div_ceil(n);
    // Resharding ZeRO-3 prefetches in backward (FsdpConfig::backward_prefetch, on by
    // default): the unit backward runs and the next one are gathered at once.
    let gathered_peak = |n: u64| 2 * padded_unit(n);
    // Every all-gather and reduce-scatter sends (N-1)/N of a padded unit. The first
    // layer's input needs no gradient, so its backward reads no weight and its unit is
    // not gathered again.
    let pass = |n: u64| 4 * (n - 1) * shard(n);
    let unit0 = |n: u64| 4 * (n - 1) * UNIT.div_ceil(n);
    // A reduce-scatter also carries one used-flag (an f32) per parameter of its unit
    // (weight and bias) in each of the N chunks: (N-1)/N of them are sent.
    let flags = |n: u64| 4 * (n - 1) * 2 * LAYERS;

    // One rank: the shards are the weights (and the NaN); nothing is sent.
    assert_eq!(figures(ok_case(&one, "ddp")), (full, None, 0));
    assert_eq!(
        figures(ok_case(&one, "zero3")),
        (parameter_bytes(1), Some(gathered_peak(1)), 0)
    );

    // Two ranks. DDP, ZeRO-1 and ZeRO-2 hold every weight and gather none.
    for strategy in ["ddp", "zero1", "zero2"] {
        let (params, gathered, _) = figures(ok_case(&two, strategy));
        assert_eq!((params, gathered), (full, None), "{strategy}");
    }
    // ZeRO-3: half the weights (110 divides by 2: no padding), two units gathered at
    // most; all-gathers in forward and backward and a reduce-scatter.
    assert_eq!(parameter_bytes(2), 4 * 165 + 4);
    assert_eq!(
        figures(ok_case(&two, "zero3")),
        (
            parameter_bytes(2),
            Some(gathered_peak(2)),
            3 * pass(2) - unit0(2) + flags(2)
        )
    );
    // Kept from forward to backward: every unit gathered at the end of the forward,
    // and backward gathers nothing.
    assert_eq!(
        figures(ok_case(&two, "zero3-keep")),
        (
            parameter_bytes(2),
            Some(LAYERS * padded_unit(2)),
            2 * pass(2) + flags(2)
        )
    );
    // Stepping in backward: the same traffic, and no gradient left after backward.
    let c = ok_case(&two, "zero3-in-backward");
    assert_eq!(figures(c), figures(ok_case(&two, "zero3")));
    assert_eq!(c.gradient_bytes, Some(0));
    // Every-layer checkpointing recomputes each unit in backward (gathering the first
    // one again too), and each of two micro-batches reduce-scatters.
    assert_eq!(
        figures(ok_case(&two, "zero3-ckpt-accum")),
        (
            parameter_bytes(2),
            Some(gathered_peak(2)),
            2 * (3 * pass(2) + flags(2))
        )
    );
    // ZeRO-3's optimizer state and gradients are the shards': two f32 moments and one
    // f32 gradient a shard value.
    let c = ok_case(&two, "zero3");
    assert_eq!(c.optimizer_state_bytes, Some(2 * 4 * shard(2)));
    assert_eq!(c.gradient_bytes, Some(4 * shard(2)));
    // Without an optimizer the averaged gradients stay in the shards.
    let c = ok_case(&two, "zero3-grads");
    assert_eq!(c.optimizer_state_bytes, None);
    assert_eq!(c.gradient_bytes, Some(4 * shard(2)));

    // Four ranks: 110 values pad to 112, 28 a rank a unit.
    assert_eq!(shard(4), 84);
    assert_eq!(
        figures(ok_case(&four, "zero3")),
        (
            parameter_bytes(4),
            Some(gathered_peak(4)),
            3 * pass(4) - unit0(4) + flags(4)
        )
    );
    assert_eq!(
        figures(ok_case(&four, "zero3-keep")),
        (
            parameter_bytes(4),
            Some(LAYERS * padded_unit(4)),
            2 * pass(4) + flags(4)
        )
    );

    // The table shows them.
    assert!(table.contains("params/rank"), "{table}");
    assert!(table.contains("gathered peak/rank"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("lin") && l.contains("zero3 ") && l.contains("664 B")),
        "{table}"
    );
}

const BASE: &str = "suite: t
world_size: 2
models:
  - {name: a, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
strategies:
  - {name: z, with: [{zero: 3}, {optimizer: {kind: adamw}}]}
";

fn error_of(yaml: &str) -> String {
    match Suite::from_yaml(yaml, "bad.yaml") {
        Ok(s) => panic!("accepted an invalid suite: {s:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn zero3_and_its_option_parse_and_bad_ones_are_errors_at_their_position() {
    let suite = Suite::from_yaml(BASE, "ok.yaml").unwrap();
    assert_eq!(
        suite.strategies[0].techniques[0],
        Technique::Zero(ZeroSpec {
            stage: 3,
            reshard_after_forward: true
        })
    );
    let keep = BASE.replace(
        "{name: z, with: [{zero: 3}, {optimizer: {kind: adamw}}]}",
        "{zero: {stage: 3, reshard_after_forward: false}}",
    );
    let suite = Suite::from_yaml(&keep, "ok.yaml").unwrap();
    assert_eq!(
        suite.strategies[0].name,
        "zero(stage=3, reshard_after_forward=false)"
    );
    let plain = BASE.replace(
        "{name: z, with: [{zero: 3}, {optimizer: {kind: adamw}}]}",
        "{zero: 3}",
    );
    assert_eq!(
        Suite::from_yaml(&plain, "ok.yaml").unwrap().strategies[0].name,
        "zero(stage=3)"
    );
    // The map form of the other stages.
    let two = BASE.replace("{zero: 3}", "{zero: {stage: 2}}");
    assert_eq!(
        Suite::from_yaml(&two, "ok.yaml").unwrap().strategies[0].techniques[0],
        Technique::Zero(ZeroSpec::stage(2))
    );

    for (to, position, needle) in [
        (
            "{zero: 4}",
            "6:29",
            "strategies[0].with[0].zero: a ZeRO stage must be 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters), got 4",
        ),
        (
            "{zero: {stage: 0}}",
            "6:29",
            "a ZeRO stage must be 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters), got 0",
        ),
        (
            "{zero: {stage: 2, reshard_after_forward: false}}",
            "6:29",
            "reshard_after_forward is an option of stage 3",
        ),
        (
            "{zero: {stage: 3, reshard: false}}",
            "6:",
            "reshard",
        ),
        ("{zero: {reshard_after_forward: false}}", "6:", "stage"),
        (
            "{zero: {stage: 3, reshard_after_forward: maybe}}",
            "6:",
            "reshard_after_forward",
        ),
    ] {
        let e = error_of(&BASE.replace("{zero: 3}", to));
        assert!(
            e.starts_with(&format!("bad.yaml:{position}")),
            "{to}: expected position {position} in: {e}"
        );
        assert!(e.contains(needle), "{to}: expected '{needle}' in: {e}");
    }
}

/// What the engine refuses under ZeRO-3 is unavailable before any rank starts, with
/// the reason naming the lever; what it runs is available.
#[test]
#[serial_test::parallel]
fn zero3_availability_is_decided_from_the_suite() {
    let yaml = "suite: t
world_size: 2
models:
  - {name: lin, kind: residual_linear, layers: 2, hidden: 8, batch: [4]}
  - {name: net, kind: resnet, depth: 18, image: [3, 32, 32], classes: 4, batch: 4}
  - {name: unet, kind: unet, image: [3, 16, 16], classes: 2, base: 4, levels: 2, batch: 4}
  - {name: tied, kind: llama, vocab: 64, dim: 16, layers: 1, heads: 2, seq: 8, tied: true, batch: 4}
strategies:
  - {name: plain, with: [{zero: 3}]}
  - {name: in-backward, with: [{zero: 3}, {optimizer: {kind: adamw, in_backward: true}}]}
  - {name: keep+ckpt, with: [{zero: {stage: 3, reshard_after_forward: false}}, {checkpoint: {every_layer: true}}]}
  - {name: scaler, with: [{zero: 3}, grad_scaler]}
  - {name: offload-grads, with: [{zero: 3}, {offload_grads: {to: disk}}]}
  - {name: in-backward+accum, with: [{zero: 3}, {optimizer: {kind: adamw, in_backward: true}}, {accumulate: {micro_batches: 2}}, {offload_grads: {to: disk}}]}
  - {name: in-backward+accum-only, with: [{zero: 3}, {optimizer: {kind: adamw, in_backward: true}}, {accumulate: {micro_batches: 2}}]}
  - {name: ddp-in-backward+accum, with: [{optimizer: {kind: adamw, in_backward: true}}, {accumulate: {micro_batches: 2}}]}
";
    let suite = Suite::from_yaml(yaml, "t.yaml").unwrap();
    let lin = &suite.models[0];
    let net = &suite.models[1];
    let strategy = |name: &str| {
        suite
            .strategies
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name}"))
    };
    for name in ["plain", "in-backward", "keep+ckpt"] {
        availability(lin, strategy(name), Some(2)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    for (name, needle) in [
        ("scaler", "grad_scaler cannot run with zero: 3"),
        ("offload-grads", "offload_grads cannot run with zero: 3"),
        (
            "in-backward+accum",
            "in_backward cannot accumulate over micro-batches with zero: 3",
        ),
        // Not one-process advice to add offload_grads, which zero: 3 and DDP refuse.
        (
            "in-backward+accum-only",
            "in_backward cannot accumulate over micro-batches with zero: 3",
        ),
        (
            "ddp-in-backward+accum",
            "in_backward cannot run data parallel",
        ),
    ] {
        let e = availability(lin, strategy(name), Some(2)).expect_err(name);
        assert!(e.to_string().contains(needle), "{name}: {e}");
        assert!(!e.to_string().contains("add offload_grads"), "{name}: {e}");
    }
    // A zoo chain runs: each layer's parameters are found by running it.
    availability(net, strategy("plain"), Some(2)).unwrap_or_else(|e| panic!("zoo chain: {e}"));
    // So does a network of blocks, one unit per block; a chain whose head is tied to
    // its embedding does not.
    availability(&suite.models[2], strategy("plain"), Some(2))
        .unwrap_or_else(|e| panic!("network of blocks: {e}"));
    let e = availability(&suite.models[3], strategy("plain"), Some(2)).expect_err("tied");
    assert!(
        e.to_string()
            .contains("zero: 3 shards one unit per layer (or block)")
            && e.to_string()
                .contains("ties its output head to the embedding"),
        "{e}"
    );
    // Without ranks, zero is unavailable.
    let e = availability(lin, strategy("plain"), None).expect_err("no ranks");
    assert!(e.to_string().contains("world_size"), "{e}");
}

/// `memsave trace` of the suite's `strategy` on its two ranks: rank 0's summary.
fn traced(dir: &Path, strategy: &str) -> String {
    std::fs::write(dir.join("zero3.yaml"), SUITE).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args([
            "trace",
            "zero3.yaml",
            "--model",
            "lin",
            "--strategy",
            strategy,
        ])
        .current_dir(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// (start, peak, end) of the `category` row of a summary, as printed.
fn row(summary: &str, category: &str) -> [String; 3] {
    let line = summary
        .lines()
        .find(|l| l.split_whitespace().next() == Some(category))
        .unwrap_or_else(|| panic!("no {category} row: {summary}"));
    // "parameter  664 B  664 B  664 B": a number and its unit per column.
    let cells: Vec<&str> = line.split_whitespace().skip(1).collect();
    assert_eq!(cells.len(), 6, "{line}");
    std::array::from_fn(|i| format!("{} {}", cells[2 * i], cells[2 * i + 1]))
}

#[test]
fn trace_on_ranks_files_zero3_shards_as_parameters_and_gradients_as_gradients() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 holds half of every unit (165 values) and the 4-byte zero, as
    // `parameter_bytes` says; without an optimizer its shards' averaged gradients (165
    // f32) stay to the end of the step.
    let zero3 = traced(dir.path(), "zero3-grads");
    assert_eq!(
        row(&zero3, "parameter"),
        ["664 B", "664 B", "664 B"].map(String::from),
        "{zero3}"
    );
    assert_eq!(row(&zero3, "gradient")[2], "660 B", "{zero3}");
    // DDP keeps the 330 gradients (1,320 bytes) until AdamW frees them; the peak, in
    // backward, holds them all.
    let ddp = traced(dir.path(), "ddp");
    assert_eq!(row(&ddp, "gradient")[1], "1.29 KiB", "{ddp}");
}
