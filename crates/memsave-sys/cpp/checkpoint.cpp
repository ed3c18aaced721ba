// Gradient checkpointing on saved-tensor hooks (the non-reentrant scheme).
//
// `ms_checkpoint` runs the closure with grad enabled under a CheckpointFrame: autograd
// builds the ordinary graph, but every tensor it saves is replaced by a handle (an
// index) and the tensor itself is not kept. The frame keeps the closure, its inputs
// and the RNG/autocast state. The first handle unpacked in backward recomputes the
// closure under a capturing frame that stores each saved tensor of the recomputation
// at its index, and stops the recomputation as soon as every handle still alive has
// its tensor back. Because the recomputed tensors are handed to the original graph,
// every autograd entry point (backward, grad to chosen tensors, create_graph,
// retain_graph) behaves as without checkpointing.
//
// A backward may also run inside the function (PyTorch's `autograd.grad` in a
// checkpointed function): in the forward, where it unpacks handles before the forward
// has finished (the recomputation then reruns the function up to the last handle saved
// so far), and in a recomputation, over the recomputation's own graph (whose capture
// hooks keep what they save until the recomputation ends).
#include "common.h"
#include "hooks.h"
#include "ops.h"
#include "rng.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// The Rust side: runs the closure on `inputs` and reports through `ms_outputs_*`.
typedef void (*ms_run_fn)(void* ctx, at::Tensor* const* inputs, size_t n_inputs, void* outputs);
typedef void (*ms_drop_fn)(void* ctx);

namespace {

using memsave::hooks::SavedMeta;

struct Outputs {
  std::vector<at::Tensor> tensors;
  std::optional<std::string> error;
};

// Owns the Rust closure; dropping it runs the Rust destructor exactly once.
struct Closure {
  void* ctx;
  ms_run_fn run;
  ms_drop_fn drop;

  Closure(void* c, ms_run_fn r, ms_drop_fn d) : ctx(c), run(r), drop(d) {}
  Closure(const Closure&) = delete;
  Closure& operator=(const Closure&) = delete;
  ~Closure() { drop(ctx); }

  // Runs the closure; an error or panic in it comes back in `Outputs::error`.
  Outputs call(const std::vector<at::Tensor>& inputs) const {
    std::vector<at::Tensor*> ptrs;
    ptrs.reserve(inputs.size());
    for (const auto& t : inputs) ptrs.push_back(const_cast<at::Tensor*>(&t));
    Outputs out;
    run(ctx, ptrs.data(), ptrs.size(), &out);
    return out;
  }
};

// With preserve_rng, a checkpointed forward and its recomputation must draw the same
// numbers from the process-wide generators, so regions on different threads take turns
// (a process-wide lock, recursive for nesting on one thread). But a region may wait for
// a worker thread that runs a checkpointed branch: waiting for the lock would deadlock
// there. So a region waits at most kRngWait, then runs without the lock, and each region
// learns whether a region of another thread ran while it did. Only when that happened
// and the generators' state moved during the region can its draws be mixed with another
// thread's, and then the region fails with an error instead of replaying other numbers.
constexpr auto kRngWait = std::chrono::milliseconds(500);

class RngRegion {
 public:
  explicit RngRegion(bool preserve_rng) : lock_(mutex(), std::defer_lock) {
    if (!preserve_rng) return;
    (void)lock_.try_lock_for(kRngWait);
    overlapped_ = std::make_shared<std::atomic<bool>>(false);
    auto& r = registry();
    std::lock_guard<std::mutex> guard(r.mu);
    const auto me = std::this_thread::get_id();
    for (auto& entry : r.active) {
      if (entry.first == me) continue;
      entry.second->store(true);
      overlapped_->store(true);
    }
    r.active.emplace_back(me, overlapped_);
  }
  RngRegion(const RngRegion&) = delete;
  RngRegion& operator=(const RngRegion&) = delete;
  ~RngRegion() {
    if (!overlapped_) return;
    auto& r = registry();
    std::lock_guard<std::mutex> guard(r.mu);
    auto& active = r.active;
    active.erase(std::remove_if(active.begin(), active.end(), [this](const auto& e) { return e.second == overlapped_; }),
                 active.end());
  }

  // Whether a checkpointed region of another thread ran at some time during this one.
  bool overlapped() const { return overlapped_ && overlapped_->load(); }

