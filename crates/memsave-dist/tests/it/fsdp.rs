//! ZeRO-3 (`Fsdp`): 1, 2 and 4 ranks (processes over 127.0.0.1) train 8 linear layers
//! for 20 steps with every layer a fully sharded unit, with and without every-layer
//! checkpointing, with accumulation over 3 micro-batches, with and without
//! `reshard_after_forward`; the weights must equal single-process training, and each
//! rank's resident parameter bytes, gathered bytes and bytes sent must be what the
//! algorithm says.
use crate::common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memsave_dist::{init_process_group, Fsdp, FsdpConfig, FsdpUnit, InitOptions, ProcessGroup};
use memsave_meter::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
use memsave_optim::{AdamW, AdamWConfig};
use serial_test::serial;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 20;
/// The batch of the ZeRO-3 tests (`data`).
pub(crate) const BATCH: i64 = 24;
/// Widths of the 8 layers' inputs and outputs: units of 96, 221, 224, 187, 192, 153,
/// 160 and 51 values, 1,284 in all (odd sizes, so that 2 and 4 ranks pad).
pub(crate) const DIMS: [i64; 9] = [5, 16, 13, 16, 11, 16, 9, 16, 3];
pub(crate) const CONFIG: AdamWConfig = AdamWConfig {
    lr: 1e-2,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 1e-2,
};

/// Values of layer `i` (weight and bias), computed from the widths.
fn unit_values(i: usize) -> u64 {
    (DIMS[i] * DIMS[i + 1] + DIMS[i + 1]) as u64
}

fn layers() -> (nn::VarStore, Vec<nn::Linear>) {
    layers_of(&DIMS, 1)
}

/// Linear layers of the given widths, initialized from `seed`.
pub(crate) fn layers_of(dims: &[i64], seed: i64) -> (nn::VarStore, Vec<nn::Linear>) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let layers = (0..dims.len() - 1)
        .map(|i| {
            nn::linear(
                vs.root() / format!("l{i}"),
                dims[i],
                dims[i + 1],
                Default::default(),
            )
        })
        .collect();
    (vs, layers)
}

/// The inputs and targets every ZeRO-3 test of these 8 layers trains on.
pub(crate) fn data() -> (Tensor, Tensor) {
    tch::manual_seed(2);
    let x = Tensor::randn([BATCH, DIMS[0]], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([BATCH, DIMS[8]], (Kind::Float, Device::Cpu));
    (x, y)
}

/// Layer `i`'s forward: linear, then tanh except after the last.
pub(crate) fn layer_forward(lin: &nn::Linear, i: usize, x: &Tensor) -> Tensor {
    let y = lin.forward(x);
    if i < 7 {
        y.tanh()
    } else {
        y
    }
}

pub(crate) fn flat(params: &[Tensor]) -> Vec<f32> {
    params
        .iter()
        .flat_map(|p| Vec::<f32>::try_from(p.detach().reshape([-1])).expect("f32 values"))
        .collect()
}

/// Single-process training on the whole batch, AdamW with f32 state: the reference.
fn reference() -> Vec<f32> {
    reference_by_step(STEPS).pop().expect("at least one step")
}

/// The weights after each of `steps` steps of single-process AdamW (f32 state, stepped
/// after backward) on the whole batch, in the order the units take them (each layer's
/// weight, then its bias).
pub(crate) fn reference_by_step(steps: usize) -> Vec<Vec<f32>> {
    let (_vs, layers) = layers();
    let (x, y) = data();
    let ordered: Vec<Tensor> = layers
        .iter()
        .flat_map(|l| [l.ws.shallow_clone(), l.bs.as_ref().unwrap().shallow_clone()])
        .collect();
    let mut opt = AdamW::new(&ordered, CONFIG).expect("optimizer");
    let mut out = Vec::new();
    for _ in 0..steps {
        opt.zero_grad(true);
        let mut h = x.shallow_clone();
        for (i, lin) in layers.iter().enumerate() {
            h = layer_forward(lin, i, &h);
        }
        h.mse_loss(&y, tch::Reduction::Mean).backward();
        opt.f_step().expect("step");
        out.push(flat(&ordered));
    }
    out
}

/// How a run uses the units.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Setup {
    /// Every unit inside a checkpoint (recomputed in backward).
    checkpoint: bool,
    /// The checkpoints' recomputation stops after the last tensor backward needs
    /// (unwinding the unit's forward from there).
    early_stop: bool,
    micro: i64,
    reshard_after_forward: bool,
    backward_prefetch: bool,
}

