#include "common.h"

namespace {
thread_local std::string last_error;
}

namespace memsave {
void set_last_error(std::string message) { last_error = std::move(message); }
}  // namespace memsave

extern "C" const char* ms_last_error() { return last_error.c_str(); }
