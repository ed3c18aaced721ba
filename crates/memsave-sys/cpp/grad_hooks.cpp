// Post-accumulate-grad hooks whose body is a Rust callback.
//
// libtorch keeps one `PostAccumulateGradHook` per leaf tensor (in its autograd meta)
// and calls it from `AccumulateGrad` right after the gradient has been accumulated into
// `.grad`. `ms_grad_hook_register` installs a hook that calls a Rust function with the
// tensor; when the callback reports a failure, the hook throws a c10::Error, which the
// autograd engine propagates to the caller of backward.
#include "common.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <optional>
#include <string>

// The Rust side: runs the hook for `tensor`; reports a failure with `ms_grad_hook_fail`.
typedef void (*ms_grad_hook_fn)(void* ctx, const at::Tensor* tensor, void* status);
// Drops the Rust side of a hook.
typedef void (*ms_grad_hook_drop_fn)(void* ctx);

namespace {

struct HookStatus {
  std::optional<std::string> error;
};

// Owns the Rust context: the destructor drops it exactly once, whenever libtorch
// destroys the hook (removed, replaced, or the tensor freed).
class RustPostAccumulateGradHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  RustPostAccumulateGradHook(void* ctx, ms_grad_hook_fn run, ms_grad_hook_drop_fn drop)
      : ctx_(ctx), run_(run), drop_(drop) {}
  RustPostAccumulateGradHook(const RustPostAccumulateGradHook&) = delete;
  RustPostAccumulateGradHook& operator=(const RustPostAccumulateGradHook&) = delete;
  ~RustPostAccumulateGradHook() override { drop_(ctx_); }

  void operator()(const torch::autograd::Variable& tensor) override {
    HookStatus status;
    run_(ctx_, &tensor, &status);
    MS_CHECK(!status.error, *status.error);
  }

 private:
  void* ctx_;
  ms_grad_hook_fn run_;
  ms_grad_hook_drop_fn drop_;
};

}  // namespace

extern "C" {

void ms_grad_hook_fail(void* status, const char* message) noexcept {
  try {
    static_cast<HookStatus*>(status)->error = std::string(message == nullptr ? "unknown error" : message);
  } catch (...) {
    try {
      static_cast<HookStatus*>(status)->error = std::string();
    } catch (...) {
    }
  }
}

// Installs a post-accumulate-grad hook on the leaf `t`, which must not have one yet.
// Takes ownership of `ctx` in every case: `drop(ctx)` runs exactly once, before this
// returns on error, else when the hook is destroyed. `*out_id` identifies the hook
// for `ms_grad_hook_remove`.
int ms_grad_hook_register(const at::Tensor* t, void* ctx, ms_grad_hook_fn run, ms_grad_hook_drop_fn drop,
                          void** out_id) {
  std::unique_ptr<RustPostAccumulateGradHook> hook;
  try {
    hook = std::make_unique<RustPostAccumulateGradHook>(ctx, run, drop);
  } catch (...) {
    drop(ctx);
    memsave::set_last_error("post-accumulate-grad hook: out of memory");
    return 1;
  }
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    TORCH_CHECK(t->is_leaf() && t->requires_grad(),
                "post-accumulate-grad hooks can only be registered on leaf tensors that require grad");
    TORCH_CHECK(torch::autograd::impl::post_acc_grad_hooks(*t) == nullptr,
                "the tensor already has a post-accumulate-grad hook (libtorch keeps one per tensor)");
    *out_id = hook.get();
    torch::autograd::impl::set_post_acc_grad_hooks(*t, std::move(hook));
  })
}

// Removes the hook `id` from `t` if it is still the tensor's hook; `*removed` says
// whether it was. Must not be called from inside that hook.
int ms_grad_hook_remove(const at::Tensor* t, void* id, bool* removed) {
  MS_TRY({
    *removed = false;
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(*t);
    if (id != nullptr && slot.get() == id) {
      slot.reset();
      *removed = true;
    }
  })
}

}  // extern "C"
