#include "hp/pp/schedule.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "hp/core/error.h"

namespace hp::pp {

namespace {

const char* kind_token(ActionKind k) {
  switch (k) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "B";
    case ActionKind::kBackwardInput:
      return "I";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kUnshard:
      return "UNSHARD";
    case ActionKind::kReshard:
      return "RESHARD";
    case ActionKind::kReduceGrad:
      return "REDUCE_GRAD";
  }
  return "?";
}

bool is_backward(ActionKind k) {
  return k == ActionKind::kBackward || k == ActionKind::kBackwardInput || k == ActionKind::kBackwardWeight;
}

}  // namespace

bool Action::is_compute() const {
  return kind == ActionKind::kForward || is_backward(kind);
}

std::string Action::to_string() const {
  std::string s = std::to_string(stage) + kind_token(kind);
  if (is_compute()) s += std::to_string(microbatch);
  return s;
}

Action Action::parse(const std::string& token) {
  size_t i = 0;
  while (i < token.size() && std::isdigit(static_cast<unsigned char>(token[i]))) ++i;
  HP_CHECK(i > 0 && i < token.size() && i <= 9, "pipeline schedule: '", token,
           "' is not an action (a stage number, then F, B, I, W with a micro-batch, or UNSHARD, RESHARD, REDUCE_GRAD)");
  Action a;
  a.stage = std::stoi(token.substr(0, i));
  const std::string rest = token.substr(i);
  for (ActionKind k : {ActionKind::kUnshard, ActionKind::kReshard, ActionKind::kReduceGrad}) {
    if (rest == kind_token(k)) {
      a.kind = k;
      return a;
    }
  }
  const std::string digits = rest.substr(1);
  const bool number = !digits.empty() && digits.size() <= 9 &&
                      std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  HP_CHECK(number && std::string("FBIW").find(rest[0]) != std::string::npos, "pipeline schedule: '", token,
           "' is not an action (a stage number, then F, B, I, W with a micro-batch, or UNSHARD, RESHARD, REDUCE_GRAD)");
  a.kind = rest[0] == 'F' ? ActionKind::kForward
           : rest[0] == 'B' ? ActionKind::kBackward
           : rest[0] == 'I' ? ActionKind::kBackwardInput
                            : ActionKind::kBackwardWeight;
  a.microbatch = std::stoi(digits);
  return a;
}

std::string Schedule::to_string() const {
  std::ostringstream os;
  for (size_t r = 0; r < actions.size(); ++r) {
    os << "rank " << r << ":";
    for (const auto& a : actions[r]) os << " " << a.to_string();
    os << "\n";
  }
  return os.str();
}

Schedule Schedule::parse(const std::string& text, int stages, int microbatches) {
  Schedule s;
  s.stages = stages;
  s.microbatches = microbatches;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::istringstream words(line);
    std::string rank_word, label;
    words >> rank_word >> label;
    HP_CHECK(rank_word == "rank" && label == std::to_string(s.actions.size()) + ":", "pipeline schedule: line '", line,
             "' does not start with 'rank ", s.actions.size(), ":'");
    std::vector<Action> acts;
    for (std::string tok; words >> tok;) acts.push_back(Action::parse(tok));
    s.actions.push_back(std::move(acts));
  }
  HP_CHECK(!s.actions.empty(), "pipeline schedule: no 'rank 0:' line");
  s.ranks = static_cast<int>(s.actions.size());
  HP_CHECK(stages % s.ranks == 0, "pipeline schedule: ", stages, " stages do not divide over ", s.ranks, " ranks");
  return s;
}

namespace {

Schedule empty(int ranks, int stages, int m) {
  HP_CHECK(ranks >= 1, "pipeline schedule: ranks must be at least 1, got ", ranks);
  HP_CHECK(m >= 1, "pipeline schedule: micro-batches must be at least 1, got ", m);
  Schedule s;
  s.ranks = ranks;
  s.stages = stages;
  s.microbatches = m;
  s.actions.resize(ranks);
  return s;
}

Action compute(int stage, ActionKind k, int mb) { return Action{stage, k, mb}; }

}  // namespace

