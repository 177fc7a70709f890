// Fuzzes hp-train's YAML config reader (hp::train::parse_config, what load_config runs on a
// file's text), then the checks a run makes next: validate() at a few world sizes and the
// one-line-per-setting description. A config it accepts must also survive the round trip
// its settings promise: resolved_settings() gives text that parses back to the same
// settings (the ranks of a run and a resumed checkpoint compare them).
#include "fuzz_util.h"
#include "hp/train/config.h"

namespace {

void round_trip(const hp::train::TrainConfig& c) {
  const auto settings = hp::train::resolved_settings(c);
  std::vector<std::string> overrides;
  for (const auto& [k, v] : settings) {
    // model.from_hf was read already: its sizes are the model.* entries.
    if (k != "model.from_hf") overrides.push_back(k + "=" + v);
  }
  hp::train::TrainConfig again;
  try {
    again = hp::train::parse_config("", overrides, "fuzz.yaml (settings)");
  } catch (const hp::Error& e) {
    hp::fuzz::finding(std::string("resolved_settings() did not parse back: ") + e.what());
  }
  if (hp::train::resolved_settings(again) != settings) hp::fuzz::finding("resolved_settings() parsed back to others");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return -1;  // configs are a few hundred bytes; 1 MiB reaches deep nesting
  const std::string text(reinterpret_cast<const char*>(data), size);
  hp::fuzz::expect_clean([&] {
    const hp::train::TrainConfig parsed = hp::train::parse_config(text, {}, "fuzz.yaml");
    round_trip(parsed);
    for (int world : {1, 2, 8}) {
      hp::train::TrainConfig c = parsed;
      hp::fuzz::expect_clean([&] {
        c.validate(world);
        (void)hp::train::describe(c);
        (void)c.micro_batch_size();
      });
    }
  });
  return 0;
}
