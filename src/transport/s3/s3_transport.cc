// s3://<bucket>[/<prefix>]?endpoint=…: payloads through an object store (upstream's
// vllm_s3_sparse), for receivers that share no network path with the trainer.
//
//   Send:    upload (multipart beyond part_size, bounded parts in flight) → announce the
//            manifest to every receiver through its ManifestAnnouncer (each downloads, verifies
//            the checksum and MAC before anything decodes it, stages, then answers; the
//            announcer, the control plane's client, owns the HTTP) → DELETE once all ACKed
//            (chain=1: keep it for the chain). A failed DELETE is retried at Finish and again
//            when the transfer ends.
//   Abort:   every object under the transfer's key prefixes is deleted and its unfinished
//            multipart uploads aborted (TransferAborted), also uploads the store completed after
//            their sender gave up; what cannot be reached now is swept when a later transfer
//            ends. An unfinished sender deletes what it stored on destruction.
//   Commit:  chain=1 appends the version to <prefix>/chain/index.json, written last, then
//            prunes past the retention (TransferCommitted; see s3_chain.h).
#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/digest.h"
#include "refit/manifest_announcer.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/s3/s3_chain.h"
#include "transport/s3/s3_client.h"
#include "transport/s3/s3_layout.h"
#include "transport/transport_internal.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

// ---- What a transport instance uploaded, per transfer ----------------------------------------

// Shared by the transport and its senders (which may outlive it): every object stored per
// transfer (what a chain version lists, what an abort deletes), the live objects whose DELETE
// failed (retried when the transfer ends), and objects that could not be deleted even then
// (retried whenever a later transfer ends, e.g. once a store that vanished is back).
struct UploadLog {
  internal::Mutex mutex;
  std::map<std::string, std::vector<ChainPayload>> uploads;
  std::map<std::string, std::vector<std::string>> undeleted;
  std::vector<std::string> orphans;
  // Key prefixes of aborted transfers that could not be swept yet (the store was unreachable).
  std::vector<std::string> unswept;

  void Record(const TransferId& id, ChainPayload payload) {
    internal::MutexLock lock(mutex);
    uploads[id.ToHex()].push_back(std::move(payload));
  }
  void RecordUndeleted(const TransferId& id, std::vector<std::string> keys) {
    if (keys.empty()) return;
    internal::MutexLock lock(mutex);
    std::vector<std::string>& list = undeleted[id.ToHex()];
    list.insert(list.end(), keys.begin(), keys.end());
  }
  // The transfer's uploads in (producer, payload) order, each once: a re-sent payload overwrote
  // the same key with the same bytes. (Deduplicated here, once, rather than at every Record:
  // a large model's transfer has tens of thousands of payloads.)
  std::vector<ChainPayload> TakeUploads(const TransferId& id) {
    std::vector<ChainPayload> list;
    {
      internal::MutexLock lock(mutex);
      auto node = uploads.extract(id.ToHex());
      if (!node.empty()) list = std::move(node.mapped());
    }
    auto ids = [](const ChainPayload& p) { return std::pair(p.producer_id, p.payload_id); };
    std::sort(list.begin(), list.end(),
              [&](const ChainPayload& a, const ChainPayload& b) { return ids(a) < ids(b); });
    list.erase(
        std::unique(list.begin(), list.end(),
                    [&](const ChainPayload& a, const ChainPayload& b) { return ids(a) == ids(b); }),
        list.end());
    return list;
  }
  // The undeleted objects of `id` and every orphan.
  std::vector<std::string> TakeUndeleted(const TransferId& id) {
    internal::MutexLock lock(mutex);
    auto node = undeleted.extract(id.ToHex());
    std::vector<std::string> keys = std::move(orphans);
    orphans.clear();
    if (!node.empty()) keys.insert(keys.end(), node.mapped().begin(), node.mapped().end());
    return keys;
  }
  void AddOrphans(const std::vector<std::string>& keys) {
    internal::MutexLock lock(mutex);
    orphans.insert(orphans.end(), keys.begin(), keys.end());
  }
  std::vector<std::string> TakeUnswept() {
    internal::MutexLock lock(mutex);
    return std::exchange(unswept, {});
  }
  void AddUnswept(const std::vector<std::string>& prefixes) {
    internal::MutexLock lock(mutex);
    unswept.insert(unswept.end(), prefixes.begin(), prefixes.end());
  }
};

