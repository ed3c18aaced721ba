//! [`Workload`]: a model as memsave measures and plans it, whoever defined it.
use crate::config::ResidualUpdate;
use crate::levers::OptimizerSpec;
use crate::measure::TraceEntry;
use memsave_checkpoint::{Blocks, CheckpointedSequential};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, TchError, Tensor};

/// A batch of examples: the model's input and, for losses that need one, a target.
/// Both are split along their first dimension into micro-batches.
#[derive(Debug)]
pub struct Batch {
    /// The model's input; its first dimension is the batch.
    pub input: Tensor,
    /// What the loss compares the output with, if anything; its first dimension is the
    /// batch too.
    pub target: Option<Tensor>,
}

impl Batch {
    /// A batch with an input only (losses such as the mean square of the output).
    pub fn input(input: Tensor) -> Self {
        Self {
            input,
            target: None,
        }
    }

    /// The number of examples (the input's first dimension).
    pub fn len(&self) -> i64 {
        self.input.size().first().copied().unwrap_or(0)
    }

    /// True when the batch has no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Examples `start..start + len` of input and target, as views (no copy).
    pub fn f_narrow(&self, start: i64, len: i64) -> Result<Batch, TchError> {
        Ok(Batch {
            input: self.input.f_narrow(0, start, len)?,
            target: self
                .target
                .as_ref()
                .map(|t| t.f_narrow(0, start, len))
                .transpose()?,
        })
    }

    /// Views of the same tensors.
    pub fn shallow_clone(&self) -> Batch {
        Batch {
            input: self.input.shallow_clone(),
            target: self.target.as_ref().map(Tensor::shallow_clone),
        }
    }
}

/// A model memsave can measure (`memsave_bench::run_workload`) and plan for
/// (`memsave_fit::fit`): its layers as a [`CheckpointedSequential`] (so that a
/// checkpoint plan is only a setting), its parameters, a maker of input batches of
/// any size, a loss and, optionally, an optimizer.
///
/// Only the first six methods are required. The rest have defaults that fit most
/// models: no buffers, the loss is the mean of the squared output, there is no optimizer, and
/// the harness's residual-update strategies (`inplace_add`, `add_out`,
/// `safe_residual`) and per-block traces are unavailable.
///
/// Traps: `batch` must return the same examples for the same size every time (a
/// fixed seed, or a slice of a batch made once), or gradients cannot be compared
/// between strategies; and the loss must be a mean over the batch, so that
/// micro-batches weighted by their size add up to the full batch's gradient.
///
/// ```
/// use memsave_checkpoint::{Blocks, CheckpointedSequential};
/// use memsave_step::{Batch, Workload};
/// use tch::{nn, nn::Module, Device, Kind, Tensor};
///
/// /// Three residual linear layers of width 16 and batches of 8 random rows.
/// struct Tiny {
///     vs: nn::VarStore,
///     layers: CheckpointedSequential,
///     data: Tensor,
/// }
///
/// impl Tiny {
///     fn new() -> Tiny {
///         tch::manual_seed(0);
///         let vs = nn::VarStore::new(Device::Cpu);
///         let mut layers = CheckpointedSequential::new();
///         for i in 0..3 {
///             let lin = nn::linear(vs.root() / i, 16, 16, Default::default());
///             layers = layers.add_fn(move |x| x + lin.forward(x).relu());
///         }
///         let data = Tensor::rand([8, 16], (Kind::Float, Device::Cpu));
///         Tiny { vs, layers, data }
///     }
/// }
///
/// impl Workload for Tiny {
///     fn name(&self) -> &str { "tiny" }
///     fn device(&self) -> Device { Device::Cpu }
///     fn layers(&self) -> &CheckpointedSequential { &self.layers }
///     fn layers_mut(&mut self) -> &mut CheckpointedSequential { &mut self.layers }
///     fn parameters(&self) -> Vec<Tensor> { self.vs.trainable_variables() }
///     fn global_batch(&self) -> i64 { 8 }
///     fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
///         Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
///     }
/// }
///
/// let tiny = Tiny::new();
/// assert_eq!(tiny.batch(4)?.len(), 4);
/// # Ok::<(), tch::TchError>(())
/// ```
pub trait Workload {
    /// The model's name in reports.
    fn name(&self) -> &str;

    /// The device its parameters and batches are on.
    fn device(&self) -> Device;

    /// The layers, run in order; the output of the last goes to [`loss`](Self::loss).
    fn layers(&self) -> &CheckpointedSequential;

    /// The layers, to set a checkpoint plan or profile them.
    fn layers_mut(&mut self) -> &mut CheckpointedSequential;

