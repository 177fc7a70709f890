#include "hp/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>

#include <atomic>
#include <fstream>
#include <mutex>
#include <string>
#include <unistd.h>

#include "hp/core/compat.h"

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

void counted_free(void* data) {
  if (data == nullptr) return;
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
int64_t current_bytes() { return g_current.load(); }
int64_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_current.load()); }
int64_t process_rss_bytes() { return read_kb("/proc/self/status", "VmRSS:"); }
int64_t process_peak_rss_bytes() { return read_kb("/proc/self/status", "VmHWM:"); }
int64_t available_bytes() { return read_kb("/proc/meminfo", "MemAvailable:"); }

}  // namespace hp::memory
