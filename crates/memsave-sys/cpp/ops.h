// The batch-norm family, as libtorch's dispatcher records its ops.
#pragma once

#include <ATen/record_function.h>

namespace memsave::ops {

// Whether `name` is a batch-norm-family op: one whose arguments 3 and 4 are running
// statistics it updates in place as it runs (instance_norm's too).
bool updates_running_stats(const char* name);

// Whether `fn` couples the samples of a batch: a batch-norm-family op in training mode
// (instance_norm normalizes each sample on its own and does not).
bool couples_samples(const at::RecordFunction& fn);

}  // namespace memsave::ops
