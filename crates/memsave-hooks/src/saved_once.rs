//! One packed form per saved tensor: a tensor that several autograd nodes save (a
//! ReLU saves its output, the layer after it the same tensor as its input) is packed
//! once and shared, by [`Compress`](crate::Compress) and
//! [`DiskOffload`](crate::DiskOffload) alike, whatever layout each node saves it in
//! (as itself, flattened, transposed, permuted: any view of memory the first save's
//! stored form covers).
use crate::error::HookError;
use memsave_sys::tensor::WeakStorage;
use std::sync::{Arc, Mutex, Weak};
use tch::{Kind, TchError, Tensor};

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

/// The memory a stored tensor fills when it fills a whole span of its storage: its
/// elements, each once, are `len` consecutive elements, the first of them its element
/// `[0, 0, ...]` (strides are never negative). PyTorch calls such a tensor
/// non-overlapping and dense: contiguous, transposed, permuted, channels-last.
///
/// The region in memory order, as a 1-D tensor of `len` elements, rebuilds any view
/// of that memory: the tensor itself ([`f_view_of`](Self::f_view_of)) and every other
/// save of it ([`View::f_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Region {
    size: Vec<i64>,
    stride: Vec<i64>,
    len: i64,
    contiguous: bool,
}

impl Region {
    /// The span `t` fills; `None` when it has gaps (a narrowed slice, a step over
    /// elements), repeats an element (stride 0 with a size above 1) or is empty.
    pub fn of(t: &Tensor) -> Option<Region> {
        let size = t.size();
        let stride = t.stride();
        if size.contains(&0) {
            return None;
        }
        let mut dims: Vec<(i64, i64)> = size
            .iter()
            .zip(&stride)
            .filter(|(&n, _)| n != 1)
            .map(|(&n, &s)| (s, n))
            .collect();
        dims.sort_unstable();
        let mut len = 1i64;
        for (s, n) in dims {
            if s != len {
                return None;
            }
            len *= n;
        }
        Some(Region {
            contiguous: t.is_contiguous(),
            size,
            stride,
            len,
        })
    }

    /// Elements in the region.
    pub fn len(&self) -> i64 {
        self.len
    }

    /// The region in memory order (1-D, `len` elements) of the tensor it was found
    /// for, or of a tensor of the same sizes and strides: a view, no copy.
    pub fn f_memory(&self, t: &Tensor) -> Result<Tensor, TchError> {
        t.f_as_strided([self.len], [1], None)
    }

    /// The region in memory order from `values`, the tensor's values in its own
    /// order (its sizes, any strides: a codec's decode): a view when the tensor is
    /// contiguous and `values` too, else a copy placed as the tensor's strides say.
    pub fn f_from_values(&self, values: &Tensor) -> Result<Tensor, TchError> {
        if self.contiguous && values.is_contiguous() {
            return values.f_reshape([self.len]);
        }
        let region = Tensor::f_empty([self.len], (values.f_kind()?, values.device()))?;
        self.f_view_of(&region)?.f_copy_(values)?;
        Ok(region)
    }

    /// The tensor (its sizes and strides) over `region`, a region in memory order.
    pub fn f_view_of(&self, region: &Tensor) -> Result<Tensor, TchError> {
        region.f_as_strided(&self.size, &self.stride, None)
    }
}

/// A save that shares another save's stored [`Region`] in another layout: that
/// region, and this save's sizes, strides and the offset of its element `[0, 0, ...]`
/// in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct View {
    region: Region,
    size: Vec<i64>,
    stride: Vec<i64>,
    offset: i64,
}

impl View {
    /// The region stored (by the first save).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// This save's tensor over `region` (in memory order, 1-D): a view, no copy.
    pub fn f_of(&self, region: &Tensor) -> Result<Tensor, TchError> {
        let len = region.size()[0];
        region
            .f_narrow(0, self.offset, len - self.offset)?
            .f_as_strided(&self.size, &self.stride, None)
    }
}

/// A tensor packed so far.
#[derive(Debug)]
struct Known<T> {
    storage: WeakStorage,
    data_ptr: usize,
    size: Vec<i64>,
    stride: Vec<i64>,
    kind: Kind,
    version: u64,
    /// The span its stored form covers, when it covers one.
    region: Option<Region>,
    packed: Weak<T>,
}

/// What [`SavedOnce::get_or_make`] found or made.
pub(crate) enum Lookup<T> {
    /// Packed before: its form, and how to view its region for a tensor of other
    /// sizes or strides over the same memory (`None`: the same sizes and strides).
    Shared(Arc<T>, Option<View>),
    /// Packed now.
    Made(Arc<T>),
    /// `make` declined it.
    Declined,
}

/// How a save matches a known one.
enum Match {
    /// The same tensor: same place, sizes and strides.
    Same,
    /// Another view inside its region.
    Inside(View),
}

