//! `checkpoint`: run a function without keeping its activations, recompute it in backward.
use crate::error::Result;
use crate::levers::Lever;
use memsave_sys::checkpoint as raw;
use memsave_sys::CallbackError;
use std::fmt::Display;
use std::sync::Arc;
use tch::Tensor;

/// Options of a checkpointed call; `Checkpoint::default()` preserves the RNG state and
/// runs the function to its end in the recomputation (no early stop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    preserve_rng: bool,
    early_stop: bool,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Self {
            preserve_rng: true,
            early_stop: false,
        }
    }
}

impl Checkpoint {
    /// Default options: RNG state preserved, early stop off (see
    /// [`early_stop`](Self::early_stop) for why, unlike PyTorch).
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether to stash the CPU (and CUDA) generator state at the forward and restore it
    /// for the recompute, so dropout draws the same masks (default `true`). Turning it
    /// off saves a state copy per call (5,056 bytes for the CPU generator, plus one per
    /// CUDA device of the inputs) but makes random functions recompute differently.
    ///
    /// Trap: the generators are process-wide. Checkpointed calls on different threads
    /// take turns, each waiting at most half a second for the others (a call may run a
    /// checkpointed branch on a worker thread and wait for it, which would otherwise
    /// deadlock); when random numbers are drawn while calls of two threads overlap, the
    /// draws may be interleaved and could not be replayed: each overlapping call
    /// during which the generators' state moved (by its draws or the other thread's)
    /// fails with an error saying so, where PyTorch would replay the wrong numbers
    /// without a word. Overlapping calls during which nothing is drawn are never
    /// refused.
    pub fn preserve_rng(mut self, preserve: bool) -> Self {
        self.preserve_rng = preserve;
        self
    }

    /// Whether the recomputation ends right after the last tensor backward needs, by
    /// unwinding `f` (default `false`; PyTorch's `early_stop` defaults to `true`).
    ///
    /// Off, `f` runs to its end in the recomputation: a stop is then always safe, and
    /// costs only the ops after the last tensor backward needs (in a block
    /// `x + mlp(norm(x))`, the residual add). `f` may end early by itself once
    /// [`recomputation_done`](crate::recomputation_done) says so, at a point it
    /// chooses (as [`CheckpointedSequential`](crate::CheckpointedSequential) does
    /// between layers).
    ///
    /// On, the stop unwinds `f` from the op that saves that tensor (tch's short-named
    /// ops panic; the `f_` ones return the error, which `f` should pass on with `?`),
    /// so what `f` does after it runs once, in the forward. Turn it on only for a
    /// function that, across its ops:
    /// - holds no `std::sync::Mutex` guard: the unwinding poisons it, and the next
    ///   step's `lock().unwrap()` panics. Lock only around the call that needs it
    ///   (`let y = layer.lock().unwrap().forward(x);` then carry on with `y`), or use a
    ///   lock that does not poison;
    /// - starts no `std::thread` that it joins later: the unwinding skips the `join`
    ///   and leaves the thread running (scoped threads, `std::thread::scope`, are
    ///   joined on unwind and are fine);
    /// - needs nothing else that runs after its ops (a file finished, a counter
    ///   updated, a channel answered).
    pub fn early_stop(mut self, early_stop: bool) -> Self {
        self.early_stop = early_stop;
        self
    }

