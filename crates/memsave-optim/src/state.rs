//! The precision of optimizer state: f32, bf16, or 8-bit codes with one scale per block.
//!
//! The 8-bit code is logarithmic, in the spirit of bitsandbytes' dynamic quantization:
//! a block's values are divided by the block's largest magnitude (its *absmax*, kept in
//! f32), and each quotient is stored as the nearest power of a fixed ratio. A signed
//! buffer (first moment, momentum) uses a sign and 127 magnitudes spanning six decades
//! below the absmax; quotients under the smallest become 0, which only shortens the
//! step. A non-negative buffer (second moment) uses 255 magnitudes spanning twelve
//! decades, and a non-zero value is never stored as 0: rounding it up keeps the
//! denominator of the Adam update from collapsing to `eps`. Neighbouring codes are
//! about 11.5% apart, so a stored value is within about 5.6% of the computed one; the
//! block's largest value is stored exactly. Rounding is to nearest (deterministic), so
//! a moment that changes by less than half a step per update (a second moment decaying
//! by `beta2 = 0.999`) stays where it is until the block's scale moves: 8-bit state
//! trades that precision for memory, as bitsandbytes does.
//!
//! Infinities (a second moment that overflowed f32 after a gradient above about 6e20,
//! as it does in f32 state) do not become the scale: that would decode the whole block
//! as `0 * inf = NaN`. A block holding one is scaled by its largest *finite* magnitude
//! times one code step, which leaves the top code free to mean "infinity" (with its
//! sign), and its absmax is stored negated to say so. Its finite values are then stored
//! as in any block (the largest within one rounding of exact instead of exactly), and
//! the infinities decode as themselves, so the update sees what f32 state would: an
//! infinite second moment stops that one entry (`m / inf = 0`) and no other. A finite
//! value within about 5% of `f32::MAX` in such a block decodes as infinite. A NaN is stored
//! as 0 and never becomes the scale.
//!
//! Traps: a huge but *finite* value (the first moment after a gradient of 1e22, a
//! momentum buffer) is still its block's scale, as in any absmax code; the block's
//! other values fall out of the code's range (six or twelve decades) and become 0
//! (signed) or the smallest code (non-negative) until it decays, so their updates
//! shrink towards 0 for a while where f32 state would step them. They stay finite.
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::number::number_like;

/// How the optimizer stores its state buffers (moments, momentum) between steps.
///
/// The update itself is always computed in f32: a buffer is widened (or decoded) just
/// before a parameter's update and narrowed (or encoded) right after.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// 4 bytes per value; in f32 the update matches tch's own optimizers.
    #[default]
    F32,
    /// 2 bytes per value, rounded to nearest even on every step.
    Bf16,
    /// 1 byte per value plus one f32 scale per `block` values of each buffer: a
    /// logarithmic code relative to the block's largest magnitude, within about 5.6%.
    /// With `block: 256` that is 1.016 bytes per value, 0.254x the f32 state.
    ///
    /// An infinite value (a second moment that overflowed, as it does in f32 state after
    /// a gradient above about 6e20) is kept as infinity and leaves the rest of its block
    /// as it would be without it. A huge *finite* value is its block's scale, and the
    /// block's values more than six (signed) or twelve (non-negative) decades below it
    /// are stored as 0 or rounded up to that floor until it decays: their updates shrink
    /// where f32 state would step them.
    Int8Blockwise {
        /// Number of consecutive values (of the flattened parameter) sharing a scale.
        block: usize,
    },
}

impl State {
    pub(crate) fn validate(self) -> Result<()> {
        match self {
            State::Int8Blockwise { block: 0 } => Err(crate::OptimError::Config(
                "State::Int8Blockwise needs a block of at least 1 value".into(),
            )),
            _ => Ok(()),
        }
    }

