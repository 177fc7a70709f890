// The Trainer's checkpoints: the whole training state saved, in the background, and loaded.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <set>

#include "hp/ckpt/checkpoint.h"
#include "hp/core/error.h"
#include "hp/optim/foreach_adamw.h"
#include "hp/optim/muon.h"
#include "trainer_impl.h"

namespace hp::train {

namespace {

// The most steps a checkpoint may say were done: far past any run, and small enough that
// the data position (steps x global batch) stays inside int64.
constexpr int64_t kMaxSavedSteps = int64_t(1) << 40;

// The settings a checkpoint cannot be resumed under a change of: the model's.
std::vector<std::pair<std::string, std::string>> fixed_settings(const TrainConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [k, v] : resolved_settings(c)) {
    if (k.rfind("model.", 0) == 0) out.emplace_back(k, v);
  }
  return out;
}

// The optimizer's AdamW state of `p`, created (zeros, step 0: what the first step would
// create) when it has none yet.
torch::optim::AdamWParamState& adamw_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto& states = opt.state();
  auto key = optim::state_key(states, p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(0);
    st->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    st->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = states.emplace(key, std::move(st)).first;
  }
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

// The parameters of `opt`'s Muon groups (none for AdamW).
std::set<const c10::TensorImpl*> muon_params(torch::optim::Optimizer& opt) {
  std::set<const c10::TensorImpl*> out;
  for (auto& g : opt.param_groups()) {
    if (dynamic_cast<optim::MuonOptions*>(&g.options()) == nullptr) continue;
    for (const at::Tensor& p : g.params()) out.insert(p.unsafeGetTensorImpl());
  }
  return out;
}

// The step count of `p`'s state (made as the first step would where it has none): Muon's
// or AdamW's.
int64_t& state_step(torch::optim::Optimizer& opt, const std::set<const c10::TensorImpl*>& muon, const at::Tensor& p) {
  if (muon.count(p.unsafeGetTensorImpl())) return static_cast<optim::Muon&>(opt).muon_state(p).step();
  return adamw_state(opt, p).step();
}

}  // namespace

namespace internal {

HostStaging::HostStaging(std::vector<ckpt::Item>& items) {
  for (auto& it : items) {
    if (!it.local.defined() || it.local.device().is_cpu()) continue;
    at::Tensor host = at::empty(it.local.sizes(), it.local.options().device(c10::kCPU));
    staged_.emplace_back(it.local, host);
    it.local = host;
  }
}

void HostStaging::put_back() {
  at::NoGradGuard ng;
  for (auto& [dev, host] : staged_) dev.copy_(host);
  staged_.clear();
}

}  // namespace internal

// Every tensor of the training state as checkpoint items (see save()), the optimizer's
// largest step count through `step`, and each parameter's own (AdamW skips a parameter
// without a gradient, as an MoE expert no token reached: the counts can differ) through
// `steps` when given.
static std::vector<ckpt::Item> state_items(Trainer::Impl& s, int64_t* step,
                                           std::map<std::string, int64_t>* steps = nullptr) {
  std::vector<ckpt::Item> items;
  torch::optim::Optimizer& opt = s.master ? s.master->inner() : *s.opt;
  const auto muon = muon_params(opt);
  size_t j = 0;  // index into the masters: the parameters that require grad
  *step = 0;
  for (size_t i = 0; i < s.sharded.params.size(); ++i) {
    items.push_back({s.sharded.params[i].name, s.sharded.params[i].param.detach(), s.sharded.params[i].box});
    if (!s.sharded.params[i].param.requires_grad()) continue;
    at::Tensor stepped = s.sharded.params[i].param;
    if (s.master) {
      stepped = s.master->masters()[j++];
      items.push_back({s.sharded.params[i].name + ".master", stepped.detach(), s.sharded.params[i].box});
    }
    const int64_t n = state_step(opt, muon, stepped);
    *step = std::max<int64_t>(*step, n);
    if (steps) (*steps)[s.sharded.params[i].name] = n;
    if (muon.count(stepped.unsafeGetTensorImpl())) {  // Muon's momentum, resharded like the parameter
      items.push_back({s.sharded.params[i].name + ".momentum", static_cast<optim::Muon&>(opt).muon_state(stepped).momentum_buffer(),
                       s.sharded.params[i].box});
      continue;
    }
    auto& st = adamw_state(opt, stepped);
    items.push_back({s.sharded.params[i].name + ".exp_avg", st.exp_avg(), s.sharded.params[i].box});
    items.push_back({s.sharded.params[i].name + ".exp_avg_sq", st.exp_avg_sq(), s.sharded.params[i].box});
  }
  for (torch::nn::Module* root : s.sharded.roots) {
    for (const auto& b : root->named_buffers()) {
      std::vector<int64_t> shape = b.value().sizes().vec();
      if (shape.empty()) shape = {1};
      items.push_back({b.key(), b.value().view(shape), make_shard_spec(shape, {})});
    }
  }
  return items;
}