const SETUPS: [Setup; 7] = [
    Setup {
        checkpoint: false,
        early_stop: false,
        micro: 1,
        reshard_after_forward: true,
        backward_prefetch: true,
    },
    Setup {
        checkpoint: true,
        early_stop: false,
        micro: 1,
        reshard_after_forward: true,
        backward_prefetch: true,
    },
    Setup {
        checkpoint: false,
        early_stop: false,
        micro: 3,
        reshard_after_forward: true,
        backward_prefetch: true,
    },
    Setup {
        checkpoint: true,
        early_stop: true,
        micro: 3,
        reshard_after_forward: true,
        backward_prefetch: true,
    },
    Setup {
        checkpoint: false,
        early_stop: false,
        micro: 1,
        reshard_after_forward: false,
        backward_prefetch: true,
    },
    // Without backward prefetch: one unit gathered at a time.
    Setup {
        checkpoint: false,
        early_stop: false,
        micro: 1,
        reshard_after_forward: true,
        backward_prefetch: false,
    },
    Setup {
        checkpoint: true,
        early_stop: false,
        micro: 1,
        reshard_after_forward: true,
        backward_prefetch: false,
    },
];

fn name(setup: Setup) -> String {
    format!(
        "ckpt{}-m{}-reshard{}-prefetch{}",
        setup.checkpoint as u8,
        setup.micro,
        setup.reshard_after_forward as u8,
        setup.backward_prefetch as u8
    )
}

/// The model as fully sharded units: each layer one unit.
pub(crate) fn sharded(fsdp: &mut Fsdp, layers: Vec<nn::Linear>) -> Vec<Arc<Mutex<FsdpUnit>>> {
    layers
        .into_iter()
        .enumerate()
        .map(|(i, lin)| {
            let params = [
                lin.ws.shallow_clone(),
                lin.bs.as_ref().expect("bias").shallow_clone(),
            ];
            let module = nn::func(move |x| layer_forward(&lin, i, x));
            Arc::new(Mutex::new(
                fsdp.fully_shard(module, &params).expect("fully_shard"),
            ))
        })
        .collect()
}

/// The chain's forward, each unit inside a checkpoint when asked.
fn forward(units: &[Arc<Mutex<FsdpUnit>>], x: &Tensor, setup: Setup) -> Tensor {
    let mut h = x.shallow_clone();
    for unit in units {
        h = if setup.checkpoint {
            let unit = Arc::clone(unit);
            let f: memsave_sys::checkpoint::CheckpointFn = Box::new(move |xs: &[Tensor]| {
                let unit = unit.lock().unwrap_or_else(|e| e.into_inner());
                unit.f_forward_t(&xs[0], true)
                    .map(|y| vec![y])
                    .map_err(|e| e.to_string().into())
            });
            memsave_sys::checkpoint::checkpoint(&[h], false, setup.early_stop, f)
                .expect("checkpoint")
                .remove(0)
        } else {
            units_forward(unit, &h)
        };
    }
    h
}

pub(crate) fn units_forward(unit: &Arc<Mutex<FsdpUnit>>, x: &Tensor) -> Tensor {
    unit.lock().unwrap().forward_t(x, true)
}