    /// How many values of a parameter one update handles at a time, which bounds the
    /// scratch memory of a step (the rule's buffers, conversions to f32) to that of one
    /// chunk. In f32 (buffers updated in place) on the CPU, an eighth of the parameter
    /// (so that the scratch adds at most an eighth of the gradient next to it in a step
    /// fused into backward), at least 2^12 values and at most 2^16; on an accelerator,
    /// where each chunk costs kernel launches, 2^20; in bf16 2^20 values; in 8 bits a
    /// whole number of blocks near 2^20, 8 bytes per value of one chunk per buffer.
    pub(crate) fn chunk_len(self, numel: i64, device: Device) -> i64 {
        const CHUNK: i64 = 1 << 20;
        let numel = numel.max(1);
        match self {
            State::F32 if device == Device::Cpu => {
                // A multiple of 64 values, as the kernels' vectors take them.
                let eighth = (numel + 7) / 8;
                let eighth = (eighth + 63) / 64 * 64;
                eighth.clamp(1 << 12, 1 << 16).min(numel)
            }
            State::F32 => CHUNK.min(numel),
            State::Bf16 => CHUNK,
            State::Int8Blockwise { block } => {
                let block = block as i64;
                (CHUNK / block).max(1) * block
            }
        }
    }
}

/// Whether a state buffer can hold negative values; chooses its 8-bit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sign {
    /// Any sign (a first moment, a momentum buffer).
    Signed,
    /// Never negative (a second moment).
    NonNegative,
}

const SIGNED_TOP: f64 = 127.0;
const SIGNED_DECADES: f64 = 6.0;
const UNSIGNED_TOP: f64 = 255.0;
const UNSIGNED_DECADES: f64 = 12.0;

fn ln_ratio(sign: Sign) -> f64 {
    match sign {
        Sign::Signed => SIGNED_DECADES * std::f64::consts::LN_10 / (SIGNED_TOP - 1.0),
        Sign::NonNegative => UNSIGNED_DECADES * std::f64::consts::LN_10 / (UNSIGNED_TOP - 1.0),
    }
}

/// One state buffer of one parameter, flattened, at its stored precision.
#[derive(Debug)]
pub(crate) enum Buffer {
    /// f32 or bf16 values.
    Plain(Tensor),
    /// 8-bit codes (`Int8` when signed, `Uint8` otherwise) and one f32 absmax per block.
    Quantized {
        codes: Tensor,
        absmax: Tensor,
        block: i64,
        sign: Sign,
    },
}

impl Buffer {
    /// A buffer of `numel` zeros.
    pub(crate) fn zeros(state: State, numel: i64, sign: Sign, device: Device) -> Result<Self> {
        Ok(match state {
            State::F32 => Buffer::Plain(Tensor::f_zeros([numel], (Kind::Float, device))?),
            State::Bf16 => Buffer::Plain(Tensor::f_zeros([numel], (Kind::BFloat16, device))?),
            State::Int8Blockwise { block } => {
                let block = block as i64;
                let blocks = (numel + block - 1) / block;
                Buffer::Quantized {
                    codes: Tensor::f_zeros([numel], (code_kind(sign), device))?,
                    absmax: Tensor::f_zeros([blocks], (Kind::Float, device))?,
                    block,
                    sign,
                }
            }
        })
    }

