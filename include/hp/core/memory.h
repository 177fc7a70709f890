// Memory accounting: tensor bytes per rank and process RSS.
//
// install_counting_allocator() wraps libtorch's CPU allocator so that every CPU tensor
// allocation made afterwards is counted (current and peak bytes). hp::init installs it;
// tests and benches may call it directly (it is idempotent and thread-safe). Storage
// allocated before installation is not counted, neither when allocated nor when freed.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace hp::memory {

void install_counting_allocator();
bool counting_allocator_installed();

// Bytes of CPU tensor storage currently allocated through the counting allocator.
int64_t current_bytes();
// Highest current_bytes() since installation or the last reset_peak().
int64_t peak_bytes();
// Sets the peak to the current value.
void reset_peak();
// The same for the tensors of `device`: the CPU's as above, a CUDA device's from its caching
// allocator (bytes allocated to tensors, not the cache it reserves).
int64_t peak_bytes(c10::Device device);
void reset_peak(c10::Device device);

// Deferred allocation: while a DeferredAllocation lives on a thread, every CPU tensor
// allocated on that thread through the counting allocator gets no memory of its own. All
// of them share one scratch block (as large as the largest single request so far; a larger
// request starts a new block), so building a model whose parameters would not fit costs
// one parameter's worth of memory, and the values in those tensors are meaningless (they
// alias each other). Such a tensor must be given real storage before it is read
// (fully_shard does it for parameters with FullyShardOptions::param_init; a module's
// buffers with materialize_deferred_buffers). A scratch block is freed when the last tensor
// on it is gone and no DeferredAllocation uses it. Needs the counting allocator (hp::init
// installs it); raises hp::Error without it. Nests; not copyable.
class DeferredAllocation {
 public:
  DeferredAllocation();
  ~DeferredAllocation();
  DeferredAllocation(const DeferredAllocation&) = delete;
  DeferredAllocation& operator=(const DeferredAllocation&) = delete;
};
// Whether `data` (a tensor's storage pointer) is a scratch block of a deferred allocation.
bool is_deferred(const void* data);
// Whether a DeferredAllocation is alive on this thread.
bool deferring();

// Resident set size of this process, and its high-water mark, in bytes (0 if unknown).
int64_t process_rss_bytes();
int64_t process_peak_rss_bytes();
// Memory the node can still give to new allocations (MemAvailable), in bytes (0 if unknown).
int64_t available_bytes();

}  // namespace hp::memory
