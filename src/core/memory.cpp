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

// Keeps the wrapped allocator's DataPtr alive; destroying it frees the memory.
struct Counted {
  c10::DataPtr inner;
  int64_t bytes;
};

void delete_counted(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  int64_t n = c->bytes;
  delete c;
  g_current.fetch_sub(n, std::memory_order_relaxed);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) HP_ALLOCATOR_ALLOCATE_CONST override {
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    c10::Device dev = p.device();
    auto* ctx = new Counted{std::move(p), static_cast<int64_t>(n)};
    add_bytes(static_cast<int64_t>(n));
    return c10::DataPtr(data, ctx, &delete_counted, dev);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
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

int64_t read_status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
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
    static CountingAllocator alloc(c10::GetCPUAllocator());
    // Priority above the default registration so libtorch's own code allocates through it.
    c10::SetCPUAllocator(&alloc, /*priority=*/100);
    g_installed = true;
  });
}

bool counting_allocator_installed() { return g_installed; }
int64_t current_bytes() { return g_current.load(); }
int64_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_current.load()); }
int64_t process_rss_bytes() { return read_status_kb("VmRSS:"); }
int64_t process_peak_rss_bytes() { return read_status_kb("VmHWM:"); }

}  // namespace hp::memory