// Delete `keys`; return those whose DELETE failed (each logged).
std::vector<std::string> DeleteObjects(S3Client& client, const std::vector<std::string>& keys) {
  std::vector<std::string> failed;
  for (const std::string& key : keys) {
    Status deleted = client.DeleteObject(key);
    // A bucket deleted meanwhile holds the object no more either.
    if (!deleted.ok() && deleted.code() != StatusCode::kNotFound) {
      REFIT_LOG_WARN("s3: could not delete {}: {}", key, deleted.ToString());
      failed.push_back(key);
    }
  }
  return failed;
}

// Delete every object and abort every unfinished multipart upload under each of `prefixes` (an
// aborted transfer's): this also catches an upload the store completed after its client gave up,
// which no sender recorded. Return the prefixes that could not be swept.
std::vector<std::string> SweepPrefixes(S3Client& client, const std::vector<std::string>& prefixes) {
  std::vector<std::string> failed;
  for (const std::string& prefix : prefixes) {
    Result<std::vector<S3ObjectInfo>> objects = client.ListObjects(prefix);
    Result<std::vector<S3MultipartUpload>> uploads = client.ListMultipartUploads(prefix);
    if (!objects.ok() || !uploads.ok()) {
      failed.push_back(prefix);
      continue;
    }
    std::vector<std::string> keys;
    for (const S3ObjectInfo& object : *objects) keys.push_back(object.key);
    bool swept = DeleteObjects(client, keys).empty();
    // Parts of an upload cut short are stored, invisible and billed, until aborted.
    for (const S3MultipartUpload& upload : *uploads) {
      Status aborted = client.AbortMultipartUpload(upload.key, upload.upload_id);
      swept &= aborted.ok() || aborted.code() == StatusCode::kNotFound;
    }
    if (!swept) failed.push_back(prefix);
  }
  return failed;
}

// ---- Sender --------------------------------------------------------------------------------

class S3Sender final : public TransportSender {
 public:
  S3Sender(SenderContext context, std::shared_ptr<const S3TransportConfig> config,
           std::shared_ptr<S3Client> client, std::shared_ptr<UploadLog> log, PayloadLimits limits,
           std::vector<std::shared_ptr<ManifestAnnouncer>> announcers)
      : TransportSender(std::move(context), limits),
        config_(std::move(config)),
        client_(std::move(client)),
        log_(std::move(log)),
        announcers_(std::move(announcers)) {}

  // A stream that failed is not finished: delete what it stored, so an aborted transfer leaves
  // nothing behind even without a coordinator to tell the transport.
  ~S3Sender() override {
    internal::MutexLock lock(mutex_);
    if (finished_) return;
    std::vector<std::string> keys = std::move(kept_);
    keys.insert(keys.end(), undeleted_.begin(), undeleted_.end());
    DeleteObjects(*client_, keys);
  }

