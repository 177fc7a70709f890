#include "hp/fsdp/mixed_precision.h"

#include "hp/core/error.h"

namespace hp {
namespace {

void check_floating(at::ScalarType t, const char* field) {
  bool ok = t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
  HP_CHECK(ok, "MixedPrecisionPolicy: ", field, " is ", t,
           "; it must be a floating dtype (float32, float64, bfloat16, float16)");
}

}  // namespace

GroupDtypes resolve_dtypes(const MixedPrecisionPolicy& p, at::ScalarType param_dtype) {
  check_floating(param_dtype, "the parameters' dtype");
  if (p.param_dtype) check_floating(*p.param_dtype, "param_dtype");
  if (p.reduce_dtype) check_floating(*p.reduce_dtype, "reduce_dtype");
  if (p.output_dtype) check_floating(*p.output_dtype, "output_dtype");
  GroupDtypes d;
  d.param = param_dtype;
  d.compute = p.param_dtype.value_or(param_dtype);
  d.all_gather = d.compute;  // shards are cast before the all-gather
  d.grad = d.compute;        // autograd's gradient matches the unsharded parameter
  d.reduce = p.reduce_dtype.value_or(d.grad);
  d.unsharded_accumulate = d.reduce;  // never below the reduction's precision
  d.main_grad = p.apply_grad_on_fp32_main_grad;
  d.sharded_grad = d.main_grad ? at::kFloat : param_dtype;
  d.sharded_accumulate = d.main_grad ? at::kFloat : d.reduce;
  d.output = p.output_dtype;
  if (p.cast_forward_inputs && p.param_dtype) d.input = p.param_dtype;
  return d;
}

std::string GroupDtypes::to_string() const {
  auto opt = [](const c10::optional<at::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("none");
  };
  return detail::str_cat("param=", param, " compute=", compute, " all_gather=", all_gather,
                         " grad=", grad, " reduce=", reduce, " unsharded_acc=", unsharded_accumulate,
                         " sharded_acc=", sharded_accumulate, " sharded_grad=", sharded_grad,
                         " main_grad=", main_grad, " output=", opt(output), " input=", opt(input));
}

}  // namespace hp
