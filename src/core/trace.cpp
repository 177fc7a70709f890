#include "hp/core/trace.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sys/stat.h>

#include "hp/core/error.h"

namespace hp::trace {
namespace {

struct State {
  std::mutex mu;
  std::atomic<bool> on{false};
  std::string dir;
  int rank = 0;
  std::vector<Event> events;
  std::map<int64_t, std::string> lane_names;
  std::atomic<int64_t> next_tid{1};
};

State& state() {
  static State* s = new State();  // never destroyed: threads may record during exit
  return *s;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

bool enabled() { return state().on.load(std::memory_order_relaxed); }

void enable(const std::string& dir) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  s.dir = dir.empty() ? "." : dir;
  ::mkdir(s.dir.c_str(), 0755);
  s.on = true;
}

void disable() { state().on = false; }

void set_rank(int rank) {
  std::lock_guard<std::mutex> g(state().mu);
  state().rank = rank;
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t current_tid() {
  thread_local int64_t tid = state().next_tid.fetch_add(1);
  return tid;
}

void name_lane(int64_t tid, const std::string& name) {
  std::lock_guard<std::mutex> g(state().mu);
  state().lane_names[tid] = name;
}

int64_t new_lane(const std::string& name) {
  int64_t tid = state().next_tid.fetch_add(1);
  name_lane(tid, name);
  return tid;
}

void record(Event e) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> g(state().mu);
  state().events.push_back(std::move(e));
}

std::vector<Event> events() {
  std::lock_guard<std::mutex> g(state().mu);
  return state().events;
}

void clear() {
  std::lock_guard<std::mutex> g(state().mu);
  state().events.clear();
}

std::string flush() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.dir.empty()) return "";
  std::string path = s.dir + "/trace_rank" + std::to_string(s.rank) + ".json";
  // Written whole under a temporary name, every write checked, then renamed: a trace file
  // under its own name is always complete, and a failure is an error naming it.
  const std::string partial = path + ".partial";
  errno = 0;
  std::ofstream f(partial, std::ios::trunc);
  HP_CHECK(f.good(), "cannot write the trace file '", partial, "': ", errno ? std::strerror(errno) : "unknown error");
  auto fail = [&](const char* what) {
    const int err = errno;
    f.close();
    std::remove(partial.c_str());
    HP_CHECK(false, what, " the trace file '", partial, "' failed: ", err ? std::strerror(err) : "unknown error",
             " (removed; the run's other output is not affected)");
  };
  f << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!f.good()) fail("writing");  // at once, while errno says why
    if (!first) f << ",\n";
    first = false;
  };
  sep();
  f << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << s.rank
    << ",\"args\":{\"name\":\"rank " << s.rank << "\"}}";
  for (const auto& [tid, name] : s.lane_names) {
    sep();
    f << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << s.rank << ",\"tid\":" << tid
      << ",\"args\":{\"name\":\"" << json_escape(name) << "\"}}";
  }
  for (const auto& e : s.events) {
    std::string args = e.args.empty() ? "{}" : e.args;
    std::string common = "\"name\":\"" + json_escape(e.name) + "\",\"cat\":\"" +
                         json_escape(e.cat) + "\",\"pid\":" + std::to_string(s.rank) +
                         ",\"tid\":" + std::to_string(e.tid);
    sep();
    if (e.async) {
      f << "{" << common << ",\"ph\":\"b\",\"id\":" << e.id << ",\"ts\":" << e.ts_us
        << ",\"args\":" << args << "},\n";
      f << "{" << common << ",\"ph\":\"e\",\"id\":" << e.id
        << ",\"ts\":" << (e.ts_us + e.dur_us) << "}";
    } else {
      f << "{" << common << ",\"ph\":\"X\",\"ts\":" << e.ts_us << ",\"dur\":" << e.dur_us
        << ",\"args\":" << args << "}";
    }
  }
  f << "\n]}\n";
  if (!f.good()) fail("writing");
  f.flush();
  if (!f.good()) fail("writing");
  f.close();
  if (f.fail()) fail("closing");
  if (std::rename(partial.c_str(), path.c_str()) != 0) fail("renaming");
  return path;
}

Span::Span(std::string name, const char* cat) : name_(std::move(name)), cat_(cat) {
  if (enabled()) start_us_ = now_us();
}

Span::~Span() {
  if (start_us_ < 0 || !enabled()) return;
  int64_t end = now_us();
  record(Event{std::move(name_), cat_, start_us_, end - start_us_, current_tid(), false, 0, ""});
}

}  // namespace hp::trace
