//! State precision, saving and loading, and state kept on disk.
//!
//! Every test is serial: the meter counts the whole process.

use crate::common::{assert_bitwise, net};
use memsave_meter::memory_allocated;
use memsave_optim::{AdamW, AdamWConfig, OptimError, Options, Placement, Sgd, SgdConfig, State};
use serial_test::serial;
use tch::{nn, Device, Kind, Tensor};

const PRECISIONS: [State; 3] = [State::F32, State::Bf16, State::Int8Blockwise { block: 256 }];

fn adamw(params: &[Tensor], state: State, placement: Placement) -> AdamW {
    let config = AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let options = Options {
        state,
        placement,
        ..Default::default()
    };
    AdamW::with_options(params, config, options).unwrap()
}

/// Trains `net` with `opt` on batches `from..to`; returns the last loss.
fn train(net: &crate::common::Net, opt: &mut AdamW, from: i64, to: i64) -> f64 {
    let mut loss = f64::NAN;
    for step in from..to {
        opt.zero_grad(true);
        loss = net.backward(step);
        opt.step();
    }
    loss
}

#[test]
#[serial]
fn int8_state_is_at_most_027_of_f32_state_measured_by_the_meter() {
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 300, 200, Default::default());
    let x = Tensor::randn([4, 300], (Kind::Float, Device::Cpu));
    memsave_meter::install();
    let mut measured = Vec::new();
    for state in [State::F32, State::Int8Blockwise { block: 256 }] {
        // The first use of some kernels allocates libtorch's own caches; not state.
        let mut warm_up = adamw(&vs.trainable_variables(), state, Placement::Device);
        tch::nn::Module::forward(&layer, &x)
            .sum(Kind::Float)
            .backward();
        warm_up.step();
        drop(warm_up);
        let mut opt = adamw(&vs.trainable_variables(), state, Placement::Device);
        opt.zero_grad(true);
        tch::nn::Module::forward(&layer, &x)
            .sum(Kind::Float)
            .backward();
        let before = memory_allocated(Device::Cpu);
        opt.step();
        let state_bytes = memory_allocated(Device::Cpu) - before;
        assert_eq!(state_bytes, opt.state_bytes(), "{state:?}");
        measured.push(state_bytes);
    }
    // f32: two moments of 60_000 + 200 values, 4 bytes each.
    assert_eq!(measured[0], 2 * 4 * 60_200);
    // int8: one byte per value and an f32 scale per block of 256 (235 + 1 blocks).
    assert_eq!(measured[1], 2 * (60_200 + 4 * (235 + 1)));
    let ratio = measured[1] as f64 / measured[0] as f64;
    assert!(ratio <= 0.27, "int8/f32 state = {ratio}");
}

#[test]
#[serial]
fn low_precision_state_converges_like_f32() {
    let mut finals = Vec::new();
    for state in PRECISIONS {
        let n = net(7);
        let mut opt = adamw(&n.params(), state, Placement::Device);
        let first = n.loss(0).double_value(&[]);
        let last = train(&n, &mut opt, 0, 100);
        assert!(last < first / 2.0, "{state:?}: loss {first} -> {last}");
        finals.push(last);
    }
    // Low-precision state may land a little lower or higher than f32 depending on the
    // start; what must hold is that it trains no worse than 2% above f32.
    for (state, last) in PRECISIONS.iter().zip(&finals).skip(1) {
        let relative = (last - finals[0]) / finals[0];
        assert!(
            relative <= 0.02,
            "{state:?}: final loss {last} vs f32 {}: {relative}",
            finals[0]
        );
    }
}

