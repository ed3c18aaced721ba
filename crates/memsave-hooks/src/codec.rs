//! `Codec`: how a saved floating-point tensor is stored smaller, and its error bound.
use std::num::NonZeroUsize;
use tch::{Kind, TchError, Tensor};

/// The block of a blockwise codec when none is given: 1,024 elements, so the f32
/// scale adds 4 bytes per 1,024 (0.4% of the int8 data).
pub const DEFAULT_BLOCK: NonZeroUsize = match NonZeroUsize::new(1024) {
    Some(n) => n,
    None => unreachable!(),
};

/// A lossy representation of a saved tensor, restored to its dtype at unpack.
///
/// The error of one element `x` restored as `x'` (before rounding to the original
/// dtype, which adds that dtype's own rounding), with `m` the largest `|x|` of its
/// block (blockwise codecs):
///
/// | codec | stored per element | error bound |
/// | --- | --- | --- |
/// | `Bf16` | 2 bytes | `|x - x'| <= 2^-8 |x|` |
/// | `Fp16` | 2 bytes | `|x - x'| <= 2^-11 |x| + 2^-25` |
/// | `Fp8E4m3` | 1 byte + 4 per block | `|x - x'| <= 2^-4 |x| + 2^-10 m / 448` |
/// | `Int8` | 1 byte + 4 per block | `|x - x'| <= m / 254` (stochastic: `< m / 127`) |
///
/// Traps, each a pass-through (the tensor is kept as it is, never silently wrong):
/// - tensors that are not floating point (masks, indices);
/// - a codec that would not shrink the tensor (`Bf16`/`Fp16` on a 2-byte float);
/// - `Fp16` on a tensor with a value beyond its range (`|x| > 65504`);
/// - `Fp8E4m3` and `Int8` on a tensor holding inf or NaN (its block scale would be
///   meaningless).
///
/// Reading those maxima costs one host synchronization per pack on CUDA.
/// Stochastic rounding draws from libtorch's default generator, so it shifts the
/// random numbers that later ops (dropout) draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// bfloat16: f32's range, 8 bits of precision.
    Bf16,
    /// IEEE half: 11 bits of precision, range ±65504.
    Fp16,
    /// float8 e4m3 (`Float8e4m3fn`) after dividing each block by `max|x| / 448`.
    Fp8E4m3 {
        /// Elements sharing one scale.
        block: NonZeroUsize,
    },
    /// int8 after dividing each block by `max|x| / 127` (bitsandbytes' blockwise
    /// absmax).
    Int8 {
        /// Elements sharing one scale.
        block: NonZeroUsize,
        /// Round up with probability equal to the fraction (unbiased: the expected
        /// restored value is `x`), rather than to nearest.
        stochastic_rounding: bool,
    },
}

impl Codec {
    /// float8 e4m3 with the default block.
    pub fn fp8() -> Self {
        Codec::Fp8E4m3 {
            block: DEFAULT_BLOCK,
        }
    }

    /// int8 absmax with the default block, rounding to nearest.
    pub fn int8() -> Self {
        Codec::Int8 {
            block: DEFAULT_BLOCK,
            stochastic_rounding: false,
        }
    }

