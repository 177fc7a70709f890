#include "hp/ckpt/storage.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "hp/core/error.h"
#include "hp/core/files.h"

namespace hp::ckpt {
namespace {

class LocalFile final : public Storage::File {
 public:
  explicit LocalFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    HP_CHECK(fd_ >= 0, "cannot create '", path_, "': ", std::strerror(errno));
  }
  ~LocalFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  size_t write_some(const void* p, size_t n) override {
    for (;;) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      HP_CHECK(w > 0, "writing '", path_, "' failed: ", w < 0 ? std::strerror(errno) : "nothing was written");
      return static_cast<size_t>(w);
    }
  }
  void sync() override { HP_CHECK(::fsync(fd_) == 0, "fsync of '", path_, "' failed: ", std::strerror(errno)); }
  void close() override {
    const int fd = fd_;
    fd_ = -1;
    HP_CHECK(::close(fd) == 0, "closing '", path_, "' failed: ", std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

class LocalStorage final : public Storage {
 public:
  std::unique_ptr<File> create(const std::string& path) override { return std::make_unique<LocalFile>(path); }
  void sync(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    HP_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    HP_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(err));
  }
  void rename(const std::string& from, const std::string& to) override {
    HP_CHECK(std::rename(from.c_str(), to.c_str()) == 0, "cannot rename '", from, "' to '", to,
             "': ", std::strerror(errno));
  }
  void make_folders(const std::string& path) override {
    const std::string error = files::create_folders(path);
    HP_CHECK(error.empty(), error);
  }
  void remove_tree(const std::string& path) override {
    const std::string error = files::remove_tree(path);
    HP_CHECK(error.empty(), error);
  }
};

}  // namespace

const char* to_string(SavePoint p) {
  switch (p) {
    case SavePoint::kWrite: return "write";
    case SavePoint::kWritten: return "written";
    case SavePoint::kCommit: return "commit";
    case SavePoint::kSwap: return "swap";
    case SavePoint::kLatest: return "latest";
  }
  return "?";
}

void Storage::File::write(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const size_t w = write_some(c, n);
    HP_CHECK(w >= 1 && w <= n, "a storage wrote ", w, " of ", n, " bytes");
    c += w;
    n -= w;
  }
}

void Storage::reached(SavePoint, int) {}

std::shared_ptr<Storage> local_storage() {
  static const std::shared_ptr<Storage> local = std::make_shared<LocalStorage>();
  return local;
}

void write_atomically(Storage& storage, const std::string& path, const std::string& temp, const std::string& text) {
  {
    auto f = storage.create(temp);
    f->write(text.data(), text.size());
    f->sync();
    f->close();
  }
  storage.rename(temp, path);
  const std::filesystem::path folder = std::filesystem::absolute(path).parent_path();
  storage.sync(folder.string());
}

}  // namespace hp::ckpt