 private:
  struct Registry {
    std::mutex mu;
    std::vector<std::pair<std::thread::id, std::shared_ptr<std::atomic<bool>>>> active;
  };
  static Registry& registry() {
    static auto* r = new Registry();
    return *r;
  }
  static std::recursive_timed_mutex& mutex() {
    static auto* m = new std::recursive_timed_mutex();
    return *m;
  }
  std::unique_lock<std::recursive_timed_mutex> lock_;
  std::shared_ptr<std::atomic<bool>> overlapped_;
};

constexpr const char* kRngOverlap =
    " drew random numbers while a checkpointed region ran on another thread (preserve_rng): the draws of the "
    "two may be interleaved, so the recomputation could not replay this region's numbers. Run the checkpointed "
    "regions that draw random numbers on one thread, or pass preserve_rng = false where a function draws none";

using RngStates = std::vector<std::pair<at::Generator, c10::intrusive_ptr<c10::TensorImpl>>>;

using memsave::rng::get_state;
using memsave::rng::set_state;

// RNG and autocast state captured at forward and restored for the recomputation.
struct ForwardState {
  RngStates rng;
  bool autocast_cpu = false;
  bool autocast_cuda = false;
  at::ScalarType autocast_cpu_dtype = at::kBFloat16;
  at::ScalarType autocast_cuda_dtype = at::kHalf;

  static ForwardState capture(const std::vector<at::Tensor>& inputs, bool preserve_rng) {
    ForwardState s;
    if (preserve_rng) {
      auto cpu = at::detail::getDefaultCPUGenerator();
      s.rng.emplace_back(cpu, get_state(cpu));
      std::vector<c10::DeviceIndex> cuda_devices;
      for (const auto& t : inputs) {
        if (t.defined() && t.is_cuda() &&
            std::find(cuda_devices.begin(), cuda_devices.end(), t.get_device()) == cuda_devices.end()) {
          cuda_devices.push_back(t.get_device());
        }
      }
      for (auto index : cuda_devices) {
        auto gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index));
        s.rng.emplace_back(gen, get_state(gen));
      }
    }
    s.autocast_cpu = at::autocast::is_autocast_enabled(c10::DeviceType::CPU);
    s.autocast_cpu_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
    s.autocast_cuda = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
    s.autocast_cuda_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
    return s;
  }

  void apply_autocast() const {
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, autocast_cpu);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, autocast_cpu_dtype);
    at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, autocast_cuda);
    at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, autocast_cuda_dtype);
  }
};

// Applies a ForwardState for its lifetime and restores what was there before. The
// destructor never throws: a failed restore cannot be reported from it, and a throw
// there would end the process.
class ReplayGuard {
 public:
  explicit ReplayGuard(const ForwardState& fwd) : saved_(ForwardState::capture({}, false)) {
    for (const auto& entry : fwd.rng) {
      auto gen = entry.first;
      rng_before_.emplace_back(gen, get_state(gen));
      set_state(gen, entry.second);
    }
    fwd.apply_autocast();
    // An autocast scope of its own, as torch.autocast's __enter__: when it is the
    // outermost one, leaving it clears the cache of casted weights.
    at::autocast::increment_nesting();
  }
  ReplayGuard(const ReplayGuard&) = delete;
  ReplayGuard& operator=(const ReplayGuard&) = delete;
  ~ReplayGuard() noexcept {
    try {
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    } catch (...) {
    }
    for (auto& entry : rng_before_) {
      try {
        set_state(entry.first, entry.second);
      } catch (...) {
      }
    }
    try {
      saved_.apply_autocast();
    } catch (...) {
    }
  }

 private:
  ForwardState saved_;
  RngStates rng_before_;
};

// Batch-norm-family ops update their running statistics (arguments 3 and 4 of each of
// these schemas) in place as they run, so a recomputation would update them a second
// time. While a recomputation runs, this guard copies each running statistic such an op
// is about to update, the first time it sees it, and puts every copy back when the
// recomputation ends: a checkpointed step updates them exactly once, as a plain step
// does (PyTorch's checkpoint updates them once per recomputation). Covers the ops the
// recomputing thread runs; ops on other threads inside the function are not seen.
class RunningStatsGuard {
 public:
  RunningStatsGuard() : outer_(current()) {
    current() = this;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_op_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  RunningStatsGuard(const RunningStatsGuard&) = delete;
  RunningStatsGuard& operator=(const RunningStatsGuard&) = delete;
  ~RunningStatsGuard() noexcept {
    try {
      at::removeCallback(handle_);
    } catch (...) {
    }
    current() = outer_;
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      try {
        // Below autograd and the version counter: a plain write back of the values.
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        it->first.copy_(it->second);
      } catch (...) {
      }
    }
  }

