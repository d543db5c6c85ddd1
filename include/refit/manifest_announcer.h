// ManifestAnnouncer: how a transport that stores payloads elsewhere (s3://) tells a receiver that
// a payload is there to fetch. Part of the transfer vocabulary, like ReceiverControl: transport
// declares what it needs, control implements it (ControlClient posts to /v1/manifest), and node
// wires the two together, so that neither layer links the other and the transport knows nothing
// of HTTP (routes, auth headers, status codes, retries).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "refit/status.h"
#include "refit/transfer.h"

namespace refit {

/// Delivers manifests to one receiver.
///
/// Thread-safety: AnnounceManifest may be called concurrently from any thread.
class ManifestAnnouncer {
 public:
  virtual ~ManifestAnnouncer() = default;

  /// Hand `manifest` (the transport's own text, opaque here; borrowed for the call) to the
  /// receiver, which fetches, verifies and stages the payload it names before it answers, and
  /// return how it staged it. `stage_time` is how long the receiver may take to do that, on top
  /// of the announcer's own connection and transfer limits; the call returns within their sum.
  /// Repeating a call is safe: a receiver deduplicates a payload it staged before.
  /// Errors: the receiver's refusal with its own code (e.g. DataLoss for a corrupt object,
  /// PermissionDenied for a wrong MAC or key); Unavailable when the receiver cannot be reached;
  /// DeadlineExceeded when it did not answer in time; DataLoss for a reply that is not one.
  virtual Result<StageResult> AnnounceManifest(std::string_view manifest,
                                               std::chrono::milliseconds stage_time) = 0;
};

/// Return the announcer of the receiver at `endpoint` (an entry of SenderContext::endpoints).
/// Errors: InvalidArgument for an endpoint the announcer cannot address.
using ManifestAnnouncerFactory =
    std::function<Result<std::shared_ptr<ManifestAnnouncer>>(const std::string& endpoint)>;

}  // namespace refit
