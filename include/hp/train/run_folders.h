// The folders a training run writes (output_dir, save_dir), claimed before its first step:
// created and probed for writing, locked against a second run, and checked for the
// checkpoints of an earlier run, which a new run may not overwrite unless told to.
//
// The lock is the file <folder>/hp-train.lock, holding the holder's host, pid and start
// time; it is made whole under a private name and hard-linked into place, so it exists
// complete or not at all, and is removed when the run ends. A lock whose holder ran on this
// host and is no longer running (a killed job) is stale: the next run takes it over and says
// so. A holder on another host cannot be checked from here: the error names it and the file
// to remove once that run has ended. (Two runs taking over one stale lock in the same
// instant could both believe they hold it: the window is one rename and one read.)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hp/train/config.h"

namespace hp::train {

// What a run does with a save_dir that holds checkpoints of an earlier run.
enum class EarlierRun {
  kRefuse,    // the default: an error naming them, before anything is written
  kContinue,  // --resume: keep them (this run continues one of them)
  kReplace,   // --overwrite: delete them once every rank's checks passed
};

// A lock on one folder for the life of this object (see the file comment).
class FolderLock {
 public:
  // Takes the lock on the existing folder `dir`, or raises naming the holder (host, pid,
  // since when) and the lock file. `what` names the folder in messages ("save_dir='x'").
  FolderLock(const std::string& dir, const std::string& what);
  ~FolderLock();  // removes the lock file while it is still this process's
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

  const std::string& path() const { return path_; }
  // "" or what was taken over: "took over the stale lock of pid 12 on host h (no longer running)".
  const std::string& note() const { return note_; }

 private:
  std::string path_, content_, note_;
};

class RunFolders {
 public:
  // This rank's part (not collective: the caller agrees on errors across ranks). Rank 0
  // creates output_dir and probes it for writing; where the run saves (save_interval > 0)
  // every rank does the same with save_dir (each writes its own files there); rank 0 then
  // locks both and looks for an earlier run's
  // checkpoints in save_dir (step_<k> folders, committed or not, and `latest`), which
  // `earlier` kRefuse refuses, naming them and the two ways on. Raises naming the config
  // key, the folder and the OS's reason.
  RunFolders(const TrainConfig& c, int rank, EarlierRun earlier);
  ~RunFolders();

  // kReplace, on rank 0: deletes the earlier run's checkpoints (only the names listed
  // above) and returns a line saying what went; "" when there was nothing or for the other
  // modes and ranks. Call it once every rank's checks have passed.
  std::string replace_earlier();

  // Lines for the console: stale locks taken over.
  std::vector<std::string> notes() const;

  // The earlier run's checkpoint entries found in save_dir (rank 0), sorted.
  const std::vector<std::string>& earlier() const { return earlier_; }

 private:
  std::string save_dir_;
  EarlierRun mode_;
  std::vector<std::unique_ptr<FolderLock>> locks_;
  std::vector<std::string> earlier_;
};

}  // namespace hp::train