/// Trains this rank's share of the batch under `setup`; writes the final weights and
/// the measured figures.
fn train_rank(group: &ProcessGroup, setup: Setup, out: &Path) {
    let (rank, n) = (group.rank() as i64, group.world_size() as i64);
    let (x, y) = data();
    let local = BATCH / n;
    let (x, y) = (
        x.narrow(0, rank * local, local),
        y.narrow(0, rank * local, local),
    );
    let per_micro = local / setup.micro;
    let baseline = memory_allocated(Device::Cpu);
    let (vs, layers) = layers();
    let config = FsdpConfig {
        reshard_after_forward: setup.reshard_after_forward,
        backward_prefetch: setup.backward_prefetch,
        ..Default::default()
    };
    let mut fsdp = Fsdp::new(group, config).expect("fsdp");
    let units = sharded(&mut fsdp, layers);
    let mut figures = String::new();
    // Bytes held once sharded: the shards and the placeholder (the VarStore's tensors
    // now read from the placeholder).
    writeln!(
        figures,
        "sharded_bytes {}",
        memory_allocated(Device::Cpu) - baseline
    )
    .unwrap();
    let mut opt = AdamW::new(&fsdp.parameters(), CONFIG).expect("optimizer");
    let mut sent = Vec::new();
    let mut between = Vec::new();
    let mut peaks = Vec::new();
    let mut after_forward = Vec::new();
    let mut saved = Vec::new();
    let mut backward_peaks = Vec::new();
    for _ in 0..STEPS {
        let before = group.bytes_sent();
        fsdp.reset_gathered_peak();
        reset_peak_memory_stats(Device::Cpu);
        let start = memory_allocated(Device::Cpu);
        for m in 0..setup.micro {
            let (xm, ym) = (
                x.narrow(0, m * per_micro, per_micro),
                y.narrow(0, m * per_micro, per_micro),
            );
            let loss = fsdp
                .forward(|| {
                    forward(&units, &xm, setup).mse_loss(&ym, tch::Reduction::Mean)
                        / setup.micro as f64
                })
                .expect("forward");
            if m == 0 {
                let held = memory_allocated(Device::Cpu) - start;
                after_forward.push(held);
                // What the step saves for backward (and the loss): held after the
                // forward, less the full weights still gathered then.
                saved.push(held - fsdp.stats().gathered_bytes);
            }
            loss.backward();
        }
        fsdp.f_finish_backward().expect("finish_backward");
        backward_peaks.push(max_memory_allocated(Device::Cpu) - start);
        opt.f_step().expect("step");
        opt.zero_grad(true);
        sent.push(group.bytes_sent() - before);
        peaks.push(max_memory_allocated(Device::Cpu) - start);
        // Gloo's worker thread sometimes lets go of a reduce-scatter's input (the last
        // unit's, 2 x 192 bytes at N=2) a moment after the call returns; the next
        // collective waits for it to be done.
        group.barrier().expect("barrier");
        between.push(memory_allocated(Device::Cpu) - baseline);
    }
    let stats = fsdp.stats();
    assert!(
        sent.windows(2).all(|w| w[0] == w[1]),
        "same bytes every step: {sent:?}"
    );
    assert!(
        between[1..].windows(2).all(|w| w[0] == w[1]),
        "the same bytes held between steps from the second on: {between:?}"
    );
    writeln!(figures, "bytes_sent_per_step {}", sent[0]).unwrap();
    writeln!(figures, "between_steps {}", between[STEPS - 1]).unwrap();
    writeln!(figures, "state_bytes {}", opt.state_bytes()).unwrap();
    writeln!(figures, "peak_above_start {}", peaks[STEPS - 1]).unwrap();
    writeln!(figures, "after_forward {}", after_forward[STEPS - 1]).unwrap();
    writeln!(figures, "saved_bytes {}", saved[STEPS - 1]).unwrap();
    writeln!(figures, "backward_peak {}", backward_peaks[STEPS - 1]).unwrap();
    writeln!(figures, "gathered_peak_bytes {}", stats.gathered_peak_bytes).unwrap();
    writeln!(figures, "parameter_bytes {}", stats.parameter_bytes).unwrap();
    writeln!(figures, "padding_values {}", stats.padding_values).unwrap();
    writeln!(figures, "gathered_bytes {}", stats.gathered_bytes).unwrap();
    let full = fsdp.f_full_parameters().expect("full parameters");
    let tag = format!("{}-rank{rank}", name(setup));
    let bytes: Vec<u8> = flat(&full).iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(out.join(format!("{tag}.params")), bytes).expect("write params");
    std::fs::write(out.join(format!("{tag}.figures")), figures).expect("write figures");
    drop(vs);
}