 private:
  static RunningStatsGuard*& current() {
    thread_local RunningStatsGuard* guard = nullptr;
    return guard;
  }

  static std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
    auto* self = current();
    if (self == nullptr || !memsave::ops::updates_running_stats(fn.name())) return nullptr;
    const auto inputs = fn.inputs();
    for (size_t i : {size_t{3}, size_t{4}}) {
      if (i < inputs.size() && inputs[i].isTensor()) self->snapshot(inputs[i].toTensor());
    }
    return nullptr;
  }

  void snapshot(const at::Tensor& t) {
    if (!t.defined()) return;
    for (const auto& entry : saved_) {
      if (entry.first.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return;
    }
    at::NoGradGuard no_grad;
    saved_.emplace_back(t, t.clone());
  }

  RunningStatsGuard* outer_;
  at::CallbackHandle handle_ = at::INVALID_CALLBACK_HANDLE;
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;
};

// Recomputations running on this thread. Whatever a recomputation builds besides the
// tensors it captures is thrown away when it ends, so a checkpoint called inside one
// needs no frame of its own: it runs under a DiscardFrame (no RNG copy, nothing kept).
// Unless a backward runs inside the function being recomputed (autograd.grad in a
// checkpointed function): that backward may go through the nested checkpoint, which
// then gets a light frame (no inputs packed) to recompute itself from.
thread_local int recompute_depth = 0;
thread_local bool recompute_runs_backward = false;

struct RecomputeScope {
  explicit RecomputeScope(bool runs_backward) : outer_runs_backward_(recompute_runs_backward) {
    ++recompute_depth;
    recompute_runs_backward = recompute_runs_backward || runs_backward;
  }
  ~RecomputeScope() {
    --recompute_depth;
    recompute_runs_backward = outer_runs_backward_;
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  bool outer_runs_backward_;
};

struct DiscardSavedHooks final : torch::autograd::SavedVariableHooks {
  void call_pack_hook(const at::Tensor& /*tensor*/) override {}
  at::Tensor call_unpack_hook() override {
    MS_CHECK(false,
             "checkpoint: a backward ran inside a recomputation through a nested checkpoint whose function ran "
             "no backward in the forward; the function must do the same computation when it is rerun");
  }
};

struct DiscardFrame final : memsave::hooks::Frame {
  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<DiscardSavedHooks>();
  }
};

// Why a recomputation was ended early (not an error).
constexpr const char* kStopMessage = "memsave-checkpoint: recomputation stopped early (not an error)";

class CheckpointFrame;

// Runs a checkpoint's recomputation when backward reaches the node of one of its
// outputs; holds the frame weakly (the graph must not keep it alive).
struct RecomputePreHook final : torch::autograd::FunctionPreHook {
  std::weak_ptr<CheckpointFrame> frame;
  explicit RecomputePreHook(std::weak_ptr<CheckpointFrame> f) : frame(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override;
};

// One checkpointed call: owns the closure, its inputs and the tensors recomputed for
// the handles that autograd holds.
class CheckpointFrame final : public memsave::hooks::Frame, public std::enable_shared_from_this<CheckpointFrame> {
 public:
  CheckpointFrame(std::unique_ptr<Closure> closure, std::string name, bool preserve_rng, bool early_stop)
      : closure_(std::move(closure)), name_(std::move(name)), preserve_rng_(preserve_rng), early_stop_(early_stop) {}

  // Whether the recomputation running on this thread has every tensor it needs back
  // (the function may return early: what it computes from there on is thrown away).
  static bool current_recomputation_done() {
    const auto* f = recomputing_frame();
    return f != nullptr && f->stopped_;
  }

