// Shared conventions of the memsave C++ bridge.
//
// Every exported function is `extern "C"`, catches every C++ exception and reports
// failure through its return value; the message is kept per thread and read with
// `ms_last_error`. No exception ever reaches Rust.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace memsave {

void set_last_error(std::string message) noexcept;

}  // namespace memsave

// Like TORCH_CHECK, but the error carries no C++ backtrace: an error meant for the
// user (a hook or a checkpoint failing in backward) reaches tch as one line.
#define MS_CHECK(cond, ...)                                        \
  do {                                                             \
    if (!(cond)) throw c10::Error(c10::str(__VA_ARGS__), nullptr); \
  } while (false)

// Runs the body (a braced statement list); returns 0 on success, 1 after recording
// the error. Variadic so that commas inside the body need no parentheses.
#define MS_TRY(...)                                                         \
  try {                                                                     \
    __VA_ARGS__;                                                            \
    return 0;                                                               \
  } catch (const c10::Error& e) {                                           \
    memsave::set_last_error(e.what_without_backtrace());                    \
  } catch (const std::exception& e) {                                       \
    memsave::set_last_error(e.what());                                      \
  } catch (...) {                                                           \
    memsave::set_last_error("unknown C++ exception");                       \
  }                                                                         \
  return 1;
