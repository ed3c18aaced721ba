//! Gradient buckets, shared by data parallel and ZeRO-2: which parameters each bucket
//! holds, and how far one backward has got through them. What a reduction does with a
//! bucket (all-reduce and copy back, or all-to-all into a shard) is the caller's.
use tch::Tensor;

use crate::error::Result;

/// Parameters grouped into buckets, and the progress of the current backward.
///
/// Buckets are filled in reverse parameter order (the order backward usually produces
/// gradients), each with consecutive parameters up to the byte cap; a parameter larger
/// than the cap gets a bucket of its own. Buckets are reduced strictly in order, so
/// every rank issues the same collectives: a complete bucket waits for the buckets
/// before it.
#[derive(Debug)]
pub(crate) struct Buckets {
    /// Parameter indices of each bucket, last parameter first; never empty.
    members: Vec<Vec<usize>>,
    /// The bucket of each parameter.
    bucket_of: Vec<usize>,
    /// Gradients marked ready in each bucket during this backward.
    ready: Vec<usize>,
    /// The first bucket this backward has not reduced; always less than the number of
    /// buckets, or 0 when there are none.
    next: usize,
}

impl Buckets {
    /// Groups `params` into buckets of at most `cap_bytes` of gradient (a gradient has
    /// its parameter's kind and shape, so its bytes are the parameter's).
    pub(crate) fn new(params: &[Tensor], cap_bytes: u64) -> Self {
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut filled = 0u64;
        for index in (0..params.len()).rev() {
            let bytes = memsave_sys::tensor::nbytes(&params[index]);
            if members.is_empty() || filled + bytes > cap_bytes {
                members.push(Vec::new());
                filled = 0;
            }
            members
                .last_mut()
                .expect("a bucket was just pushed")
                .push(index);
            filled += bytes;
        }
        let mut bucket_of = vec![0; params.len()];
        for (b, m) in members.iter().enumerate() {
            for &i in m {
                bucket_of[i] = b;
            }
        }
        Self {
            ready: vec![0; members.len()],
            members,
            bucket_of,
            next: 0,
        }
    }

    /// Number of buckets.
    pub(crate) fn len(&self) -> usize {
        self.members.len()
    }

    /// The parameter indices of `bucket`, last parameter first.
    pub(crate) fn members(&self, bucket: usize) -> &[usize] {
        &self.members[bucket]
    }

    /// Counts parameter `index`'s gradient as ready.
    pub(crate) fn mark_ready(&mut self, index: usize) {
        self.ready[self.bucket_of[index]] += 1;
    }

    /// The bucket to reduce now: the first one not reduced in this backward, when all
    /// its gradients are ready.
    pub(crate) fn next_complete(&self) -> Option<usize> {
        (self.next < self.members.len() && self.ready[self.next] == self.members[self.next].len())
            .then_some(self.next)
    }

    /// The first bucket not reduced in this backward, complete or not, once the
    /// backward has marked any gradient ready; `None` when none has.
    pub(crate) fn next_owed(&self) -> Option<usize> {
        self.ready.iter().any(|&r| r > 0).then_some(self.next)
    }

    /// Records that the bucket [`next_complete`](Self::next_complete) or
    /// [`next_owed`](Self::next_owed) named is reduced; after the last bucket, starts
    /// over for the next backward.
    pub(crate) fn advance(&mut self) {
        self.next += 1;
        if self.next == self.members.len() {
            self.next = 0;
            self.ready.iter_mut().for_each(|r| *r = 0);
        }
    }
}

/// A reduction of gradients bucket by bucket as backward produces them: data parallel's
/// all-reduce, ZeRO-2's all-to-all into the shards. It supplies its buckets and how one
/// bucket is reduced; the order in which buckets are reduced is this trait's.
pub(crate) trait BucketReduce {
    /// The buckets and the current backward's progress through them.
    fn buckets(&mut self) -> &mut Buckets;

    /// Whether backward reduces now (false inside `no_sync`).
    fn syncing(&self) -> bool;

    /// Reduces bucket `bucket`.
    fn reduce(&mut self, bucket: usize) -> Result<()>;

    /// Counts parameter `index`'s gradient ready, then reduces, in order, every bucket
    /// now complete whose predecessors are all reduced: the post-accumulate-grad hook's
    /// work. Nothing inside `no_sync`.
    fn mark_ready(&mut self, index: usize) -> Result<()> {
        if !self.syncing() {
            return Ok(());
        }
        self.buckets().mark_ready(index);
        while let Some(bucket) = self.buckets().next_complete() {
            self.reduce(bucket)?;
            self.buckets().advance();
        }
        Ok(())
    }

    /// Reduces, in order, every bucket the current backward has not reduced, complete
    /// or not; nothing when no gradient was marked ready since the last backward ended.
    fn reduce_owed(&mut self) -> Result<()> {
        while let Some(bucket) = self.buckets().next_owed() {
            self.reduce(bucket)?;
            self.buckets().advance();
        }
        Ok(())
    }
}

/// Copies consecutive slices of `flat` into `tensors`, each viewed in its shape: the
/// first `numel` values into the first tensor, the next into the second, and so on.
pub(crate) fn copy_from_flat(flat: &Tensor, tensors: &[Tensor]) -> Result<(), tch::TchError> {
    let offsets = tensors.iter().scan(0, |next, t| {
        let at = *next;
        *next += t.numel() as i64;
        Some(at)
    });
    copy_from_flat_at(flat, tensors, offsets)
}