Schedule gpipe(int ranks, int m) {
  Schedule s = empty(ranks, ranks, m);
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < m; ++i) s.actions[r].push_back(compute(r, ActionKind::kForward, i));
    for (int i = 0; i < m; ++i) s.actions[r].push_back(compute(r, ActionKind::kBackward, i));
  }
  return s;
}

Schedule one_f_one_b(int ranks, int m) { return interleaved_1f1b(ranks, 1, m); }

Schedule interleaved_1f1b(int ranks, int v, int m) {
  HP_CHECK(v >= 1, "pipeline schedule: stages per rank must be at least 1, got ", v);
  Schedule s = empty(ranks, ranks * v, m);
  HP_CHECK(v == 1 || m % ranks == 0, "pipeline schedule: interleaved 1F1B with ", m,
           " micro-batches over ", ranks, " ranks (not a multiple) is not supported yet");
  const int total = m * v;  // forwards (and backwards) per rank
  for (int r = 0; r < ranks; ++r) {
    // Forward k runs chunk (k / ranks) % v on micro-batch (k / (ranks v)) ranks + k % ranks;
    // backward k the chunks in reverse. With v = 1 this is plain 1F1B.
    auto fwd = [&](int k) {
      const int chunk = v == 1 ? 0 : (k / ranks) % v;
      const int mb = v == 1 ? k : (k / (ranks * v)) * ranks + k % ranks;
      return compute(chunk * ranks + r, ActionKind::kForward, mb);
    };
    auto bwd = [&](int k) {
      const int chunk = v == 1 ? 0 : v - 1 - (k / ranks) % v;
      const int mb = v == 1 ? k : (k / (ranks * v)) * ranks + k % ranks;
      return compute(chunk * ranks + r, ActionKind::kBackward, mb);
    };
    const int warmup = std::min(total, v == 1 ? ranks - r - 1 : (ranks - r - 1) * 2 + (v - 1) * ranks);
    int f = 0, b = 0;
    for (; f < warmup; ++f) s.actions[r].push_back(fwd(f));
    while (f < total) {
      s.actions[r].push_back(fwd(f++));
      s.actions[r].push_back(bwd(b++));
    }
    while (b < total) s.actions[r].push_back(bwd(b++));
  }
  return s;
}

