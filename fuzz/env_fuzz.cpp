// Fuzzes the environment knobs' reading (hp::env::check_all, get_int, get_double: what
// hp::init checks first): the input's lines are the values of the declared knobs, in their
// order (a missing or empty line leaves the knob unset). Values it accepts must lie in the
// knob's declared range.
#include <cstdlib>

#include "fuzz_util.h"
#include "hp/core/env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return -1;
  const std::string text(reinterpret_cast<const char*>(data), size);
  size_t at = 0;
  for (const hp::env::Knob& k : hp::env::knobs()) {
    std::string value;
    if (at <= text.size()) {
      size_t nl = text.find('\n', at);
      if (nl == std::string::npos) nl = text.size();
      value = text.substr(at, nl - at);
      at = nl + 1;
    }
    value = value.substr(0, value.find('\0'));  // the environment holds C strings
    if (value.empty()) {
      unsetenv(k.name);
    } else {
      setenv(k.name, value.c_str(), 1);
    }
  }
  hp::fuzz::expect_clean(
      [&] {
        hp::env::check_all();
        for (const hp::env::Knob& k : hp::env::knobs()) {
          if (!k.numeric()) continue;
          const double x = std::string(k.name) == "HP_COMM_TIMEOUT_S" ? hp::env::get_double(k.name)
                                                                        : static_cast<double>(hp::env::get_int(k.name));
          if (!(x >= k.min && x <= k.max)) hp::fuzz::finding(std::string(k.name) + " accepted out of its range");
        }
      },
      "environment variable");
  return 0;
}
