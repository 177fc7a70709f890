// The killed run of tests/ckpt/kill_test.sh: hp-train's training (the same config, data and
// checkpoint manager, without its printing), saving through a FaultyStorage that kills the
// process with SIGKILL at one point of one save.
// Usage: kill_train <point> <rank|all> <save> <hp-train's arguments...>
//   point: write, written, commit, swap or latest (hp::ckpt::SavePoint);
//   rank:  the rank that kills itself, or "all";
//   save:  which save of the run (1-based).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/faulty_storage.h"
#include "hp/runtime.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/train/cli.h"
#include "hp/train/run.h"
#include "hp/train/trainer.h"

namespace {

std::optional<hp::ckpt::SavePoint> point_named(const std::string& s) {
  for (auto p : {hp::ckpt::SavePoint::kWrite, hp::ckpt::SavePoint::kWritten, hp::ckpt::SavePoint::kCommit,
                 hp::ckpt::SavePoint::kSwap, hp::ckpt::SavePoint::kLatest}) {
    if (s == hp::ckpt::to_string(p)) return p;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: kill_train <point> <rank|all> <save> <hp-train arguments...>\n");
    return 2;
  }
  hp::test::StorageFault fault;
  fault.kill_at = point_named(argv[1]);
  fault.kill_rank = std::strcmp(argv[2], "all") == 0 ? -1 : std::atoi(argv[2]);
  fault.kill_save = std::atoi(argv[3]);
  if (!fault.kill_at || fault.kill_save < 1) {
    std::fprintf(stderr, "kill_train: bad point '%s' or save '%s'\n", argv[1], argv[3]);
    return 2;
  }
  // hp-train's arguments, after the program's name.
  std::vector<char*> rest = {argv[0]};
  for (int i = 4; i < argc; ++i) rest.push_back(argv[i]);
  try {
    const hp::train::Args args = hp::train::parse_args(static_cast<int>(rest.size()), rest.data());
    hp::CommPtr world = hp::init(hp::train::init_options(args));
    hp::train::RunInputs in = hp::train::prepare_run(args, world->size(), world->rank());
    in.folders = hp::train::claim_folders(args, in.config, world->rank());
    hp::train::Trainer trainer(in.config, world, in.data, in.valid);
    auto o = hp::train::CheckpointManager::options_of(in.config);
    o.storage = std::make_shared<hp::test::FaultyStorage>(o.storage, fault);
    hp::train::CheckpointManager checkpoints(o, world);
    trainer.train(&checkpoints);
    hp::finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kill_train: %s\n", e.what());
    std::fflush(nullptr);
    std::_Exit(1);
  }
  std::fprintf(stderr, "kill_train: the run ended without being killed\n");
  return 3;
}
