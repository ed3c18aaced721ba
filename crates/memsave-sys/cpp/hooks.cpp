// memsave's autograd engine and the Rust-facing saved-tensor hook frames.
#include "hooks.h"

#include "common.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_set>
#include <utility>

namespace memsave::hooks {
namespace {

struct Entry {
  std::shared_ptr<Frame> frame;
  at::CallbackHandle op_callback = at::INVALID_CALLBACK_HANDLE;
  uint64_t id = 0;
};

struct ThreadState {
  std::vector<Entry> stack;
  uint64_t last_id = 0;
  int disabled = 0;
  // Names of the aten ops running, innermost last (schema names live as long as the process).
  std::vector<const char*> ops;
  int op_recorders = 0;
  // Backward calls (graph tasks) started on this thread.
  uint64_t backward_calls = 0;
};

ThreadState& tls() {
  thread_local ThreadState state;
  return state;
}

using NodePtr = decltype(torch::autograd::Edge::function);

// The nodes reachable from `roots`, each after every node it leads to, held while the
// caller releases their saved tensors (which may free nodes reached only through them).
// With `outputs` (autograd::grad, backward with inputs), nodes created before every
// output's node are not walked below: they cannot lead to an output.

std::vector<NodePtr> nodes_children_first(
    const torch::autograd::edge_list& roots, const torch::autograd::edge_list& outputs) {
  using torch::autograd::Node;
  uint64_t min_topo_nr = 0;
  if (!outputs.empty()) {
    min_topo_nr = std::numeric_limits<uint64_t>::max();
    for (const auto& e : outputs) {
      if (e.function) min_topo_nr = std::min(min_topo_nr, e.function->topological_nr());
    }
  }
  std::vector<NodePtr> order;
  std::unordered_set<Node*> seen;
  // (node, index of the next edge to walk)
  std::vector<std::pair<NodePtr, size_t>> stack;
  const auto visit = [&](const NodePtr& fn) {
    if (fn && seen.insert(fn.get()).second) stack.emplace_back(fn, 0);
  };
  for (const auto& root : roots) {
    visit(root.function);
    while (!stack.empty()) {
      auto& [fn, next] = stack.back();
      const auto& edges = fn->next_edges();
      if (next < edges.size() && fn->topological_nr() >= min_topo_nr) {
        visit(edges[next++].function);  // may reallocate `stack`: `fn` is not used after
        continue;
      }
      order.push_back(std::move(fn));
      stack.pop_back();
    }
  }
  return order;
}

// Frees the saved tensors of the nodes the failed backward from `roots` would have run:
// all it reaches, or with `outputs`, those with a path to an output (the outputs' own
// nodes too when the backward accumulates into them), as the engine's GraphTask picks
// them (those it ran are freed already; freeing twice is harmless). Never throws: the
// backward's own error is what the caller reports.
void release_failed_graph(const torch::autograd::edge_list& roots, bool accumulate_grad,
                         const torch::autograd::edge_list& outputs) noexcept {
  using torch::autograd::Node;
  try {
    const auto nodes = nodes_children_first(roots, outputs);
    std::unordered_set<const Node*> output_nodes;
    for (const auto& e : outputs) output_nodes.insert(e.function.get());
    std::unordered_set<const Node*> runs;
    for (const auto& fn : nodes) {
      bool run = outputs.empty() || (accumulate_grad && output_nodes.count(fn.get()) > 0);
      for (const auto& e : fn->next_edges()) {
        const Node* child = e.function.get();
        if (run || child == nullptr) continue;
        run = runs.count(child) > 0 || output_nodes.count(child) > 0;
      }
      if (run) runs.insert(fn.get());
    }
    for (const auto& fn : nodes) {
      if (runs.count(fn.get()) > 0) fn->release_variables();
    }
  } catch (...) {
    // Out of memory while walking the graph: it stays as the base engine left it.
  }
}

// The base engine's behaviour, plus the calling thread's innermost hook frame.
struct MemsaveEngine final : torch::autograd::Engine {
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    auto& state = tls();
    if (state.disabled > 0 || state.stack.empty()) return nullptr;
    // Hooks of one frame are never asked for while that frame packs (DisableGuard).
    return state.stack.back().frame->make_hooks();
  }

