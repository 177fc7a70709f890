#include "hp/ckpt/checkpoint.h"

#include "hp/comm/agree.h"
#include "hp/core/hash.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>

#include "hp/ckpt/safetensors.h"
#include "reader.h"
#include "hp/core/error.h"

namespace hp::ckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string box_key(const std::string& name, const std::vector<int64_t>& offsets) {
  std::string k = name + "@";
  for (size_t d = 0; d < offsets.size(); ++d) k += (d ? "," : "") + std::to_string(offsets[d]);
  return k;
}

// Every rank's `mine`, gathered to every rank (as JSON text).
std::vector<json> gather_json(const json& mine, const CommPtr& world) {
  const std::string text = mine.dump();
  // On the device the backend carries control values on (the GPU for nccl).
  const auto on = at::TensorOptions().device(control_device(world));
  at::Tensor len = at::full({1}, static_cast<int64_t>(text.size()), on.dtype(at::kLong));
  world->all_reduce(len, {ReduceOp::MAX}).wait();
  const int64_t L = len.item<int64_t>() + 1;
  at::Tensor buf = at::zeros({L}, at::kByte);
  std::memcpy(buf.data_ptr(), text.data(), text.size());
  buf = buf.to(on.device());
  at::Tensor all = at::empty({world->size() * L}, on.dtype(at::kByte));
  world->all_gather(all, buf).wait();
  all = all.cpu();
  std::vector<json> out;
  for (int r = 0; r < world->size(); ++r) {
    const char* p = static_cast<const char*>(all.data_ptr()) + r * L;
    out.push_back(json::parse(std::string(p, strnlen(p, static_cast<size_t>(L)))));
  }
  return out;
}

// Files are checksummed in blocks, so a load that reads a few byte ranges verifies only the
// blocks under them (each once), with detail::block_hash.
constexpr int64_t kChecksumBlock = int64_t(1) << 20;

// Size and per-block checksums of a file, read back from disk.
json file_checksums(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  HP_CHECK(fd >= 0, "ckpt::save: cannot open '", path, "' to checksum it: ", std::strerror(errno));
  std::unique_ptr<int, void (*)(int*)> closer(&fd, [](int* q) { ::close(*q); });
  std::vector<uint8_t> buf(static_cast<size_t>(kChecksumBlock));
  json sums = json::array();
  int64_t total = 0;
  for (;;) {
    int64_t got = 0;
    while (got < kChecksumBlock) {
      ssize_t r = ::pread(fd, buf.data() + got, static_cast<size_t>(kChecksumBlock - got), static_cast<off_t>(total + got));
      if (r < 0 && errno == EINTR) continue;
      HP_CHECK(r >= 0, "ckpt::save: reading back '", path, "' failed: ", std::strerror(errno));
      if (r == 0) break;
      got += r;
    }
    if (got == 0) break;
    sums.push_back(std::to_string(detail::block_hash(buf.data(), static_cast<size_t>(got))));
    total += got;
    if (got < kChecksumBlock) break;
  }
  return {{"bytes", total}, {"block", kChecksumBlock}, {"checksums", sums}};
}

