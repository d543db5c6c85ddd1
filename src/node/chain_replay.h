// Receivers that join late or fall behind replay a versioned delta chain
// (src/transport/s3/s3_chain.h).
//
// A receiver bootstraps by replaying the active chain (or only the deltas after the version it
// holds, when its state fingerprint matches that version's) through a ReceiverSession, so every
// payload is verified, applied atomically and rolled back on failure, and the final state
// fingerprint is checked against the index. A live receiver that fell behind replays the deltas
// it missed through its own session (CatchUpFromChain), as `refit serve --bootstrap` does when a
// prepare finds it behind.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string_view>

#include "receiver/receiver_session.h"
#include "refit/status.h"
#include "refit/weight_store.h"
#include "transport/s3/s3_chain.h"

namespace refit {

/// Options of BootstrapFromChain.
struct ChainBootstrapOptions {
  /// The session that replays the chain (its limits bound what a payload may be).
  ReceiverSessionOptions session;
  /// How long one version's payloads may take to apply after they are staged.
  std::chrono::milliseconds version_timeout{std::chrono::minutes(10)};
  /// Called after each version is committed (for progress reports), with that version.
  std::function<void(const ChainVersion&)> on_version;
};

/// Bring `store` to the newest committed version of the chain `s3_uri` names: replay the active
/// chain from its anchor, or only the deltas after the store's version when the store holds a
/// version of the active chain with the recorded state fingerprint. Each payload is downloaded,
/// its checksum (and MAC, with a key) verified before anything decodes it, then staged, applied
/// and verified by a ReceiverSession made for the replay; each version's state fingerprint must
/// match the index. The store must not be in use by another session.
/// Errors: NotFound (no index, an empty chain, a missing payload object); DataLoss (a checksum,
/// size or state fingerprint mismatch: the version is rolled back and the store stays at the
/// last version that verified); PermissionDenied (a missing or wrong MAC); FailedPrecondition
/// (the store's tensors do not match the chain's, as the session reports); those of the S3
/// requests.
Result<ChainBootstrapReport> BootstrapFromChain(std::string_view s3_uri, WeightStore& store,
                                                const ChainBootstrapOptions& options = {});

/// Bring a live receiver that fell behind to `target_version` by replaying, through its own
/// `session`, the chain's deltas after the version it holds (which must be a version of the
/// active chain with the recorded state fingerprint; `store` is the session's store, read for
/// its digests). Every payload and version is verified as by BootstrapFromChain. The session
/// must be idle, and nothing else may drive it meanwhile.
/// Errors: FailedPrecondition (a transfer is open; the receiver's state is not a version of the
/// active chain: restart it with --bootstrap); NotFound (the chain does not reach
/// target_version yet); those of BootstrapFromChain.
Result<ChainBootstrapReport> CatchUpFromChain(std::string_view s3_uri,
                                              internal::ReceiverSession& session,
                                              const WeightStore& store, uint64_t target_version,
                                              const ChainBootstrapOptions& options = {});

}  // namespace refit
