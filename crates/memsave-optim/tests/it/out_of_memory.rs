//! An optimizer step that runs out of memory (the meter's simulated CPU limit) returns
//! `OptimError::OutOfMemory`, never panics, and with f32 state leaves the parameter it
//! failed on, its state and its step count as they were; with more memory the step can
//! be finished.
use memsave_meter::{f_measure, f_memory_allocated, MemoryLimitGuard};
use memsave_optim::{AdamW, AdamWConfig, OptimError, Options, Sgd, SgdConfig, State};
use serial_test::serial;
use std::panic::{self, AssertUnwindSafe};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

/// A parameter of `shape` with values from `seed`, and a gradient set through backward.
fn param(shape: &[i64], seed: i64, kind: Kind) -> Tensor {
    let n: i64 = shape.iter().product();
    let idx = Tensor::arange(n, (Kind::Float, CPU));
    let p = (&idx * 0.61 + seed as f64 * 0.37)
        .sin()
        .to_kind(kind)
        .view(shape)
        .set_requires_grad(true);
    let g = ((idx * 0.83 + seed as f64).cos() * 0.5)
        .to_kind(kind)
        .view(shape);
    (&p * &g).sum(Kind::Float).backward();
    p
}

/// The bits of every parameter, to compare before and after.
fn bits(params: &[Tensor]) -> Vec<Vec<u8>> {
    params
        .iter()
        .map(|p| {
            let p = p.detach().contiguous();
            let n = p.numel();
            let mut out = vec![0u8; n * p.kind().elt_size_in_bytes()];
            p.copy_data_u8(&mut out, n);
            out
        })
        .collect()
}

/// One optimizer under test, stepped through one interface.
enum Opt {
    AdamW(AdamW),
    Sgd(Sgd),
}

