//! [`Network`]: a model of the zoo as a chain of blocks, with its task (what its input
//! is, what its loss compares).
use crate::error::ModelError;
use memsave_checkpoint::Blocks;
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
    /// Images `[batch, channels, height, width]` in, logits `[batch, classes, height,
    /// width]` out, cross-entropy against a class index per pixel (`[batch, height,
    /// width]`), averaged over every pixel.
    Segmentation {
        /// Number of classes.
        classes: i64,
    },
    /// Sequence to sequence with teacher forcing: the input packs the source tokens
    /// and the decoder's input tokens of each example in one int64 row, `[batch,
    /// source + target]` (the source first); logits `[batch, target, vocab]` out,
    /// cross-entropy against the target tokens `[batch, target]` (the decoder's input
    /// shifted by one).
    Seq2Seq {
        /// Vocabulary size (source and target alike).
        vocab: i64,
        /// Source tokens per example: the first `source` columns of the input.
        source: i64,
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
            Task::NextToken { vocab } | Task::Seq2Seq { vocab, .. } => vocab,
            Task::Segmentation { .. } => {
                // Classes along dimension 1, one target per pixel: libtorch's spatial
                // cross-entropy (as PyTorch's `F.cross_entropy(logits, target)`).
                return logits.f_cross_entropy_loss::<Tensor>(
                    target,
                    None,
                    tch::Reduction::Mean,
                    -100,
                    0.0,
                );
            }
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
///
/// A network that is not a chain (the U-Net, the encoder–decoder) has one layer that
/// runs its whole forward through named [`Blocks`], kept in `blocks`: their levers,
/// not a plan of the chain, decide what is checkpointed.
pub struct Network {
    /// The blocks, run in order.
    pub layers: Vec<Layer>,
    /// What the input is and what the loss compares.
    pub task: Task,
    /// One example's shape: `[channels, height, width]` for images, `[seq]` for
    /// tokens, `[source + target]` for sequence to sequence.
    pub example_shape: Vec<i64>,
    /// The named blocks the one layer runs, for a network that is not a chain;
    /// `None` for a chain.
    pub blocks: Option<Blocks>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("layers", &self.layers.len())
            .field("task", &self.task)
            .field("example_shape", &self.example_shape)
            .field("blocks", &self.blocks.is_some())
            .finish()
    }
}

impl Network {
    /// `size` synthetic examples from libtorch's current random stream (seed it first
    /// for the same batch every time): images drawn from N(0, 1) with uniform class
    /// labels (one per image, or one per pixel for segmentation), or uniform token ids
    /// whose targets are the next tokens (one sequence of `seq + 1` tokens per
    /// example, input and target its two overlapping windows). For sequence to
    /// sequence, uniform source tokens, then a target sequence of `target + 1` tokens
    /// whose first `target` are the decoder's input (packed after the source) and last
    /// `target` the target.
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
            Task::Segmentation { classes } => {
                shape.extend_from_slice(&self.example_shape);
                let input = Tensor::f_randn(&shape, (Kind::Float, device))?;
                let pixels = [size, shape[2], shape[3]];
                let target = Tensor::f_randint(classes, pixels, (Kind::Int64, device))?;
                Ok(Batch {
                    input,
                    target: Some(target),
                })
            }
            Task::Seq2Seq { vocab, source } => {
                let total = self.example_shape.first().copied().unwrap_or(0);
                let target = total - source;
                let src = Tensor::f_randint(vocab, [size, source], (Kind::Int64, device))?;
                let tgt = Tensor::f_randint(vocab, [size, target + 1], (Kind::Int64, device))?;
                let input = Tensor::f_cat(&[src, tgt.f_narrow(1, 0, target)?], 1)?;
                Ok(Batch {
                    input,
                    target: Some(tgt.f_narrow(1, 1, target)?.f_contiguous()?),
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

/// Runs one forward of a network of blocks (`f` calls `blocks.run` for each block)
/// inside [`Blocks::forward`], as the body of its one layer: a layer has no error
/// channel, so an error panics with its message, which
/// `CheckpointedSequential::f_forward` (and the step engine) turn back into an `Err`.
pub(crate) fn forward_blocks(
    blocks: &Blocks,
    f: impl FnOnce(&Blocks) -> memsave_checkpoint::Result<Tensor>,
) -> Tensor {
    match blocks.forward(f) {
        Ok(Ok(out)) => out,
        Ok(Err(e)) | Err(e) => panic!("{e}"),
    }
}

/// The one output of a block.
pub(crate) fn only(outputs: Vec<Tensor>) -> Tensor {
    outputs
        .into_iter()
        .next()
        .expect("a block of the zoo returns one output")
}