 private:
  Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                 const PayloadHeader& /*header*/) override {
    PayloadManifest manifest;
    manifest.transfer_id = context().transfer_id;
    manifest.producer_id = context().producer_id;
    manifest.payload_id = payload_id;
    manifest.key = PayloadObjectKey(*config_, config_->chain, context().transfer_id,
                                    context().producer_id, payload_id);
    manifest.size = payload.size();
    manifest.checksum = ObjectChecksum(payload);
    if (!config_->mac_key.empty()) manifest.mac = MacHex(config_->mac_key, payload);

    REFIT_RETURN_NOT_OK(client_->Upload(manifest.key, payload, config_->transfer));
    {
      internal::MutexLock lock(mutex_);
      kept_.push_back(manifest.key);
    }
    log_->Record(context().transfer_id, ChainPayload{.key = manifest.key,
                                                     .producer_id = manifest.producer_id,
                                                     .payload_id = manifest.payload_id,
                                                     .size = manifest.size,
                                                     .checksum = manifest.checksum,
                                                     .mac = manifest.mac});
    REFIT_RETURN_NOT_OK(Announce(manifest));
    if (!config_->chain) {
      Status deleted = client_->DeleteObject(manifest.key);
      internal::MutexLock lock(mutex_);
      std::erase(kept_, manifest.key);
      if (!deleted.ok()) {
        REFIT_LOG_WARN(
            "s3: could not delete {} after every receiver staged it ({}); retrying at "
            "the end of the stream",
            manifest.key, deleted.ToString());
        undeleted_.push_back(manifest.key);
      }
    }
    return Status::OK();
  }

  Status EndStream(uint64_t /*payloads*/) override {
    internal::MutexLock lock(mutex_);
    undeleted_ = DeleteObjects(*client_, undeleted_);
    // Still failing: the transport retries once the transfer is decided.
    log_->RecordUndeleted(context().transfer_id, std::move(undeleted_));
    undeleted_.clear();
    finished_ = true;
    return Status::OK();
  }

  // Announce the manifest to every receiver concurrently; the first failure is Send's error.
  Status Announce(const PayloadManifest& manifest) {
    const std::string text = ManifestToJson(manifest);
    const size_t n = announcers_.size();
    std::vector<Status> results(n);
    auto post = [&](size_t r) {
      Result<StageResult> staged =
          announcers_[r]->AnnounceManifest(text, config_->manifest_timeout);
      if (!staged.ok()) {
        results[r] = staged.status().WithContext(fmt::format(
            "announcing payload {} of producer {}", manifest.payload_id, manifest.producer_id));
      }
    };
    {
      std::vector<std::jthread> threads;
      for (size_t r = 1; r < n; ++r) threads.emplace_back(post, r);
      post(0);
    }
    for (const Status& result : results) REFIT_RETURN_NOT_OK(result);
    return Status::OK();
  }

  const std::shared_ptr<const S3TransportConfig> config_;
  const std::shared_ptr<S3Client> client_;
  const std::shared_ptr<UploadLog> log_;
  // One per endpoint, in the order of context().endpoints.
  const std::vector<std::shared_ptr<ManifestAnnouncer>> announcers_;

  internal::Mutex mutex_;
  // Objects stored and not deleted (chain objects, or live ones awaiting their ACKs).
  std::vector<std::string> kept_;
  // Live objects whose DELETE failed.
  std::vector<std::string> undeleted_;
  bool finished_ = false;
};

// ---- Listener ------------------------------------------------------------------------------

class S3Listener final : public Listener {
 public:
  S3Listener(std::string endpoint, std::shared_ptr<const S3TransportConfig> config,
             std::shared_ptr<S3Client> client, PayloadSink& sink, PayloadLimits limits)
      : endpoint_(std::move(endpoint)),
        config_(std::move(config)),
        client_(std::move(client)),
        sink_(sink),
        limits_(limits) {}

  Status Start() override {
    internal::MutexLock lock(mutex_);
    if (started_ || stopped_) {
      return FailedPrecondition("s3 listener '{}' was started before", Printable(endpoint_));
    }
    started_ = true;
    return Status::OK();
  }

  void Stop() override {
    internal::MutexLock lock(mutex_);
    stopped_ = true;
  }

