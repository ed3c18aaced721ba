//! Splitting a batch into micro-batches, each with the weight of its micro-loss.
use crate::error::{AccumError, Result};
use tch::Tensor;

/// How to split a batch into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Exactly this many micro-batches, balanced: sizes differ by at most one sample
    /// and the larger ones come first (10 samples in 4: 3, 3, 2, 2).
    Count(usize),
    /// Micro-batches of this many samples; the last one holds the rest and may be
    /// smaller (10 samples by 4: 4, 4, 2).
    MaxSize(i64),
}

/// One micro-batch: a contiguous range of samples and the weight of its loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatch {
    /// Position in the batch, from 0.
    pub index: usize,
    /// First sample.
    pub start: i64,
    /// Number of samples.
    pub len: i64,
    /// `len / batch_size`: the factor that makes the weighted sum of mean-reduced
    /// micro-losses the mean over the whole batch, even for an uneven split.
    pub weight: f64,
}

impl MicroBatch {
    /// One past the last sample.
    pub fn end(&self) -> i64 {
        self.start + self.len
    }

    /// The micro-batch's rows of `t` along dimension 0 (a view, no copy).
    pub fn f_narrow(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.f_narrow(0, self.start, self.len)?)
    }

    /// The micro-batch's rows of `t` along dimension 0.
    ///
    /// # Panics
    /// When `t` has fewer rows than the batch; see [`f_narrow`](Self::f_narrow).
    pub fn narrow(&self, t: &Tensor) -> Tensor {
        self.f_narrow(t).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The most micro-batches one batch may be split into: 1,048,576 (2^20).
///
/// Each micro-batch is a forward and a backward of its own, so a split past this is
/// a mistake (a `MaxSize(1)` on a huge batch size), and its list alone would take
/// tens of megabytes; [`f_split`] refuses it before allocating anything.
pub const MAX_MICRO_BATCHES: u64 = 1 << 20;

/// Splits a batch of `batch_size` samples into micro-batches, in order.
///
/// Errors on an empty batch, `Count(0)`, `MaxSize(0)`, more micro-batches than
/// samples and more than [`MAX_MICRO_BATCHES`] micro-batches; never returns an empty
/// micro-batch. The count is checked before anything is allocated, so no batch size
/// or split, however large, can exhaust memory.
pub fn f_split(batch_size: i64, split: Split) -> Result<Vec<MicroBatch>> {
    if batch_size < 0 {
        return Err(AccumError::NegativeBatch(batch_size));
    }
    if batch_size == 0 {
        return Err(AccumError::EmptyBatch);
    }
    let count: u64 = match split {
        Split::Count(0) => return Err(AccumError::ZeroMicroBatches),
        Split::Count(n) if n as u64 > batch_size as u64 => {
            return Err(AccumError::MoreMicroBatchesThanSamples {
                batch_size,
                micro_batches: n,
            })
        }
        Split::Count(n) => n as u64,
        Split::MaxSize(m) if m <= 0 => return Err(AccumError::ZeroMicroBatchSize(m)),
        Split::MaxSize(m) => (batch_size / m + i64::from(batch_size % m != 0)) as u64,
    };
    if count > MAX_MICRO_BATCHES {
        return Err(AccumError::TooManyMicroBatches {
            batch_size,
            micro_batches: count,
            limit: MAX_MICRO_BATCHES,
        });
    }
    let sizes: Vec<i64> = match split {
        Split::Count(_) => {
            let n = count as i64;
            let (base, larger) = (batch_size / n, batch_size % n);
            (0..n).map(|i| base + i64::from(i < larger)).collect()
        }
        Split::MaxSize(m) => (0..batch_size)
            .step_by(m as usize)
            .map(|start| m.min(batch_size - start))
            .collect(),
    };
    let mut start = 0;
    Ok(sizes
        .into_iter()
        .enumerate()
        .map(|(index, len)| {
            let mb = MicroBatch {
                index,
                start,
                len,
                weight: len as f64 / batch_size as f64,
            };
            start += len;
            mb
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(b: i64, split: Split) -> Vec<i64> {
        f_split(b, split).unwrap().iter().map(|m| m.len).collect()
    }

    #[test]
    fn splits_as_documented() {
        assert_eq!(lens(10, Split::Count(4)), [3, 3, 2, 2]);
        assert_eq!(lens(10, Split::MaxSize(4)), [4, 4, 2]);
        assert_eq!(lens(10, Split::MaxSize(20)), [10]);
        assert_eq!(lens(3, Split::Count(3)), [1, 1, 1]);
        let mbs = f_split(10, Split::MaxSize(4)).unwrap();
        assert_eq!(
            mbs.iter().map(|m| (m.start, m.end())).collect::<Vec<_>>(),
            [(0, 4), (4, 8), (8, 10)]
        );
        assert_eq!(mbs[2].weight, 0.2);
    }

    #[test]
    fn bad_input_is_an_error_that_says_what_to_do() {
        for (b, split, needle) in [
            (0, Split::Count(1), "batch is empty"),
            (-3, Split::Count(1), "must be positive"),
            (5, Split::Count(0), "at least 1"),
            (5, Split::MaxSize(0), "at least 1 sample"),
            (3, Split::Count(4), "at most one micro-batch per sample"),
            (1 << 40, Split::MaxSize(1), "at most 1048576"),
            (1 << 40, Split::Count(1 << 38), "at most 1048576"),
            (i64::MAX, Split::MaxSize(1), "at most 1048576"),
            (
                i64::MAX,
                Split::Count(usize::MAX),
                "at most one micro-batch per sample",
            ),
        ] {
            let e = f_split(b, split).unwrap_err().to_string();
            assert!(e.contains(needle), "{b} {split:?}: {e}");
        }
    }

    #[test]
    fn too_many_micro_batches_is_a_typed_error_and_the_limit_itself_splits() {
        let err = f_split(1 << 40, Split::MaxSize(1)).unwrap_err();
        assert!(
            matches!(
                err,
                AccumError::TooManyMicroBatches {
                    batch_size: 1_099_511_627_776,
                    micro_batches: 1_099_511_627_776,
                    limit: 1_048_576,
                }
            ),
            "{err:?}"
        );
        let err = f_split(1 << 40, Split::Count(1 << 38)).unwrap_err();
        assert!(
            matches!(
                err,
                AccumError::TooManyMicroBatches {
                    micro_batches: 274_877_906_944,
                    ..
                }
            ),
            "{err:?}"
        );
        // One past the limit by size, exactly the limit by count and by size.
        assert!(f_split((1 << 20) + 1, Split::MaxSize(1)).is_err());
        assert_eq!(
            f_split(1 << 40, Split::Count(1 << 20)).unwrap().len(),
            1 << 20
        );
        let by_size = f_split(1 << 40, Split::MaxSize(1 << 20)).unwrap();
        assert_eq!(by_size.len(), 1 << 20);
        assert_eq!(by_size.last().unwrap().end(), 1 << 40);
    }
}