#[test]
#[ignore = "a rank of the ZeRO-3 tests: started by the launcher"]
fn fsdp_worker() {
    memsave_meter::install();
    let out = common::out_dir();
    let options = InitOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    for setup in SETUPS {
        train_rank(&group, setup, &out);
    }
}

fn read_params(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn figures(path: &Path) -> BTreeMap<String, u64> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("key value");
            (k.to_owned(), v.parse().expect("a number"))
        })
        .collect()
}

/// Largest difference between `got` and `expected`, relative to the largest |expected|.
fn relative_difference(got: &[f32], expected: &[f32]) -> f32 {
    assert_eq!(got.len(), expected.len());
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / scale
}

fn check_world(n: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    common::run_ranks("fsdp::fsdp_worker", n, dir.path()).expect("every rank succeeds");
    let expected = reference();
    let n64 = n as u64;
    // Each unit padded to a multiple of N on its own: this rank's shard of unit u has
    // ceil(P_u / N) values.
    let shard_values: u64 = (0..8).map(|i| unit_values(i).div_ceil(n64)).sum();
    let total: u64 = (0..8).map(unit_values).sum();
    let mut padded: Vec<u64> = (0..8).map(|i| unit_values(i).div_ceil(n64) * n64).collect();
    padded.sort_unstable();
    let largest_unit = padded[7];
    // The two largest units (1 and 2, 221 and 224 values before padding) are
    // neighbours: backward prefetches unit 1 while unit 2 is gathered.
    let two_largest = padded[6] + padded[7];
    let padded_units: u64 = shard_values * n64;
    let mut report = String::new();
    // By the meter: after a forward without checkpoints, resharding holds every unit's
    // full weights less than keeping them (activations and gradients being equal).
    for rank in 0..n {
        let f = |setup| {
            figures(
                &dir.path()
                    .join(format!("{}-rank{rank}.figures", name(setup))),
            )
        };
        let (resharded, kept) = (f(SETUPS[0]), f(SETUPS[4]));
        assert_eq!(
            kept["after_forward"] - resharded["after_forward"],
            4 * padded_units,
            "rank {rank}: bytes held after the forward, kept minus resharded"
        );
    }
    for setup in SETUPS {
        for rank in 0..n {
            let tag = format!("{}-rank{rank}", name(setup));
            let got = read_params(&dir.path().join(format!("{tag}.params")));
            let difference = relative_difference(&got, &expected);
            assert!(
                difference <= 1e-6,
                "{tag}: weights differ from one process by {difference} of the largest"
            );
            let f = figures(&dir.path().join(format!("{tag}.figures")));
            // Resident parameters: the shards plus the 4-byte placeholder, by the meter.
            let parameter_bytes = 4 * shard_values + 4;
            assert_eq!(f["sharded_bytes"], parameter_bytes, "{tag}: after sharding");
            assert_eq!(f["parameter_bytes"], parameter_bytes, "{tag}: reported");
            assert_eq!(
                f["padding_values"],
                shard_values - total.div_ceil(n64),
                "{tag}"
            );
            assert!(
                shard_values - total.div_ceil(n64) < 8,
                "{tag}: fewer than one value of padding per unit"
            );
            // AdamW's two f32 moments per shard value.
            assert_eq!(f["state_bytes"], 8 * shard_values, "{tag}");
            assert_eq!(
                f["between_steps"],
                parameter_bytes + f["state_bytes"],
                "{tag}: bytes held between steps, by the meter: parameters and state only"
            );
            assert_eq!(
                f["gathered_bytes"], 0,
                "{tag}: nothing gathered between steps"
            );
            // When resharding: two units' full weights at once with backward prefetch
            // (the one backward runs and the one it gathers ahead), one without; every
            // unit at the end of the forward when not resharding.
            let gathered_peak = match (setup.reshard_after_forward, setup.backward_prefetch) {
                (true, true) => 4 * two_largest,
                (true, false) => 4 * largest_unit,
                (false, _) => 4 * padded_units,
            };
            assert_eq!(f["gathered_peak_bytes"], gathered_peak, "{tag}");
            if setup.reshard_after_forward {
                // The bound on the step's peak (meter, bytes above the step's
                // start, optimizer step included): the gathered weights (4 x the two
                // largest padded units: the one backward runs and the prefetched one),
                // Gloo's staging buffer of an all-gather (4 x the largest padded unit:
                // Gloo gathers into a flat buffer of its own and copies it out; with
                // prefetch this overlaps backward's work), what the step saves (held after the first micro-batch's forward less
                // the weights gathered then: activations and the loss), the gradient
                // shards (4 x this rank's shard values, and a unit's two used-flags
                // received with its shard), and one unit's full gradient twice (4 x the
                // largest padded unit, twice: the reduce-scatter copies the parameters'
                // .grad into one flat buffer before dropping them) with the flags of
                // its two parameters in each of the N chunks.
                let bound = 4 * two_largest
                    + 4 * largest_unit
                    + f["saved_bytes"]
                    + 4 * shard_values
                    + 4 * 2
                    + 2 * 4 * (largest_unit + 2 * n64);
                assert!(
                    f["peak_above_start"] <= bound,
                    "{tag}: step peak {} above start exceeds the bound {bound}",
                    f["peak_above_start"]
                );
            }
            // Per micro-batch: an all-gather per unit in forward, another in backward
            // (except unit 0 without checkpointing: its input needs no gradient, so its
            // backward reads no weight) unless the weights stay, and a reduce-scatter;
            // each sends (N-1)/N of the padded unit, and the reduce-scatter (N-1)/N of
            // the N chunks' used-flags too (one f32 per parameter and chunk: 2 a unit).
            // Backward prefetch sends nothing more: it prefetches only units whose
            // backward gathers them (not unit 0 without checkpointing), so no
            // prefetched buffer goes unused.
            let unit0 = 4 * (n64 - 1) * unit_values(0).div_ceil(n64);
            let one = 4 * (n64 - 1) * shard_values;
            let flags = 4 * (n64 - 1) * 2 * 8;
            let per_micro = flags
                + match (setup.reshard_after_forward, setup.checkpoint) {
                    (true, true) => 3 * one,
                    (true, false) => 3 * one - unit0,
                    (false, _) => 2 * one,
                };
            assert_eq!(
                f["bytes_sent_per_step"],
                setup.micro as u64 * per_micro,
                "{tag}: bytes sent per step"
            );
            writeln!(
                report,
                "N={n} {tag}: parameter bytes {parameter_bytes}, sent/step {}, gathered peak {}, step peak above start {}, saved {}",
                f["bytes_sent_per_step"], f["gathered_peak_bytes"], f["peak_above_start"], f["saved_bytes"]
            )
            .unwrap();
        }
    }
    println!("{report}");
}

