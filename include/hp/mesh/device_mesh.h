// hp::DeviceMesh: an N-D arrangement of the world's ranks with named dims.
//
// Ranks are laid out row-major: with dims (pp=2, dp_replicate=2, dp_shard=2) rank
// 5 = 1*4 + 0*2 + 1 has coordinates (1, 0, 1). One dim may have size -1, meaning
// "whatever remains" (world size / product of the others). The mesh creates, collectively
// at construction, a sub-communicator for every dim and every combination of dims; a
// combination's ranks are ordered row-major over its dims (in mesh order).
// MeshLayout is the pure part (sizes, coordinates, groups) and needs no ranks.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "hp/comm/communicator.h"

namespace hp {

struct MeshDim {
  std::string name;
  int64_t size;  // > 0, or -1 for "the rest"
};

class MeshLayout {
 public:
  // Validates the dims against the world size and resolves a -1.
  MeshLayout(std::vector<MeshDim> dims, int world_size);

  int ndim() const { return static_cast<int>(names_.size()); }
  int world_size() const { return world_size_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  int64_t size(const std::string& dim) const { return sizes_[index_of(dim)]; }
  // Raises for a name that is not a dim of this mesh.
  int index_of(const std::string& dim) const;

  std::vector<int64_t> coordinates(int rank) const;
  int rank_at(const std::vector<int64_t>& coords) const;
  // Dim indices in mesh order for a set of names (raises on unknown or repeated names).
  std::vector<int> dims_of(const std::vector<std::string>& dims) const;
  // World ranks of `rank`'s group over `dims`, row-major over those dims.
  std::vector<int> group_ranks(int rank, const std::vector<std::string>& dims) const;
  // Which group of the given dims `rank` belongs to (ranks sharing the other coordinates).
  int group_index(int rank, const std::vector<std::string>& dims) const;
  // `rank`'s position within that group.
  int rank_in_group(int rank, const std::vector<std::string>& dims) const;

 private:
  std::vector<std::string> names_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int world_size_;
};

class DeviceMesh {
 public:
  // Collective over `world`: every rank constructs the mesh with the same dims.
  DeviceMesh(CommPtr world, std::vector<MeshDim> dims);
  // A view over communicators made already (flattened dims of a larger mesh, say): `groups`
  // holds one communicator per dim, in `dims`' order, and `whole` spans them all, its ranks
  // row-major over the dims. Not collective. group() answers one dim or all of them; another
  // combination raises.
  DeviceMesh(CommPtr whole, std::vector<MeshDim> dims, std::vector<CommPtr> groups);

  const MeshLayout& layout() const { return layout_; }
  int ndim() const { return layout_.ndim(); }
  const std::vector<std::string>& names() const { return layout_.names(); }
  int64_t size(const std::string& dim) const { return layout_.size(dim); }
  int64_t size() const { return layout_.world_size(); }
  int64_t coordinate(const std::string& dim) const { return coords_[layout_.index_of(dim)]; }
  const std::vector<int64_t>& coordinates() const { return coords_; }
  int rank() const { return world_->rank(); }

  // The communicator over one dim, or over a combination of dims (any order of names).
  CommPtr group(const std::string& dim) const;
  CommPtr group(const std::vector<std::string>& dims) const;
  CommPtr group(std::initializer_list<std::string> dims) const {
    return group(std::vector<std::string>(dims));
  }
  const CommPtr& world() const { return world_; }

 private:
  CommPtr world_;
  MeshLayout layout_;
  std::vector<int64_t> coords_;
  std::map<std::vector<int>, CommPtr> groups_;  // keyed by dim indices in mesh order
};

}  // namespace hp
