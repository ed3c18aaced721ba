// Distributed collectives on libtorch's c10d: stores (TCP or file rendezvous) and a
// Gloo process group, with blocking collectives that wait at most a timeout.
//
// Compiled with USE_C10D_GLOO, against gloo's headers (Debian's libgloo-dev); the
// symbols are in libtorch_cpu. Every error message starts with the rank that saw it.
#include "common.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

struct StoreHandle {
  c10::intrusive_ptr<c10d::Store> store;
};

struct GroupHandle {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  int rank;
  int size;
  std::chrono::milliseconds timeout;
};

std::string str_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// Runs `body`, prefixing any error with the rank and the operation.
template <typename F>
void as_rank(int rank, const char* op, F&& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    throw std::runtime_error(c10::str("rank ", rank, ": ", op, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw std::runtime_error(c10::str("rank ", rank, ": ", op, ": ", e.what()));
  }
}

// Waits for a collective, refusing to wait longer than the group's timeout; then
// waits (briefly) until the group's worker thread has let go of the work, so that
// its tensors are released when the caller's reference is, not some time later: the
// memory meter sees exact bytes right after a collective returns.
void finish(GroupHandle* g, c10::intrusive_ptr<c10d::Work> work) {
  MS_CHECK(work->wait(g->timeout), "timed out after ", g->timeout.count(), " ms");
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (work.use_count() > 1 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
}

// A collective started without waiting (`async_op=True`): the work, the group it runs
// on (kept alive while the work is) and the group's timeout and rank for errors.
struct WorkHandle {
  c10::intrusive_ptr<c10d::Work> work;
  GroupHandle group;  // a copy: holds a reference to the process group
  bool waited;
};

}  // namespace

extern "C" {

// A TCPStore: the server (rank 0) listens on `port` of `host`, clients connect to it.
int ms_dist_store_tcp(const char* host, uint16_t port, bool is_server, int world_size, int64_t timeout_ms,
                      void** out) {
  MS_TRY({
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server;
    opts.numWorkers = world_size;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *out = new StoreHandle{store};
  })
}

// A FileStore on `path`, shared by `world_size` processes (on one machine or a shared file system).
int ms_dist_store_file(const char* path, int world_size, int64_t timeout_ms, void** out) {
  MS_TRY({
    auto store = c10::make_intrusive<c10d::FileStore>(std::string(path), world_size);
    store->setTimeout(std::chrono::milliseconds(timeout_ms));
    *out = new StoreHandle{store};
  })
}

void ms_dist_store_free(void* store) noexcept { delete static_cast<StoreHandle*>(store); }

// Joins a Gloo process group over `store` as `rank` of `size`. First checks, through
// the store, that every rank agrees on the world size, then builds the group with a
// device bound to `hostname`.
int ms_dist_group_gloo(void* store, int rank, int size, const char* hostname, int64_t timeout_ms, void** out) {
  MS_TRY({
    MS_CHECK(size >= 1, "rank ", rank, ": world size must be at least 1, got ", size);
    MS_CHECK(rank >= 0 && rank < size, "rank ", rank, ": rank must be in 0..", size, " (world size ", size, ")");
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto base = static_cast<StoreHandle*>(store)->store;
    as_rank(rank, "rendezvous", [&] {
      base->setTimeout(timeout);
      base->set("memsave/world_size/" + std::to_string(rank), bytes_of(std::to_string(size)));
      std::vector<std::string> keys;
      for (int r = 0; r < size; ++r) keys.push_back("memsave/world_size/" + std::to_string(r));
      try {
        base->wait(keys, timeout);
      } catch (const std::exception&) {
        std::string missing;
        for (const auto& key : keys) {
          if (!base->check({key})) missing += (missing.empty() ? "" : ", ") + key.substr(19);
        }
        throw std::runtime_error(c10::str("ranks [", missing, "] did not join within ", timeout_ms,
                                          " ms (is every rank started with WORLD_SIZE=", size, "?)"));
      }
      for (int r = 0; r < size; ++r) {
        auto theirs = str_of(base->get(keys[r]));
        MS_CHECK(theirs == std::to_string(size), "world size mismatch: this rank has ", size, ", rank ", r,
                 " has ", theirs);
      }
    });
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    // One worker thread: collectives run one at a time, in the order they are issued.
    opts->threads = 1;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
    as_rank(rank, "creating the Gloo process group", [&] {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("memsave/gloo", base);
      pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, opts);
    });
    *out = new GroupHandle{pg, rank, size, timeout};
  })
}

void ms_dist_group_free(void* group) noexcept { delete static_cast<GroupHandle*>(group); }

// Sums `t` across the group, in place.
int ms_dist_all_reduce_sum(void* group, at::Tensor* t) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "all_reduce", [&] {
      std::vector<at::Tensor> tensors{*t};
      finish(g, g->pg->allreduce(tensors, c10d::AllreduceOptions()));
    });
  })
}