#[test]
#[serial]
fn save_load_continue_is_bitwise_uninterrupted_training_for_every_precision() {
    let dir = tempfile::tempdir().unwrap();
    for state in PRECISIONS {
        for placement in [
            Placement::Device,
            Placement::Disk(dir.path().join(format!("{state:?}"))),
        ] {
            let a = net(11);
            let mut opt_a = adamw(&a.params(), state, Placement::Device);
            train(&a, &mut opt_a, 0, 7);
            let file = dir.path().join("state.json");
            opt_a.save(&file).unwrap();

            let mut b = net(99);
            b.vs.copy(&a.vs).unwrap();
            let mut opt_b = adamw(&b.params(), state, placement.clone());
            opt_b.load(&file).unwrap();
            assert_eq!(opt_b.step_count(0), 7);

            train(&a, &mut opt_a, 7, 15);
            train(&b, &mut opt_b, 7, 15);
            assert_bitwise(
                &b.params(),
                &a.params(),
                &format!("{state:?} {placement:?}"),
            );
            assert_eq!(opt_b.state_dict().unwrap(), opt_a.state_dict().unwrap());
        }
    }
}

#[test]
#[serial]
fn loading_a_state_that_does_not_fit_names_the_parameter() {
    let a = net(5);
    let mut opt = adamw(
        &a.params(),
        State::Int8Blockwise { block: 256 },
        Placement::Device,
    );
    train(&a, &mut opt, 0, 2);
    let saved = opt.state_dict().unwrap();

    let other_precision = adamw(&a.params(), State::Bf16, Placement::Device);
    let mut other_precision = other_precision;
    let e = other_precision.load_state_dict(&saved).unwrap_err();
    assert!(matches!(e, OptimError::StateMismatch(_)), "{e}");
    assert!(e.to_string().contains("Bf16"), "{e}");

    let mut fewer = adamw(
        &a.params()[..3],
        State::Int8Blockwise { block: 256 },
        Placement::Device,
    );
    let e = fewer.load_state_dict(&saved).unwrap_err();
    assert!(
        e.to_string().contains("6 parameters, this optimizer 3"),
        "{e}"
    );

    let mut reshaped = saved.clone();
    let shape = a.params()[2].size();
    reshaped.params[2].shape = vec![shape[0] + 1];
    let e = opt.load_state_dict(&reshaped).unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("parameter 2 (shape {shape:?})")),
        "{e}"
    );

    let mut truncated = saved.clone();
    truncated.params[4].buffers[1][0].data.pop();
    let e = opt.load_state_dict(&truncated).unwrap_err();
    assert!(e.to_string().contains("parameter 4"), "{e}");
    // Nothing was changed by the refused loads.
    assert_eq!(opt.state_dict().unwrap(), saved);

    let mut sgd = Sgd::new(&a.params(), SgdConfig::default()).unwrap();
    let file = tempfile::NamedTempFile::new().unwrap();
    opt.save(file.path()).unwrap();
    let e = sgd.load(file.path()).unwrap_err();
    assert!(e.to_string().contains("saved by adamw"), "{e}");
}

#[test]
#[serial]
fn disk_placement_keeps_no_state_in_memory_and_matches_the_device_placement() {
    let dir = tempfile::tempdir().unwrap();
    for state in PRECISIONS {
        let on_device = net(21);
        let on_disk = net(21);
        let mut opt_device = adamw(&on_device.params(), state, Placement::Device);
        let mut opt_disk = adamw(
            &on_disk.params(),
            state,
            Placement::Disk(dir.path().join(format!("{state:?}"))),
        );
        for step in 0..5 {
            opt_device.zero_grad(true);
            on_device.backward(step);
            opt_device.step();

            opt_disk.zero_grad(true);
            on_disk.backward(step);
            let before = memory_allocated(Device::Cpu);
            opt_disk.step();
            assert_eq!(
                memory_allocated(Device::Cpu),
                before,
                "{state:?}: bytes left after a step"
            );
            assert_eq!(opt_disk.state_bytes(), 0);
            assert!(opt_device.state_bytes() > 0);
        }
        assert_bitwise(
            &on_disk.params(),
            &on_device.params(),
            &format!("{state:?}"),
        );
    }
}

