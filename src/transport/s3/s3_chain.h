// Versioned delta chains in an object store, for receivers that join late or fall behind.
//
// With `chain=1` on an s3:// URI, the trainer keeps each committed transfer's payloads instead of
// deleting them, under <prefix>/chain/, and records it in one small index object,
// <prefix>/chain/index.json, written after every payload of the version is stored and the fleet
// has committed it — so a reader never sees a half-written version:
//
//   {"format": "refit-chain/1",
//    "versions": [{"version": 7, "base_version": 6, "anchor": true, "transfer_id": hex32,
//                  "state_fingerprint": hex16,
//                  "payloads": [{"key", "producer_id", "payload_id", "size", "checksum": hex32,
//                                "mac": hex64 (with a MAC key)}, …]},
//                 {"version": 8, "base_version": 7, "anchor": false, …}, …],
//    "mac": hex64 (with a MAC key: HMAC-SHA256 over the index without this field)}
//
// Versions are contiguous from the first anchor: each delta's base is the version before it.
// The *active chain* is the newest anchor and every delta after it; older versions are pruned
// past a retention, whole chains at a time (a delta is useless without its anchor), never the
// active one. Receivers replay a chain through a ReceiverSession (src/node/chain_replay.h).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "refit/chain_version.h"
#include "refit/payload.h"
#include "refit/status.h"

namespace refit {

/// The index object of a chain: its versions, oldest first.
struct ChainIndex {
  std::vector<ChainVersion> versions;

  /// The newest anchor's position in `versions`, or versions.size() when there is none.
  size_t ActiveAnchor() const;

  friend bool operator==(const ChainIndex&, const ChainIndex&) = default;
};

/// Serialize `index` as the index object's JSON; with a non-empty `mac_key`, append its MAC.
std::string SerializeChainIndex(const ChainIndex& index, std::string_view mac_key);

/// Parse an index object (untrusted). With a non-empty `mac_key` the index must carry a MAC that
/// verifies (constant-time compare). `where` names the object in errors.
/// Errors: DataLoss (malformed JSON, missing or mistyped fields, versions out of order or not
/// contiguous, a delta before any anchor); PermissionDenied (a missing or wrong MAC).
Result<ChainIndex> ParseChainIndex(std::string_view text, std::string_view mac_key,
                                   std::string_view where);

/// Append `version` to `index`. An anchor may follow anything (it restarts the chain); a delta
/// must be based on the newest version. Errors: FailedPrecondition for a delta that is not.
Status AppendChainVersion(ChainIndex& index, ChainVersion version);

/// Remove from `index` the versions that retention no longer needs and return them (their
/// objects are then deleted): every version older than the anchor at or before the
/// `retain_versions`-th newest version. The active chain is always kept; retain_versions = 0
/// keeps only it.
std::vector<ChainVersion> PruneChain(ChainIndex& index, uint64_t retain_versions);

/// Read the index of the chain an s3:// URI names (the same URI the trainer and receivers
/// use). Errors: NotFound when the chain has no index yet; those of ParseChainIndex and of the
/// S3 requests; InvalidArgument for a URI that is not s3:// or not valid.
Result<ChainIndex> ReadChainIndex(std::string_view s3_uri);

}  // namespace refit