impl<T> Known<T> {
    /// How `t` (saved at `version`) matches this tensor, if it does: the same storage,
    /// dtype and version, and either the same place, sizes and strides, or every
    /// element of `t` inside the region this tensor's stored form covers.
    fn matches(&self, t: &Tensor, version: u64) -> Result<Option<Match>, HookError> {
        if self.version != version || self.kind != t.kind() {
            return Ok(None);
        }
        let (size, stride) = (t.size(), t.stride());
        let ptr = t.data_ptr() as usize;
        let found = if ptr == self.data_ptr && size == self.size && stride == self.stride {
            Match::Same
        } else if let Some(view) = self.inside(ptr, size, stride) {
            Match::Inside(view)
        } else {
            return Ok(None);
        };
        Ok(self.storage.is_storage_of(t)?.then_some(found))
    }

    /// The view of the tensor at `ptr` with `size` and `stride` over this tensor's
    /// region, when every element of it lies inside that region.
    fn inside(&self, ptr: usize, size: Vec<i64>, stride: Vec<i64>) -> Option<View> {
        let region = self.region.as_ref()?;
        let elt = self.kind.elt_size_in_bytes();
        let bytes = ptr.checked_sub(self.data_ptr)?;
        if bytes % elt != 0 || size.contains(&0) {
            return None;
        }
        let offset = i64::try_from(bytes / elt).ok()?;
        // The last element's offset from the first (strides are never negative).
        let last: i64 = size.iter().zip(&stride).map(|(&n, &s)| (n - 1) * s).sum();
        (offset + last < region.len()).then(|| View {
            region: region.clone(),
            size,
            stride,
            offset,
        })
    }
}

impl<T> SavedOnce<T> {
    /// The packed form of `tensor` if one is alive, else what `make` packs (`None`:
    /// declined, nothing remembered). `region` is the span the form `make` packs
    /// covers (see [`Region`]; `None`: shared only with saves of the same sizes and
    /// strides). A form whose region holds every element of `tensor` is shared, with
    /// the [`View`] to rebuild `tensor` from that region; the same tensor is preferred.
    /// The lock is held while `make` runs, so two threads saving one tensor pack it
    /// once.
    pub fn get_or_make(
        &self,
        tensor: &Tensor,
        region: Option<Region>,
        make: impl FnOnce() -> Result<Option<Arc<T>>, HookError>,
    ) -> Result<Lookup<T>, HookError> {
        let version = memsave_sys::tensor::version(tensor)?;
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.retain(|k| k.packed.strong_count() > 0);
        let mut inside = None;
        for k in known.iter() {
            let Some(found) = k.matches(tensor, version)? else {
                continue;
            };
            let Some(packed) = k.packed.upgrade() else {
                continue;
            };
            match found {
                Match::Same => return Ok(Lookup::Shared(packed, None)),
                Match::Inside(view) => {
                    inside.get_or_insert((packed, view));
                }
            }
        }
        if let Some((packed, view)) = inside {
            return Ok(Lookup::Shared(packed, Some(view)));
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
                kind: tensor.kind(),
                version,
                region,
                packed: Arc::downgrade(&packed),
            });
        }
        Ok(Lookup::Made(packed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn arange(n: i64) -> Tensor {
        Tensor::arange(n, (Kind::Float, Device::Cpu))
    }

    #[test]
    fn regions_are_the_spans_a_tensor_fills() {
        let t = arange(24).reshape([2, 3, 4]);
        for (view, len) in [
            (t.shallow_clone(), Some(24)),
            (t.transpose(0, 2), Some(24)),
            (t.permute([1, 2, 0]), Some(24)),
            (t.select(0, 1), Some(12)),
            (t.narrow(0, 1, 1), Some(12)),
            (t.reshape([24]), Some(24)),
            (arange(1).reshape([1, 1]).expand([1, 1], false), Some(1)),
            // Gaps or repeats: no region.
            (t.narrow(2, 0, 2), None),
            (t.select(2, 1), None),
            (arange(4).reshape([1, 4]).expand([3, 4], false), None),
            (arange(0).reshape([0, 3]), None),
        ] {
            assert_eq!(
                Region::of(&view).map(|r| r.len()),
                len,
                "{:?} {:?}",
                view.size(),
                view.stride()
            );
        }
    }

    #[test]
    fn a_region_rebuilds_the_tensor_and_other_views_of_its_memory() {
        let t = arange(24).reshape([2, 3, 4]);
        for first in [t.shallow_clone(), t.permute([2, 0, 1]), t.transpose(1, 2)] {
            let region = Region::of(&first).unwrap();
            // From the tensor's values in its own order (a decode gives them so).
            let memory = region.f_from_values(&first.contiguous()).unwrap();
            assert!(memory.equal(&arange(24)));
            assert!(region.f_view_of(&memory).unwrap().equal(&first));
            assert_eq!(region.f_view_of(&memory).unwrap().stride(), first.stride());
            assert!(region.f_memory(&first).unwrap().equal(&arange(24)));
            for other in [
                t.transpose(0, 1),
                t.select(1, 2),
                t.reshape([6, 4]).narrow(0, 2, 3),
            ] {
                let bytes = other.data_ptr() as usize - t.data_ptr() as usize;
                let view = View {
                    region: region.clone(),
                    size: other.size(),
                    stride: other.stride(),
                    offset: (bytes / 4) as i64,
                };
                assert!(view.f_of(&memory).unwrap().equal(&other));
            }
        }
    }
}
