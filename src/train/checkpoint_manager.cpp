#include "hp/train/checkpoint_manager.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <utility>
#include <vector>

#include "hp/ckpt/checkpoint.h"
#include "hp/comm/agree.h"
#include "hp/core/error.h"

namespace hp::train {

namespace fs = std::filesystem;

namespace {

bool committed(const std::string& dir) {
  std::error_code ec;
  return fs::exists(ckpt::committed_dir(dir) + "/metadata.json", ec);
}

// A checkpoint's folder name as this manager writes it: step_ and 8 or more digits.
bool is_checkpoint_name(const std::string& n) {
  if (n.rfind("step_", 0) != 0 || n.size() < 13) return false;
  return std::all_of(n.begin() + 5, n.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

}  // namespace

CheckpointManager::Options CheckpointManager::options_of(const TrainConfig& c) {
  return {c.save_dir, c.save_interval, c.keep_last_n, c.async_save};
}

CheckpointManager::CheckpointManager(Options o, CommPtr world) : o_(std::move(o)), world_(std::move(world)) {
  HP_CHECK(o_.interval == 0 || !o_.dir.empty(), "checkpoints every ", o_.interval, " steps need a folder (save_dir)");
  HP_CHECK(o_.interval >= 0 && o_.keep_last_n >= 0, "checkpoint interval ", o_.interval, " and keep_last_n ",
           o_.keep_last_n, " must not be negative");
  HP_CHECK(o_.storage != nullptr, "CheckpointManager: no storage given");
}

CheckpointManager::~CheckpointManager() {
  if (saver_.joinable()) saver_.join();  // a save in flight completes
}

bool CheckpointManager::due(int64_t step, int64_t last_step) const {
  return o_.interval > 0 && (step % o_.interval == 0 || step == last_step);
}

std::string CheckpointManager::name_of(int64_t steps) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(steps));
  return buf;
}

std::string CheckpointManager::resolve(const std::string& dir) {
  HP_CHECK(!dir.empty(), "no checkpoint folder (set save_dir or output_dir, or name the checkpoint)");
  if (committed(dir)) return dir;
  const std::string name = latest_of(dir);
  // The file is read back from disk: it must name a checkpoint folder of `dir` itself (a
  // child by a name this manager writes, so no path, and a real folder, not a link out).
  const std::string shown = name.size() > 80 ? name.substr(0, 77) + "..." : name;
  HP_CHECK(is_checkpoint_name(name), "'", dir, "/latest' names '", shown,
           "', which is not a checkpoint folder name (step_ and digits)");
  const std::string out = dir + "/" + name;
  HP_CHECK(committed(out), "'", dir, "/latest' names ", name, ", which is not a committed checkpoint (no metadata.json)");
  std::error_code ec;
  const std::string used = ckpt::committed_dir(out);
  HP_CHECK(fs::symlink_status(used, ec).type() == fs::file_type::directory, "'", dir, "/latest' names ", name, ", but '",
           used, "' is a symbolic link, not a folder (a checkpoint is a folder inside '", dir, "')");
  return out;
}

std::string CheckpointManager::latest_of(const std::string& dir) {
  const std::string path = dir + "/latest";
  // O_NOFOLLOW: the link itself is refused, not what it points at (checked then opened, a
  // link could be swapped in between); O_NONBLOCK: a FIFO is refused, not waited on.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  HP_CHECK(fd >= 0 || errno != ENOENT, "no checkpoint in '", dir,
           "' (its 'latest' file is missing: nothing was committed there yet)");
  HP_CHECK(fd >= 0 || errno != ELOOP, "'", path, "' is a symbolic link (this manager writes 'latest' as a ",
           "regular file in '", dir, "'; a link could point anywhere, so it is not followed)");
  HP_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st{};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  char buf[kMaxLatest + 1];
  ssize_t n = -1;
  int read_errno = 0;
  if (regular) {
    do {
      n = ::read(fd, buf, sizeof buf);
    } while (n < 0 && errno == EINTR);
    read_errno = errno;
  }
  ::close(fd);
  HP_CHECK(regular, "'", path, "' is not a regular file (this manager writes 'latest' as one line in a regular file)");
  HP_CHECK(n >= 0, "cannot read '", path, "': ", std::strerror(read_errno));
  const std::string text(buf, static_cast<size_t>(n));
  const size_t eol = text.find('\n');
  HP_CHECK(eol != std::string::npos || n <= kMaxLatest, "'", path, "' is not a checkpoint name: its first line is longer than ",
           kMaxLatest, " bytes (", text.substr(0, 40), "...)");
  const std::string name = text.substr(0, eol);
  HP_CHECK(!name.empty(), "no checkpoint in '", dir, "' (its 'latest' file is empty: nothing was committed there yet)");
  return name;
}