// `output` (n values) receives the sum over ranks of this rank's slice of `input` (size × n values).
int ms_dist_reduce_scatter_sum(void* group, at::Tensor* output, at::Tensor* input) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "reduce_scatter", [&] {
      MS_CHECK(input->numel() == output->numel() * g->size, "input has ", input->numel(),
               " values; expected world size × output = ", g->size, " × ", output->numel());
      finish(g, g->pg->_reduce_scatter_base(*output, *input, c10d::ReduceScatterOptions()));
    });
  })
}

// `output` (size × n values) receives every rank's `input` (n values), in rank order.
int ms_dist_all_gather(void* group, at::Tensor* output, at::Tensor* input) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "all_gather", [&] {
      MS_CHECK(output->numel() == input->numel() * g->size, "output has ", output->numel(),
               " values; expected world size × input = ", g->size, " × ", input->numel());
      finish(g, g->pg->_allgather_base(*output, *input, c10d::AllgatherOptions()));
    });
  })
}

// Starts what ms_dist_all_gather does without waiting: `*out` receives a work handle
// (the work keeps both tensors alive until it is done). Wait with ms_dist_work_wait;
// ms_dist_work_free waits too when it was not waited.
int ms_dist_all_gather_start(void* group, at::Tensor* output, at::Tensor* input, void** out) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "all_gather (started)", [&] {
      MS_CHECK(output->numel() == input->numel() * g->size, "output has ", output->numel(),
               " values; expected world size × input = ", g->size, " × ", input->numel());
      auto work = g->pg->_allgather_base(*output, *input, c10d::AllgatherOptions());
      *out = new WorkHandle{work, *g, false};
    });
  })
}

// Waits for a started collective (at most the group's timeout), as the blocking ones do,
// and lets go of it. Only the first call waits; later ones return 0.
int ms_dist_work_wait(void* work) {
  MS_TRY({
    auto w = static_cast<WorkHandle*>(work);
    if (w->waited) return 0;
    w->waited = true;
    as_rank(w->group.rank, "waiting for a started collective", [&] { finish(&w->group, std::move(w->work)); });
  })
}

// Frees a work handle; waits for the collective first when it was not waited, so that it
// never runs on tensors the caller has given up. Errors are dropped here (wait first to
// see them).
void ms_dist_work_free(void* work) noexcept {
  auto w = static_cast<WorkHandle*>(work);
  if (!w->waited) {
    try {
      finish(&w->group, std::move(w->work));
    } catch (...) {
    }
  }
  try {
    delete w;
  } catch (...) {
  }
}

// Sends `input_counts[r]` values of `input` (in rank order) to rank r and receives
// `output_counts[r]` values from rank r into `output` (in rank order): c10d's
// `alltoall_base`, Gloo's alltoallv. `n` is the length of both count arrays (the world size).
int ms_dist_all_to_all(void* group, at::Tensor* output, at::Tensor* input, const int64_t* output_counts,
                       const int64_t* input_counts, int n) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "all_to_all", [&] {
      MS_CHECK(n == g->size, "got ", n, " split sizes; expected the world size ", g->size);
      std::vector<int64_t> out_counts(output_counts, output_counts + n);
      std::vector<int64_t> in_counts(input_counts, input_counts + n);
      int64_t out_total = 0, in_total = 0;
      for (int r = 0; r < n; ++r) {
        MS_CHECK(out_counts[r] >= 0 && in_counts[r] >= 0, "split sizes must not be negative");
        out_total += out_counts[r];
        in_total += in_counts[r];
      }
      MS_CHECK(out_total == output->numel(), "output has ", output->numel(), " values; the output split sizes add up to ",
               out_total);
      MS_CHECK(in_total == input->numel(), "input has ", input->numel(), " values; the input split sizes add up to ",
               in_total);
      finish(g, g->pg->alltoall_base(*output, *input, out_counts, in_counts, c10d::AllToAllOptions()));
    });
  })
}

// Copies `t` of rank `src` into `t` of every rank.
int ms_dist_broadcast(void* group, at::Tensor* t, int src) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "broadcast", [&] {
      MS_CHECK(src >= 0 && src < g->size, "source rank ", src, " is not in 0..", g->size);
      std::vector<at::Tensor> tensors{*t};
      c10d::BroadcastOptions opts;
      opts.rootRank = src;
      finish(g, g->pg->broadcast(tensors, opts));
    });
  })
}

// Returns once every rank has reached it.
int ms_dist_barrier(void* group) {
  MS_TRY({
    auto g = static_cast<GroupHandle*>(group);
    as_rank(g->rank, "barrier", [&] { finish(g, g->pg->barrier(c10d::BarrierOptions())); });
  })
}

// Sets the gradient of the leaf `t` to `grad` (same shape), as PyTorch's `t.grad = grad`.
int ms_dist_set_grad(at::Tensor* t, const at::Tensor* grad) {
  MS_TRY({
    MS_CHECK(t->defined() && grad->defined(), "set_grad: undefined tensor");
    MS_CHECK(t->sizes() == grad->sizes(), "set_grad: gradient shape ", grad->sizes(), " differs from ",
             t->sizes());
    t->mutable_grad() = *grad;
  })
}

}  // extern "C"