    /// The codec's short name: `bf16`, `fp16`, `fp8`, `int8`.
    pub fn name(&self) -> &'static str {
        match self {
            Codec::Bf16 => "bf16",
            Codec::Fp16 => "fp16",
            Codec::Fp8E4m3 { .. } => "fp8",
            Codec::Int8 { .. } => "int8",
        }
    }

    /// `tensor` stored by this codec, or `None` when it is passed through (see the
    /// traps on [`Codec`]).
    pub fn f_encode(&self, tensor: &Tensor) -> Result<Option<Encoded>, TchError> {
        let kind = tensor.f_kind()?;
        if !is_float(kind) || tensor.numel() == 0 {
            return Ok(None);
        }
        let shape = tensor.size();
        let numel = tensor.numel() as i64;
        let (data, scale) = match *self {
            Codec::Bf16 | Codec::Fp16 if kind.elt_size_in_bytes() <= 2 => return Ok(None),
            Codec::Bf16 => (tensor.f_to_kind(Kind::BFloat16)?, None),
            Codec::Fp16 => {
                let high = tensor.f_max()?.f_double_value(&[])?;
                let low = tensor.f_min()?.f_double_value(&[])?;
                let range = high.abs().max(low.abs());
                if range.is_nan() || range > 65504.0 {
                    return Ok(None);
                }
                (tensor.f_to_kind(Kind::Half)?, None)
            }
            Codec::Fp8E4m3 { block } => {
                let Some((blocks, scale)) = blockwise(tensor, block, 448.0)? else {
                    return Ok(None);
                };
                let data = blocks.f_div(&scale)?.f_to_kind(Kind::Float8e4m3fn)?;
                (data, Some(scale))
            }
            Codec::Int8 {
                block,
                stochastic_rounding,
            } => {
                let Some((blocks, scale)) = blockwise(tensor, block, 127.0)? else {
                    return Ok(None);
                };
                let mut v = blocks.f_div(&scale)?;
                if stochastic_rounding {
                    let _ = v.f_add_(&v.f_rand_like()?)?.f_floor_()?;
                } else {
                    let _ = v.f_round_()?;
                }
                let _ = v.f_clamp_(-127, 127)?;
                (v.f_to_kind(Kind::Int8)?, Some(scale))
            }
        };
        Ok(Some(Encoded {
            kind,
            shape,
            numel,
            data,
            scale,
        }))
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}

/// `tensor` as f32 blocks `[n, block]` (zero-padded) and each block's scale
/// `max|x| / top` (`[n, 1]`); `None` when a value is inf or NaN.
fn blockwise(
    tensor: &Tensor,
    block: NonZeroUsize,
    top: f64,
) -> Result<Option<(Tensor, Tensor)>, TchError> {
    let block = block.get() as i64;
    let flat = tensor.f_reshape([-1])?.f_to_kind(Kind::Float)?;
    let numel = flat.size()[0];
    let count = (numel + block - 1) / block;
    let padded = if count * block > numel {
        flat.f_constant_pad_nd([0, count * block - numel])?
    } else {
        flat
    };
    let blocks = padded.f_view([count, block])?;
    let absmax = blocks
        .f_amax([1], true)?
        .f_maximum(&blocks.f_amin([1], true)?.f_neg()?)?;
    if !absmax.f_max()?.f_double_value(&[])?.is_finite() {
        return Ok(None);
    }
    // An all-zero block divides by the smallest normal f32 and stores zeros.
    let scale = absmax
        .f_div_scalar(top)?
        .f_clamp_min(f64::from(f32::MIN_POSITIVE))?;
    Ok(Some((blocks, scale)))
}

/// A tensor stored by a [`Codec`]: the reduced data, the block scales, and what is
/// needed to restore the original.
#[derive(Debug)]
pub struct Encoded {
    kind: Kind,
    shape: Vec<i64>,
    numel: i64,
    data: Tensor,
    scale: Option<Tensor>,
}

impl Encoded {
    /// The tensor restored to its original shape and dtype.
    pub fn f_decode(&self) -> Result<Tensor, TchError> {
        let values = match &self.scale {
            None => self.data.shallow_clone(),
            Some(scale) => self
                .data
                .f_to_kind(Kind::Float)?
                .f_mul(scale)?
                .f_reshape([-1])?
                .f_narrow(0, 0, self.numel)?,
        };
        values.f_reshape(&self.shape)?.f_to_kind(self.kind)
    }

    /// Bytes held by the stored form (data and scales).
    pub fn stored_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        bytes(&self.data) + self.scale.as_ref().map_or(0, bytes)
    }

    /// Bytes of the original tensor.
    pub fn original_bytes(&self) -> u64 {
        self.numel as u64 * self.kind.elt_size_in_bytes() as u64
    }
}
