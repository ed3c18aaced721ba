//! ZeRO-1 and ZeRO-2 with 8-bit blockwise AdamW state on 2 ranks step exactly as one
//! process's optimizer with the same state: each parameter starts a new block in the
//! flat vector, so every block of a shard holds the values of one parameter, in the
//! positions that parameter's blocks have on one process.
//!
//! Both ranks see the same data, so the averaged gradient is the single-process one bit
//! for bit ((g + g) / 2 = g) and only the optimizer state's layout can make a
//! difference. The parameters' sizes (100, 37 and 16 × 16) are not all multiples of the
//! block (64), and their gradients differ by decades, so a block running across a
//! parameter boundary would take its scale from the larger neighbour.
use crate::common;

use std::path::Path;
use std::time::Duration;

use memsave_dist::{init_process_group, InitOptions, ProcessGroup, ZeroOptimizer, ZeroStage};
use memsave_optim::{AdamW, AdamWConfig, Options, State};
use serial_test::parallel;
use tch::{Device, Kind, Tensor};

const STEPS: usize = 10;
const BLOCK: usize = 64;
const STATE: State = State::Int8Blockwise { block: BLOCK };
const SHAPES: [&[i64]; 3] = [&[100], &[37], &[16, 16]];
/// How much each parameter's loss weighs: gradients decades apart.
const WEIGHTS: [f64; 3] = [1.0, 100.0, 0.01];
const CONFIG: AdamWConfig = AdamWConfig {
    lr: 1e-2,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 1e-2,
};
const TOLERANCE: f32 = 1e-6;

/// The runs on the ranks: stage, bucket cap in bytes, name.
const RUNS: [(ZeroStage, u64, &str); 3] = [
    (ZeroStage::One, 25 << 20, "zero1"),
    (ZeroStage::Two, 25 << 20, "zero2"),
    // A bucket per parameter (400, 148 and 1024 bytes).
    (ZeroStage::Two, 256, "zero2_buckets"),
];

/// `n` values from a fixed formula (no generator, so every process and thread gets
/// the same ones): `scale · sin(0.7 i + phase)`.
fn values(n: i64, scale: f64, phase: f64) -> Tensor {
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.7 + phase).sin() * scale
}

/// The parameters and their targets, in their shapes.
fn problem() -> (Vec<Tensor>, Vec<Tensor>) {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let p = values(n, 1.0, i as f64)
                .reshape(*shape)
                .set_requires_grad(true);
            let t = values(n, 2.0, 0.3 + i as f64).reshape(*shape);
            (p, t)
        })
        .unzip()
}

/// `Σ_i w_i · Σ (p_i − t_i)²`.
fn loss(params: &[Tensor], targets: &[Tensor]) -> Tensor {
    params
        .iter()
        .zip(targets)
        .zip(WEIGHTS)
        .map(|((p, t), w)| (p - t).square().sum(Kind::Float) * w)
        .reduce(|a, b| a + b)
        .expect("parameters")
}

fn flat(params: &[Tensor]) -> Vec<f32> {
    params
        .iter()
        .flat_map(|p| Vec::<f32>::try_from(p.detach().reshape([-1])).expect("f32 values"))
        .collect()
}

/// One process, one `memsave-optim` optimizer with the same 8-bit state: the reference.
fn single_process() -> Vec<f32> {
    let (params, targets) = problem();
    let options = Options {
        state: STATE,
        ..Default::default()
    };
    let mut opt = AdamW::with_options(&params, CONFIG, options).expect("optimizer");
    for _ in 0..STEPS {
        opt.zero_grad(true);
        loss(&params, &targets).backward();
        opt.f_step().expect("step");
    }
    flat(&params)
}

fn train(group: &ProcessGroup, stage: ZeroStage, cap: u64) -> (Vec<f32>, i64) {
    let (params, targets) = problem();
    let options = Options {
        state: STATE,
        ..Default::default()
    };
    let mut zero = ZeroOptimizer::with_bucket_cap(group, &params, CONFIG, options, stage, cap)
        .expect("ZeroOptimizer");
    for step in 0..STEPS {
        loss(&params, &targets).backward();
        zero.f_step()
            .unwrap_or_else(|e| panic!("rank {} step {step}: {e}", group.rank()));
        zero.f_zero_grad(true).expect("zero_grad");
    }
    (flat(&params), zero.padded_len())
}

#[test]
#[ignore = "a rank of the ZeRO 8-bit parity test: started by the launcher"]
fn zero_int8_worker() {
    let out = common::out_dir();
    let options = InitOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    for (stage, cap, name) in RUNS {
        let (params, padded) = train(&group, stage, cap);
        let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
        let tag = format!("{name}-rank{}", group.rank());
        std::fs::write(out.join(format!("{tag}.params")), bytes).expect("write params");
        std::fs::write(out.join(format!("{tag}.padded")), padded.to_string())
            .expect("write padded");
    }
}

fn read_params(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

#[test]
#[parallel]
fn zero_with_int8_state_on_two_ranks_matches_one_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::run_ranks("zero_int8::zero_int8_worker", 2, dir.path()).expect("both ranks train");
    let expected = single_process();
    let (initial, _) = problem();
    let moved = flat(&initial)
        .iter()
        .zip(&expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(moved > 1e-2, "10 steps move the weights: {moved}");
    for (_, _, name) in RUNS {
        for rank in 0..2 {
            let tag = format!("{name}-rank{rank}");
            let got = read_params(&dir.path().join(format!("{tag}.params")));
            assert_eq!(got.len(), expected.len(), "{tag}");
            let (worst, at) = got
                .iter()
                .zip(&expected)
                .map(|(a, b)| (a - b).abs())
                .enumerate()
                .fold(
                    (0f32, 0),
                    |(m, at), (i, d)| if d > m { (d, i) } else { (m, at) },
                );
            assert!(
                worst <= TOLERANCE,
                "{tag}: weights differ from one process by {worst} (value {at})"
            );
            // Each parameter padded to whole blocks (128 + 64 + 256), then to 2 blocks.
            let padded =
                std::fs::read_to_string(dir.path().join(format!("{tag}.padded"))).expect("padded");
            assert_eq!(padded, "512", "{tag}: padded length");
        }
    }
}
