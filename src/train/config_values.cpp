// The values of config keys as written and back: each choice's names, and the parsers and
// writers of numbers, lists, dtypes and patterns (config_keys.h).
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "config_keys.h"

namespace hp::train {

template <>
const std::vector<std::pair<DataType, const char*>>& enum_names<DataType>() {
  static const std::vector<std::pair<DataType, const char*>> n = {
      {DataType::kSynthetic, "synthetic"}, {DataType::kBinary, "binary"}, {DataType::kText, "text"},
      {DataType::kMegatron, "megatron"}};
  return n;
}
template <>
const std::vector<std::pair<TokenDtype, const char*>>& enum_names<TokenDtype>() {
  static const std::vector<std::pair<TokenDtype, const char*>> n = {{TokenDtype::kUint16, "uint16"},
                                                                     {TokenDtype::kUint32, "uint32"}};
  return n;
}
template <>
const std::vector<std::pair<ShardStrategy, const char*>>& enum_names<ShardStrategy>() {
  static const std::vector<std::pair<ShardStrategy, const char*>> n = {
      {ShardStrategy::kOptimGradsParams, "optim_grads_params"},
      {ShardStrategy::kOptimGrads, "optim_grads"},
      {ShardStrategy::kOptim, "optim"}};
  return n;
}
template <>
const std::vector<std::pair<Recompute, const char*>>& enum_names<Recompute>() {
  static const std::vector<std::pair<Recompute, const char*>> n = {
      {Recompute::kNone, "none"}, {Recompute::kFull, "full"}, {Recompute::kSelective, "selective"},
      {Recompute::kLight, "light"}};
  return n;
}
template <>
const std::vector<std::pair<PipelineScheduleKind, const char*>>& enum_names<PipelineScheduleKind>() {
  using P = PipelineScheduleKind;
  static const std::vector<std::pair<P, const char*>> n = {{P::kAuto, "auto"},  {P::kGPipe, "gpipe"},
                                                           {P::k1F1B, "1f1b"},  {P::kInterleaved, "interleaved"},
                                                           {P::kZBH1, "zbh1"}, {P::kZBV, "zbv"},
                                                           {P::kDualPipeV, "dualpipev"}};
  return n;
}
template <>
const std::vector<std::pair<ep::DispatcherKind, const char*>>& enum_names<ep::DispatcherKind>() {
  static const std::vector<std::pair<ep::DispatcherKind, const char*>> n = {{ep::DispatcherKind::kAllToAll, "all_to_all"},
                                                                           {ep::DispatcherKind::kDedup, "dedup"}};
  return n;
}
template <>
const std::vector<std::pair<cp::Method, const char*>>& enum_names<cp::Method>() {
  static const std::vector<std::pair<cp::Method, const char*>> n = {
      {cp::Method::kRing, cp::method_name(cp::Method::kRing)},
      {cp::Method::kAllGather, cp::method_name(cp::Method::kAllGather)},
      {cp::Method::kUlysses, cp::method_name(cp::Method::kUlysses)}};
  return n;
}
template <>
const std::vector<std::pair<LrDecay, const char*>>& enum_names<LrDecay>() {
  static const std::vector<std::pair<LrDecay, const char*>> n = {
      {LrDecay::kCosine, "cosine"}, {LrDecay::kLinear, "linear"}, {LrDecay::kConstant, "constant"}};
  return n;
}
template <>
const std::vector<std::pair<OptimizerKind, const char*>>& enum_names<OptimizerKind>() {
  static const std::vector<std::pair<OptimizerKind, const char*>> n = {{OptimizerKind::kAdamW, "adamw"},
                                                                      {OptimizerKind::kMuon, "muon"}};
  return n;
}
template <>
const std::vector<std::pair<optim::NsSchedule, const char*>>& enum_names<optim::NsSchedule>() {
  static const std::vector<std::pair<optim::NsSchedule, const char*>> n = {
      {optim::NsSchedule::kQuintic, "quintic"}, {optim::NsSchedule::kPerStep, "per_step"},
      {optim::NsSchedule::kDeepSeekV4, "deepseek_v4"}};
  return n;
}
template <>
const std::vector<std::pair<optim::MuonScale, const char*>>& enum_names<optim::MuonScale>() {
  static const std::vector<std::pair<optim::MuonScale, const char*>> n = {{optim::MuonScale::kRms, "rms"},
                                                                          {optim::MuonScale::kOriginal, "original"}};
  return n;
}
template <>
const std::vector<std::pair<optim::MuonScheme, const char*>>& enum_names<optim::MuonScheme>() {
  static const std::vector<std::pair<optim::MuonScheme, const char*>> n = {
      {optim::MuonScheme::kOwner, "owner"}, {optim::MuonScheme::kGatherEverywhere, "gather_everywhere"}};
  return n;
}
template <>
const std::vector<std::pair<Device, const char*>>& enum_names<Device>() {
  static const std::vector<std::pair<Device, const char*>> n = {{Device::kCpu, "cpu"}, {Device::kCuda, "cuda"}};
  return n;
}

namespace internal {
namespace {

// The whole text as one number (std::stoll / std::stod), else an error naming `kind`.
template <typename T>
T parse_whole(const Value& v, T (*parse)(const std::string&, size_t*), const char* kind) {
  size_t used = 0;
  T x{};
  try {
    x = parse(v.text, &used);
  } catch (const std::exception&) {
    v.fail("expected ", kind);
  }
  if (used != v.text.size()) v.fail("expected ", kind);
  return x;
}

// The dtypes a config may name: the first name of each is the one written back.
const std::vector<std::pair<const char*, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<const char*, at::ScalarType>> n = {
      {"float32", at::kFloat}, {"fp32", at::kFloat},   {"bfloat16", at::kBFloat16},
      {"bf16", at::kBFloat16}, {"float16", at::kHalf}, {"fp16", at::kHalf}};
  return n;
}

}  // namespace

int64_t as_int(const Value& v, int64_t min, int64_t max) {
  const int64_t x = parse_whole<long long>(v, [](const std::string& t, size_t* n) { return std::stoll(t, n); },
                                           "an integer");
  if (x < min) v.fail("must be >= ", min);
  if (x > max) v.fail("must be <= ", max);
  return x;
}

// "[2, 1, 1]" or "2,1,1" (empty: none), each entry an integer in [min, max].
std::vector<int64_t> as_int_list(const Value& v, int64_t min, int64_t max) {
  std::string t = v.text;
  if (!t.empty() && t.front() == '[') {
    if (t.back() != ']') v.fail("expected a list like [2, 1, 1]");
    t = t.substr(1, t.size() - 2);
  }
  std::vector<int64_t> out;
  std::stringstream ss(t);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) v.fail("an empty entry in the list");
    out.push_back(as_int(Value{v.key, item.substr(a, b - a + 1), v.origin}, min, max));
  }
  return out;
}