    /// Checkpoints an infallible function; a panic inside it becomes an `Err` naming
    /// where it was checkpointed (the caller's file, line and column), also when it
    /// happens in the recomputation (then the backward fails with it).
    #[track_caller]
    pub fn run<F>(self, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static,
    {
        let name = caller_name();
        self.try_run_named(inputs, &name, None, move |xs| {
            Ok::<_, std::convert::Infallible>(f(xs))
        })
    }

    /// Checkpoints a fallible function; its error comes back from the forward, or from
    /// `f_backward` when the recompute fails, naming where it was checkpointed.
    #[track_caller]
    pub fn try_run<F, E>(self, inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> std::result::Result<Vec<Tensor>, E> + Send + 'static,
        E: Display,
    {
        let name = caller_name();
        self.try_run_named(inputs, &name, None, f)
    }

    /// [`try_run`](Self::try_run) whose errors call the function `name`; with `store`,
    /// the inputs are kept by it until the recompute instead of by the checkpoint.
    pub(crate) fn try_run_named<F, E>(
        self,
        inputs: &[&Tensor],
        name: &str,
        store: Option<Lever>,
        f: F,
    ) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> std::result::Result<Vec<Tensor>, E> + Send + 'static,
        E: Display,
    {
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
        let boxed: raw::CheckpointFn =
            Box::new(move |xs: &[Tensor]| f(xs).map_err(|e| CallbackError::from(e.to_string())));
        let run = |pack_inputs, f| {
            raw::checkpoint_named(
                &inputs,
                Some(name),
                self.preserve_rng,
                self.early_stop,
                pack_inputs,
                f,
            )
        };
        let Some(store) = store else {
            return Ok(run(false, boxed)?);
        };
        let frame = memsave_sys::hooks::push(Arc::new(store))?;
        let out = run(true, boxed);
        frame.exit()?;
        Ok(out?)
    }
}

/// "the function checkpointed at src/model.rs:42:17", for the caller of a
/// `#[track_caller]` function.
#[track_caller]
fn caller_name() -> String {
    format!(
        "the function checkpointed at {}",
        std::panic::Location::caller()
    )
}

/// Runs `f(inputs)` keeping only its inputs for backward, and recomputes it there.
///
/// Like `torch.utils.checkpoint.checkpoint`, the activations inside `f` are freed after
/// the forward and rebuilt during backward; parameter gradients accumulate exactly as
/// without checkpointing. Unlike PyTorch's reentrant variant, parameters inside `f` get
/// gradients even when no input requires grad, and several inputs and outputs, outputs
/// that do not require grad, undefined outputs (`Tensor::new()`, PyTorch's `None`),
/// nested checkpoints and a backward inside `f` (`Tensor::run_backward` on its own
/// computation, PyTorch's `autograd.grad` in a checkpointed function) all work. Unlike
/// PyTorch, the recomputation runs `f` to its end (no early stop, see
/// [`Checkpoint::early_stop`]): a `Mutex` `f` locks is never poisoned by it and a
/// thread `f` starts and joins is joined, at the cost of the ops after the last tensor
/// backward needs. An error or panic of `f` comes back as an `Err` (from the forward,
/// or from `f_backward` when it happens in the recomputation) naming the file, line
/// and column of this call; the graph is freed with the tensors that hold it, and the
/// next step runs as usual.
///
/// `f` is `Fn`: a backward inside `f` may need the recomputation while the forward is
/// still in `f`, so `f` can be called again from within its own call.
///
/// Traps, as in PyTorch:
/// - `f` runs twice: it must compute the same thing both times. Random functions do,
///   because the RNG state is restored (see [`Checkpoint::preserve_rng`]); a function
///   that reads changing state does not, and a recompute whose outputs differ in shape
///   or dtype makes backward fail with an error saying so.
/// - An input modified in place between the forward and backward would be recomputed
///   from the new values: backward fails instead, naming the input.
/// - Without grad mode (inference, `no_grad`) `f` simply runs.
///
/// ```
/// use memsave_checkpoint::checkpoint;
/// use tch::{Device, Kind, Tensor};
///
/// let w = Tensor::ones([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
/// let w2 = w.shallow_clone();
/// let y = checkpoint(&[&x], move |xs| vec![xs[0].matmul(&w2).relu()]).unwrap();
/// y[0].sum(Kind::Float).backward();
/// // x does not require grad, yet w gets its gradient (PyTorch's reentrant variant would not).
/// assert_eq!(w.grad().sum(Kind::Float).double_value(&[]), 32.0);
/// ```
#[track_caller]
pub fn checkpoint<F>(inputs: &[&Tensor], f: F) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static,
{
    Checkpoint::new().run(inputs, f)
}

/// [`checkpoint`] for a function of one tensor to one tensor.
#[track_caller]
pub fn checkpoint1<F>(input: &Tensor, f: F) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    let mut outputs = checkpoint(&[input], move |xs| vec![f(&xs[0])])?;
    Ok(outputs.remove(0))
}