    /// The tensors that hold the buffer, with the names they are saved under.
    pub(crate) fn parts(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            Buffer::Plain(t) => vec![("values", t)],
            Buffer::Quantized { codes, absmax, .. } => vec![("codes", codes), ("absmax", absmax)],
        }
    }

    /// The expected (name, kind, shape) of each part for a parameter of `numel` values.
    pub(crate) fn layout(
        state: State,
        numel: i64,
        sign: Sign,
    ) -> Vec<(&'static str, Kind, Vec<i64>)> {
        match state {
            State::F32 => vec![("values", Kind::Float, vec![numel])],
            State::Bf16 => vec![("values", Kind::BFloat16, vec![numel])],
            State::Int8Blockwise { block } => {
                let block = block as i64;
                vec![
                    ("codes", code_kind(sign), vec![numel]),
                    ("absmax", Kind::Float, vec![(numel + block - 1) / block]),
                ]
            }
        }
    }

    /// Rebuilds a buffer from parts in the order of [`Buffer::layout`].
    pub(crate) fn from_parts(state: State, sign: Sign, mut parts: Vec<Tensor>) -> Self {
        match state {
            State::F32 | State::Bf16 => Buffer::Plain(parts.remove(0)),
            State::Int8Blockwise { block } => {
                let absmax = parts.remove(1);
                let codes = parts.remove(0);
                Buffer::Quantized {
                    codes,
                    absmax,
                    block: block as i64,
                    sign,
                }
            }
        }
    }

    /// Bytes held by the buffer's tensors.
    pub(crate) fn bytes(&self) -> u64 {
        self.parts()
            .iter()
            .map(|(_, t)| memsave_sys::tensor::nbytes(t))
            .sum()
    }

    /// The buffer moved to `device` (the same tensors when it is already there).
    pub(crate) fn to_device(&self, device: Device) -> Result<Self> {
        Ok(match self {
            Buffer::Plain(t) => Buffer::Plain(t.f_to_device(device)?),
            Buffer::Quantized {
                codes,
                absmax,
                block,
                sign,
            } => Buffer::Quantized {
                codes: codes.f_to_device(device)?,
                absmax: absmax.f_to_device(device)?,
                block: *block,
                sign: *sign,
            },
        })
    }

    /// Values `start..start + len` in f32. For an f32 buffer this is a view: updating it
    /// in place updates the buffer, and [`Buffer::write`] has nothing left to do.
    /// `start` is a multiple of the block for a quantized buffer.
    pub(crate) fn read(&self, start: i64, len: i64) -> Result<Tensor> {
        match self {
            Buffer::Plain(t) if t.kind() == Kind::Float => Ok(t.f_narrow(0, start, len)?),
            Buffer::Plain(t) => Ok(t.f_narrow(0, start, len)?.f_to_kind(Kind::Float)?),
            Buffer::Quantized {
                codes,
                absmax,
                block,
                sign,
            } => {
                let blocks = (len + block - 1) / block;
                let codes = codes.f_narrow(0, start, len)?;
                let scale = absmax.f_narrow(0, start / block, blocks)?;
                let tables = Tables::of(*sign);
                if codes.device() == Device::Cpu {
                    let mut values = Tensor::f_empty([len], (Kind::Float, Device::Cpu))?;
                    memsave_sys::quant::blockwise_decode(
                        &codes,
                        &scale,
                        &tables.table,
                        *block,
                        &mut values,
                    )?;
                    // Blocks holding an infinity are rare: look for them only when one is there.
                    let zero = number_like(0.0, &scale)?;
                    if scale.f_lt_tensor(&zero)?.f_any()?.f_int64_value(&[])? != 0 {
                        values = restore_infinities(&values, &codes, &scale, *block, *sign)?;
                    }
                    return Ok(values);
                }
                decode_ops(&codes, &scale, *block, *sign)
            }
        }
    }

    /// Stores f32 `values` as `start..start + len` of the buffer.
    pub(crate) fn write(&mut self, start: i64, len: i64, values: &Tensor) -> Result<()> {
        match self {
            Buffer::Plain(t) if t.kind() == Kind::Float => Ok(()),
            Buffer::Plain(t) => {
                t.f_narrow(0, start, len)?.f_copy_(values)?;
                Ok(())
            }
            Buffer::Quantized {
                codes,
                absmax,
                block,
                sign,
            } => {
                let blocks = (len + *block - 1) / *block;
                let mut codes = codes.f_narrow(0, start, len)?;
                let mut scale = absmax.f_narrow(0, start / *block, blocks)?;
                let tables = Tables::of(*sign);
                if codes.device() == Device::Cpu {
                    let values = values.f_contiguous()?;
                    let fused = |values: &Tensor, codes: &mut Tensor, scale: &mut Tensor| {
                        memsave_sys::quant::blockwise_encode(
                            values,
                            &tables.thresholds,
                            &tables.buckets,
                            *block,
                            codes,
                            scale,
                        )
                    };
                    fused(&values, &mut codes, &mut scale)?;
                    // An infinite value makes its block's absmax infinite: rare, so the
                    // blocks are encoded again only when one is there.
                    if scale.f_isinf()?.f_any()?.f_int64_value(&[])? != 0 {
                        let (spread, has_inf) = spread_infinities(&values, *block, *sign)?;
                        fused(&spread, &mut codes, &mut scale)?;
                        flag_blocks(&mut scale, &has_inf)?;
                    }
                    return Ok(());
                }
                encode_ops(values, *block, *sign, &mut codes, &mut scale)
            }
        }
    }
}