  // Hands each defined input to the calling thread's innermost hook frame (pushed by
  // the caller for this call) instead of keeping it: the recompute unpacks it. Call
  // before `forward`; the packed inputs live as long as the frame (a second backward
  // with retain_graph unpacks them again).
  void pack_inputs_with_current_hooks(const std::vector<at::Tensor>& inputs) {
    packed_inputs_.resize(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].defined()) continue;
      auto hooks = memsave::hooks::current_hooks();
      MS_CHECK(hooks != nullptr, "checkpoint: packing inputs needs a hook frame, and none is pushed");
      hooks->call_pack_hook(inputs[i]);
      packed_inputs_[i] = std::move(hooks);
    }
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override;

  // Runs the forward under this frame; returns the closure's outputs.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& inputs) {
    RngRegion region(preserve_rng_);
    state_ = ForwardState::capture(inputs, preserve_rng_);
    backward_calls_at_forward_ = memsave::hooks::backward_calls_started();
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& t = inputs[i];
      const bool packed = i < packed_inputs_.size() && packed_inputs_[i] != nullptr;
      // A kept input shares storage and version counter with the caller's tensor.
      const bool keep = t.defined() && !packed;
      inputs_.push_back(keep ? t.detach() : at::Tensor());
      requires_grad_.push_back(t.defined() && t.requires_grad());
      versions_.push_back(t.defined() && !t.is_inference() ? t._version() : 0);
    }
    Outputs out;
    {
      memsave::hooks::FrameScope scope(shared_from_this());
      out = closure_->call(inputs);
    }
    MS_CHECK(!out.error, "checkpoint: ", name_, " failed during the forward: ", *out.error);
    backward_inside_ = memsave::hooks::backward_calls_started() != backward_calls_at_forward_;
    drop_unused_rng_states();
    MS_CHECK(!region.overlapped() || state_.rng.empty(), "checkpoint: ", name_, kRngOverlap);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& t = inputs[i];
      if (!t.defined() || t.is_inference()) continue;
      MS_CHECK(t._version() == versions_[i], "checkpoint: ", name_, " modified its input ", i, " (",
                  t.sizes(), " ", t.scalar_type(),
                  ") in place; the recomputation in backward would modify it again. Clone the input inside "
                  "the function before modifying it.");
    }
    forward_done_ = true;
    std::vector<const torch::autograd::Node*> hooked;
    for (const auto& t : out.tensors) {
      // An undefined output (PyTorch's None) passes through as it is.
      if (!t.defined() || !t.requires_grad()) continue;
      const auto fn = memsave::hooks::stored_grad_fn(t);
      if (!fn || std::find(hooked.begin(), hooked.end(), fn.get()) != hooked.end()) continue;
      fn->add_pre_hook(std::make_unique<RecomputePreHook>(weak_from_this()));
      hooked.push_back(fn.get());
    }
    return std::move(out.tensors);
  }

  // A generator whose state the forward left unchanged was not drawn from: nothing to
  // replay, so its 5 KiB copy need not be kept.
  void drop_unused_rng_states() {
    auto& rng = state_.rng;
    rng.erase(std::remove_if(rng.begin(), rng.end(),
                             [](auto& entry) {
                               auto now = get_state(entry.first);
                               return at::equal(at::Tensor(now), at::Tensor(entry.second));
                             }),
              rng.end());
  }

  size_t register_handle() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    MS_CHECK(!forward_done_,
                "checkpoint: a tensor was saved under a checkpoint's hooks after its forward ended (a hook scope "
                "left on another thread?)");
    storage_.emplace_back();
    alive_.push_back(true);
    return storage_.size() - 1;
  }

  void release_handle(size_t index) noexcept {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    alive_[index] = false;
    storage_[index] = at::Tensor();
  }

  at::Tensor unpack(size_t index, const SavedMeta& meta) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!storage_[index].defined()) recompute("the " + meta.describe());
    MS_CHECK(storage_[index].defined(), "checkpoint: the recomputation did not give back the ", meta.describe(),
             "; the function must do the same computation when it is rerun");
    at::Tensor t = std::move(storage_[index]);
    storage_[index] = at::Tensor();
    return t;
  }

  // Called by the capturing frame for each tensor the recomputation saves: stores the
  // k-th at index k. With early stop it ends the recomputation (by throwing
  // kStopMessage) as soon as every live handle has its tensor back, so nothing after
  // the last tensor needed is recomputed (PyTorch's early stop); without, the rest of
  // the function runs and what it saves is not kept.
  void on_recompute_save(const at::Tensor& t) {
    if (stopped_) {
      MS_CHECK(!early_stop_, kStopMessage);
      return;
    }
    if (!capture(t)) {
      stopped_ = true;
      MS_CHECK(!early_stop_, kStopMessage);
    }
  }

  // Backward has reached an output of the checkpoint: refill every live handle now,
  // before the segment's own backward starts adding gradients (a gradient cast to
  // another dtype, say) that would otherwise be alive during the recomputation.
  void prefetch() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!forward_done_ || recomputing_) return;
    for (size_t k = 0; k < storage_.size(); ++k) {
      if (alive_[k] && !storage_[k].defined()) {
        recompute("the gradient reaching its output");
        return;
      }
    }
  }

 private:
  bool capture(const at::Tensor& t) {
    const size_t k = next_capture_++;
    MS_CHECK(k < storage_.size(), "checkpoint: the recomputation saved more tensors for backward than the "
                                     "forward did (",
                storage_.size(), "); the function must do the same computation when it is rerun");
    if (alive_[k] && !storage_[k].defined()) {
      storage_[k] = t.detach();
      --missing_;
    }
    return missing_ > 0;
  }

  void recompute(const std::string& needed_for);

  static const CheckpointFrame*& recomputing_frame() {
    thread_local const CheckpointFrame* frame = nullptr;
    return frame;
  }

  std::unique_ptr<Closure> closure_;
  // What errors call the function: "the function", or the name the caller gave.
  std::string name_;
  bool preserve_rng_;
  bool early_stop_;
  bool recomputing_ = false;
  // Whether a backward ran inside the function during the forward.
  uint64_t backward_calls_at_forward_ = 0;
  bool backward_inside_ = false;
  std::vector<at::Tensor> inputs_;
  // Inputs packed by a hook frame instead of kept (null: kept in `inputs_`).
  std::vector<std::unique_ptr<torch::autograd::SavedVariableHooks>> packed_inputs_;
  std::vector<bool> requires_grad_;
  std::vector<uint32_t> versions_;
  ForwardState state_;
  bool forward_done_ = false;

  // Recursive: a backward inside the function can unpack a handle while the frame is
  // busy on this thread.
  std::recursive_mutex mu_;
  std::vector<at::Tensor> storage_;
  std::vector<bool> alive_;
  size_t next_capture_ = 0;
  size_t missing_ = 0;
  bool stopped_ = false;
};