namespace {

using Key = std::tuple<int, int, int>;  // stage, kind, micro-batch

// Replays the lists; `check_only` skips nothing (costs still computed). Raises when stuck.
SimResult replay(const Schedule& s, const Costs& c) {
  const int R = static_cast<int>(s.actions.size());
  std::map<Key, double> done;  // finish time of each compute action
  auto finished = [&](int stage, ActionKind k, int mb, double* t) {
    auto it = done.find(Key{stage, static_cast<int>(k), mb});
    if (it == done.end()) return false;
    *t = std::max(*t, it->second);
    return true;
  };
  SimResult out;
  out.busy.assign(R, 0);
  out.peak_in_flight.assign(R, 0);
  std::vector<double> free_at(R, 0);
  std::vector<size_t> next(R, 0);
  std::vector<int> in_flight(R, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      while (next[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][next[r]];
        double start = free_at[r], cost = 0;
        bool ready = true;
        switch (a.kind) {
          case ActionKind::kForward:
            if (a.stage > 0) ready = finished(a.stage - 1, ActionKind::kForward, a.microbatch, &start);
            cost = c.forward;
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            ready = finished(a.stage, ActionKind::kForward, a.microbatch, &start);
            if (ready && a.stage + 1 < s.stages) {
              ready = finished(a.stage + 1, ActionKind::kBackward, a.microbatch, &start) ||
                      finished(a.stage + 1, ActionKind::kBackwardInput, a.microbatch, &start);
            }
            cost = a.kind == ActionKind::kBackward ? c.backward : c.backward_input;
            break;
          case ActionKind::kBackwardWeight:
            ready = finished(a.stage, ActionKind::kBackwardInput, a.microbatch, &start);
            cost = c.backward_weight;
            break;
          default:
            break;
        }
        if (!ready) break;
        const double end = start + cost;
        if (a.is_compute()) done[Key{a.stage, static_cast<int>(a.kind), a.microbatch}] = end;
        free_at[r] = end;
        out.busy[r] += cost;
        if (a.kind == ActionKind::kForward) ++in_flight[r];
        if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --in_flight[r];
        out.peak_in_flight[r] = std::max(out.peak_in_flight[r], in_flight[r]);
        ++next[r];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < R; ++r) {
    if (next[r] < s.actions[r].size()) {
      stuck += detail::str_cat(stuck.empty() ? "" : ", ", "rank ", r, " at ", s.actions[r][next[r]].to_string(),
                               " (action ", next[r], ")");
    }
  }
  HP_CHECK(stuck.empty(), "pipeline schedule cannot complete: every rank waits on another: ", stuck);
  for (double t : free_at) out.makespan = std::max(out.makespan, t);
  for (int r = 0; r < R; ++r) out.bubble.push_back(out.makespan > 0 ? 1.0 - out.busy[r] / out.makespan : 0.0);
  return out;
}

}  // namespace

void validate(const Schedule& s) {
  HP_CHECK(s.ranks >= 1 && static_cast<int>(s.actions.size()) == s.ranks, "pipeline schedule: ", s.actions.size(),
           " rank lists for ", s.ranks, " ranks");
  HP_CHECK(s.stages >= s.ranks && s.stages % s.ranks == 0, "pipeline schedule: ", s.stages,
           " stages do not divide over ", s.ranks, " ranks");
  std::map<Key, int> count;
  std::map<int, int> reduce_grads;
  for (int r = 0; r < s.ranks; ++r) {
    std::map<Key, bool> seen;  // compute actions so far on this rank
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const std::string where = detail::str_cat("rank ", r, ", action ", i, " (", a.to_string(), ")");
      HP_CHECK(a.stage >= 0 && a.stage < s.stages, "pipeline schedule: ", where, ": stage ", a.stage,
               " is not one of the ", s.stages, " stages");
      HP_CHECK(s.rank_of(a.stage) == r, "pipeline schedule: ", where, ": stage ", a.stage, " runs on rank ",
               s.rank_of(a.stage), ", not ", r);
      if (a.kind == ActionKind::kReduceGrad) {
        HP_CHECK(++reduce_grads[a.stage] == 1, "pipeline schedule: ", where, ": a second REDUCE_GRAD of stage ",
                 a.stage);
        continue;
      }
      if (!a.is_compute()) continue;
      HP_CHECK(a.microbatch >= 0 && a.microbatch < s.microbatches, "pipeline schedule: ", where, ": micro-batch ",
               a.microbatch, " is not one of the ", s.microbatches);
      HP_CHECK(reduce_grads[a.stage] == 0 || a.kind == ActionKind::kForward, "pipeline schedule: ", where,
               ": a backward after stage ", a.stage, "'s REDUCE_GRAD");
      const Key k{a.stage, static_cast<int>(a.kind), a.microbatch};
      HP_CHECK(++count[k] == 1, "pipeline schedule: ", where, ": runs twice");
      if (is_backward(a.kind)) {
        HP_CHECK(seen.count(Key{a.stage, static_cast<int>(ActionKind::kForward), a.microbatch}), "pipeline schedule: ",
                 where, ": a backward before its forward");
      }
      if (a.kind == ActionKind::kBackwardWeight) {
        HP_CHECK(seen.count(Key{a.stage, static_cast<int>(ActionKind::kBackwardInput), a.microbatch}),
                 "pipeline schedule: ", where, ": W before its I");
      }
      seen[k] = true;
    }
  }
  for (int st = 0; st < s.stages; ++st) {
    for (int mb = 0; mb < s.microbatches; ++mb) {
      auto n = [&](ActionKind k) { return count[Key{st, static_cast<int>(k), mb}]; };
      HP_CHECK(n(ActionKind::kForward) == 1, "pipeline schedule: stage ", st, " never forwards micro-batch ", mb);
      const bool full = n(ActionKind::kBackward) == 1;
      const bool split = n(ActionKind::kBackwardInput) == 1 && n(ActionKind::kBackwardWeight) == 1;
      HP_CHECK(full != split, "pipeline schedule: stage ", st, " micro-batch ", mb,
               full ? " has both a full and a split backward" : " is never backwarded (B, or I and W)");
    }
  }
  replay(s, Costs{});
}

SimResult simulate(const Schedule& s, const Costs& c) { return replay(s, c); }

}  // namespace hp::pp
