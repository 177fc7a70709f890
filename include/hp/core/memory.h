// Memory accounting: tensor bytes per rank and process RSS.
//
// install_counting_allocator() wraps libtorch's CPU allocator so that every CPU tensor
// allocation made afterwards is counted (current and peak bytes). hp::init installs it;
// tests and benches may call it directly (it is idempotent and thread-safe). Storage
// allocated before installation is not counted, neither when allocated nor when freed.
#pragma once

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

// Resident set size of this process, and its high-water mark, in bytes (0 if unknown).
int64_t process_rss_bytes();
int64_t process_peak_rss_bytes();
// Memory the node can still give to new allocations (MemAvailable), in bytes (0 if unknown).
int64_t available_bytes();

}  // namespace hp::memory
