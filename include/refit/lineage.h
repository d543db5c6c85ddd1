// Lineage: which trainer run a version belongs to, so that a receiver never lets a second trainer
// (or one restarted without resuming its run) publish a version number it already holds under
// other contents (docs/protocol.md, "Lineage and fencing").
//
//   run id       chosen once per training run (PublisherOptions::run_id, or random at a fresh
//                start); a receiver holds the run of the last transfer it committed
//   epoch        a fencing token: a trainer that restarts and resumes its run takes the highest
//                epoch the fleet has seen + 1; once a receiver has seen epoch e of a run it
//                refuses every transfer of that run from an epoch below e (a zombie trainer)
//   fingerprint  StateFingerprint of the canonical state digests at a version: what a delta's
//                base must match, so a version number never names two contents on one receiver
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "refit/status.h"

namespace refit {

/// The lineage a transfer states in its Prepare (PrepareRequest::lineage).
struct TransferLineage {
  /// The trainer run; empty: the coordinator states no lineage (one older than lineages, or a
  /// Coordinator given no run id), which only a receiver that holds no lineage accepts.
  std::string run_id;
  /// The trainer's epoch of that run (0 for a run's first trainer, +1 at each resume).
  uint64_t epoch = 0;
  /// The StateFingerprint of the state the transfer's base version has on the producers; 0:
  /// not stated (an anchor, a folded catch-up, or a trainer that does not know it, e.g. W > 1
  /// ranks restarted from a checkpoint). A receiver holding that version with another known
  /// fingerprint refuses the delta.
  uint64_t base_fingerprint = 0;

  friend bool operator==(const TransferLineage&, const TransferLineage&) = default;
};

/// The lineage a receiver holds with its committed version: persisted with the version (the
/// model file's metadata, LineageMetadata) and reported in its status.
struct HeldLineage {
  /// The run of the last transfer committed; empty: none (a receiver that loaded a checkpoint
  /// without lineage metadata and committed no transfer stating one accepts any run).
  std::string run_id;
  /// The highest epoch of that run seen, at a Prepare this receiver accepted: the fence.
  uint64_t epoch = 0;
  /// The StateFingerprint of the canonical digests of the version held, as the coordinator
  /// declared and this receiver verified at the Flush that committed it; 0: unknown.
  uint64_t fingerprint = 0;

  friend bool operator==(const HeldLineage&, const HeldLineage&) = default;
};

/// Safetensors metadata keys a model file records its lineage under, beside
/// kWeightVersionMetadataKey (refit/safetensors.h): the run id, the epoch (decimal) and the
/// fingerprint (16 hex digits).
inline constexpr const char* kLineageRunMetadataKey = "refit.run_id";
inline constexpr const char* kLineageEpochMetadataKey = "refit.epoch";
inline constexpr const char* kLineageFingerprintMetadataKey = "refit.fingerprint";

/// Return `lineage` as metadata entries (none for an empty run id and a zero fingerprint).
std::map<std::string, std::string> LineageMetadata(const HeldLineage& lineage);

/// Read the lineage recorded in a model file's metadata; a file without the keys holds none.
/// Errors: InvalidArgument naming the key and its value when an epoch or fingerprint does not
/// parse. (A fingerprint without a run id is valid: a version of a coordinator that states no
/// lineage.)
Result<HeldLineage> LineageFromMetadata(const std::map<std::string, std::string>& metadata);

/// Describe `lineage` for errors and logs: "run 'r' epoch e" or "no lineage".
std::string DescribeLineage(const HeldLineage& lineage);

}  // namespace refit