/// [`Buffer::read`]'s decoding with tensor ops, for devices without the fused kernel:
/// the same bits as the CPU path.
fn decode_ops(codes: &Tensor, scale: &Tensor, block: i64, sign: Sign) -> Result<Tensor> {
    let values = decode_finite_ops(codes, scale, block, Tables::of(sign))?;
    // Branch-free, so that a device needs no synchronisation to look for infinities.
    restore_infinities(&values, codes, scale, block, sign)
}

/// `memsave_sys::quant::blockwise_decode` with tensor ops: `table[code] * scale`.
fn decode_finite_ops(
    codes: &Tensor,
    scale: &Tensor,
    block: i64,
    tables: &Tables,
) -> Result<Tensor> {
    let len = codes.size()[0];
    let blocks = scale.size()[0];
    let table = Tensor::f_from_slice(&tables.table)?.f_to_device(codes.device())?;
    let index = codes.f_to_kind(Kind::Int64)?;
    let index = index.f_add(&number_like(tables.offset as f64, &index)?)?;
    let fractions = pad_to(&table.f_index_select(0, &index)?, blocks * block)?;
    let values = fractions
        .f_view([blocks, block])?
        .f_mul(&scale.f_view([blocks, 1])?)?;
    Ok(values.f_view([-1])?.f_narrow(0, 0, len)?)
}

/// [`Buffer::write`]'s encoding with tensor ops, for devices without the fused kernel:
/// the same bits as the CPU path for values that are not NaN.
fn encode_ops(
    values: &Tensor,
    block: i64,
    sign: Sign,
    codes: &mut Tensor,
    scale: &mut Tensor,
) -> Result<()> {
    // Branch-free, so that a device needs no synchronisation to look for infinities.
    let (spread, has_inf) = spread_infinities(values, block, sign)?;
    encode_finite_ops(&spread, block, sign, codes, scale)?;
    flag_blocks(scale, &has_inf)
}

/// `memsave_sys::quant::blockwise_encode` with tensor ops, for finite values.
fn encode_finite_ops(
    values: &Tensor,
    block: i64,
    sign: Sign,
    codes: &mut Tensor,
    scale: &mut Tensor,
) -> Result<()> {
    let len = codes.size()[0];
    let blocks = scale.size()[0];
    let x = pad_to(values, blocks * block)?.f_view([blocks, block])?;
    let amax = x.f_abs()?.f_amax([1i64].as_slice(), true)?;
    let smallest = number_like(f64::from(f32::MIN_POSITIVE), &amax)?;
    let q = x.f_div(&amax.f_clamp_min_tensor(&smallest)?)?;
    let thresholds =
        Tensor::f_from_slice(&Tables::of(sign).thresholds)?.f_to_device(codes.device())?;
    // bucketize(right) counts the thresholds <= |q|, thresholds[0] = -inf included.
    let top = match sign {
        Sign::Signed => SIGNED_TOP,
        Sign::NonNegative => UNSIGNED_TOP,
    };
    let k = Tensor::f_bucketize(&q.f_abs()?, &thresholds, false, true)?;
    let k = k
        .f_sub(&number_like(1.0, &k)?)?
        .f_clamp_max_tensor(&number_like(top, &k)?)?;
    let code = match sign {
        Sign::Signed => k.f_mul(&q.f_sign()?.f_to_kind(Kind::Int64)?)?,
        Sign::NonNegative => k,
    };
    codes.f_copy_(
        &code
            .f_to_kind(code_kind(sign))?
            .f_view([-1])?
            .f_narrow(0, 0, len)?,
    )?;
    scale.f_copy_(&amax.f_view([-1])?)?;
    Ok(())
}

/// The largest magnitude code of `sign`'s code.
fn top_code(sign: Sign) -> f64 {
    match sign {
        Sign::Signed => SIGNED_TOP,
        Sign::NonNegative => UNSIGNED_TOP,
    }
}

