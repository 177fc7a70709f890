#include "hp/core/untrusted.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "hp/core/error.h"

namespace hp::files {
namespace {

const char* kind_of(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISDIR(m)) return "a folder";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  if (S_ISSOCK(m)) return "a socket";
  return "of another kind";
}

}  // namespace

int open_regular(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  HP_CHECK(fd >= 0, what, " '", path, "': cannot open: ", std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = kind_of(st.st_mode);
    ::close(fd);
    throw Error(detail::str_cat(what, " '", path, "' is not a regular file (it is ", kind, ")"));
  }
  // Reads of a regular file never block; the flag is cleared for what follows all the same.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::string read_regular(const std::string& path, const std::string& what, int64_t max_bytes) {
  const int fd = open_regular(path, what);
  std::string out;
  std::vector<char> buf(1 << 16);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw Error(detail::str_cat("reading ", what, " '", path, "' failed: ", std::strerror(err)));
    }
    if (n == 0) break;
    out.append(buf.data(), static_cast<size_t>(n));
    if (static_cast<int64_t>(out.size()) > max_bytes) {
      ::close(fd);
      throw Error(detail::str_cat(what, " '", path, "' holds more than ", max_bytes, " bytes (a damaged file?)"));
    }
  }
  ::close(fd);
  return out;
}

}  // namespace hp::files

namespace hp::text {
namespace {

[[noreturn]] void too_deep(const std::string& what, int max, size_t at) {
  throw Error(detail::str_cat(what, ": nested deeper than ", max, " levels (at byte ", at, ")"));
}

}  // namespace

bool json_nesting_within(std::string_view text, int max, size_t* at) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (ch == '\\') {
        ++i;
      } else if (ch == '"') {
        in_string = false;
      }
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max) {
        if (at) *at = i;
        return false;
      }
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
  return true;
}

void check_json_nesting(std::string_view text, const std::string& what, int max) {
  size_t at = 0;
  if (!json_nesting_within(text, max, &at)) too_deep(what, max, at);
}

void check_yaml_nesting(std::string_view text, const std::string& what, int max) {
  std::vector<size_t> indents;  // the block levels open at the current line
  int flow = 0;
  size_t i = 0;
  while (i < text.size()) {
    // A line: its indent opens or closes block levels (outside flow collections).
    size_t col = 0;
    while (i + col < text.size() && (text[i + col] == ' ' || text[i + col] == '-')) ++col;
    const size_t start = i + col;
    const bool blank = start >= text.size() || text[start] == '\n' || text[start] == '#' || text[start] == '\r';
    if (!blank && flow == 0) {
      while (!indents.empty() && indents.back() >= col) indents.pop_back();
      indents.push_back(col);
    }
    char quote = 0;
    for (i = start; i < text.size() && text[i] != '\n'; ++i) {
      const char ch = text[i];
      if (quote) {
        if (quote == '"' && ch == '\\') {
          ++i;
        } else if (ch == quote) {
          quote = 0;
        }
      } else if (ch == '"' || ch == '\'') {
        quote = ch;
      } else if (ch == '#' && (i == start || text[i - 1] == ' ')) {
        while (i < text.size() && text[i] != '\n') ++i;
        break;
      } else if (ch == '[' || ch == '{') {
        ++flow;
      } else if ((ch == ']' || ch == '}') && flow > 0) {
        --flow;
      }
      if (static_cast<int>(indents.size()) + flow > max) too_deep(what, max, i);
    }
    if (static_cast<int>(indents.size()) + flow > max) too_deep(what, max, i);
    ++i;
  }
}

}  // namespace hp::text
