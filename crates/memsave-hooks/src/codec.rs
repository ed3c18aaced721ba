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
/// `Int8` rounding to nearest keeps the sign of every value: a nonzero value that
/// would round to zero is stored as one step (`±m / 127`) instead, so for
/// `0 < |x| < m / 254` the error is `< m / 127`. A zero would turn a ReLU's mask off
/// (`result > 0` in backward) and drop that element's whole gradient: on conv/ReLU
/// stacks such flips, a fraction of a percent of the elements, made a gradient error
/// of 3-6% (relative L2) where keeping signs gives under 1%. Trap: stochastic
/// rounding stays unbiased, so it does round small values to zero and flips masks.
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

    /// This codec with blocks of at most `block` elements (bf16 and fp16, which have
    /// none, unchanged).
    pub(crate) fn block_at_most(self, block: NonZeroUsize) -> Self {
        match self {
            Codec::Fp8E4m3 { block: b } => Codec::Fp8E4m3 {
                block: b.min(block),
            },
            Codec::Int8 {
                block: b,
                stochastic_rounding,
            } => Codec::Int8 {
                block: b.min(block),
                stochastic_rounding,
            },
            other => other,
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
        self.f_encode_grouped(tensor, &[], false, true)
    }

    /// [`f_encode`](Self::f_encode), with blocks that never mix two indices of the
    /// dimensions `groups` (a blockwise codec's scale then follows each group's own
    /// range): `[1]` gives each channel of an `[N, C, H, W]` tensor blocks of its own.
    /// A group's elements are cut into blocks of equal size, at most the codec's block
    /// (`ceil(len / ceil(len / block))`), so a group pads less than one element per
    /// block. Empty `groups`: `f_encode`'s blocks (or, `centered`, one group). Bf16
    /// and fp16 have no blocks.
    ///
    /// `keep_signs: false` turns off int8's rule that keeps a nonzero value's sign
    /// (rounding to nearest stores it as zero then, within `m / 254`): for tensors no
    /// backward reads a sign or mask from, such as probabilities and a batched
    /// matmul's inputs (see [`ROW_BLOCK_OPS`](crate::ROW_BLOCK_OPS)), where that rule
    /// would add one step to every tiny value.
    ///
    /// `centered` stores values relative to a midpoint of their own, for a tensor that
    /// is read through its deviations from a mean (the input of a normalization that
    /// subtracts one): blockwise codecs store each block relative to its midrange
    /// `(max + min) / 2`, scaled by its half-range (a step never larger than absmax's),
    /// bf16 and fp16 each group relative to its mean (an f32 per group). The error is
    /// then a fraction of the values' spread instead of `|x|`, which is many times the
    /// spread when a channel sits far from zero. Trap: a centered form restores no
    /// value exactly, zero included (a ReLU's mask, `x > 0`, would flip).
    pub(crate) fn f_encode_grouped(
        &self,
        tensor: &Tensor,
        groups: &[usize],
        centered: bool,
        keep_signs: bool,
    ) -> Result<Option<Encoded>, TchError> {
        let kind = tensor.f_kind()?;
        if !is_float(kind) || tensor.numel() == 0 {
            return Ok(None);
        }
        let shape = tensor.size();
        let numel = tensor.numel() as i64;
        let rows = match Rows::of(&shape, groups) {
            None if centered => Some(Rows::whole(&shape)),
            rows => rows,
        };
        let mut offset = None;
        let (data, scale) = match *self {
            Codec::Bf16 | Codec::Fp16 if kind.elt_size_in_bytes() <= 2 => return Ok(None),
            Codec::Bf16 | Codec::Fp16 => {
                let mut values = tensor.shallow_clone();
                if let (true, Some(rows)) = (centered, &rows) {
                    let matrix = rows.f_matrix(tensor)?;
                    let mean = matrix.f_mean_dim(Some([1i64].as_slice()), true, Kind::Float)?;
                    // inf or NaN: stored as it is, uncentered.
                    if mean.f_isfinite()?.f_all()?.f_int64_value(&[])? == 1 {
                        values = matrix.f_sub(&mean)?;
                        offset = Some(mean);
                    }
                }
                if *self == Codec::Bf16 {
                    (values.f_to_kind(Kind::BFloat16)?, None)
                } else {
                    let high = values.f_max()?.f_double_value(&[])?;
                    let low = values.f_min()?.f_double_value(&[])?;
                    let range = high.abs().max(low.abs());
                    if range.is_nan() || range > 65504.0 {
                        return Ok(None);
                    }
                    (values.f_to_kind(Kind::Half)?, None)
                }
            }
            Codec::Fp8E4m3 { block } => {
                let Some(b) = blockwise(tensor, &rows, block, 448.0, centered)? else {
                    return Ok(None);
                };
                offset = b.offset;
                (b.values.f_to_kind(Kind::Float8e4m3fn)?, Some(b.scale))
            }
            Codec::Int8 {
                block,
                stochastic_rounding,
            } => {
                let Some(b) = blockwise(tensor, &rows, block, 127.0, centered)? else {
                    return Ok(None);
                };
                let mut v = b.values;
                if stochastic_rounding {
                    let _ = v.f_add_(&v.f_rand_like()?)?.f_floor_()?;
                } else {
                    let _ = v.f_round_()?;
                }
                let _ = v.f_clamp_(-127, 127)?;
                // Rounded to nearest, a nonzero value keeps its sign: rounded to zero it
                // would turn a ReLU's mask off (`result > 0` in backward) at full
                // gradient size. (Stochastic rounding stays unbiased instead; a
                // centered form has no exact zero to keep.)
                let v = if stochastic_rounding || b.offset.is_some() || !keep_signs {
                    v
                } else {
                    v.f_where_self(&v.f_ne(0)?, &b.raw.f_sign()?)?
                };
                offset = b.offset;
                (v.f_to_kind(Kind::Int8)?, Some(b.scale))
            }
        };
        let rows = if scale.is_some() || offset.is_some() {
            rows
        } else {
            None
        };
        Ok(Some(Encoded {
            kind,
            shape,
            numel,
            data,
            scale,
            offset,
            rows,
        }))
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}

/// How [`Codec::f_encode_grouped`] lays a tensor out in rows, one per group: the
/// grouped dimensions moved to the front (in order), then the tensor seen as
/// `[groups, len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rows {
    /// The order of the tensor's dimensions in the row layout (`permute`'s argument).
    perm: Vec<i64>,
    /// The tensor's sizes in that order.
    permuted: Vec<i64>,
    /// Rows (groups) and elements per row.
    count: i64,
    len: i64,
}

