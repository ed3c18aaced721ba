// The libtorch version the bridge was compiled against, from libtorch's own header.
#include <torch/version.h>

extern "C" {

// A static string literal: valid for the whole program, never freed, cannot throw.
const char* ms_libtorch_version() noexcept { return TORCH_VERSION; }

}  // extern "C"