impl Opt {
    fn f_step(&mut self) -> Result<(), OptimError> {
        match self {
            Opt::AdamW(o) => o.f_step(),
            Opt::Sgd(o) => o.f_step(),
        }
    }
    fn f_step_param(&mut self, i: usize) -> Result<bool, OptimError> {
        match self {
            Opt::AdamW(o) => o.f_step_param(i),
            Opt::Sgd(o) => o.f_step_param(i),
        }
    }
    fn step_count(&self, i: usize) -> u64 {
        match self {
            Opt::AdamW(o) => o.step_count(i),
            Opt::Sgd(o) => o.step_count(i),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Rule {
    AdamW,
    SgdNesterov,
}

fn build(rule: Rule, params: &[Tensor], state: State, clip: bool) -> Opt {
    let options = Options {
        state,
        max_grad_norm: clip.then_some(0.5),
        ..Default::default()
    };
    match rule {
        Rule::AdamW => {
            Opt::AdamW(AdamW::with_options(params, AdamWConfig::default(), options).unwrap())
        }
        Rule::SgdNesterov => Opt::Sgd(
            Sgd::with_options(
                params,
                SgdConfig {
                    lr: 1e-2,
                    momentum: 0.9,
                    weight_decay: 1e-3,
                    nesterov: true,
                    ..Default::default()
                },
                options,
            )
            .unwrap(),
        ),
    }
}

/// What one case sets up: fresh parameters (each with a gradient) and an optimizer,
/// stepped `warm` times without a limit first (so that its state exists or not).
fn setup(
    rule: Rule,
    state: State,
    shapes: &[Vec<i64>],
    kind: Kind,
    clip: bool,
    warm: usize,
) -> (Vec<Tensor>, Opt) {
    let params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| param(s, i as i64 + 1, kind))
        .collect();
    let mut opt = build(rule, &params, state, clip);
    for _ in 0..warm {
        opt.f_step().unwrap();
    }
    (params, opt)
}

/// Steps every configuration under limits from nothing above what is allocated up to
/// the step's own peak: each try returns (never panics), an error is out of memory,
/// and enough memory makes it succeed.
#[test]
#[serial]
fn a_step_out_of_memory_is_an_error_never_a_panic() {
    memsave_meter::install();
    let shape_sets: [Vec<Vec<i64>>; 4] = [
        vec![vec![1]],
        vec![vec![7, 13], vec![13]],
        vec![vec![300, 11], vec![5], vec![2, 2, 3]],
        // Eight chunks in f32 on the CPU: the first allocates all the update needs.
        vec![vec![7], vec![2 * 65_536 + 37]],
    ];
    let states = [State::F32, State::Bf16, State::Int8Blockwise { block: 64 }];
    let mut tries = 0;
    let mut failed = 0;
    for rule in [Rule::AdamW, Rule::SgdNesterov] {
        for state in states {
            for shapes in &shape_sets {
                for (kind, clip, warm) in [
                    (Kind::Float, false, 0),
                    (Kind::Float, true, 1),
                    (Kind::BFloat16, false, 1),
                ] {
                    let case =
                        format!("{rule:?} {state:?} {shapes:?} {kind:?} clip={clip} warm={warm}");
                    // The step's peak above what is allocated before it, unlimited.
                    let (params, mut opt) = setup(rule, state, shapes, kind, clip, warm);
                    let (stepped, m) = f_measure(CPU, |_| opt.f_step()).unwrap();
                    stepped.unwrap_or_else(|e| panic!("{case}: unlimited: {e}"));
                    drop((params, opt));
                    let peak = m.peak_bytes;
                    // Every few bytes at first (the small tensors a step makes), then
                    // every 1/16 of the peak, then the peak itself, which must fit.
                    let mut extras: Vec<u64> = (0..=64).step_by(4).collect();
                    extras.extend((1..16).map(|i| peak * i / 16));
                    extras.push(peak);
                    for extra in extras {
                        let (params, mut opt) = setup(rule, state, shapes, kind, clip, warm);
                        let before = bits(&params);
                        let counts: Vec<u64> =
                            (0..params.len()).map(|i| opt.step_count(i)).collect();
                        let start = f_memory_allocated(CPU).unwrap();
                        let outcome = {
                            let _limit = MemoryLimitGuard::f_new(CPU, start + extra).unwrap();
                            panic::catch_unwind(AssertUnwindSafe(|| opt.f_step()))
                        };
                        tries += 1;
                        let outcome = outcome.unwrap_or_else(|payload| {
                            let message = payload
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_default();
                            panic!("{case}, {extra} bytes: the step panicked: {message}")
                        });
                        match outcome {
                            Ok(()) => {}
                            Err(e) => {
                                failed += 1;
                                assert!(extra < peak, "{case}: the step's own peak failed: {e}");
                                assert!(
                                    e.is_out_of_memory(),
                                    "{case}, {extra} bytes: not an out-of-memory error: {e:?}"
                                );
                                assert!(
                                    matches!(e, OptimError::OutOfMemory { .. }),
                                    "{case}, {extra} bytes: {e:?}"
                                );
                                assert!(!e.to_string().contains('\n'), "one line: {e}");
                                // f32 state: the parameter it failed on is as it was,
                                // and so are those after it; those before it stepped.
                                if state == State::F32 {
                                    let after = bits(&params);
                                    let stepped: Vec<bool> = (0..params.len())
                                        .map(|i| opt.step_count(i) > counts[i])
                                        .collect();
                                    for i in 0..params.len() {
                                        if stepped[i] {
                                            assert!(
                                                i == 0 || stepped[i - 1],
                                                "{case}: parameters step in order"
                                            );
                                        } else {
                                            assert_eq!(
                                                after[i], before[i],
                                                "{case}, {extra} bytes: parameter {i} changed without stepping"
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // The sweep did reach both sides of every step's peak.
    assert!(failed > 0 && failed < tries, "{failed} of {tries} failed");
}

/// After an out-of-memory error on parameter `k` (f32 state), stepping parameters
/// `k..` one by one once memory is there finishes the step: the bits of an optimizer
/// that never failed, and every step count at 2.
#[test]
#[serial]
fn a_failed_step_can_be_finished_with_f32_state() {
    memsave_meter::install();
    // A small parameter first, then a large one: 400 bytes fit the first's update only.
    let shapes = vec![vec![9], vec![50, 9]];
    for rule in [Rule::AdamW, Rule::SgdNesterov] {
        let (reference, mut clean) = setup(rule, State::F32, &shapes, Kind::Float, false, 1);
        clean.f_step().unwrap();
        for (extra, failing) in [(16, 0), (400, 1)] {
            let (params, mut opt) = setup(rule, State::F32, &shapes, Kind::Float, false, 1);
            let start = f_memory_allocated(CPU).unwrap();
            let failed = {
                let _limit = MemoryLimitGuard::f_new(CPU, start + extra).unwrap();
                opt.f_step()
            };
            match failed {
                Err(OptimError::OutOfMemory {
                    parameter: Some(k), ..
                }) => assert_eq!(k, failing, "{rule:?}, {extra} bytes"),
                other => panic!("{rule:?}, {extra} bytes: {other:?}"),
            }
            for k in failing..params.len() {
                assert!(opt.f_step_param(k).unwrap());
            }
            assert_eq!(bits(&params), bits(&reference), "{rule:?}, {extra} bytes");
            for k in 0..params.len() {
                assert_eq!(opt.step_count(k), 2, "{rule:?}, {extra} bytes");
            }
        }
    }
}
