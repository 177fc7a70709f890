// The local backend: a world of one rank, without MPI. Every collective is a copy.
#include <cstring>

#include "hp/core/error.h"
#include "transport.h"

namespace hp::detail {
namespace {

void copy_bytes(const at::Tensor& out, const at::Tensor& in) {
  if (out.data_ptr() != in.data_ptr() && in.nbytes() > 0) {
    std::memcpy(out.data_ptr(), in.data_ptr(), in.nbytes());
  }
}

class LocalTransport final : public Transport {
 public:
  std::string backend() const override { return "local"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<int> world_ranks() const override { return {0}; }
  bool supports_device(const c10::Device& d) const override { return d.is_cpu(); }

  void all_gather(const at::Tensor& out, const at::Tensor& in) override { copy_bytes(out, in); }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp) override {
    copy_bytes(out, in);
  }
  void all_reduce(const at::Tensor&, ReduceOp) override {}
  void broadcast(const at::Tensor&, int) override {}
  void all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>&,
                  const std::vector<int64_t>&, bool) override {
    copy_bytes(out, in);
  }
  void send(const at::Tensor&, int, int) override {
    HP_INTERNAL_ASSERT(false, "send on a world of one rank passed validation");
  }
  void batch_send_recv(const std::vector<P2POp>&) override {
    HP_INTERNAL_ASSERT(false, "batch_send_recv on a world of one rank passed validation");
  }
  void recv(const at::Tensor&, int, int) override {
    HP_INTERNAL_ASSERT(false, "recv on a world of one rank passed validation");
  }
  void barrier() override {}
  std::unique_ptr<Transport> split(int color, int) override {
    if (color < 0) return nullptr;
    return std::make_unique<LocalTransport>();
  }
  std::unique_ptr<Transport> create_group(const std::vector<int>&) override {
    return std::make_unique<LocalTransport>();
  }
};

}  // namespace

std::unique_ptr<Transport> make_local_transport() { return std::make_unique<LocalTransport>(); }

}  // namespace hp::detail
