// Device-generic autocast state (tch only toggles the CUDA flag).
#include "common.h"

#include <ATen/autocast_mode.h>

extern "C" {

int ms_autocast_is_enabled(int device_type, bool* out) {
  MS_TRY({ *out = at::autocast::is_autocast_enabled(static_cast<c10::DeviceType>(device_type)); })
}

int ms_autocast_set_enabled(int device_type, bool enabled) {
  MS_TRY({ at::autocast::set_autocast_enabled(static_cast<c10::DeviceType>(device_type), enabled); })
}

int ms_autocast_get_dtype(int device_type, int* out) {
  MS_TRY({
    *out = static_cast<int>(at::autocast::get_autocast_dtype(static_cast<c10::DeviceType>(device_type)));
  })
}

int ms_autocast_set_dtype(int device_type, int scalar_type) {
  MS_TRY({
    at::autocast::set_autocast_dtype(static_cast<c10::DeviceType>(device_type),
                                     static_cast<c10::ScalarType>(scalar_type));
  })
}

int ms_autocast_increment_nesting(int64_t* out) {
  MS_TRY({ *out = at::autocast::increment_nesting(); })
}

int ms_autocast_decrement_nesting(int64_t* out) {
  MS_TRY({ *out = at::autocast::decrement_nesting(); })
}

int ms_autocast_clear_cache() {
  MS_TRY({ at::autocast::clear_cache(); })
}

}  // extern "C"
