// A counting CPU allocator: exact current and peak bytes of every tensor storage
// allocated through c10's CPU allocator, with an optional limit that simulates a
// device of N bytes.
//
// The DataPtr keeps the raw-deleter convention (context == data pointer, deleter ==
// raw_deleter()): oneDNN and bf16 kernels check `get() == get_context()`.
#include "common.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#if __has_include(<malloc.h>)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

// One allocation or free seen while recording (see ms_cpu_trace_start); `bytes` is
// negative for a free, `allocated_after` the counter right after it.
struct MsAllocEvent {
  uint64_t addr;
  int64_t bytes;
  int64_t allocated_after;
  uint64_t time_ns;
};

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

struct Counters {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;  // pointer -> bytes, for frees and the summary
  int64_t current = 0;
  int64_t peak = 0;
  int64_t limit = -1;  // -1: no limit
  int64_t pending = 0;  // bytes being allocated right now, reserved against the limit
  // The opt-in event recorder: off, it costs one bool test under the lock already held.
  bool recording = false;
  std::vector<MsAllocEvent> events;

  // Called with `mu` held; `after` is `current` once the event has happened.
  void record(void* ptr, int64_t bytes, int64_t after) {
    if (recording) events.push_back({reinterpret_cast<uint64_t>(ptr), bytes, after, now_ns()});
  }
};

// Leaked on purpose: storages can be freed during static destruction.
Counters& counters() {
  static Counters* c = new Counters();
  return *c;
}

// A deleter runs inside destructors: it must not throw, and always frees.
void counting_delete(void* ptr) noexcept {
  if (ptr == nullptr) return;
  auto& c = counters();
  try {
    std::lock_guard<std::mutex> guard(c.mu);
    auto it = c.live.find(ptr);
    if (it != c.live.end()) {
      const auto bytes = static_cast<int64_t>(it->second);
      c.current -= bytes;
      c.live.erase(it);
      c.record(ptr, -bytes, c.current);
    }
  } catch (...) {
  }
  c10::free_cpu(ptr);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    auto& c = counters();
    const auto n = static_cast<int64_t>(nbytes);
    {
      // Reserve against the limit; the counter itself moves only once the memory is
      // there, in the same critical section as the recorder's event.
      std::lock_guard<std::mutex> guard(c.mu);
      if (c.limit >= 0 && c.current + c.pending + n > c.limit) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "memsave: CPU out of memory: tried to allocate ", nbytes,
                         " bytes with ", c.current, " bytes allocated and a memory limit of ", c.limit,
                         " bytes (set_memory_limit)");
      }
      c.pending += n;
    }
    void* ptr = nullptr;
    try {
      ptr = c10::alloc_cpu(nbytes);
    } catch (...) {
      std::lock_guard<std::mutex> guard(c.mu);
      c.pending -= n;
      throw;
    }
    if (ptr == nullptr) {
      std::lock_guard<std::mutex> guard(c.mu);
      c.pending -= n;
    } else {
      try {
        std::lock_guard<std::mutex> guard(c.mu);
        c.pending -= n;
        c.live.emplace(ptr, nbytes);
        try {
          c.record(ptr, n, c.current + n);
        } catch (...) {
          c.live.erase(ptr);
          throw;
        }
        c.current += n;
        c.peak = std::max(c.peak, c.current);
      } catch (...) {
        // Not tracked: give the memory back rather than leak it (the counter moved
        // only after a successful emplace, so there is nothing to undo).
        c10::free_cpu(ptr);
        throw;
      }
    }
    return {ptr, ptr, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// See ms_c_mapped_blocks (outside MS_TRY: no preprocessor lines in a macro's arguments).
int64_t c_mapped_blocks() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  return static_cast<int64_t>(mallinfo2().hblks);
#else
  return -1;
#endif
}

}  // namespace

