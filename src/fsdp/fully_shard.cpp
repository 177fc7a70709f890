// fully_shard: building a parameter group (shards, the module's tensors made storage-less,
// hooks), and the registry of handles and managed parameters.
//
// The rest of fsdp, by concern (see docs/fsdp.md, "Where the code is"):
//   param_state.h      per-parameter state: shard, unsharded tensor, kept gradients
//   group.h            a parameter group (FSDPModule::State) and its two state machines
//   group_unshard.cpp  storage: all-gather into the module's tensors, reshard
//   group_reduce.cpp   gradients: reduce-scatter, all-reduce, results on the shards
//   collectives.h/cpp  the stateless copies in and out of fused buffers
//   comm_context.h/cpp the order of collectives across groups and roots; overlap
//   module_state.cpp   the hooks, the training-state machine, each root's pass
//   fsdp_module.cpp    the public handle's verbs
//   buffers.h          the owning types: UnshardedParam, OwnedBuffer
// Every dtype comes from the group's GroupDtypes (resolve_dtypes).
#include "hp/fsdp/fully_shard.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include "buffers.h"
#include "group.h"
#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/core/weak_key_map.h"
#include "hp/fsdp/shard_plan.h"
#include "hp/hooks/call.h"
#include "hp/hooks/recompute.h"
#include "hp/runtime.h"

namespace hp {

using detail::OwnedBuffer;
using detail::ParamInfo;

namespace {

constexpr int64_t kFusedAlignBytes = 64;

// Both keyed by address, each entry living as long as its handle (hp/core/weak_key_map.h;
// the value is unused: they are sets). The handle of each module fully_shard was applied
// to (a handle outliving its module, the address reused by a new module, is told apart by
// the handle's owner_gone()), and the parameters already managed, by tensor.
std::mutex g_mu;
WeakKeyMap<torch::nn::Module, std::weak_ptr<FSDPModule>, bool> g_handles;
WeakKeyMap<c10::TensorImpl, std::weak_ptr<FSDPModule>, bool> g_managed;

}  // namespace

namespace {

// A parameter used while its module is resharded has no storage, and ATen raises "...data
// is not allocated yet". Name the sharded module whose forward ran outside hp::call.
void translate_unallocated(torch::nn::Module& failing, const std::exception& e) {
  if (std::string(e.what()).find("not allocated") == std::string::npos) return;
  std::set<const c10::TensorImpl*> used;
  for (const auto& t : failing.parameters(/*recurse=*/true)) used.insert(t.unsafeGetTensorImpl());
  std::vector<FSDPHandle> live;
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_handles.for_each_live([&](const torch::nn::Module*, auto& e) {
      if (auto h = e.owner.lock()) live.push_back(h);
    });
  }
  for (const auto& h : live) {
    detail::GroupState& s = detail::FsdpAccess::state(*h);
    if (s.unsharded() || s.gathering() || in_call(*s.module)) continue;
    for (const auto& p : s.params) {
      if (!used.count(p.param.tensor().unsafeGetTensorImpl())) continue;
      throw Error(detail::str_cat(
          "module ", s.label, " is sharded by fully_shard and its forward ran outside hp::call, so its ",
          "parameters (here '", p.name, "', used by ", failing.name(), ") were not gathered; call it as ",
          "hp::call(module, inputs...)"));
    }
  }
}

// wait_per_submodule: the submodule owning each parameter that needs a gradient (-1 when
// several share it, or the module itself owns it), and a pre-forward hook on each such
// submodule that waits for its parameters' all-gathers. Held weakly: the hooks live as
// long as the submodules.
void watch_submodules(const FSDPHandle& handle) {
  detail::GroupState& s = detail::FsdpAccess::state(*handle);
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < s.params.size(); ++i) index[s.params[i].param.tensor().unsafeGetTensorImpl()] = i;
  std::vector<int> owners(s.params.size(), 0);  // how many submodules register each parameter
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> subs;
  for (const auto& item : s.module->named_modules("", /*include_self=*/false)) subs.emplace_back(item.key(), item.value());
  for (const auto& [name, sub] : subs) {
    for (const auto& t : sub->parameters(/*recurse=*/false)) {
      auto it = index.find(t.unsafeGetTensorImpl());
      if (it != index.end()) ++owners[it->second];
    }
  }
  std::weak_ptr<FSDPModule> weak = handle;
  for (const auto& [name, sub] : subs) {
    const int k = static_cast<int>(s.submodules.size());
    bool any = false;
    for (const auto& t : sub->parameters(/*recurse=*/false)) {
      auto it = index.find(t.unsafeGetTensorImpl());
      if (it == index.end() || owners[it->second] != 1 || !s.params[it->second].requires_grad) continue;
      s.params[it->second].submodule = k;
      any = true;
    }
    if (!any) continue;
    s.submodules.push_back(name);
    ForwardHooks h;
    h.pre = [weak, k](torch::nn::Module&) {
      if (auto hd = weak.lock()) detail::FsdpAccess::state(*hd).finish_submodule(k);
    };
    register_forward_hooks(*sub, std::move(h));
  }
}