// Handle kept by autograd in place of a tensor saved under a CheckpointFrame.
struct CheckpointSavedHooks final : torch::autograd::SavedVariableHooks {
  std::shared_ptr<CheckpointFrame> frame;
  size_t index = 0;
  bool registered = false;
  SavedMeta meta;

  explicit CheckpointSavedHooks(std::shared_ptr<CheckpointFrame> f) : frame(std::move(f)) {}
  ~CheckpointSavedHooks() override {
    if (registered) frame->release_handle(index);
  }
  void call_pack_hook(const at::Tensor& tensor) override {
    meta = SavedMeta::of(tensor);
    index = frame->register_handle();
    registered = true;
  }
  at::Tensor call_unpack_hook() override {
    meta.check_version();
    auto t = frame->unpack(index, meta);
    meta.check_unpacked(t, "checkpoint: the recomputation",
                        "the function must do the same computation when it is rerun");
    return t;
  }
};

std::unique_ptr<torch::autograd::SavedVariableHooks> CheckpointFrame::make_hooks() {
  return std::make_unique<CheckpointSavedHooks>(shared_from_this());
}

torch::autograd::variable_list RecomputePreHook::operator()(const torch::autograd::variable_list& grads) {
  if (auto f = frame.lock()) f->prefetch();
  return grads;
}

// The frame of a recomputation: stores what it saves into the CheckpointFrame and
// ends the recomputation once nothing more is needed.
class CaptureFrame final : public memsave::hooks::Frame {
 public:
  explicit CaptureFrame(CheckpointFrame* target) : target_(target) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override;
  CheckpointFrame* target_;
};

