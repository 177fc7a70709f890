// ThreadSanitizer annotations for an order TSan cannot see: the communicator's worker drops
// an op's tensors after reading them, and the last holder (often the caller's thread) frees
// their storage later inside libtorch, ordered by libtorch's reference count, which is not
// instrumented. Nothing outside a TSan build (scripts/tsan.sh).
#pragma once

#if defined(__SANITIZE_THREAD__)
#define HP_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define HP_TSAN 1
#endif
#endif

#ifdef HP_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace hp::tsan {

inline char g_tensor_drops;

// The worker is done with an op's tensors and drops them.
inline void tensors_dropped() {
#ifdef HP_TSAN
  __tsan_release(&g_tensor_drops);
#endif
}
// Before memory the counting allocator gave out is freed: after every drop before it.
inline void before_free() {
#ifdef HP_TSAN
  __tsan_acquire(&g_tensor_drops);
#endif
}

}  // namespace hp::tsan
