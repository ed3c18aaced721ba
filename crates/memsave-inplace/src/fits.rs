//! Whether an in-place result can take the place of the out-of-place one: the shape
//! must not grow by broadcasting and the dtype must not be promoted.
use tch::{Kind, Tensor};

/// PyTorch's type categories, ordered: a higher category wins a promotion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Category {
    Bool,
    Integral,
    Floating,
    Complex,
}

/// The category of a kind; `None` for quantized and float8 kinds, which this crate
/// only updates in place when both operands have the same kind.
pub(crate) fn category(kind: Kind) -> Option<Category> {
    match kind {
        Kind::Bool => Some(Category::Bool),
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 => {
            Some(Category::Integral)
        }
        Kind::Half | Kind::Float | Kind::Double | Kind::BFloat16 => Some(Category::Floating),
        Kind::ComplexHalf | Kind::ComplexFloat | Kind::ComplexDouble => Some(Category::Complex),
        _ => None,
    }
}

/// True when `x op other` (elementwise, broadcasting) has exactly `x`'s shape and kind,
/// so that `x.op_(other)` computes the same tensor.
pub(crate) fn binary_fits(x: &Tensor, other: &Tensor) -> bool {
    broadcasts_into(&x.size(), &other.size()) && keeps_kind(x, other)
}

/// True when a scalar of category `scalar` combined with `x` keeps `x`'s kind: Rust
/// numbers are PyTorch's "wrapped numbers", the lowest promotion tier, which only
/// matter when their category is higher than `x`'s.
pub(crate) fn scalar_keeps_kind(x: &Tensor, scalar: Category) -> bool {
    category(x.kind()).is_some_and(|c| c >= scalar)
}

/// True when broadcasting `other` against `x` yields `x`'s shape.
fn broadcasts_into(x: &[i64], other: &[i64]) -> bool {
    other.len() <= x.len()
        && x.iter()
            .rev()
            .zip(other.iter().rev())
            .all(|(&xd, &od)| od == xd || od == 1)
}

/// True when PyTorch's type promotion of `x` with `other` gives `x`'s kind.
///
/// Dimensioned tensors outrank zero-dimensional ones: a zero-dim `other` changes the
/// result only when its category is higher. Within one tier the higher category wins,
/// except that complex with floating may widen the complex kind, so that pair is left
/// out of place.
fn keeps_kind(x: &Tensor, other: &Tensor) -> bool {
    let (xk, ok) = (x.kind(), other.kind());
    if xk == ok {
        return true;
    }
    let (Some(xc), Some(oc)) = (category(xk), category(ok)) else {
        return false;
    };
    let (x_dimensioned, other_dimensioned) = (x.dim() > 0, other.dim() > 0);
    if x_dimensioned == other_dimensioned {
        oc < xc && !(xc == Category::Complex && oc == Category::Floating)
    } else {
        x_dimensioned && oc <= xc
    }
}

#[cfg(test)]
mod tests {
    use super::broadcasts_into;

    #[test]
    fn broadcasting_into_the_same_shape_fits() {
        assert!(broadcasts_into(&[3, 4], &[3, 4]));
        assert!(broadcasts_into(&[3, 4], &[4]));
        assert!(broadcasts_into(&[3, 4], &[3, 1]));
        assert!(broadcasts_into(&[3, 4], &[]));
        assert!(broadcasts_into(&[0, 4], &[1, 4]));
    }

    #[test]
    fn growing_the_shape_does_not_fit() {
        assert!(!broadcasts_into(&[4], &[3, 4]));
        assert!(!broadcasts_into(&[3, 1], &[3, 4]));
        assert!(!broadcasts_into(&[], &[1]));
        assert!(!broadcasts_into(&[1, 4], &[0, 4]));
    }
}