// "ClassName (fully_shard #k)": k counts fully_shard calls, so equal blocks differ in
// errors and traces.
std::string describe(const torch::nn::Module& m) {
  static std::atomic<int> count{0};
  return detail::str_cat(m.name(), " (fully_shard #", ++count, ")");
}

// Every rank must shard the same parameters: compare (count, then per parameter dtype,
// ndim and dims) across `comm` before anything is sharded.
void check_same_shapes(const CommPtr& comm, const std::vector<std::pair<std::string, at::Tensor>>& ps,
                       const std::string& label, c10::Device dev) {
  std::vector<int64_t> sig{static_cast<int64_t>(ps.size())};
  for (const auto& [name, t] : ps) {
    sig.push_back(static_cast<int64_t>(t.scalar_type()));
    sig.push_back(t.dim());
    for (int64_t d : t.sizes()) sig.push_back(d);
  }
  const auto opts = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor len = at::full({1}, static_cast<int64_t>(sig.size()), opts);
  comm->all_reduce(len, {ReduceOp::MAX}).wait();
  const int64_t L = len.item<int64_t>();
  at::Tensor mine = at::full({L}, -1, at::kLong);
  for (size_t i = 0; i < sig.size(); ++i) mine[i] = sig[i];
  mine = mine.to(dev);
  at::Tensor mx, mn;
  if (all_ranks_equal(comm, mine, &mx, &mn)) return;
  // Name the first parameter whose signature differs.
  int64_t pos = 1;
  for (const auto& [name, t] : ps) {
    int64_t end = pos + 2 + t.dim();
    if (!at::equal(mx.narrow(0, pos, end - pos), mn.narrow(0, pos, end - pos))) {
      HP_CHECK(false, "fully_shard(", label, "): parameter '", name, "' is ", t.scalar_type(), t.sizes(),
               " on rank ", comm->rank(), " but differs on other ranks of group '", comm->name(),
               "': every rank must build the same model");
    }
    pos = end;
  }
  HP_CHECK(false, "fully_shard(", label, "): ranks of group '", comm->name(), "' have different ",
           "parameter lists (", ps.size(), " parameters on rank ", comm->rank(), ")");
}

