//! A saved tensor's distinct elements: what the packing hooks keep of a tensor
//! expanded from a smaller one.
use tch::{TchError, Tensor};

/// What a packing hook keeps of a saved tensor: its distinct elements.
///
/// A tensor expanded from a smaller one (stride 0 in a dimension, as `expand` and
/// broadcasting make) shares one element among all the positions of that dimension.
/// Copying it (`contiguous`, a codec, a copy to another device) would store every
/// repeat: a `[1, 1024]` row expanded to `[256, 1024]` would take 256 times its bytes.
/// So the hooks keep the tensor narrowed to size 1 in each such dimension and
/// [`Expanded::restore`] expands it back at unpack: the shape and dtype autograd
/// checks are those of the saved tensor; only the strides differ from a copy's.
pub(crate) fn distinct(t: &Tensor) -> Result<(Tensor, Option<Expanded>), TchError> {
    let size = t.size();
    let repeated = |(d, (&n, &s)): (usize, (&i64, &i64))| (s == 0 && n > 1).then_some(d);
    let dims: Vec<usize> = size
        .iter()
        .zip(&t.stride())
        .enumerate()
        .filter_map(repeated)
        .collect();
    if dims.is_empty() {
        return Ok((t.shallow_clone(), None));
    }
    let mut base = t.shallow_clone();
    for d in dims {
        base = base.f_narrow(d as i64, 0, 1)?;
    }
    Ok((base, Some(Expanded(size))))
}

/// The sizes of a saved tensor that [`distinct`] narrowed.
#[derive(Debug, Clone)]
pub(crate) struct Expanded(Vec<i64>);

impl Expanded {
    /// `base`, as [`distinct`] kept it (or a copy of it), expanded back to the saved
    /// tensor's sizes; `base` as it is with `None`.
    pub fn restore(expanded: Option<&Expanded>, base: Tensor) -> Result<Tensor, TchError> {
        match expanded {
            None => Ok(base),
            Some(Expanded(size)) => base.f_expand(size, false),
        }
    }
}