// Keeps what it saves, as a plain save would: the recomputation's own graph lives only
// until the recomputation ends, and a backward inside the function (autograd.grad in a
// checkpointed function) runs through it.
struct CaptureSavedHooks final : torch::autograd::SavedVariableHooks {
  CheckpointFrame* target;
  at::Tensor kept;
  explicit CaptureSavedHooks(CheckpointFrame* t) : target(t) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    kept = tensor.detach();
    target->on_recompute_save(tensor);
  }
  at::Tensor call_unpack_hook() override { return kept; }
};

std::unique_ptr<torch::autograd::SavedVariableHooks> CaptureFrame::make_hooks() {
  return std::make_unique<CaptureSavedHooks>(target_);
}

void CheckpointFrame::recompute(const std::string& needed_for) {
  MS_CHECK(!recomputing_, "checkpoint: a backward inside the recomputation needed the same checkpoint's "
                          "recomputation again (needed for ",
           needed_for, ")");
  std::vector<at::Tensor> replay_inputs;
  replay_inputs.reserve(inputs_.size());
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (i < packed_inputs_.size() && packed_inputs_[i] != nullptr) {
      // The hooks check the version and the shape and dtype of what they restore.
      auto x = packed_inputs_[i]->call_unpack_hook().detach();
      if (requires_grad_[i]) x.requires_grad_(true);
      replay_inputs.push_back(std::move(x));
      continue;
    }
    const auto& saved = inputs_[i];
    if (!saved.defined()) {
      replay_inputs.emplace_back();
      continue;
    }
    if (!saved.is_inference()) {
      const auto now = saved._version();
      MS_CHECK(now == versions_[i], "checkpoint: input ", i, " (", saved.sizes(), " ", saved.scalar_type(),
                  ") was modified in place after the checkpointed forward (version ", versions_[i], " -> ", now,
                  "); the recomputation would use the new values. Clone it before modifying it.");
    }
    auto x = saved.detach();
    if (requires_grad_[i]) x.requires_grad_(true);
    replay_inputs.push_back(std::move(x));
  }
  next_capture_ = 0;
  missing_ = 0;
  for (size_t k = 0; k < storage_.size(); ++k) {
    if (alive_[k] && !storage_[k].defined()) ++missing_;
  }
  stopped_ = missing_ == 0;
  Outputs out;
  bool overlapped = false;
  recomputing_ = true;
  struct Reset {
    bool& flag;
    const CheckpointFrame*& current;
    const CheckpointFrame* outer;
    ~Reset() {
      flag = false;
      current = outer;
    }
  } reset{recomputing_, recomputing_frame(), recomputing_frame()};
  recomputing_frame() = this;
  {
    RngRegion region(!state_.rng.empty());
    at::AutoGradMode enable_grad(true);
    ReplayGuard replay(state_);
    RunningStatsGuard running_stats;
    // A recomputation during the forward is itself asked for by a backward inside it.
    RecomputeScope recomputing(backward_inside_ || !forward_done_);
    memsave::hooks::FrameScope scope(std::make_shared<CaptureFrame>(this));
    out = closure_->call(replay_inputs);
    overlapped = region.overlapped();
  }
  MS_CHECK(!overlapped, "checkpoint: the recomputation in backward (needed for ", needed_for, ")", kRngOverlap);
  out.tensors.clear();  // the recomputation's own outputs are not needed
  const bool stopped = stopped_;
  stopped_ = false;
  if (out.error && !stopped) {
    MS_CHECK(false, "checkpoint: ", name_, " failed during the recomputation in backward (needed for ", needed_for,
             "): ", *out.error);
  }
  MS_CHECK(missing_ == 0, "checkpoint: the recomputation saved ", next_capture_,
              " tensors for backward but the forward saved ", storage_.size(),
              "; the function must do the same computation when it is rerun");
}

}  // namespace