/// For blocks of `values` holding an infinity: `values` with each infinity replaced by
/// the block's *infinity scale* (its largest finite magnitude times one code step,
/// kept within `f32::MIN_POSITIVE..=f32::MAX`), with the infinity's sign. Encoded
/// as usual, that scale becomes the block's absmax, the infinities get the top code and
/// every finite value a lower one. Also returns which blocks hold an infinity
/// (`[blocks, 1]` booleans). Blocks without one are returned unchanged, bit for bit.
fn spread_infinities(values: &Tensor, block: i64, sign: Sign) -> Result<(Tensor, Tensor)> {
    let len = values.size()[0];
    let blocks = (len + block - 1) / block;
    let x = pad_to(values, blocks * block)?.f_view([blocks, block])?;
    let inf = x.f_isinf()?;
    let has_inf = inf.f_any_dim(1, true)?;
    let abs = x.f_abs()?;
    let finite_abs =
        abs.f_masked_fill_tensor(&x.f_isfinite()?.f_logical_not()?, &number_like(0.0, &abs)?)?;
    let step = ln_ratio(sign).exp() as f32;
    let largest = finite_abs.f_amax([1i64].as_slice(), true)?;
    let (step, lowest, highest) = (
        number_like(f64::from(step), &largest)?,
        number_like(f64::from(f32::MIN_POSITIVE), &largest)?,
        number_like(f64::from(f32::MAX), &largest)?,
    );
    let infinity_scale = largest
        .f_mul(&step)?
        .f_clamp_tensor(Some(&lowest), Some(&highest))?;
    let spread = x.f_where_self(&inf.f_logical_not()?, &x.f_sign()?.f_mul(&infinity_scale)?)?;
    Ok((
        spread.f_view([-1])?.f_narrow(0, 0, len)?.f_contiguous()?,
        has_inf,
    ))
}

/// Marks the blocks that held an infinity (`has_inf`, from [`spread_infinities`]) by
/// negating their absmax, which is positive: see [`restore_infinities`].
fn flag_blocks(scale: &mut Tensor, has_inf: &Tensor) -> Result<()> {
    let has_inf = has_inf.f_view([-1])?;
    let flagged = scale.f_where_self(&has_inf.f_logical_not()?, &scale.f_neg()?)?;
    scale.f_copy_(&flagged)?;
    Ok(())
}

/// Undoes [`flag_blocks`] on decoded `values`: in a block with a negative absmax, every
/// value is negated back (the decoder multiplied by the negative scale; negation is
/// exact), and the top code stands for an infinity of its sign.
fn restore_infinities(
    values: &Tensor,
    codes: &Tensor,
    scale: &Tensor,
    block: i64,
    sign: Sign,
) -> Result<Tensor> {
    let len = values.size()[0];
    let blocks = scale.size()[0];
    let flagged = scale
        .f_lt_tensor(&number_like(0.0, scale)?)?
        .f_view([blocks, 1])?
        .f_expand([blocks, block], false)?
        .f_reshape([-1])?
        .f_narrow(0, 0, len)?;
    let values = values.f_where_self(&flagged.f_logical_not()?, &values.f_neg()?)?;
    let codes = codes.f_to_kind(Kind::Int16)?;
    let top = codes
        .f_abs()?
        .f_eq_tensor(&number_like(top_code(sign), &codes)?)?;
    let infinite = flagged.f_logical_and(&top)?;
    let signs = codes.f_sign()?.f_to_kind(Kind::Float)?;
    let infinities = signs.f_mul(&number_like(f64::INFINITY, &signs)?)?;
    Ok(values.f_where_self(&infinite.f_logical_not()?, &infinities)?)
}

/// The two tables that define a sign's 8-bit code (see the module documentation):
/// what each code decodes to, as a fraction of the block's absmax, and the smallest
/// magnitude each magnitude code stands for.
pub(crate) struct Tables {
    /// `table[code + offset]`: the fraction code `code` decodes to.
    pub(crate) table: [f32; 256],
    /// `thresholds[k]`: the smallest fraction stored as magnitude `k`; `-inf` at 0,
    /// `+inf` past the last code.
    pub(crate) thresholds: [f32; 256],
    /// 128 for signed (int8) codes, 0 for unsigned ones.
    pub(crate) offset: i64,
    /// The fused encoder's lookup of a magnitude's code by its top bits.
    pub(crate) buckets: [u8; 4096],
}