// The small values of a checkpoint: the steps done, AdamW's step, the model settings.
static std::map<std::string, std::string> saved_values(const Trainer::Impl& s, int64_t opt_step,
                                                       const std::map<std::string, int64_t>& steps) {
  std::map<std::string, std::string> values = {{"steps", std::to_string(s.steps)},
                                               {"optimizer_step", std::to_string(opt_step)}};
  for (const auto& [name, n] : steps) values["optimizer_step." + name] = std::to_string(n);
  // Which parameters hold a (zeroed) gradient between steps: libtorch 1.x's zero_grad() keeps
  // one, and AdamW then steps the parameter even when it gets no gradient (an MoE expert no
  // token reached), where one that never had a gradient is skipped. Restored on load.
  for (size_t i = 0; i < s.sharded.params.size(); ++i) {
    if (!s.master && s.sharded.params[i].param.requires_grad() && s.sharded.params[i].param.grad().defined()) values["grad_held." + s.sharded.params[i].name] = "1";
  }
  for (const auto& [k, v] : fixed_settings(s.c)) values["config." + k] = v;
  // Every other setting of the run, for a resume to compare its own with (run.cpp).
  for (const auto& [k, v] : resolved_settings(s.c)) {
    if (k.rfind("model.", 0) != 0) values["run." + k] = v;
  }
  values["optimizer"] = to_string(s.c.optimizer);  // its state's kind
  return values;
}

ckpt::Checkpointable::State Trainer::checkpoint_state() const {
  Impl& s = *impl_;
  int64_t opt_step = 0;
  std::map<std::string, int64_t> steps;
  State out;
  out.items = state_items(s, &opt_step, &steps);
  out.values = saved_values(s, opt_step, steps);
  return out;
}

void Trainer::save(const std::string& dir) const {
  State st = checkpoint_state();
  ckpt::to_host(st.items, /*copy=*/false);
  ckpt::save(st.items, dir, impl_->world, st.values);
}

void Trainer::load_checkpoint(const std::string& dir) { load(dir); }

namespace {

// Raises naming the first model setting of `c` that the checkpoint `dir` (its metadata
// `values`) saved differently, or did not save. Compared as values (the saved text is parsed
// as the config's would be), not as text.
void check_same_model(const std::map<std::string, std::string>& values, const TrainConfig& c, const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> saved;
  for (const auto& [k, v] : values) {
    if (k.rfind("config.model.", 0) == 0) saved.emplace_back(k.substr(7), v);
  }
  TrainConfig then;
  then.model = model_from_settings(saved, "resume from " + dir + ": the checkpoint's config");
  const auto theirs = fixed_settings(then);
  for (const auto& [k, v] : fixed_settings(c)) {
    // What steers the routing (an MoE's capacity, balancing) is not the model's shape: the
    // run's resume decides on a change of it (run.cpp, check_resume_settings).
    if (resume_rule(c, k) != ResumeRule::kFixed) continue;
    auto it = values.find("config." + k);
    auto parsed = std::find_if(theirs.begin(), theirs.end(), [&k = k](const auto& e) { return e.first == k; });
    HP_CHECK(it != values.end() && parsed != theirs.end() && parsed->second == v, "resume from ", dir, ": ", k, "=",
             it == values.end() ? std::string("(not saved)") : it->second, " in the checkpoint but ", k, "=", v,
             " in this config (the model cannot change on resume)");
  }
}

}  // namespace