extern "C" {

void ms_outputs_push(void* outputs, const at::Tensor* t) noexcept {
  try {
    static_cast<Outputs*>(outputs)->tensors.push_back(t == nullptr ? at::Tensor() : *t);
  } catch (...) {
    try {
      static_cast<Outputs*>(outputs)->error = "out of memory collecting the function's outputs";
    } catch (...) {
    }
  }
}

void ms_outputs_fail(void* outputs, const char* message) noexcept {
  try {
    static_cast<Outputs*>(outputs)->error = std::string(message == nullptr ? "unknown error" : message);
  } catch (...) {
  }
}

// Bytes of the default CPU generator's state, as libtorch copies it (get_state()).
int ms_cpu_generator_state_bytes(int64_t* out) {
  MS_TRY({
    auto gen = at::detail::getDefaultCPUGenerator();
    *out = static_cast<int64_t>(at::Tensor(get_state(gen)).nbytes());
  })
}

// Running statistics (BatchNorm's running mean and variance, ...) that ops update
// between enter and exit on this thread are written back to their values at enter.
// Scopes nest and must exit in reverse order on the thread that entered them.
void* ms_running_stats_scope_enter() noexcept {
  try {
    return new RunningStatsGuard();
  } catch (...) {
    return nullptr;
  }
}

void ms_running_stats_scope_exit(void* scope) noexcept { delete static_cast<RunningStatsGuard*>(scope); }

// Whether the recomputation running on this thread has every tensor it needs back.
bool ms_checkpoint_recomputation_done() noexcept { return CheckpointFrame::current_recomputation_done(); }

// The message of the exception that ends a recomputation early: the Rust side keeps
// panics carrying it quiet.
const char* ms_checkpoint_stop_message() noexcept { return kStopMessage; }

// Takes ownership of `ctx` in every case: `drop(ctx)` runs exactly once, either before
// this returns (error, no graph) or when the autograd graph is freed.
//
// The outputs are returned as a vector handle: read it with `ms_tensor_vec_*`.
//
// With `pack_inputs`, the inputs are handed to the calling thread's innermost hook
// frame at the forward instead of being kept, and unpacked for the recompute.
//
// `name` (null: "the function") is what error messages call the function.
int ms_checkpoint(at::Tensor* const* inputs, size_t n_inputs, void* ctx, ms_run_fn run, ms_drop_fn drop,
                  const char* name, bool preserve_rng, bool early_stop, bool pack_inputs, void** out_vec) {
  std::unique_ptr<Closure> closure;
  try {
    closure = std::make_unique<Closure>(ctx, run, drop);
  } catch (...) {
    drop(ctx);
    memsave::set_last_error("checkpoint: out of memory");
    return 1;
  }
  MS_TRY({
    const std::string label = name == nullptr ? "the function" : name;
    std::vector<at::Tensor> in;
    in.reserve(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) in.push_back(inputs[i] == nullptr ? at::Tensor() : *inputs[i]);
    auto result = std::make_unique<std::vector<at::Tensor>>();
    if (!at::GradMode::is_enabled()) {
      // No graph is being built (inference or an outer no_grad): nothing to save.
      auto out = closure->call(in);
      MS_CHECK(!out.error, "checkpoint: ", label, " failed during the forward: ", *out.error);
      *result = std::move(out.tensors);
      *out_vec = result.release();
      return 0;
    }
    memsave::hooks::install_engine();
    if (recompute_depth > 0 && !recompute_runs_backward) {
      // Inside an outer checkpoint's recomputation: only the outer capture matters.
      Outputs out;
      {
        memsave::hooks::FrameScope scope(std::make_shared<DiscardFrame>());
        out = closure->call(in);
      }
      MS_CHECK(!out.error, "checkpoint: ", label, " failed during the forward: ", *out.error);
      *result = std::move(out.tensors);
      *out_vec = result.release();
      return 0;
    }
    // Inside a recomputation that runs a backward the frame is light: its inputs are not
    // packed, and what it builds is thrown away when the recomputation ends.
    const bool light = recompute_depth > 0;
    auto frame = std::make_shared<CheckpointFrame>(std::move(closure), label, preserve_rng, early_stop);
    if (pack_inputs && !light) frame->pack_inputs_with_current_hooks(in);
    *result = frame->forward(in);
    *out_vec = result.release();
  })
}

size_t ms_tensor_vec_len(const void* vec) noexcept {
  return static_cast<const std::vector<at::Tensor>*>(vec)->size();
}

// Writes a new handle to element `i` (a `new at::Tensor`, owned by the caller).
int ms_tensor_vec_get(const void* vec, size_t i, at::Tensor** out) {
  MS_TRY({ *out = new at::Tensor((*static_cast<const std::vector<at::Tensor>*>(vec)).at(i)); })
}

void ms_tensor_vec_free(void* vec) noexcept { delete static_cast<std::vector<at::Tensor>*>(vec); }

}  // extern "C"
