//! `FitReport::trainer`: the trainer built from `fit`'s choice in one call trains as
//! the same configuration assembled by hand through `f_step_with` (the choice's step
//! configuration with the workload's optimizer, its checkpoint schedule set on the
//! layers), bitwise, and each of its steps peaks within the budget.
use crate::common::Mlp;
use memsave_checkpoint::Schedule;
use memsave_fit::{fit, FitRequest};
use memsave_step::optimizer::CaseOptimizer;
use memsave_step::step::f_step_with;
use memsave_step::{OptimizerKind, OptimizerSpec, StepConfig, Workload};
use serial_test::serial;
use tch::{Device, Tensor};

fn host(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter()
        .map(|t| Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
        .collect()
}

/// Fits a fresh model of `make` to `budget(plain peak, gradient bytes)` (the plain
/// step's with the model's optimizer, its state made by an earlier step, as `fit`
/// counts it: the whole device), trains it 3 steps with `report.trainer`, and a second
/// fresh model 3 steps by hand; returns the choice's name and how many candidates
/// recompute.
fn trainer_matches_by_hand(
    make: impl Fn() -> Mlp,
    budget: impl Fn(u64, u64) -> u64,
) -> (String, usize) {
    memsave_meter::install();
    let plain = {
        // On a model of its own: the optimizer moves its weights.
        let model = make();
        let outside = crate::device::outside(&model);
        let x = model.batch(model.global_batch()).unwrap();
        let spec = model.optimizer().unwrap();
        let mut optimizer = CaseOptimizer::build(&spec, &model.parameters()).unwrap();
        let mut plain = 0;
        for _ in 0..2 {
            let m = f_step_with(
                &model,
                &x,
                &StepConfig::baseline(),
                Device::Cpu,
                false,
                None,
                Some(&mut optimizer),
            )
            .unwrap();
            plain = crate::device::peak(&m, &outside);
        }
        plain
    };
    let mut model = make();
    let x = model.batch(model.global_batch()).unwrap();
    let grads: u64 = model
        .parameters()
        .iter()
        .map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as u64)
        .sum();
    memsave_accum::free_grads(&model.parameters()).unwrap();
    let budget = budget(plain, grads);
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap();
    let choice = &report.choice;
    assert_ne!(choice.strategy, "baseline", "{}", report.to_text());
    let spec = model.optimizer();
    assert!(spec.is_some());
    let before = host(&model.parameters());
    // Every configuration fit considered builds a trainer with its levers and its
    // schedule (not only the choice, whose schedule depends on the machine's speed).
    let mut scheduled = 0;
    for c in &report.candidates {
        let trainer = c.choice.trainer_builder(spec).build(&mut model).unwrap();
        assert_eq!(
            trainer.config(),
            &c.choice.step_config(spec),
            "{}",
            c.choice.strategy
        );
        let layers = trainer.model().layers().len();
        let expected = c
            .choice
            .schedule()
            .cloned()
            .unwrap_or_else(|| Schedule::plain(layers));
        assert_eq!(
            trainer.model().layers().schedule(),
            &expected,
            "{}",
            c.choice.strategy
        );
        scheduled += usize::from(c.choice.schedule().is_some());
        // A per-layer choice puts the chain's layers under their levers.
        if let Some(levers) = c.choice.block_levers() {
            let layers = trainer.model().layers();
            assert_eq!(layers.plan(), memsave_checkpoint::Plan::PerLayer);
            for (key, lever) in levers {
                assert_eq!(layers.blocks().lever(&key).name(), lever.name(), "{key}");
            }
        }
    }

    let outside = crate::device::outside(&model);
    let mut trainer = report.trainer(&mut model).unwrap();
    // Everything the choice means: its levers, with the workload's optimizer...
    assert_eq!(trainer.config(), &choice.step_config(spec));
    // ... and its schedule on the layers (or none recomputed).
    let layers = trainer.model().layers().len();
    let schedule = choice
        .schedule()
        .cloned()
        .unwrap_or_else(|| Schedule::plain(layers));
    assert_eq!(trainer.model().layers().schedule(), &schedule);
    let mut trainer_peaks = Vec::new();
    let mut device_peaks = Vec::new();
    for _ in 0..3 {
        let m = trainer.step(&x).unwrap();
        trainer_peaks.push(m.peak_bytes);
        device_peaks.push(crate::device::peak(&m, &outside));
    }
    assert_eq!(trainer.steps(), 3);
    let state = trainer.optimizer_state_bytes();
    assert!(state > 0, "AdamW keeps two moments");
    drop(trainer);
    let trained = host(&model.parameters());
    assert_ne!(trained, before, "the optimizer stepped");

    // By hand, on a fresh model (fit left the first as it found it, bar the schedule).
    let mut by_hand = make();
    assert_eq!(host(&by_hand.parameters()), before);
    by_hand.layers_mut().set_schedule(schedule.clone()).unwrap();
    if let Some(levers) = choice.block_levers() {
        // A per-layer choice: the layers as blocks, each under its lever.
        memsave_step::plan::set_block_levers(&mut by_hand, levers).unwrap();
    }
    let xh = by_hand.batch(by_hand.global_batch()).unwrap();
    let config = choice.step_config(by_hand.optimizer());
    let params = by_hand.parameters();
    let mut optimizer = config
        .optimizer
        .map(|s| CaseOptimizer::build(&s, &params).unwrap());
    let mut hand_peaks = Vec::new();
    for _ in 0..3 {
        let m = f_step_with(
            &by_hand,
            &xh,
            &config,
            Device::Cpu,
            false,
            None,
            optimizer.as_mut(),
        )
        .unwrap();
        hand_peaks.push(m.peak_bytes);
    }
    assert!(
        host(&params) == trained,
        "parameters differ from the hand-assembled run's"
    );
    // fit's budget counts the optimizer's state: every step is within it, the first
    // (which makes the state) too.
    for (i, peak) in device_peaks.iter().enumerate() {
        assert!(
            *peak <= budget,
            "step {i} of {} peaked at {peak}, over the budget {budget} (optimizer state {state})",
            choice.strategy
        );
    }
    assert_eq!(trainer_peaks, hand_peaks);
    (choice.strategy.clone(), scheduled)
}

