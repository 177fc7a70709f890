#include "hp/train/run_folders.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <memory>
#include <sstream>

#include "hp/core/error.h"
#include "hp/core/files.h"
#include "hp/train/checkpoint_manager.h"

namespace hp::train {

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The first 4 KiB of a regular file, or "" when it is not one (a symbolic link, a FIFO that
// would block, a folder) or cannot be read.
std::string read_small(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st {};
  std::string out;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    char buf[4096];
    for (ssize_t n; out.size() < sizeof buf && (n = ::read(fd, buf, sizeof buf - out.size())) > 0;) out.append(buf, n);
  }
  ::close(fd);
  return out;
}

// Writes `text` to the new file `path` (O_EXCL) and syncs it; "" or the OS's reason.
std::string write_new(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return std::strerror(errno);
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = n == static_cast<ssize_t>(text.size()) ? 0 : (n < 0 ? errno : ENOSPC);
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (err != 0 || !synced) {
    ::unlink(path.c_str());
    return std::strerror(err != 0 ? err : EIO);
  }
  return "";
}

struct Holder {
  std::string host, since;
  long pid = 0;
  // The process's start time (clock ticks after boot) and the boot's id: a live process of
  // that pid with another start, or another boot, is not the holder (the pid was reused).
  // Empty in a lock written before they were recorded.
  std::string start, boot;
  bool parsed = false;
};

// "host H\npid P\nsince T\nstart S\nboot B\n" as FolderLock writes it.
Holder parse_holder(const std::string& text) {
  Holder h;
  std::istringstream in(text);
  for (std::string key, value; in >> key >> value;) {
    if (key == "host") h.host = value;
    if (key == "since") h.since = value;
    if (key == "start") h.start = value;
    if (key == "boot") h.boot = value;
    if (key == "pid") {
      char* end = nullptr;
      errno = 0;
      h.pid = std::strtol(value.c_str(), &end, 10);
      if (errno != 0 || *end != '\0' || h.pid <= 0) h.pid = 0;
    }
  }
  h.parsed = !h.host.empty() && h.pid > 0;
  return h;
}

// The state letter of a Linux task from its /proc stat file (the field after the command's
// closing parenthesis), or '?' where it cannot be read.
char task_state(const std::string& stat_path) {
  const std::string text = read_small(stat_path);
  const auto close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() ? text[close + 2] : '?';
}

// The start time of `pid` (field 22 of its /proc stat file: clock ticks after boot), "" where
// it cannot be read (not Linux, no such process).
std::string process_start(long pid) {
  const std::string text = read_small("/proc/" + std::to_string(pid) + "/stat");
  const auto close = text.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream in(text.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && (in >> field); ++i) {
    if (i == 22) return field;
  }
  return "";
}

// This boot's id ("" where it cannot be read).
std::string boot_id() {
  std::string id = read_small("/proc/sys/kernel/random/boot_id");
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

// Whether every thread of `pid` has exited: a zombie its parent has not reaped yet. A job
// launcher that exits as soon as its ranks die leaves them so for a moment (mpirun does),
// and a relaunch at once must not take them for a live run. Linux only; elsewhere false.
bool exited(long pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  if (task_state(proc + "/stat") != 'Z') return false;
  std::unique_ptr<DIR, int (*)(DIR*)> tasks(::opendir((proc + "/task").c_str()), ::closedir);
  if (!tasks) return errno == ENOENT;  // reaped meanwhile
  while (const dirent* e = ::readdir(tasks.get())) {
    if (e->d_name[0] == '.') continue;
    const char s = task_state(proc + "/task/" + e->d_name + "/stat");
    if (s != 'Z' && s != 'X' && s != '?') return false;  // '?': that thread is gone
  }
  return true;
}

// A process of this host that no longer runs. EPERM: it exists (another user's). A holder
// whose main thread has exited while others are still exiting is waited for, 5 s at most.
bool gone(const Holder& h) {
  if (h.host != host_name()) return false;
  // Another boot: every process of the lock's is gone. A process of that pid that started at
  // another time: the pid was given to another process (the lock's holder is gone).
  if (!h.boot.empty() && !boot_id().empty() && h.boot != boot_id()) return true;
  if (!h.start.empty()) {
    const std::string now = process_start(h.pid);
    if (!now.empty() && now != h.start) return true;
  }
  const auto pid = static_cast<pid_t>(h.pid);
  for (int tries = 0; tries < 50; ++tries) {
    if (::kill(pid, 0) != 0) return errno == ESRCH;
    if (exited(h.pid)) return true;
    if (task_state("/proc/" + std::to_string(h.pid) + "/stat") != 'Z') return false;  // running
    ::usleep(100 * 1000);
  }
  return false;
}

// Creates `dir` (and its parents) and checks that this process can create a file in it.
void create_and_probe(const std::string& dir, const std::string& what, int rank) {
  std::string made = files::create_folders(dir);
  HP_CHECK(made.empty(), what, " cannot be created: ", made);
  const std::string probe = dir + "/.hp-train-probe." + host_name() + "." + std::to_string(::getpid()) + "." +
                            std::to_string(rank);
  const std::string error = write_new(probe, "probe\n");
  HP_CHECK(error.empty(), what, " cannot be written: creating a file in it failed: ", error);
  ::unlink(probe.c_str());
}

}  // namespace

FolderLock::FolderLock(const std::string& dir, const std::string& what) : path_(dir + "/hp-train.lock") {
  content_ = "host " + host_name() + "\npid " + std::to_string(::getpid()) + "\nsince " + now_utc() + "\n";
  const std::string start = process_start(::getpid()), boot = boot_id();
  if (!start.empty()) content_ += "start " + start + "\n";
  if (!boot.empty()) content_ += "boot " + boot + "\n";
  const std::string mine = path_ + "." + host_name() + "." + std::to_string(::getpid());
  ::unlink(mine.c_str());  // a leftover of this very pid (an earlier process the OS gave it to)
  const std::string error = write_new(mine, content_);
  HP_CHECK(error.empty(), what, ": cannot write its lock file '", mine, "': ", error);
  for (int attempt = 0;; ++attempt) {
    if (::link(mine.c_str(), path_.c_str()) == 0) break;
    const int err = errno;
    if (err != EEXIST) {
      ::unlink(mine.c_str());
      HP_CHECK(false, what, ": cannot create its lock file '", path_, "': ", std::strerror(err));
    }
    const std::string text = read_small(path_);
    const Holder h = parse_holder(text);
    if (!h.parsed) {
      ::unlink(mine.c_str());
      HP_CHECK(false, what, " is locked by '", path_, "', which does not name its holder (host and pid); remove it "
               "if no run is using this folder");
    }
    if (attempt > 0 || !gone(h)) {
      ::unlink(mine.c_str());
      const bool here = h.host == host_name();
      HP_CHECK(false, what, " is in use by another run: pid ", h.pid, " on host ", h.host, " since ", h.since,
               " holds its lock '", path_, "'. Wait for that run to end, or give this one another folder",
               here ? std::string()
                    : std::string(" (a process on another host cannot be checked from here: if that run has "
                                  "ended, remove the lock file)"));
    }
    // Stale: the holder died without removing it. Replace it, then read it back: a second
    // run taking over at the same time wins or loses here.
    if (::rename(mine.c_str(), path_.c_str()) != 0) {
      const int e = errno;
      ::unlink(mine.c_str());
      HP_CHECK(false, what, ": cannot take over the stale lock '", path_, "': ", std::strerror(e));
    }
    if (read_small(path_) == content_) {
      note_ = "took over the stale lock '" + path_ + "' of pid " + std::to_string(h.pid) + " on host " + h.host +
              " (since " + h.since + ", no longer running)";
      return;
    }
    HP_CHECK(false, what, " is in use by another run, which took over the stale lock '", path_, "' first");
  }
  ::unlink(mine.c_str());
}

FolderLock::~FolderLock() {
  if (read_small(path_) == content_) ::unlink(path_.c_str());
}

RunFolders::RunFolders(const TrainConfig& c, int rank, EarlierRun earlier)
    : save_dir_(c.save_interval > 0 ? c.save_dir : std::string()), mode_(earlier) {
  const std::string out_what = "output_dir='" + c.output_dir + "'", save_what = "save_dir='" + save_dir_ + "'";
  if (!c.output_dir.empty() && rank == 0) create_and_probe(c.output_dir, out_what, rank);
  if (!save_dir_.empty()) create_and_probe(save_dir_, save_what, rank);
  if (rank != 0) return;
  if (!c.output_dir.empty()) locks_.push_back(std::make_unique<FolderLock>(c.output_dir, out_what));
  if (!save_dir_.empty() && save_dir_ != c.output_dir) locks_.push_back(std::make_unique<FolderLock>(save_dir_, save_what));
  if (save_dir_.empty()) return;
  earlier_ = CheckpointManager::entries_in(save_dir_);
  if (earlier_.empty() || earlier != EarlierRun::kRefuse) return;
  std::string newest;
  try {
    newest = CheckpointManager::latest_of(save_dir_);  // a link or a FIFO is not read
  } catch (const Error&) {
  }
  HP_CHECK(false, save_what, " holds the checkpoints of an earlier run (", earlier_.size(), " entries: ", earlier_.front(),
           earlier_.size() > 1 ? " ... " + earlier_.back() : std::string(),
           newest.empty() ? std::string() : "; latest: " + newest.substr(0, 64),
           "), which this run would overwrite. Continue that run with --resume, start over with --overwrite "
           "(which deletes them), or give this run another save_dir");
}

RunFolders::~RunFolders() = default;

std::string RunFolders::replace_earlier() {
  if (mode_ != EarlierRun::kReplace || earlier_.empty()) return "";
  for (const auto& n : earlier_) {
    const std::string error = files::remove_tree(save_dir_ + "/" + n);
    HP_CHECK(error.empty(), "--overwrite: ", error);
  }
  const std::string line = "--overwrite: deleted the earlier run's " + std::to_string(earlier_.size()) +
                           " checkpoint entries in " + save_dir_ + " (" + earlier_.front() +
                           (earlier_.size() > 1 ? " ... " + earlier_.back() : std::string()) + ")";
  earlier_.clear();
  return line;
}

std::vector<std::string> RunFolders::notes() const {
  std::vector<std::string> out;
  for (const auto& l : locks_) {
    if (!l->note().empty()) out.push_back(l->note());
  }
  return out;
}

}  // namespace hp::train
