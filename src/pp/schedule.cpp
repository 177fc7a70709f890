#include "hp/pp/schedule.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "hp/core/error.h"
#include "timeline.h"

namespace hp::pp {

using internal::is_backward;
using internal::Timeline;

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
    case ActionKind::kSendForward:
      return "SEND_F";
    case ActionKind::kRecvForward:
      return "RECV_F";
    case ActionKind::kSendBackward:
      return "SEND_B";
    case ActionKind::kRecvBackward:
      return "RECV_B";
  }
  return "?";
}



}  // namespace

bool Action::is_compute() const {
  return kind == ActionKind::kForward || is_backward(kind);
}

bool Action::is_comm() const {
  return kind == ActionKind::kSendForward || kind == ActionKind::kRecvForward || kind == ActionKind::kSendBackward ||
         kind == ActionKind::kRecvBackward;
}

int Action::peer_stage() const {
  return kind == ActionKind::kSendForward || kind == ActionKind::kRecvBackward ? stage + 1 : stage - 1;
}

std::string Action::to_string() const {
  std::string s = std::to_string(stage) + kind_token(kind);
  if (is_compute() || is_comm()) s += std::to_string(microbatch);
  if (paired) s += "+";
  return s;
}

Action Action::parse(const std::string& token_text) {
  // A trailing "+": a forward paired with the next compute action.
  const bool paired = !token_text.empty() && token_text.back() == '+';
  const std::string token = paired ? token_text.substr(0, token_text.size() - 1) : token_text;
  size_t i = 0;
  while (i < token.size() && std::isdigit(static_cast<unsigned char>(token[i]))) ++i;
  HP_CHECK(i > 0 && i < token.size() && i <= 9, "pipeline schedule: '", token,
           "' is not an action (a stage number, then F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B with a micro-batch, "
           "or UNSHARD, RESHARD, REDUCE_GRAD)");
  Action a;
  a.stage = std::stoi(token.substr(0, i));
  const std::string rest = token.substr(i);
  HP_CHECK(!paired || rest[0] == 'F', "pipeline schedule: '", token_text,
           "': only a forward pairs with the next action ('+')");
  for (ActionKind k : {ActionKind::kUnshard, ActionKind::kReshard, ActionKind::kReduceGrad}) {
    if (rest == kind_token(k)) {
      a.kind = k;
      return a;
    }
  }
  size_t name_len = 1;
  a.kind = ActionKind::kForward;
  bool known = std::string("FBIW").find(rest[0]) != std::string::npos;
  if (known) {
    a.kind = rest[0] == 'F' ? ActionKind::kForward
             : rest[0] == 'B' ? ActionKind::kBackward
             : rest[0] == 'I' ? ActionKind::kBackwardInput
                              : ActionKind::kBackwardWeight;
  }
  for (ActionKind k : {ActionKind::kSendForward, ActionKind::kRecvForward, ActionKind::kSendBackward,
                       ActionKind::kRecvBackward}) {
    const std::string name = kind_token(k);
    if (rest.compare(0, name.size(), name) == 0) {
      a.kind = k;
      name_len = name.size();
      known = true;
    }
  }
  const std::string digits = rest.substr(std::min(name_len, rest.size()));
  const bool number = !digits.empty() && digits.size() <= 9 &&
                      std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  HP_CHECK(known && number, "pipeline schedule: '", token,
           "' is not an action (a stage number, then F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B with a micro-batch, "
           "or UNSHARD, RESHARD, REDUCE_GRAD)");
  a.microbatch = std::stoi(digits);
  a.paired = paired;
  return a;
}

int Schedule::rank_of(int stage) const {
  HP_CHECK(stage >= 0 && stage < stages, "pipeline schedule: stage ", stage, " is not in [0, ", stages,
           ") (an action names a stage before the first or after the last)");
  return placement.empty() ? stage % ranks : placement[static_cast<size_t>(stage)];
}

std::vector<int> Schedule::stages_of(int r) const {
  std::vector<int> out;
  for (int st = 0; st < stages; ++st) {
    if (rank_of(st) == r) out.push_back(st);
  }
  return out;
}

