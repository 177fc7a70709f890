// Fuzzes the reading of a checkpoint's metadata.json (hp::ckpt::detail::read_metadata: the
// parse, format, checksum and schema check that load(), saved_tensors() and the consolidated
// import start from). The input is the file's contents, read twice: as given (a damaged file,
// whose checksum rarely matches) and, where it parses to a JSON object, again with a correct
// checksum (a consistent file as a tool could write, so that the schema check is what must
// refuse a bad value). A document it accepts is then read with the accessors the loader uses
// on it (which trust the schema check): a json exception escaping them is a finding.
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "ckpt/reader.h"
#include "fuzz_util.h"
#include "hp/ckpt/checkpoint.h"

namespace {

using json = nlohmann::json;

// What load(), load_boxes() and saved_tensors() read of an accepted document.
void read_as_the_loader_does(const json& meta) {
  if (meta.contains("values")) (void)meta["values"].get<std::map<std::string, std::string>>();
  if (meta.contains("files")) {
    for (const auto& [name, info] : meta["files"].items()) {
      if (info.is_null()) continue;  // format 1: a file without checksums
      (void)info["bytes"].get<int64_t>();
      (void)info["block"].get<int64_t>();
      for (const auto& c : info["checksums"]) (void)std::stoull(c.get<std::string>());
    }
  }
  for (const auto& [name, t] : meta["tensors"].items()) {
    (void)t["dtype"].get<std::string>();
    const auto shape = t["shape"].get<std::vector<int64_t>>();
    for (const auto& c : t["chunks"]) {
      (void)c["file"].get<std::string>();
      (void)c["key"].get<std::string>();
      const auto offsets = c["offsets"].get<std::vector<int64_t>>();
      const auto lengths = c["lengths"].get<std::vector<int64_t>>();
      if (offsets.size() != shape.size() || lengths.size() != shape.size()) {
        hp::fuzz::finding("an accepted chunk's box does not have the tensor's rank");
      }
      for (size_t d = 0; d < shape.size(); ++d) {
        if (offsets[d] < 0 || lengths[d] < 1 || offsets[d] + lengths[d] > shape[d]) {
          hp::fuzz::finding("an accepted chunk's box runs outside its tensor");
        }
      }
    }
  }
}

void read_file(const std::string& dir, const std::string& path) {
  hp::fuzz::expect_clean([&] { read_as_the_loader_does(hp::ckpt::detail::read_metadata(dir)); }, path);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return -1;  // a checkpoint of a few hundred tensors; 1 MiB reaches deep nesting
  const std::string dir = hp::fuzz::scratch_dir();
  const std::string path = dir + "/metadata.json";
  hp::fuzz::write_file(path, data, size);
  read_file(dir, path);
  // The same document with the checksum it should carry (any value in its place: the loader
  // reads "checksum" before the schema).
  json meta;
  try {
    meta = json::parse(data, data + size);
  } catch (const std::exception&) {
    return 0;  // not JSON: the read above refused it
  }
  if (!meta.is_object()) return 0;
  std::string text;
  try {
    meta["checksum"] = std::to_string(hp::ckpt::detail::metadata_checksum(meta));
    text = meta.dump(1);
  } catch (const std::exception&) {
    return 0;  // not UTF-8 throughout: no checksum can be written for it
  }
  hp::fuzz::write_file(path, reinterpret_cast<const uint8_t*>(text.data()), text.size());
  read_file(dir, path);
  return 0;
}
