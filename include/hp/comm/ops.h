// The names of a Communicator's ops and reductions: the enums every layer passes instead of
// strings (errors, traces and Work::op() print them through to_string).
#pragma once

namespace hp {

enum class ReduceOp { SUM, AVG, MAX, MIN };
const char* to_string(ReduceOp op);

enum class CommOp {
  kAllGather, kReduceScatter, kAllReduce, kBroadcast, kAllToAll, kSend, kRecv, kBatchSendRecv, kBarrier,
  kSplit, kNewGroup
};
const char* to_string(CommOp op);
// Whether every rank of the communicator runs the op (not point-to-point, not new_group,
// which only the listed ranks call).
bool is_collective(CommOp op);

}  // namespace hp
