// Test support: faults injected into the checkpoint seam (hp/ckpt/storage.h), as
// comm/fault_injection.h injects them into the communicators'.
//
// FaultyStorage passes every call to the storage it wraps, except where its StorageFault
// says otherwise:
//   - the `nth` call of kind `op` whose path contains `path_has` fails with `error` (an errno:
//     ENOSPC on a write is a full disk, EIO on a sync a failed fsync), raised as the local
//     storage raises it;
//   - every write writes at most `short_writes` bytes (0: as asked), as a pipe or a network
//     file system may;
//   - at `kill_at`, on `kill_rank` (-1: every rank), in the `kill_save`-th save of the
//     process (saves counted by their kWrite point), the process kills itself with SIGKILL.
// Nothing here is reachable from the library or hp-train.
#pragma once

#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "hp/ckpt/storage.h"
#include "hp/core/error.h"

namespace hp::test {

struct StorageFault {
  enum class Op { kNone, kCreate, kWrite, kSync, kClose, kRename, kMakeFolders, kRemoveTree };
  Op op = Op::kNone;
  std::string path_has;  // only calls on a path containing this count ("": every call)
  int nth = 1;           // the nth counted call fails (1-based)
  int error = EIO;
  size_t short_writes = 0;
  std::optional<ckpt::SavePoint> kill_at;
  int kill_rank = -1;
  int kill_save = 1;
};

class FaultyStorage final : public ckpt::Storage {
 public:
  FaultyStorage(std::shared_ptr<ckpt::Storage> inner, StorageFault f) : inner_(std::move(inner)), f_(std::move(f)) {}

  // How many calls of the fault's kind on its paths were made so far (fired or not).
  int counted() const { return counted_; }

  std::unique_ptr<File> create(const std::string& path) override {
    hit(StorageFault::Op::kCreate, path);
    return std::make_unique<FaultyFile>(this, path, inner_->create(path));
  }
  void sync(const std::string& path) override {
    hit(StorageFault::Op::kSync, path);
    inner_->sync(path);
  }
  void rename(const std::string& from, const std::string& to) override {
    hit(StorageFault::Op::kRename, from);
    inner_->rename(from, to);
  }
  void make_folders(const std::string& path) override {
    hit(StorageFault::Op::kMakeFolders, path);
    inner_->make_folders(path);
  }
  void remove_tree(const std::string& path) override {
    hit(StorageFault::Op::kRemoveTree, path);
    inner_->remove_tree(path);
  }
  void reached(ckpt::SavePoint point, int rank) override {
    if (point == ckpt::SavePoint::kWrite) ++saves_;
    if (f_.kill_at == point && (f_.kill_rank < 0 || f_.kill_rank == rank) && saves_ == f_.kill_save) {
      std::raise(SIGKILL);
    }
    inner_->reached(point, rank);
  }

 private:
  class FaultyFile final : public File {
   public:
    FaultyFile(FaultyStorage* s, std::string path, std::unique_ptr<File> inner)
        : s_(s), path_(std::move(path)), inner_(std::move(inner)) {}
    size_t write_some(const void* p, size_t n) override {
      s_->hit(StorageFault::Op::kWrite, path_);
      if (s_->f_.short_writes > 0 && n > s_->f_.short_writes) n = s_->f_.short_writes;
      return inner_->write_some(p, n);
    }
    void sync() override {
      s_->hit(StorageFault::Op::kSync, path_);
      inner_->sync();
    }
    void close() override {
      s_->hit(StorageFault::Op::kClose, path_);
      inner_->close();
    }

   private:
    FaultyStorage* s_;
    std::string path_;
    std::unique_ptr<File> inner_;
  };

  void hit(StorageFault::Op op, const std::string& path) {
    if (op != f_.op || path.find(f_.path_has) == std::string::npos) return;
    HP_CHECK(++counted_ != f_.nth, "injected fault on '", path, "': ", std::strerror(f_.error));
  }

  std::shared_ptr<ckpt::Storage> inner_;
  StorageFault f_;
  int counted_ = 0;
  int saves_ = 0;
};

}  // namespace hp::test
