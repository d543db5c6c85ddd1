// The versions of a delta chain in an object store (s3:// with chain=1) as a receiver replays
// them to catch up: each version's payloads, and what a bootstrap replayed
// (ReceiverNodeOptions::on_bootstrap_version, ReceiverNode::bootstrap_report). The chain itself
// and its replay are internal (src/transport/s3/s3_chain.h, src/node/chain_replay.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "refit/payload.h"

namespace refit {

/// One payload object of a chain version.
struct ChainPayload {
  std::string key;
  uint32_t producer_id = 0;
  uint32_t payload_id = 0;
  uint64_t size = 0;
  /// XXH3-128 of the whole object.
  std::array<uint8_t, 16> checksum{};
  /// HMAC-SHA256 of the whole object under the chain's MAC key, as 64 hex digits; empty
  /// without a key.
  std::string mac;

  friend bool operator==(const ChainPayload&, const ChainPayload&) = default;
};

/// One committed version of a chain.
struct ChainVersion {
  uint64_t version = 0;
  uint64_t base_version = 0;
  bool anchor = false;
  TransferId transfer_id;
  /// StateFingerprint of every tensor's state digest at `version`.
  uint64_t state_fingerprint = 0;
  /// In (producer_id, payload_id) order.
  std::vector<ChainPayload> payloads;

  friend bool operator==(const ChainVersion&, const ChainVersion&) = default;
};

/// What a bootstrap from a chain replayed (ReceiverNode::bootstrap_report).
struct ChainBootstrapReport {
  /// The store's version before and after.
  uint64_t start_version = 0;
  uint64_t final_version = 0;
  /// The versions replayed (0 when the store already held the newest version), starting with
  /// an anchor unless the store held a version of the active chain.
  uint64_t versions_replayed = 0;
  bool replayed_anchor = false;
  uint64_t payloads = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};

}  // namespace refit