// The communicator of this rank's group of `g` consecutive ranks of `shard`, made once per
// (communicator, size) and shared by every module that asks (a split is collective: every
// rank of `shard` reaches it in the same fully_shard call).
CommPtr post_forward_group(const CommPtr& shard, int g) {
  static std::mutex mu;
  // Weak both ways: the modules using a group keep it alive, and nothing outlives them.
  static std::map<std::pair<const Communicator*, int>, std::pair<std::weak_ptr<Communicator>, std::weak_ptr<Communicator>>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (auto e = cache.begin(); e != cache.end();) {
    e = (e->second.first.expired() || e->second.second.expired()) ? cache.erase(e) : std::next(e);
  }
  auto key = std::make_pair(shard.get(), g);
  auto it = cache.find(key);
  if (it != cache.end() && it->second.first.lock() == shard) {
    if (CommPtr sub = it->second.second.lock()) return sub;
  }
  CommOptions co;
  co.name = detail::str_cat(shard->name(), "/post-forward", g);
  CommPtr sub = shard->split(shard->rank() / g, shard->rank(), co);
  cache[key] = {shard, sub};
  return sub;
}

}  // namespace

namespace {

// The checks of the options alone, naming the module.
void check_options(const FullyShardOptions& o, const std::string& label) {
  HP_CHECK(o.reshard_after_forward_group_size >= 0, "fully_shard(", label, "): reshard_after_forward_group_size=",
           o.reshard_after_forward_group_size, " must be positive (0: not set)");
  HP_CHECK(o.reshard_after_forward_group_size == 0 || o.reshard_after_forward, "fully_shard(", label,
           "): reshard_after_forward_group_size=", o.reshard_after_forward_group_size,
           " with reshard_after_forward=false: the group size says how to reshard after forward, so it needs true");
  HP_CHECK(!(o.wait_per_submodule && o.comm_fusion), "fully_shard(", label,
           "): wait_per_submodule with comm_fusion is not supported yet (comm_fusion gathers the module's ",
           "parameters in one op, so there is nothing to wait for per submodule): set one of them false");
}

// The groups of `st` (shard, and replicate for HSDP) from the options' mesh (none: the
// world); returns the group over both, which the signature check runs on.
CommPtr place_groups(detail::GroupState& st, const FullyShardOptions& o, const std::string& label) {
  CommPtr world;
  if (!o.mesh) {
    world = hp::world();
    st.shard = world;
  } else {
    const auto& names = o.mesh->names();
    auto has = [&](const char* d) { return std::find(names.begin(), names.end(), d) != names.end(); };
    if (has("dp_shard")) {
      // Named dims: shard over dp_shard, replicate over dp_replicate when there is one; other
      // dims (tp, pp) are not data-parallel, and fully_shard works within each of their groups.
      st.shard_dim = "dp_shard";
      st.shard = o.mesh->group("dp_shard");
      if (has("dp_replicate")) st.replicate = o.mesh->group("dp_replicate");
      world = has("dp_replicate") ? o.mesh->group({"dp_replicate", "dp_shard"}) : st.shard;
    } else {
      HP_CHECK(o.mesh->ndim() == 1 || o.mesh->ndim() == 2, "fully_shard(", label,
               ") takes a mesh with a dp_shard dim (and optionally dp_replicate, tp, ...), or a 1-D mesh (the "
               "shard dim) or a 2-D mesh (replicate, shard); got ", o.mesh->ndim(), " dims without a dp_shard");
      if (o.mesh->ndim() == 1) {
        st.shard = o.mesh->group(names[0]);
      } else {
        st.replicate = o.mesh->group(names[0]);
        st.shard = o.mesh->group(names[1]);
      }
      st.shard_dim = names.back();
      world = o.mesh->group(names);
    }
  }
  return world;
}

// The parameters one call manages: not ignored, not already managed by a nested call, each
// tensor once (shared parameters appear under several names).
std::vector<std::pair<std::string, at::Tensor>> managed_params(torch::nn::Module& module, const FullyShardOptions& o) {
  std::set<const c10::TensorImpl*> ignored;
  for (const auto& t : o.ignored_params) ignored.insert(t.unsafeGetTensorImpl());
  std::vector<std::pair<std::string, at::Tensor>> mine;
  {
    std::lock_guard<std::mutex> g(g_mu);
    std::set<const c10::TensorImpl*> seen;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      const bool taken = g_managed.find(impl) != nullptr;
      if (ignored.count(impl) || taken || !seen.insert(impl).second) continue;
      mine.emplace_back(item.key(), item.value());
    }
  }
  return mine;
}

