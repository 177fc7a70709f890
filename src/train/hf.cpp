// Hugging Face interchange of the Trainer's model: weights in from a model folder, a
// checkpoint's model out to one.
#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <set>

#include "hp/ckpt/checkpoint.h"
#include "hp/ckpt/consolidated.h"
#include "hp/ckpt/float8.h"
#include "hp/ckpt/safetensors.h"
#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/core/untrusted.h"
#include "hp/models/family.h"
#include "trainer_impl.h"

namespace hp::train {

namespace internal {

// The Hugging Face name of each parameter of the config's model, after checking the
// folder's config.json against it.
std::map<std::string, std::string> hf_sources(const TrainConfig& c, const std::string& dir) {
  HP_CHECK(c.model->supports_hf(), "init_from_hf: model.type=", c.model.family().name(),
           " is not supported yet (the family has no Hugging Face names)");
  const std::string path = dir + "/config.json";
  std::string text;
  try {
    text = hp::files::read_regular(path, "config.json");
  } catch (const Error& e) {
    throw Error(detail::str_cat("init_from_hf: '", dir, "' has no config.json (not a Hugging Face model folder): ",
                                e.what()));
  }
  c.model->check_hf_config(text, path);
  const bool float8 = ckpt::hf_float8_blocks(text, path).has_value();  // FP8 weights with block scales
  const auto names = c.model->hf_names();
  std::map<std::string, std::string> sources(names.begin(), names.end());
  std::set<std::string> read;
  for (const auto& [ours, theirs] : names) read.insert(theirs);
  const std::map<std::string, std::string> held = ckpt::consolidated_tensors(dir);  // each shard's header read
  // Weights are floating point, or FP8 bytes with their block scales where config.json says
  // so (then the scales are read too): an integer or boolean one is quantized in another way
  // or not a weight, and a cast would train from garbage.
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : held) {
    if (read.count(name)) by_file[file].insert(name);
  }
  std::set<std::string> scales;
  for (const auto& [file, names] : by_file) {
    for (const ckpt::TensorEntry& e : ckpt::read_header(dir + "/" + file).tensors) {
      if (!names.count(e.name)) continue;
      if (e.e4m3fn && float8) {
        scales.insert(ckpt::float8_scale_name(e.name));
        continue;
      }
      HP_CHECK(at::isFloatingType(e.dtype), "init_from_hf: '", dir, "': the tensor '", e.name, "' (in ", file, ") is ",
               e.dtype_name(), e.e4m3fn ? ", but config.json has no quantization_config to say how it is scaled"
                                        : ": integer and boolean weights are not supported yet (a quantized checkpoint? "
                                          "convert it to bf16 or fp32 first)");
    }
  }
  read.insert(scales.begin(), scales.end());
  // Every tensor of the folder is read, or one transformers passes over too: a tensor left
  // over (a bias, a block or a head config.json does not speak of) would be dropped silently.
  size_t unused = 0;
  std::vector<std::string> first;
  bool mtp = false;  // the first one left over is a multi-token prediction module's
  for (const auto& [name, file] : held) {
    if (read.count(name) || c.model->hf_ignores(name)) continue;
    const bool unbuilt_mtp = c.model->hf_unbuilt_mtp(name);
    if (unbuilt_mtp && c.init_from_hf_drop_mtp) continue;
    if (unused == 0) mtp = unbuilt_mtp;
    if (unused++ < 3) first.push_back("'" + name + "' (in " + file + ")");
  }
  std::string listed;
  for (const std::string& f : first) listed += (listed.empty() ? "" : ", ") + f;
  HP_CHECK(unused == 0, "init_from_hf: '", dir, "' holds ", unused, " tensor", unused == 1 ? "" : "s",
           " the model has no place for, the first ", listed,
           mtp ? ": a multi-token prediction module the model does not have (set model.mtp_layers to its "
                 "num_nextn_predict_layers to train it, or init_from_hf_drop_mtp: true to leave it)"
               : ": the weights hold more than config.json says (a tensor of a kind not supported yet, or a "
                 "config.json of another model)",
           "; nothing was loaded");
  return sources;
}

const std::string& hf_source(const std::map<std::string, std::string>& sources, const std::string& name) {
  auto it = sources.find(name);
  HP_INTERNAL_ASSERT(it != sources.end(), "no Hugging Face name for the parameter ", name);
  return it->second;
}

void add_hf_buffers(torch::nn::Module& root, const std::map<std::string, std::string>& sources,
                    std::vector<ckpt::Item>& items) {
  for (const auto& b : root.named_buffers()) {
    auto it = sources.find(b.key());
    if (it != sources.end()) items.push_back({b.key(), b.value(), make_shard_spec(b.value().sizes().vec(), {}), it->second});
  }
}

}  // namespace internal