impl Rows {
    /// The layout grouping `shape` by `groups` (dimensions out of range are ignored);
    /// `None` for no groups.
    fn of(shape: &[i64], groups: &[usize]) -> Option<Rows> {
        let mut front: Vec<usize> = Vec::new();
        for &d in groups {
            if d < shape.len() && !front.contains(&d) {
                front.push(d);
            }
        }
        if front.is_empty() {
            return None;
        }
        let rest = (0..shape.len()).filter(|d| !front.contains(d));
        let perm: Vec<i64> = front
            .iter()
            .copied()
            .chain(rest)
            .map(|d| d as i64)
            .collect();
        let permuted: Vec<i64> = perm.iter().map(|&d| shape[d as usize]).collect();
        let count: i64 = front.iter().map(|&d| shape[d]).product();
        let len = permuted[front.len()..].iter().product();
        Some(Rows {
            perm,
            permuted,
            count,
            len,
        })
    }

    /// The whole tensor as one row.
    fn whole(shape: &[i64]) -> Rows {
        Rows {
            perm: (0..shape.len() as i64).collect(),
            permuted: shape.to_vec(),
            count: 1,
            len: shape.iter().product(),
        }
    }

    /// `tensor` (of the sizes this layout was made for) as f32 rows `[count, len]`.
    fn f_matrix(&self, tensor: &Tensor) -> Result<Tensor, TchError> {
        tensor
            .f_permute(&self.perm)?
            .f_reshape([self.count, self.len])?
            .f_to_kind(Kind::Float)
    }

