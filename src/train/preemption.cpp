#include "hp/train/preemption.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <ctime>

#include "hp/core/error.h"

namespace hp::train {

namespace {

std::atomic<int> g_first{0};
std::atomic<int64_t> g_first_ns{0};
std::atomic<int64_t> g_grace_ns{0};
std::atomic<bool> g_installed{false};
struct sigaction g_old_term {}, g_old_usr1 {};

int64_t now_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void say(const char* msg, size_t n) {
  const ssize_t w = ::write(STDERR_FILENO, msg, n);
  (void)w;
}

void on_signal(int signo) {
  // Only async-signal-safe calls here.
  const int64_t t = now_ns();
  int none = 0;
  if (g_first.compare_exchange_strong(none, signo)) {  // the first: stop after this step
    g_first_ns = t;
    return;
  }
  if (t - g_first_ns.load() < g_grace_ns.load()) {
    // The same notice twice (a scheduler signals the ranks and the launcher, which passes it
    // on): the save goes on.
    static const char kSame[] =
        "hp-train: a second stop signal within the grace after the first: the save goes on\n";
    say(kSame, sizeof kSame - 1);
    return;
  }
  static const char kMsg[] = "hp-train: a second stop signal: exiting now; 'latest' names the last committed checkpoint\n";
  say(kMsg, sizeof kMsg - 1);
  ::_exit(128 + signo);
}

}  // namespace

PreemptionSignals::PreemptionSignals(double grace_s) {
  HP_CHECK(grace_s >= 0 && grace_s <= 3600, "PreemptionSignals: grace_s=", grace_s, " must be in [0, 3600]");
  HP_CHECK(!g_installed.exchange(true), "PreemptionSignals: one object at a time");
  g_first = 0;
  g_first_ns = 0;
  g_grace_ns = static_cast<int64_t>(grace_s * 1e9);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a read or write in flight goes on; the step loop polls the flag
  ::sigaction(SIGTERM, &sa, &g_old_term);
  ::sigaction(SIGUSR1, &sa, &g_old_usr1);
}

PreemptionSignals::~PreemptionSignals() {
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  ::sigaction(SIGUSR1, &g_old_usr1, nullptr);
  g_installed = false;
}

int PreemptionSignals::received() { return g_first.load(std::memory_order_relaxed); }

std::string signal_name(int signo) {
  if (signo == SIGTERM) return "SIGTERM";
  if (signo == SIGUSR1) return "SIGUSR1";
  if (signo == SIGINT) return "SIGINT";
  if (signo == SIGKILL) return "SIGKILL";
  return "signal " + std::to_string(signo);
}

}  // namespace hp::train
