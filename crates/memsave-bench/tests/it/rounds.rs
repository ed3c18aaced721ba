//! `memsave bench` times each model's strategies in interleaved rounds, and measures
//! their memory as it did when each case ran its steps back to back.
use memsave_bench::{
    bundled, run_suite, run_suite_with, CaseResult, Observer, Rounds, RunOptions, Status, Suite,
};
use serial_test::serial;

/// What a run told its observer, in order.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    Started(String),
    Timed(String, usize, usize),
    Finished(String),
}

#[derive(Default)]
struct Log(Vec<Event>);

impl Observer for Log {
    fn case_started(&mut self, _model: &str, strategy: &str) {
        self.0.push(Event::Started(strategy.to_owned()));
    }
    fn case_finished(&mut self, case: &CaseResult) {
        self.0.push(Event::Finished(case.strategy.clone()));
    }
    fn timed_step(&mut self, _model: &str, strategy: &str, round: usize, rounds: usize) {
        self.0
            .push(Event::Timed(strategy.to_owned(), round, rounds));
    }
}

const TINY: &str = "
suite: rounds
warmup: 1
repeats: 3
models:
  - {name: tiny, kind: residual_linear, layers: 3, hidden: 8, batch: [4]}
strategies:
  - inplace_add
  - baseline
  - checkpoint: {every_layer: true}
  - {name: adamw, with: [{optimizer: {kind: adamw}}]}
  # Optimizers stepping in backward hold a hook on every parameter (one per tensor).
  - {name: adamw-in-backward, with: [{optimizer: {kind: adamw, in_backward: true}}]}
  - {name: sgd-in-backward, with: [{optimizer: {kind: sgd, momentum: 0.9, in_backward: true}}]}
  - accumulate: {micro_batches: 2}
";

#[test]
#[serial]
fn each_round_steps_every_measured_strategy_once_alternating_the_order() {
    let suite = Suite::from_yaml(TINY, "rounds.yaml").unwrap();
    let mut log = Log::default();
    // No rounds past the suite's 3 (see the steadiness test below).
    let options = RunOptions {
        rounds: Rounds {
            target_spread: 0.0,
            ..Rounds::default()
        },
        ..RunOptions::default()
    };
    let report = run_suite_with(&suite, &options, &mut log).unwrap();
    let timed: Vec<(String, usize)> = log
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Timed(s, round, rounds) => {
                assert_eq!(*rounds, 3);
                Some((s.clone(), *round))
            }
            _ => None,
        })
        .collect();
    // `inplace_add` fails at backward: it is not timed. The others in suite order,
    // then backwards, then forwards again.
    let forwards = [
        "baseline",
        "checkpoint(every_layer=true)",
        "adamw",
        "adamw-in-backward",
        "sgd-in-backward",
        "accumulate(micro_batches=2)",
    ];
    let mut expected = Vec::new();
    for round in 0..3 {
        let mut order = forwards.to_vec();
        if round == 1 {
            order.reverse();
        }
        expected.extend(order.into_iter().map(|s| (s.to_owned(), round)));
    }
    assert_eq!(timed, expected);

    // Every case is set up and measured before the first timed step, and a measured
    // case ends after the last.
    let first_timed = log
        .0
        .iter()
        .position(|e| matches!(e, Event::Timed(..)))
        .unwrap();
    let last_timed = log
        .0
        .iter()
        .rposition(|e| matches!(e, Event::Timed(..)))
        .unwrap();
    let started = log
        .0
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Event::Started(_)));
    assert_eq!(started.clone().count(), 7);
    assert!(started.clone().all(|(i, _)| i < first_timed));
    for strategy in forwards {
        let finished = log
            .0
            .iter()
            .position(|e| *e == Event::Finished(strategy.to_owned()))
            .unwrap();
        assert!(
            finished > last_timed,
            "{strategy} ended before the rounds did"
        );
    }

    for case in &report.cases {
        // Each case ran (two optimizers in backward were never alive at once).
        assert_eq!(
            case.status == Status::Ok,
            case.strategy != "inplace_add",
            "{}: {:?}",
            case.strategy,
            case.error
        );
        if case.strategy == "inplace_add" {
            assert_eq!(case.rounds, None);
            assert!(case.step_time_s.is_none());
        } else {
            assert_eq!(case.rounds, Some(3), "{}", case.strategy);
            let t = case.step_time_s.unwrap();
            assert!(t.min > 0.0 && t.min <= t.median && t.median <= t.max);
        }
    }
    // The table says how the times were taken.
    let table = report.to_table();
    assert!(
        table.contains(
            "time: the median of 3 rounds; each round times every strategy of a model once"
        ),
        "{table}"
    );
    // And the JSON carries the number.
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["cases"][1]["rounds"], 3);
    assert!(json["cases"][0]["rounds"].is_null());
}

