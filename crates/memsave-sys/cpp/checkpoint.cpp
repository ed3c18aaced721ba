// A custom autograd node whose backward recomputes a Rust closure.
//
// `ms_checkpoint` runs the closure once without building a graph, then gives its
// differentiable outputs a `MemsaveCheckpointBackward` node. The node keeps only the
// closure and its inputs; in backward it restores the RNG and autocast state of the
// forward, reruns the closure with grad enabled and back-propagates through it
// (a reentrant backward), so parameter gradients accumulate as without
// checkpointing, and returns the gradients of the inputs.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The Rust side: runs the closure on `inputs` and reports through `ms_outputs_*`.
typedef void (*ms_run_fn)(void* ctx, at::Tensor* const* inputs, size_t n_inputs, void* outputs);
typedef void (*ms_drop_fn)(void* ctx);

namespace {

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

  std::vector<at::Tensor> call(const std::vector<at::Tensor>& inputs, const char* phase) const {
    std::vector<at::Tensor*> ptrs;
    ptrs.reserve(inputs.size());
    for (const auto& t : inputs) ptrs.push_back(const_cast<at::Tensor*>(&t));
    Outputs out;
    run(ctx, ptrs.data(), ptrs.size(), &out);
    TORCH_CHECK(!out.error, "checkpoint: the function failed during the ", phase, ": ", *out.error);
    return std::move(out.tensors);
  }
};

// RNG and autocast state captured at forward and restored for the recompute.
struct ForwardState {
  std::vector<std::pair<at::Generator, c10::intrusive_ptr<c10::TensorImpl>>> rng;
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

  static c10::intrusive_ptr<c10::TensorImpl> get_state(at::Generator& gen) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state().getIntrusivePtr();
  }

  static void set_state(at::Generator& gen, const c10::intrusive_ptr<c10::TensorImpl>& state) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(at::Tensor(state));
  }
};

// Applies a ForwardState for its lifetime and restores what was there before.
class ReplayGuard {
 public:
  explicit ReplayGuard(const ForwardState& fwd)
      : saved_(ForwardState::capture({}, false)) {
    for (const auto& entry : fwd.rng) {
      auto gen = entry.first;
      rng_before_.emplace_back(gen, ForwardState::get_state(gen));
      ForwardState::set_state(gen, entry.second);
    }
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, fwd.autocast_cpu);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, fwd.autocast_cpu_dtype);
    at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, fwd.autocast_cuda);
    at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, fwd.autocast_cuda_dtype);
    // An autocast scope of its own, as torch.autocast's __enter__: when it is the
    // outermost one, leaving it clears the cache of casted weights.
    at::autocast::increment_nesting();
  }
  ReplayGuard(const ReplayGuard&) = delete;
  ReplayGuard& operator=(const ReplayGuard&) = delete;
  ~ReplayGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    for (auto& entry : rng_before_) ForwardState::set_state(entry.first, entry.second);
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, saved_.autocast_cpu);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, saved_.autocast_cpu_dtype);
    at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, saved_.autocast_cuda);
    at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, saved_.autocast_cuda_dtype);
  }

 private:
  ForwardState saved_;
  std::vector<std::pair<at::Generator, c10::intrusive_ptr<c10::TensorImpl>>> rng_before_;
};

struct OutputMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  bool differentiable;
};