fn adamw(mut model: Mlp) -> Mlp {
    model.optimizer = Some(OptimizerSpec {
        kind: OptimizerKind::Adamw,
        lr: Some(1e-2),
        ..Default::default()
    });
    model
}

#[test]
#[serial]
fn the_trainer_from_fit_s_choice_trains_as_the_choice_assembled_by_hand() {
    // Half the plain step's peak: recompute, offload or the step in backward.
    let (strategy, scheduled) =
        trainer_matches_by_hand(|| adamw(Mlp::new(6, 32, 16, 32)), |plain, _| plain / 2);
    assert!(scheduled > 0, "no candidate recomputes");
    eprintln!("half the plain peak: {strategy}");
}

#[test]
#[serial]
fn the_trainer_from_fit_s_choice_steps_the_optimizer_in_backward_as_chosen() {
    // Wide layers, few examples, a budget below the gradients' bytes: only a choice
    // that never holds every gradient fits, so AdamW steps in backward (the choice's
    // lever on the workload's optimizer), with gradients in files if need be.
    let (strategy, _) = trainer_matches_by_hand(
        || adamw(Mlp::new(3, 96, 4, 2)),
        // The parameters, AdamW's two moments (each as many bytes as the
        // gradients), the data the batch is sliced from (4 × 2 × 96 f32: 3 KiB)
        // and three quarters of the gradients.
        |_, grads| 3 * grads + 3072 + grads * 3 / 4,
    );
    assert!(strategy.contains("in_backward=true"), "{strategy}");
    eprintln!("below the gradients: {strategy}");
}

