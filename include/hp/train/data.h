// Training data for hp-train: token samples and their split over data-parallel ranks.
//
// A dataset is a fixed number of samples of seq_length + 1 tokens (inputs and the
// next-token targets). Three sources:
//   synthetic: a learnable corpus built from the seed. Each sample walks a fixed random
//              Markov chain in which every token has 4 possible successors (one of them
//              taken half the time), so the loss falls from ln(vocab) toward ~1.2 nats.
//   binary:    a file of uint16 or uint32 token ids; sample i is tokens
//              [i * seq_length, i * seq_length + seq_length + 1).
//   text:      a UTF-8 text file; each byte is a token (byte-level tokenizer), sampled as
//              binary.
//   megatron:  Megatron-LM's indexed dataset (PREFIX.bin and PREFIX.idx, as its
//              preprocess_data.py writes them); the documents, stored back to back in the
//              .bin, are sampled as one binary stream in the index's token dtype (uint8,
//              uint16, int32 or int64). The index is checked against the .bin at open:
//              header, version, dtype, sizes, each sequence's pointer and the document
//              index.
// The validation set (eval_interval > 0) is data.valid_path of the same type, or for
// synthetic data samples held out of the same corpus; an evaluation reads its first
// batches in order (DataSharder without shuffle), the same ones every time.
// Files are checked when opened: size, every token < vocab, valid UTF-8, at least one
// sample; errors name the file and the offending offset and value.
//
// DataSharder walks an endless stream of sample positions: epoch e is a permutation of
// all samples (seeded by (seed, e), computed per position without storing it; the
// identity without shuffle), and step s consumes
// positions [s * G, (s + 1) * G) for G = global_batch_size. Within a step, position
// j * (dp * m) + r * m + i belongs to micro-batch j of data-parallel rank r (m samples per
// micro-batch), so the concatenation of every rank's micro-batch j is micro-batch j of a
// single process running the global batch, and each sample is seen exactly once per epoch
// across all ranks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/train/config.h"

namespace hp::train {

class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  virtual int64_t size() const = 0;  // samples
  // Writes sample `index`'s seq_length + 1 tokens to `out`.
  virtual void read(int64_t index, int64_t* out) const = 0;
  virtual std::string describe() const = 0;
};

std::unique_ptr<TokenDataset> make_dataset(const DataSpec& spec, int64_t seq_length, int64_t vocab,
                                           uint64_t seed);
// The validation set of a validated config with eval_interval > 0: data.valid_path read as
// data.type (its errors name data.valid_path), or for synthetic data eval_steps x
// global_batch_size samples held out of the same corpus (those after its num_samples: the
// same chain, never trained on).
std::unique_ptr<TokenDataset> make_validation_dataset(const TrainConfig& c);
// The global batches one evaluation runs: eval_steps, or with eval_steps 0 all the whole
// batches `valid` holds (a last partial one is left out). Raises naming the sizes when it
// holds fewer samples than that needs (or than one batch).
int64_t validation_batches(const TrainConfig& c, const TokenDataset& valid);

class DataSharder {
 public:
  DataSharder(int64_t num_samples, int64_t global_batch_size, int64_t micro_batch_num, int64_t dp_size,
              uint64_t seed, bool shuffle);
  // The sample at stream position p.
  int64_t sample_at(int64_t position) const;
  // Sample indices of data-parallel rank `dp_rank`'s micro-batch `micro` at step `step`.
  std::vector<int64_t> samples(int64_t step, int64_t micro, int64_t dp_rank) const;
  // The whole micro-batch `micro` of step `step` over all ranks (rank 0's samples first).
  std::vector<int64_t> global_samples(int64_t step, int64_t micro) const;
  int64_t micro_batch_size() const { return m_; }

 private:
  int64_t n_, g_, mb_num_, dp_, m_;
  uint64_t seed_;
  bool shuffle_;
};

// [samples, seq_length + 1] int64 tokens of the given samples.
at::Tensor load_batch(const TokenDataset& d, const std::vector<int64_t>& samples, int64_t seq_length);

}  // namespace hp::train