  // A backward that fails without keep_graph frees the saved tensors of every node it
  // would have run, as one that succeeds does (the base engine frees only the nodes it
  // ran). Otherwise a graph with a reference cycle outlives every handle to it: a tensor
  // modified in place after a node saved it (`x += f(x)`) has a grad_fn that leads to
  // that node, which holds the tensor; the backward fails at its version check, before
  // that node, so nothing breaks the cycle.
  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs, bool keep_graph,
                                         bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    ++tls().backward_calls;
    try {
      return Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
    } catch (...) {
      if (!keep_graph) release_failed_graph(roots, accumulate_grad, outputs);
      throw;
    }
  }
};

torch::autograd::Engine& memsave_engine() {
  // Leaked on purpose: graphs can be freed during static destruction.
  static auto* engine = new MemsaveEngine();
  return *engine;
}

}  // namespace

// `t`'s grad_fn as stored, read without `grad_fn()`, which can regenerate a view's node
// as a side effect.
c10::intrusive_ptr<torch::autograd::Node> stored_grad_fn(const at::Tensor& t) {
  auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta != nullptr ? meta->grad_fn_ : c10::intrusive_ptr<torch::autograd::Node>();
}

SavedMeta SavedMeta::of(const at::Tensor& t) {
  SavedMeta m;
  m.sizes = t.sizes().vec();
  m.dtype = t.scalar_type();
  m.device = t.device();
  const auto fn = stored_grad_fn(t);
  m.producer = fn ? fn->name() : std::string(t.requires_grad() ? "leaf" : "constant");
  if (!t.is_inference()) {
    m.version = torch::autograd::impl::version_counter(t);
    m.track_version = m.version.enabled();
    if (m.track_version) m.saved_version = m.version.current_version();
  }
  return m;
}

std::string SavedMeta::describe() const {
  std::ostringstream s;
  s << "tensor " << c10::IntArrayRef(sizes) << " " << dtype << " on " << device << " saved from " << producer;
  return s.str();
}

void SavedMeta::check_version() const {
  if (!track_version) return;
  const auto now = version.current_version();
  MS_CHECK(now == saved_version, "a ", describe(),
              " needed for gradient computation was modified by an in-place operation (version ", saved_version,
              " at save, ", now, " now); clone it before modifying it, or use tch's out-of-place op");
}

void SavedMeta::check_unpacked(const at::Tensor& t, const char* who, const char* hint) const {
  MS_CHECK(t.defined(), who, " returned an undefined tensor for the ", describe(), "; ", hint);
  MS_CHECK(t.sizes() == c10::IntArrayRef(sizes) && t.scalar_type() == dtype, who, " gave a tensor of shape ",
              t.sizes(), " and dtype ", t.scalar_type(), " for the ", describe(), "; ", hint);
}

void install_engine() {
  static std::once_flag once;
  std::call_once(once, [] { torch::autograd::set_default_engine_stub(&memsave_engine); });
}

namespace {

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  tls().ops.push_back(fn.name());
  return nullptr;
}

void on_op_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
  auto& ops = tls().ops;
  if (!ops.empty()) ops.pop_back();
}

}  // namespace

uint64_t push(std::shared_ptr<Frame> frame, bool record_ops) {
  auto& state = tls();
  Entry entry{std::move(frame)};
  entry.id = ++state.last_id;
  if (record_ops) {
    entry.op_callback = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_op_start, &on_op_end).scopes({at::RecordScope::FUNCTION}));
    ++state.op_recorders;
  }
  try {
    state.stack.push_back(std::move(entry));
  } catch (...) {
    if (record_ops) {
      at::removeCallback(entry.op_callback);
      --state.op_recorders;
    }
    throw;
  }
  return state.stack.back().id;
}