    /// The named blocks of a model that is not a chain (a U-Net, an encoder–decoder),
    /// whose forward runs in [`layers`](Self::layers) as one layer: a checkpoint plan
    /// then sets the blocks' levers (`checkpoint: {every_layer: true}` recomputes
    /// every block) and leaves that layer plain. `None` (the default) for a chain.
    fn blocks(&self) -> Option<&Blocks> {
        None
    }

    /// The trainable parameters.
    fn parameters(&self) -> Vec<Tensor>;

    /// The number of examples in one optimizer step (the global batch) by default.
    fn global_batch(&self) -> i64;

    /// A batch of `size` examples, the same ones for the same size every time (for
    /// `size <= global_batch()`, best the first `size` of the global batch).
    fn batch(&self, size: i64) -> Result<Batch, TchError>;

    /// Tensors the step updates in place that are not parameters, e.g. BatchNorm's
    /// running statistics; `memsave_fit::fit` restores them after its probe runs, as
    /// it restores the parameters, and a step with a one-example micro-batch checks
    /// they stay finite ([`StepError::NonFiniteStatistics`](crate::StepError)). None
    /// by default: a workload with BatchNorm layers should list them
    /// ([`var_store_buffers`] for a model in one `VarStore`), or `fit` leaves them
    /// moved by its runs and a NaN statistic goes unnoticed.
    fn buffers(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// The loss of `output` against the batch's `target`: a scalar, the mean over the
    /// batch. By default the mean of the squared output, in f32 (the target ignored).
    fn loss(&self, output: &Tensor, target: Option<&Tensor>) -> Result<Tensor, TchError> {
        let _ = target;
        mean_square(output)
    }

    /// The optimizer stepped at the end of every step, if the workload has one.
    fn optimizer(&self) -> Option<OptimizerSpec> {
        None
    }

    /// Makes every residual block use `update` from now on. Returns false when the
    /// model has no such blocks (the default), so strategies asking for another
    /// update than [`ResidualUpdate::Add`] are reported unavailable.
    fn set_residual(&self, update: ResidualUpdate) -> bool {
        update == ResidualUpdate::Add
    }

    /// Starts recording the memory around each block of the next forward (the
    /// harness's per-layer trace); by default nothing is recorded.
    fn start_trace(&self) {}

    /// Stops recording and returns what was recorded (by default nothing).
    fn stop_trace(&self) -> Vec<TraceEntry> {
        Vec::new()
    }

    /// The trainable parameters each layer of [`layers`](Self::layers) uses: one list
    /// per layer, in layer order, each parameter of [`parameters`](Self::parameters) in
    /// exactly one list. ZeRO-3 ([`DataParallel::Fsdp`](crate::DataParallel::Fsdp))
    /// shards each layer's list as one unit. `Ok(None)` by default: the parameters
    /// are not attributable to layers, and ZeRO-3 is refused. An `Err` (a workload
    /// that finds them by running its layers, and failed) is ZeRO-3's error, as it is.
    fn layer_parameters(&self) -> Result<Option<Vec<Vec<Tensor>>>, TchError> {
        Ok(None)
    }

    /// Runs every layer's forward through `wrapper` from now on (`None`: directly
    /// again): layer `i` returns `wrapper(i, &mut || its own forward)`. ZeRO-3 gathers
    /// layer `i`'s weights there and frees them after (FSDP2 does it with a module's
    /// forward hooks). Returns false when the layers cannot (the default), and ZeRO-3
    /// is refused. A [`LayerWrapperSlot`] cloned into each layer closure does it.
    ///
    /// Trap: the wrapper runs wherever the layer does, also when a checkpoint
    /// recomputes it in backward; a layer must call it exactly once per forward.
    fn set_layer_wrapper(&self, wrapper: Option<LayerWrapper>) -> bool {
        let _ = wrapper;
        false
    }
}

/// What a layer's forward runs through (see [`Workload::set_layer_wrapper`]): called
/// with the layer's index and its forward, it returns the layer's output. It has no
/// error channel (a layer closure has none): it panics, and
/// `CheckpointedSequential::f_forward` turns the panic into an `Err`.
pub type LayerWrapper = Arc<dyn Fn(usize, &mut dyn FnMut() -> Tensor) -> Tensor + Send + Sync>;

/// The [`LayerWrapper`] a workload's layers share: clone it into every layer closure
/// and run the layer's forward through [`run`](Self::run); the workload's
/// [`Workload::set_layer_wrapper`] calls [`set`](Self::set).
///
/// ```
/// use memsave_checkpoint::{Blocks, CheckpointedSequential};
/// use memsave_step::LayerWrapperSlot;
/// use std::sync::Arc;
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let slot = LayerWrapperSlot::default();
/// let mut layers = CheckpointedSequential::new();
/// for i in 0..2 {
///     let lin = nn::linear(vs.root() / i, 4, 4, Default::default());
///     let slot = slot.clone();
///     layers = layers.add_fn(move |x| slot.run(i, || x + lin.forward(x)));
/// }
/// let x = Tensor::rand([2, 4], (Kind::Float, Device::Cpu));
/// let plain = layers.f_forward(&x)?;
/// // Doubles every layer's output: a wrapper sees each layer's forward.
/// slot.set(Some(Arc::new(|_, forward: &mut dyn FnMut() -> Tensor| forward() * 2)));
/// let wrapped = layers.f_forward(&x)?;
/// assert_eq!(wrapped.size(), plain.size());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct LayerWrapperSlot(Arc<Mutex<Option<LayerWrapper>>>);

impl std::fmt::Debug for LayerWrapperSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LayerWrapperSlot")
            .field(&self.get().is_some())
            .finish()
    }
}