impl Tables {
    /// The tables of `sign`'s code, computed once in f64 and rounded to f32.
    pub(crate) fn of(sign: Sign) -> &'static Tables {
        static SIGNED: OnceLock<Tables> = OnceLock::new();
        static NON_NEGATIVE: OnceLock<Tables> = OnceLock::new();
        match sign {
            Sign::Signed => SIGNED.get_or_init(|| Tables::new(sign)),
            Sign::NonNegative => NON_NEGATIVE.get_or_init(|| Tables::new(sign)),
        }
    }

    fn new(sign: Sign) -> Tables {
        let ln_r = ln_ratio(sign);
        let (top, offset) = match sign {
            Sign::Signed => (SIGNED_TOP as i64, 128),
            Sign::NonNegative => (UNSIGNED_TOP as i64, 0),
        };
        // Magnitude code k (1..=top) stands for ratio^(k - top) of the absmax.
        let magnitude = |k: i64| ((k - top) as f64 * ln_r).exp();
        let mut table = [0f32; 256];
        for code in -top..=top {
            let index = code + offset;
            if code == 0 || !(0..256).contains(&index) {
                continue;
            }
            table[index as usize] = (code.signum() as f64 * magnitude(code.abs())) as f32;
        }
        let mut thresholds = [f32::INFINITY; 256];
        thresholds[0] = f32::NEG_INFINITY;
        for k in 1..=top {
            // Half a step below the code in log space: rounding to the nearest code.
            thresholds[k as usize] = ((k as f64 - 0.5 - top as f64) * ln_r).exp() as f32;
        }
        if sign == Sign::NonNegative {
            // Never 0 unless exactly 0: the smallest positive f32 already gets code 1.
            thresholds[1] = f32::from_bits(1);
        }
        Tables {
            table,
            buckets: memsave_sys::quant::buckets_for(&thresholds),
            thresholds,
            offset,
        }
    }
}

fn code_kind(sign: Sign) -> Kind {
    match sign {
        Sign::Signed => Kind::Int8,
        Sign::NonNegative => Kind::Uint8,
    }
}

/// `t` (1-D) followed by zeros up to `len` values.
fn pad_to(t: &Tensor, len: i64) -> Result<Tensor> {
    let have = t.size()[0];
    if have == len {
        return Ok(t.shallow_clone());
    }
    Ok(t.f_constant_pad_nd([0, len - have].as_slice())?)
}

/// What the optimizer remembers of one parameter.
#[derive(Debug, Default)]
pub(crate) struct ParamState {
    /// Number of updates so far.
    pub(crate) step: u64,
    /// The buffers in the rule's order; empty before the first step, and between steps
    /// when they are kept on disk.
    pub(crate) buffers: Vec<Buffer>,
    /// With the state on disk (`Placement::Disk`), the CRC-32 of the file as last
    /// written, checked when it is read back.
    pub(crate) disk_crc: Option<u32>,
}

