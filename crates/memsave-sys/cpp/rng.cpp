// The default CPU generator's state, read and written under the generator's own mutex
// (tch exposes `manual_seed` only): `fit` puts the random stream back where it was
// after its probe runs, so a model draws the same numbers with or without it.
#include "common.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/Tensor.h>

#include <mutex>

extern "C" {

// Writes a copy of the default CPU generator's state (a uint8 CPU tensor, a `new
// at::Tensor` owned by the caller) to `out`.
int ms_rng_cpu_state(at::Tensor** out) {
  MS_TRY({
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    *out = new at::Tensor(std::move(state));
  })
}

// Makes `state` (from `ms_rng_cpu_state`) the default CPU generator's state.
int ms_rng_set_cpu_state(const at::Tensor* state) {
  MS_TRY({
    MS_CHECK(state != nullptr && state->defined(), "the generator state is an undefined tensor");
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  })
}

}  // extern "C"
