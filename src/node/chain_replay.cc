#include "node/chain_replay.h"

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/digest.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/s3/s3_chain_internal.h"
#include "transport/s3/s3_client.h"
#include "transport/s3/s3_layout.h"
#include "transport/transport_internal.h"
#include "util/logging.h"

namespace refit {
namespace {

using internal::OpenAndReadChain;
using internal::OpenedChain;
using internal::Printable;

std::string DigestHex(uint64_t digest) { return fmt::format("{:016x}", digest); }

Result<std::map<uint32_t, uint32_t>> PayloadCounts(const ChainVersion& version) {
  std::map<uint32_t, uint32_t> counts;
  for (const ChainPayload& p : version.payloads) ++counts[p.producer_id];
  for (const ChainPayload& p : version.payloads) {
    if (p.payload_id >= counts[p.producer_id]) {
      return DataLoss("chain version {}: producer {} lists {} payloads but payload id {}",
                      version.version, p.producer_id, counts[p.producer_id], p.payload_id);
    }
  }
  return counts;
}

// Replay one version into `session`; on any failure the version is aborted (rolled back).
Status ReplayVersion(const ChainVersion& version, const internal::S3TransportConfig& config,
                     S3Client& client, internal::ReceiverSession& session,
                     const ChainBootstrapOptions& options, ChainBootstrapReport& report) {
  const std::string where = fmt::format("chain version {}", version.version);
  PrepareRequest prepare;
  prepare.transfer_id = version.transfer_id;
  prepare.base_version = version.base_version;
  // A chain records no lineage, only each version's state fingerprint, which the replay checks:
  // the replay states the lineage the store holds, so the receiver keeps its run and epoch, and
  // its fingerprint becomes unknown (docs/protocol.md "Lineage and fencing").
  prepare.lineage.run_id = session.GetStatus().lineage.run_id;
  prepare.lineage.epoch = session.GetStatus().lineage.epoch;
  REFIT_ASSIGN_OR_RETURN(prepare.expected.payloads_per_producer, PayloadCounts(version));
  REFIT_RETURN_NOT_OK(session.Prepare(prepare).status().WithContext(where));
  auto replay = [&]() -> Status {
    for (const ChainPayload& p : version.payloads) {
      const std::string expected_key = internal::PayloadObjectKey(
          config, /*chain=*/true, version.transfer_id, p.producer_id, p.payload_id);
      if (p.key != expected_key) {
        return DataLoss("{}: payload key '{}' is not {} (keys derive from ids)", where,
                        Printable(p.key), expected_key);
      }
      internal::PayloadManifest manifest{.transfer_id = version.transfer_id,
                                         .producer_id = p.producer_id,
                                         .payload_id = p.payload_id,
                                         .key = p.key,
                                         .size = p.size,
                                         .checksum = p.checksum,
                                         .mac = p.mac};
      REFIT_ASSIGN_OR_RETURN(
          ValidatedPayload payload,
          internal::FetchVerifiedPayload(client, config, manifest, options.session.limits));
      report.bytes += payload.size();
      ++report.payloads;
      REFIT_RETURN_NOT_OK(session.Stage(std::move(payload)).status());
    }
    FlushOptions flush;
    flush.timeout = options.version_timeout;
    REFIT_ASSIGN_OR_RETURN(const FlushReport flushed, session.Flush(version.transfer_id, flush));
    const uint64_t fingerprint = StateFingerprint(flushed.digests);
    if (fingerprint != version.state_fingerprint) {
      return DataLoss("state fingerprint {} after replay differs from the recorded {}",
                      DigestHex(fingerprint), DigestHex(version.state_fingerprint));
    }
    return session.Commit(version.transfer_id);
  };
  Status replayed = replay();
  if (!replayed.ok()) {
    session.Abort(version.transfer_id).IgnoreError();
    return replayed.WithContext(where);
  }
  return Status::OK();
}

// The position of the newest version of the active chain that a store at `version` with
// `fingerprint` provably holds, if any.
std::optional<size_t> HeldVersion(const ChainIndex& index, uint64_t version, uint64_t fingerprint) {
  std::optional<size_t> held;
  for (size_t i = index.ActiveAnchor(); i < index.versions.size(); ++i) {
    if (index.versions[i].version == version &&
        index.versions[i].state_fingerprint == fingerprint) {
      held = i;
    }
  }
  return held;
}

}  // namespace

Result<ChainBootstrapReport> BootstrapFromChain(std::string_view s3_uri, WeightStore& store,
                                                const ChainBootstrapOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(const OpenedChain chain, OpenAndReadChain(s3_uri));
  const internal::S3TransportConfig& config = chain.config;
  S3Client& client = *chain.client;
  const ChainIndex& index = chain.index;
  const size_t anchor = index.ActiveAnchor();
  if (anchor == index.versions.size()) {
    return NotFound("chain at s3://{}/{} has no committed version yet", config.client.bucket,
                    config.prefix);
  }

  ChainBootstrapReport report;
  report.start_version = store.version();
  // Replay only the deltas after the store's version when it provably holds that version.
  const std::optional<size_t> held =
      HeldVersion(index, store.version(), StateFingerprint(store.Digests()));
  const size_t first = held.has_value() ? *held + 1 : anchor;
  if (first == anchor) {
    // The anchor overwrites every tensor, whatever version the store claims.
    store.set_version(index.versions[anchor].base_version);
    report.replayed_anchor = true;
  }
  REFIT_LOG_INFO("chain s3://{}/{}: store at version {}; replaying {} version(s) from {}",
                 config.client.bucket, config.prefix, report.start_version,
                 index.versions.size() - first,
                 first < index.versions.size() ? index.versions[first].version : store.version());
  if (first < index.versions.size()) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::ReceiverSession> session,
                           internal::ReceiverSession::Make(options.session, store));
    for (size_t i = first; i < index.versions.size(); ++i) {
      Status replayed = ReplayVersion(index.versions[i], config, client, *session, options, report);
      if (!replayed.ok()) {
        if (i == first && report.replayed_anchor) {
          // Rolled back to the bytes it held: give back the version it held them at.
          session.reset();
          store.set_version(report.start_version);
        }
        return replayed;
      }
      ++report.versions_replayed;
      if (options.on_version) options.on_version(index.versions[i]);
    }
  }
  report.final_version = store.version();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