/// What the state buffers of one parameter look like.
pub(crate) struct BufferLayout {
    pub(crate) state: State,
    pub(crate) numel: i64,
    pub(crate) signs: &'static [(&'static str, Sign)],
    pub(crate) device: tch::Device,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode_fused(values: &Tensor, block: i64, sign: Sign) -> (Tensor, Tensor) {
        let n = values.size()[0];
        let mut codes = Tensor::zeros([n], (code_kind(sign), Device::Cpu));
        let mut scale = Tensor::zeros([(n + block - 1) / block], (Kind::Float, Device::Cpu));
        memsave_sys::quant::blockwise_encode(
            values,
            &Tables::of(sign).thresholds,
            &Tables::of(sign).buckets,
            block,
            &mut codes,
            &mut scale,
        )
        .unwrap();
        (codes, scale)
    }

    fn encode_with_ops(values: &Tensor, block: i64, sign: Sign) -> (Tensor, Tensor) {
        let n = values.size()[0];
        let mut codes = Tensor::zeros([n], (code_kind(sign), Device::Cpu));
        let mut scale = Tensor::zeros([(n + block - 1) / block], (Kind::Float, Device::Cpu));
        encode_ops(values, block, sign, &mut codes, &mut scale).unwrap();
        (codes, scale)
    }

    fn bits(t: &Tensor) -> Vec<u8> {
        let mut out = vec![0u8; memsave_sys::tensor::nbytes(t) as usize];
        t.copy_data_u8(&mut out, t.numel());
        out
    }

    #[test]
    fn the_fused_cpu_code_and_the_tensor_op_code_agree_bit_for_bit() {
        for (n, block) in [(1, 1), (5, 2), (1000, 256), (4099, 64), (300, 7)] {
            for sign in [Sign::Signed, Sign::NonNegative] {
                // Values over many decades, some exact zeros, a block of zeros.
                let idx = Tensor::arange(n, (Kind::Float, Device::Cpu));
                let mut values = (idx.shallow_clone() * 0.731).sin()
                    * ((idx.shallow_clone() * 0.05).fmod(40.0) - 20.0).exp();
                if sign == Sign::NonNegative {
                    values = values.abs();
                }
                let values = values * idx.fmod(11).ne(0).to_kind(Kind::Float);
                let (fused_codes, fused_scale) = encode_fused(&values, block, sign);
                let (ops_codes, ops_scale) = encode_with_ops(&values, block, sign);
                assert_eq!(bits(&fused_codes), bits(&ops_codes), "codes n={n} {sign:?}");
                assert_eq!(bits(&fused_scale), bits(&ops_scale), "scale n={n} {sign:?}");

                let mut fused = Tensor::zeros([n], (Kind::Float, Device::Cpu));
                let tables = Tables::of(sign);
                memsave_sys::quant::blockwise_decode(
                    &fused_codes,
                    &fused_scale,
                    &tables.table,
                    block,
                    &mut fused,
                )
                .unwrap();
                let ops = decode_ops(&ops_codes, &ops_scale, block, sign).unwrap();
                assert_eq!(bits(&fused), bits(&ops), "decoded n={n} {sign:?}");
            }
        }
    }

    #[test]
    fn decoded_values_are_within_six_percent_and_block_maxima_are_exact() {
        let block = 64;
        let n = 640;
        let idx = Tensor::arange(n, (Kind::Float, Device::Cpu));
        // Magnitudes within four decades of each block's largest: inside both codes' range.
        let values = (idx.shallow_clone() * 1.3).sin().sign()
            * (idx.shallow_clone() * 0.37).sin().abs().clamp_min(1e-4);
        for sign in [Sign::Signed, Sign::NonNegative] {
            let values = match sign {
                Sign::Signed => values.shallow_clone(),
                Sign::NonNegative => values.abs(),
            };
            let (codes, scale) = encode_fused(&values, block, sign);
            let mut decoded = Tensor::zeros([n], (Kind::Float, Device::Cpu));
            memsave_sys::quant::blockwise_decode(
                &codes,
                &scale,
                &Tables::of(sign).table,
                block,
                &mut decoded,
            )
            .unwrap();
            let original = Vec::<f32>::try_from(&values).unwrap();
            let back = Vec::<f32>::try_from(&decoded).unwrap();
            for (chunk_o, chunk_b) in original
                .chunks(block as usize)
                .zip(back.chunks(block as usize))
            {
                let max = chunk_o.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (o, b) in chunk_o.iter().zip(chunk_b) {
                    if *o == 0.0 {
                        assert_eq!(*b, 0.0, "{sign:?}: 0 stays 0");
                        continue;
                    }
                    let rel = ((o - b) / o).abs();
                    assert!(rel <= 0.058, "{sign:?}: {o} decoded as {b} ({rel})");
                    assert_eq!(o.signum(), b.signum(), "{sign:?}: sign of {o}");
                    if o.abs() == max {
                        assert_eq!(b.abs(), max, "{sign:?}: the block's largest is exact");
                    }
                }
            }
        }
    }

    /// `values` written to and read back from an 8-bit buffer of `block`, with the
    /// fused CPU code and with the tensor-op code; both must give the same bits.
    fn round_trip(values: &[f32], block: usize, sign: Sign) -> (Vec<f32>, Vec<f32>) {
        let n = values.len() as i64;
        let t = Tensor::from_slice(values);
        let mut buffer =
            Buffer::zeros(State::Int8Blockwise { block }, n, sign, Device::Cpu).unwrap();
        buffer.write(0, n, &t).unwrap();
        let back = Vec::<f32>::try_from(&buffer.read(0, n).unwrap()).unwrap();
        let Buffer::Quantized { codes, absmax, .. } = &buffer else {
            unreachable!("an 8-bit buffer")
        };
        let scales = Vec::<f32>::try_from(absmax).unwrap();
        let mut ops_codes = codes.zeros_like();
        let mut ops_scale = absmax.zeros_like();
        encode_ops(&t, block as i64, sign, &mut ops_codes, &mut ops_scale).unwrap();
        assert_eq!(bits(codes), bits(&ops_codes), "codes, fused vs ops");
        assert_eq!(bits(absmax), bits(&ops_scale), "scales, fused vs ops");
        let ops = decode_ops(&ops_codes, &ops_scale, block as i64, sign).unwrap();
        assert_eq!(
            bits(&buffer.read(0, n).unwrap()),
            bits(&ops),
            "decoded, fused vs ops"
        );
        (back, scales)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        /// Infinite entries (a second moment that overflowed f32) decode as themselves,
        /// every block scale stays finite, and the finite entries of the same block
        /// decode as if the infinities were not there: within 5.8%, or 0 below the
        /// code's range, never NaN.
        #[test]
        fn infinite_entries_do_not_spoil_their_block(
            raw in proptest::collection::vec(-4.0f32..4.0, 1..700),
            block in proptest::sample::select(vec![1usize, 3, 64, 100, 256]),
            infs in proptest::collection::vec((0.0f64..1.0, proptest::bool::ANY), 1..4),
            non_negative in proptest::bool::ANY,
        ) {
            let sign = if non_negative { Sign::NonNegative } else { Sign::Signed };
            // Magnitudes over four decades below 1, inside both codes' range.
            let mut values: Vec<f32> = raw
                .iter()
                .map(|x| {
                    let m = 10f32.powf(-x.abs());
                    if non_negative || *x >= 0.0 { m } else { -m }
                })
                .collect();
            let n = values.len();
            for (at, negative) in &infs {
                let i = ((n as f64 * at) as usize).min(n - 1);
                values[i] = if *negative && !non_negative {
                    f32::NEG_INFINITY
                } else {
                    f32::INFINITY
                };
            }
            let (back, scales) = round_trip(&values, block, sign);
            proptest::prop_assert!(
                scales.iter().all(|s| s.is_finite()),
                "a block scale is not finite: {scales:?}"
            );
            for (i, (v, b)) in values.iter().zip(&back).enumerate() {
                if v.is_infinite() {
                    proptest::prop_assert_eq!(*b, *v, "entry {} (infinite)", i);
                    continue;
                }
                let rel = ((v - b) / v).abs();
                proptest::prop_assert!(
                    rel <= 0.058,
                    "entry {}: {} decoded as {} (block {})", i, v, b, block
                );
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors_not_crashes() {
        let values = Tensor::zeros([10], (Kind::Float, Device::Cpu));
        let mut codes = Tensor::zeros([10], (Kind::Int8, Device::Cpu));
        let mut wrong_scale = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let thresholds = &Tables::of(Sign::Signed).thresholds;
        let buckets = &Tables::of(Sign::Signed).buckets;
        let e = memsave_sys::quant::blockwise_encode(
            &values,
            thresholds,
            buckets,
            4,
            &mut codes,
            &mut wrong_scale,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("absmax must hold 3 block scales"),
            "{e}"
        );
        let e = memsave_sys::quant::blockwise_encode(
            &values,
            thresholds,
            buckets,
            0,
            &mut codes,
            &mut wrong_scale,
        )
        .unwrap_err();
        assert!(e.to_string().contains("at least one value"), "{e}");
    }
}
