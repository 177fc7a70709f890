// Reading what a user's disk holds as untrusted input: a named file read only when it is a
// regular file (a FIFO is refused, never waited on), and text whose nesting is bounded
// before a recursive reader or printer sees it (200,000 nested JSON arrays in a config.json
// overflowed the stack when an error message printed the value).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace hp::files {

// Opens `path` for reading without blocking (O_NONBLOCK: a FIFO with no writer returns at
// once) and returns the descriptor when it is a regular file; otherwise raises "<what>
// '<path>' ...": missing, unreadable, or "is not a regular file (it is a FIFO)" (a folder, ...).
int open_regular(const std::string& path, const std::string& what);

// The whole of the regular file at `path` (as open_regular), at most `max_bytes` of it:
// a larger file raises naming its size.
std::string read_regular(const std::string& path, const std::string& what, int64_t max_bytes = int64_t(1) << 28);

}  // namespace hp::files

namespace hp::text {

// The deepest nesting hp reads in a JSON or YAML text: a config nests 3 levels, metadata.json
// 5; this leaves room and keeps every recursive reader far from the stack's end.
constexpr int kMaxNesting = 64;

// Whether JSON `text` opens at most `max` arrays and objects inside one another (brackets in
// strings not counted); where it opens more, the byte at which it does in `*at`.
bool json_nesting_within(std::string_view text, int max = kMaxNesting, size_t* at = nullptr);
// Raises "<what>: nested deeper than 64 levels (at byte N)" where json_nesting_within is false.
void check_json_nesting(std::string_view text, const std::string& what, int max = kMaxNesting);

// The same for YAML `text`: flow collections ([ {) and block levels (each deeper indent of a
// line opens one) counted together, comments and quoted scalars skipped.
void check_yaml_nesting(std::string_view text, const std::string& what, int max = kMaxNesting);

}  // namespace hp::text
