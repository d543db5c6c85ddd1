#include "node/peer_bootstrap.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "core/digest.h"
#include "refit/control_client.h"
#include "refit/status_format.h"
#include "util/logging.h"
#include "util/thread_pool.h"

namespace refit::internal {
namespace {

// Tensors downloaded at once (each on its own connection to the peer).
constexpr size_t kDownloadStreams = 4;

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
    uint64_t bytes = 0;
    std::map<std::string, uint64_t> digests;
    Result<std::vector<OwnedTensor>> copied = CopyOnce(*peer, store, *before, &bytes, &digests);
    if (!copied.ok()) {
      last = copied.status();
      // Only a peer that moved is worth another try; a tensor set that differs will differ again.
      if (last.code() != StatusCode::kUnavailable) return last;
      REFIT_LOG_INFO("bootstrap from peer {}: attempt {}: {}", report.peer, report.attempts,
                     last.message());
      continue;
    }
    // Verified as a whole: now write it.
    for (OwnedTensor& theirs : *copied) {
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
    store.set_version(before->version);
    report.final_version = before->version;
    report.tensors = copied->size();
    report.bytes = bytes;
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
