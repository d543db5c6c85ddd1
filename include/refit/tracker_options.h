// How a producer rank tracks its baseline: where the committed bits live, when a transfer is an
// anchor, which op and location encoding delta items use, and the compare's threads. The options
// of PublisherOptions::tracker; the tracker itself is internal (src/codec/tracker.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "refit/compare_options.h"
#include "refit/dtype.h"
#include "refit/item.h"

namespace refit {

/// Where the tracker keeps baselines. Behaviour is identical; only memory accounting differs.
enum class BaselineStorage : uint8_t {
  /// Anonymous process memory.
  kMemory,
  /// An unlinked temporary file per tensor, mmapped shared: the kernel can write clean pages back
  /// instead of swapping, so a producer's RSS is not charged with the whole baseline.
  kFile,
};

/// Options of DeltaTracker::Make.
struct TrackerOptions {
  BaselineStorage baseline_storage = BaselineStorage::kMemory;
  /// Directory for kFile baselines.
  std::string baseline_dir = "/tmp";
  /// The first transfer is always an anchor (FULL). With N > 0, every transfer whose number of
  /// previously committed transfers is a multiple of N is an anchor too (the upstream rule:
  /// N = 20 → transfers 1, 21, 41, … are FULL). 0 = only the first.
  uint64_t full_sync_interval = 0;
  /// Force an anchor when the changed elements committed since the last anchor exceed this
  /// fraction of all baseline elements (for object-store chains, so late joiners replay a
  /// bounded chain). 0 = off.
  double max_drift_fraction = 0.0;
  /// The op of delta items: kXor (default), kOverwrite or kAdd.
  Op op = Op::kXor;
  /// The delta dtype of kAdd items. Tensors whose dtype cannot ADD (integers, FP8) use kOverwrite.
  DType add_delta_dtype = DType::kBFloat16;
  /// Tensors that always use kOverwrite in delta transfers (upstream `overwrite_names`).
  std::vector<std::string> overwrite_names;
  /// Pin a location encoding (tests); default: the smallest estimate per item.
  std::optional<LocationEncoding> force_location_encoding;
  /// Threads and kernel of the comparison inside one Encode call.
  CompareOptions compare;
  /// Threads that scatter a transfer's pending changes into the baseline at Commit, one tensor
  /// per thread at a time: Commit runs after every Encode, so these never compete with the
  /// encode workers. 1 to kMaxCommitThreads.
  int commit_threads = 4;
  static constexpr int kMaxCommitThreads = 256;
  /// The version the tracker starts at (the receivers' version before the first transfer).
  uint64_t initial_version = 0;
};

}  // namespace refit
