// Accelerator memory statistics through libtorch's device-generic API, so CUDA works
// without CUDA headers at build time.
#include "common.h"

#include <ATen/DeviceAccelerator.h>

namespace {

c10::DeviceType require_accelerator(int device_type) {
  auto acc = at::accelerator::getAccelerator(false);
  TORCH_CHECK(acc.has_value(), "no accelerator is available in this build of libtorch or on this machine");
  TORCH_CHECK(static_cast<int>(*acc) == device_type, "the available accelerator is ", c10::DeviceTypeName(*acc),
              ", not ", c10::DeviceTypeName(static_cast<c10::DeviceType>(device_type)));
  return *acc;
}

void check_index(int64_t index) {
  const auto count = at::accelerator::deviceCount();
  TORCH_CHECK(index >= 0 && index < count, "device index ", index, " is out of range: ", count,
              " device(s) available");
}

}  // namespace

extern "C" {

// -1 when no accelerator is available, else the c10::DeviceType of it.
int ms_accelerator_type() noexcept {
  try {
    auto acc = at::accelerator::getAccelerator(false);
    if (!acc.has_value() || at::accelerator::deviceCount() == 0) return -1;
    return static_cast<int>(*acc);
  } catch (...) {
    return -1;
  }
}

// Aggregate statistics: current and peak allocated bytes, live allocations, reserved bytes.
int ms_device_stats(int device_type, int64_t index, int64_t* allocated, int64_t* peak, int64_t* live_allocations,
                    int64_t* reserved) {
  MS_TRY({
    require_accelerator(device_type);
    check_index(index);
    const auto stats = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    constexpr auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[agg].current;
    *peak = stats.allocated_bytes[agg].peak;
    *live_allocations = stats.allocation[agg].current;
    *reserved = stats.reserved_bytes[agg].current;
  })
}

int ms_device_reset_peak(int device_type, int64_t index) {
  MS_TRY({
    require_accelerator(device_type);
    check_index(index);
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
  })
}

int ms_device_empty_cache(int device_type) {
  MS_TRY({
    require_accelerator(device_type);
    at::accelerator::emptyCache();
  })
}

int ms_device_synchronize(int device_type, int64_t index) {
  MS_TRY({
    require_accelerator(device_type);
    check_index(index);
    at::accelerator::synchronizeDevice(static_cast<c10::DeviceIndex>(index));
  })
}

}  // extern "C"