Popped pop(uint64_t id) {
  auto& state = tls();
  auto& stack = state.stack;
  auto it = std::find_if(stack.rbegin(), stack.rend(), [id](const Entry& e) { return e.id == id; });
  if (id == 0 || it == stack.rend()) return Popped::kNotFound;
  const auto result = it == stack.rbegin() ? Popped::kInnermost : Popped::kOutOfOrder;
  // Move out first: the frame's destructor may run Rust code that pushes or pops.
  auto entry = std::move(*it);
  stack.erase(std::next(it).base());
  if (entry.op_callback != at::INVALID_CALLBACK_HANDLE) {
    at::removeCallback(entry.op_callback);
    if (--state.op_recorders == 0) state.ops.clear();
  }
  entry.frame.reset();
  return result;
}

std::unique_ptr<torch::autograd::SavedVariableHooks> current_hooks() {
  return memsave_engine().get_default_saved_variable_hooks();
}

uint64_t backward_calls_started() { return tls().backward_calls; }

const char* current_op() {
  const auto& state = tls();
  return state.op_recorders > 0 && !state.ops.empty() ? state.ops.back() : nullptr;
}

FrameScope::~FrameScope() {
  try {
    pop(id_);
  } catch (...) {
    // Destructors must not throw; a frame that cannot be popped stays until the thread ends.
  }
}

DisableGuard::DisableGuard() { ++tls().disabled; }
DisableGuard::~DisableGuard() { --tls().disabled; }

}  // namespace memsave::hooks

// ---------------------------------------------------------------------------------
// Hooks written in Rust: the frame owns a Rust context with pack/unpack callbacks.

typedef int (*ms_hook_pack_fn)(void* ctx, const at::Tensor* t, const char* saved_by, void** packed, void* error);
typedef int (*ms_hook_unpack_fn)(void* ctx, void* packed, at::Tensor* out, void* error);
typedef void (*ms_hook_free_fn)(void* ctx, void* packed);
typedef void (*ms_hook_drop_fn)(void* ctx);

namespace {

using memsave::hooks::SavedMeta;

struct RustHookFrame final : memsave::hooks::Frame, std::enable_shared_from_this<RustHookFrame> {
  void* ctx;
  ms_hook_pack_fn pack;
  ms_hook_unpack_fn unpack;
  ms_hook_free_fn free_packed;
  ms_hook_drop_fn drop;

  RustHookFrame(void* c, ms_hook_pack_fn p, ms_hook_unpack_fn u, ms_hook_free_fn f, ms_hook_drop_fn d)
      : ctx(c), pack(p), unpack(u), free_packed(f), drop(d) {}
  RustHookFrame(const RustHookFrame&) = delete;
  RustHookFrame& operator=(const RustHookFrame&) = delete;
  ~RustHookFrame() override { drop(ctx); }

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override;
};

struct RustSavedHooks final : torch::autograd::SavedVariableHooks {
  std::shared_ptr<RustHookFrame> frame;
  void* packed = nullptr;
  SavedMeta meta;

  explicit RustSavedHooks(std::shared_ptr<RustHookFrame> f) : frame(std::move(f)) {}
  RustSavedHooks(const RustSavedHooks&) = delete;
  RustSavedHooks& operator=(const RustSavedHooks&) = delete;
  ~RustSavedHooks() override {
    if (packed != nullptr) frame->free_packed(frame->ctx, packed);
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    meta = SavedMeta::of(tensor);
    const char* saved_by = memsave::hooks::current_op();
    memsave::hooks::DisableGuard no_hooks;
    std::string error;
    if (frame->pack(frame->ctx, &tensor, saved_by, &packed, &error) != 0) {
      // As in PyTorch, the op that saved the tensor fails: the forward stops there.
      packed = nullptr;
      MS_CHECK(false, "saved_tensors_hooks: the pack hook failed for the ", meta.describe(), ": ",
               error.empty() ? std::string("unknown error") : error);
    }
  }

