// Muon's named choices (hp/optim/muon.h), apart so that a config can hold them without
// libtorch's optimizer headers.
#pragma once

namespace hp::optim {

// The coefficient schedules. For singular values of D / |D|_F in [0.01, 1] they leave the
// output's singular values in (tested): kQuintic [0.68, 1.14]; kPerStep [0.97, 1.04];
// kDeepSeekV4 [0.999, 1.001].
enum class NsSchedule {
  kQuintic,     // (3.4445, -4.7750, 2.0315) every step, 5 steps by default
  kPerStep,     // five steps, each with its own tuned triple (the seed system's)
  kDeepSeekV4,  // 8 steps of kQuintic's triple, then 2 of (2, -1.5, 0.5), which fixes 1
};

// The update scale s(A, B) of an A x B matrix. The factor between them is
// rms_target sqrt(max(A, B)) / sqrt(max(1, A / B)): 0.2 sqrt(1024) = 6.4 against sqrt(2) =
// 1.414 for 1024 x 512, 4.5x; a learning rate tuned under one is that far off under the other.
enum class MuonScale {
  kRms,       // rms_target sqrt(max(A, B)): the update's RMS is rms_target (about AdamW's, 0.2:
              // Moonlight's "match AdamW", so that AdamW's lr and weight decay carry over). Default.
  kOriginal,  // sqrt(max(1, A / B)) (Muon's first form, PyTorch's torch.optim.Muon "original")
};

// How the whole matrices of a distributed Muon are orthogonalized.
enum class MuonScheme {
  // One rank per matrix, among those holding pieces of it, balanced by the iteration's cost
  // per step (s^2 x (2 l + s), s and l the smaller and larger dim): the pieces go to the owner
  // (one all-to-all), the owner runs the iteration (same-shape matrices as one batch) and
  // sends each holder its box of the result (a second all-to-all). Each matrix is
  // orthogonalized once in the whole job, replicas included.
  kOwner,
  // Every holder gathers every piece of its matrices and runs the iteration itself (one
  // all-to-all, every matrix orthogonalized by each of its holders): the baseline.
  kGatherEverywhere,
};

}  // namespace hp::optim