    /// Blocks per row and elements per block: equal blocks of at most `block`.
    fn blocks(&self, block: i64) -> (i64, i64) {
        let per_row = (self.len + block - 1) / block;
        (per_row, (self.len + per_row - 1) / per_row)
    }

    /// The inverse of `perm`.
    fn inverse(&self) -> Vec<i64> {
        let mut inv = vec![0i64; self.perm.len()];
        for (i, &d) in self.perm.iter().enumerate() {
            inv[d as usize] = i as i64;
        }
        inv
    }
}

/// A tensor cut into blocks by [`blockwise`].
struct Blocks {
    /// The blocks as they were, f32 `[n, size]` (padded).
    raw: Tensor,
    /// `(raw - offset) / scale`: within `±top`.
    values: Tensor,
    /// Each block's scale, `[n, 1]`.
    scale: Tensor,
    /// Each block's midrange `(max + min) / 2`, `[n, 1]`, when centered.
    offset: Option<Tensor>,
}

/// `tensor` as f32 blocks `[n, size]` and each block's scale: `max|x| / top`, or,
/// `centered`, the half-range `(max - min) / 2 / top` around the block's midrange;
/// `None` when a value is inf or NaN. Without `rows`, blocks of `block` consecutive
/// elements (the last one zero-padded); with them, each row cut into equal blocks
/// (see [`Rows::blocks`]), each row padded at its end with zeros or, centered, with
/// its last value (a zero would widen the last block's range).
fn blockwise(
    tensor: &Tensor,
    rows: &Option<Rows>,
    block: NonZeroUsize,
    top: f64,
    centered: bool,
) -> Result<Option<Blocks>, TchError> {
    let block = block.get() as i64;
    let raw = match rows {
        None => {
            let flat = tensor.f_reshape([-1])?.f_to_kind(Kind::Float)?;
            let numel = flat.size()[0];
            let count = (numel + block - 1) / block;
            let padded = if count * block > numel {
                flat.f_constant_pad_nd([0, count * block - numel])?
            } else {
                flat
            };
            padded.f_view([count, block])?
        }
        Some(rows) => {
            let (per_row, size) = rows.blocks(block);
            let matrix = rows.f_matrix(tensor)?;
            let extra = per_row * size - rows.len;
            let padded = if extra == 0 {
                matrix
            } else if centered {
                let last = matrix
                    .f_narrow(1, rows.len - 1, 1)?
                    .f_expand([rows.count, extra], false)?;
                Tensor::f_cat(&[matrix, last], 1)?
            } else {
                matrix.f_constant_pad_nd([0, extra])?
            };
            padded.f_reshape([rows.count * per_row, size])?
        }
    };
    let high = raw.f_amax([1], true)?;
    let low = raw.f_amin([1], true)?;
    let (reach, offset) = if centered {
        // Halved before adding: no overflow near f32's largest values.
        let (high, low) = (high.f_div_scalar(2.0)?, low.f_div_scalar(2.0)?);
        (high.f_sub(&low)?, Some(high.f_add(&low)?))
    } else {
        (high.f_maximum(&low.f_neg()?)?, None)
    };
    if !reach.f_max()?.f_double_value(&[])?.is_finite() {
        return Ok(None);
    }
    // An all-zero (or, centered, constant) block divides by the smallest normal f32
    // and stores zeros.
    let scale = reach
        .f_div_scalar(top)?
        .f_clamp_min(f64::from(f32::MIN_POSITIVE))?;
    let values = match &offset {
        None => raw.f_div(&scale)?,
        Some(offset) => raw.f_sub(offset)?.f_div(&scale)?,
    };
    Ok(Some(Blocks {
        raw,
        values,
        scale,
        offset,
    }))
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
    /// What was subtracted before encoding (a centered form): per block for blockwise
    /// codecs, per row otherwise.
    offset: Option<Tensor>,
    /// The row layout of grouped blocks or centered rows, `None` for consecutive
    /// blocks or the tensor's own shape.
    rows: Option<Rows>,
}

