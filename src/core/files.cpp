#include "hp/core/files.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace hp::files {
namespace {

thread_local std::string t_error;

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  if (std::remove(path) != 0 && errno != ENOENT) {
    t_error = std::string("cannot remove '") + path + "': " + std::strerror(errno);
    return 1;  // stops the walk
  }
  return 0;
}

}  // namespace

std::string remove_tree(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return "";
    return "cannot remove '" + path + "': " + std::strerror(errno);
  }
  t_error.clear();
  // Children before their folder; symbolic links removed, not followed.
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && t_error.empty()) {
    t_error = "cannot remove '" + path + "': " + std::strerror(errno);
  }
  return t_error;
}

}  // namespace hp::files
