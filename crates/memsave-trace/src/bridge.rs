//! What a recording session learns from the code it records: the optimizer's
//! gradients and state as the optimizer works with them, and each named block's runs
//! (with its recomputations) of a model of `memsave_checkpoint::Blocks`. Harnesses
//! that trace a training step install these for the step's length.
use crate::recorder::Session;
use memsave_checkpoint::{BlockNotice, BlockObserver};
use memsave_optim::Observer;
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// An optimizer observer that tells `.0` the gradients and the state as the optimizer
/// works with them (state created in the first update or fetched from disk for one
/// update, gradients freed by a step in backward, a ZeRO shard's gradient):
/// `optimizer.set_observer(Some(Arc::new(OptimizerRoles(session.clone()))))`.
pub struct OptimizerRoles(pub Session);

impl Observer for OptimizerRoles {
    fn gradient(&self, _index: usize, grad: &Tensor) {
        self.0.gradients(std::slice::from_ref(grad));
    }

    fn state(&self, _index: usize, tensors: &[Tensor]) {
        self.0.optimizer_state(tensors);
    }
}

/// A block observer that marks `session` with each named block's run (`block
/// enc1#0`) and files what a recomputation allocates under its block: the per-block
/// view of a model of blocks. A block run inside a recomputation (nested in a
/// recomputed block) is part of that one.
pub fn block_runs(session: &Session) -> BlockObserver {
    let session = session.clone();
    // Per block started and not yet ended, innermost last: whether it opened a
    // recomputation.
    let running: Mutex<Vec<bool>> = Mutex::new(Vec::new());
    Arc::new(move |notice| {
        let mut running = running.lock().unwrap_or_else(|p| p.into_inner());
        match notice {
            BlockNotice::Start { key, recompute } => {
                let label = format!("block {key}");
                session.mark(label.clone());
                let opens = *recompute && !running.iter().any(|&r| r);
                if opens {
                    session.recomputation_start(label);
                }
                running.push(opens);
            }
            BlockNotice::End { .. } => {
                if running.pop() == Some(true) {
                    session.recomputation_end();
                }
            }
        }
    })
}