std::string Schedule::to_string() const {
  std::ostringstream os;
  if (!placement.empty()) {
    os << "placement:";
    for (int r : placement) os << " " << r;
    os << "\n";
  }
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
    if (line.rfind("placement:", 0) == 0 && s.actions.empty() && s.placement.empty()) {
      std::istringstream words(line.substr(10));
      for (int r; words >> r;) s.placement.push_back(r);
      HP_CHECK(static_cast<int>(s.placement.size()) == stages, "pipeline schedule: the placement line gives ",
               s.placement.size(), " ranks for ", stages, " stages");
      continue;
    }
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
  for (int r : s.placement) {
    HP_CHECK(r >= 0 && r < s.ranks, "pipeline schedule: the placement names rank ", r, " of ", s.ranks);
  }
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
  // Micro-batches go through the chunks in rounds of `per_round` (ranks when m is a
  // multiple of it; otherwise as many rounds as fit, m / rounds each, as the anchors do).
  const int rounds = std::max(1, m / ranks);
  HP_CHECK(v == 1 || m % rounds == 0, "pipeline schedule: interleaved 1F1B with ", m, " micro-batches over ", ranks,
           " ranks (", rounds, " rounds that do not divide them) is not supported yet");
  const int per_round = v == 1 ? ranks : m / rounds;
  const int total = m * v;  // forwards (and backwards) per rank
  for (int r = 0; r < ranks; ++r) {
    // Forward k runs chunk (k / per_round) % v on micro-batch (k / (per_round v)) per_round +
    // k % per_round; backward k the chunks in reverse. With v = 1 this is plain 1F1B.
    auto fwd = [&](int k) {
      const int chunk = v == 1 ? 0 : (k / per_round) % v;
      const int mb = v == 1 ? k : (k / (per_round * v)) * per_round + k % per_round;
      return compute(chunk * ranks + r, ActionKind::kForward, mb);
    };
    auto bwd = [&](int k) {
      const int chunk = v == 1 ? 0 : v - 1 - (k / per_round) % v;
      const int mb = v == 1 ? k : (k / (per_round * v)) * per_round + k % per_round;
      return compute(chunk * ranks + r, ActionKind::kBackward, mb);
    };
    const int warmup = std::min(total, v == 1 ? ranks - r - 1 : (ranks - r - 1) * 2 + (v - 1) * per_round);
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

Schedule zero_bubble_h1(int ranks, int m) {
  const Schedule base = one_f_one_b(ranks, m);
  Schedule s = empty(ranks, ranks, m);
  // Unit-cost replay: at each slot every free rank takes its next F or I when its input is
  // ready (unless that F would exceed the memory bound), else its oldest pending W.
  Timeline timeline(ranks);
  std::vector<size_t> next(ranks, 0);
  std::vector<std::vector<int>> pending(ranks);  // micro-batches whose I ran, W not yet
  std::vector<int> held(ranks, 0);               // micro-batches between F and W
  size_t left = static_cast<size_t>(3 * m * ranks);  // an F, an I and a W per micro-batch and rank
  for (int t = 0; left > 0; ++t) {
    HP_INTERNAL_ASSERT(t < 16 * (m + ranks) + 64, "zero_bubble_h1 replay did not finish");
    for (int r = 0; r < ranks; ++r) {
      Action pick;
      bool have = false;
      if (next[r] < base.actions[r].size()) {
        const Action& a = base.actions[r][next[r]];
        const bool fwd = a.kind == ActionKind::kForward;
        const Action candidate = fwd ? a : Action{r, ActionKind::kBackwardInput, a.microbatch};
        const bool over = fwd && held[r] >= ranks && !pending[r].empty();
        if (timeline.ready_by(candidate, t) && !over) {
          pick = candidate;
          have = true;
          ++next[r];
          if (fwd) ++held[r];
        }
      }
      if (!have && !pending[r].empty()) {
        pick = Action{r, ActionKind::kBackwardWeight, pending[r].front()};
        pending[r].erase(pending[r].begin());
        --held[r];
        have = true;
      }
      if (!have) continue;
      if (pick.kind == ActionKind::kBackwardInput) pending[r].push_back(pick.microbatch);
      timeline.finish(pick, t + 1);
      s.actions[r].push_back(pick);
      --left;
    }
  }
  validate(s);
  return s;
}

Schedule zero_bubble_v(int ranks, int m) {
  Schedule s = empty(ranks, 2 * ranks, m);
  const int S = 2 * ranks;
  for (int st = 0; st < S; ++st) s.placement.push_back(st < ranks ? st : S - 1 - st);
  Timeline timeline(S);
  std::vector<int> next_f(S, 0), next_i(S, 0);
  std::vector<std::vector<std::pair<int, int>>> pending(ranks);  // (stage, mb) whose W is due
  std::vector<int> held(ranks, 0);
  size_t left = static_cast<size_t>(3 * m * S);
  for (int t = 0; left > 0; ++t) {
    HP_INTERNAL_ASSERT(t < 32 * (m + ranks) + 64, "zero_bubble_v replay did not finish");
    for (int r = 0; r < ranks; ++r) {
      const int later = S - 1 - r, earlier = r;  // this rank's two stages
      Action pick;
      bool have = false;
      for (int st : {later, earlier}) {  // a ready input-gradient backward, the later stage first
        const Action a{st, ActionKind::kBackwardInput, next_i[st]};
        if (have || a.microbatch >= m || !timeline.ready_by(a, t)) continue;
        pick = a;
        have = true;
      }
      for (int st : {later, earlier}) {  // a ready forward, within the memory bound
        const Action a{st, ActionKind::kForward, next_f[st]};
        if (have || a.microbatch >= m || held[r] >= S || !timeline.ready_by(a, t)) continue;
        pick = a;
        have = true;
      }
      if (!have && !pending[r].empty()) {
        pick = Action{pending[r].front().first, ActionKind::kBackwardWeight, pending[r].front().second};
        pending[r].erase(pending[r].begin());
        have = true;
      }
      if (!have) continue;
      if (pick.kind == ActionKind::kForward) {
        ++next_f[pick.stage];
        ++held[r];
      } else if (pick.kind == ActionKind::kBackwardInput) {
        ++next_i[pick.stage];
        pending[r].push_back({pick.stage, pick.microbatch});
      } else {
        --held[r];
      }
      timeline.finish(pick, t + 1);
      s.actions[r].push_back(pick);
      --left;
    }
  }
  validate(s);
  return s;
}

Schedule dualpipev(int ranks, int m) {
  HP_CHECK(ranks >= 1, "pipeline schedule: ranks must be at least 1, got ", ranks);
  HP_CHECK(m >= 2 * ranks, "pipeline schedule: dualpipev over ", ranks, " ranks needs at least ", 2 * ranks,
           " micro-batches (2 x ranks: its steady phase pairs them), got ", m);
  Schedule s = empty(ranks, 2 * ranks, m);
  const int S = 2 * ranks;
  for (int st = 0; st < S; ++st) s.placement.push_back(st < ranks ? st : S - 1 - st);
  for (int r = 0; r < ranks; ++r) {
    // Chunk 0 is the rank's stage on the way down the V (r), chunk 1 its stage on the way
    // back (2 ranks - 1 - r); each runs its micro-batches in order.
    const int stage[2] = {r, S - 1 - r};
    int next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::vector<Action>& out = s.actions[static_cast<size_t>(r)];
    std::vector<Action> weights;  // input gradients taken, their weight gradients owed (oldest first)
    // `paired`: overlapped with the backward that follows (F&B).
    auto forward = [&](int k, bool paired = false) {
      out.push_back(compute(stage[k], ActionKind::kForward, next_f[k]++));
      out.back().paired = paired;
    };
    // Split (zero bubble: the input gradient now, the weight gradient owed) or whole.
    auto backward = [&](int k, bool split) {
      const int mb = next_b[k]++;
      if (!split) {
        out.push_back(compute(stage[k], ActionKind::kBackward, mb));
        return;
      }
      out.push_back(compute(stage[k], ActionKind::kBackwardInput, mb));
      weights.push_back(compute(stage[k], ActionKind::kBackwardWeight, mb));
    };
    auto weight = [&] {
      HP_INTERNAL_ASSERT(!weights.empty(), "dualpipev: a weight gradient with none owed");
      out.push_back(weights.front());
      weights.erase(weights.begin());
    };
    const int later = ranks - r - 1;  // stages of the V after this rank's first
    // Warm-up: chunk 0's forwards until the first micro-batch has come back up to chunk 1.
    for (int i = 0; i < 2 * later; ++i) forward(0);
    for (int i = 0; i < r + 1; ++i) {
      forward(0);
      forward(1);
    }
    // Chunk 1's first backwards, their weight gradients filling the wait for the next input.
    for (int i = 0; i < later; ++i) {
      backward(1, true);
      weight();
      forward(1);
    }
    // Steady: pairs of one chunk's forward and the other's backward (F&B: on a device one
    // micro-batch's compute beside the other's communication). The last rank's first
    // forward runs alone: its backward's input is that forward's own output, come back.
    for (int i = 0; i < m - 2 * ranks + r + 1; ++i) {
      forward(0, !(i == 0 && r == ranks - 1));
      backward(1, false);
      forward(1, true);
      backward(0, false);
    }
    for (int i = 0; i < later; ++i) {
      backward(1, false);
      forward(1, true);
      backward(0, false);
    }
    // Drain: the backwards left, the second half split so that weight gradients fill the
    // waits that follow.
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      backward(1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      backward(0, split);
    }
    for (int i = 0; i < later; ++i) {
      weight();
      backward(0, true);
    }
    while (!weights.empty()) weight();
    HP_INTERNAL_ASSERT(next_f[0] == m && next_f[1] == m && next_b[0] == m && next_b[1] == m,
                       "dualpipev: rank ", r, " does not run every micro-batch once");
  }
  validate(s);
  return s;
}

}  // namespace hp::pp