  Result<ManifestDelivery> AcceptManifest(std::string_view text, std::stop_token stop) override {
    {
      internal::MutexLock lock(mutex_);
      if (!started_ || stopped_) {
        return Unavailable("s3 listener '{}' is not running", Printable(endpoint_));
      }
    }
    Result<ManifestDelivery> delivered = Deliver(text, std::move(stop));
    internal::MutexLock lock(mutex_);
    if (delivered.ok()) {
      ++(delivered->result == StageResult::kDuplicate ? stats_.duplicates : stats_.delivered);
    } else {
      ++stats_.failures;
      stats_.last_error = delivered.status();
    }
    return delivered;
  }

  ListenerStats stats() const override {
    internal::MutexLock lock(mutex_);
    return stats_;
  }
  const std::string& endpoint() const override { return endpoint_; }

 private:
  Result<ManifestDelivery> Deliver(std::string_view text, std::stop_token stop) {
    REFIT_ASSIGN_OR_RETURN(const PayloadManifest manifest, ManifestFromJson(text));
    // Keys derive from ids; a manifest naming any other object (another prefix, another
    // bucket's layout) is refused before any request is made.
    bool known_key = false;
    for (bool chain : {false, true}) {
      known_key |= manifest.key == PayloadObjectKey(*config_, chain, manifest.transfer_id,
                                                    manifest.producer_id, manifest.payload_id);
    }
    if (!known_key) {
      return InvalidArgument(
          "manifest key '{}' is not the object of transfer {} producer {} payload {} under "
          "s3://{}/{}",
          Printable(manifest.key), manifest.transfer_id.ToHex(), manifest.producer_id,
          manifest.payload_id, config_->client.bucket, config_->prefix);
    }
    REFIT_ASSIGN_OR_RETURN(ValidatedPayload payload,
                           FetchVerifiedPayload(*client_, *config_, manifest, limits_));
    const uint64_t bytes = payload.size();
    REFIT_ASSIGN_OR_RETURN(const StageResult staged,
                           sink_.Deliver(std::move(payload), std::move(stop)));
    return ManifestDelivery{.result = staged, .payload_bytes = bytes};
  }

  const std::string endpoint_;
  const std::shared_ptr<const S3TransportConfig> config_;
  const std::shared_ptr<S3Client> client_;
  PayloadSink& sink_;
  const PayloadLimits limits_;
  mutable internal::Mutex mutex_;
  bool started_ = false;
  bool stopped_ = false;
  ListenerStats stats_;
};

// ---- Transport -----------------------------------------------------------------------------

class S3Transport final : public Transport {
 public:
  S3Transport(TransportUri uri, std::shared_ptr<const S3TransportConfig> config,
              std::shared_ptr<S3Client> client, const TransportOptions& options)
      : Transport(std::move(uri)),
        config_(std::move(config)),
        client_(std::move(client)),
        options_(options),
        log_(std::make_shared<UploadLog>()) {}

