// File-system helpers the library uses instead of std::filesystem where that misbehaves:
// PyTorch's 2.x wheels export their own copy of std::filesystem's functions from libtorch.so,
// which take the place of the program's when it links libtorch first, and its remove_all
// crashed (a null call) in a GCC 12 build (found by scripts/torch2_check.sh).
#pragma once

#include <string>

namespace hp::files {

// Removes `path` and everything below it, without following symbolic links; a missing path
// is not an error. Returns "" on success, else the error naming the path and the OS's reason.
std::string remove_tree(const std::string& path);

// Creates the folder `path` and its missing parents (an existing folder is fine). Returns ""
// on success, else the error naming the first part that could not be made (a file in the
// way, no permission) and the OS's reason.
std::string create_folders(const std::string& path);

}  // namespace hp::files
