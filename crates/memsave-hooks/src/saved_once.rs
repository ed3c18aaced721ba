//! One packed form per saved tensor: a tensor that several autograd nodes save (a
//! ReLU saves its output, the layer after it the same tensor as its input) is packed
//! once and shared, by [`Compress`](crate::Compress) and
//! [`DiskOffload`](crate::DiskOffload) alike.
use crate::error::HookError;
use memsave_sys::tensor::WeakStorage;
use std::sync::{Arc, Mutex, Weak};
use tch::{Kind, Tensor};

/// The packed forms alive so far, to find one when its tensor is saved again.
#[derive(Debug)]
pub(crate) struct SavedOnce<T> {
    known: Mutex<Vec<Known<T>>>,
}

impl<T> Default for SavedOnce<T> {
    fn default() -> Self {
        Self {
            known: Mutex::new(Vec::new()),
        }
    }
}

/// A tensor packed so far.
#[derive(Debug)]
struct Known<T> {
    storage: WeakStorage,
    data_ptr: usize,
    size: Vec<i64>,
    stride: Vec<i64>,
    contiguous: bool,
    numel: usize,
    kind: Kind,
    version: u64,
    packed: Weak<T>,
}

/// What [`SavedOnce::get_or_make`] found or made.
pub(crate) enum Lookup<T> {
    /// Packed before: its form, and the sizes to view it with when it was packed for
    /// a tensor of other sizes over the same elements (`None`: the same sizes).
    Shared(Arc<T>, Option<Vec<i64>>),
    /// Packed now.
    Made(Arc<T>),
    /// `make` declined it.
    Declined,
}

impl<T> Known<T> {
    /// `Some(view)` when `t` is this tensor: the same storage, data pointer, dtype and
    /// version, and either the same sizes and strides (`view` None) or, both
    /// contiguous, the same elements in the same order (`view` its sizes: a
    /// `flatten` of it, say).
    fn matches(&self, t: &Tensor, version: u64) -> Result<Option<Option<Vec<i64>>>, HookError> {
        if self.data_ptr != t.data_ptr() as usize
            || self.version != version
            || self.kind != t.kind()
        {
            return Ok(None);
        }
        let size = t.size();
        let view = if size == self.size && t.stride() == self.stride {
            None
        } else if self.contiguous && t.numel() == self.numel && t.is_contiguous() {
            Some(size)
        } else {
            return Ok(None);
        };
        Ok(self.storage.is_storage_of(t)?.then_some(view))
    }
}

impl<T> SavedOnce<T> {
    /// The packed form of `tensor` if one is alive, else what `make` packs (`None`:
    /// declined, nothing remembered). The lock is held while `make` runs, so two
    /// threads saving one tensor pack it once.
    pub fn get_or_make(
        &self,
        tensor: &Tensor,
        make: impl FnOnce() -> Result<Option<Arc<T>>, HookError>,
    ) -> Result<Lookup<T>, HookError> {
        let version = memsave_sys::tensor::version(tensor)?;
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.retain(|k| k.packed.strong_count() > 0);
        for k in known.iter() {
            if let Some(view) = k.matches(tensor, version)? {
                if let Some(packed) = k.packed.upgrade() {
                    return Ok(Lookup::Shared(packed, view));
                }
            }
        }
        let Some(packed) = make()? else {
            return Ok(Lookup::Declined);
        };
        if tensor.numel() > 0 {
            known.push(Known {
                storage: WeakStorage::new(tensor)?,
                data_ptr: tensor.data_ptr() as usize,
                size: tensor.size(),
                stride: tensor.stride(),
                contiguous: tensor.is_contiguous(),
                numel: tensor.numel(),
                kind: tensor.kind(),
                version,
                packed: Arc::downgrade(&packed),
            });
        }
        Ok(Lookup::Made(packed))
    }
}
