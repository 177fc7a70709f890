// Where a checkpoint's bytes go. Every file a save writes, every fsync, rename, folder made
// and tree removed goes through a Storage, and the save tells it each point it reaches
// (SavePoint). The default, local_storage(), is this machine's file system through POSIX
// calls: a failed call raises hp::Error naming the path and the system's error (ENOSPC,
// EIO, ...), and a short write is continued. Reads do not go through it (a load verifies
// what it reads against the checksums instead).
//
// The seam is for tests: a decorator around the local storage fails a chosen call, makes
// every write short, or kills the process at a chosen point of a save
// (tests/ckpt/faulty_storage.h), so production code carries no fault hook of its own.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace hp::ckpt {

// The points of a save, in order, that a Storage is told of.
enum class SavePoint {
  kWrite,    // every rank: before it writes its data file
  kWritten,  // every rank: after it wrote it, before the commit
  kCommit,   // rank 0: metadata.json written, before the renames that commit
  kSwap,     // rank 0: an older folder of the same name set aside, the new one not yet in
  kLatest,   // train::CheckpointManager, every rank: committed, before 'latest' moves
};
const char* to_string(SavePoint p);

class Storage {
 public:
  virtual ~Storage() = default;

  // A file open for writing.
  class File {
   public:
    virtual ~File() = default;
    // Writes up to `n` (> 0) bytes from `p`; returns how many, at least 1. Raises on failure.
    virtual size_t write_some(const void* p, size_t n) = 0;
    // Makes what was written durable (fsync). Raises on failure.
    virtual void sync() = 0;
    // Closes the file (the destructor closes one not closed, ignoring errors). Raises on
    // failure: a close may be where a failed write is reported.
    virtual void close() = 0;
    // All `n` bytes, continuing after short writes.
    void write(const void* p, size_t n);
  };

  // Creates `path` for writing, or truncates it.
  virtual std::unique_ptr<File> create(const std::string& path) = 0;
  // fsync of a file or a folder (a rename is durable once its folder is synced).
  virtual void sync(const std::string& path) = 0;
  // Renames `from` to `to` in one step, replacing a file (not a folder) at `to`.
  virtual void rename(const std::string& from, const std::string& to) = 0;
  // Makes `path` and the folders above it, where missing.
  virtual void make_folders(const std::string& path) = 0;
  // Removes `path` and everything under it; nothing for a missing path. Symbolic links are
  // removed, not followed.
  virtual void remove_tree(const std::string& path) = 0;
  // A save reached `point` on `rank`. Nothing here; a test's decorator may act on it.
  virtual void reached(SavePoint point, int rank);
};

// The file system of this machine (one object, shared).
std::shared_ptr<Storage> local_storage();

// `text` written to `path` as a whole or not at all: to `temp` first, synced, renamed to
// `path`, and `path`'s folder synced.
void write_atomically(Storage& storage, const std::string& path, const std::string& temp, const std::string& text);

}  // namespace hp::ckpt
