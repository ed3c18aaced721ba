// Saved-tensor hooks without Python: a thread-local stack of hook frames consulted by
// memsave's autograd engine for every tensor autograd saves.
//
// libtorch asks `Engine::get_default_engine().get_default_saved_variable_hooks()` each
// time a SavedVariable is made (while `at::SavedTensorDefaultHooks::is_enabled()`).
// memsave installs an Engine subclass whose answer is the innermost frame of the
// calling thread's stack. Each frame makes one `SavedVariableHooks` object per saved
// tensor; those objects live with the graph and may be unpacked on any thread.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace memsave::hooks {

// `t`'s grad_fn as stored (without the view regeneration `grad_fn()` can trigger).
c10::intrusive_ptr<torch::autograd::Node> stored_grad_fn(const at::Tensor& t);

// What every packed tensor remembers, to check what unpack gives back and to name the
// tensor in errors: libtorch skips its own version check when hooks are set.
struct SavedMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  std::string producer;  // grad_fn name of the saved tensor, "leaf" or "constant"
  c10::VariableVersion version{c10::VariableVersion::Disabled::DISABLED};
  uint32_t saved_version = 0;
  bool track_version = false;

  static SavedMeta of(const at::Tensor& t);
  std::string describe() const;  // "tensor [4, 8] Float saved from AddmmBackward0"
  // Throws a c10::Error naming the tensor when it was modified in place since pack.
  void check_version() const;
  // Throws when `t` does not have the packed shape and dtype; `hint` says what to fix.
  void check_unpacked(const at::Tensor& t, const char* who, const char* hint) const;
};

// One entry of a thread's hook stack.
class Frame {
 public:
  virtual ~Frame() = default;
  virtual std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() = 0;
};

// Installs memsave's engine as libtorch's default (once per process; idempotent). Besides
// the hooks, it differs from libtorch's in one way: a backward that fails without
// keep_graph frees the saved tensors of the nodes it would have run, as a successful one
// does, so a graph with a reference cycle (an in-place update of a saved tensor) does not
// outlive the user's handles.
void install_engine();

// Pushes `frame` on the calling thread's stack; returns the frame's id (unique on this
// thread, never 0). With `record_ops`, the thread tracks the op running (a
// RecordFunction callback) until the frame is popped, for `current_op()`.
uint64_t push(std::shared_ptr<Frame> frame, bool record_ops = false);

// Hooks for one tensor from the calling thread's innermost frame, as the engine asks
// for them; nullptr when no frame is pushed or hooks are disabled.
std::unique_ptr<torch::autograd::SavedVariableHooks> current_hooks();

// How many backward calls (graph tasks) were started on this thread through memsave's
// engine: a change across a call tells that a backward ran inside it.
uint64_t backward_calls_started();

// The innermost aten op running on this thread ("aten::addmm"), or nullptr when no
// frame with `record_ops` is pushed.
const char* current_op();
// What `pop` found.
enum class Popped : int {
  // No frame with that id on this thread (popped already, or pushed on another thread).
  kNotFound = 0,
  // It was the innermost frame.
  kInnermost = 1,
  // It was removed from under frames pushed after it (a scope left out of order); the
  // frames after it stay, in their order.
  kOutOfOrder = 2,
};

// Removes the frame with id `id` from the calling thread's stack, wherever it is: a
// scope left out of order never leaves its hooks behind.
Popped pop(uint64_t id);

// A frame pushed for the guard's lifetime, popped even when the scope unwinds.
class FrameScope {
 public:
  explicit FrameScope(std::shared_ptr<Frame> frame) : id_(push(std::move(frame))) {}
  ~FrameScope();
  FrameScope(const FrameScope&) = delete;
  FrameScope& operator=(const FrameScope&) = delete;

 private:
  uint64_t id_;
};

// Hooks are off on this thread while a guard lives (inside pack hooks, as PyTorch does).
class DisableGuard {
 public:
  DisableGuard();
  ~DisableGuard();
  DisableGuard(const DisableGuard&) = delete;
  DisableGuard& operator=(const DisableGuard&) = delete;
};

}  // namespace memsave::hooks
