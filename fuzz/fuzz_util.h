// What every fuzz target shares: the rule for what an input may do. Files and strings read
// by hyperparallel are untrusted, so any input may only be accepted or refused with a clean
// hp::Error; a crash, a sanitizer report, a hang, a huge allocation, an internal error (a
// broken invariant, HP_INTERNAL_ASSERT) or another exception escaping is a finding.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "hp/core/error.h"

namespace hp::fuzz {

// Stops the run as a finding (libFuzzer keeps the input as crash-<sha1>).
[[noreturn]] inline void finding(const std::string& why) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", why.c_str());
  std::abort();
}

// Runs `body`. An hp::Error is a bad input's expected end, unless it is an internal error,
// or unless `must_name` is given and the message does not contain it (errors about a file
// must name the file). Any other exception escapes to libFuzzer, which reports it.
template <typename F>
void expect_clean(F&& body, const std::string& must_name = "") {
  try {
    body();
  } catch (const hp::Error& e) {
    const std::string what = e.what();
    if (what.rfind("internal error", 0) == 0) finding("an internal error: " + what);
    if (!must_name.empty() && what.find(must_name) == std::string::npos) {
      finding("an error that does not name '" + must_name + "': " + what);
    }
  }
}

// A private folder for targets that must hand a file to a path-taking reader, made once per
// process under /dev/shm where it exists (the writes then stay in memory).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    std::string t = (access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") + std::string("/hp-fuzz-XXXXXX");
    if (mkdtemp(t.data()) == nullptr) finding("cannot make a scratch folder");
    static std::string removed_at_exit;
    removed_at_exit = t;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(removed_at_exit, ec);
    });
    return t;
  }();
  return dir;
}

// Writes `n` bytes to `path` (replacing it).
inline void write_file(const std::string& path, const uint8_t* data, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (n > 0 && std::fwrite(data, 1, n, f) != n) || std::fclose(f) != 0) {
    finding("cannot write " + path);
  }
}

}  // namespace hp::fuzz
