//! `memsave fit SUITE --model M --budget B --world-size N`: the fit runs on N local
//! ranks and the data-parallel mode is chosen with the other levers, for a per-rank
//! budget below what ZeRO-2 alone needs (measured first by `memsave bench` on the same
//! ranks): on a model whose weights dominate the step only ZeRO-3 fits; the choice is
//! printed once, with each rank's measured peak; a rank's error comes back naming the
//! rank; a batch that does not divide among the ranks is refused before any rank
//! starts.
use crate::common::memsave;
use serial_test::serial;
use std::path::Path;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A suite of one model and ZeRO-2 with AdamW, in `dir/suite.yaml`.
fn write_suite(dir: &Path, model: &str) {
    let yaml = format!(
        "suite: fit-world-size\nwarmup: 1\nrepeats: 1\nmodels:\n  - {model}\nstrategies:\n  - name: zero2\n    with: [{{zero: 2}}, {{optimizer: {{kind: adamw}}}}]\n"
    );
    std::fs::write(dir.join("suite.yaml"), yaml).unwrap();
}

/// ZeRO-2's per-rank peak on 2 ranks as `memsave bench` measures it: the most a rank
/// allocated during the step (`start_bytes + peak_bytes`, the largest over the ranks),
/// which holds its parameters, its shard of the optimizer's state and its input.
fn zero2_per_rank_peak(dir: &Path) -> u64 {
    let out = memsave(
        &[
            "bench",
            "suite.yaml",
            "--world-size",
            "2",
            "--json",
            "zero2.json",
        ],
        dir,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("zero2.json")).unwrap()).unwrap();
    let case = &json["cases"][0];
    assert_eq!(case["status"], "ok", "{case}");
    case["start_bytes"].as_u64().unwrap() + case["peak_bytes"].as_u64().unwrap()
}

/// `memsave fit ... --world-size 2 --json fit.json` at `budget` bytes: its JSON report,
/// and its stdout.
fn fit_on_two_ranks(dir: &Path, model: &str, budget: u64) -> (serde_json::Value, String) {
    let out = memsave(
        &[
            "fit",
            "suite.yaml",
            "--model",
            model,
            "--budget",
            &format!("{budget}B"),
            "--world-size",
            "2",
            "--json",
            "fit.json",
        ],
        dir,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // fit puts its own copy of the weights back after a ZeRO-3 run: no word of them.
    assert!(
        !stderr.contains("dropped without f_restore_full_parameters"),
        "{stderr}"
    );
    let json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("fit.json")).unwrap()).unwrap();
    (json, stdout)
}

