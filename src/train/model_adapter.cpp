// The config's model (through its family), its pipeline stages and schedule.
#include <ATen/ATen.h>

#include "hp/core/memory.h"
#include "hp/models/family.h"
#include "trainer_impl.h"

namespace hp::train {

namespace {

void cast_params(torch::nn::Module& m, at::ScalarType dtype) {
  // Parameters only: buffers such as the MoE balancing bias and load stay fp32.
  torch::NoGradGuard ng;
  for (auto& p : m.parameters()) {
    if (p.scalar_type() != dtype) p.set_data(p.to(dtype));
  }
}

}  // namespace

std::unique_ptr<TrainModel> make_model(const TrainConfig& c, bool deferred, const models::PipelineSlice& slice) {
  std::unique_ptr<memory::DeferredAllocation> scope;
  if (deferred) scope = std::make_unique<memory::DeferredAllocation>();
  std::unique_ptr<TrainModel> out = c.model->build(slice, recompute_policy(c.recompute));
  // Each micro-batch's loss is divided by their number before backward (the trainers'
  // and the pipeline's rule).
  out->set_loss_scale(1.0 / static_cast<double>(c.micro_batch_num));
  if (!deferred) out->init_weights(c.seed);
  cast_params(out->root(), c.params_dtype);
  return out;
}

std::vector<int64_t> stage_params(const TrainConfig& c) {
  const int stages = static_cast<int>(c.pipeline_parallel * c.pipeline_parallel_interleave_num);
  std::vector<int64_t> out;
  for (const auto& slice : models::split_layers(c.model->layers(), stages, c.pipeline_stage_layers)) {
    out.push_back(c.model->stage_params(slice));
  }
  return out;
}

pp::Schedule pipeline_schedule(const TrainConfig& c) {
  const int pp = static_cast<int>(c.pipeline_parallel), v = static_cast<int>(c.pipeline_parallel_interleave_num);
  const int m = static_cast<int>(c.micro_batch_num);
  switch (c.pipeline_schedule) {
    case PipelineScheduleKind::kGPipe:
      return pp::gpipe(pp, m);
    case PipelineScheduleKind::k1F1B:
      return pp::one_f_one_b(pp, m);
    case PipelineScheduleKind::kZBH1:
      return pp::zero_bubble_h1(pp, m);
    case PipelineScheduleKind::kZBV:
      return pp::zero_bubble_v(pp, m);
    case PipelineScheduleKind::kDualPipeV:
      return pp::dualpipev(pp, m);
    case PipelineScheduleKind::kInterleaved:
      return pp::interleaved_1f1b(pp, v, m);
    case PipelineScheduleKind::kAuto:
      break;
  }
  throw Error("pipeline_schedule: the config is not validated (auto is not resolved)");
}


}  // namespace hp::train
