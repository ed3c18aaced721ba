// Blockwise 8-bit codes for optimizer state, on the CPU in one pass each way: the
// tensor-op version of the same code (memsave-optim's, for other devices) takes several
// passes and as many temporaries. The code itself is defined by two tables the caller
// passes, `table` (code -> fraction of the block's absmax) and `thresholds` (the
// smallest magnitude of each code), so both versions agree bit for bit.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// A signed (int8) code is looked up at index code + 128, an unsigned one at code.
constexpr int64_t kSignedOffset = 128;
// Blocks per parallel task: enough work to amortize a task.
constexpr int64_t kGrainBlocks = 16;

void check_args(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& values,
                int64_t block) {
  MS_CHECK(block > 0, "the block must hold at least one value, got ", block);
  MS_CHECK(codes.device().is_cpu() && absmax.device().is_cpu() && values.device().is_cpu(),
           "the fused blockwise codes run on the CPU; use the tensor version on ",
           values.device());
  MS_CHECK(codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte,
           "codes must be int8 or uint8, got ", codes.scalar_type());
  MS_CHECK(absmax.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
           "absmax and values must be f32, got ", absmax.scalar_type(), " and ",
           values.scalar_type());
  MS_CHECK(codes.is_contiguous() && absmax.is_contiguous() && values.is_contiguous(),
           "blockwise codes need contiguous tensors");
  MS_CHECK(codes.dim() == 1 && values.dim() == 1 && codes.numel() == values.numel(),
           "codes and values must be 1-D of the same length, got ", codes.sizes(), " and ",
           values.sizes());
  const int64_t blocks = (codes.numel() + block - 1) / block;
  MS_CHECK(absmax.dim() == 1 && absmax.numel() == blocks, "absmax must hold ", blocks,
           " block scales, got ", absmax.sizes());
}

// Sixteen buckets per power of two: a non-negative float's top 12 bits (exponent and
// 4 mantissa bits) name its bucket.
constexpr int kBucketShift = 19;

// The largest k in 0..255 with thresholds[k] <= m (m >= 0): `buckets[b]` is that k for
// the smallest float of bucket b, and a bucket is narrower than the gap between two
// thresholds, so at most one more threshold lies inside it.
inline int64_t code_of(const float* thresholds, const uint8_t* buckets, float m) {
  uint32_t bits;
  std::memcpy(&bits, &m, sizeof bits);
  const int64_t k = buckets[bits >> kBucketShift];
  return k < 255 && thresholds[k + 1] <= m ? k + 1 : k;
}

}  // namespace

extern "C" {

// values[i] = table[code(i)] * absmax[i / block], with code(i) read as signed or not.
int ms_blockwise_decode(const at::Tensor* codes, const at::Tensor* absmax, const float* table,
                        int64_t block, at::Tensor* values) {
  MS_TRY({
    check_args(*codes, *absmax, *values, block);
    const int64_t n = codes->numel();
    const int64_t blocks = absmax->numel();
    const bool is_signed = codes->scalar_type() == at::kChar;
    const uint8_t* raw = static_cast<const uint8_t*>(codes->data_ptr());
    const float* scale = absmax->data_ptr<float>();
    float* out = values->data_ptr<float>();
    at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t begin = b * block;
        const int64_t end = std::min(n, begin + block);
        const float s = scale[b];
        if (is_signed) {
          for (int64_t i = begin; i < end; ++i) {
            out[i] = table[static_cast<int8_t>(raw[i]) + kSignedOffset] * s;
          }
        } else {
          for (int64_t i = begin; i < end; ++i) {
            out[i] = table[raw[i]] * s;
          }
        }
      }
    });
  })
}

// Per block: absmax[b] = max |values|; each value divided by max(absmax[b], FLT_MIN)
// gets the magnitude code of its quotient (code_of over `thresholds`, 256 floats, and
// `buckets`, 4096 codes) and, for signed codes, the quotient's sign.
int ms_blockwise_encode(const at::Tensor* values, const float* thresholds,
                        const uint8_t* buckets, int64_t block, at::Tensor* codes,
                        at::Tensor* absmax) {
  MS_TRY({
    check_args(*codes, *absmax, *values, block);
    const int64_t n = values->numel();
    const int64_t blocks = absmax->numel();
    const bool is_signed = codes->scalar_type() == at::kChar;
    const int64_t top = is_signed ? 127 : 255;
    const float* in = values->data_ptr<float>();
    uint8_t* raw = static_cast<uint8_t*>(codes->data_ptr());
    float* scale = absmax->data_ptr<float>();
    at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t begin = b * block;
        const int64_t end = std::min(n, begin + block);
        float amax = 0.0f;
        for (int64_t i = begin; i < end; ++i) {
          // std::max keeps the first argument on NaN: a NaN value does not become the
          // scale (its own code is 0).
          amax = std::max(amax, std::fabs(in[i]));
        }
        scale[b] = amax;
        const float divisor = std::max(amax, std::numeric_limits<float>::min());
        for (int64_t i = begin; i < end; ++i) {
          const float q = in[i] / divisor;
          const int64_t k = std::min(top, code_of(thresholds, buckets, std::fabs(q)));
          if (is_signed) {
            raw[i] = static_cast<uint8_t>(static_cast<int8_t>(q < 0.0f ? -k : k));
          } else {
            raw[i] = static_cast<uint8_t>(k);
          }
        }
      }
    });
  })
}

}  // extern "C"
