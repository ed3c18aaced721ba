// The default CPU generator's state, read and written under the generator's own mutex
// (tch exposes `manual_seed` only): `fit` puts the random stream back where it was
// after its probe runs, so a model draws the same numbers with or without it. The
// checkpoint's RNG replay uses the same two functions.
#include "rng.h"

#include "common.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Tensor.h>

#include <mutex>

namespace memsave::rng {

c10::intrusive_ptr<c10::TensorImpl> get_state(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state().getIntrusivePtr();
}

void set_state(at::Generator& gen, const c10::intrusive_ptr<c10::TensorImpl>& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(at::Tensor(state));
}

}  // namespace memsave::rng

extern "C" {

// Writes a copy of the default CPU generator's state (a uint8 CPU tensor, a `new
// at::Tensor` owned by the caller) to `out`.
int ms_rng_cpu_state(at::Tensor** out) {
  MS_TRY({
    auto gen = at::detail::getDefaultCPUGenerator();
    *out = new at::Tensor(memsave::rng::get_state(gen));
  })
}

// Makes `state` (from `ms_rng_cpu_state`) the default CPU generator's state.
int ms_rng_set_cpu_state(const at::Tensor* state) {
  MS_TRY({
    MS_CHECK(state != nullptr && state->defined(), "the generator state is an undefined tensor");
    auto gen = at::detail::getDefaultCPUGenerator();
    memsave::rng::set_state(gen, state->getIntrusivePtr());
  })
}

}  // extern "C"
