// hp::train::PreemptionSignals: the first SIGTERM or SIGUSR1 is recorded (and nothing else
// happens), the second ends the process at once with 128 + its number; the handlers it
// replaced come back when it goes.
#include <gtest/gtest.h>

#include <signal.h>

#include <csignal>

#include "hp/train/preemption.h"

namespace ht = hp::train;

TEST(Preemption, TheFirstSignalIsRecordedTheSecondEndsTheProcess) {
  {
    ht::PreemptionSignals s;
    EXPECT_EQ(ht::PreemptionSignals::received(), 0);
    std::raise(SIGUSR1);
    EXPECT_EQ(ht::PreemptionSignals::received(), SIGUSR1) << "the first signal was not recorded";
    EXPECT_EQ(ht::signal_name(ht::PreemptionSignals::received()), "SIGUSR1");
  }
  // A new object starts over.
  ht::PreemptionSignals s;
  EXPECT_EQ(ht::PreemptionSignals::received(), 0);
}

TEST(Preemption, ASecondSignalEndsTheProcessAtOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ht::PreemptionSignals s;
        std::raise(SIGTERM);
        std::raise(SIGTERM);
        std::_Exit(0);  // not reached
      },
      ::testing::ExitedWithCode(128 + SIGTERM), "a second stop signal: exiting now");
  EXPECT_EXIT(
      {
        ht::PreemptionSignals s;
        std::raise(SIGUSR1);
        std::raise(SIGTERM);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(128 + SIGTERM), "a second stop signal");
}

TEST(Preemption, TheHandlersBeforeComeBack) {
  static volatile std::sig_atomic_t mine = 0;
  struct sigaction sa {}, old {};
  sa.sa_handler = [](int) { mine = 1; };
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(::sigaction(SIGUSR1, &sa, &old), 0);
  { ht::PreemptionSignals s; }
  std::raise(SIGUSR1);
  EXPECT_EQ(mine, 1) << "the handler in place before was not restored";
  ::sigaction(SIGUSR1, &old, nullptr);
}

TEST(Preemption, OneObjectAtATime) {
  ht::PreemptionSignals s;
  EXPECT_THROW(ht::PreemptionSignals t, std::exception);
}