/// Each rank's measured peak in a report.
fn peaks_by_rank(json: &serde_json::Value) -> Vec<u64> {
    json["measured_peak_bytes_by_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect()
}

#[test]
#[serial]
fn fit_on_two_ranks_finds_a_configuration_below_zero2_s_per_rank_peak() {
    let dir = tempfile::tempdir().unwrap();
    // The activations (8 x 256 rows of width 32, a few tensors a layer) outweigh the
    // parameters: ZeRO-2 alone does not fit below its own peak, recompute or
    // micro-batches must join it.
    write_suite(
        dir.path(),
        "{name: lin, kind: residual_linear, layers: 4, hidden: 32, batch: [8, 256]}",
    );
    let zero2 = zero2_per_rank_peak(dir.path());
    let budget = zero2 * 4 / 5;
    let (json, stdout) = fit_on_two_ranks(dir.path(), "lin", budget);
    // The choice once (rank 0), with each rank's measured peak.
    assert_eq!(stdout.matches("choice: ").count(), 1, "{stdout}");
    assert!(
        stdout.contains("measured peak per rank: rank 0 "),
        "{stdout}"
    );
    assert!(stdout.contains(", rank 1 "), "{stdout}");
    assert_eq!(json["world_size"], 2, "{json}");
    assert_eq!(json["budget_bytes"].as_u64(), Some(budget));
    assert_eq!(json["global_batch"], 8, "the global batch is kept: {json}");
    let mode = json["choice"]["data_parallel"].as_str();
    assert!(
        matches!(mode, Some("ddp" | "zero1" | "zero2" | "zero3")),
        "a data-parallel mode is chosen: {json}"
    );
    let by_rank = peaks_by_rank(&json);
    assert_eq!(by_rank.len(), 2, "{json}");
    assert!(
        by_rank.iter().all(|&p| p > 0 && p <= budget),
        "measured per rank {by_rank:?}, budget {budget} (ZeRO-2 alone: {zero2})\n{stdout}"
    );
    // ZeRO-2 alone was among the candidates and did not fit.
    let zero2_alone = json["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["choice"]["strategy"] == "zero(stage=2)")
        .unwrap_or_else(|| panic!("zero(stage=2) considered\n{stdout}"));
    assert_eq!(zero2_alone["predicted_fits"], false, "{stdout}");
}

#[test]
#[serial]
fn where_the_weights_dominate_fit_on_two_ranks_fits_below_zero2_with_zero3() {
    let dir = tempfile::tempdir().unwrap();
    // 4 layers of 256 x 256: 263,168 parameters, with AdamW 16 bytes each (weights,
    // gradients, two moments: 4.2 MB on one process) against a batch of 4 rows of 256.
    write_suite(
        dir.path(),
        "{name: wide, kind: residual_linear, layers: 4, hidden: 256, batch: [4]}",
    );
    let zero2 = zero2_per_rank_peak(dir.path());
    let budget = zero2 * 4 / 5;
    let (json, stdout) = fit_on_two_ranks(dir.path(), "wide", budget);
    assert_eq!(json["world_size"], 2, "{json}");
    assert_eq!(json["global_batch"], 4, "the global batch is kept: {json}");
    assert_eq!(
        json["choice"]["data_parallel"], "zero3",
        "only sharding the weights fits below ZeRO-2's {zero2} B\n{stdout}"
    );
    let by_rank = peaks_by_rank(&json);
    assert_eq!(by_rank.len(), 2, "{json}");
    assert!(
        by_rank.iter().all(|&p| p > 0 && p <= budget),
        "measured per rank {by_rank:?}, budget {budget} (ZeRO-2 alone: {zero2})\n{stdout}"
    );
    eprintln!(
        "ZeRO-2 per rank {zero2} B, budget {budget} B, measured per rank {by_rank:?}\n{stdout}"
    );
}

#[test]
#[serial]
fn a_rank_s_error_comes_back_naming_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    write_suite(
        dir.path(),
        "{name: lin, kind: residual_linear, layers: 4, hidden: 32, batch: [8, 64]}",
    );
    // Above each rank's least before the ranks start (its half of the parameters
    // 8.25 KiB, of AdamW's state 16.5 KiB and of the batch 32 KiB, and the largest
    // gradient 4 KiB: 60.75 KiB), below what any step of a rank holds.
    let out = memsave(
        &[
            "fit",
            "suite.yaml",
            "--model",
            "lin",
            "--budget",
            "61KiB",
            "--world-size",
            "2",
        ],
        dir.path(),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: rank 0: no configuration fits 61.00 KiB")
            || last.starts_with("error: rank 1: no configuration fits 61.00 KiB"),
        "{stderr}"
    );
}

#[test]
#[serial]
fn a_batch_that_does_not_divide_among_the_ranks_is_refused_before_they_start() {
    let dir = tempfile::tempdir().unwrap();
    write_suite(
        dir.path(),
        "{name: lin, kind: residual_linear, layers: 2, hidden: 8, batch: [8]}",
    );
    let out = memsave(
        &[
            "fit",
            "suite.yaml",
            "--model",
            "lin",
            "--budget",
            "1MiB",
            "--world-size",
            "3",
        ],
        dir.path(),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--world-size 3: the global batch of 8 does not divide among 3 ranks"),
        "{stderr}"
    );
    assert!(!stderr.contains("[rank"), "no rank started: {stderr}");
}

/// A budget below what each rank holds at least is refused before any rank starts,
/// naming each rank's share: half of the parameters (8.25 KiB), of AdamW's state
/// (16.50 KiB) and of the batch (32.00 KiB), and the largest gradient whole (4.00 KiB):
/// 60.75 KiB.
#[test]
#[serial]
fn a_budget_below_each_rank_s_least_is_refused_before_the_ranks_start() {
    let dir = tempfile::tempdir().unwrap();
    write_suite(
        dir.path(),
        "{name: lin, kind: residual_linear, layers: 4, hidden: 32, batch: [8, 64]}",
    );
    let out = memsave(
        &[
            "fit",
            "suite.yaml",
            "--model",
            "lin",
            "--budget",
            "60KiB",
            "--world-size",
            "2",
        ],
        dir.path(),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("[rank"), "no rank started: {stderr}");
    for part in [
        "no configuration fits 60.00 KiB",
        "holds at least 60.75 KiB on the device",
        "parameters 8.25 KiB, optimizer state 16.50 KiB, largest gradient 4.00 KiB, batch 32.00 KiB",
        "each rank's share of all but the gradient, on 2 ranks",
        "give a budget of at least 60.75 KiB",
    ] {
        assert!(stderr.contains(part), "{part}: {stderr}");
    }
}