ResumeReport Trainer::load(const std::string& dir) {
  Impl& s = *impl_;
  // The saved settings first (the metadata alone): a changed model is named by its key,
  // not by the first tensor whose shape it changed.
  const std::map<std::string, std::string> values = ckpt::load({}, dir);
  check_same_model(values, s.c, dir);
  // The optimizer's state is of its kind: AdamW's moments, or Muon's momentum.
  auto saved_opt = values.find("optimizer");
  const std::string theirs_opt = saved_opt == values.end() ? "adamw" : saved_opt->second;  // before it was saved
  ResumeReport report;
  {
    bool known = false;
    for (const auto& [kind, name] : enum_names<OptimizerKind>()) {
      if (theirs_opt == name) report.saved_optimizer = kind, known = true;
    }
    HP_CHECK(known, "resume from ", dir, ": optimizer=", theirs_opt, " in the checkpoint: not an optimizer hp-train knows");
  }
  // Which parameters' saved state is the other optimizer's (a switched optimizer, or a
  // matrix routed the other way): those start their state afresh. Decided for the whole
  // model alike on every rank, from the checkpoint's tensor names.
  const std::map<std::string, ckpt::SavedTensor> saved_tensors = ckpt::saved_tensors(dir);
  auto has = [&](const std::string& name) { return saved_tensors.count(name) > 0; };
  std::set<std::string> fresh;
  for (const internal::RoutedParam& p : internal::routed_params(s.c)) {
    const char* mine = p.muon ? ".momentum" : ".exp_avg";
    const char* other = p.muon ? ".exp_avg" : ".momentum";
    if (has(p.name + mine)) {
      ++report.kept_tensors;
      continue;
    }
    HP_CHECK(has(p.name + other), "resume from ", dir, ": the checkpoint holds no optimizer state for '", p.name,
             "' (neither ", p.name, ".momentum nor ", p.name, ".exp_avg)");
    fresh.insert(p.name);
    ++report.fresh_tensors;
    report.fresh_elements += p.numel;
  }
  // The counts next, each parsed whole and range-checked, before any state changes: the steps
  // fix the data position and the schedule, AdamW's counts its bias correction.
  const std::string mpath = ckpt::committed_dir(dir) + "/metadata.json";
  auto count = [&](const std::string& key, int64_t min, int64_t max, const int64_t* fallback) -> int64_t {
    auto it = values.find(key);
    if (it == values.end() && fallback) return *fallback;
    HP_CHECK(it != values.end(), "resume from ", dir, ": '", mpath, "' has no value '", key,
             "' (not a checkpoint hp-train wrote)");
    int64_t x = 0;
    const std::string& text = it->second;
    const auto r = std::from_chars(text.data(), text.data() + text.size(), x);
    const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    HP_CHECK(digits && r.ec == std::errc() && r.ptr == text.data() + text.size() && x >= min && x <= max,
             "resume from ", dir, ": '", mpath, "' has ", key, " = \"", text.size() > 40 ? text.substr(0, 40) + "..." : text,
             "\": expected a whole number from ", min, " to ", max);
    return x;
  };
  const int64_t steps = count("steps", 0, kMaxSavedSteps, nullptr);
  // One optimizer step per training step: the counts never exceed the steps.
  const int64_t opt_step = count("optimizer_step", 0, steps, nullptr);
  std::vector<int64_t> param_steps;
  for (size_t i = 0; i < s.sharded.params.size(); ++i) {
    if (!s.sharded.params[i].param.requires_grad()) continue;
    // Each parameter's own count (the largest for a checkpoint that has none per parameter).
    param_steps.push_back(count("optimizer_step." + s.sharded.params[i].name, 0, opt_step, &opt_step));
    auto held = values.find("grad_held." + s.sharded.params[i].name);
    HP_CHECK(held == values.end() || held->second == "1", "resume from ", dir, ": '", mpath, "' has grad_held.",
             s.sharded.params[i].name, " = \"", held == values.end() ? "" : held->second, "\": expected \"1\" (or no entry)");
  }
  int64_t unused = 0;
  auto items = state_items(s, &unused);
  // A parameter starting afresh loads its value (and master) but not its optimizer state
  // (zeroed below).
  if (!fresh.empty()) {
    auto is_fresh_state = [&](const ckpt::Item& it) {
      for (const char* suffix : {".momentum", ".exp_avg", ".exp_avg_sq"}) {
        const size_t n = std::strlen(suffix);
        if (it.name.size() > n && it.name.compare(it.name.size() - n, n, suffix) == 0 &&
            fresh.count(it.name.substr(0, it.name.size() - n))) {
          return true;
        }
      }
      return false;
    };
    items.erase(std::remove_if(items.begin(), items.end(), is_fresh_state), items.end());
  }
  {
    at::NoGradGuard ng;
    internal::HostStaging staged(items);
    ckpt::load(items, dir);
    staged.put_back();
  }
  s.steps = steps;
  torch::optim::Optimizer& opt = s.master ? s.master->inner() : *s.opt;
  const auto muon = muon_params(opt);
  size_t j = 0, k = 0;
  for (size_t i = 0; i < s.sharded.params.size(); ++i) {
    if (!s.sharded.params[i].param.requires_grad()) continue;
    const int64_t n = param_steps[k++];
    const at::Tensor& stepped = s.master ? s.master->masters()[j++] : s.sharded.params[i].param;
    if (fresh.count(s.sharded.params[i].name)) {  // as its first step would find it, whatever this trainer did before
      at::NoGradGuard ng;
      if (muon.count(stepped.unsafeGetTensorImpl())) {
        static_cast<optim::Muon&>(opt).muon_state(stepped).momentum_buffer().zero_();
      } else {
        adamw_state(opt, stepped).exp_avg().zero_();
        adamw_state(opt, stepped).exp_avg_sq().zero_();
      }
    }
    state_step(opt, muon, stepped) = fresh.count(s.sharded.params[i].name) ? 0 : n;
    if (!s.master && values.count("grad_held." + s.sharded.params[i].name)) s.sharded.params[i].param.mutable_grad() = at::zeros_like(s.sharded.params[i].param);
  }
  return report;
}


}  // namespace hp::train
