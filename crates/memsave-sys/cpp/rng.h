// The state of a random generator, read and written under the generator's own mutex.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/TensorImpl.h>

namespace memsave::rng {

// A copy of `gen`'s state.
c10::intrusive_ptr<c10::TensorImpl> get_state(at::Generator& gen);

// Makes `state` (from `get_state`) `gen`'s state.
void set_state(at::Generator& gen, const c10::intrusive_ptr<c10::TensorImpl>& state);

}  // namespace memsave::rng
