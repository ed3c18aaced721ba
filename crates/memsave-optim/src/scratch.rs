//! The memory an update rule works in, made once per parameter and reused chunk after
//! chunk.
//!
//! A parameter is updated a chunk of values at a time, so that the step's scratch
//! memory is that of one chunk, not of the whole parameter (an embedding's 2 MiB
//! denominator next to its 2 MiB gradient, in a step fused into backward). What the
//! rule allocates is allocated while it updates the first chunk, the largest, before
//! that chunk's first write; the later chunks get the same tensors back, narrowed to
//! their length, and allocate nothing. So running out of memory with f32 state leaves
//! the parameter and its state as they were, however many chunks it has.
use tch::{Kind, TchError, Tensor};

use crate::number::number_like;

/// Buffers and numbers handed to [`Rule::update`](crate::Rule::update), in the order
/// the rule asks for them: the first chunk of a parameter allocates them, the later
/// chunks get the same ones back.
///
/// A rule must ask for the same sequence in every chunk (it does when what it asks
/// for depends on its hyper-parameters and the step only); a request that does not
/// match the first chunk's is allocated afresh, which is correct but may run out of
/// memory after a write.
#[derive(Debug, Default)]
pub struct Scratch {
    buffers: Vec<Tensor>,
    numbers: Vec<(f64, Tensor)>,
    next_buffer: usize,
    next_number: usize,
}

impl Scratch {
    /// Starts the next chunk: requests are served from the first chunk's tensors again.
    pub(crate) fn next_chunk(&mut self) {
        self.next_buffer = 0;
        self.next_number = 0;
    }

    /// An uninitialized 1-dim buffer of `like`'s number of values, of `kind`, on its
    /// device (`like` is a chunk, so 1-dim).
    pub fn empty_like_kind(&mut self, like: &Tensor, kind: Kind) -> Result<Tensor, TchError> {
        let len = like.numel() as i64;
        let i = self.next_buffer;
        self.next_buffer += 1;
        if let Some(b) = self.buffers.get(i) {
            if b.kind() == kind && b.device() == like.device() && b.numel() as i64 >= len {
                return b.f_narrow(0, 0, len);
            }
        }
        let fresh = Tensor::f_empty([len], (kind, like.device()))?;
        keep(&mut self.buffers, i, fresh.shallow_clone());
        Ok(fresh)
    }

    /// An uninitialized buffer like `like` (its number of values, kind and device).
    pub fn empty_like(&mut self, like: &Tensor) -> Result<Tensor, TchError> {
        self.empty_like_kind(like, like.kind())
    }

    /// `value` as a 0-dim tensor of `like`'s kind on its device (see the crate's
    /// note on numbers: an op that fails with it returns the error, never panics).
    pub fn number(&mut self, value: f64, like: &Tensor) -> Result<Tensor, TchError> {
        let i = self.next_number;
        self.next_number += 1;
        if let Some((v, t)) = self.numbers.get(i) {
            if v.to_bits() == value.to_bits()
                && t.kind() == like.kind()
                && t.device() == like.device()
            {
                return Ok(t.shallow_clone());
            }
        }
        let fresh = number_like(value, like)?;
        keep(&mut self.numbers, i, (value, fresh.shallow_clone()));
        Ok(fresh)
    }
}

/// Puts `item` in slot `i` of `slots`, the request's place in the chunk's sequence
/// (at most one past the last slot, requests coming in order).
fn keep<T>(slots: &mut Vec<T>, i: usize, item: T) {
    if i < slots.len() {
        slots[i] = item;
    } else {
        slots.push(item);
    }
}
