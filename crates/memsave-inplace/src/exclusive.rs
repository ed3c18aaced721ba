//! Exclusivity: whether anybody but the caller's handle holds a tensor's storage.
//!
//! An in-place update is safe exactly when nobody else can observe it: no other
//! handle, no view, and no tensor that autograd saved for backward. libtorch keeps two
//! reference counts that together answer this, read through `memsave-sys`.
use crate::Result;
use memsave_sys::tensor::{self, ViewCreation};
use std::fmt;
use tch::Tensor;

/// Who holds a tensor, as libtorch counts it; see [`sharing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharing {
    /// Handles to the tensor's `TensorImpl`: tch handles, shallow clones, the base
    /// reference of each view made from it, and autograd's saved inputs.
    pub use_count: u64,
    /// `TensorImpl`s that share its storage: itself, its views and its base, detached
    /// aliases, and autograd's saved outputs. 0 for a tensor without storage.
    pub storage_use_count: u64,
    /// True when the tensor is a view of another tensor's storage.
    pub is_view: bool,
    /// For a view, the handles to its base (1: only this view holds it).
    pub base_use_count: Option<u64>,
}

impl Sharing {
    /// True when the caller's handle is the only holder: both counts are 1 and the
    /// tensor is not a view, or it is a view that alone holds its base (use count 1,
    /// storage shared by the view and its base only, base use count 1). See
    /// [`is_exclusive`] for what each count catches.
    pub fn is_exclusive(&self) -> bool {
        if self.use_count != 1 {
            return false;
        }
        if self.is_view {
            self.storage_use_count == 2 && self.base_use_count == Some(1)
        } else {
            self.storage_use_count == 1
        }
    }
}

impl fmt::Display for Sharing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (use count {}, storage use count {}{})",
            if self.is_exclusive() {
                "exclusive"
            } else {
                "shared"
            },
            self.use_count,
            self.storage_use_count,
            if self.is_view { ", a view" } else { "" }
        )
    }
}

/// Reads the reference counts of `t`.
pub fn sharing(t: &Tensor) -> Result<Sharing> {
    Ok(Sharing {
        use_count: tensor::use_count(t)?,
        storage_use_count: tensor::storage_use_count(t)?,
        is_view: tensor::is_view(t)?,
        base_use_count: tensor::base_use_count(t)?,
    })
}

/// True when nobody but this handle holds `t` or its storage, so mutating it in place
/// cannot change what anybody else sees, nor what autograd saved for backward.
///
/// The rule, observed on libtorch 2.13 (and tested in `tests/it/exclusivity.rs`):
///
/// | who else holds the tensor | use count | storage use count | view |
/// | --- | --- | --- | --- |
/// | nobody | 1 | 1 | no |
/// | a shallow clone (a second tch handle) | 2 | 1 | no |
/// | autograd, saving it as an *input* (`matmul`, `linear`, `gelu`, `clamp`, `mul`) | 2 | 1 | no |
/// | autograd, saving it as an *output* (`relu`, `exp`, `sigmoid`) | 1 | 2 | no |
/// | a view of it (`narrow`, `tr`, `view`), even under `no_grad` | 2 | 2 | no |
/// | a detached alias (`detach`) | 1 | 2 | no |
/// | it is a view whose base somebody else holds too | 1 | 2 | yes, base use count ≥ 2 |
/// | it is a view that alone holds its base | 1 | 2 | yes, base use count 1 |
///
/// Exclusive means: use count 1 and storage use count 1 for a tensor that is not a
/// view; for a view, use count 1, storage use count 2 (the view and its base) and base
/// use count 1. The last case is common: tch's `linear` with a bias on an input of three
/// or more dimensions returns such a view (libtorch flattens the input, runs `addmm`
/// and views the result back), and it may be updated in place like any activation.
///
/// # Traps
/// - Autograd does not save inputs whose gradient nobody needs: `x.matmul(&w)` saves
///   `x` only when `w` requires grad, and under `no_grad` nothing is saved at all.
/// - Exclusivity does not say the tensor *may* be mutated: a leaf that requires grad is
///   exclusive but must not be; see [`can_mutate_in_place`].
pub fn is_exclusive(t: &Tensor) -> Result<bool> {
    // The counts are read first: they are the cheap, common reason to say no.
    if tensor::use_count(t)? != 1 {
        return Ok(false);
    }
    match tensor::storage_use_count(t)? {
        1 => Ok(!tensor::is_view(t)?),
        2 => Ok(tensor::base_use_count(t)? == Some(1)),
        _ => Ok(false),
    }
}

/// True when `t` may be updated in place without anybody noticing: it is
/// [exclusive](is_exclusive), it is not a leaf that requires grad (libtorch forbids
/// that in grad mode, and a parameter is owned by its `VarStore` anyway), it is not a
/// view that libtorch refuses to write into (below), and no two of its elements share
/// memory (an expanded tensor cannot take an in-place write).
///
/// # Traps
/// libtorch refuses an in-place write that autograd records (grad mode on and any
/// operand requiring grad) into a view made any way but the ordinary one: one of
/// several views returned by one op (`chunk`, `split`, `unbind`), a view made under
/// `no_grad` or in inference mode, or one returned by a custom function. Such a view
/// may well be exclusive, and whether the write is recorded depends on the other
/// operands too, so while grad mode is on it is never mutated in place; under
/// `no_grad` libtorch checks nothing and it is. The answer therefore depends on the
/// grad mode at the time of the call.
pub fn can_mutate_in_place(t: &Tensor) -> Result<bool> {
    if !is_exclusive(t)? {
        return Ok(false);
    }
    if t.requires_grad() && t.is_leaf() {
        return Ok(false);
    }
    if tensor::grad_mode_enabled()
        && tensor::view_creation(t)?.is_some_and(|how| how != ViewCreation::Default)
    {
        return Ok(false);
    }
    Ok(!has_internal_overlap(&t.size(), &t.stride()))
}

/// True when two elements of a tensor with this layout share one memory location
/// (a zero stride on a dimension of size > 1, or strides too small for the sizes).
fn has_internal_overlap(size: &[i64], stride: &[i64]) -> bool {
    if size.contains(&0) {
        return false;
    }
    let mut dims: Vec<(i64, i64)> = size
        .iter()
        .zip(stride)
        .filter(|(&n, _)| n > 1)
        .map(|(&n, &s)| (n, s))
        .collect();
    dims.sort_by_key(|&(_, s)| s);
    let mut min_stride = 1;
    for (n, s) in dims {
        if s < min_stride {
            return true;
        }
        min_stride = s * n;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::has_internal_overlap;

    #[test]
    fn contiguous_and_transposed_layouts_do_not_overlap() {
        assert!(!has_internal_overlap(&[3, 4], &[4, 1]));
        assert!(!has_internal_overlap(&[4, 3], &[1, 4]));
        assert!(!has_internal_overlap(&[1, 5], &[0, 1]));
        assert!(!has_internal_overlap(&[0, 5], &[0, 0]));
        assert!(!has_internal_overlap(&[], &[]));
    }

    #[test]
    fn expanded_and_squeezed_strides_overlap() {
        assert!(has_internal_overlap(&[4], &[0]));
        assert!(has_internal_overlap(&[3, 4], &[1, 1]));
        assert!(has_internal_overlap(&[2, 3], &[2, 1]));
    }
}
