#include "hp/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <cstring>

#include <atomic>
#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <unistd.h>

#include "hp/config.h"
#include "hp/core/compat.h"
#include "hp/core/error.h"
#include "tsan.h"

#if HP_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace hp::memory {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};

void add_bytes(int64_t n) {
  int64_t now = g_current.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Each allocation carries a 64-byte header (keeping the data 64-byte aligned) holding its
// size; the DataPtr's context is the data pointer itself, as libtorch's raw_allocate
// requires, and the deleter finds the header from it.
constexpr size_t kHeader = 64;
c10::DeleterFnPtr g_inner_free = nullptr;

// ---- deferred allocation: scratch blocks shared by every tensor allocated meanwhile ----

thread_local int t_deferred = 0;
struct Scratch {
  size_t bytes = 0;
  int64_t users = 0;     // live tensors on it
  bool current = false;  // still handed out by a DeferredAllocation
};
std::mutex g_scratch_mu;
std::map<const void*, Scratch> g_scratch;  // by base pointer
const void* g_scratch_current = nullptr;
std::atomic<int> g_scratch_blocks{0};  // fast check in the common free path

// Call with g_scratch_mu held.
void release_if_unused(std::map<const void*, Scratch>::iterator it) {
  if (it->second.users > 0 || it->second.current) return;
  g_current.fetch_sub(static_cast<int64_t>(it->second.bytes), std::memory_order_relaxed);
  std::free(const_cast<void*>(it->first));
  g_scratch.erase(it);
  --g_scratch_blocks;
}

void scratch_free(void* data) {
  std::lock_guard<std::mutex> g(g_scratch_mu);
  auto it = g_scratch.find(data);
  if (it == g_scratch.end()) return;
  --it->second.users;
  release_if_unused(it);
}

c10::DataPtr scratch_allocate(size_t n) {
  std::lock_guard<std::mutex> g(g_scratch_mu);
  auto cur = g_scratch.find(g_scratch_current);
  if (cur == g_scratch.end()) {
    // A new deferred scope reuses a live block that is large enough (one kept alive by
    // tensors still waiting for storage), rather than allocating another.
    for (auto it = g_scratch.begin(); it != g_scratch.end(); ++it) {
      if (it->second.bytes >= n && (cur == g_scratch.end() || it->second.bytes > cur->second.bytes)) cur = it;
    }
    if (cur != g_scratch.end()) {
      cur->second.current = true;
      g_scratch_current = cur->first;
    }
  }
  if (cur == g_scratch.end() || cur->second.bytes < n) {
    size_t bytes = std::max<size_t>(n, 64);
    if (cur != g_scratch.end()) {
      bytes = std::max(bytes, cur->second.bytes);
      cur->second.current = false;
      release_if_unused(cur);
    }
    void* base = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (base == nullptr) throw std::bad_alloc();
    Scratch sc;
    sc.bytes = bytes;
    sc.current = true;
    cur = g_scratch.emplace(base, sc).first;
    g_scratch_current = base;
    ++g_scratch_blocks;
    add_bytes(static_cast<int64_t>(bytes));
  }
  ++cur->second.users;
  void* data = const_cast<void*>(cur->first);
  return c10::DataPtr(data, data, &scratch_free, c10::Device(c10::kCPU));
}

void counted_free(void* data) {
  if (data == nullptr) return;
  tsan::before_free();
  if (g_scratch_blocks.load(std::memory_order_relaxed) > 0) {
    // A raw free of a scratch pointer (raw_allocate's pairing) goes to its block.
    std::unique_lock<std::mutex> g(g_scratch_mu);
    if (g_scratch.count(data)) {
      g.unlock();
      scratch_free(data);
      return;
    }
  }
  char* base = static_cast<char*>(data) - kHeader;
  int64_t n = 0;
  std::memcpy(&n, base, sizeof n);
  g_current.fetch_sub(n, std::memory_order_relaxed);
  g_inner_free(base);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) HP_ALLOCATOR_ALLOCATE_CONST override {
    if (t_deferred > 0 && n > 0) return scratch_allocate(n);
    c10::DataPtr p = inner_->allocate(n + kHeader);
    c10::Device dev = p.device();
    char* base = static_cast<char*>(p.release_context());
    int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof bytes);
    add_bytes(bytes);
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &counted_free, dev);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
#if HP_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif

 private:
  c10::Allocator* inner_;
};

std::once_flag g_install_once;
std::atomic<bool> g_installed{false};

int64_t read_kb(const char* file, const char* key) {
  std::ifstream f(file);
  std::string line;
  const std::string k = key;
  while (std::getline(f, line)) {
    if (line.compare(0, k.size(), k) == 0) return std::stoll(line.substr(k.size())) * 1024;
  }
  return 0;
}

}  // namespace

void install_counting_allocator() {
  std::call_once(g_install_once, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    // The wrapped allocator must hand out plain pointers (context == data) with a raw
    // deleter, as libtorch's default CPU allocator does.
    g_inner_free = inner->raw_deleter();
    if (g_inner_free == nullptr) return;  // cannot wrap it: leave accounting off
    static CountingAllocator alloc(inner);
    // Priority above the default registration so libtorch's own code allocates through it.
    c10::SetCPUAllocator(&alloc, /*priority=*/100);
    g_installed = true;
  });
}

bool counting_allocator_installed() { return g_installed; }

DeferredAllocation::DeferredAllocation() {
  HP_CHECK(g_installed, "hp::memory::DeferredAllocation needs the counting allocator (hp::init installs it, or call ",
           "hp::memory::install_counting_allocator())");
  ++t_deferred;
}

DeferredAllocation::~DeferredAllocation() {
  if (--t_deferred > 0) return;
  std::lock_guard<std::mutex> g(g_scratch_mu);
  auto cur = g_scratch.find(g_scratch_current);
  g_scratch_current = nullptr;
  if (cur != g_scratch.end()) {
    cur->second.current = false;
    release_if_unused(cur);
  }
}

bool deferring() { return t_deferred > 0; }

bool is_deferred(const void* data) {
  if (data == nullptr || g_scratch_blocks.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard<std::mutex> g(g_scratch_mu);
  return g_scratch.count(data) > 0;
}
int64_t current_bytes() { return g_current.load(); }
int64_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_current.load()); }

int64_t peak_bytes(c10::Device device) {
  if (device.is_cpu()) return peak_bytes();
#if HP_HAVE_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  HP_NOT_SUPPORTED("memory::peak_bytes on ", device, " (CPU and CUDA only)");
}

void reset_peak(c10::Device device) {
  if (device.is_cpu()) return reset_peak();
#if HP_HAVE_CUDA
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  HP_NOT_SUPPORTED("memory::reset_peak on ", device, " (CPU and CUDA only)");
}
int64_t process_rss_bytes() { return read_kb("/proc/self/status", "VmRSS:"); }
int64_t process_peak_rss_bytes() { return read_kb("/proc/self/status", "VmHWM:"); }
int64_t available_bytes() { return read_kb("/proc/meminfo", "MemAvailable:"); }

}  // namespace hp::memory
