#include "node/peer_bootstrap.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "core/digest.h"
#include "receiver/apply.h"
#include "refit/control_client.h"
#include "refit/loader.h"
#include "refit/payload.h"
#include "refit/status_format.h"
#include "util/logging.h"
#include "util/thread_pool.h"

namespace refit::internal {
namespace {

// Tensors downloaded at once (each on its own connection to the peer).
constexpr size_t kDownloadStreams = 4;
// A canonical copy is written through the loader as FULL items of at most this many bytes, in
// payloads of at most kCanonicalPayloadBytes: the memory it adds to the download's is bounded.
constexpr uint64_t kCanonicalItemBytes = uint64_t{64} << 20;
constexpr uint64_t kCanonicalPayloadBytes = uint64_t{256} << 20;
// Threads that write one canonical payload through the loader (one per group of local tensors).
constexpr int kCanonicalApplyThreads = 4;

// The peer's committed version and state fingerprint, read while it is idle (a prepared peer
// already holds the next version's bytes under the old version number).
struct PeerState {
  uint64_t version = 0;
  uint64_t fingerprint = 0;
};

Result<PeerState> IdleState(ControlClient& peer) {
  REFIT_ASSIGN_OR_RETURN(const ControlStatus status, peer.GetStatus());
  if (status.receiver.state != ReceiverState::kIdle) {
    return Unavailable("peer {} is {} (transfer {}): its state is not a committed version",
                       peer.base_url(), ReceiverStateName(status.receiver.state),
                       status.receiver.transfer_id.value_or(TransferId{}).ToHex());
  }
  if (!status.state_fingerprint.has_value()) {
    return FailedPrecondition("peer {} reports no state fingerprint (an older refit)",
                              peer.base_url());
  }
  return PeerState{status.receiver.version, *status.state_fingerprint};
}

Status CheckSameTensor(const TensorView& mine, const OwnedTensor& theirs, std::string_view peer) {
  if (mine.dtype != theirs.dtype || mine.shape != theirs.shape) {
    return FailedPrecondition("tensor '{}': this receiver holds {} {}, peer {} holds {} {}",
                              mine.name, DTypeName(mine.dtype), ShapeToString(mine.shape), peer,
                              DTypeName(theirs.dtype), ShapeToString(theirs.shape));
  }
  return Status::OK();
}

// One attempt: download every tensor the store holds, then check the peer did not move.
// Each tensor's state digest lands in `digests`: checked here, then written with the tensor.
// Up to kDownloadStreams tensors are downloaded at once, on connections of their own: one
// stream leaves the link idle while each tensor is checked against its digest.
Result<std::vector<OwnedTensor>> CopyOnce(ControlClient& peer, const WeightStore& store,
                                          const PeerState& before, uint64_t* bytes,
                                          std::map<std::string, uint64_t>* digests) {
  const std::vector<TensorView> mine = store.tensors();
  std::vector<OwnedTensor> copied(mine.size());
  std::vector<uint64_t> tensor_digests(mine.size());
  const int streams = static_cast<int>(std::min<size_t>(kDownloadStreams, mine.size()));
  const Status downloaded_all =
      ParallelFor(streams, mine.size(), [&](uint64_t begin, uint64_t end) {
        for (uint64_t t = begin; t < end; ++t) {
          Result<OwnedTensor> downloaded = peer.GetTensor(mine[t].name, &tensor_digests[t]);
          if (!downloaded.ok() && downloaded.status().code() == StatusCode::kFailedPrecondition) {
            // The peer refuses reads while a transfer writes: it moved, try again.
            return Unavailable("peer {} began a transfer during the copy: {}", peer.base_url(),
                               downloaded.status().message());
          }
          if (!downloaded.ok()) return downloaded.status();
          REFIT_RETURN_NOT_OK(CheckSameTensor(mine[t], *downloaded, peer.base_url()));
          copied[t] = std::move(downloaded).ValueOrDie();
        }
        return Status::OK();
      });
  REFIT_RETURN_NOT_OK(downloaded_all);
  digests->clear();
  for (size_t t = 0; t < copied.size(); ++t) {
    (*digests)[copied[t].name] = tensor_digests[t];
    *bytes += copied[t].bytes.size();
  }
  REFIT_ASSIGN_OR_RETURN(const PeerState after, IdleState(peer));
  if (after.version != before.version || after.fingerprint != before.fingerprint) {
    return Unavailable("peer {} moved from version {} to {} during the copy", peer.base_url(),
                       before.version, after.version);
  }
  const uint64_t fingerprint = StateFingerprint(*digests);
  if (fingerprint != after.fingerprint) {
    return Unavailable(
        "the copy of peer {}'s version {} has state fingerprint {:016x}, the peer {:016x} "
        "(it held other tensors than this receiver, or changed meanwhile)",
        peer.base_url(), after.version, fingerprint, after.fingerprint);
  }
  return copied;
}

// Whether the peer lists exactly this store's tensors (names, dtypes, shapes): then its local
// tensors are copied as they are.
bool HoldsTheSameTensors(const WeightStore& store, const TensorListing& listing) {
  const std::vector<TensorView> mine = store.tensors();
  if (mine.size() != listing.tensors.size()) return false;
  for (const HeldTensor& theirs : listing.tensors) {
    Result<TensorView> held = store.Find(theirs.name);
    if (!held.ok() || held->dtype != theirs.dtype || held->shape != theirs.shape) return false;
  }
  return true;
}

// The peer's tensors this store's loader places (the others it skips), checked before anything is
// downloaded: each must be one the loader knows with the dtype and shape the peer holds, and every
// local tensor of the store must be built from at least one of them. A peer whose tensors are
// canonical (one without a loader) thus serves a newcomer of any layout: a TP shard, fused
// qkv / gate_up, expert stacks.
Result<std::vector<size_t>> PlanCanonicalCopy(const WeightStore& store,
                                              const TensorListing& listing, std::string_view peer) {
  std::vector<size_t> fetch;
  std::set<std::string, std::less<>> built;
  for (size_t t = 0; t < listing.tensors.size(); ++t) {
    const HeldTensor& theirs = listing.tensors[t];
    Result<const CanonicalLayout*> layout = store.ResolveCanonical(theirs.name);
    if (!layout.ok()) {
      return FailedPrecondition(
          "tensor '{}' of peer {} ({} {}) cannot go through this "
          "receiver's loader: {}",
          theirs.name, peer, DTypeName(theirs.dtype), ShapeToString(theirs.shape),
          layout.status().message());
    }
    const CanonicalLayout& placed = **layout;
    if (placed.skipped) continue;
    if (placed.dtype != theirs.dtype || placed.shape != theirs.shape) {
      return FailedPrecondition(
          "tensor '{}': peer {} holds {} {}, this receiver's loader expects {} {}", theirs.name,
          peer, DTypeName(theirs.dtype), ShapeToString(theirs.shape), DTypeName(placed.dtype),
          ShapeToString(placed.shape));
    }
    built.insert(placed.local_tensor);
    for (const CanonicalPiece& piece : placed.pieces) built.insert(piece.local_tensor);
    fetch.push_back(t);
  }
  for (const TensorView& mine : store.tensors()) {
    if (!built.contains(mine.name)) {
      return FailedPrecondition(
          "tensor '{}' of this receiver is built from none of the {} tensors of peer {} (its "
          "loader maps none of them onto it): the peer holds another model, or its own layout",
          mine.name, listing.tensors.size(), peer);
    }
  }
  return fetch;
}

// One attempt of a canonical copy: download the tensors `fetch` names (every one checked against
// the digest the listing gave it), then check the peer did not move and that the listing was its
// state.
Result<std::vector<OwnedTensor>> CopyCanonicalOnce(ControlClient& peer,
                                                   const TensorListing& listing,
                                                   std::span<const size_t> fetch,
                                                   const PeerState& before, uint64_t* bytes) {
  std::map<std::string, uint64_t> listed;
  for (const HeldTensor& theirs : listing.tensors) listed[theirs.name] = theirs.digest;
  if (listing.version != before.version || StateFingerprint(listed) != before.fingerprint) {
    return Unavailable("peer {} moved from version {} to {} while it listed its tensors",
                       peer.base_url(), before.version, listing.version);
  }
  std::vector<OwnedTensor> copied(fetch.size());
  const int streams = static_cast<int>(std::min<size_t>(kDownloadStreams, fetch.size()));
  const Status downloaded_all =
      ParallelFor(std::max(streams, 1), fetch.size(), [&](uint64_t begin, uint64_t end) {
        for (uint64_t f = begin; f < end; ++f) {
          const HeldTensor& theirs = listing.tensors[fetch[f]];
          uint64_t digest = 0;
          Result<OwnedTensor> downloaded = peer.GetTensor(theirs.name, &digest);
          if (!downloaded.ok() && downloaded.status().code() == StatusCode::kFailedPrecondition) {
            return Unavailable("peer {} began a transfer during the copy: {}", peer.base_url(),
                               downloaded.status().message());
          }
          if (!downloaded.ok()) return downloaded.status();
          if (digest != theirs.digest || downloaded->dtype != theirs.dtype ||
              downloaded->shape != theirs.shape) {
            return Unavailable("peer {}: tensor '{}' changed after the peer listed it",
                               peer.base_url(), theirs.name);
          }
          copied[f] = std::move(downloaded).ValueOrDie();
        }
        return Status::OK();
      });
  REFIT_RETURN_NOT_OK(downloaded_all);
  REFIT_ASSIGN_OR_RETURN(const PeerState after, IdleState(peer));
  if (after.version != before.version || after.fingerprint != before.fingerprint) {
    return Unavailable("peer {} moved from version {} to {} during the copy", peer.base_url(),
                       before.version, after.version);
  }
  for (const OwnedTensor& tensor : copied) *bytes += tensor.bytes.size();
  return copied;
}

// Write verified canonical tensors through the store's loader: FULL items, each with the digest
// of its span, applied as an anchor's are (the loader cuts each into the pieces this receiver
// holds and keeps the local and piece digests current). The old bits are not kept: the copy was
// verified before this, and a write that fails (none is expected once PlanCanonicalCopy passed)
// leaves the written spans in place with every digest recomputed from the bytes.
Status WriteThroughLoader(std::span<const OwnedTensor> copied, const TensorListing& listing,
                          WeightStore& store) {
  // A whole tensor's span digest is the one its download was checked against: not hashed again.
  std::map<std::string, uint64_t, std::less<>> listed;
  for (const HeldTensor& held : listing.tensors) listed.emplace(held.name, held.digest);
  UndoLogOptions undo_options;
  undo_options.anchor_undo = AnchorUndo::kNone;
  UndoLog undo(undo_options);
  const TransferId id = TransferId::Random();
  std::vector<ItemView> items;
  uint64_t pending_bytes = 0;
  uint32_t payload_id = 0;
  const auto apply_pending = [&]() -> Status {
    if (items.empty()) return Status::OK();
    PayloadEncodeOptions encode;
    encode.compress = false;
    encode.byte_planes = false;
    // An anchor to `version` (any base below it: the payloads never leave this process).
    const PayloadIds ids{id, 0, payload_id++, 0, std::max<uint64_t>(listing.version, 1)};
    // A stored body (FULL items, not compressed), decoded in the encoded bytes without a copy.
    REFIT_ASSIGN_OR_RETURN(std::vector<std::byte> payload, EncodePayload(ids, items, encode));
    REFIT_ASSIGN_OR_RETURN(ValidatedPayload validated, ValidatePayload(std::move(payload)));
    REFIT_ASSIGN_OR_RETURN(const DecodedPayload decoded, DecodePayload(std::move(validated)));
    items.clear();
    pending_bytes = 0;
    return ApplyPayload(decoded, store, &undo, nullptr, kCanonicalApplyThreads);
  };
  Status written = [&]() -> Status {
    for (const OwnedTensor& tensor : copied) {
      const uint32_t width = DTypeSize(tensor.dtype);
      const uint64_t numel = tensor.bytes.size() / width;
      const uint64_t step = std::max<uint64_t>(kCanonicalItemBytes / width, 1);
      for (uint64_t begin = 0; begin < numel; begin += step) {
        const uint64_t end = std::min(numel, begin + step);
        const std::span<const std::byte> values =
            std::span<const std::byte>(tensor.bytes).subspan(begin * width, (end - begin) * width);
        if (pending_bytes + values.size() > kCanonicalPayloadBytes) {
          REFIT_RETURN_NOT_OK(apply_pending());
        }
        items.push_back(ItemView{.name = tensor.name,
                                 .dtype = tensor.dtype,
                                 .shape = tensor.shape,
                                 .op = Op::kFull,
                                 .value_dtype = tensor.dtype,
                                 .span_begin = begin,
                                 .span_end = end,
                                 .count = end - begin,
                                 .location_encoding = LocationEncoding::kAll,
                                 .locations = {},
                                 .values = values,
                                 .digest = begin == 0 && end == numel
                                               ? listed.at(tensor.name)
                                               : DigestRange(tensor.bytes, width, begin, end)});
        pending_bytes += values.size();
      }
    }
    return apply_pending();
  }();
  if (!written.ok()) {
    Status rolled_back = undo.Rollback(store);
    return written.WithContext(fmt::format(
        "writing the copy through the loader (the store holds part of it{}; start this receiver "
        "again, from a checkpoint or for an anchor)",
        rolled_back.ok() ? ", its digests recomputed" : ": " + rolled_back.ToString()));
  }
  undo.Clear();
  return Status::OK();
}

// Write verified tensors of the store's own layout, each with its digest.
Status WriteLocalCopy(std::span<const OwnedTensor> copied,
                      const std::map<std::string, uint64_t>& digests, WeightStore& store) {
  for (const OwnedTensor& theirs : copied) {
    REFIT_ASSIGN_OR_RETURN(MutableTensorView mine, store.Find(theirs.name));
    std::memcpy(mine.bytes.data(), theirs.bytes.data(), theirs.bytes.size());
    if (store.has_loader()) {
      // Through a loader the canonical pieces' partial digests are state too: any resolved
      // already describe the bytes just replaced (O(tensor) once more).
      REFIT_RETURN_NOT_OK(store.RehashTensor(theirs.name));
    } else {
      REFIT_RETURN_NOT_OK(store.SetDigest(theirs.name, digests.at(theirs.name)));
    }
  }
  return Status::OK();
}

}  // namespace

Result<PeerBootstrapReport> BootstrapFromPeer(std::string_view peer_url, WeightStore& store,
                                              const PeerBootstrapOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  for (const TensorView& mine : store.tensors()) {
    if (store.DeviceMemory(mine.name) != nullptr) {
      return FailedPrecondition(
          "bootstrap from peer {}: tensor '{}' is in device memory, which a "
          "peer copy does not write; bootstrap from the trainer instead",
          peer_url, mine.name);
    }
  }
  ControlClientOptions client_options;
  client_options.base_url = std::string(peer_url);
  client_options.api_key = options.api_key;
  client_options.timeout = options.call_timeout;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> peer, ControlClient::Make(client_options));