  at::Tensor call_unpack_hook() override {
    meta.check_version();
    at::Tensor out;
    std::string error;
    if (frame->unpack(frame->ctx, packed, &out, &error) != 0) {
      MS_CHECK(false, "saved_tensors_hooks: the unpack hook failed for the ", meta.describe(), ": ",
                  error.empty() ? std::string("unknown error") : error);
    }
    meta.check_unpacked(out, "saved_tensors_hooks: the unpack hook",
                        "unpack must restore the packed shape and dtype");
    return out;
  }
};

std::unique_ptr<torch::autograd::SavedVariableHooks> RustHookFrame::make_hooks() {
  return std::make_unique<RustSavedHooks>(shared_from_this());
}

}  // namespace

extern "C" {

void ms_error_sink_set(void* sink, const char* message) noexcept {
  try {
    *static_cast<std::string*>(sink) = message == nullptr ? "unknown error" : message;
  } catch (...) {
  }
}

void ms_tensor_assign(at::Tensor* dst, const at::Tensor* src) noexcept { *dst = *src; }

int ms_hooks_install_engine() {
  MS_TRY({ memsave::hooks::install_engine(); })
}

// Takes ownership of `ctx` in every case: `drop(ctx)` runs exactly once, when the
// frame and every tensor packed by it are gone (or before this returns on error).
int ms_hooks_push(void* ctx, ms_hook_pack_fn pack, ms_hook_unpack_fn unpack, ms_hook_free_fn free_packed,
                  ms_hook_drop_fn drop, bool record_ops, uint64_t* id) {
  std::shared_ptr<RustHookFrame> frame;
  try {
    frame = std::make_shared<RustHookFrame>(ctx, pack, unpack, free_packed, drop);
  } catch (...) {
    drop(ctx);
    memsave::set_last_error("saved_tensors_hooks: out of memory creating a hook frame");
    return 1;
  }
  MS_TRY({
    memsave::hooks::install_engine();
    *id = memsave::hooks::push(std::move(frame), record_ops);
  })
}

// Writes the name of `t`'s grad_fn into `sink` (a std::string), or nothing when it has
// none.
int ms_tensor_grad_fn_name(const at::Tensor* t, void* sink, bool* has) {
  MS_TRY({
    MS_CHECK(t->defined(), "the tensor is undefined");
    const auto fn = memsave::hooks::stored_grad_fn(*t);
    *has = fn != nullptr;
    if (fn != nullptr) *static_cast<std::string*>(sink) = fn->name();
  })
}

// Writes the name of the autograd node the calling thread is running in backward
// (`AddmmBackward0`) into `sink`, or nothing when it runs none. Inside an unpack hook
// that is the node that saved the tensor.
int ms_current_autograd_node_name(void* sink, bool* has) {
  MS_TRY({
    const auto fn = torch::autograd::get_current_node();
    *has = fn != nullptr;
    if (fn != nullptr) *static_cast<std::string*>(sink) = fn->name();
  })
}

int ms_string_new(void** out) {
  MS_TRY({ *out = new std::string(); })
}

const char* ms_string_data(const void* s) noexcept { return static_cast<const std::string*>(s)->c_str(); }

void ms_string_free(void* s) noexcept { delete static_cast<std::string*>(s); }

// `*popped`: 0 no such frame on this thread, 1 it was the innermost, 2 it was removed
// from under newer frames (left out of order).
int ms_hooks_pop(uint64_t id, int* popped) {
  MS_TRY({ *popped = static_cast<int>(memsave::hooks::pop(id)); })
}

}  // extern "C"
