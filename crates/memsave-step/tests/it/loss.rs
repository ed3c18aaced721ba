//! A step's measurement carries its loss: the whole batch's for a mean loss, however
//! the step is split or what else it does.
use crate::common::Mlp;
use memsave_step::{StepConfig, Trainer, Workload};
use serial_test::serial;
use tch::Kind;

/// The workload's loss on its whole batch from one plain forward, without a step.
fn plain_loss(model: &Mlp, batch: i64) -> f64 {
    let _no_grad = tch::no_grad_guard();
    let x = model.batch(batch).unwrap();
    let out = model.layers().f_forward(&x.input).unwrap();
    model.loss(&out, None).unwrap().double_value(&[])
}

#[test]
#[serial]
fn the_step_s_loss_is_the_batch_s_under_every_split() {
    memsave_meter::install();
    let batch = 8;
    for micro_batches in [None, Some(2), Some(3), Some(8)] {
        for autocast in [None, Some(Kind::BFloat16)] {
            let mut model = Mlp::new(3, 16, batch, 4);
            let expected = plain_loss(&model, batch);
            let x = model.batch(batch).unwrap();
            let mut config = StepConfig::baseline();
            config.micro_batches = micro_batches;
            config.autocast = autocast;
            // `Trainer::builder` needs no type for the model.
            let mut trainer = Trainer::builder(config).build(&mut model).unwrap();
            let m = trainer.step(&x).unwrap();
            let loss = m.loss.expect("a scalar loss is reported");
            // bf16 activations: the loss to bf16's precision.
            let tolerance = if autocast.is_some() { 2e-2 } else { 1e-6 };
            assert!(
                ((loss - expected) / expected).abs() < tolerance,
                "{micro_batches:?} {autocast:?}: {loss} against {expected}"
            );
        }
    }
}

/// A classifier whose logits (`[4, 2000]`, 32,000 bytes) are the largest tensor of its
/// step, with cross-entropy as its loss: log-softmax's backward keeps its own result,
/// not the logits.
struct Classifier {
    vs: tch::nn::VarStore,
    layers: memsave_checkpoint::CheckpointedSequential,
}

impl Classifier {
    fn new() -> Self {
        use tch::nn::Module;
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let head = tch::nn::linear(vs.root() / "head", 8, 2000, Default::default());
        let layers =
            memsave_checkpoint::CheckpointedSequential::new().add_fn(move |x| head.forward(x));
        Self { vs, layers }
    }
}

impl Workload for Classifier {
    fn name(&self) -> &str {
        "classifier"
    }
    fn device(&self) -> tch::Device {
        tch::Device::Cpu
    }
    fn layers(&self) -> &memsave_checkpoint::CheckpointedSequential {
        &self.layers
    }
    fn layers_mut(&mut self) -> &mut memsave_checkpoint::CheckpointedSequential {
        &mut self.layers
    }
    fn parameters(&self) -> Vec<tch::Tensor> {
        self.vs.trainable_variables()
    }
    fn global_batch(&self) -> i64 {
        4
    }
    fn batch(&self, size: i64) -> Result<memsave_step::Batch, tch::TchError> {
        let opts = (Kind::Float, tch::Device::Cpu);
        Ok(memsave_step::Batch {
            input: tch::Tensor::ones([size, 8], opts),
            target: Some(tch::Tensor::arange(size, (Kind::Int64, tch::Device::Cpu))),
        })
    }
    fn loss(
        &self,
        output: &tch::Tensor,
        target: Option<&tch::Tensor>,
    ) -> Result<tch::Tensor, tch::TchError> {
        output.f_log_softmax(-1, Kind::Float)?.f_nll_loss(
            target.expect("a target"),
            None::<tch::Tensor>,
            tch::Reduction::Mean,
            -100,
        )
    }
}

/// The Trainer's step peaks at the bytes of a careful loop, `loss = ce(model(x), y);
/// loss.backward()`, measured here by hand: the output (the logits) is dropped once the
/// loss is computed, not held through backward.
#[test]
#[serial]
fn the_step_holds_no_output_a_careful_loop_frees() {
    memsave_meter::install();
    let mut model = Classifier::new();
    let x = model.batch(4).unwrap();
    let careful = |model: &Classifier| {
        for p in model.parameters() {
            memsave_sys::tensor::set_grad_none(&p).unwrap();
        }
        let (_, m) = memsave_meter::f_measure(tch::Device::Cpu, |_| {
            let loss = model
                .loss(
                    &model.layers().f_forward(&x.input).unwrap(),
                    x.target.as_ref(),
                )
                .unwrap();
            loss.backward();
        })
        .unwrap();
        m.peak_bytes
    };
    careful(&model);
    let by_hand = careful(&model);
    let mut trainer = Trainer::builder(StepConfig::baseline())
        .build(&mut model)
        .unwrap();
    trainer.step(&x).unwrap();
    let step = trainer.step(&x).unwrap();
    assert_eq!(step.peak_bytes, by_hand);
    drop(trainer);
    // The logits are the largest tensor: a loop that keeps them peaks higher.
    for p in model.parameters() {
        memsave_sys::tensor::set_grad_none(&p).unwrap();
    }
    let (_, kept) = memsave_meter::f_measure(tch::Device::Cpu, |_| {
        let out = model.layers().f_forward(&x.input).unwrap();
        let loss = model.loss(&out, x.target.as_ref()).unwrap();
        loss.backward();
        drop(out);
    })
    .unwrap();
    assert_eq!(kept.peak_bytes, by_hand + 4 * 2000 * 4);
}