  PeerBootstrapReport report;
  report.peer = peer->base_url();
  report.start_version = store.version();
  Status last = Status::OK();
  for (report.attempts = 1; report.attempts <= std::max(options.attempts, 1); ++report.attempts) {
    Result<PeerState> before = IdleState(*peer);
    if (!before.ok()) {
      last = before.status();
      if (last.code() != StatusCode::kUnavailable) return last;
      std::this_thread::sleep_for(std::chrono::milliseconds(200) * report.attempts);
      continue;
    }
    if (before->version == store.version() &&
        before->fingerprint == StateFingerprint(store.Digests())) {
      report.final_version = store.version();  // holds the peer's state already
      break;
    }
    Result<TensorListing> listing = peer->ListTensors();
    if (!listing.ok()) {
      last =
          listing.status().code() == StatusCode::kFailedPrecondition
              ? Unavailable("peer {} began a transfer: {}", report.peer, listing.status().message())
              : listing.status();
      if (last.code() != StatusCode::kUnavailable) return last;
      continue;
    }
    uint64_t bytes = 0;
    std::map<std::string, uint64_t> digests;
    // Another layout than the peer's: its tensors are canonical ones, cut by this loader.
    const bool canonical = store.has_loader() && !HoldsTheSameTensors(store, *listing);
    Result<std::vector<OwnedTensor>> copied = [&]() -> Result<std::vector<OwnedTensor>> {
      if (!canonical) return CopyOnce(*peer, store, *before, &bytes, &digests);
      REFIT_ASSIGN_OR_RETURN(const std::vector<size_t> fetch,
                             PlanCanonicalCopy(store, *listing, report.peer));
      return CopyCanonicalOnce(*peer, *listing, fetch, *before, &bytes);
    }();
    if (!copied.ok()) {
      last = copied.status();
      // Only a peer that moved is worth another try; a tensor set that differs will differ again.
      if (last.code() != StatusCode::kUnavailable) return last;
      REFIT_LOG_INFO("bootstrap from peer {}: attempt {}: {}", report.peer, report.attempts,
                     last.message());
      continue;
    }
    // Verified as a whole: now write it.
    if (canonical) {
      REFIT_RETURN_NOT_OK(WriteThroughLoader(*copied, *listing, store));
    } else {
      REFIT_RETURN_NOT_OK(WriteLocalCopy(*copied, digests, store));
    }
    store.set_version(before->version);
    report.final_version = before->version;
    report.tensors = copied->size();
    report.bytes = bytes;
    report.canonical = canonical;
    break;
  }
  if (report.attempts > std::max(options.attempts, 1)) {
    return last.WithContext(fmt::format("bootstrap from peer {}: {} attempt(s)", report.peer,
                                        std::max(options.attempts, 1)));
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace refit::internal
