//! Issue #36 ("The whole device"): the parameters off the device on one process
//! (`StepConfig::offload_params`). The zoo's ViT and LLaMA (chains of layers) and its
//! U-Net (blocks, BatchNorm, concatenated skips) train 20 AdamW steps with each
//! unit's weights in files, stepped in backward; the weights (and the running
//! statistics) must be bitwise those of plain AdamW stepped after backward with the
//! parameters on the device, while between steps the device holds none of them and
//! during a step one unit's at a time.
use memsave_models::{Architecture, LlamaConfig, UNetConfig, VitConfig, ZooWorkload};
use memsave_step::{
    OptimizerKind, OptimizerSpec, ParamsOffload, StepConfig, Trainer, TrainerBuilder, Workload,
};
use tch::{Device, Tensor};

const STEPS: usize = 20;

fn adamw(in_backward: bool) -> OptimizerSpec {
    OptimizerSpec {
        kind: OptimizerKind::Adamw,
        in_backward,
        lr: Some(1e-3),
        ..OptimizerSpec::default()
    }
}

fn values(ts: &[Tensor]) -> Vec<Vec<u8>> {
    ts.iter()
        .map(|t| {
            let t = t.detach().contiguous();
            let n = t.numel() * t.kind().elt_size_in_bytes();
            let mut out = vec![0u8; n];
            t.copy_data_u8(&mut out, t.numel());
            out
        })
        .collect()
}

/// 20 steps of `config` on a fresh `arch` (seeded alike); returns the parameters'
/// and buffers' bytes after them, and the trainer's figures when it offloads.
fn train(arch: &Architecture, batch: i64, config: StepConfig) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    tch::manual_seed(0);
    let mut model = ZooWorkload::new("zoo", arch, batch, Device::Cpu).unwrap();
    let x = model.batch(batch).unwrap();
    let offloads = config.offload_params.is_some();
    // The largest unit: the one every gather of a step is at most.
    let largest = match model.layer_parameters().unwrap() {
        Some(units) => units
            .iter()
            .map(|u| u.iter().map(|p| 4 * p.numel() as u64).sum::<u64>())
            .max()
            .unwrap(),
        None => u64::MAX,
    };
    let param_bytes: u64 = model
        .parameters()
        .iter()
        .map(|p| 4 * p.numel() as u64)
        .sum();
    let mut trainer: Trainer<'_, ZooWorkload> =
        TrainerBuilder::new(config).build(&mut model).unwrap();
    for i in 0..STEPS {
        trainer.step(&x).unwrap_or_else(|e| panic!("step {i}: {e}"));
        if offloads {
            let stats = trainer
                .data_parallel()
                .and_then(|d| d.fsdp_stats())
                .expect("offload_params runs ZeRO-3 on a group of one");
            assert_eq!(stats.parameter_bytes, 4, "only the NaN placeholder");
            assert_eq!(stats.file_bytes, param_bytes, "every weight in a file");
            assert!(stats.gathered_peak_bytes <= largest, "step {i}: {stats:?}");
        }
    }
    trainer.restore_full_parameters().unwrap();
    drop(trainer);
    (values(&model.parameters()), values(&model.buffers()))
}

/// With the whole batch at once and with `micro_batches` (None: the whole batch only),
/// the weights with the parameters in files equal plain AdamW's of the same split.
fn check(name: &str, arch: Architecture, batch: i64, micro_batches: Option<usize>) {
    memsave_meter::install();
    for micro_batches in [None, micro_batches] {
        let plain = StepConfig {
            optimizer: Some(adamw(false)),
            micro_batches,
            ..StepConfig::baseline()
        };
        let offloaded = StepConfig {
            optimizer: Some(adamw(true)),
            offload_params: Some(ParamsOffload::Disk),
            micro_batches,
            ..StepConfig::baseline()
        };
        let (p0, b0) = train(&arch, batch, plain);
        let (p1, b1) = train(&arch, batch, offloaded);
        assert_eq!(p0.len(), p1.len());
        for (i, (a, b)) in p0.iter().zip(&p1).enumerate() {
            assert!(
                a == b,
                "{name} ({micro_batches:?} micro-batches): parameter {i} differs after {STEPS} steps"
            );
        }
        assert_eq!(b0, b1, "{name}: buffers (running statistics) differ");
    }
}

#[test]
#[serial_test::serial]
fn vit_with_parameters_in_files_trains_bitwise_like_plain_adamw() {
    let arch = Architecture::Vit(VitConfig {
        image: [3, 32, 32],
        patch: 8,
        dim: 32,
        layers: 2,
        heads: 4,
        mlp: 64,
        classes: 10,
    });
    check("vit", arch, 4, Some(2));
}