using internal::add_hf_buffers;
using internal::hf_source;
using internal::hf_sources;


void Trainer::load_hf(const std::string& dir) {
  Impl& s = *impl_;
  std::string error;
  try {
    const auto sources = hf_sources(s.c, dir);
    std::vector<ckpt::Item> items;
    size_t j = 0;
    for (size_t i = 0; i < s.sharded.params.size(); ++i) {
      const std::string& hf = hf_source(sources, s.sharded.params[i].name);
      items.push_back({s.sharded.params[i].name, s.sharded.params[i].param.detach(), s.sharded.params[i].box, hf});
      if (s.master && s.sharded.params[i].param.requires_grad()) {
        items.push_back({s.sharded.params[i].name + ".master", s.master->masters()[j++].detach(), s.sharded.params[i].box, hf});
      }
    }
    for (torch::nn::Module* root : s.sharded.roots) add_hf_buffers(*root, sources, items);
    at::NoGradGuard ng;
    internal::HostStaging staged(items);
    ckpt::load_consolidated(items, dir);
    staged.put_back();
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Each rank reads other bytes: a failure on one raises on all.
  raise_if_any_failed(s.world, error, "loading '" + dir + "'");
}

void export_hf(const std::string& ckpt_dir, const std::string& out_dir, const CommPtr& world,
               ckpt::ExportOptions o, bool without_mtp) {
  const auto values = ckpt::load({}, ckpt_dir);
  std::vector<std::pair<std::string, std::string>> settings;
  for (const auto& [k, v] : values) {
    if (k.rfind("config.model.", 0) == 0) settings.emplace_back(k.substr(7), v);
  }
  HP_CHECK(!settings.empty(), "export of '", ckpt_dir, "': the checkpoint has no config.model.* settings (not saved by ",
           "hp-train)");
  ModelSpec model = model_from_settings(settings, "export of '" + ckpt_dir + "'");
  if (without_mtp && model->mtp_layers() > 0) model->set_mtp_layers(0);
  HP_CHECK(model->supports_hf(), "export of '", ckpt_dir, "': model.type=", model.family().name(),
           " is not supported yet (the family has no Hugging Face names)");
  model->validate();
  const auto saved = ckpt::saved_tensors(ckpt_dir);
  std::vector<std::pair<std::string, std::string>> tensors;
  for (const auto& [ours, theirs] : model->hf_names()) {
    auto it = saved.find(ours);
    HP_CHECK(it != saved.end(), "export of '", ckpt_dir, "': the checkpoint lacks the parameter '", ours, "'");
    // Parameters are written in their dtype unless asked otherwise (fp32 masters are the
    // source where kept, so a bf16 run's export rounds once, from the masters). What the
    // optimizer does not step (no moments saved: a buffer such as the balancing bias) keeps
    // its own dtype.
    if (!saved.count(ours + ".exp_avg")) {
      o.keep_dtype.insert(ours);
    } else if (!o.dtype) {
      o.dtype = ckpt::dtype_from_string(it->second.dtype);
    }
    tensors.emplace_back(saved.count(ours + ".master") ? ours + ".master" : ours, theirs);
    // --dtype fp8: the projections, as the published FP8 checkpoints hold them (attention's
    // and the MLPs' and experts' *_proj.weight); embeddings, head, norms, router and biases
    // stay in the export's dtype.
    const std::string suffix = "proj.weight";
    if (o.float8 && theirs.size() > suffix.size() &&
        theirs.compare(theirs.size() - suffix.size(), suffix.size(), suffix) == 0 && it->second.shape.size() == 2) {
      o.float8_names.insert(tensors.back().first);
    }
  }
  std::string config = model->hf_config(*o.dtype);
  if (o.float8) {  // says how the weights are stored (hp/ckpt/float8.h)
    nlohmann::json j = nlohmann::json::parse(config);
    j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                                {"weight_block_size", {128, 128}}};
    config = j.dump(2) + "\n";
  }
  ckpt::export_consolidated(ckpt_dir, tensors, out_dir, world, o, {{"config.json", config}});
}


}  // namespace hp::train
