// A test-only hp-train (hp_train_fault: apps/hp_train.cpp and this file; never installed):
// the fault HP_TEST_FAULT names (tests/comm/fault_injection.h's text form) is injected into
// this process's communicators, in the first launch only: the rank the fault fires in
// creates the file HP_TEST_FAULT_ONCE names just before it acts, and a process that finds
// the file at start runs clean (the launcher's relaunch). The knobs exist in this binary
// alone: hp-train and the library read neither.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "comm/fault_injection.h"

namespace {

struct Armed {
  std::unique_ptr<hp::test::FaultInjection> injection;
  Armed() {
    const char* spec = std::getenv("HP_TEST_FAULT");
    const char* once = std::getenv("HP_TEST_FAULT_ONCE");
    if (spec == nullptr || *spec == '\0') return;
    if (once == nullptr || *once == '\0') {
      std::fprintf(stderr, "hp_train_fault: HP_TEST_FAULT needs HP_TEST_FAULT_ONCE (a file marking it fired)\n");
      std::_Exit(2);
    }
    if (::access(once, F_OK) == 0) return;  // fired in an earlier launch
    const std::string marker = once;
    injection = std::make_unique<hp::test::FaultInjection>(
        hp::test::Fault::parse(spec), [marker](const hp::test::FaultFired& where) {
          if (std::FILE* f = std::fopen(marker.c_str(), "w")) {
            std::fprintf(f, "%s #%llu on %s\n", hp::to_string(where.op),
                         static_cast<unsigned long long>(where.seq), where.group.c_str());
            std::fclose(f);
          }
        });
  }
};

const Armed armed;

}  // namespace