double as_double(const Value& v) {
  const double x = parse_whole<double>(v, [](const std::string& t, size_t* n) { return std::stod(t, n); }, "a number");
  if (!std::isfinite(x)) v.fail("expected a finite number");
  return x;
}

bool as_bool(const Value& v) {
  // 1 and 0 too: checkpoints written before the key table's getters saved bools that way.
  if (v.text == "true" || v.text == "True" || v.text == "yes" || v.text == "on" || v.text == "1") return true;
  if (v.text == "false" || v.text == "False" || v.text == "no" || v.text == "off" || v.text == "0") return false;
  v.fail("expected true or false");
}

at::ScalarType as_dtype(const Value& v) {
  for (const auto& [name, t] : dtype_names()) {
    if (v.text == name) return t;
  }
  v.fail("expected float32, bfloat16 or float16");
}

std::string dtype_text(at::ScalarType t) {
  for (const auto& [name, d] : dtype_names()) {
    if (d == t) return name;
  }
  return c10::toString(t);
}

// The shortest text that reads back as exactly `x`.
std::string double_text(double x) {
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream os;
    os.precision(digits);
    os << x;
    if (std::strtod(os.str().c_str(), nullptr) == x) return os.str();
  }
  std::ostringstream os;
  os.precision(17);
  os << x;
  return os.str();
}

std::string bool_text(bool b) { return b ? "true" : "false"; }

std::string list_text(const std::vector<int64_t>& l) {
  std::string out;
  for (int64_t n : l) out += (out.empty() ? "" : ", ") + std::to_string(n);
  return "[" + out + "]";
}

// "[layers_*.attn.wq.weight, output.weight]" or "a,b" (empty: none): parameter-name patterns
// of letters, digits, '_', '.' and '*'.
std::vector<std::string> as_pattern_list(const Value& v) {
  std::string t = v.text;
  if (!t.empty() && t.front() == '[') {
    if (t.back() != ']') v.fail("expected a list like [layers_*.mlp.*, output.weight]");
    t = t.substr(1, t.size() - 2);
  }
  std::vector<std::string> out;
  if (t.find_first_not_of(" \t") == std::string::npos) return out;
  std::stringstream ss(t);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) v.fail("an empty entry in the list");
    const std::string p = item.substr(a, b - a + 1);
    for (char ch : p) {
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '.' && ch != '*') {
        v.fail("pattern '", p, "': only letters, digits, '_', '.' and '*' may appear in a parameter name pattern");
      }
    }
    out.push_back(p);
  }
  return out;
}

std::string list_text(const std::vector<std::string>& l) {
  std::string out;
  for (const std::string& p : l) out += (out.empty() ? "" : ", ") + p;
  return "[" + out + "]";
}

}  // namespace internal
}  // namespace hp::train