/// Copies the values of `flat` from each offset into the tensor at the same place in
/// `tensors`, viewed in its shape; whatever lies between them (padding) is left behind.
pub(crate) fn copy_from_flat_at(
    flat: &Tensor,
    tensors: &[Tensor],
    offsets: impl IntoIterator<Item = i64>,
) -> Result<(), tch::TchError> {
    for (t, offset) in tensors.iter().zip(offsets) {
        let src = flat.f_narrow(0, offset, t.numel() as i64)?.f_view_as(t)?;
        t.shallow_clone().f_copy_(&src)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn params(numels: &[i64]) -> Vec<Tensor> {
        numels
            .iter()
            .map(|&n| Tensor::zeros([n], (Kind::Float, Device::Cpu)))
            .collect()
    }

    #[test]
    fn buckets_fill_in_reverse_order_up_to_the_cap() {
        // f32: 40, 8, 24, 16, 4 bytes; cap 32.
        let b = Buckets::new(&params(&[10, 2, 6, 4, 1]), 32);
        let members: Vec<&[usize]> = (0..b.len()).map(|i| b.members(i)).collect();
        assert_eq!(members, [&[4, 3][..], &[2, 1], &[0]]);
        assert_eq!(b.bucket_of, [2, 1, 1, 0, 0]);
        // The cap counts bytes, not values: bf16 halves them.
        let bf16: Vec<Tensor> = params(&[10, 2, 6, 4, 1])
            .iter()
            .map(|p| p.to_kind(Kind::BFloat16))
            .collect();
        let b = Buckets::new(&bf16, 32);
        assert_eq!(b.len(), 2);
        assert_eq!(b.members(0), [4, 3, 2, 1]);
        assert_eq!(b.members(1), [0]);
        assert_eq!(Buckets::new(&[], 32).len(), 0);
        assert_eq!(Buckets::new(&params(&[3, 3]), 1 << 20).members(0), [1, 0]);
    }

    #[test]
    fn a_bucket_is_due_when_complete_and_after_every_bucket_before_it() {
        let mut b = Buckets::new(&params(&[10, 2, 6, 4, 1]), 32);
        assert_eq!((b.next_complete(), b.next_owed()), (None, None));
        // Bucket 1 completes first, but waits for bucket 0.
        b.mark_ready(2);
        b.mark_ready(1);
        assert_eq!(b.next_complete(), None);
        assert_eq!(b.next_owed(), Some(0));
        b.mark_ready(4);
        b.mark_ready(3);
        assert_eq!(b.next_complete(), Some(0));
        b.advance();
        assert_eq!(b.next_complete(), Some(1));
        b.advance();
        assert_eq!(b.next_complete(), None);
        assert_eq!(b.next_owed(), Some(2));
        b.mark_ready(0);
        assert_eq!(b.next_complete(), Some(2));
        b.advance();
        // The last bucket reduced: the next backward starts from scratch.
        assert_eq!((b.next_complete(), b.next_owed()), (None, None));
        assert_eq!(b.ready, [0, 0, 0]);
    }

    #[test]
    fn an_incomplete_backward_owes_every_bucket_not_reduced() {
        let mut b = Buckets::new(&params(&[10, 2, 6, 4, 1]), 32);
        b.mark_ready(4);
        let mut owed = Vec::new();
        while let Some(bucket) = b.next_owed() {
            owed.push(bucket);
            b.advance();
        }
        assert_eq!(owed, [0, 1, 2]);
        assert_eq!(b.next_owed(), None);
    }

    /// Records the buckets it is asked to reduce.
    struct Recorder {
        buckets: Buckets,
        syncing: bool,
        reduced: Vec<usize>,
    }

    impl BucketReduce for Recorder {
        fn buckets(&mut self) -> &mut Buckets {
            &mut self.buckets
        }
        fn syncing(&self) -> bool {
            self.syncing
        }
        fn reduce(&mut self, bucket: usize) -> Result<()> {
            self.reduced.push(bucket);
            Ok(())
        }
    }

    #[test]
    fn backward_reduces_buckets_in_order_as_they_complete() {
        let mut r = Recorder {
            buckets: Buckets::new(&params(&[10, 2, 6, 4, 1]), 32),
            syncing: true,
            reduced: Vec::new(),
        };
        for index in [1, 2, 4] {
            r.mark_ready(index).unwrap();
        }
        assert_eq!(r.reduced, [] as [usize; 0]);
        r.mark_ready(3).unwrap();
        assert_eq!(r.reduced, [0, 1]);
        r.mark_ready(0).unwrap();
        assert_eq!(r.reduced, [0, 1, 2]);
        // Complete: nothing is owed, and the next backward starts over.
        r.reduce_owed().unwrap();
        assert_eq!(r.reduced, [0, 1, 2]);
        r.mark_ready(0).unwrap();
        r.reduce_owed().unwrap();
        assert_eq!(r.reduced, [0, 1, 2, 0, 1, 2]);
        // Inside no_sync nothing is counted.
        r.syncing = false;
        for index in 0..5 {
            r.mark_ready(index).unwrap();
        }
        r.reduce_owed().unwrap();
        assert_eq!(r.reduced.len(), 6);
    }

    #[test]
    fn copy_from_flat_fills_each_tensor_in_its_shape() {
        let flat = Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6., 7.]);
        let targets = [
            Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)),
            Tensor::zeros([3], (Kind::Float, Device::Cpu)),
        ];
        copy_from_flat(&flat, &targets).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(targets[0].flatten(0, -1)).unwrap(),
            [1., 2., 3., 4.]
        );
        assert_eq!(Vec::<f32>::try_from(&targets[1]).unwrap(), [5., 6., 7.]);
        let short = Tensor::from_slice(&[1f32, 2.]);
        assert!(copy_from_flat(&short, &targets).is_err());
    }
}