#[test]
#[serial]
fn repeats_is_the_number_of_rounds() {
    let suite = Suite::from_yaml(TINY, "rounds.yaml").unwrap();
    let options = RunOptions {
        repeats: Some(2),
        warmup: Some(0),
        ..RunOptions::default()
    };
    let mut log = Log::default();
    let report = run_suite_with(&suite, &options, &mut log).unwrap();
    let rounds: Vec<usize> = log
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Timed(s, round, 2) if s == "baseline" => Some(*round),
            _ => None,
        })
        .collect();
    assert_eq!(rounds, [0, 1]);
    assert_eq!(report.baseline("tiny").unwrap().rounds, Some(2));
    assert!(report.to_table().contains("time: the median of 2 rounds;"));
}

#[test]
#[serial]
fn from_three_repeats_rounds_are_added_until_the_medians_are_steady() {
    // A target no step time meets: the rounds go on to the cap, every median gets its
    // spread (from 6 rounds), and the table shows it beside the time.
    let suite = Suite::from_yaml(TINY, "rounds.yaml").unwrap();
    let options = RunOptions {
        filter: Some(regex::Regex::new("baseline|every_layer").unwrap()),
        rounds: Rounds {
            target_spread: 1e-12,
            max_rounds: 7,
            max_time_s: 600.0,
        },
        ..RunOptions::default()
    };
    let mut log = Log::default();
    let report = run_suite_with(&suite, &options, &mut log).unwrap();
    let rounds: Vec<(usize, usize)> = log
        .0
        .iter()
        .filter_map(|e| match e {
            Event::Timed(s, round, most) if s == "baseline" => Some((*round, *most)),
            _ => None,
        })
        .collect();
    assert_eq!(rounds, (0..7).map(|r| (r, 7)).collect::<Vec<_>>());
    for case in &report.cases {
        assert_eq!(case.rounds, Some(7), "{}", case.strategy);
        let t = case.step_time_s.unwrap();
        let spread = t.spread.unwrap();
        // Seven times: the fastest to the slowest (98.4%), over the median.
        assert_eq!(
            spread,
            (t.max - t.min) / 2.0 / t.median,
            "{}",
            case.strategy
        );
    }
    let table = report.to_table();
    assert!(table.contains(" ±"), "{table}");
    assert!(
        table.contains("±: half the width of the median's 95% confidence interval"),
        "{table}"
    );
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert!(json["cases"][0]["step_time_s"]["spread"].is_f64(), "{json}");
}

/// The byte figures of a case: start, peak, retained after forward, offloaded,
/// compressed away, optimizer state.
type Figures = [Option<u64>; 6];

fn figures(c: &CaseResult) -> Figures {
    [
        c.start_bytes,
        c.peak_bytes,
        c.retained_after_forward_bytes,
        c.offloaded_bytes,
        c.compressed_saved_bytes,
        c.optimizer_state_bytes,
    ]
}

/// Runs the bundled suite `name` with `repeats` rounds and checks every case's byte
/// figures against `expected`.
fn same_bytes_as_back_to_back(name: &str, repeats: usize, expected: &[(&str, Figures)]) {
    let suite = Suite::from_yaml(bundled(name).unwrap().source, "suite.yaml").unwrap();
    let options = RunOptions {
        repeats: Some(repeats),
        ..RunOptions::default()
    };
    // The expected figures come from a process of their own; this one may hold what an
    // earlier test left (a failing `inplace_add` step leaks its reference cycle), which
    // every case's start counts: measured from what is allocated before the run.
    let before = memsave_meter::f_memory_allocated(tch::Device::Cpu).unwrap();
    let report = run_suite(&suite, &options).unwrap();
    let got: Vec<(&str, Figures)> = report
        .cases
        .iter()
        .map(|c| {
            let mut f = figures(c);
            f[0] = f[0].map(|start| start - before);
            (c.strategy.as_str(), f)
        })
        .collect();
    assert_eq!(got, expected);
}