// A data file opened for loading: its size checked against the metadata at once, and each
// block checked against its checksum the first time a read touches it.
class CheckedFile {
 public:
  // `info`: the file's entry in the metadata (null: none, nothing to check). A link is
  // refused (not followed) under FileLinks::kRefuse; anything but a regular file always (a
  // FIFO would block the reader).
  CheckedFile(std::string path, const json& info, detail::FileLinks links) : path_(std::move(path)) {
    const int follow = links == detail::FileLinks::kRefuse ? O_NOFOLLOW : 0;
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | follow);
    HP_CHECK(fd_ >= 0 || errno != ELOOP, "ckpt::load: '", path_,
             "' is a symbolic link (a checkpoint's files are regular files in its folder; links are not followed)");
    HP_CHECK(fd_ >= 0, "ckpt::load: cannot open '", path_, "': ", std::strerror(errno));
    try {
      struct stat st{};
      HP_CHECK(::fstat(fd_, &st) == 0, "ckpt::load: cannot stat '", path_, "': ", std::strerror(errno));
      HP_CHECK(S_ISREG(st.st_mode), "ckpt::load: '", path_, "' is not a regular file");
      check(info);
    } catch (...) {
      ::close(fd_);  // the destructor does not run for a constructor that throws
      throw;
    }
  }
  // `info` as read_metadata checked it: its numbers in range, one checksum per block.
  void check(const json& info) {
    if (info.is_null()) return;  // a checkpoint written before checksums: nothing to check
    bytes_ = info["bytes"].get<int64_t>();
    block_ = info["block"].get<int64_t>();
    for (const auto& c : info["checksums"]) sums_.push_back(std::stoull(c.get<std::string>()));
    verified_.assign(sums_.size(), false);
    struct stat st{};
    HP_CHECK(::fstat(fd_, &st) == 0, "ckpt::load: cannot stat '", path_, "': ", std::strerror(errno));
    HP_CHECK(st.st_size == bytes_, "ckpt::load: '", path_, "' has ", static_cast<int64_t>(st.st_size),
             " bytes, the checkpoint wrote ", bytes_, " (truncated or changed since)");
  }
  ~CheckedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  CheckedFile(const CheckedFile&) = delete;
  CheckedFile& operator=(const CheckedFile&) = delete;
  int fd() const { return fd_; }
  // Verifies every block under [offset, offset + n); `what` names the reader in errors.
  void verify(int64_t offset, int64_t n, const std::string& what) {
    if (sums_.empty() || n <= 0) return;
    std::vector<uint8_t> buf;
    for (int64_t b = offset / block_; b <= (offset + n - 1) / block_; ++b) {
      HP_CHECK(b < static_cast<int64_t>(sums_.size()), "ckpt::load: '", path_, "': ", what, " reads past its end");
      if (verified_[static_cast<size_t>(b)]) continue;
      const int64_t begin = b * block_, len = std::min(block_, bytes_ - begin);
      buf.resize(static_cast<size_t>(len));
      int64_t got = 0;
      while (got < len) {
        ssize_t r = ::pread(fd_, buf.data() + got, static_cast<size_t>(len - got), static_cast<off_t>(begin + got));
        if (r < 0 && errno == EINTR) continue;
        HP_CHECK(r > 0, "ckpt::load: reading '", path_, "' failed: ", r < 0 ? std::strerror(errno) : "the file is shorter");
        got += r;
      }
      // A block is checked whole: one read for the header may find a damaged byte of the
      // data after it (and the reverse); the message says where the block's bytes are.
      const bool wider = begin < offset || begin + len > offset + n;
      HP_CHECK(detail::block_hash(buf.data(), buf.size()) == sums_[static_cast<size_t>(b)], "ckpt::load: '", path_,
               "' is corrupted: bytes ", begin, "-", begin + len, " do not match their checksum (found reading ", what,
               wider ? "; the block also holds other bytes, and the damage may be anywhere in it" : "", ")");
      verified_[static_cast<size_t>(b)] = true;
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t bytes_ = 0, block_ = 1;
  std::vector<uint64_t> sums_;
  std::vector<bool> verified_;
};

// This rank's items as a save can take them; "" when they are fine.
std::string check_items(const std::vector<Item>& items) {
  for (const auto& it : items) {
    if (!it.local.defined() || !it.local.device().is_cpu()) {
      return "ckpt::save: tensor '" + it.name + "' must be a defined CPU tensor";
    }
    if (!(it.local.sizes().vec() == it.spec.lengths || (it.local.dim() == 0 && it.spec.numel() == 1))) {
      return hp::detail::str_cat("ckpt::save: tensor '", it.name, "' is ", it.local.sizes(), " but its spec says ",
                             it.spec.to_string());
    }
  }
  return "";
}

std::vector<json> gather_boxes(const std::vector<Item>& items, const CommPtr& world) {
  json mine = json::array();
  for (const auto& it : items) {
    mine.push_back({{"name", it.name},
                    {"dtype", dtype_string(it.local.scalar_type())},
                    {"shape", it.spec.global_shape},
                    {"offsets", it.spec.offsets},
                    {"lengths", it.spec.lengths}});
  }
  return gather_json(mine, world);
}


// Reads the part `sub` (offsets within the chunk, lengths) of a row-major chunk of shape
// `chunk` stored at byte `base` of the open file into `out` (contiguous, sub's shape):
// one read per contiguous run.
void read_sub_box(CheckedFile& file, const std::string& path, const std::string& what, int64_t base,
                  const std::vector<int64_t>& chunk, const std::vector<int64_t>& sub_off,
                  const std::vector<int64_t>& sub_len, int64_t elem, char* out) {
  const int fd = file.fd();
  const int64_t nd = static_cast<int64_t>(chunk.size());
  // The dims from `k` on are read in one run: those after k are taken whole.
  int64_t k = nd == 0 ? 0 : nd - 1;
  while (k > 0 && sub_off[k] == 0 && sub_len[k] == chunk[k]) --k;
  int64_t run = elem;
  for (int64_t d = k; d < nd; ++d) run *= sub_len[d];
  std::vector<int64_t> stride(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * chunk[d + 1];
  std::vector<int64_t> idx(k, 0);
  for (;;) {
    int64_t lin = 0;
    for (int64_t d = 0; d < nd; ++d) lin += (sub_off[d] + (d < k ? idx[d] : 0)) * stride[d];
    file.verify(base + lin * elem, run, what);
    int64_t done = 0;
    while (done < run) {
      ssize_t r = ::pread(fd, out + done, static_cast<size_t>(run - done), static_cast<off_t>(base + lin * elem + done));
      if (r < 0 && errno == EINTR) continue;
      HP_CHECK(r > 0, "ckpt: reading '", path, "' at byte ", base + lin * elem + done, " failed",
               r < 0 ? std::string(": ") + std::strerror(errno) : std::string(" (the file is shorter)"));
      done += r;
    }
    out += run;
    int64_t d = k - 1;
    while (d >= 0 && ++idx[d] == sub_len[d]) idx[d--] = 0;
    if (d < 0) break;
  }
}

// metadata.json's document: every box gathered from the ranks (`boxes`), listed once as a
// chunk of the file of the rank `writer_of` picks, the data files' checksums (`files`), the
// values, and the document's own checksum.
json build_metadata(const std::vector<json>& boxes, const std::vector<json>& files,
                    const std::map<std::string, std::string>& values,
                    const std::function<int(const std::string&, const std::vector<int64_t>&)>& writer_of) {
  json meta;
  meta["format"] = detail::kFormat;
  meta["values"] = values;
  json tensors = json::object();
  for (size_t r = 0; r < boxes.size(); ++r) {
    for (const auto& b : boxes[r]) {
      const std::string name = b["name"];
      const auto off = b["offsets"].get<std::vector<int64_t>>();
      const auto len = b["lengths"].get<std::vector<int64_t>>();
      json& t = tensors[name];
      if (t.is_null()) {
        t = {{"dtype", b["dtype"]}, {"shape", b["shape"]}, {"chunks", json::array()}};
      }
      HP_CHECK(t["dtype"] == b["dtype"] && t["shape"] == b["shape"], "ckpt::save: tensor '", name,
               "' has another dtype or global shape on rank ", r);
      int64_t n = 1;
      for (int64_t l : len) n *= l;
      if (n == 0 || writer_of(name, off) != static_cast<int>(r)) continue;
      t["chunks"].push_back({{"file", "rank" + std::to_string(r) + ".safetensors"},
                             {"key", box_key(name, off)},
                             {"offsets", off},
                             {"lengths", len}});
    }
  }
  meta["tensors"] = tensors;
  json fj = json::object();
  for (const auto& f : files) fj[f["file"].get<std::string>()] = f["sums"];
  meta["files"] = fj;
  meta["checksum"] = std::to_string(detail::metadata_checksum(meta));
  return meta;
}

// Rank 0's commit of the folder `tmp` holding every data file: metadata.json written into
// it, then the folder renamed to `dir` in one step (an older `dir` set aside first, removed
// after).
void commit(const json& meta, const std::string& tmp, const std::string& dir, Storage& storage) {
  write_atomically(storage, tmp + "/metadata.json", tmp + "/metadata.json.partial", meta.dump(1));
  storage.reached(SavePoint::kCommit, 0);
  // Killed between the two renames, `dir` is missing and `dir`.old is the previous commit,
  // which committed_dir() then finds; an `dir`.old left so is kept until `dir` is back.
  const std::string old = dir + ".old";
  if (fs::exists(dir)) {
    storage.remove_tree(old);
    storage.rename(dir, old);
  }
  storage.reached(SavePoint::kSwap, 0);
  storage.rename(tmp, dir);
  try {
    storage.remove_tree(old);  // committed: an old folder left behind is no failure of this save
  } catch (const std::exception&) {
  }
  storage.sync(fs::absolute(dir).parent_path().string());
}

}  // namespace

void save(const std::vector<Item>& items, const std::string& dir, const CommPtr& world,
          const std::map<std::string, std::string>& values, Storage& storage) {
  const int rank = world->rank();
  const std::string tmp = dir + ".tmp";
  std::string problem = check_items(items);
  if (rank == 0 && problem.empty()) {
    try {
      storage.remove_tree(tmp);
    } catch (const std::exception&) {  // what is left there is overwritten or not listed
    }
    try {
      storage.make_folders(tmp);
    } catch (const std::exception& e) {
      problem = std::string("ckpt::save: ") + e.what();
    }
  }
  raise_if_any_failed(world, problem, "ckpt::save to '" + dir + "'");  // also orders the folder's creation before any write
  std::vector<json> boxes = gather_boxes(items, world);
  // The writer of each distinct box: one of the ranks holding it, by the tensor's name.
  std::map<std::string, std::vector<int>> holders;
  for (int r = 0; r < world->size(); ++r) {
    for (const auto& b : boxes[r]) {
      holders[box_key(b["name"], b["offsets"].get<std::vector<int64_t>>())].push_back(r);
    }
  }
  auto writer_of = [&](const std::string& name, const std::vector<int64_t>& off) {
    const auto& h = holders.at(box_key(name, off));
    return h[fnv1a(name) % h.size()];
  };
  std::vector<std::pair<std::string, at::Tensor>> mine;
  for (const auto& it : items) {
    if (it.spec.numel() == 0 || writer_of(it.name, it.spec.offsets) != rank) continue;
    mine.emplace_back(box_key(it.name, it.spec.offsets), it.local.reshape(it.spec.lengths));
  }
  const std::string file = "rank" + std::to_string(rank) + ".safetensors";
  std::string error;
  json sums;
  try {
    storage.reached(SavePoint::kWrite, rank);
    write_file(tmp + "/" + file, mine, {}, storage);
    storage.reached(SavePoint::kWritten, rank);
    sums = file_checksums(tmp + "/" + file);
  } catch (const std::exception& e) {
    error = e.what();
  }
  raise_if_any_failed(world, error.empty() ? error : "ckpt::save to '" + dir + "' failed: " + error,
                      "ckpt::save to '" + dir + "'");
  const std::vector<json> files = gather_json(json{{"file", file}, {"sums", sums}}, world);
  std::string commit_error;
  if (rank == 0) try {
    commit(build_metadata(boxes, files, values, writer_of), tmp, dir, storage);
  } catch (const std::exception& e) {
    commit_error = e.what();
  }
  raise_if_any_failed(world, commit_error, "ckpt::save to '" + dir + "'");  // every rank returns once the commit is done (or fails with it)
}

namespace detail {

void load_boxes(const std::vector<Item>& items, const std::string& dir, const json& tensors, const json& files,
                bool convert, const std::string& source, FileLinks links) {
  std::map<std::string, SafetensorsHeader> headers;
  std::map<std::string, std::unique_ptr<CheckedFile>> checked;
  for (const auto& it : items) {
    const std::string& name = it.source.empty() ? it.name : it.source;
    const std::string called = name == it.name ? "'" + name + "'" : "'" + name + "' (for '" + it.name + "')";
    HP_CHECK(tensors.contains(name), "ckpt::load: tensor ", called, " is not in ", source, " '", dir, "'");
    const json& t = tensors[name];
    const auto shape = t["shape"].get<std::vector<int64_t>>();
    HP_CHECK(shape == it.spec.global_shape, "ckpt::load: tensor ", called, " was saved with shape ",
             c10::IntArrayRef(shape), ", the model has ", c10::IntArrayRef(it.spec.global_shape));
    const std::string saved_dtype = t["dtype"].get<std::string>();
    HP_CHECK(convert || saved_dtype == dtype_string(it.local.scalar_type()), "ckpt::load: tensor ", called,
             " was saved as ", saved_dtype, ", the model holds ", it.local.scalar_type());
    int64_t covered = 0;
    // The parts of the box read so far, each chunk's (in the box's coordinates): a chunk that
    // overlaps one would count elements twice and leave others unread.
    std::vector<std::pair<BoxOverlap, std::string>> read;
    for (const auto& c : t["chunks"]) {
      ShardSpec chunk;
      chunk.global_shape = shape;
      chunk.offsets = c["offsets"].get<std::vector<int64_t>>();
      chunk.lengths = c["lengths"].get<std::vector<int64_t>>();
      BoxOverlap o;
      if (!intersect(chunk, it.spec, &o)) continue;
      const std::string where = c["file"].get<std::string>() + ":" + c["key"].get<std::string>();
      for (const auto& [other, other_where] : read) {
        bool overlap = true;
        for (size_t d = 0; d < o.lengths.size(); ++d) {
          overlap = overlap && o.offsets_in_b[d] < other.offsets_in_b[d] + other.lengths[d] &&
                    other.offsets_in_b[d] < o.offsets_in_b[d] + o.lengths[d];
        }
        HP_CHECK(!overlap, "ckpt::load: tensor ", called, " in ", source, " '", dir, "': its chunks ", other_where, " and ",
                 where, " overlap (each element is saved once)");
      }
      read.emplace_back(o, where);
      const std::string fname = c["file"].get<std::string>();
      const std::string file = dir + "/" + fname;
      auto cf = checked.find(file);
      if (cf == checked.end()) {
        const json info = files.contains(fname) ? files[fname] : json();
        cf = checked.emplace(file, std::make_unique<CheckedFile>(file, info, links)).first;
      }
      auto h = headers.find(file);
      if (h == headers.end()) {
        // The header's bytes are checked before they are trusted: its 8-byte length first.
        cf->second->verify(0, 8, "its header");
        uint64_t hlen = 0;
        HP_CHECK(::pread(cf->second->fd(), &hlen, 8, 0) == 8, "ckpt::load: '", file, "' is shorter than a header");
        cf->second->verify(8, static_cast<int64_t>(std::min<uint64_t>(hlen, uint64_t(1) << 40)), "its header");
        h = headers.emplace(file, read_header(file)).first;
      }
      const TensorEntry* e = h->second.find(c["key"].get<std::string>());
      HP_CHECK(e != nullptr && e->shape == chunk.lengths && dtype_string(e->dtype) == saved_dtype, "ckpt::load: '",
               file, "' lacks the chunk '", c["key"].get<std::string>(), "' its metadata lists");
      at::Tensor dst = it.local.dim() == 0 ? it.local.view({1}) : it.local;
      for (size_t d = 0; d < o.lengths.size(); ++d) {
        dst = dst.narrow(static_cast<int64_t>(d), o.offsets_in_b[d], o.lengths[d]);
      }
      // Straight into the item where the overlap is a contiguous part of it in the saved
      // dtype, else through a buffer (which a converting load casts from).
      const bool direct = dst.is_contiguous() && e->dtype == it.local.scalar_type();
      at::Tensor part = direct ? dst : at::empty(o.lengths, it.local.options().dtype(e->dtype));
      read_sub_box(*cf->second, file, "tensor " + called, h->second.data_start + e->begin, chunk.lengths,
                   o.offsets_in_a, o.lengths, static_cast<int64_t>(part.element_size()),
                   static_cast<char*>(part.data_ptr()));
      if (!direct) dst.copy_(part.view(dst.sizes()));
      int64_t n = 1;
      for (int64_t l : o.lengths) n *= l;
      covered += n;
    }
    HP_CHECK(covered == it.spec.numel(), "ckpt::load: tensor ", called, ": the saved chunks cover ", covered,
             " of the ", it.spec.numel(), " elements of this rank's box ", it.spec.to_string());
  }
}

}  // namespace detail

std::string committed_dir(const std::string& dir) {
  if (fs::exists(dir + "/metadata.json") || !fs::exists(dir + ".old/metadata.json")) return dir;
  return dir + ".old";
}

std::map<std::string, std::string> load(const std::vector<Item>& items, const std::string& saved) {
  const std::string dir = committed_dir(saved);
  const json meta = detail::read_metadata(dir);
  detail::load_boxes(items, dir, meta["tensors"], meta.contains("files") ? meta["files"] : json::object(),
                     /*convert=*/false, "the checkpoint");
  std::map<std::string, std::string> values;
  if (meta.contains("values")) values = meta["values"].get<std::map<std::string, std::string>>();
  return values;
}

void to_host(std::vector<Item>& items, bool copy) {
  for (auto& it : items) {
    if (!it.local.defined()) continue;
    if (!it.local.device().is_cpu()) {
      it.local = it.local.to(c10::kCPU);
    } else if (copy) {
      it.local = it.local.clone();
    }
  }
}

int format_version(const std::string& dir) {
  return detail::read_metadata(committed_dir(dir))["format"] == detail::kFormatV1 ? 1 : 2;
}

std::string upgrade(const std::string& dir, Storage& storage) {
  const std::string from = committed_dir(dir);
  json meta = detail::read_metadata(from);  // the schema checked, format 1 or 2
  if (meta["format"] == detail::kFormat) return "'" + from + "' is format 2 already: nothing to do";
  // Every data file a chunk reads, checksummed as it is.
  std::set<std::string> files;
  for (const auto& [name, t] : meta["tensors"].items()) {
    for (const auto& c : t["chunks"]) files.insert(c["file"].get<std::string>());
  }
  json fj = json::object();
  for (const std::string& f : files) {
    const std::string path = from + "/" + f;
    struct stat st{};
    HP_CHECK(::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), "upgrade of '", from, "': '", path,
             "' is missing or not a regular file (the checkpoint is damaged; nothing was changed)");
    fj[f] = file_checksums(path);
  }
  meta["files"] = fj;
  meta["format"] = detail::kFormat;
  if (!meta.contains("values")) meta["values"] = json::object();
  meta.erase("checksum");
  meta["checksum"] = std::to_string(detail::metadata_checksum(meta));
  write_atomically(storage, from + "/metadata.json", from + "/metadata.json.partial", meta.dump(1));
  storage.sync(from);
  return hp::detail::str_cat("upgraded '", from, "' to format 2: ", files.size(),
                             " data file(s) checksummed as they are now; loads check them from here on");
}

std::map<std::string, SavedTensor> saved_tensors(const std::string& dir) {
  const json meta = detail::read_metadata(committed_dir(dir));
  std::map<std::string, SavedTensor> out;
  for (const auto& [name, t] : meta["tensors"].items()) {
    out[name] = SavedTensor{t["dtype"].get<std::string>(), t["shape"].get<std::vector<int64_t>>()};
  }
  return out;
}

}  // namespace hp::ckpt
