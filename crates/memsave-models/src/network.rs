//! [`Network`]: a model of the zoo as a chain of blocks, with its task (what its input
//! is, what its loss compares).
use crate::error::ModelError;
use memsave_step::Batch;
use tch::nn::ModuleT;
use tch::{Device, Kind, TchError, Tensor};

/// One block of a network: a tch `ModuleT`, run with the train flag (BatchNorm's batch
/// statistics and dropout in training).
pub type Layer = Box<dyn ModuleT>;

/// What a network's input is and what its loss compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Images `[batch, channels, height, width]` in, logits `[batch, classes]` out,
    /// cross-entropy against a class index per image.
    Classification {
        /// Number of classes.
        classes: i64,
    },
    /// Token ids `[batch, seq]` in, logits `[batch, seq, vocab]` out, cross-entropy
    /// against the next token at every position.
    NextToken {
        /// Vocabulary size.
        vocab: i64,
    },
}

impl Task {
    /// The mean cross-entropy of `logits` against `target`, in f32 (logits of a lower
    /// precision are converted first).
    ///
    /// # Errors
    /// When `target` is `None` or its shape does not match the logits'.
    pub fn loss(&self, logits: &Tensor, target: Option<&Tensor>) -> Result<Tensor, TchError> {
        let target = target.ok_or_else(|| {
            TchError::Kind("the zoo's losses need a target (the batch has none)".to_owned())
        })?;
        let logits = if logits.kind() == Kind::Float {
            logits.shallow_clone()
        } else {
            logits.f_to_kind(Kind::Float)?
        };
        let classes = match *self {
            Task::Classification { classes } => classes,
            Task::NextToken { vocab } => vocab,
        };
        logits
            .f_reshape([-1, classes])?
            .f_cross_entropy_loss::<Tensor>(
                &target.f_reshape([-1])?,
                None,
                tch::Reduction::Mean,
                -100,
                0.0,
            )
    }
}

/// A built network: its blocks in order (the last one outputs the logits), its task,
/// and the shape of one example (without the batch dimension).
pub struct Network {
    /// The blocks, run in order.
    pub layers: Vec<Layer>,
    /// What the input is and what the loss compares.
    pub task: Task,
    /// One example's shape: `[channels, height, width]` for images, `[seq]` for tokens.
    pub example_shape: Vec<i64>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("layers", &self.layers.len())
            .field("task", &self.task)
            .field("example_shape", &self.example_shape)
            .finish()
    }
}

impl Network {
    /// `size` synthetic examples from libtorch's current random stream (seed it first
    /// for the same batch every time): images drawn from N(0, 1) with uniform class
    /// labels, or uniform token ids whose targets are the next tokens (one sequence of
    /// `seq + 1` tokens per example, input and target its two overlapping windows).
    pub fn synthetic_batch(&self, size: i64, device: Device) -> Result<Batch, ModelError> {
        let mut shape = vec![size];
        match self.task {
            Task::Classification { classes } => {
                shape.extend_from_slice(&self.example_shape);
                let input = Tensor::f_randn(&shape, (Kind::Float, device))?;
                let target = Tensor::f_randint(classes, [size], (Kind::Int64, device))?;
                Ok(Batch {
                    input,
                    target: Some(target),
                })
            }
            Task::NextToken { vocab } => {
                let seq = self.example_shape.first().copied().unwrap_or(0);
                let tokens = Tensor::f_randint(vocab, [size, seq + 1], (Kind::Int64, device))?;
                Ok(Batch {
                    input: tokens.f_narrow(1, 0, seq)?.f_contiguous()?,
                    target: Some(tokens.f_narrow(1, 1, seq)?.f_contiguous()?),
                })
            }
        }
    }

    /// The mean cross-entropy of `logits` against `target`, in f32 ([`Task::loss`]).
    pub fn loss(&self, logits: &Tensor, target: Option<&Tensor>) -> Result<Tensor, TchError> {
        self.task.loss(logits, target)
    }
}
