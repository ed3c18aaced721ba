// Which ops a piece of work runs: ops that couple the samples of a batch (BatchNorm in
// training mode computes each sample's output from the whole batch's statistics, so
// splitting the batch into micro-batches changes the result).
#include "ops.h"

#include "common.h"

#include <cstring>
#include <memory>
#include <string>

namespace {

struct CouplingRecorder {
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
  std::string first;  // the first coupling op seen, empty: none
  CouplingRecorder* outer = nullptr;
};

CouplingRecorder*& current() {
  thread_local CouplingRecorder* recorder = nullptr;
  return recorder;
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  auto* recorder = current();
  if (recorder != nullptr && recorder->first.empty() && memsave::ops::couples_samples(fn)) {
    recorder->first = fn.name();
  }
  return nullptr;
}

}  // namespace

namespace memsave::ops {

namespace {

// All have their running statistics at arguments 3 and 4.
constexpr const char* kBatchNormFamily[] = {
    "aten::batch_norm",           "aten::native_batch_norm",       "aten::_native_batch_norm_legit",
    "aten::_batch_norm_with_update", "aten::_batch_norm_impl_index", "aten::instance_norm",
    "aten::cudnn_batch_norm",     "aten::miopen_batch_norm",
};

}  // namespace

bool updates_running_stats(const char* name) {
  for (const char* op : kBatchNormFamily) {
    if (std::strcmp(name, op) == 0) return true;
  }
  return false;
}

// `training` is argument 5 (argument 3 in _native_batch_norm_legit's no_stats
// overload); _batch_norm_with_update always trains.
bool couples_samples(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (!updates_running_stats(name) || std::strcmp(name, "aten::instance_norm") == 0) return false;
  if (std::strcmp(name, "aten::_batch_norm_with_update") == 0) return true;
  const auto inputs = fn.inputs();
  for (size_t i : {size_t{5}, size_t{3}}) {
    if (i < inputs.size() && inputs[i].isBool()) return inputs[i].toBool();
  }
  return false;
}

}  // namespace memsave::ops

extern "C" {

// Starts recording, on this thread, whether an op that couples the samples of a batch
// runs; `*recorder` is handed to `ms_coupling_end` exactly once.
int ms_coupling_begin(void** recorder) {
  MS_TRY({
    auto r = std::make_unique<CouplingRecorder>();
    r->handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_op_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    r->outer = current();
    current() = r.get();
    *recorder = r.release();
  })
}

// Stops recording and frees the recorder; writes the first coupling op's name into
// `sink` (a std::string) and sets `*found` when one ran.
int ms_coupling_end(void* recorder, void* sink, bool* found) {
  MS_TRY({
    std::unique_ptr<CouplingRecorder> r(static_cast<CouplingRecorder*>(recorder));
    at::removeCallback(r->handle);
    current() = r->outer;
    *found = !r->first.empty();
    if (*found && sink != nullptr) *static_cast<std::string*>(sink) = r->first;
  })
}

}  // extern "C"
