// Muon's Newton-Schulz iteration: the coefficient schedules, the iteration itself and the
// update's scale (hp/optim/muon.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "hp/core/error.h"
#include "hp/optim/muon.h"

namespace hp::optim {

std::vector<NsStep> ns_steps(NsSchedule schedule, int64_t steps) {
  const NsStep quintic{3.4445, -4.7750, 2.0315};
  switch (schedule) {
    case NsSchedule::kQuintic:
      HP_CHECK(steps >= 0, "Newton-Schulz steps=", steps, " is negative");
      return std::vector<NsStep>(static_cast<size_t>(steps == 0 ? 5 : steps), quintic);
    case NsSchedule::kPerStep: {
      HP_CHECK(steps == 0 || steps == 5, "Newton-Schulz steps=", steps,
               ": the per_step schedule has its own 5 steps (0 takes them)");
      return {{4.0848, -6.8946, 2.9270},
              {3.9505, -6.3029, 2.6377},
              {3.7418, -5.5913, 2.3037},
              {2.8769, -3.1427, 1.2046},
              {2.8366, -3.0525, 1.2012}};
    }
    case NsSchedule::kDeepSeekV4: {
      HP_CHECK(steps == 0 || steps == 10, "Newton-Schulz steps=", steps,
               ": the deepseek_v4 schedule has its own 10 steps, 8 + 2 (0 takes them)");
      std::vector<NsStep> out(8, quintic);
      out.insert(out.end(), 2, NsStep{2.0, -1.5, 0.5});
      return out;
    }
  }
  HP_INTERNAL_ASSERT(false, "unknown NsSchedule");
}

at::Tensor newton_schulz(const at::Tensor& d, const std::vector<NsStep>& steps, at::ScalarType dtype, double eps) {
  HP_CHECK(d.dim() >= 2, "newton_schulz: a matrix (or a batch of them) is needed, got shape ", d.sizes());
  at::Tensor x = d.to(dtype);
  const bool tall = x.size(-2) > x.size(-1);
  if (tall) x = x.transpose(-2, -1);
  // The Frobenius norm in at least fp32, whatever dtype the iteration runs in.
  const at::ScalarType norm_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor norm = x.to(norm_dtype).pow(2).sum({-2, -1}, /*keepdim=*/true).sqrt();
  x = (x.to(norm_dtype) / (norm + eps)).to(dtype);
  for (const NsStep& s : steps) {
    const at::Tensor a = at::matmul(x, x.transpose(-2, -1));
    const at::Tensor b = at::matmul(s.b * a + s.c * at::matmul(a, a), x);
    x = s.a * x + b;
  }
  return tall ? x.transpose(-2, -1) : x;
}

double muon_scale(MuonScale scale, int64_t rows, int64_t cols, double rms_target) {
  HP_CHECK(rows > 0 && cols > 0, "muon_scale: a ", rows, " x ", cols, " matrix");
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  switch (scale) {
    case MuonScale::kRms:
      return rms_target * std::sqrt(std::max(a, b));
    case MuonScale::kOriginal:
      return std::sqrt(std::max(1.0, a / b));
  }
  HP_INTERNAL_ASSERT(false, "unknown MuonScale");
}

}  // namespace hp::optim