#[test]
#[serial_test::serial]
fn llama_with_parameters_in_files_trains_bitwise_like_plain_adamw() {
    // 1,100 x 64 = 70,400 values in the embedding and in the head: more than one
    // optimizer chunk (64 Ki values) each.
    let arch = Architecture::Llama(LlamaConfig {
        vocab: 1100,
        dim: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        hidden: None,
        seq: 16,
        ..LlamaConfig::default()
    });
    check("llama", arch, 4, Some(3));
}

#[test]
#[serial_test::serial]
fn unet_with_parameters_in_files_trains_bitwise_like_plain_adamw() {
    let arch = Architecture::UNet(UNetConfig {
        image: [3, 16, 16],
        classes: 3,
        base: 4,
        levels: 2,
    });
    // BatchNorm: a split changes the step (each micro-batch's own statistics), the
    // same way with the parameters in files or not.
    check("unet", arch, 2, Some(2));
}

#[test]
#[serial_test::serial]
fn offload_params_refuses_an_optimizer_after_backward_and_a_scaler() {
    let arch = Architecture::Vit(VitConfig {
        image: [3, 16, 16],
        patch: 8,
        dim: 16,
        layers: 1,
        heads: 2,
        mlp: 32,
        classes: 4,
    });
    let mut model = ZooWorkload::new("vit", &arch, 2, Device::Cpu).unwrap();
    let cases = [
        (
            StepConfig {
                optimizer: Some(adamw(false)),
                offload_params: Some(ParamsOffload::Disk),
                ..StepConfig::baseline()
            },
            "offload_params keeps the weights in files between their uses, so the optimizer must step each unit as its gradients land: add in_backward: true",
        ),
        (
            StepConfig {
                optimizer: Some(adamw(true)),
                offload_params: Some(ParamsOffload::Disk),
                scaler: Some(memsave_amp::GradScalerConfig::default()),
                ..StepConfig::baseline()
            },
            "GradScaler cannot be combined with an optimizer stepping in backward",
        ),
        (
            StepConfig {
                optimizer: Some(adamw(true)),
                offload_params: Some(ParamsOffload::Disk),
                offload_grads: Some(memsave_step::GradsAfter::Restored),
                ..StepConfig::baseline()
            },
            "offload_grads cannot run with offload_params",
        ),
    ];
    for (config, says) in cases {
        let e = TrainerBuilder::new(config)
            .build(&mut model)
            .expect_err("refused")
            .to_string();
        assert!(e.contains(says), "{e}");
    }
    // Refused before anything was sharded: the parameters are the model's own.
    assert!(model
        .parameters()
        .iter()
        .all(|p| p.isfinite().all().int64_value(&[]) == 1));
}

/// With each other lossless lever (every layer recomputed, saved activations in
/// files, the optimizer's state in files, micro-batches, and all of them at once), the
/// parameters in files change nothing: 20 steps give the weights of the same levers
/// with the parameters on the device (the optimizer stepped after backward).
#[test]
#[serial_test::serial]
fn with_every_other_lossless_lever_the_weights_are_bitwise_the_same() {
    use memsave_checkpoint::Plan;
    use memsave_step::{OffloadSpec, PlanChoice, SavedTensors, StatePlacement};
    memsave_meter::install();
    let arch = Architecture::Llama(LlamaConfig {
        vocab: 256,
        dim: 32,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        hidden: None,
        seq: 8,
        ..LlamaConfig::default()
    });
    let recompute = |c: &mut StepConfig| c.plan = PlanChoice::Fixed(Plan::EveryLayer);
    let offload = |c: &mut StepConfig| {
        c.saved = Some(SavedTensors::Offload(OffloadSpec::Disk {
            dir: None,
            max_in_flight: None,
        }))
    };
    let state = |c: &mut StepConfig| {
        if let Some(o) = c.optimizer.as_mut() {
            o.placement = StatePlacement::Disk;
        }
    };
    let split = |c: &mut StepConfig| c.micro_batches = Some(2);
    type Lever = fn(&mut StepConfig);
    let levers: [(&str, Vec<Lever>); 5] = [
        ("recompute", vec![recompute]),
        ("offload", vec![offload]),
        ("state in files", vec![state]),
        ("micro-batches", vec![split]),
        ("all", vec![recompute, offload, state, split]),
    ];
    for (name, with) in levers {
        let config = |in_backward: bool, params: bool| {
            let mut c = StepConfig {
                optimizer: Some(adamw(in_backward)),
                offload_params: params.then_some(ParamsOffload::Disk),
                ..StepConfig::baseline()
            };
            for lever in &with {
                lever(&mut c);
            }
            c
        };
        let (p0, _) = train(&arch, 4, config(false, false));
        let (p1, _) = train(&arch, 4, config(true, true));
        for (i, (a, b)) in p0.iter().zip(&p1).enumerate() {
            assert!(a == b, "{name}: parameter {i} differs after {STEPS} steps");
        }
    }
}
