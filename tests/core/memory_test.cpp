#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hp/core/memory.h"

TEST(Memory, CountsTensorBytesAndPeak) {
  hp::memory::install_counting_allocator();  // hp::init already did; idempotent
  ASSERT_TRUE(hp::memory::counting_allocator_installed());
  const int64_t base = hp::memory::current_bytes();
  hp::memory::reset_peak();
  EXPECT_EQ(hp::memory::peak_bytes(), base);
  {
    at::Tensor a = at::empty({1 << 20});  // 4 MiB
    EXPECT_EQ(hp::memory::current_bytes() - base, 4 << 20);
    {
      at::Tensor b = at::empty({1 << 19}, at::kDouble);  // 4 MiB more
      EXPECT_EQ(hp::memory::current_bytes() - base, 8 << 20);
    }
    EXPECT_EQ(hp::memory::current_bytes() - base, 4 << 20);
  }
  EXPECT_EQ(hp::memory::current_bytes(), base);
  EXPECT_EQ(hp::memory::peak_bytes() - base, 8 << 20);
  hp::memory::reset_peak();
  EXPECT_EQ(hp::memory::peak_bytes(), base);
}

TEST(Memory, ProcessRssIsReported) {
  // The current RSS first: the peak read after it bounds it. (Read the other way round, the
  // pages the second read allocates, as under AddressSanitizer, put the current above the
  // peak read before it.)
  const int64_t now = hp::memory::process_rss_bytes();
  EXPECT_GT(now, 0);
  EXPECT_GE(hp::memory::process_peak_rss_bytes(), now);
}