Result<ChainBootstrapReport> CatchUpFromChain(std::string_view s3_uri,
                                              internal::ReceiverSession& session,
                                              const WeightStore& store, uint64_t target_version,
                                              const ChainBootstrapOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(const OpenedChain chain, OpenAndReadChain(s3_uri));
  const internal::S3TransportConfig& config = chain.config;
  S3Client& client = *chain.client;
  const ChainIndex& index = chain.index;
  const std::string where = fmt::format("chain s3://{}/{}", config.client.bucket, config.prefix);
  const ReceiverStatus status = session.GetStatus();
  if (status.state != ReceiverState::kIdle) {
    return FailedPrecondition("{}: cannot catch up while transfer {} is {}", where,
                              status.transfer_id.value_or(TransferId{}).ToHex(),
                              ReceiverStateName(status.state));
  }
  // Only deltas can be replayed into a live session: it must provably hold a version of the
  // active chain (an anchor would need the store reset, which only a bootstrap at start does).
  const uint64_t fingerprint = StateFingerprint(store.Digests());
  const std::optional<size_t> held = HeldVersion(index, status.version, fingerprint);
  if (!held.has_value()) {
    return FailedPrecondition(
        "{}: this receiver's version {} (state fingerprint {}) is not a version of the active "
        "chain; restart it with --bootstrap to replay from the anchor",
        where, status.version, DigestHex(fingerprint));
  }
  if (index.versions.back().version < target_version) {
    return NotFound("{}: its newest version is {}, not {} yet", where,
                    index.versions.back().version, target_version);
  }
  ChainBootstrapReport report;
  report.start_version = status.version;
  for (size_t i = *held + 1; i < index.versions.size(); ++i) {
    if (index.versions[i].version > target_version) break;
    REFIT_RETURN_NOT_OK(ReplayVersion(index.versions[i], config, client, session, options, report));
    ++report.versions_replayed;
    if (options.on_version) options.on_version(index.versions[i]);
  }
  report.final_version = session.GetStatus().version;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace refit
