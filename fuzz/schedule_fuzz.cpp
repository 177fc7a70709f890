// Fuzzes the pipeline schedule's text form (hp::pp::Schedule::parse), then what a parsed
// schedule goes through: validate(), simulate() and lower(). The input's first two bytes
// choose the stage count (1 to 8) and the micro-batch count (1 to 16); the rest is the text.
// A schedule that parses must print back to text that parses to the same schedule (the
// header's promise), and one that validates must simulate and lower.
#include "fuzz_util.h"
#include "hp/pp/schedule.h"

namespace {

bool same(const hp::pp::Schedule& a, const hp::pp::Schedule& b) {
  return a.ranks == b.ranks && a.stages == b.stages && a.microbatches == b.microbatches && a.actions == b.actions &&
         a.placement == b.placement;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2 || size > (8 << 10)) return -1;  // 8 stages x 16 micro-batches fit in a few KB
  const int stages = data[0] % 8 + 1, microbatches = data[1] % 16 + 1;
  const std::string text(reinterpret_cast<const char*>(data) + 2, size - 2);
  hp::fuzz::expect_clean(
      [&] {
        const hp::pp::Schedule s = hp::pp::Schedule::parse(text, stages, microbatches);
        const std::string printed = s.to_string();
        hp::pp::Schedule again;
        try {
          again = hp::pp::Schedule::parse(printed, stages, microbatches);
        } catch (const hp::Error& e) {
          hp::fuzz::finding("a parsed schedule's text does not parse back: " + std::string(e.what()));
        }
        if (!same(s, again)) hp::fuzz::finding("a parsed schedule's text parses back to another schedule");
        hp::pp::validate(s);
        // A valid schedule completes: simulate and lower must not raise.
        try {
          (void)hp::pp::simulate(s);
          const hp::pp::Schedule lowered = hp::pp::lower(s);
          hp::pp::validate(lowered);
          (void)hp::pp::simulate(lowered);
        } catch (const hp::Error& e) {
          hp::fuzz::finding("a schedule that validates failed later: " + std::string(e.what()));
        }
      },
      "pipeline schedule");
  return 0;
}