extern "C" {

int ms_cpu_install_counting_allocator() {
  MS_TRY({
    // Function-local static: installed exactly once, thread-safely.
    static bool installed = [] {
      static CountingAllocator* allocator = new CountingAllocator();
      c10::SetCPUAllocator(allocator, /*priority=*/100);
      return true;
    }();
    (void)installed;
  })
}

int ms_cpu_counting_allocator_active(bool* out) {
  MS_TRY({ *out = dynamic_cast<CountingAllocator*>(c10::GetCPUAllocator()) != nullptr; })
}

int ms_cpu_storage_counted(const at::Tensor* t, bool* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    *out = false;
    if (t->has_storage() && t->device().is_cpu()) {
      const void* data = t->storage().data();
      auto& c = counters();
      std::lock_guard<std::mutex> guard(c.mu);
      *out = c.live.find(const_cast<void*>(data)) != c.live.end();
    }
  })
}

int ms_cpu_allocated(int64_t* out) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    *out = c.current;
  })
}

int ms_cpu_peak(int64_t* out) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    *out = c.peak;
  })
}

int ms_cpu_reset_peak() {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    c.peak = c.current;
  })
}

// Raises the peak to at least `value` (restores an outer scope's peak after an inner reset).
int ms_cpu_raise_peak(int64_t value) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    c.peak = std::max(c.peak, value);
  })
}

int ms_cpu_set_limit(int64_t limit) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    c.limit = limit;
  })
}

int ms_cpu_limit(int64_t* out) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    *out = c.limit;
  })
}

int ms_cpu_live_allocations(int64_t* out) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    *out = static_cast<int64_t>(c.live.size());
  })
}

// Writes the sizes of the `cap` largest live allocations, largest first, and how many.
int ms_cpu_largest_allocations(int64_t* out, size_t cap, size_t* written) {
  MS_TRY({
    std::vector<int64_t> sizes;
    {
      auto& c = counters();
      std::lock_guard<std::mutex> guard(c.mu);
      sizes.reserve(c.live.size());
      for (const auto& entry : c.live) sizes.push_back(static_cast<int64_t>(entry.second));
    }
    const size_t n = std::min(cap, sizes.size());
    std::partial_sort(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(n), sizes.end(),
                      std::greater<int64_t>());
    std::copy(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(n), out);
    *written = n;
  })
}

// Starts recording allocation events; `started` is false when a recording is already
// on. The stream opens with one event per storage already live (time 0), so that
// replaying it gives the counter at every event.
int ms_cpu_trace_start(bool* started) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    *started = !c.recording;
    if (!*started) return 0;
    c.events.clear();
    c.events.reserve(c.live.size() + 4096);
    int64_t running = 0;
    for (const auto& entry : c.live) {
      running += static_cast<int64_t>(entry.second);
      c.events.push_back(
          {reinterpret_cast<uint64_t>(entry.first), static_cast<int64_t>(entry.second), running, 0});
    }
    c.recording = true;
  })
}

// How many events have been recorded so far: a position in the stream.
int ms_cpu_trace_position(size_t* out) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    *out = c.events.size();
  })
}

// Stops recording; `count` is the number of events to read with ms_cpu_trace_read.
int ms_cpu_trace_stop(size_t* count) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    c.recording = false;
    *count = c.events.size();
  })
}

// Copies up to `cap` events of a stopped recording into `out`, then forgets them all.
int ms_cpu_trace_read(MsAllocEvent* out, size_t cap, size_t* written) {
  MS_TRY({
    auto& c = counters();
    std::lock_guard<std::mutex> guard(c.mu);
    const size_t n = c.recording ? 0 : std::min(cap, c.events.size());
    std::copy(c.events.begin(), c.events.begin() + static_cast<std::ptrdiff_t>(n), out);
    *written = n;
    if (!c.recording) std::vector<MsAllocEvent>().swap(c.events);
  })
}

// Blocks the C library's malloc serves from mappings of their own (glibc's
// mallinfo2().hblks), or -1 where the C library does not say.
int ms_c_mapped_blocks(int64_t* out) {
  MS_TRY({ *out = c_mapped_blocks(); })
}

}  // extern "C"
