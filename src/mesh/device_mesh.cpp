#include "hp/mesh/device_mesh.h"

#include <algorithm>
#include <set>

#include "hp/core/error.h"

namespace hp {

MeshLayout::MeshLayout(std::vector<MeshDim> dims, int world_size) : world_size_(world_size) {
  HP_CHECK(!dims.empty(), "a DeviceMesh needs at least one dim");
  HP_CHECK(world_size >= 1, "world size ", world_size, " must be positive");
  std::set<std::string> seen;
  int rest = -1;
  int64_t known = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto& d = dims[i];
    HP_CHECK(!d.name.empty(), "mesh dim ", i, " has an empty name");
    HP_CHECK(seen.insert(d.name).second, "mesh dim name '", d.name, "' is used twice");
    HP_CHECK(d.size > 0 || d.size == -1, "mesh dim '", d.name, "' has size ", d.size,
             ": sizes must be positive, or -1 (one dim) for the rest of the world");
    if (d.size == -1) {
      HP_CHECK(rest < 0, "mesh dims '", dims[rest].name, "' and '", d.name,
               "' are both -1: only one dim may take the rest of the world");
      rest = static_cast<int>(i);
    } else {
      known *= d.size;
    }
  }
  std::string shape;
  for (const auto& d : dims) shape += (shape.empty() ? "" : ", ") + d.name + "=" + std::to_string(d.size);
  if (rest >= 0) {
    HP_CHECK(world_size % known == 0, "mesh (", shape, ") does not fit a world of ", world_size,
             " ranks: ", world_size, " is not divisible by ", known);
    dims[rest].size = world_size / known;
  } else {
    HP_CHECK(known == world_size, "mesh (", shape, ") has ", known, " ranks but the world has ",
             world_size);
  }
  for (const auto& d : dims) {
    names_.push_back(d.name);
    sizes_.push_back(d.size);
  }
  strides_.assign(sizes_.size(), 1);
  for (int i = static_cast<int>(sizes_.size()) - 2; i >= 0; --i) strides_[i] = strides_[i + 1] * sizes_[i + 1];
}

int MeshLayout::index_of(const std::string& dim) const {
  for (int i = 0; i < ndim(); ++i) {
    if (names_[i] == dim) return i;
  }
  std::string known;
  for (const auto& n : names_) known += (known.empty() ? "" : ", ") + n;
  HP_CHECK(false, "mesh has no dim named '", dim, "' (dims: ", known, ")");
  return -1;
}

std::vector<int64_t> MeshLayout::coordinates(int rank) const {
  HP_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " is not in the mesh of ",
           world_size_, " ranks");
  std::vector<int64_t> c(ndim());
  for (int i = 0; i < ndim(); ++i) c[i] = (rank / strides_[i]) % sizes_[i];
  return c;
}

int MeshLayout::rank_at(const std::vector<int64_t>& coords) const {
  HP_CHECK(static_cast<int>(coords.size()) == ndim(), "expected ", ndim(), " coordinates, got ",
           coords.size());
  int64_t r = 0;
  for (int i = 0; i < ndim(); ++i) {
    HP_CHECK(coords[i] >= 0 && coords[i] < sizes_[i], "coordinate ", coords[i], " of dim '",
             names_[i], "' is not in [0, ", sizes_[i], ")");
    r += coords[i] * strides_[i];
  }
  return static_cast<int>(r);
}