impl Encoded {
    /// The tensor restored to its original shape and dtype.
    pub fn f_decode(&self) -> Result<Tensor, TchError> {
        if self.scale.is_none() && self.offset.is_none() {
            return self.data.f_reshape(&self.shape)?.f_to_kind(self.kind);
        }
        let mut values = self.data.f_to_kind(Kind::Float)?;
        if let Some(scale) = &self.scale {
            values = values.f_mul(scale)?;
        }
        if let Some(offset) = &self.offset {
            values = values.f_add(offset)?;
        }
        match &self.rows {
            None => values
                .f_reshape([-1])?
                .f_narrow(0, 0, self.numel)?
                .f_reshape(&self.shape)?
                .f_to_kind(self.kind),
            Some(rows) => values
                .f_reshape([rows.count, -1])?
                .f_narrow(1, 0, rows.len)?
                .f_reshape(&rows.permuted)?
                .f_permute(rows.inverse())?
                .f_to_kind(self.kind)?
                .f_contiguous(),
        }
    }

    /// Bytes held by the stored form (data and scales).
    pub fn stored_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        bytes(&self.data)
            + self.scale.as_ref().map_or(0, bytes)
            + self.offset.as_ref().map_or(0, bytes)
    }

    /// Bytes of the original tensor.
    pub fn original_bytes(&self) -> u64 {
        self.numel as u64 * self.kind.elt_size_in_bytes() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tch::Device;

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Grouped blocks restore the shape, and each element within its own group's
        /// range: a group of values 1e4 times smaller than its neighbours' keeps its
        /// precision (flat blocks would store it as zeros or one step).
        #[test]
        fn grouped_blocks_follow_each_groups_range(
            shape in prop::collection::vec(1i64..7, 1..5),
            group_bits in 0usize..16,
            block in 1usize..40,
            stochastic in any::<bool>(),
            fp8 in any::<bool>(),
            seed in 0i64..1000,
        ) {
            tch::manual_seed(seed);
            let groups: Vec<usize> = (0..shape.len()).filter(|d| group_bits >> d & 1 == 1).collect();
            let block = NonZeroUsize::new(block).unwrap();
            let codec = if fp8 {
                Codec::Fp8E4m3 { block }
            } else {
                Codec::Int8 { block, stochastic_rounding: stochastic }
            };
            // Each group's scale: 1 or 1e-4, alternating.
            let mut scale = Tensor::ones(shape.as_slice(), (Kind::Float, Device::Cpu));
            let mut group_of = Tensor::zeros(shape.as_slice(), (Kind::Int64, Device::Cpu));
            let mut count = 1i64;
            for &d in &groups {
                let mut view = vec![1i64; shape.len()];
                view[d] = shape[d];
                let idx = Tensor::arange(shape[d], (Kind::Int64, Device::Cpu)).view(view.as_slice());
                group_of = group_of * shape[d] + idx;
                count *= shape[d];
            }
            if count > 1 {
                let small = group_of.remainder(2).eq(1);
                scale = scale.where_self(&small.logical_not(), &Tensor::from(1e-4f32));
            }
            let x = Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)) * &scale;
            let e = codec.f_encode_grouped(&x, &groups, false, true).unwrap().unwrap();
            let r = e.f_decode().unwrap();
            prop_assert_eq!(r.size(), shape.clone());
            prop_assert_eq!(r.kind(), Kind::Float);
            // The largest |x| of each element's group, element by element.
            let group: Vec<i64> = Vec::<i64>::try_from(&group_of.reshape([-1])).unwrap();
            let (xv, rv) = (values(&x), values(&r));
            let mut max = vec![0f64; count as usize];
            for (g, v) in group.iter().zip(&xv) {
                max[*g as usize] = max[*g as usize].max(v.abs());
            }
            let mv: Vec<f64> = group.iter().map(|g| max[*g as usize]).collect();
            for ((v, r), m) in xv.iter().zip(&rv).zip(&mv) {
                // int8: < m / 127; fp8: 2^-4 |x| + 2^-10 m / 448; with f32 slack.
                let bound = if fp8 { v.abs() / 16.0 + m / 448.0 / 1024.0 } else { m / 127.0 } + 1e-6 * m;
                prop_assert!((v - r).abs() <= bound, "{codec:?} {shape:?} {groups:?}: {v} as {r}, group max {m}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// A centered form's error is a fraction of each group's spread, however far
        /// the group sits from zero: int8 within half a step of its block's
        /// half-range (at most the group's range / 254), bf16 and fp16 within their
        /// relative precision of the distance to the group's mean. Uncentered, a group
        /// of spread 1 around 1e3 would be off by up to 1e3 / 254 (int8) or 4 (bf16).
        #[test]
        fn centered_forms_follow_each_groups_spread(
            groups in 1i64..6,
            len in 1i64..3000,
            offset in prop::sample::select(vec![0.0f64, 1e3, -1e5]),
            codec in 0usize..3,
            seed in 0i64..1000,
        ) {
            tch::manual_seed(seed);
            let codec = [Codec::int8(), Codec::Bf16, Codec::Fp16][codec];
            let shift = Tensor::randn([groups, 1], (Kind::Float, Device::Cpu)) * offset;
            let x = Tensor::randn([groups, len], (Kind::Float, Device::Cpu)) + shift;
            let Some(e) = codec.f_encode_grouped(&x, &[0], true, true).unwrap() else {
                // fp16 passes a value beyond its range through.
                prop_assert!(codec == Codec::Fp16 && offset.abs() > 6e4);
                return Ok(());
            };
            let r = e.f_decode().unwrap();
            prop_assert_eq!(r.size(), vec![groups, len]);
            for g in 0..groups {
                let (xv, rv) = (values(&x.get(g)), values(&r.get(g)));
                let mean = xv.iter().sum::<f64>() / len as f64;
                let high = xv.iter().cloned().fold(f64::MIN, f64::max);
                let low = xv.iter().cloned().fold(f64::MAX, f64::min);
                // f32 arithmetic around the offset.
                let slack = 4.0 * f64::from(f32::EPSILON) * (mean.abs() + high - low);
                for (v, r) in xv.iter().zip(&rv) {
                    let bound = match codec {
                        Codec::Bf16 => (v - mean).abs() / 256.0,
                        Codec::Fp16 => (v - mean).abs() / 2048.0 + 6e-8,
                        _ => (high - low) / 254.0,
                    } + slack;
                    prop_assert!((v - r).abs() <= bound, "{codec:?}, group {g} of {len} around {mean}: {v} as {r} (bound {bound})");
                }
            }
        }
    }

    #[test]
    fn grouped_blocks_split_each_group_evenly() {
        // 3 groups of 2,500 elements, block 1,024: 3 blocks of 834 per group.
        let x = Tensor::randn([3, 50, 50], (Kind::Float, Device::Cpu));
        let e = Codec::int8()
            .f_encode_grouped(&x, &[0], false, true)
            .unwrap()
            .unwrap();
        assert_eq!(e.stored_bytes(), 3 * (3 * 834 + 3 * 4));
        // Flat blocks: 8 of 1,024 for 7,500 elements.
        let e = Codec::int8().f_encode(&x).unwrap().unwrap();
        assert_eq!(e.stored_bytes(), 8 * (1024 + 4));
    }
}
