//! The errors of splitting, accumulating and fitting micro-batches.
use memsave_meter::Bytes;

/// A boxed error from a user closure (a forward pass, a loss).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong in `memsave-accum`; each message says what to change.
#[derive(Debug, thiserror::Error)]
pub enum AccumError {
    /// The batch has no samples.
    #[error("the batch is empty (0 samples): there is nothing to accumulate")]
    EmptyBatch,
    /// A negative batch size.
    #[error("the batch size must be positive, got {0}")]
    NegativeBatch(i64),
    /// `Split::Count(0)`.
    #[error("cannot split a batch into 0 micro-batches: ask for at least 1")]
    ZeroMicroBatches,
    /// `Split::MaxSize(0)` or a search bound of 0.
    #[error("a micro-batch must hold at least 1 sample, got a maximum of {0}")]
    ZeroMicroBatchSize(i64),
    /// More micro-batches than samples were asked for.
    #[error("cannot split a batch of {batch_size} samples into {micro_batches} micro-batches: at most one micro-batch per sample")]
    MoreMicroBatchesThanSamples {
        /// Samples in the batch.
        batch_size: i64,
        /// Micro-batches asked for.
        micro_batches: usize,
    },
    /// More micro-batches than [`MAX_MICRO_BATCHES`](crate::MAX_MICRO_BATCHES).
    #[error("cannot split a batch of {batch_size} samples into {micro_batches} micro-batches: at most {limit} are supported; use larger micro-batches")]
    TooManyMicroBatches {
        /// Samples in the batch.
        batch_size: i64,
        /// Micro-batches the split asked for.
        micro_batches: u64,
        /// The most supported.
        limit: u64,
    },
    /// The optimizer (or parameter list) has no parameters.
    #[error("no trainable parameters: build the optimizer from a VarStore that holds the model")]
    NoParameters,
    /// A micro-batch loss is not a single value.
    #[error("micro-batch {index}: the loss must be a scalar (a mean over the micro-batch), got shape {shape:?}")]
    LossNotScalar {
        /// Index of the micro-batch.
        index: usize,
        /// Shape of the loss returned.
        shape: Vec<i64>,
    },
    /// The user's closure, or backward through its graph, failed for a micro-batch.
    #[error("micro-batch {index} (samples {start}..{end}): {source}")]
    MicroBatch {
        /// Index of the micro-batch.
        index: usize,
        /// First sample of the micro-batch.
        start: i64,
        /// One past the last sample.
        end: i64,
        /// What failed.
        source: BoxError,
    },
    /// A trial of the search failed with something other than out-of-memory.
    #[error("trial with a micro-batch of {micro_batch} samples failed: {source}")]
    Trial {
        /// Micro-batch size tried.
        micro_batch: i64,
        /// What failed.
        source: BoxError,
    },
    /// Even one sample does not fit in the budget.
    #[error("even a micro-batch of 1 sample does not fit in a budget of {} above the current allocation: {reason}; raise the budget (or a memory limit already set), shrink the model or checkpoint it", Bytes(*.budget_bytes))]
    BudgetTooSmall {
        /// The budget asked for.
        budget_bytes: u64,
        /// The out-of-memory error of the 1-sample trial.
        reason: String,
    },
    /// The parameters given to the search live on more than one device.
    #[error("the parameters live on {first:?} and {other:?}: the search measures one device, so move the model to one device first")]
    MixedDevices {
        /// The device of the first parameter.
        first: tch::Device,
        /// Another device found.
        other: tch::Device,
    },
    /// The gradient scaler refused a call.
    #[error(transparent)]
    Amp(#[from] memsave_amp::AmpError),
    /// The meter refused a device (it meters the CPU and CUDA only).
    #[error(transparent)]
    Meter(#[from] memsave_meter::MeterError),
    /// libtorch reported an error through tch.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// libtorch reported an error through the memsave bridge.
    #[error(transparent)]
    Bridge(#[from] memsave_sys::Error),
}

/// The result of a fallible `memsave-accum` call.
pub type Result<T, E = AccumError> = std::result::Result<T, E>;
