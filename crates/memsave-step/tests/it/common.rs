//! The small models the integration tests of memsave-step and memsave-fit run on (fit's
//! include this file by path).
use memsave_checkpoint::CheckpointedSequential;
use memsave_step::{Batch, LayerWrapper, LayerWrapperSlot, OptimizerSpec, Workload};
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

/// A residual MLP: `layers` blocks of `x + W2 gelu(W1 x)` of width `hidden`; each
/// block's forward runs through a [`LayerWrapperSlot`], so ZeRO-3 can shard it.
pub struct Mlp {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    /// Each block's weights and biases: `up` then `down`.
    layer_params: Vec<Vec<Tensor>>,
    wrapper: LayerWrapperSlot,
    data: Tensor,
    /// The loss fails: a workload whose step fails.
    pub fail: bool,
    /// The optimizer the workload asks for.
    pub optimizer: Option<OptimizerSpec>,
}

impl Mlp {
    pub fn new(layers: usize, hidden: i64, batch: i64, rows: i64) -> Mlp {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut seq = CheckpointedSequential::new();
        let wrapper = LayerWrapperSlot::default();
        let mut layer_params = Vec::new();
        for i in 0..layers {
            let p = vs.root() / i;
            let up = nn::linear(&p / "up", hidden, 2 * hidden, Default::default());
            let down = nn::linear(&p / "down", 2 * hidden, hidden, Default::default());
            layer_params.push(
                [&up, &down]
                    .iter()
                    .flat_map(|l| [l.ws.shallow_clone(), l.bs.as_ref().unwrap().shallow_clone()])
                    .collect(),
            );
            let slot = wrapper.clone();
            seq =
                seq.add_fn(move |x| slot.run(i, || x + down.forward(&up.forward(x).gelu("none"))));
        }
        let data = Tensor::rand([batch, rows, hidden], (Kind::Float, Device::Cpu));
        Mlp {
            vs,
            layers: seq,
            layer_params,
            wrapper,
            data,
            fail: false,
            optimizer: None,
        }
    }
}

impl Workload for Mlp {
    fn name(&self) -> &str {
        "mlp"
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
    fn optimizer(&self) -> Option<OptimizerSpec> {
        self.optimizer
    }
    fn layer_parameters(&self) -> Result<Option<Vec<Vec<Tensor>>>, tch::TchError> {
        Ok(Some(
            self.layer_params
                .iter()
                .map(|l| l.iter().map(Tensor::shallow_clone).collect())
                .collect(),
        ))
    }
    fn set_layer_wrapper(&self, wrapper: Option<LayerWrapper>) -> bool {
        self.wrapper.set(wrapper);
        true
    }
    fn loss(&self, output: &Tensor, _target: Option<&Tensor>) -> Result<Tensor, tch::TchError> {
        if self.fail {
            return Err(tch::TchError::Kind("this loss always fails".into()));
        }
        output.f_square()?.f_mean(Kind::Float)
    }
}

/// `relu(Linear(BatchNorm1d(Linear(x))))` of width `width` on `[batch, width]`: a
/// micro-batch of one example gives the BatchNorm one value per channel, which turns
/// its running variance NaN.
pub struct Norm1d {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Tensor,
}

impl Norm1d {
    pub fn new(batch: i64, width: i64) -> Norm1d {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let first = nn::linear(vs.root() / "first", width, width, Default::default());
        let norm = nn::batch_norm1d(vs.root() / "norm", width, Default::default());
        let second = nn::linear(vs.root() / "second", width, width, Default::default());
        let layers = CheckpointedSequential::new()
            .add_fn(move |x| norm.forward_t(&first.forward(x), true))
            .add_fn(move |x| second.forward(x).relu());
        let data = Tensor::rand([batch, width], (Kind::Float, Device::Cpu));
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
    /// The running statistics, by name.
    fn buffers(&self) -> Vec<Tensor> {
        memsave_step::var_store_buffers(&self.vs)
    }
    fn global_batch(&self) -> i64 {
        self.data.size()[0]
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    }
}
