// A receiver that joins the fleet copies the state of a peer that holds the fleet's version
// instead of asking the trainer for an anchor (docs/protocol.md "Per-receiver plans": a peer
// replica). The trainer's links then carry only the fleet's delta; the newcomer is current, or a
// version behind and folded in at the next sync.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "refit/status.h"
#include "refit/weight_store.h"

namespace refit::internal {

/// Options of BootstrapFromPeer.
struct PeerBootstrapOptions {
  /// The peer's control-plane key (the fleet's).
  std::string api_key;
  /// Limit of each control call (status, one tensor's download per connect/read/write).
  std::chrono::milliseconds call_timeout{std::chrono::seconds(60)};
  /// Copies to try before giving up when the peer commits a new version (or reads mid-transfer)
  /// while it is being copied.
  int attempts = 3;
};

/// What BootstrapFromPeer did.
struct PeerBootstrapReport {
  std::string peer;
  uint64_t start_version = 0;
  uint64_t final_version = 0;
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  int attempts = 0;
  double seconds = 0;
  /// The peer's tensors were canonical ones written through this store's loader (another layout
  /// than the peer's), not its local tensors copied as they are.
  bool canonical = false;
};

/// Bring `store` to the version the receiver at `peer_url` (its control URL) holds, by copying
/// its tensors (GET /v1/tensors lists them with their digests; GET /v1/tensors/{name} downloads
/// one, checked against its digest). Two ways:
/// - **local**: the peer holds the same tensors as the store (names, dtypes, shapes: without a
///   loader, or with the same loader spec and rank as the peer's, whose local tensors these are):
///   each is copied as it is, and the store's canonical piece digests are recomputed from the
///   copied bytes;
/// - **canonical**: the store has a loader and holds other tensors than the peer, whose tensors
///   are then canonical ones (a peer without a loader): each tensor the loader places is
///   downloaded whole and written through the loader as an anchor's FULL items are (a TP shard
///   of any rank, fused qkv / gate_up, expert stacks); the tensors it skips are not downloaded.
///   Before any download, every peer tensor must be one the loader knows with the peer's dtype and
///   shape, and every local tensor must be built from at least one of them (FailedPrecondition
///   naming the tensor). A sharded peer cannot serve it: its tensors are not canonical.
/// The copy is verified as a whole before anything is written: the state fingerprint of what was
/// listed (and each download's digest) must equal the one the peer reports, idle, at that version
/// before and after the download — so a copy that straddled one of the peer's transfers is refused
/// and tried again. The store is written only when that holds (it needs the copied tensors' size
/// in memory meanwhile) and then set to the peer's version; otherwise it is left untouched. A
/// store that already holds the peer's state is not written. Device tensors are not supported
/// (FailedPrecondition naming one).
/// Errors: InvalidArgument (peer_url); FailedPrecondition (the tensor sets differ, naming the
/// tensor and both descriptions; a device tensor); Unavailable (the peer could not be reached, or
/// its state kept moving, for every attempt); NotFound (a tensor the peer lacks); those of the
/// control calls (PermissionDenied, DataLoss).
Result<PeerBootstrapReport> BootstrapFromPeer(std::string_view peer_url, WeightStore& store,
                                              const PeerBootstrapOptions& options = {});

}  // namespace refit::internal
