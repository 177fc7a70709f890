// One case of the fault matrix (fault_matrix.sh runs them all, one mpirun each): every
// rank trains configs/llama_tiny.yaml under a layout, on a job communicator of a short
// timeout, with a fault injected into the communication seam (fault_injection.h), and
// writes what it saw to OUT/rank<R>.json: whether the run ended with an error, the error's
// type and message, and when. The script checks every rank ended with an error naming
// rank, op, group and seq, within the timeout plus a margin of the fault.
//
// Usage: fault_matrix --config llama_tiny.yaml --layout fsdp|hsdp|tp|pp|ckpt --fault SPEC
//                     --out DIR [--timeout-ms MS]
// SPEC: fault_injection.h's text form ("none": no fault, the run must complete).
//
// A process whose op timed out keeps a worker blocked in MPI, so MPI cannot be finalized:
// each rank leaves with _Exit once every rank's record is written (hp-train leaves at once
// after an error, and mpirun stops the others).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/fault_injection.h"
#include "hp/core/error.h"
#include "hp/runtime.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/train/config.h"
#include "hp/train/trainer.h"

namespace {

namespace fs = std::filesystem;
namespace ht = hp::train;
using json = nlohmann::json;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The layouts, at the rank counts fault_matrix.sh runs them with.
std::vector<std::string> overrides_of(const std::string& layout, const std::string& out) {
  std::vector<std::string> o = {"train_steps=3", "lr_warmup_steps=1", "output_dir=", "global_batch_size=8", "seq_length=32"};
  if (layout == "fsdp") {
    o.push_back("data_parallel_shard=-1");
  } else if (layout == "hsdp") {  // 4 ranks: 2 replicas x 2 shards
    o.push_back("data_parallel=2");
  } else if (layout == "tp") {
    o.insert(o.end(), {"tensor_parallel=2", "sequence_parallel=true"});
  } else if (layout == "pp") {
    o.insert(o.end(), {"pipeline_parallel=2", "micro_batch_num=2"});
  } else if (layout == "ckpt") {  // FSDP, a save after every step
    o.insert(o.end(), {"save_dir=" + out + "/checkpoints", "save_interval=1"});
  } else {
    HP_CHECK(false, "fault_matrix: unknown layout '", layout, "' (fsdp, hsdp, tp, pp, ckpt)");
  }
  return o;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  HP_CHECK(f.good(), "fault_matrix: cannot read ", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_json(const std::string& path, const json& j) {
  std::ofstream(path + ".tmp") << j.dump() << "\n";
  fs::rename(path + ".tmp", path);
}

}  // namespace

int main(int argc, char** argv) {
  std::string config, layout, fault_text, out;
  int timeout_ms = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") config = v;
    else if (k == "--layout") layout = v;
    else if (k == "--fault") fault_text = v;
    else if (k == "--out") out = v;
    else if (k == "--timeout-ms") timeout_ms = std::atoi(v.c_str());
    else {
      std::cerr << "fault_matrix: unknown argument " << k << "\n";
      return 2;
    }
  }
  if (config.empty() || layout.empty() || fault_text.empty() || out.empty()) {
    std::cerr << "usage: fault_matrix --config C --layout L --fault SPEC --out DIR [--timeout-ms MS]\n";
    return 2;
  }
  hp::CommPtr world = hp::init();
  const int rank = world->rank();
  json rec = {{"rank", rank}, {"layout", layout}, {"fault", fault_text}, {"timeout_ms", timeout_ms}};
  std::unique_ptr<hp::test::FaultInjection> inject;
  if (fault_text != "none") {
    inject = std::make_unique<hp::test::FaultInjection>(
        hp::test::Fault::parse(fault_text), [out, rank](const hp::test::FaultFired& f) {
          write_json(out + "/fired.json", {{"rank", rank},
                                           {"group", f.group},
                                           {"op", hp::to_string(f.op)},
                                           {"seq", f.seq},
                                           {"at_ms", now_ms()}});
        });
  }
  ht::TrainConfig c;
  try {
    c = ht::parse_config(read_file(config), overrides_of(layout, out), config);
    c.validate(world->size());
  } catch (const std::exception& e) {
    std::cerr << "fault_matrix: " << e.what() << "\n";
    std::fflush(nullptr);
    std::_Exit(2);
  }
  // Every communicator of the run descends from this one, made after the injection.
  world->barrier().wait();
  hp::CommPtr job = world->split(0, rank, {std::chrono::milliseconds(timeout_ms), "job"});
  rec["start_ms"] = now_ms();
  // Outside the try: the error is timed where it reaches the caller, before the trainer's
  // communicators are destroyed.
  std::unique_ptr<ht::Trainer> trainer;
  std::unique_ptr<ht::CheckpointManager> checkpoints;
  try {
    trainer = std::make_unique<ht::Trainer>(c, job);
    if (layout == "ckpt") {
      checkpoints = std::make_unique<ht::CheckpointManager>(ht::CheckpointManager::options_of(c), job);
    }
    trainer->train(checkpoints.get());
    rec["outcome"] = "completed";
  } catch (const hp::TimeoutError& e) {
    rec["outcome"] = "error", rec["type"] = "TimeoutError", rec["what"] = e.what();
  } catch (const hp::CommError& e) {
    rec["outcome"] = "error", rec["type"] = "CommError", rec["what"] = e.what();
  } catch (const hp::Error& e) {
    rec["outcome"] = "error", rec["type"] = "Error", rec["what"] = e.what();
  } catch (const std::exception& e) {
    rec["outcome"] = "error", rec["type"] = "other", rec["what"] = e.what();
  }
  rec["end_ms"] = now_ms();
  // Not destroyed after a fault: each communicator stuck in an op would wait 2 s for it in
  // its destructor (as hp-train's unwinding does; docs/reliability.md), and the process
  // leaves with _Exit.
  if (fault_text != "none") {
    (void)checkpoints.release();
    (void)trainer.release();
  }
  if (layout == "ckpt" && rank == 0) {
    // What a resume would start from: must be a committed checkpoint.
    try {
      rec["resume_from"] = ht::CheckpointManager::resolve(c.save_dir);
    } catch (const std::exception& e) {
      rec["resume_error"] = e.what();
    }
  }
  write_json(out + "/rank" + std::to_string(rank) + ".json", rec);
  std::fflush(nullptr);
  // Faultless: a clean end. Otherwise workers may be stuck in MPI calls (see above).
  if (fault_text == "none") {
    checkpoints.reset();
    trainer.reset();
    job.reset();
    world.reset();
    hp::finalize();
    return 0;
  }
  // A rank that leaves makes mpirun stop the others: wait (on files, not MPI) until every
  // rank has its own record, so that each is seen raising by itself.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int r = 0; r < world->size() && std::chrono::steady_clock::now() < until; ++r) {
    while (!fs::exists(out + "/rank" + std::to_string(r) + ".json") && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::_Exit(0);
}
