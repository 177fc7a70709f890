// Errors raised by hyperparallel.
//
// hp::Error is every error the library raises for a user mistake or a failed operation.
// hp::CommError adds what a communication failure must name: rank, group, op and the op's
// sequence number on its communicator. HP_CHECK reports user errors with the values
// involved; HP_INTERNAL_ASSERT reports broken invariants (a bug in hyperparallel itself).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace hp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Raised for a collective or point-to-point op that failed or timed out.
class CommError : public Error {
 public:
  // `rank` is the rank within `group`; `world_rank` (when known, >= 0) the same process's
  // rank in the world, named in the message when it differs.
  CommError(int rank, std::string group, std::string op, uint64_t seq, std::string detail, int world_rank = -1);
  int rank() const { return rank_; }
  int world_rank() const { return world_rank_ >= 0 ? world_rank_ : rank_; }
  const std::string& group() const { return group_; }
  const std::string& op() const { return op_; }
  uint64_t seq() const { return seq_; }
  const std::string& detail() const { return detail_; }

 private:
  int rank_;
  std::string group_;
  std::string op_;
  uint64_t seq_;
  std::string detail_;
  int world_rank_;
};

// Raised when a collective did not complete within its timeout.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

namespace detail {
inline void stream_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void stream_all(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  stream_all(os, rest...);
}
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  stream_all(os, args...);
  return os.str();
}
[[noreturn]] void throw_check_failure(const char* cond, const char* file, int line,
                                      const std::string& msg);
[[noreturn]] void throw_internal_failure(const char* cond, const char* file, int line,
                                         const std::string& msg);
}  // namespace detail

}  // namespace hp

// HP_CHECK(cond, parts...): raise hp::Error("parts...") when cond is false.
#define HP_CHECK(cond, ...)                                                              \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) {                                                  \
      ::hp::detail::throw_check_failure(#cond, __FILE__, __LINE__,                       \
                                        ::hp::detail::str_cat(__VA_ARGS__));             \
    }                                                                                    \
  } while (0)

#define HP_INTERNAL_ASSERT(cond, ...)                                                    \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) {                                                  \
      ::hp::detail::throw_internal_failure(#cond, __FILE__, __LINE__,                    \
                                           ::hp::detail::str_cat(__VA_ARGS__));          \
    }                                                                                    \
  } while (0)

#define HP_NOT_SUPPORTED(...) \
  throw ::hp::Error(::hp::detail::str_cat("not supported yet: ", __VA_ARGS__))
