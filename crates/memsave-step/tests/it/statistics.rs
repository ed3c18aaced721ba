//! A step with a one-example micro-batch that turns BatchNorm's running statistics NaN
//! fails with `NonFiniteStatistics`, puts the statistics back bitwise, and keeps the
//! step's gradients (restored from files too).
use memsave_checkpoint::CheckpointedSequential;
use memsave_step::config::GradsAfter;
use memsave_step::{Batch, StepConfig, StepError, StepRun, Workload};
use serial_test::serial;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

/// `BatchNorm1d(Linear(x))` on `[batch, 8]`: one example gives one value per channel.
struct Norm1d {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Tensor,
}

impl Norm1d {
    fn new(batch: i64) -> Norm1d {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let linear = nn::linear(vs.root() / "linear", 8, 8, Default::default());
        let norm = nn::batch_norm1d(vs.root() / "norm", 8, Default::default());
        let layers =
            CheckpointedSequential::new().add_fn(move |x| norm.forward_t(&linear.forward(x), true));
        let data = Tensor::rand([batch, 8], (Kind::Float, Device::Cpu));
        Norm1d { vs, layers, data }
    }
}

impl Workload for Norm1d {
    fn name(&self) -> &str {
        "norm1d"
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
    fn global_batch(&self) -> i64 {
        self.data.size()[0]
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    }
    fn buffers(&self) -> Vec<Tensor> {
        let mut named: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(_, t)| !t.requires_grad())
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named.into_iter().map(|(_, t)| t).collect()
    }
}

#[test]
#[serial]
fn one_value_per_channel_is_refused_with_the_statistics_put_back_and_the_gradients_kept() {
    memsave_meter::install();
    for offload_grads in [None, Some(GradsAfter::Restored)] {
        let model = Norm1d::new(4);
        let x = model.batch(4).unwrap();
        let before: Vec<Tensor> = model.buffers().iter().map(Tensor::copy).collect();
        let mut config = StepConfig::baseline();
        config.offload_grads = offload_grads;
        config.micro_batches = Some(4);
        let e = StepRun::new(Device::Cpu)
            .f_step(&model, &x, &config)
            .expect_err("one value per channel");
        assert!(
            matches!(
                e,
                StepError::NonFiniteStatistics {
                    buffers: 1,
                    micro_batch: 1
                }
            ),
            "{offload_grads:?}: {e:?}"
        );
        for (b, a) in before.iter().zip(model.buffers()) {
            assert!(b.equal(&a), "{offload_grads:?}: a statistic not put back");
        }
        for p in model.parameters() {
            assert!(
                p.grad().defined(),
                "{offload_grads:?}: the step's gradients are lost"
            );
        }
        // Two examples a micro-batch: a step as any other.
        config.micro_batches = Some(2);
        StepRun::new(Device::Cpu)
            .f_step(&model, &x, &config)
            .unwrap_or_else(|e| panic!("{offload_grads:?}: 2x2: {e}"));
        // Unchecked, the same split leaves the NaN the check reports.
        config.micro_batches = Some(4);
        StepRun::new(Device::Cpu)
            .check_statistics(false)
            .f_step(&model, &x, &config)
            .unwrap();
        let nan = model
            .buffers()
            .iter()
            .any(|b| b.isnan().any().int64_value(&[]) == 1);
        assert!(nan, "{offload_grads:?}: no NaN without the check");
    }
}
