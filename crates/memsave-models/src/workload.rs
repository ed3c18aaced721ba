//! [`ZooWorkload`]: a network of the zoo with a synthetic batch, as a memsave workload.
use crate::architecture::Architecture;
use crate::error::ModelError;
use crate::network::{Network, Task};
use memsave_checkpoint::{Blocks, CheckpointedSequential};
use memsave_step::{Batch, LayerWrapper, LayerWrapperSlot, Workload};
use tch::{nn, Device, TchError, Tensor};

/// A network of the zoo, its parameters and buffers in a `VarStore`, and one global
/// batch of synthetic examples made at construction: what the harness, `fit` and a
/// user's own loop run.
pub struct ZooWorkload {
    name: String,
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    task: Task,
    data: Batch,
    blocks: Option<Blocks>,
    /// What each layer's forward runs through (ZeRO-3's units).
    wrapper: LayerWrapperSlot,
    /// A chain's parameters per layer, found once when first asked.
    layer_params: std::cell::OnceCell<Vec<Vec<Tensor>>>,
}

impl std::fmt::Debug for ZooWorkload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooWorkload")
            .field("name", &self.name)
            .field("layers", &self.layers)
            .field("task", &self.task)
            .finish_non_exhaustive()
    }
}

impl ZooWorkload {
    /// Builds `architecture` on `device` and a batch of `global_batch` synthetic
    /// examples, both from libtorch's current random stream (call `tch::manual_seed`
    /// first for the same model and batch every time).
    ///
    /// # Errors
    /// A configuration the architecture refuses, a `global_batch` below 1, or libtorch
    /// failing (out of memory).
    pub fn new(
        name: impl Into<String>,
        architecture: &Architecture,
        global_batch: i64,
        device: Device,
    ) -> Result<ZooWorkload, ModelError> {
        if global_batch < 1 {
            return Err(ModelError::config(
                "batch",
                format!("must be at least 1, got {global_batch}"),
            ));
        }
        let vs = nn::VarStore::new(device);
        let network = architecture.build(&vs.root())?;
        let data = network.synthetic_batch(global_batch, device)?;
        let Network {
            layers,
            task,
            blocks,
            ..
        } = network;
        let wrapper = LayerWrapperSlot::default();
        let layers = layers.into_iter().enumerate().fold(
            CheckpointedSequential::new(),
            |seq, (index, layer)| {
                seq.add_t(BoxedLayer {
                    index,
                    layer,
                    wrapper: wrapper.clone(),
                })
            },
        );
        Ok(ZooWorkload {
            name: name.into(),
            vs,
            layers,
            task,
            data,
            blocks,
            wrapper,
            layer_params: Default::default(),
        })
    }

    /// The parameters and buffers, under tch's (or torchvision's) names.
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// The parameters and buffers, e.g. to load a tch checkpoint of the same
    /// architecture (`var_store_mut().load(path)`).
    pub fn var_store_mut(&mut self) -> &mut nn::VarStore {
        &mut self.vs
    }

    /// What the network's input is and what its loss compares.
    pub fn task(&self) -> Task {
        self.task
    }

    /// The named blocks of a network that is not a chain (the U-Net, the
    /// encoder–decoder), whose forward is the chain's one layer: set their levers
    /// (`blocks().set_every(BlockLever::Recompute)` checkpoints every block) instead
    /// of a plan of the chain. `None` for a chain.
    pub fn blocks(&self) -> Option<&Blocks> {
        self.blocks.as_ref()
    }
}

/// A boxed `ModuleT` as a `ModuleT` (the chain takes layers by value).
/// One layer of the network, run through the workload's wrapper (if set).
#[derive(Debug)]
struct BoxedLayer {
    index: usize,
    layer: Box<dyn nn::ModuleT>,
    wrapper: LayerWrapperSlot,
}

impl nn::ModuleT for BoxedLayer {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.wrapper
            .run(self.index, || self.layer.forward_t(xs, train))
    }
}

impl Workload for ZooWorkload {
    fn name(&self) -> &str {
        &self.name
    }

    fn device(&self) -> Device {
        self.vs.device()
    }

    fn layers(&self) -> &CheckpointedSequential {
        &self.layers
    }

    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.layers
    }

    fn blocks(&self) -> Option<&Blocks> {
        self.blocks.as_ref()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    /// The variables of the store that are not trained (BatchNorm's running mean,
    /// variance and batch count), in the order of their names.
    fn buffers(&self) -> Vec<Tensor> {
        memsave_step::var_store_buffers(&self.vs)
    }

    fn global_batch(&self) -> i64 {
        self.data.len()
    }

    /// The first `size` examples of the global batch (views); beyond it, the global
    /// batch repeated (new tensors).
    fn batch(&self, size: i64) -> Result<Batch, TchError> {
        let have = self.data.len();
        if size <= have {
            return self.data.f_narrow(0, size);
        }
        let times = (size + have - 1) / have.max(1);
        let repeat = |t: &Tensor| -> Result<Tensor, TchError> {
            let mut reps = vec![1i64; t.dim()];
            reps[0] = times;
            t.f_repeat(&reps)?.f_narrow(0, 0, size)
        };
        Ok(Batch {
            input: repeat(&self.data.input)?,
            target: self.data.target.as_ref().map(repeat).transpose()?,
        })
    }

    /// Cross-entropy against the batch's target, in f32 ([`Task::loss`]).
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, TchError> {
        self.task.loss(output, target)
    }

    /// A chain's parameters per layer (ZeRO-3's units): those each layer's output
    /// depends on, found once by running each layer on the first example in
    /// evaluation mode (`CheckpointedSequential::f_layer_parameters`; a head tied to
    /// the embedding is then in two layers, which ZeRO-3 refuses). `None` for a network
    /// of blocks, whose one layer is the whole forward.
    fn layer_parameters(&self) -> Result<Option<Vec<Vec<Tensor>>>, TchError> {
        if self.blocks.is_some() {
            return Ok(None);
        }
        // Found once; a failure is not kept (the next call tries again).
        let found = match self.layer_params.get() {
            Some(found) => found,
            None => {
                let first = self.data.input.f_narrow(0, 0, 1)?;
                let lists = self
                    .layers
                    .f_layer_parameters(&first, &self.vs.trainable_variables(), false)
                    .map_err(|e| TchError::Torch(e.to_string()))?;
                self.layer_params.get_or_init(|| lists)
            }
        };
        Ok(Some(
            found
                .iter()
                .map(|l| l.iter().map(Tensor::shallow_clone).collect())
                .collect(),
        ))
    }

    /// Every layer runs through `wrapper` (ZeRO-3 gathers its unit around it).
    fn set_layer_wrapper(&self, wrapper: Option<LayerWrapper>) -> bool {
        self.wrapper.set(wrapper);
        true
    }
}
