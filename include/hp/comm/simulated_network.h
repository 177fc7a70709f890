// A simulated network: a measuring tool for machines whose real links are not the ones
// being studied (these 2-core machines move bytes through shared memory, with the CPU).
//
// With it, every op of a communicator runs for real and then its completion is held until
// the time a modelled link would need, counted from when the op started:
//
//   alpha + bus factor x bytes / bandwidth
//
// with the bus factor of a ring collective over n ranks: all_gather (bytes: the output)
// and reduce_scatter (the input) (n-1)/n, all_reduce 2(n-1)/n, all_to_all (n-1)/n of the
// input, broadcast, send and recv 1, batch_send_recv the larger of its sent and received
// bytes, barrier alpha alone; ops of a group of one take no time. An op that really took
// longer (a late peer) is not held further. The hold sleeps, so it takes no CPU from
// compute. A group whose ranks sit on one simulated node uses the intra-node link, one
// spanning nodes the inter-node link (rank r is on node r / ranks_per_node).
//
// Enabled by HP_SIM_NET or InitOptions::world.simulated_network (CommOptions), never by
// default. The trace records each op's modelled and real duration ("model_us", "real_us").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/ops.h"

namespace hp {

struct LinkModel {
  double alpha_us = 0;        // latency of one op, microseconds
  double gbytes_per_s = 0;    // bandwidth, 1e9 bytes per second
};

struct SimulatedNetwork {
  LinkModel intra;
  LinkModel inter;
  int ranks_per_node = 0;  // 0: every rank on one node (only the intra link is used)

  // "ALPHA_US:GB_PER_S" (every rank on one node), or
  // "ALPHA_US:GB_PER_S,INTER_ALPHA_US:INTER_GB_PER_S:RANKS_PER_NODE"; for example
  // "5:100,10:12.5:4" (8 ranks as 2 nodes of 4: 100 GB/s inside a node, 12.5 across).
  // Raises hp::Error naming the spec and the part that is wrong.
  static SimulatedNetwork parse(const std::string& spec);
  std::string to_string() const;

  // Whether the group of these world ranks spans simulated nodes.
  bool spans_nodes(const std::vector<int>& world_ranks) const;
  // Modelled seconds of `op` moving `bytes` (as above) over a group of n ranks on the given
  // link (new_group has no model: raises).
  static double seconds(CommOp op, int64_t bytes, int n, const LinkModel& link);
};

// What a layer's estimator says it issues (ep::dispatch_traffic, ...): `count` ops of `op`
// over groups of `ranks`, each of `bytes` as SimulatedNetwork::seconds takes them (an
// all_gather's output, a reduce_scatter's or all_to_all's input, an all_reduce's, a
// broadcast's or a send's tensor). The planner times them; each layer's test checks them
// against what its runtime's communicator counts.
struct CollectiveCost {
  CommOp op = CommOp::kAllReduce;
  double bytes = 0;
  int ranks = 1;
  double count = 1;
};
// The bytes one rank sends for them, as Communicator::traffic() counts them (the
// bandwidth-optimal algorithms' shares: all_gather, reduce_scatter and broadcast (n-1)/n,
// all_reduce 2(n-1)/n, all_to_all (n-1)/n with its rows split evenly, send all of them);
// raises for an op without a share of its own (recv, batch_send_recv, barrier, split).
double bytes_sent(const CollectiveCost& c);
double bytes_sent(const std::vector<CollectiveCost>& cs);
// The ops of them all.
double op_count(const std::vector<CollectiveCost>& cs);
// Their modelled seconds on `link`: count x SimulatedNetwork::seconds(op, bytes, ranks),
// summed in order.
double seconds(const std::vector<CollectiveCost>& cs, const LinkModel& link);

}  // namespace hp