// The parameters checked alike on every rank of `world` and within the group (one dtype, one
// device the group's communicators support); the group's device, dtypes and post-forward
// group settled. Returns the parameters' dtype.
at::ScalarType settle_group(detail::GroupState& st, torch::nn::Module& module, const CommPtr& world,
                            const std::vector<std::pair<std::string, at::Tensor>>& mine, const FullyShardOptions& o,
                            const std::string& label) {
  // The signature check runs on the CPU, or on the parameters' device for a backend that
  // moves only device tensors (nccl).
  c10::Device sig_dev = c10::kCPU;
  if (!world->supports_device(sig_dev)) {
    auto all = module.parameters(/*recurse=*/true);
    HP_CHECK(o.device || !all.empty(), "fully_shard(", label, "): a module without parameters on a ",
             world->backend(), " communicator");
    sig_dev = o.device ? *o.device : all[0].device();
  }
  check_same_shapes(world, mine, label, sig_dev);
  at::ScalarType pdt = mine.empty() ? at::kFloat : mine[0].second.scalar_type();
  for (const auto& [name, t] : mine) {
    HP_CHECK(t.scalar_type() == pdt, "not supported yet: parameters of different dtypes in one fully_shard ",
             "group (", label, ": '", mine[0].first, "' is ", pdt, ", '", name, "' is ", t.scalar_type(),
             "); apply fully_shard to a submodule so each group has one dtype");
    HP_CHECK(t.device() == mine[0].second.device(), "not supported yet: parameters on different devices in one ",
             "fully_shard group (", label, ": '", mine[0].first, "' is on ", mine[0].second.device(), ", '", name,
             "' on ", t.device(), ")");
  }
  if (o.device) {
    st.device = *o.device;  // the parameters are copied there as they are sharded
  } else if (!mine.empty()) {
    st.device = mine[0].second.device();
  }
  HP_CHECK(st.shard->supports_device(st.device) && (!st.replicate || st.replicate->supports_device(st.device)),
           "fully_shard(", label, "): parameter '", mine.empty() ? std::string() : mine[0].first, "' is on ",
           st.device, ", which the ", st.shard->backend(), " backend of communicator '", st.shard->name(),
           "' does not support");
  st.dt = resolve_dtypes(o.mp_policy, pdt);
  if (o.reshard_after_forward_group_size > 0) {
    const int g = o.reshard_after_forward_group_size, ns = st.shard->size();
    HP_CHECK(ns % g == 0, "fully_shard(", label, "): reshard_after_forward_group_size=", g, " does not divide the ",
             ns, " ranks of group '", st.shard->name(), "'");
    if (g == 1) {
      st.opts.reshard_after_forward = false;  // each rank keeps all of it: no resharding
    } else if (!st.aliased()) {
      st.post_group = post_forward_group(st.shard, g);
    }
  }
  return pdt;
}