  TransportCapabilities capabilities() const override {
    TransportCapabilities caps;
    // Send returns once every receiver downloaded and staged the payload.
    caps.staged_ack = true;
    caps.needs_manifest = true;
    return caps;
  }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_RETURN_NOT_OK(CheckSenderContext(uri(), context));
    if (!options_.manifest_announcers) {
      return FailedPrecondition(
          "transport URI '{}': s3:// announces each payload to the receivers' control planes, "
          "but no announcer was given (TransportOptions::manifest_announcers)",
          config_->shown_uri);
    }
    std::vector<std::shared_ptr<ManifestAnnouncer>> announcers;
    for (const std::string& endpoint : context.endpoints) {
      Result<std::shared_ptr<ManifestAnnouncer>> announcer = options_.manifest_announcers(endpoint);
      if (!announcer.ok()) {
        return announcer.status().WithContext(
            fmt::format("transport URI '{}': endpoint '{}' (s3:// endpoints are the receivers' "
                        "control planes)",
                        config_->shown_uri, Printable(endpoint)));
      }
      if (*announcer == nullptr) {
        return Internal("transport URI '{}': the announcer factory gave none for endpoint '{}'",
                        config_->shown_uri, Printable(endpoint));
      }
      announcers.push_back(*std::move(announcer));
    }
    return std::unique_ptr<TransportSender>(std::make_unique<S3Sender>(
        context, config_, client_, log_, options_.limits, std::move(announcers)));
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    if (!context.peers.empty() || !context.bind_address.empty()) {
      return InvalidArgument(
          "transport URI '{}': s3:// has no relays and binds nothing (peers and bind_address "
          "must be empty); manifests arrive through the control plane",
          config_->shown_uri);
    }
    return std::unique_ptr<Listener>(
        std::make_unique<S3Listener>(context.endpoint, config_, client_, sink, options_.limits));
  }

  bool NeedsAnchor(uint64_t base_version) override {
    if (!config_->chain) return false;
    internal::MutexLock lock(chain_mutex_);
    Status loaded = LoadChainIndex();
    if (!loaded.ok()) {
      REFIT_LOG_WARN("s3 chain: cannot read its index ({}); the next transfer is an anchor",
                     loaded.ToString());
      return true;
    }
    // A delta extends the chain only from the version it holds last.
    return chain_->versions.empty() || chain_->versions.back().version != base_version;
  }

  Status TransferCommitted(const TransferPlan& plan,
                           const std::map<std::string, uint64_t>& digests) override {
    std::vector<ChainPayload> uploads = log_->TakeUploads(plan.transfer_id);
    log_->AddOrphans(DeleteObjects(*client_, log_->TakeUndeleted(plan.transfer_id)));
    log_->AddUnswept(SweepPrefixes(*client_, log_->TakeUnswept()));
    if (!config_->chain) return Status::OK();
    ChainVersion version{.version = plan.target_version,
                         .base_version = plan.base_version,
                         .anchor = plan.anchor,
                         .transfer_id = plan.transfer_id,
                         .state_fingerprint = StateFingerprint(digests),
                         .payloads = std::move(uploads)};
    internal::MutexLock lock(chain_mutex_);
    return PublishChainVersion(std::move(version));
  }

  void TransferAborted(const TransferId& id) override {
    std::vector<std::string> keys = log_->TakeUndeleted(id);
    for (const ChainPayload& payload : log_->TakeUploads(id)) keys.push_back(payload.key);
    log_->AddOrphans(DeleteObjects(*client_, keys));
    std::vector<std::string> prefixes = log_->TakeUnswept();
    for (bool chain : {false, true}) prefixes.push_back(TransferObjectPrefix(*config_, chain, id));
    log_->AddUnswept(SweepPrefixes(*client_, prefixes));
  }

 private:
  Status LoadChainIndex() {
    if (chain_.has_value()) return Status::OK();
    Result<std::vector<std::byte>> text = client_->GetObject(ChainIndexKey(*config_));
    if (!text.ok() && text.status().code() == StatusCode::kNotFound) {
      chain_ = ChainIndex{};
      return Status::OK();
    }
    REFIT_RETURN_NOT_OK(text.status());
    REFIT_ASSIGN_OR_RETURN(
        ChainIndex index,
        ParseChainIndex(std::string_view(reinterpret_cast<const char*>(text->data()), text->size()),
                        config_->mac_key, ChainIndexKey(*config_)));
    chain_ = std::move(index);
    return Status::OK();
  }

  // Append `version`, write the index (the version becomes visible), then prune.
  Status PublishChainVersion(ChainVersion version) {
    REFIT_RETURN_NOT_OK(LoadChainIndex());
    ChainIndex next = *chain_;
    std::vector<ChainVersion> replaced;
    if (version.anchor && !next.versions.empty() &&
        version.version <= next.versions.back().version) {
      // The trainer went back (a restarted run under the same prefix): its anchor starts a new
      // lineage, and the old one, whose versions collide with it, goes.
      REFIT_LOG_WARN(
          "s3 chain {}: anchor version {} is not newer than the chain's {}; a new "
          "chain replaces the old one",
          ChainIndexKey(*config_), version.version, next.versions.back().version);
      replaced = std::move(next.versions);
      next.versions.clear();
    }
    const std::vector<std::string> keys = [&] {
      std::vector<std::string> list;
      for (const ChainPayload& p : version.payloads) list.push_back(p.key);
      return list;
    }();
    Status appended = AppendChainVersion(next, std::move(version));
    if (!appended.ok()) {
      // A delta the chain cannot use: drop its objects; NeedsAnchor asks for an anchor next.
      log_->AddOrphans(DeleteObjects(*client_, keys));
      return appended;
    }
    std::vector<ChainVersion> pruned = PruneChain(next, config_->retain_versions);
    pruned.insert(pruned.end(), std::make_move_iterator(replaced.begin()),
                  std::make_move_iterator(replaced.end()));
    const std::string text = SerializeChainIndex(next, config_->mac_key);
    Status written =
        client_->PutObject(ChainIndexKey(*config_),
                           std::span(reinterpret_cast<const std::byte*>(text.data()), text.size()));
    if (!written.ok()) {
      // Unknown whether the index changed: read it again before the next append.
      chain_.reset();
      return written.WithContext("writing the chain index");
    }
    chain_ = std::move(next);
    if (!pruned.empty()) {
      // Every receiver of the sync that committed holds the newest version, so none of them
      // needs what goes; a receiver outside it (cut off, restarted) that holds a pruned version
      // can no longer replay from it, and is caught up by an anchor instead (docs/protocol.md
      // "Lineage and fencing", garbage collection). Say so, with the versions.
      const auto [oldest, newest] = std::minmax_element(
          pruned.begin(), pruned.end(),
          [](const ChainVersion& a, const ChainVersion& b) { return a.version < b.version; });
      REFIT_LOG_INFO(
          "s3 chain {}: dropped {} version(s) ({} to {}); a receiver holding one of them and "
          "not in the syncs catches up by an anchor, not by the chain",
          ChainIndexKey(*config_), pruned.size(), oldest->version, newest->version);
    }
    // Pruned objects go only after the index stops naming them.
    for (const ChainVersion& old : pruned) {
      std::vector<std::string> old_keys;
      for (const ChainPayload& p : old.payloads) old_keys.push_back(p.key);
      log_->AddOrphans(DeleteObjects(*client_, old_keys));
    }
    return Status::OK();
  }

  const std::shared_ptr<const S3TransportConfig> config_;
  const std::shared_ptr<S3Client> client_;
  const TransportOptions options_;
  const std::shared_ptr<UploadLog> log_;
  internal::Mutex chain_mutex_;
  // The chain's index as last read or written; empty until needed, or after a failed write.
  std::optional<ChainIndex> chain_;
};

}  // namespace

Result<std::unique_ptr<Transport>> MakeS3Transport(const TransportUri& uri,
                                                   const TransportOptions& options) {
  REFIT_ASSIGN_OR_RETURN(S3TransportConfig config, ParseS3TransportUri(uri));
  // Both belong to the control plane's client now, which prepare and flush need configured
  // anyway; a URI that still sets them keeps working.
  if (!config.api_key.empty() || !config.control_ca_cert.empty()) {
    REFIT_LOG_WARN(
        "transport URI '{}': api_key_env and control_ca_cert are ignored; manifests are "
        "announced with the control client's API key and CA",
        config.shown_uri);
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<S3Client> client, S3Client::Make(config.client));
  return std::unique_ptr<Transport>(std::make_unique<S3Transport>(
      uri, std::make_shared<const S3TransportConfig>(std::move(config)),
      std::shared_ptr<S3Client>(std::move(client)), options));
}

}  // namespace refit::internal