#[test]
#[serial]
fn the_request_s_optimizer_is_stepped_instead_of_the_workload_s() {
    // The workload asks for no optimizer; the request gives AdamW. A budget below the
    // gradients' bytes needs the step in backward, a lever of an optimizer only.
    let mut model = Mlp::new(3, 96, 4, 2);
    assert!(model.optimizer.is_none());
    let grads: u64 = model
        .parameters()
        .iter()
        .map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as u64)
        .sum();
    let spec = adamw(Mlp::new(1, 4, 1, 1)).optimizer;
    // The parameters, AdamW's two moments, the data the batch is sliced from (4 × 2 ×
    // 96 f32: 3 KiB) and three quarters of the gradients.
    let mut request = FitRequest::new(3 * grads + 3072 + grads * 3 / 4);
    request.optimizer = spec;
    let report = fit(&mut model, &request).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.optimizer, spec);
    assert!(
        report.choice.strategy.contains("in_backward=true"),
        "{}",
        report.to_text()
    );
    // The trainer steps the optimizer the fit stepped, within the budget after the
    // step that makes its state.
    let before = host(&model.parameters());
    let outside = crate::device::outside(&model);
    let batch = model.batch(model.global_batch()).unwrap();
    let mut trainer = report.trainer(&mut model).unwrap();
    for _ in 0..2 {
        let peak = crate::device::peak(&trainer.step(&batch).unwrap(), &outside);
        assert!(
            peak <= request.budget_bytes,
            "{peak} > {}",
            request.budget_bytes
        );
    }
    assert!(trainer.optimizer_state_bytes() > 0, "no AdamW state");
    drop(trainer);
    assert_ne!(
        host(&model.parameters()),
        before,
        "the weights did not move"
    );
}

/// With room for the parameters, the data and the gradients but not for AdamW's two
/// moments (twice the parameters), only a configuration that keeps the state in files
/// fits: `fit` finds it as predicted on its first try, and a trainer built from its
/// report trains, step after step, to the weights the same levers reach with the state
/// on the device (and, with one micro-batch, plain AdamW), bitwise.
#[test]
#[serial]
fn without_room_for_adamw_s_state_fit_keeps_it_in_files_and_trains_as_plain_adamw() {
    memsave_meter::install();
    let make = || adamw(Mlp::new(3, 96, 4, 2));
    let mut model = make();
    let parameters: u64 = model
        .parameters()
        .iter()
        .map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as u64)
        .sum();
    // The parameters, the gradients (as many bytes), the data the batch is sliced
    // from (4 × 2 × 96 f32: 3 KiB): less than the parameters and AdamW's state alone.
    let budget = 2 * parameters + 3072;
    assert!(budget < 3 * parameters);
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap_or_else(|e| panic!("{e}"));
    let text = report.to_text();
    assert!(report.choice.state_in_files, "{text}");
    assert!(report.choice.is_lossless(), "{text}");
    assert!(report.measured_peak_bytes <= budget, "{text}");
    let error = report.predicted_peak_bytes as f64 / report.measured_peak_bytes as f64 - 1.0;
    assert!(error.abs() <= 0.05, "{error:+.3}\n{text}");
    assert_eq!(report.tries, 1, "{text}");
    // No state waits on the device between steps.
    assert_eq!(report.breakdown.optimizer_state, 0, "{text}");

    let x = model.batch(model.global_batch()).unwrap();
    let outside = crate::device::outside(&model);
    let mut trainer = report.trainer(&mut model).unwrap();
    for step in 0..5 {
        let peak = crate::device::peak(&trainer.step(&x).unwrap(), &outside);
        assert!(peak <= budget, "step {step}: {peak} > {budget}\n{text}");
    }
    drop(trainer);

    // By hand: the same configuration with the state on the device, and (with one
    // micro-batch, where the split changes no sum) plain AdamW.
    let trained = host(&model.parameters());
    let mut on_device = report.choice.step_config(report.optimizer);
    if let Some(o) = on_device.optimizer.as_mut() {
        o.placement = memsave_step::levers::StatePlacement::Device;
    }
    let mut plain = StepConfig::baseline();
    plain.optimizer = report.optimizer;
    let mut references = vec![("the same levers with the state on the device", on_device)];
    if report.choice.micro_batches == 1 {
        references.push(("plain AdamW", plain));
    }
    for (what, config) in references {
        let by_hand = make();
        let x = by_hand.batch(by_hand.global_batch()).unwrap();
        let params = by_hand.parameters();
        let mut optimizer = CaseOptimizer::build(&config.optimizer.unwrap(), &params).unwrap();
        for _ in 0..5 {
            f_step_with(
                &by_hand,
                &x,
                &config,
                Device::Cpu,
                false,
                None,
                Some(&mut optimizer),
            )
            .unwrap();
        }
        assert!(
            trained == host(&params),
            "the weights differ from {what}'s after 5 steps\n{text}"
        );
    }
}
