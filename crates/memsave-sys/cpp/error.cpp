#include "common.h"

namespace {
thread_local std::string last_error;
}

namespace memsave {
void set_last_error(std::string message) noexcept {
  try {
    // One line a person can act on: libtorch appends a backtrace after the message.
    const auto cut = message.find("\nException raised from");
    if (cut != std::string::npos) message.resize(cut);
    last_error = std::move(message);
  } catch (...) {
    // Out of memory while recording the message: keep the previous text rather than throw.
  }
}
}  // namespace memsave

extern "C" const char* ms_last_error() noexcept { return last_error.c_str(); }
