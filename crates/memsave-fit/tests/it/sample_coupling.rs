//! `fit` on a step that couples the samples of a batch (BatchNorm in training mode):
//! micro-batches are a lossy lever there, offered only when allowed and never called
//! lossless; and `fit` leaves the model bitwise as it found it (parameters, BatchNorm's
//! running statistics, the CPU random generator's stream).
use memsave_checkpoint::CheckpointedSequential;
use memsave_fit::{fit, FitRequest};
use memsave_step::step::f_step;
use memsave_step::{Batch, OptimizerSpec, StepConfig, Workload};
use serial_test::serial;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

/// How each block of [`ConvNet`] mixes the samples of a batch.
#[derive(Clone, Copy, PartialEq)]
enum Mix {
    /// Not at all: each sample alone.
    None,
    /// BatchNorm1d in training mode (an op `memsave_sys::ops::sample_coupling_op` names).
    BatchNorm,
    /// `y - y.mean(0)`: a reduction over the batch no op list names.
    Center,
}

/// Residual blocks `x + relu(mix(conv1d(x)))`, with dropout when `dropout`, on a fixed
/// batch of `[batch, 8, 32]`.
struct ConvNet {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Tensor,
    optimizer: Option<OptimizerSpec>,
}

impl ConvNet {
    fn new(mix: Mix, dropout: bool, batch: i64) -> ConvNet {
        tch::manual_seed(11);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut seq = CheckpointedSequential::new();
        for i in 0..4 {
            let p = vs.root() / i;
            let conv = nn::conv1d(
                &p / "conv",
                8,
                8,
                3,
                nn::ConvConfig {
                    padding: 1,
                    ..Default::default()
                },
            );
            let norm =
                (mix == Mix::BatchNorm).then(|| nn::batch_norm1d(&p / "bn", 8, Default::default()));
            seq = seq.add_fn(move |x| {
                let y = conv.forward(x);
                let y = match &norm {
                    Some(norm) => norm.forward_t(&y, true),
                    None if mix == Mix::Center => &y - y.mean_dim(0, true, Kind::Float),
                    None => y,
                };
                let y = if dropout { y.dropout(0.1, true) } else { y };
                x + y.relu()
            });
        }
        let data = Tensor::rand([batch, 8, 32], (Kind::Float, Device::Cpu));
        ConvNet {
            vs,
            layers: seq,
            data,
            optimizer: None,
        }
    }
}

impl Workload for ConvNet {
    fn name(&self) -> &str {
        "convnet"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        &self.layers
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.layers
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }
    fn buffers(&self) -> Vec<Tensor> {
        memsave_step::var_store_buffers(&self.vs)
    }
    fn global_batch(&self) -> i64 {
        self.data.size()[0]
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    }
    fn optimizer(&self) -> Option<OptimizerSpec> {
        self.optimizer
    }
}

/// The peak of one plain step on the whole batch, measured by the meter; the model's
/// state is put back by the caller's snapshot where it matters.
fn baseline_peak(model: &mut ConvNet) -> u64 {
    memsave_meter::install();
    let x = model.batch(model.global_batch()).unwrap();
    let m = f_step(model, &x, &StepConfig::baseline(), Device::Cpu, false, None).unwrap();
    memsave_accum::free_grads(&model.parameters()).unwrap();
    m.peak_bytes
}

fn copies(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.detach().copy()).collect()
}

fn assert_bitwise(what: &str, before: &[Tensor], after: &[Tensor]) {
    assert_eq!(before.len(), after.len());
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        assert!(
            b.equal(a),
            "{what} {i} changed by fit: max difference {}",
            f64::try_from((b - a).abs().max()).unwrap()
        );
    }
}

#[test]
#[serial]
fn micro_batches_are_lossy_with_batch_norm_and_offered_only_when_allowed() {
    let mut model = ConvNet::new(Mix::BatchNorm, false, 16);
    let budget = (baseline_peak(&mut model) as f64 * 0.6) as u64;

    let report = fit(&mut model, &FitRequest::new(budget)).unwrap();
    let op = report
        .sample_coupling_op
        .clone()
        .expect("the batch norm in training mode is found");
    assert!(op.contains("batch_norm"), "{op}");
    assert!(
        report.why.contains(&op) && report.why.contains("training mode"),
        "{}",
        report.why
    );
    assert!(
        report
            .candidates
            .iter()
            .all(|c| c.choice.micro_batches == 1),
        "micro-batches offered without being allowed:\n{}",
        report.to_text()
    );
    assert!(report.choice.is_lossless(), "{}", report.choice.strategy);

    let mut request = FitRequest::new(budget);
    request.allow.micro_batches = true;
    let report = fit(&mut model, &request).unwrap();
    assert_eq!(report.sample_coupling_op.as_deref(), Some(op.as_str()));
    let split: Vec<_> = report
        .candidates
        .iter()
        .filter(|c| c.choice.micro_batches > 1)
        .collect();
    assert!(!split.is_empty(), "{}", report.to_text());
    for c in split {
        assert!(
            !c.choice.is_lossless(),
            "{} called lossless",
            c.choice.strategy
        );
        assert_eq!(c.choice.sample_coupling_op.as_deref(), Some(op.as_str()));
    }
    assert!(report.why.contains(&op), "{}", report.why);
}