void CheckpointManager::commit(const Options& o_, const std::string& name) {
  // Durable before it replaces the old pointer, and the rename durable after.
  ckpt::write_atomically(*o_.storage, o_.dir + "/latest", o_.dir + "/latest.tmp", name + "\n");
  if (o_.keep_last_n <= 0) return;
  std::vector<std::string> saved;
  for (const auto& e : fs::directory_iterator(o_.dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && is_checkpoint_name(n) && fs::exists(e.path() / "metadata.json")) saved.push_back(n);
  }
  std::sort(saved.begin(), saved.end());  // zero-padded: oldest first
  for (size_t i = 0; i + static_cast<size_t>(o_.keep_last_n) < saved.size(); ++i) {
    if (saved[i] == name) continue;
    try {
      o_.storage->remove_tree(o_.dir + "/" + saved[i]);
    } catch (const std::exception& e) {
      HP_CHECK(false, "keep_last_n: ", e.what());
    }
  }
}

std::string CheckpointManager::save(const ckpt::Checkpointable& state) { return save(state, o_.async); }

std::string CheckpointManager::save(const ckpt::Checkpointable& state, bool background) {
  HP_CHECK(!o_.dir.empty(), "save: no checkpoint folder (save_dir)");
  wait();
  const std::string name = name_of(state.steps_done()), dir = o_.dir + "/" + name;
  o_.storage->make_folders(o_.dir);
  const int rank = world_->rank();
  ckpt::Checkpointable::State st = state.checkpoint_state();
  // The state as it is now: copied where training goes on while it is written.
  ckpt::to_host(st.items, /*copy=*/background);
  // By value: a background save may commit after this manager is gone.
  auto write = [o = o_, name, dir, rank, st = std::move(st)](const CommPtr& comm) {
    ckpt::save(st.items, dir, comm, st.values, *o.storage);
    o.storage->reached(ckpt::SavePoint::kLatest, rank);
    if (rank == 0) commit(o, name);
  };
  if (!background) {
    write(world_);
    world_->barrier().wait();
    return dir;
  }
  if (!background_) {
    CommOptions co;
    co.name = "checkpoint";
    background_ = world_->split(0, rank, co);
  }
  saver_ = std::thread([this, write = std::move(write)] {
    try {
      write(background_);
    } catch (...) {
      save_error_ = std::current_exception();
    }
  });
  return dir;
}

void CheckpointManager::wait() {
  std::string error;
  if (saver_.joinable()) saver_.join();
  if (save_error_) {
    try {
      std::rethrow_exception(std::exchange(save_error_, nullptr));
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  raise_if_any_failed(world_, error, "the background save");
}

std::string CheckpointManager::load(ckpt::Checkpointable& state, const std::string& from) {
  const std::string dir = resolve(from);
  state.load_checkpoint(dir);
  return dir;
}

std::vector<std::string> CheckpointManager::entries_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    std::string stem = n;
    for (const char* suffix : {".tmp", ".old"}) {
      const std::string sfx = suffix;
      if (stem.size() > sfx.size() && stem.compare(stem.size() - sfx.size(), sfx.size(), sfx) == 0) {
        stem.resize(stem.size() - sfx.size());
        break;
      }
    }
    if (is_checkpoint_name(stem) || stem == "latest") out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace hp::train
