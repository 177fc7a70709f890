#include "hp/train/preemption.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "hp/core/error.h"

namespace hp::train {

namespace {

std::atomic<int> g_first{0};
std::atomic<bool> g_installed{false};
struct sigaction g_old_term {}, g_old_usr1 {};

void on_signal(int signo) {
  int none = 0;
  if (g_first.compare_exchange_strong(none, signo)) return;  // the first: stop after this step
  // The second: end now. Only async-signal-safe calls here.
  static const char kMsg[] = "hp-train: a second stop signal: exiting now; 'latest' names the last committed checkpoint\n";
  const ssize_t n = ::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
  (void)n;
  ::_exit(128 + signo);
}

}  // namespace

PreemptionSignals::PreemptionSignals() {
  HP_CHECK(!g_installed.exchange(true), "PreemptionSignals: one object at a time");
  g_first = 0;
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
