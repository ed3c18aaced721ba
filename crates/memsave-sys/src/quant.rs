//! Blockwise 8-bit codes on the CPU, fused: one pass to decode a buffer to f32 and one
//! to encode it back, for memsave-optim's `Int8Blockwise` state.
//!
//! The code is defined by the caller's two tables of 256 entries, so that a tensor-op
//! version on another device gives the same bits:
//! - `table[i]`: the fraction of the block's absmax that code `i` stands for, where
//!   `i` is the code itself for `uint8` codes and the code plus 128 for `int8` codes;
//! - `thresholds[k]`: the smallest magnitude (fraction of the absmax) stored as
//!   magnitude code `k`, non-decreasing, with `thresholds[0] = -inf` and `+inf` past
//!   the last code. A value's magnitude code is the largest `k` with
//!   `thresholds[k] <= |value / max(absmax, f32::MIN_POSITIVE)|`; an `int8` code carries
//!   the value's sign;
//! - `buckets[b]` (4096 entries, for encoding): that largest `k` for the smallest
//!   non-negative f32 whose top 12 bits are `b` (sixteen buckets per power of two). It
//!   makes encoding two lookups instead of a search, and needs consecutive thresholds
//!   to be more than a sixteenth of a power of two apart (about 4.4%); [`buckets_for`]
//!   computes it.
//!
//! For finite values the results equal those of the same definition written with
//! libtorch ops (`amax`, `div`, `bucketize(right=true)`, `index_select`). A NaN value
//! gets code 0 and does not become its block's absmax.
use crate::error::check;
use crate::ffi;
use tch::Tensor;

/// `values = table[codes] * absmax[block of each value]`; every tensor 1-D,
/// contiguous and on the CPU, `values` f32 with as many elements as `codes`.
pub fn blockwise_decode(
    codes: &Tensor,
    absmax: &Tensor,
    table: &[f32; 256],
    block: i64,
    values: &mut Tensor,
) -> crate::Result<()> {
    // SAFETY: the tensors are live tch tensors (valid at::Tensor pointers), `table`
    // holds the 256 floats the C++ side reads, and the C++ side checks shapes, kinds,
    // devices and contiguity before touching any data.
    check(unsafe {
        ffi::ms_blockwise_decode(
            codes.as_ptr().cast(),
            absmax.as_ptr().cast(),
            table.as_ptr(),
            block,
            values.as_mut_ptr().cast(),
        )
    })
}

/// Encodes f32 `values` into `codes` (`int8`: signed, `uint8`: magnitudes only) and
/// one absmax per `block` values into `absmax`, writing through both (they may be
/// narrowed views of larger buffers); every tensor 1-D, contiguous and on the CPU.
pub fn blockwise_encode(
    values: &Tensor,
    thresholds: &[f32; 256],
    buckets: &[u8; 4096],
    block: i64,
    codes: &mut Tensor,
    absmax: &mut Tensor,
) -> crate::Result<()> {
    // SAFETY: as in `blockwise_decode`; `thresholds` and `buckets` hold the 256 floats
    // and 4096 codes read (every index is in range: a code is at most 255, a bucket a
    // float's top 12 bits), and the
    // writes go through the checked, contiguous `codes` and `absmax`.
    check(unsafe {
        ffi::ms_blockwise_encode(
            values.as_ptr().cast(),
            thresholds.as_ptr(),
            buckets.as_ptr(),
            block,
            codes.as_mut_ptr().cast(),
            absmax.as_mut_ptr().cast(),
        )
    })
}

/// The `buckets` table of `thresholds` (see the module documentation).
///
/// # Panics
/// When two consecutive finite thresholds from the smallest normal f32 up are less
/// than 17/16 apart: one bucket could then hold two of them.
pub fn buckets_for(thresholds: &[f32; 256]) -> [u8; 4096] {
    for pair in thresholds.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.is_finite() && b.is_finite() && a >= f32::MIN_POSITIVE {
            assert!(
                // A bucket [lo, hi) has hi <= lo * 17/16, so b >= a * 17/16 is outside a's.
                f64::from(b) >= f64::from(a) * (17.0 / 16.0),
                "thresholds {a} and {b} are too close for the bucket table"
            );
        }
    }
    let mut buckets = [0u8; 4096];
    for (b, slot) in buckets.iter_mut().enumerate() {
        let smallest = f32::from_bits((b as u32) << 19);
        // Infinity and NaN buckets: NaN compares false everywhere, so code 0.
        let k = if smallest.is_nan() {
            0
        } else {
            thresholds
                .iter()
                .rposition(|t| t.is_finite() && *t <= smallest)
                .unwrap_or(0)
        };
        *slot = k as u8;
    }
    buckets
}