impl LayerWrapperSlot {
    /// Sets (or, with `None`, removes) the wrapper of every layer sharing this slot.
    pub fn set(&self, wrapper: Option<LayerWrapper>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = wrapper;
    }

    /// The wrapper set now, if any.
    pub fn get(&self) -> Option<LayerWrapper> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Layer `index`'s output: `forward()` through the wrapper when one is set (the
    /// slot's lock is not held while it runs).
    pub fn run(&self, index: usize, forward: impl FnOnce() -> Tensor) -> Tensor {
        let Some(wrapper) = self.get() else {
            return forward();
        };
        // A panicking forward is caught here and goes on once the wrapper returned:
        // what the wrapper entered (a ZeRO-3 unit's gathered weights), it leaves.
        let mut once = Some(forward);
        let mut panicked = None;
        let out = wrapper(index, &mut || match once.take() {
            Some(f) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(out) => out,
                Err(payload) => {
                    panicked = Some(payload);
                    Tensor::new()
                }
            },
            None => panic!("layer {index}: a layer wrapper ran the forward twice"),
        });
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
        out
    }
}

/// The mean of the squared `output`, in f32: the default [`Workload::loss`].
pub fn mean_square(output: &Tensor) -> Result<Tensor, TchError> {
    let output = if output.kind() == Kind::Float {
        output.shallow_clone()
    } else {
        output.f_to_kind(Kind::Float)?
    };
    output.f_square()?.f_mean(Kind::Float)
}

/// The variables of `vs` that are not trained (BatchNorm's running mean and variance),
/// in the order of their names: what [`Workload::buffers`] returns for a model built in
/// one `VarStore`.
///
/// Trap: a frozen weight (`requires_grad` off) is listed too, so `fit` puts it back
/// after its runs (harmless) and a step with a one-example micro-batch copies it to
/// check it (its size in the step's start bytes).
pub fn var_store_buffers(vs: &tch::nn::VarStore) -> Vec<Tensor> {
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| !t.requires_grad())
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, t)| t).collect()
}

#[cfg(test)]
mod tests {
    use super::{var_store_buffers, LayerWrapperSlot};
    use std::sync::Arc;
    use tch::{nn, Tensor};

    #[test]
    fn a_panicking_layer_leaves_the_wrapper_and_panics_on() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (entered, left) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (e, l) = (Arc::clone(&entered), Arc::clone(&left));
        let slot = LayerWrapperSlot::default();
        slot.set(Some(Arc::new(
            move |_, forward: &mut dyn FnMut() -> Tensor| {
                e.fetch_add(1, Ordering::SeqCst);
                let out = forward();
                l.fetch_add(1, Ordering::SeqCst);
                out
            },
        )));
        let caught = std::panic::catch_unwind(|| slot.run(0, || panic!("broken layer")));
        let message = caught.expect_err("the panic goes on");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"broken layer"));
        assert_eq!(entered.load(Ordering::SeqCst), 1);
        assert_eq!(left.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn var_store_buffers_are_the_untrained_variables_by_name() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _linear = nn::linear(vs.root() / "a", 4, 4, Default::default());
        let norm = nn::batch_norm1d(vs.root() / "b", 4, Default::default());
        let buffers = var_store_buffers(&vs);
        assert_eq!(buffers.len(), 2);
        assert!(buffers[0].shallow_clone().equal(&norm.running_mean));
        assert!(buffers[1].shallow_clone().equal(&norm.running_var));
        assert_eq!(
            buffers[0].data_ptr(),
            norm.running_mean.data_ptr(),
            "the variable itself, not a copy"
        );
        assert_eq!(buffers[1].data_ptr(), norm.running_var.data_ptr());
    }
}