/// Without coupling a split is lossless, with dropout too: its draws differ between a
/// split and the whole batch (as between two steps), which is no change of the step.
#[test]
#[serial]
fn without_batch_norm_micro_batches_stay_lossless() {
    let mut model = ConvNet::new(Mix::None, true, 16);
    let off = split_rel_l2(&model);
    assert!(
        off > 1e-4,
        "dropout should draw otherwise when split: {off}"
    );
    let budget = (baseline_peak(&mut model) as f64 * 0.6) as u64;
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap();
    assert_eq!(report.sample_coupling_op, None);
    assert!(
        report.candidates.iter().any(|c| c.choice.micro_batches > 1),
        "{}",
        report.to_text()
    );
    for c in &report.candidates {
        assert!(c.choice.is_lossless(), "{}", c.choice.strategy);
        assert_eq!(c.choice.sample_coupling_op, None);
    }
    assert!(!report.why.contains("training mode"), "{}", report.why);
}

#[test]
#[serial]
fn fit_leaves_parameters_buffers_and_the_random_stream_as_it_found_them() {
    for optimizer in [None, Some(OptimizerSpec::default())] {
        let mut model = ConvNet::new(Mix::BatchNorm, true, 12);
        model.optimizer = optimizer;
        // A step first, so that the running statistics are not their initial values.
        baseline_peak(&mut model);
        let budget = (baseline_peak(&mut model) as f64 * 0.6) as u64;
        let params = copies(&model.parameters());
        let buffers = copies(&model.buffers());
        assert_eq!(buffers.len(), 2 * 4, "running mean and var per BN");
        let rng = memsave_sys::rng::cpu_state().unwrap();
        let next = Tensor::rand([64], (Kind::Float, Device::Cpu));
        memsave_sys::rng::set_cpu_state(&rng).unwrap();

        let mut request = FitRequest::new(budget);
        request.allow.micro_batches = true;
        fit(&mut model, &request).unwrap();

        assert_bitwise("parameter", &params, &model.parameters());
        assert_bitwise("buffer", &buffers, &model.buffers());
        let drawn = Tensor::rand([64], (Kind::Float, Device::Cpu));
        assert!(drawn.equal(&next), "the random stream moved");
    }
}

/// The relative L2 difference between the gradients of one plain step on the whole
/// batch and on the same batch in two micro-batches, measured here with `f_step`.
fn split_rel_l2(model: &ConvNet) -> f64 {
    let x = model.batch(model.global_batch()).unwrap();
    let grads = |micro_batches| {
        let mut config = StepConfig::baseline();
        config.micro_batches = micro_batches;
        f_step(model, &x, &config, Device::Cpu, false, None).unwrap();
        let g = memsave_step::step::f_grads(&model.parameters()).unwrap();
        memsave_accum::free_grads(&model.parameters()).unwrap();
        g
    };
    let whole = grads(None);
    memsave_step::step::rel_l2_diff(&grads(Some(2)), &whole)
}

/// Issue "Trust III" item 2: `y - y.mean(0)` couples the samples as BatchNorm does, but
/// no op list names it. `fit` called its splits lossless (11 micro-batches chosen,
/// gradients 0.87 off); it now finds the coupling in the gradients of a split and never
/// calls a split lossless (offered, as with BatchNorm, only when allowed).
#[test]
#[serial]
fn a_reduction_over_the_batch_makes_micro_batches_lossy() {
    let mut model = ConvNet::new(Mix::Center, false, 16);
    let off = split_rel_l2(&model);
    assert!(off > 1e-2, "the split should change the gradients: {off}");
    let budget = (baseline_peak(&mut model) as f64 * 0.6) as u64;

    let mut request = FitRequest::new(budget);
    request.allow.micro_batches = true;
    let report = fit(&mut model, &request).unwrap();
    let coupling = report
        .sample_coupling_op
        .clone()
        .expect("the coupling is found from the gradients");
    assert!(coupling.contains("changed the gradients"), "{coupling}");
    assert!(report.why.contains("couples the samples"), "{}", report.why);
    let split: Vec<_> = report
        .candidates
        .iter()
        .filter(|c| c.choice.micro_batches > 1)
        .collect();
    assert!(!split.is_empty(), "{}", report.to_text());
    for c in split {
        assert!(
            !c.choice.is_lossless(),
            "{} called lossless",
            c.choice.strategy
        );
    }
}
