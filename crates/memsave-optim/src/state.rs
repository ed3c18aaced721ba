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
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::Result;

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
    /// 1 byte per value plus one f32 scale per `block` values of each buffer (see the
    /// module documentation for the code). With `block: 256` that is 1.016 bytes per
    /// value, 0.254x the f32 state.
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

    /// How many values of a parameter one update handles at a time: all of them in f32
    /// (the buffers are updated in place), else a whole number of blocks, which bounds
    /// the f32 scratch memory of a step to 8 bytes per value of one chunk per buffer.
    pub(crate) fn chunk_len(self, numel: i64) -> i64 {
        const CHUNK: i64 = 1 << 20;
        match self {
            State::F32 => numel.max(1),
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
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
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
                let scale = absmax
                    .f_narrow(0, start / block, blocks)?
                    .f_view([blocks, 1])?;
                let k = pad_to(
                    &codes.f_narrow(0, start, len)?.f_to_kind(Kind::Float)?,
                    blocks * block,
                )?;
                let top = match sign {
                    Sign::Signed => SIGNED_TOP,
                    Sign::NonNegative => UNSIGNED_TOP,
                };
                // sign(k) is 0 for the code 0, and the sign of the value otherwise.
                let magnitude = (k
                    .f_abs()?
                    .f_sub_scalar(top)?
                    .f_mul_scalar(ln_ratio(*sign))?)
                .f_exp()?;
                let values = magnitude
                    .f_mul(&k.f_sign()?)?
                    .f_view([blocks, *block])?
                    .f_mul(&scale)?;
                Ok(values.f_view([-1])?.f_narrow(0, 0, len)?)
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
                let x = pad_to(values, blocks * *block)?.f_view([blocks, *block])?;
                let scale = x.f_abs()?.f_amax([1i64].as_slice(), true)?;
                let scaled = x.f_div(&scale.f_clamp_min(f64::from(f32::MIN_POSITIVE))?)?;
                let magnitude = scaled.f_abs()?;
                let ln_r = ln_ratio(*sign);
                let (top, kind) = match sign {
                    Sign::Signed => (SIGNED_TOP, Kind::Int8),
                    Sign::NonNegative => (UNSIGNED_TOP, Kind::Uint8),
                };
                let k = magnitude
                    .f_log()?
                    .f_mul_scalar(1.0 / ln_r)?
                    .f_add_scalar(top)?
                    .f_round()?
                    .f_clamp(1.0, top)?;
                let keep = match sign {
                    // Below half a step under the smallest code: 0.
                    Sign::Signed => magnitude.f_ge((-(top - 0.5) * ln_r).exp())?,
                    // Never 0 unless exactly 0.
                    Sign::NonNegative => magnitude.f_gt(0.0)?,
                };
                let code = k
                    .f_mul(&keep.f_to_kind(Kind::Float)?)?
                    .f_mul(&scaled.f_sign()?)?
                    .f_to_kind(kind)?;
                codes
                    .f_narrow(0, start, len)?
                    .f_copy_(&code.f_view([-1])?.f_narrow(0, 0, len)?)?;
                absmax
                    .f_narrow(0, start / *block, blocks)?
                    .f_copy_(&scale.f_view([-1])?)?;
                Ok(())
            }
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