std::vector<int> MeshLayout::dims_of(const std::vector<std::string>& dims) const {
  HP_CHECK(!dims.empty(), "a mesh group needs at least one dim");
  std::vector<int> idx;
  for (const auto& d : dims) {
    int i = index_of(d);
    HP_CHECK(std::find(idx.begin(), idx.end(), i) == idx.end(), "mesh dim '", d,
             "' is named twice");
    idx.push_back(i);
  }
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int> MeshLayout::group_ranks(int rank, const std::vector<std::string>& dims) const {
  std::vector<int> idx = dims_of(dims);
  std::vector<int64_t> c = coordinates(rank);
  int64_t count = 1;
  for (int i : idx) count *= sizes_[i];
  std::vector<int> ranks;
  for (int64_t k = 0; k < count; ++k) {
    int64_t rem = k;
    for (int j = static_cast<int>(idx.size()) - 1; j >= 0; --j) {
      c[idx[j]] = rem % sizes_[idx[j]];
      rem /= sizes_[idx[j]];
    }
    ranks.push_back(rank_at(c));
  }
  return ranks;
}

int MeshLayout::group_index(int rank, const std::vector<std::string>& dims) const {
  std::vector<int> idx = dims_of(dims);
  std::vector<int64_t> c = coordinates(rank);
  int64_t g = 0;
  for (int i = 0; i < ndim(); ++i) {
    if (std::find(idx.begin(), idx.end(), i) != idx.end()) continue;
    g = g * sizes_[i] + c[i];
  }
  return static_cast<int>(g);
}

int MeshLayout::rank_in_group(int rank, const std::vector<std::string>& dims) const {
  std::vector<int> r = group_ranks(rank, dims);
  return static_cast<int>(std::find(r.begin(), r.end(), rank) - r.begin());
}

static const CommPtr& non_null(const CommPtr& c) {
  HP_CHECK(c != nullptr, "DeviceMesh needs a world communicator, got null");
  return c;
}

DeviceMesh::DeviceMesh(CommPtr world, std::vector<MeshDim> dims)
    : world_(non_null(world)), layout_(std::move(dims), world_->size()) {
  coords_ = layout_.coordinates(world_->rank());
  const int n = ndim();
  // Every non-empty subset of dims, in a fixed order on all ranks (split is collective).
  for (int mask = 1; mask < (1 << n); ++mask) {
    std::vector<std::string> names;
    std::vector<int> idx;
    std::string label;
    for (int i = 0; i < n; ++i) {
      if (mask & (1 << i)) {
        names.push_back(layout_.names()[i]);
        idx.push_back(i);
        label += (label.empty() ? "" : "+") + layout_.names()[i];
      }
    }
    if (mask == (1 << n) - 1) {
      groups_[idx] = world_;  // all dims: the world itself, in the same order
      continue;
    }
    int color = layout_.group_index(world_->rank(), names);
    int key = layout_.rank_in_group(world_->rank(), names);
    groups_[idx] = world_->split(color, key, CommOptions{world_->default_timeout(), label});
  }
}

DeviceMesh::DeviceMesh(CommPtr whole, std::vector<MeshDim> dims, std::vector<CommPtr> groups)
    : world_(non_null(whole)), layout_(std::move(dims), world_->size()) {
  HP_CHECK(static_cast<int>(groups.size()) == ndim(), "DeviceMesh view: ", groups.size(), " communicators for ", ndim(),
           " dims");
  for (int i = 0; i < ndim(); ++i) {
    const CommPtr& g = groups[static_cast<size_t>(i)];
    HP_CHECK(g != nullptr && g->size() == layout_.sizes()[i], "DeviceMesh view: dim '", layout_.names()[i], "' has size ",
             layout_.sizes()[i], " but its communicator ", g ? detail::str_cat("has ", g->size(), " ranks") : "is null");
    coords_.push_back(g->rank());
    groups_[{i}] = g;
  }
  HP_CHECK(layout_.rank_at(coords_) == world_->rank(), "DeviceMesh view: rank ", world_->rank(),
           " of the whole is not at its coordinates in the dims' communicators (not row-major over them)");
  std::vector<int> all(static_cast<size_t>(ndim()));
  for (int i = 0; i < ndim(); ++i) all[static_cast<size_t>(i)] = i;
  groups_[all] = world_;
}

CommPtr DeviceMesh::group(const std::string& dim) const {
  return group(std::vector<std::string>{dim});
}

CommPtr DeviceMesh::group(const std::vector<std::string>& dims) const {
  const auto it = groups_.find(layout_.dims_of(dims));
  HP_CHECK(it != groups_.end(), "this DeviceMesh is a view with a communicator per dim and one over all of them; it has "
           "none over the ", dims.size(), " dims asked for");
  return it->second;
}

}  // namespace hp