// Parameter `t` sharded over the group's `n` ranks (this one `k`): its rows copied into this
// rank's padded shard (a deferred parameter made whole on the scratch block first); the
// module's tensor becomes the unsharded parameter.
ParamInfo shard_param(detail::GroupState& st, const std::string& name, at::Tensor& t, at::ScalarType pdt, int n, int k,
                      const FullyShardOptions& o, const std::string& label) {
  ParamInfo p;
  p.name = name;
  p.param = detail::UnshardedParam(t);
  p.shape = t.sizes().vec();
  p.plan = plan_shard(p.shape, n, k);
  p.requires_grad = t.requires_grad();
  std::vector<int64_t> shard_shape = p.shape.empty() ? std::vector<int64_t>{1} : p.shape;
  shard_shape[0] = p.plan.rows_per_shard;
  p.padded = OwnedBuffer::zeros(shard_shape, pdt, st.device);
  at::Tensor full = t.detach();
  if (memory::is_deferred(t.storage().data())) {
    // Built without storage: this parameter's whole value, made on the scratch block that
    // already holds the model's deferred tensors, then only this rank's rows are kept.
    HP_CHECK(o.param_init, "fully_shard(", label, "): parameter '", name, "' was built under a ",
             "DeferredAllocation (no storage); give FullyShardOptions::param_init to initialize it");
    {
      memory::DeferredAllocation on_scratch;
      full = at::empty(p.shape, at::TensorOptions().dtype(pdt));
    }
    o.param_init(t, full);
    HP_CHECK(full.sizes() == t.sizes() && full.scalar_type() == pdt, "fully_shard(", label,
             "): param_init changed the shape or dtype of '", name, "'");
  }
  if (p.plan.rows > 0) {
    at::Tensor src = full.reshape({p.plan.dim0, p.plan.row_numel});
    p.padded.tensor().view({p.plan.rows_per_shard, p.plan.row_numel})
        .narrow(0, 0, p.plan.rows)
        .copy_(src.narrow(0, p.plan.row_offset, p.plan.rows));
  }
  p.sharded = p.padded.tensor().narrow(0, 0, p.plan.rows).detach();
  p.sharded.set_requires_grad(p.requires_grad);
  if (st.dt.main_grad) p.main_grad = OwnedBuffer::zeros(p.sharded.sizes(), at::kFloat, st.device);
  // The module's tensor becomes the unsharded parameter: compute dtype, global shape,
  // no storage until unshard. Its identity (module fields, autograd meta) is kept.
  // With one shard in the parameters' dtype it simply aliases the shard.
  if (st.aliased()) {
    t.set_data(p.padded.tensor().view(p.shape));
  } else {
    // Made with no storage at all (not allocated whole, then freed: a rank never holds
    // the whole parameter here).
    at::Tensor unsharded = at::empty({0}, at::TensorOptions().dtype(st.dt.compute).device(st.device));
    unsharded.storage().set_data_ptr(c10::DataPtr(nullptr, unsharded.device()));  // as a resharded one
    unsharded.unsafeGetTensorImpl()->set_sizes_contiguous(p.shape);
    t.set_data(unsharded);
  }
  if (t.grad().defined()) t.mutable_grad() = at::Tensor();
  return p;
}

// The group's handle registered (its parameters managed, nested handles found) and its
// forward hooks installed on `module`.
void install_handle(const std::shared_ptr<FSDPModule>& handle, torch::nn::Module& module, const FullyShardOptions& o) {
  detail::GroupState* s = &detail::FsdpAccess::state(*handle);
  s->watch_gradients();
  {
    std::lock_guard<std::mutex> g(g_mu);
    for (const auto& p : s->params) g_managed.assign(p.param.tensor().unsafeGetTensorImpl(), handle, true);
    for (const auto& sub : module.modules(/*include_self=*/false)) {
      if (auto* e = g_handles.find(sub.get())) {
        if (auto h = e->owner.lock()) s->nested.push_back(&detail::FsdpAccess::state(*h));
      }
    }
    g_handles.assign(&module, handle, true);
  }
  if (o.wait_per_submodule) watch_submodules(handle);
  ForwardHooks hooks;
  hooks.pre = [handle](torch::nn::Module&) { detail::FsdpAccess::state(*handle).pre_forward(); };
  if (s->dt.input) {
    at::ScalarType in_dt = *s->dt.input;
    hooks.cast_input = [in_dt](torch::nn::Module&, const at::Tensor& x, size_t) {
      return x.is_floating_point() && x.scalar_type() != in_dt ? x.to(in_dt) : x;
    };
  }
  hooks.cast_output = [handle](torch::nn::Module&, const at::Tensor& out) {
    return detail::FsdpAccess::state(*handle).on_output(out, handle);
  };
  hooks.post = [handle](torch::nn::Module&) { detail::FsdpAccess::state(*handle).post_forward(); };
  hooks.on_error = [handle](torch::nn::Module&, const std::exception&) {
    detail::FsdpAccess::state(*handle).on_forward_error();
  };
  register_forward_hooks(module, std::move(hooks));
}

}  // namespace

FSDPHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& o) {
  const std::string label = describe(module);
  purge_expired_forward_hooks();  // releases the handles of destroyed modules
  static std::once_flag translator_once;
  std::call_once(translator_once, [] { register_error_translator(translate_unallocated); });
  {
    std::lock_guard<std::mutex> g(g_mu);
    // A handle outliving its module (the address reused by a new module) does not count.
    bool applied = false;
    if (auto* e = g_handles.find(&module)) {
      if (auto h = e->owner.lock()) applied = !h->state().owner_gone();
    }
    HP_CHECK(!applied, "fully_shard was already applied to module ", label, "; apply it once per module");
  }
  check_options(o, label);
  auto st = std::make_unique<detail::GroupState>();
  st->module = &module;
  try {
    st->owner = module.shared_from_this();
    st->owned = true;
  } catch (const std::bad_weak_ptr&) {
    // Not held by a shared_ptr: no liveness check.
  }
  st->label = label;
  st->opts = o;
  const CommPtr world = place_groups(*st, o, label);
  std::vector<std::pair<std::string, at::Tensor>> mine = managed_params(module, o);
  const at::ScalarType pdt = settle_group(*st, module, world, mine, o, label);
  const int n = st->shard->size(), k = st->shard->rank();
  at::NoGradGuard no_grad;
  HP_CHECK(!memory::deferring(), "fully_shard(", label, ") inside a DeferredAllocation scope: end the scope ",
           "(the model is built) before sharding, so the shards get real memory");
  for (const auto& t : o.ignored_params) {
    HP_CHECK(!memory::is_deferred(t.storage().data()), "fully_shard(", label, "): an ignored parameter ",
             t.sizes(), " was built under a DeferredAllocation; ignored parameters are not materialized");
  }
  for (auto& [name, t] : mine) st->params.push_back(shard_param(*st, name, t, pdt, n, k, o, label));
  if (st->post_group) {
    for (const auto& p : st->params) {
      st->post_offsets.push_back(st->post_total);
      st->post_total += p.plan.padded_numel() / st->post_group->size();
    }
  }
  std::vector<ShardPlan> plans;
  for (const auto& p : st->params) plans.push_back(p.plan);
  st->layout = plan_fused(plans, std::max<int64_t>(1, kFusedAlignBytes / static_cast<int64_t>(c10::elementSize(st->dt.reduce))));
  // The all-gather buffer uses the same layout in its own dtype; offsets are in elements.
  auto handle = std::shared_ptr<FSDPModule>(new FSDPModule(std::move(st)));
  install_handle(handle, module, o);
  return handle;
}

void materialize_deferred_buffers(torch::nn::Module& module, c10::optional<c10::Device> device) {
  HP_CHECK(!memory::deferring(), "materialize_deferred_buffers inside a DeferredAllocation scope");
  at::NoGradGuard no_grad;
  for (auto& b : module.buffers(/*recurse=*/true)) {
    if (!b.defined()) continue;
    const c10::Device to = device ? *device : b.device();
    if (memory::is_deferred(b.storage().data())) {
      b.set_data(at::zeros(b.sizes(), b.options().device(to)));
    } else if (b.device() != to) {
      b.set_data(b.to(to));
    }
  }
}

FSDPHandle fsdp_handle(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> g(g_mu);
  auto* e = g_handles.find(&module);
  if (e == nullptr) return nullptr;
  // A handle outliving its module (the address reused by a new module) is not this one's.
  auto h = e->owner.lock();
  return h && !detail::FsdpAccess::state(*h).owner_gone() ? h : nullptr;
}

}  // namespace hp