#[test]
#[serial]
fn zero_grad_drops_or_zeroes_the_gradients() {
    let n = net(3);
    let opt = Sgd::new(&n.params(), SgdConfig::default()).unwrap();
    n.backward(0);
    opt.zero_grad(false);
    for p in n.params() {
        assert!(p.grad().defined());
        assert_eq!(p.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
    opt.zero_grad(true);
    assert!(n.params().iter().all(|p| !p.grad().defined()));
}

#[test]
#[serial]
fn parameter_groups_have_their_own_hyper_parameters() {
    let n = net(4);
    let params = n.params();
    let frozen = SgdConfig {
        lr: 0.0,
        ..Default::default()
    };
    let mut opt = Sgd::new(&params[..2], frozen).unwrap();
    let group = opt
        .add_param_group(
            &params[2..],
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(group, 1);
    let before: Vec<Tensor> = params.iter().map(|p| p.detach().copy()).collect();
    n.backward(0);
    opt.step();
    for (i, (p, b)) in params.iter().zip(&before).enumerate() {
        assert_eq!(p.equal(b), i < 2, "parameter {i}");
    }
    let e = opt
        .add_param_group(&params[..1], SgdConfig::default())
        .unwrap_err();
    assert!(
        e.to_string().contains("parameter 6") && e.to_string().contains("already optimized"),
        "{e}"
    );
}

#[test]
#[serial]
fn bad_parameters_and_options_are_refused() {
    let t = Tensor::zeros([3, 4], (Kind::Float, Device::Cpu));
    let e = AdamW::new(&[t.shallow_clone()], AdamWConfig::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("parameter 0 (shape [3, 4]): does not require grad"),
        "{e}"
    );
    let p = t.set_requires_grad(true);
    let bad = AdamWConfig {
        betas: (0.9, 1.0),
        ..Default::default()
    };
    assert!(matches!(
        AdamW::new(&[p.shallow_clone()], bad),
        Err(OptimError::Config(_))
    ));
    let options = Options {
        state: State::Int8Blockwise { block: 0 },
        ..Default::default()
    };
    assert!(matches!(
        AdamW::with_options(&[p], AdamWConfig::default(), options),
        Err(OptimError::Config(_))
    ));
}

#[test]
#[serial]
fn cpu_placement_of_cpu_parameters_is_the_device_placement() {
    let a = net(41);
    let b = net(41);
    let mut on_device = adamw(&a.params(), State::Bf16, Placement::Device);
    let mut on_cpu = adamw(&b.params(), State::Bf16, Placement::Cpu);
    train(&a, &mut on_device, 0, 5);
    train(&b, &mut on_cpu, 0, 5);
    assert_bitwise(&b.params(), &a.params(), "Placement::Cpu");
    assert_eq!(on_cpu.state_bytes(), on_device.state_bytes());
}

#[test]
#[serial]
#[ignore = "needs CUDA"]
fn cpu_placement_keeps_no_state_on_the_gpu_and_matches_the_device_placement() {
    let device = Device::Cuda(0);
    tch::manual_seed(42);
    let w = Tensor::randn([16, 8], (Kind::Float, device));
    let x = Tensor::randn([4, 8], (Kind::Float, device));
    let pa = w.copy().set_requires_grad(true);
    let pb = w.copy().set_requires_grad(true);
    let mut on_device = adamw(
        &[pa.shallow_clone()],
        State::Int8Blockwise { block: 32 },
        Placement::Device,
    );
    let mut on_cpu = adamw(
        &[pb.shallow_clone()],
        State::Int8Blockwise { block: 32 },
        Placement::Cpu,
    );
    for _ in 0..3 {
        for (p, opt) in [(&pa, &mut on_device), (&pb, &mut on_cpu)] {
            opt.zero_grad(true);
            x.matmul(&p.tr()).square().mean(Kind::Float).backward();
            let before = memory_allocated(device);
            opt.step();
            if opt.options().placement == Placement::Cpu {
                assert_eq!(memory_allocated(device), before, "state left on the GPU");
            }
        }
    }
    assert!(
        pb.equal(&pa),
        "Placement::Cpu differs from Placement::Device on CUDA"
    );
}

/// One hex digit changed in a saved state file is still valid JSON of the right
/// shape: the tensor's CRC-32 refuses it, naming the file and the tensor, and the
/// optimizer loading it keeps its own state.
#[test]
#[serial]
fn a_changed_byte_in_a_saved_state_is_refused_naming_the_file_and_the_tensor() {
    let a = net(6);
    let mut opt = adamw(&a.params(), State::F32, Placement::Device);
    train(&a, &mut opt, 0, 2);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("adamw.json");
    opt.save(&file).unwrap();
    let mut text = std::fs::read_to_string(&file).unwrap();
    // The first digit of parameter 0's exp_avg_sq, swapped for another hex digit.
    let at = text.match_indices("\"data\":\"").nth(1).unwrap().0 + 8;
    let digit = &text[at..at + 1];
    let other = if digit == "7" { "8" } else { "7" };
    text.replace_range(at..at + 1, other);
    std::fs::write(&file, &text).unwrap();

    let b = net(7);
    let mut other_opt = adamw(&b.params(), State::F32, Placement::Device);
    train(&b, &mut other_opt, 0, 1);
    let before = other_opt.state_dict().unwrap();
    let e = other_opt.load(&file).unwrap_err();
    assert!(matches!(e, OptimError::StateFile { .. }), "{e:?}");
    let message = e.to_string();
    assert!(message.contains(&file.display().to_string()), "{message}");
    let shape = a.params()[0].size();
    assert!(
        message.contains(&format!(
            "parameter 0 (shape {shape:?}), exp_avg_sq.values: its bytes changed"
        )),
        "{message}"
    );
    assert!(!message.contains('\n'), "{message}");
    assert_eq!(other_opt.state_dict().unwrap(), before);

    // The same through load_state_dict.
    let mut changed = opt.state_dict().unwrap();
    changed.params[3].buffers[0][0].data[5] ^= 1;
    let e = other_opt.load_state_dict(&changed).unwrap_err();
    let shape = a.params()[3].size();
    assert!(
        e.to_string()
            .contains(&format!("parameter 3 (shape {shape:?}), exp_avg.values")),
        "{e}"
    );
    assert_eq!(other_opt.state_dict().unwrap(), before);
}

/// A state file saved before checksums were written (no `crc32` fields) still loads,
/// unchecked, and continues bitwise.
#[test]
#[serial]
fn a_state_file_from_before_checksums_still_loads() {
    let a = net(6);
    let mut opt = adamw(&a.params(), State::F32, Placement::Device);
    train(&a, &mut opt, 0, 2);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("adamw.json");
    opt.save(&file).unwrap();
    let text = std::fs::read_to_string(&file).unwrap();
    // Each tensor ends `..."data":"<hex>","crc32":<digits>}`: drop the last field.
    let mut old = String::with_capacity(text.len());
    let mut rest = text.as_str();
    let mut dropped = 0;
    while let Some(at) = rest.find(",\"crc32\":") {
        old.push_str(&rest[..at]);
        let after = &rest[at + ",\"crc32\":".len()..];
        let digits = after.find(|c: char| !c.is_ascii_digit()).unwrap();
        rest = &after[digits..];
        dropped += 1;
    }
    old.push_str(rest);
    assert!(dropped > 0, "no crc32 field in {text}");
    std::fs::write(&file, &old).unwrap();

    let b = net(6);
    let mut loaded = adamw(&b.params(), State::F32, Placement::Device);
    loaded.load(&file).unwrap();
    assert_eq!(loaded.state_dict().unwrap(), opt.state_dict().unwrap());
}
