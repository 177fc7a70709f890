#include "hp/core/error.h"

namespace hp {

CommError::CommError(int rank, std::string group, std::string op, uint64_t seq, std::string detail,
                     int world_rank)
    : Error(world_rank < 0 || world_rank == rank
                ? detail::str_cat("[rank ", rank, "] ", op, " #", seq, " on group '", group, "' failed: ", detail)
                : detail::str_cat("[world rank ", world_rank, ", rank ", rank, " of group '", group, "'] ", op, " #",
                                  seq, " on group '", group, "' failed: ", detail)),
      rank_(rank),
      group_(std::move(group)),
      op_(std::move(op)),
      seq_(seq),
      detail_(std::move(detail)),
      world_rank_(world_rank) {}

namespace detail {

void throw_check_failure(const char* cond, const char* file, int line, const std::string& msg) {
  (void)cond;
  (void)file;
  (void)line;
  // User errors read as sentences: the message carries the values, not the source line.
  throw Error(msg.empty() ? str_cat("check failed: ", cond) : msg);
}

void throw_internal_failure(const char* cond, const char* file, int line,
                            const std::string& msg) {
  throw Error(str_cat("internal error (a bug in hyperparallel) at ", file, ":", line, ": ",
                      cond, " ", msg));
}

}  // namespace detail
}  // namespace hp