bool is_differentiable(const at::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

// The root of the recompute's backward: hands its gradients on and keeps no reference,
// so each incoming gradient is freed as soon as the node it feeds has used it. (A plain
// `torch::autograd::backward(outputs, grads)` call would hold the recomputed outputs
// and their gradients until the whole nested backward returns: one activation and one
// gradient per nesting level.)
class GradientFeeder final : public Node {
 public:
  // `trigger` is the empty tensor the engine is started with (no bytes allocated).
  GradientFeeder(torch::autograd::edge_list&& next, variable_list grads, const at::Tensor& trigger)
      : Node(std::move(next)), grads_(std::move(grads)) {
    add_input_metadata(trigger);
  }
  std::string name() const override { return "MemsaveCheckpointGradientFeeder"; }
  variable_list apply(variable_list&& /*unused*/) override { return std::move(grads_); }

 private:
  variable_list grads_;
};

class CheckpointBackward final : public Node {
 public:
  CheckpointBackward(torch::autograd::edge_list&& next, std::unique_ptr<Closure> closure,
                     std::vector<at::Tensor> inputs, ForwardState state, std::vector<OutputMeta> meta)
      : Node(std::move(next)),
        closure_(std::move(closure)),
        inputs_(std::move(inputs)),
        state_(std::move(state)),
        meta_(std::move(meta)) {
    for (const auto& t : inputs_) {
      requires_grad_.push_back(t.defined() && t.requires_grad());
      versions_.push_back(t.defined() ? static_cast<int64_t>(t._version()) : 0);
    }
    for (auto& t : inputs_) {
      if (t.defined()) t = t.detach();  // shares storage and version counter, drops the graph
    }
  }

  std::string name() const override { return "MemsaveCheckpointBackward"; }

  // Called by the engine once this node has run (unless the graph is kept): frees the
  // saved inputs and the stashed RNG state, though the node itself lives on with the graph.
  void release_variables() override {
    inputs_.clear();
    state_.rng.clear();
    released_ = true;
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!released_,
                "checkpoint: trying to backward through the graph a second time; pass keep_graph=true "
                "to the first backward if you need to");
    std::vector<at::Tensor> replay_inputs;
    replay_inputs.reserve(inputs_.size());
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const auto& saved = inputs_[i];
      if (!saved.defined()) {
        replay_inputs.emplace_back();
        continue;
      }
      const auto now = static_cast<int64_t>(saved._version());
      TORCH_CHECK(now == versions_[i], "checkpoint: input ", i,
                  " was modified in place after the checkpointed forward (version ", versions_[i], " -> ", now,
                  "); the recomputation would use the new values. Clone it before modifying it.");
      auto x = saved.detach();
      if (requires_grad_[i]) x.requires_grad_(true);
      replay_inputs.push_back(std::move(x));
    }

    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode enable_grad(true);
      ReplayGuard replay(state_);
      outputs = closure_->call(replay_inputs, "recomputation in backward");
    }
    TORCH_CHECK(outputs.size() == meta_.size(), "checkpoint: the recomputation returned ", outputs.size(),
                " tensors but the forward returned ", meta_.size(), "; the function must be deterministic");
    torch::autograd::edge_list roots;
    variable_list root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const auto& out = outputs[i];
      const auto& meta = meta_[i];
      TORCH_CHECK(out.defined() && out.sizes().vec() == meta.sizes && out.scalar_type() == meta.dtype,
                  "checkpoint: output ", i, " of the recomputation has shape ",
                  out.defined() ? c10::str(out.sizes()) : std::string("undefined"), " and dtype ",
                  out.defined() ? c10::str(out.scalar_type()) : std::string("undefined"),
                  " but the forward produced shape ", c10::IntArrayRef(meta.sizes), " and dtype ", meta.dtype,
                  "; the function must compute the same thing when it is rerun");
      if (!meta.differentiable || i >= grads.size() || !grads[i].defined() || !out.requires_grad()) continue;
      roots.push_back(torch::autograd::impl::gradient_edge(out));
      root_grads.push_back(std::move(grads[i]));
    }
    // Only the graph edges are needed from here on: drop the recomputed outputs and the
    // incoming gradients now, so that they are freed as soon as the graph is done with them.
    outputs.clear();
    grads.clear();
    if (!roots.empty()) {
      const auto trigger = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
      auto feeder = c10::make_intrusive<GradientFeeder>(std::move(roots), std::move(root_grads), trigger);
      torch::autograd::Engine::get_default_engine().execute({Edge(std::move(feeder), 0)}, {trigger},
                                                            /*keep_graph=*/false, /*create_graph=*/false,
                                                            /*accumulate_grad=*/true);
    }
    variable_list result;
    result.reserve(replay_inputs.size());
    for (size_t i = 0; i < replay_inputs.size(); ++i) {
      result.push_back(requires_grad_[i] ? replay_inputs[i].grad() : at::Tensor());
    }
    return result;
  }

 private:
  std::unique_ptr<Closure> closure_;
  std::vector<at::Tensor> inputs_;
  std::vector<bool> requires_grad_;
  std::vector<int64_t> versions_;
  ForwardState state_;
  std::vector<OutputMeta> meta_;
  bool released_ = false;
};

}  // namespace