#[test]
#[serial]
fn the_seed_suite_measures_the_bytes_it_did_back_to_back() {
    // `memsave bench suites/seed.yaml --json` before the rounds (commit b2fd973: warm-up
    // 1, the last of 3 back-to-back repeats measured).
    let expected: &[(&str, Figures)] = &[
        (
            "baseline",
            [
                Some(20746240),
                Some(143360008),
                Some(102400000),
                None,
                None,
                None,
            ],
        ),
        ("inplace_add", [None, None, None, None, None, None]),
        ("add_out", [None, None, None, None, None, None]),
        (
            "safe_residual",
            [
                Some(20746240),
                Some(143360008),
                Some(102400000),
                None,
                None,
                None,
            ],
        ),
        (
            "checkpoint(segments=3)",
            [
                Some(20746240),
                Some(102400008),
                Some(61440000),
                None,
                None,
                None,
            ],
        ),
        (
            "checkpoint(every_layer=true)",
            [
                Some(20746240),
                Some(143360008),
                Some(102400000),
                None,
                None,
                None,
            ],
        ),
        (
            "checkpoint(nested=true)",
            [
                Some(20746240),
                Some(81920008),
                Some(40960000),
                None,
                None,
                None,
            ],
        ),
        (
            "checkpoint(budget=60MiB)",
            [
                Some(20746240),
                Some(61440008),
                Some(20480000),
                None,
                None,
                None,
            ],
        ),
        (
            "autocast(dtype=bf16)",
            [
                Some(20746240),
                Some(107118600),
                Some(66693120),
                None,
                None,
                None,
            ],
        ),
        (
            "accumulate(micro_batches=4)",
            [
                Some(20746240),
                Some(47779848),
                Some(37130240),
                None,
                None,
                None,
            ],
        ),
        (
            "ckpt+bf16",
            [
                Some(20746240),
                Some(84017160),
                Some(46213120),
                None,
                None,
                None,
            ],
        ),
        (
            "offload(to=disk)",
            [
                Some(20746240),
                Some(51200008),
                Some(10240000),
                Some(92160000),
                None,
                None,
            ],
        ),
        (
            "compress(dtype=bf16)",
            [
                Some(20746240),
                Some(97280008),
                Some(56320000),
                None,
                Some(46080000),
                None,
            ],
        ),
        (
            "compress(dtype=fp8)",
            [
                Some(20746240),
                Some(74330008),
                Some(33370000),
                None,
                Some(69030000),
                None,
            ],
        ),
        (
            "compress(dtype=int8)",
            [
                Some(20746240),
                Some(74330008),
                Some(33370000),
                None,
                Some(69030000),
                None,
            ],
        ),
    ];
    same_bytes_as_back_to_back("seed", 2, expected);
}

#[test]
#[serial]
fn the_optimizer_suite_measures_the_bytes_it_did_back_to_back() {
    // As above, `suites/optimizer.yaml` (warm-up 1, the last of 3 repeats): each
    // case's optimizer state and saved weights are alive in its own memory step only.
    let expected: &[(&str, Figures)] = &[
        (
            "baseline",
            [
                Some(6743040),
                Some(12862088),
                Some(11796480),
                None,
                None,
                None,
            ],
        ),
        (
            "adamw",
            [
                Some(19901440),
                Some(12862088),
                Some(11796480),
                None,
                None,
                Some(13158400),
            ],
        ),
        (
            "adamw-in-backward",
            [
                Some(19901440),
                Some(12862088),
                Some(11796480),
                None,
                None,
                Some(13158400),
            ],
        ),
        (
            "ckpt",
            [
                Some(6743040),
                Some(8296328),
                Some(1310720),
                None,
                None,
                None,
            ],
        ),
        (
            "ckpt+adamw",
            [
                Some(19901440),
                Some(8296328),
                Some(1310720),
                None,
                None,
                Some(13158400),
            ],
        ),
        (
            "ckpt+adamw-in-backward",
            [
                Some(19901440),
                Some(3686408),
                Some(1310720),
                None,
                None,
                Some(13158400),
            ],
        ),
        (
            "ckpt+sgd-in-backward",
            [
                Some(6743040),
                Some(3686408),
                Some(1310720),
                None,
                None,
                Some(0),
            ],
        ),
        (
            "ckpt+adamw-bf16-in-backward",
            [
                Some(13322240),
                Some(4259872),
                Some(1310720),
                None,
                None,
                Some(6579200),
            ],
        ),
        (
            "ckpt+adamw-int8-in-backward",
            [
                Some(10084096),
                Some(4259872),
                Some(1310720),
                None,
                None,
                Some(3341056),
            ],
        ),
        (
            "ckpt+adamw-int8-disk",
            [
                Some(6743040),
                Some(8296328),
                Some(1310720),
                None,
                None,
                Some(0),
            ],
        ),
    ];
    same_bytes_as_back_to_back("optimizer", 2, expected);
}
