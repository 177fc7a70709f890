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

std::string create_folders(const std::string& path) {
  if (path.empty()) return "cannot create a folder with an empty name";
  // Each prefix ending before a '/', then the whole path.
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string part = end == std::string::npos ? path : path.substr(0, end);
    struct stat st{};
    if (!part.empty() && part.back() != '/' && ::stat(part.c_str(), &st) != 0) {
      if (errno != ENOENT) return "cannot create '" + part + "': " + std::strerror(errno);
      if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) {
        return "cannot create '" + part + "': " + std::strerror(errno);
      }
      if (::stat(part.c_str(), &st) != 0) return "cannot create '" + part + "': " + std::strerror(errno);
    }
    if (!part.empty() && part.back() != '/' && !S_ISDIR(st.st_mode)) {
      return "cannot create '" + path + "': '" + part + "' is not a folder";
    }
    if (end == std::string::npos) return "";
  }
}

}  // namespace hp::files