extern "C" {

void ms_outputs_push(void* outputs, const at::Tensor* t) {
  static_cast<Outputs*>(outputs)->tensors.push_back(t == nullptr ? at::Tensor() : *t);
}

void ms_outputs_fail(void* outputs, const char* message) {
  static_cast<Outputs*>(outputs)->error = std::string(message == nullptr ? "unknown error" : message);
}

// Takes ownership of `ctx` in every case: `drop(ctx)` runs exactly once, either before
// this returns (error, no graph) or when the autograd graph is freed.
//
// The outputs are returned as a vector handle: read it with `ms_tensor_vec_*`.
int ms_checkpoint(at::Tensor* const* inputs, size_t n_inputs, void* ctx, ms_run_fn run, ms_drop_fn drop,
                  bool preserve_rng, void** out_vec) {
  auto closure = std::make_unique<Closure>(ctx, run, drop);
  MS_TRY({
    std::vector<at::Tensor> in;
    in.reserve(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) in.push_back(inputs[i] == nullptr ? at::Tensor() : *inputs[i]);
    auto result = std::make_unique<std::vector<at::Tensor>>();
    if (!at::GradMode::is_enabled()) {
      // No graph is being built (inference or an outer no_grad): nothing to save.
      *result = closure->call(in, "forward");
      *out_vec = result.release();
      return 0;
    }
    auto state = ForwardState::capture(in, preserve_rng);
    std::vector<at::Tensor> outputs;
    {
      at::NoGradGuard no_grad;
      outputs = closure->call(in, "forward");
    }
    std::vector<OutputMeta> meta;
    meta.reserve(outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      const auto& o = outputs[i];
      TORCH_CHECK(o.defined(), "checkpoint: output ", i, " of the function is undefined");
      meta.push_back({o.sizes().vec(), o.scalar_type(), is_differentiable(o)});
    }
    auto node = c10::make_intrusive<CheckpointBackward>(torch::autograd::collect_next_edges(in),
                                                        std::move(closure), in, std::move(state), meta);
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (meta[i].differentiable) {
        // A fresh TensorImpl sharing storage: an output that aliases an input must not
        // change the input's own autograd history.
        auto wrapped = outputs[i].detach();
        torch::autograd::impl::set_gradient_edge(wrapped, Edge(node, node->add_input_metadata(wrapped)));
        result->push_back(std::move(wrapped));
      } else {
        node->add_input_metadata(Node::undefined_input());
        result->push_back(outputs[i]);
      }
    }
    *out_vec = result.release();
  })
}

size_t ms_tensor_vec_len(const void* vec) { return static_cast<const std::vector<at::Tensor>*>(vec)->size(); }

// A new handle to element `i` (a `new at::Tensor`, owned by the caller).
at::Tensor* ms_tensor_vec_get(const void* vec, size_t i) {
  return new at::Tensor((*static_cast<const std::vector<at::Tensor>*>(vec))[i]);
}

void ms_tensor_vec_free(void* vec) { delete static_cast<std::vector<at::Tensor>*>(vec); }

}  // extern "C"
