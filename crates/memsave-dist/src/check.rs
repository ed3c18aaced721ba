//! The one-time check that every rank holds parameters of the same shapes.
use tch::{Device, Kind, Tensor};

use crate::error::{DistError, Result};
use crate::group::ProcessGroup;

/// FNV-1a over the shapes, so that ranks can compare them with one small all-gather.
fn fingerprint(params: &[Tensor]) -> [i64; 3] {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut numel: i64 = 0;
    for p in params {
        let size = p.size();
        for d in std::iter::once(size.len() as i64).chain(size.iter().copied()) {
            for byte in d.to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        numel += p.numel() as i64;
    }
    [params.len() as i64, numel, hash as i64]
}

/// Errs on every rank when some rank's parameters differ in number or shape from this
/// rank's, naming the first rank that differs.
pub(crate) fn same_shapes_everywhere(group: &ProcessGroup, params: &[Tensor]) -> Result<()> {
    let rank = group.rank();
    let mine = fingerprint(params);
    let n = group.world_size();
    let tensor_err = |context| {
        move |source| DistError::Tensor {
            rank,
            context,
            source,
        }
    };
    let local = Tensor::f_from_slice(&mine).map_err(tensor_err("shape check"))?;
    let all = Tensor::f_zeros([3 * n as i64], (Kind::Int64, Device::Cpu))
        .map_err(tensor_err("shape check"))?;
    group.all_gather(&all, &local)?;
    let all = Vec::<i64>::try_from(&all).map_err(tensor_err("shape check"))?;
    for (other, theirs) in all.chunks(3).enumerate() {
        if theirs != mine {
            return Err(DistError::Mismatch {
                rank,
                other,
                what: "parameter shapes",
                detail: format!(
                    "{} tensors of {} values here, {} tensors of {} values there{}",
                    mine[0],
                    mine[1],
                    theirs[0],
                    theirs[1],
                    if theirs[..2] == mine[..2] {
                        " (same totals, different shapes)"
                    } else {
                        ""
                    }
                ),
            });
        }
    }
    Ok(())
}
