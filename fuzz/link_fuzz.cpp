// Fuzzes the simulated network's spec (hp::SimulatedNetwork::parse: hp-train's --link and
// the HP_SIM_NET knob): a spec it accepts must print, name a model for every op it holds
// and give each a finite, non-negative time.
#include <cmath>

#include "fuzz_util.h"
#include "hp/comm/simulated_network.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 256) return -1;  // a spec is "5:100,10:12.5:4"
  const std::string spec(reinterpret_cast<const char*>(data), size);
  hp::fuzz::expect_clean(
      [&] {
        const hp::SimulatedNetwork n = hp::SimulatedNetwork::parse(spec);
        (void)n.to_string();
        (void)n.spans_nodes({0, 1, 7, 1 << 20});
        for (const hp::LinkModel& l : {n.intra, n.inter}) {
          for (hp::CommOp op : {hp::CommOp::kAllReduce, hp::CommOp::kAllGather, hp::CommOp::kSend, hp::CommOp::kBarrier}) {
            const double t = hp::SimulatedNetwork::seconds(op, int64_t(1) << 40, 1 << 20, l);
            if (!std::isfinite(t) || t < 0) hp::fuzz::finding("spec '" + spec + "' models a time of " + std::to_string(t));
          }
        }
      },
      "simulated network");
  return 0;
}
