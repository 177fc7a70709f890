// Where and when hp-train's checkpoints are written, and which one a run resumes from.
//
// A run's checkpoints are folders save_dir/step_<k> (k zero-padded to 8 digits, so names
// sort by step), each committed by ckpt::save's one rename; save_dir/latest names the newest
// committed one and moves only after it committed (written to latest.tmp, fsynced, renamed).
// keep_last_n > 0 removes all but the newest n committed ones after each commit (never the
// one `latest` names). With async the state is copied and written in the background by the
// manager's own thread over its own communicator (split from the world at the first such
// save, so its collectives never interleave with training's), and `latest` moves when that
// save committed.
//
// It saves any ckpt::Checkpointable (the Trainer is one), through the options' ckpt::Storage
// (the local file system unless a test gives another).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <exception>
#include <memory>
#include <thread>

#include "hp/ckpt/checkpoint.h"
#include "hp/ckpt/storage.h"
#include "hp/comm/communicator.h"
#include "hp/train/config.h"

namespace hp::train {

class CheckpointManager {
 public:
  struct Options {
    std::string dir;          // save_dir
    int64_t interval = 0;     // save every this many steps and after the last; 0 = never
    int64_t keep_last_n = 0;  // 0 = keep all
    bool async = false;
    std::shared_ptr<ckpt::Storage> storage = ckpt::local_storage();
  };
  // The options a validated config asks for (save_dir, save_interval, keep_last_n, async_save).
  static Options options_of(const TrainConfig& c);

  CheckpointManager(Options o, CommPtr world);
  // Waits for a background save (its error, if any, is lost: wait() is where it is raised).
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Whether to save after step `step` (1-based) of a run of `last_step` steps.
  bool due(int64_t step, int64_t last_step) const;
  // Saves `state` to dir/step_<steps done> (collective over the world), then moves `latest`
  // and prunes (rank 0); with async, returns once the state is copied (training may change
  // it at once). A background save still running is waited for first. Returns the folder.
  std::string save(const ckpt::Checkpointable& state);
  // The same, in the background or not whatever the options say (a save before a stop is
  // synchronous).
  std::string save(const ckpt::Checkpointable& state, bool background);
  // Waits for a background save; raises on every rank when it failed on any. Collective.
  void wait();
  // Loads `state` from the checkpoint resolve(from) names; returns that folder.
  static std::string load(ckpt::Checkpointable& state, const std::string& from);
  // The checkpoint a resume starts from: `dir` itself when it is a committed checkpoint,
  // else the one dir/latest names. Raises naming the folder when there is none, or when
  // `latest` is unreadable or not a regular file of its own (latest_of), names something
  // outside `dir` (anything but a step_<digits> child: no path, no "..", no symbolic link),
  // or names an uncommitted folder.
  static std::string resolve(const std::string& dir);
  // What dir/latest names, as written: its first line. Raises naming the file when it is
  // missing or empty, a symbolic link (not followed, wherever it points), not a regular file
  // (a FIFO would block the reader), or longer than kMaxLatest bytes without a line end.
  // resolve() then checks the name.
  static std::string latest_of(const std::string& dir);
  static constexpr int64_t kMaxLatest = 256;
  // The folder name of the checkpoint after `steps` steps ("step_00000042").
  static std::string name_of(int64_t steps);
  // What this manager (and ckpt::save under it) writes in `dir`, sorted: step_<k> folders,
  // committed or not (with their .tmp and .old forms), `latest` and `latest.tmp`. Empty for
  // a missing folder.
  static std::vector<std::string> entries_in(const std::string& dir);

  const Options& options() const { return o_; }

 private:
  // Points o.dir/latest at `name`, then prunes. Rank 0, after the save of `name` committed.
  static void commit(const Options& o, const std::string& name);

  Options o_;
  CommPtr world_;
  CommPtr background_;  // the background saves' communicator
  std::thread saver_;
  std::exception_ptr save_error_;
};

}  // namespace hp::train
