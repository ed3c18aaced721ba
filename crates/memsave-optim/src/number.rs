//! Numbers as 0-dim tensors, so that an op that runs out of memory returns the error.
//!
//! tch hands a number to libtorch as a `Scalar`, and a `Scalar`'s drop reads libtorch's
//! error slot and panics when it holds an error. The slot is read after the op's
//! temporaries are dropped, so when the op the number was passed to just failed (out of
//! memory), tch panics even in the `f_` form: `f_mul_scalar_`, `f_lt`, `f_clamp`,
//! `Tensor::f_scalar_tensor` and every other op that takes a number. The optimizer
//! passes numbers as 0-dim tensors made without a `Scalar` instead. libtorch turns a
//! number into such a tensor itself before the same kernel runs, so the results are
//! the same bits (the f32 tests against tch's own optimizers check it).
use tch::{Device, Kind, TchError, Tensor};

/// `value` as a 0-dim tensor of `kind` on `device` (rounded as libtorch rounds a
/// number to that kind).
pub(crate) fn number(value: f64, kind: Kind, device: Device) -> Result<Tensor, TchError> {
    let t = Tensor::f_from_slice(&[value])?.f_reshape([0i64; 0])?;
    let t = if kind == Kind::Double {
        t
    } else {
        t.f_to_kind(kind)?
    };
    if device == Device::Cpu {
        Ok(t)
    } else {
        t.f_to_device(device)
    }
}

/// `value` as a 0-dim tensor of the kind and on the device of `like`: an operand that
/// an op on `like` uses as it is, with no conversion (and so no allocation) in the op.
pub(crate) fn number_like(value: f64, like: &Tensor) -> Result<Tensor, TchError> {
    number(value, like.kind(), like.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_0_dim_and_rounded_to_their_kind() {
        let t = number(0.1, Kind::Float, Device::Cpu).unwrap();
        assert_eq!(t.size(), Vec::<i64>::new());
        assert_eq!(t.kind(), Kind::Float);
        assert_eq!(t.double_value(&[]), f64::from(0.1f32));
        let i = number(127.0, Kind::Int16, Device::Cpu).unwrap();
        assert_eq!(i.int64_value(&[]), 127);
        let like = Tensor::zeros([3], (Kind::BFloat16, Device::Cpu));
        assert_eq!(number_like(1.0, &like).unwrap().kind(), Kind::BFloat16);
    }
}
