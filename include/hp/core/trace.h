// Tracing: per-rank Chrome trace-event JSON (open in Perfetto or chrome://tracing).
//
// Off by default. Enabled by HP_TRACE=<dir> (read by hp::init) or trace::enable(dir).
// While enabled, communication ops record one span each (issue -> completion; in
// events() by the time the op's Work reports completion) and
// compute regions record a span per trace::Span scope. trace::flush() writes
// <dir>/trace_rank<R>.json; hp::finalize calls it. Timestamps are microseconds of the
// system clock, so files of several ranks on one machine line up when merged
// (scripts/merge_traces.py). Thread-safe; recording costs one mutex acquisition.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::trace {

struct Event {
  std::string name;
  std::string cat;   // "comm" or "compute" (or a user category)
  int64_t ts_us;     // start
  int64_t dur_us;    // duration
  int64_t tid;       // lane: a thread, or a communicator for comm spans
  bool async;        // written as an async begin/end pair (comm spans may overlap)
  uint64_t id;       // async pair id
  std::string args;  // JSON object text, or empty
};

bool enabled();
void enable(const std::string& dir);
void disable();
// The rank written into file names and as the trace's pid.
void set_rank(int rank);

int64_t now_us();
// A small stable number for the calling thread (its trace lane).
int64_t current_tid();
// Names a lane in the written trace (e.g. "comm world").
void name_lane(int64_t tid, const std::string& name);
// A fresh lane id for something that is not a thread (a communicator).
int64_t new_lane(const std::string& name);

void record(Event e);

// Snapshot of the events recorded so far (tests read it).
std::vector<Event> events();
void clear();

// Writes the trace file and returns its path ("" when tracing is off).
std::string flush();

// Records a compute span for its scope when tracing is enabled.
class Span {
 public:
  explicit Span(std::string name, const char* cat = "compute");
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  std::string name_;
  const char* cat_;
  int64_t start_us_ = -1;
};

}  // namespace hp::trace
