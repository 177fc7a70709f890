// Collective agreement idioms over a communicator: whether every rank succeeded, and
// whether every rank holds the same values. Each is one or two small all-reduces on the
// communicator's device, and must be called by every rank of it.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "hp/comm/communicator.h"

namespace hp {

// comm->control_device(): where `comm` moves small control values (the CPU, or for nccl
// its GPU).
c10::Device control_device(const CommPtr& comm);

// The lowest rank of `comm` whose `ok` is false, or -1 when every rank is ok.
int first_failed_rank(const CommPtr& comm, bool ok);

// Returns on every rank when every rank's `error` is empty; else raises hp::Error on every
// rank: a rank's own error where it has one, "<what> failed on rank R (its error says
// why)" on the others (R the lowest failing rank).
void raise_if_any_failed(const CommPtr& comm, const std::string& error, const std::string& what);

// Whether `values` (any integral dtype, the same shape on every rank) is elementwise equal
// on every rank of `comm` (the elementwise MAX equals the MIN); `max` and `min`, when given,
// receive those (to find where ranks differ).
bool all_ranks_equal(const CommPtr& comm, const at::Tensor& values, at::Tensor* max = nullptr,
                     at::Tensor* min = nullptr);

// `text` as rank `root` holds it, on every rank of `comm` (two broadcasts: its length, then
// its bytes). What one rank decided that every rank must do alike.
std::string broadcast_text(const CommPtr& comm, const std::string& text, int root);

}  // namespace hp