// `#[serial]`: the reference training seeds this process's default generator.
#[test]
#[serial]
fn one_rank_matches_single_process_training() {
    check_world(1);
}

#[test]
#[serial]
fn two_ranks_match_single_process_training() {
    check_world(2);
}

#[test]
#[serial]
fn four_ranks_match_single_process_training() {
    check_world(4);
}

/// Without grad (evaluation) a unit's weights are freed after its forward whatever
/// `reshard_after_forward` says, and the outputs are the plain model's.
#[test]
#[serial]
fn a_forward_without_grad_gives_the_plain_output_and_frees_the_weights() {
    let dir = tempfile::tempdir().expect("tempdir");
    let group = ProcessGroup::new_file(&dir.path().join("store"), 0, 1, &InitOptions::default())
        .expect("a group of one");
    let (x, _) = data();
    let (_vs, plain) = layers();
    let mut expected = x.shallow_clone();
    tch::no_grad(|| {
        for (i, lin) in plain.iter().enumerate() {
            expected = layer_forward(lin, i, &expected);
        }
    });
    for reshard_after_forward in [true, false] {
        let (_vs, layers) = layers();
        let mut fsdp = Fsdp::new(
            &group,
            FsdpConfig {
                reshard_after_forward,
                ..Default::default()
            },
        )
        .expect("fsdp");
        let held: Vec<Tensor> = layers
            .iter()
            .flat_map(|l| [l.ws.shallow_clone(), l.bs.as_ref().unwrap().shallow_clone()])
            .collect();
        let units = sharded(&mut fsdp, layers);
        let y = tch::no_grad(|| {
            let mut h = x.shallow_clone();
            for unit in &units {
                h = units_forward(unit, &h);
            }
            h
        });
        assert!(
            y.equal(&expected),
            "reshard_after_forward {reshard_after_forward}"
        );
        let stats = fsdp.stats();
        assert_eq!(stats.gathered_bytes, 0);
        assert_eq!(stats.gathers, 8);
        // Every parameter reads as NaN between uses, in its own shape (not zeros, which
        // a VarStore::save would write as if they were weights).
        for (p, q) in held
            .iter()
            .zip(plain.iter().flat_map(|l| [&l.ws, l.bs.as_ref().unwrap()]))
        {
            assert_eq!(p.size(), q.size());
            assert!(
                Vec::<f32>::try_from(&p.reshape([-1]))
                    .unwrap()
                    .iter()
                    .all(|v| v.is_nan()),
                "a freed parameter reads a number"
            );
        }
        let params: Vec<Tensor> = plain
            .iter()
            .flat_map(|l| [l.ws.shallow_clone(), l.bs.as_ref().unwrap().shallow_clone()])
            .collect();
        let full = fsdp.f_full_parameters().expect("full parameters");
        assert_eq!(flat(&full), flat(&params));
        // Restored, the module's own parameters hold the weights, and keep them when
        // the Fsdp is dropped; the units then run their module as it is.
        fsdp.f_restore_full_parameters().expect("restore");
        assert_eq!(flat(&held), flat(&params));
        drop(fsdp);
        assert_eq!(flat(&held), flat(&params));
        let y = tch::no_grad(|| {
            let mut h = x.shallow_clone();
            for unit in &units {
                h = units_forward(unit, &h);
            }
            h
        });
        assert!(y.equal(&expected), "after the drop");
    }
}

/// The started all-gather backward prefetch uses: waited, it has gathered; dropped
/// unwaited, it is waited for by the drop (the output is written when the drop
/// returns), and its error, if any, is dropped.
#[test]
#[serial]
fn a_started_all_gather_is_done_when_waited_or_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let group = ProcessGroup::new_file(&dir.path().join("store"), 0, 1, &InitOptions::default())
        .expect("a group of one");
    let input = Tensor::from_slice(&[1f32, 2.0, 3.0]);
    let waited = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    group
        .all_gather_async(&waited, &input)
        .expect("start")
        .wait()
        .expect("wait");
    assert_eq!(flat(&[waited]), [1.0, 2.0, 3.0]);
    let dropped = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    drop(group.all_gather_async(&dropped, &input).expect("start"));
    assert_eq!(flat(&[dropped]), [1.0, 2.0, 3.0]);
    // A wrong output size is refused when starting, naming the rank.
    let wrong = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let e = group
        .all_gather_async(&wrong, &input)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 0") && e.contains("output has 4 values"),
        "{e}"
    );
}
