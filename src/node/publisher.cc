#include "refit/publisher.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "codec/delta_history.h"
#include "codec/tracker.h"
#include "control/fleet_roster.h"
#include "control/membership_server.h"
#include "control/protocol.h"
#include "core/digest.h"
#include "node/group_protocol.h"
#include "pipeline/coordinator.h"
#include "pipeline/piece_source.h"
#include "pipeline/producer_stream.h"
#include "pipeline/quorum.h"
#include "pipeline/staged_source.h"
#include "pipeline/staging_pool.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/transport_internal.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_annotations.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
using internal::BoxDigestsFromJson;
using internal::BoxDigestsToJson;
using internal::DigestHex;
using internal::DigestsFromJson;
using internal::DigestsToJson;
using internal::GroupMessage;
using internal::Json;
using internal::kGroupProtocolVersion;
using internal::kOpAbort;
using internal::kOpBegin;
using internal::kOpCommit;
using internal::kOpPropose;
using internal::kOpStream;
using internal::ParseGroupMessage;
using internal::PlanFromJson;
using internal::RoutesFromJson;
using internal::RoutesToJson;
using internal::StatusFromJson;
using internal::StatusToJson;
using internal::StreamReportFromJson;
using internal::StreamReportToJson;

// How long rank 0 tries to tell the other ranks to abort: they stop waiting for its word on
// their own (LeaderSilenceDeadline) anyway, so this only needs to cover a live link (a rank whose
// link is down is waited for this long, in case it is reconnecting).
constexpr std::chrono::seconds kAbortNoticeBudget{1};
// What rank 0 may spend on a commit's calls after a flush (the coordinator's decision margin).
constexpr std::chrono::seconds kCommitMargin{1};

// The bytes read so far from the device tensors among `tensors` (their boundaries count them).
uint64_t DeviceReadBytes(std::span<const ExportTensor> tensors) {
  uint64_t bytes = 0;
  for (const ExportTensor& tensor : tensors) {
    if (tensor.device != nullptr) bytes += tensor.device->traffic().from_device_bytes;
  }
  return bytes;
}

}  // namespace

// This rank's own producer: its tracker, stream and transport. Both rank 0 and the other ranks
// drive it, rank 0 inline and the others from rank 0's messages.
struct PublisherRank {
  PublisherOptions options;
  std::unique_ptr<ProducerGroup> group;
  std::unique_ptr<internal::DeltaTracker> tracker;
  // The deltas this rank committed, for folding (null: it keeps none); opened, committed and
  // aborted with the tracker, cleared when the tracker is rebuilt.
  std::unique_ptr<DeltaHistory> history;
  std::unique_ptr<ProducerStream> stream;
  // The stream of a sharded Sync: the source yields only this rank's boxes, all of them its own.
  std::unique_ptr<ProducerStream> piece_stream;
  std::unique_ptr<Transport> transport;
  // The world size this rank last committed under: ownership (k % W) moves when W changes, so
  // the baseline is then rebuilt by an anchor.
  uint32_t committed_world = 0;
  // This rank does not know which version its state is: it has committed nothing, or adopted a
  // baseline without being told the version (a rank that cannot ask the fleet). The first plan's
  // base version labels it; rank 0 takes that base from the ranks that know, else from the
  // receivers, so versions only move forward.
  bool version_unknown = true;
  // The open transfer's plan and data endpoints, between begin and commit/abort.
  std::optional<TransferPlan> open;
  std::vector<std::string> endpoints;
  std::optional<StreamReport> streamed;
  // The host buffers device tensors are staged through, kept between Syncs while the budget they
  // need stays the same; null until a Sync stages.
  std::shared_ptr<StagingPool> staging;
  // Rank 0 with PublisherOptions::membership: the fleet (configured and joined members) and the
  // endpoint that changes it; LeadTransfer snapshots it at each Sync's start.
  std::unique_ptr<internal::FleetRoster> roster;
  std::unique_ptr<internal::MembershipServer> membership_server;

  // ---- A sharded Sync (Publisher::Sync(const ShardedModel&)). ----------------------------------
  // The model of the Sync in flight, and its local tensors by name; null for a whole-model Sync.
  const ShardedModel* sharded = nullptr;
  std::map<std::string, ExportTensor> sharded_locals;
  Status sharded_status;
  uint64_t sharded_layout_digest = 0;
  // Whether the last commit was of a sharded Sync: the tracker's baselines are boxes then,
  // whole tensors otherwise, so switching rebuilds them with an anchor.
  std::optional<bool> committed_sharded;
  // This rank's role for each of its pieces in the open transfer, from rank 0's plan.
  std::vector<PieceRole> roles;
  // The digests of the boxes this rank sent or holds a copy of, reported after its stream.
  std::vector<BoxDigest> streamed_boxes;
  // Rank 0: every rank's layout as last received, with its digest, the plan of the open
  // transfer, and a digest of the plan last committed (a new plan moves boxes between ranks,
  // whose trackers then need an anchor).
  std::vector<std::optional<std::pair<uint64_t, ProducerLayout>>> known_layouts;
  LayoutPlan layout_plan;
  uint64_t open_plan_digest = 0;
  uint64_t committed_plan_digest = 0;
  // Rank 0 adopted a sharded baseline (it restarted): the next plan is taken as the one the
  // adopted checkpoint was sent under, rather than a new plan that needs an anchor.
  bool adopted_plan = false;

  // ---- Lineage (docs/protocol.md "Lineage and fencing"); rank 0 decides, the others ignore it.
  // The run and epoch every Prepare states: the run fixed at Make (empty while a resume takes
  // the fleet's), the epoch of a resumed run once the first Sync asked the fleet.
  std::string run_id;
  uint64_t epoch = 0;
  bool lineage_decided = false;
  // Whether a transfer of this lineage committed: the fleet was this trainer's since.
  bool committed_in_run = false;
  // The StateFingerprint of the producers' state at fingerprint_version, which a delta from that
  // version states as its base fingerprint; 0: not known (W > 1 ranks that adopted a
  // checkpoint know only their own tensors' digests).
  uint64_t base_fingerprint = 0;
  uint64_t fingerprint_version = 0;

  // Decide the run and epoch from what the receivers hold (`held`, one per receiver, named by
  // `names`), at the first Sync. Errors: InvalidArgument for a resume with no run id whose
  // receivers hold several runs; FailedPrecondition for a run id the fleet holds given without
  // resume.
  Status DecideLineage(const std::vector<std::string>& names, const std::vector<HeldLineage>& held);

  StagingReport Staging(uint64_t staged_bytes) const {
    StagingReport report;
    report.staged_bytes = staged_bytes;
    if (staging != nullptr) {
      report.budget_bytes = staging->budget_bytes();
      report.peak_held_bytes = staging->stats().peak_held_bytes;
    }
    return report;
  }

  // The staging pool for a Sync that stages chunks of up to `needed` device bytes (null when 0).
  std::shared_ptr<StagingPool> StagingFor(uint64_t needed) {
    if (needed == 0) return nullptr;
    const uint64_t budget = options.staging_bytes != 0 ? options.staging_bytes : 2 * needed;
    if (staging == nullptr || staging->budget_bytes() != budget) {
      staging = std::make_shared<StagingPool>(budget);
    }
    return staging;
  }

  uint32_t rank() const { return group->rank(); }
  uint32_t world() const { return group->world_size(); }
  Clock::time_point Deadline() const { return Clock::now() + options.transfer_timeout; }
  // How long a follower waits for rank 0's next word. Between two words rank 0 may wait out a
  // whole flush (the transfer timeout, then the control timeout for the flush's reply) and then
  // the commit's calls: a follower that gave up after the transfer timeout alone would leave a
  // commit that the receivers already made without its tracker.
  Clock::time_point LeaderSilenceDeadline() const {
    return Clock::now() + options.transfer_timeout + options.control.timeout + kCommitMargin;
  }

  // ---- This rank's part of each op. -------------------------------------------------------------

  Result<Json> Propose(const Json& request) {
    REFIT_RETURN_NOT_OK(sharded_status);
    if (committed_sharded.has_value() && *committed_sharded != (sharded != nullptr)) {
      REFIT_LOG_INFO(
          "publisher rank {}: a {} sync after a {} one: rebuilding the baseline with an anchor",
          rank(), sharded ? "sharded" : "whole-model",
          *committed_sharded ? "sharded" : "whole-model");
      REFIT_ASSIGN_OR_RETURN(tracker, internal::DeltaTracker::Make(options.tracker));
      if (history != nullptr) history->Clear();
      committed_sharded.reset();
      committed_world = 0;
      version_unknown = true;
    }
    if (committed_world != 0 && committed_world != world()) {
      // Chunks moved between ranks: start from an empty baseline at the next anchor.
      REFIT_LOG_INFO(
          "publisher rank {}: the group has {} ranks, {} at the last commit: "
          "rebuilding the baseline with an anchor",
          rank(), world(), committed_world);
      REFIT_ASSIGN_OR_RETURN(tracker, internal::DeltaTracker::Make(options.tracker));
      if (history != nullptr) history->Clear();
      committed_world = 0;
      version_unknown = true;
    }
    Json reply = GroupMessage(kOpPropose);
    reply["ok"] = true;
    reply["version"] = tracker->version();
    reply["version_known"] = !version_unknown;
    reply["wants_anchor"] = tracker->NextIsAnchor();
    reply["open"] = tracker->open_transfer().has_value();
    reply["sharded"] = sharded != nullptr;
    if (sharded != nullptr) {
      // The layout travels only when rank 0 does not hold this one already.
      const auto known = request.value("layouts_known", std::vector<std::string>());
      const std::string digest = DigestHex(sharded_layout_digest);
      reply["layout_digest"] = digest;
      if (rank() >= known.size() || known[rank()] != digest) {
        reply["layout"] = internal::LayoutToJson(sharded->layout);
      }
    }
    return reply;
  }

  // Take the sharded model of the Sync about to run (null: a whole-model Sync) and check its
  // layout and local tensors. A bad one fails this rank's proposal, which rank 0 reports by name,
  // rather than leaving the other ranks to wait for a rank that never answers.
  void SetSharded(const ShardedModel* model) {
    sharded = model;
    sharded_locals.clear();
    sharded_status = Status::OK();
    if (model == nullptr) return;
    // The errors reach rank 0 in this rank's proposal, which names the rank.
    sharded_status = CheckLayout(model->layout);
    if (!sharded_status.ok()) return;
    Result<std::map<std::string, ExportTensor>> locals = LocalsOf(model->layout, model->locals);
    if (!locals.ok()) {
      sharded_status = locals.status();
      return;
    }
    sharded_locals = *std::move(locals);
    sharded_layout_digest = internal::LayoutDigest(model->layout);
  }

  // `full_self`: this rank sends its boxes FULL inside a delta transfer (it has no baseline).
  Status Begin(const TransferPlan& plan, std::vector<std::string> fleet,
               const std::vector<std::string>& all_roles, bool full_self = false) {
    roles.clear();
    if (sharded != nullptr) {
      const std::string where = fmt::format("rank {}", rank());
      if (rank() >= all_roles.size()) {
        return InvalidArgument("{}: rank 0's plan has roles for {} ranks", where, all_roles.size());
      }
      REFIT_ASSIGN_OR_RETURN(roles, internal::RolesFromString(
                                        all_roles[rank()], sharded->layout.pieces.size(), where));
      // The tracker keeps each box this rank sends in the box's own numbering; a box it adopted
      // but another rank sends (AdoptBaseline of a sharded model) is dropped.
      for (size_t i = 0; i < roles.size(); ++i) {
        const LayoutPiece& piece = sharded->layout.pieces[i];
        if (roles[i] != PieceRole::kSend) {
          REFIT_RETURN_NOT_OK(tracker->Forget(PieceKey(piece)));
          continue;
        }
        REFIT_RETURN_NOT_OK(tracker->Place(PieceKey(piece), PieceBox(piece), piece.extent));
      }
    }
    if (version_unknown) {
      REFIT_RETURN_NOT_OK(tracker->Rebase(plan.base_version));
      version_unknown = false;
    }
    TransferPlan own = plan;
    own.anchor = plan.anchor || full_self;
    REFIT_RETURN_NOT_OK(tracker->BeginPlanned(own).status());
    if (history != nullptr) history->Begin(own.base_version, own.anchor);
    open = plan;
    endpoints = std::move(fleet);
    streamed.reset();
    return Status::OK();
  }

  // What this rank's Begin reply adds: the oldest version it can fold from (absent: none).
  void PutFoldable(Json& reply) const {
    if (history == nullptr) return;
    if (const std::optional<uint64_t> oldest = history->oldest_version()) {
      reply["fold_from"] = *oldest;
    }
  }

  // Stream this rank's share through one sender per route (routing by holdings; one route of
  // the whole fleet otherwise), each finished with its route's payload count.
  Result<internal::ProducerStreamed> Stream(const ChunkSource& source, Clock::time_point deadline,
                                            std::span<const TransferRoute> routes) {
    if (!open.has_value()) return FailedPrecondition("publisher rank {}: no open transfer", rank());
    if (routes.empty()) return InvalidArgument("publisher rank {}: no routes", rank());
    std::vector<std::unique_ptr<TransportSender>> senders;
    std::vector<StreamRoute> stream_routes;
    for (const TransferRoute& route : routes) {
      SenderContext context;
      context.transfer_id = open->transfer_id;
      context.producer_id = rank();
      context.base_version =
          route.content != CatchUp::kDelta ? route.from_version : open->base_version;
      context.target_version = open->target_version;
      context.endpoints = route.endpoints.empty() ? endpoints : route.endpoints;
      context.anchor = open->anchor;
      context.deadline = deadline;
      REFIT_ASSIGN_OR_RETURN(std::unique_ptr<TransportSender> sender,
                             transport->MakeSender(context));
      TransportSender* channel = sender.get();
      senders.push_back(std::move(sender));
      stream_routes.push_back(StreamRoute{
          route.items.get(),
          [this, channel, deadline](uint32_t payload_id, std::span<const std::byte> payload) {
            REFIT_RETURN_NOT_OK(CheckCancelled(fmt::format("before payload {}", payload_id)));
            if (Clock::now() > deadline) {
              return DeadlineExceeded("payload {}: the transfer passed its deadline", payload_id);
            }
            return channel->Send(payload_id, payload);
          },
          channel->AsSenderCleanup(), route.content, route.from_version});
    }
    const auto finish = [&](const StreamReport& report) -> Status {
      for (size_t k = 0; k < senders.size(); ++k) {
        REFIT_RETURN_NOT_OK(senders[k]->Finish(report.routes[k].payloads).WithContext("finish"));
      }
      return Status::OK();
    };
    if (sharded == nullptr) {
      REFIT_ASSIGN_OR_RETURN(StreamReport report,
                             stream->Run(*tracker, source, stream_routes, history.get()));
      REFIT_RETURN_NOT_OK(finish(report));
      streamed = report;
      return internal::ProducerStreamed{std::move(report), tracker->PendingDigests()};
    }
    const ChunkSource pieces =
        SentPiecesSource(sharded->layout, roles, sharded_locals, options.stream.chunk_bytes,
                         StagingFor(StagingBytesNeeded(sharded->layout, roles, sharded_locals,
                                                       options.stream.chunk_bytes)));
    REFIT_ASSIGN_OR_RETURN(StreamReport report,
                           piece_stream->Run(*tracker, pieces, stream_routes, history.get()));
    REFIT_RETURN_NOT_OK(finish(report));
    streamed = report;
    REFIT_ASSIGN_OR_RETURN(streamed_boxes, BoxDigests());
    return internal::ProducerStreamed{std::move(report), {}};
  }

  // The canonical digest of every box this rank holds: what its tracker will commit for the boxes
  // it sent, and a hash of its local tensor for the copies (rank 0 compares them, CheckCopies).
  Result<std::vector<BoxDigest>> BoxDigests() const {
    const std::map<std::string, uint64_t> pending = tracker->PendingDigests();
    std::vector<BoxDigest> boxes;
    for (size_t i = 0; i < roles.size(); ++i) {
      const LayoutPiece& piece = sharded->layout.pieces[i];
      if (roles[i] == PieceRole::kSend) {
        auto it = pending.find(PieceKey(piece));
        if (it == pending.end()) {
          return Internal("rank {}: piece {} was sent but its tracker has no digest for it", rank(),
                          piece.ToString());
        }
        boxes.push_back(BoxDigest{piece.tensor, piece.offset, rank(), it->second});
      } else if (roles[i] == PieceRole::kCopy) {
        REFIT_ASSIGN_OR_RETURN(const uint64_t digest,
                               CopyDigest(piece, sharded_locals.at(piece.local), staging.get()));
        boxes.push_back(BoxDigest{piece.tensor, piece.offset, rank(), digest});
      }
    }
    return boxes;
  }

  Status Commit(const TransferId& id) {
    if (Status committed = tracker->Commit(id); !committed.ok()) {
      if (history != nullptr) history->Abort();
      return committed;
    }
    if (history != nullptr) history->Commit();
    committed_sharded = sharded != nullptr;
    committed_world = world();
    version_unknown = false;
    open.reset();
    return Status::OK();
  }

  void Abort(const TransferId& id) {
    if (tracker->open_transfer().has_value()) tracker->Abort(id).IgnoreError();
    if (history != nullptr) history->Abort();
    open.reset();
  }

  // ---- Ranks ≥ 1: follow rank 0.
  // -----------------------------------------------------------------

  Result<SyncReport> Follow(const ChunkSource& source);
  // ---- Rank 0: coordinate.
  // -----------------------------------------------------------------------

  Result<SyncReport> Lead(const ChunkSource& source, bool force_anchor);
  Result<SyncReport> LeadTransfer(const ChunkSource& source, bool force_anchor);
  // Rank 0: the canonical tensors of the last Sync, which the next one routes by when its
  // producers do not know theirs.
  std::vector<std::string> routed_tensors;
  // Rank 0: receivers fenced under a quorum whose Abort did not get through, by control URL, and
  // the transfer they were fenced from. The next Sync sends that Abort again before its prepare,
  // so a fenced transfer still live there (its receiver resumed) cannot hold the prepare up.
  std::map<std::string, TransferId> unresolved_fences;
  // The names of the tensor list this Sync was given (Sync(std::vector<TensorView>)); empty for
  // a chunk source.
  std::vector<std::string> listed_tensors;
  // Set once rank 0 told the other ranks to abort the current Sync.
  bool told_abort = false;
  // Publisher::Cancel: in_sync says a Sync is in flight; cancel_requested, set only then (under
  // cancel_mutex, so that a Cancel racing the end of a Sync cannot leak into the next one), is
  // read without the lock by every phase boundary and before each payload.
  internal::Mutex cancel_mutex;
  bool in_sync REFIT_GUARDED_BY(cancel_mutex) = false;
  std::atomic<bool> cancel_requested{false};

  Status CheckCancelled(std::string_view where) const {
    if (!cancel_requested.load(std::memory_order_relaxed)) return Status::OK();
    return Cancelled("publisher rank {}: the sync was cancelled (Publisher::Cancel) {}", rank(),
                     where);
  }
};

namespace {

// Rank 0's view of the W ranks as one ProducerSet: every op is a broadcast, every answer a gather.
class GroupProducers final : public internal::ProducerSet {
 public:
  // `per_receiver`: the coordinator plans each receiver (per-receiver plans), so a receiver
  // behind the base no longer makes the transfer an anchor.
  // `lineage_versions`: those of `receiver_versions` held by receivers of rank 0's lineage (or
  // of none), the only ones a transfer is rebased on.
  GroupProducers(PublisherRank& self, const ChunkSource& source, std::vector<std::string> endpoints,
                 std::vector<uint64_t> receiver_versions, std::vector<uint64_t> lineage_versions,
                 bool per_receiver)
      : self_(self),
        source_(source),
        endpoints_(std::move(endpoints)),
        receiver_versions_(std::move(receiver_versions)),
        lineage_versions_(std::move(lineage_versions)),
        per_receiver_(per_receiver) {}

  uint32_t size() const override { return self_.world(); }
  uint64_t version() const override { return self_.tracker->version(); }

  Result<TransferPlan> Begin(const TransferId& id, bool force_anchor) override {
    if (Status cancelled = self_.CheckCancelled("before the transfer began"); !cancelled.ok()) {
      Abort(id);
      return cancelled;
    }
    // 1. Every rank proposes (its version and cadence, its layout if sharded); rank 0 decides one
    // plan for all.
    Json propose = GroupMessage(kOpPropose);
    if (self_.sharded != nullptr) {
      self_.known_layouts.resize(size());
      std::vector<std::string> known;
      for (const auto& layout : self_.known_layouts) {
        known.push_back(layout.has_value() ? DigestHex(layout->first) : std::string());
      }
      propose["layouts_known"] = known;
    }
    Result<Json> own = self_.Propose(propose);
    Result<std::vector<Json>> collected =
        Collect(propose, own.ok() ? *own : StatusToJson(own.status()));
    Status proposed = collected.ok() ? FirstFailure(*collected) : collected.status();
    if (!proposed.ok()) {
      Abort(id);
      return proposed;
    }
    const std::vector<Json>& proposals = *collected;
    bool anchor = force_anchor;
    std::optional<uint64_t> known;
    // A sharded rank that wants an anchor (it restarted: no baseline) sends its own boxes FULL
    // inside the others' delta, instead of re-anchoring the whole fleet for one rank; the
    // transfer is an anchor only when every rank wants one.
    const bool sharded = self_.sharded != nullptr;
    std::vector<uint32_t> full_ranks;
    for (uint32_t r = 0; r < proposals.size(); ++r) {
      if (proposals[r].value("open", false)) {
        Abort(id);
        return FailedPrecondition("rank {} has a transfer open", r);
      }
      if (proposals[r].value("version_known", true)) {
        known = std::max(known.value_or(0), proposals[r].value("version", uint64_t{0}));
      }
      if (proposals[r].value("wants_anchor", true)) full_ranks.push_back(r);
    }
    if (!sharded || full_ranks.size() == proposals.size()) {
      anchor = anchor || !full_ranks.empty();
      full_ranks.clear();
    }
    // No rank knows its version (all adopted a checkpoint): the receivers' is the base.
    uint64_t base = known.value_or(0);
    uint64_t newest_held = 0;
    // A trainer that knows no version starts above every version held, of any lineage: a new
    // lineage anchors there. A known version is rebased only on this lineage's receivers:
    // another run's versions are not this trainer's to continue, and a transfer to one of them
    // is refused by its receivers (docs/protocol.md "Lineage and fencing").
    for (uint64_t held : known.has_value() ? lineage_versions_ : receiver_versions_) {
      newest_held = std::max(newest_held, held);
    }
    if (!known.has_value()) {
      base = std::max(base, newest_held);
    } else if (newest_held > base) {
      // A receiver committed a version no rank knows: rank 0 stopped after committing some
      // receivers and before the trackers (the other ranks dropped their pending bits). That
      // transfer was decided, so the next one is based on it: receivers still prepared for it
      // commit implicitly instead of rolling back, versions only move forward, and the anchor
      // rebuilds every tracker's baseline.
      REFIT_LOG_INFO(
          "transfer {}: a receiver holds version {}, newer than the producers' {}: an anchor "
          "based on it",
          id.ToHex(), newest_held, base);
      base = newest_held;
      anchor = true;
    }
    for (uint32_t r = 0; r < proposals.size(); ++r) {
      const uint64_t version = proposals[r].value("version", uint64_t{0});
      if (proposals[r].value("version_known", true) && version != base && !anchor) {
        REFIT_LOG_INFO("transfer {}: rank {} is at version {}, the others at {}: an anchor",
                       id.ToHex(), r, version, base);
        anchor = true;
      }
    }
    for (uint64_t held : receiver_versions_) {
      if (held != base && !anchor && !per_receiver_) {
        REFIT_LOG_INFO("transfer {}: a receiver holds version {}, the producers {}: an anchor",
                       id.ToHex(), held, base);
        anchor = true;
      }
    }
    std::vector<std::string> roles;
    if (Status planned = PlanPieces(proposals, roles); !planned.ok()) {
      Abort(id);
      return planned;
    }
    if (self_.sharded != nullptr && self_.adopted_plan) {
      // Rank 0 restarted and adopted the checkpoint the fleet holds: the plan it was sent under
      // is this one (the flush's digests check that).
      self_.committed_plan_digest = self_.open_plan_digest;
      self_.adopted_plan = false;
    }
    if (self_.sharded != nullptr && self_.open_plan_digest != self_.committed_plan_digest &&
        !anchor) {
      REFIT_LOG_INFO("transfer {}: the ranks' layouts or the boxes they send changed: an anchor",
                     id.ToHex());
      anchor = true;
    }
    plan_ = TransferPlan{id, anchor, base, base + 1};
    if (anchor) full_ranks.clear();
    for (uint32_t r : full_ranks) {
      REFIT_LOG_INFO("transfer {}: rank {} has no baseline: it sends its boxes FULL", id.ToHex(),
                     r);
    }
    // 2. Every rank opens that plan.
    Json begin = GroupMessage(kOpBegin);
    begin["transfer_id"] = id.ToHex();
    begin["anchor"] = anchor;
    begin["base_version"] = base;
    begin["target_version"] = base + 1;
    begin["endpoints"] = endpoints_;
    if (!roles.empty()) begin["roles"] = roles;
    if (!full_ranks.empty()) begin["full_ranks"] = full_ranks;
    const bool full_self = std::find(full_ranks.begin(), full_ranks.end(), 0u) != full_ranks.end();
    const Status opened = self_.Begin(plan_, endpoints_, roles, full_self);
    Json own_reply = StatusToJson(opened);
    if (opened.ok()) self_.PutFoldable(own_reply);
    Result<std::vector<Json>> replies = Collect(begin, own_reply);
    Status failed = replies.ok() ? FirstFailure(*replies) : replies.status();
    if (!failed.ok()) {
      Abort(id);
      return failed;
    }
    // Every rank folds from its own oldest retained version: the fleet from the newest of them.
    fold_from_.reset();
    for (const Json& reply : *replies) {
      const auto oldest = reply.find("fold_from");
      if (oldest == reply.end() || !oldest->is_number_unsigned()) {
        fold_from_.reset();
        break;
      }
      fold_from_ = std::max(fold_from_.value_or(0), oldest->get<uint64_t>());
    }
    return plan_;
  }

  std::optional<uint64_t> FoldableFrom() const override { return fold_from_; }

  Result<std::vector<internal::ProducerStreamed>> Stream(const TransferPlan& plan,
                                                         std::span<const TransferRoute> routes,
                                                         Clock::time_point deadline) override {
    REFIT_RETURN_NOT_OK(self_.CheckCancelled("before the stream"));
    Json stream = GroupMessage(kOpStream);
    stream["routes"] = RoutesToJson(routes);
    REFIT_RETURN_NOT_OK(
        self_.group->Broadcast(stream.dump(), deadline).status().WithContext("rank 0: stream"));
    Result<internal::ProducerStreamed> own = self_.Stream(source_, deadline, routes);
    // Rank 0's own results stay as they are; only the other ranks' travel as JSON (rank 0's
    // part of the gather is never read).
    REFIT_ASSIGN_OR_RETURN(std::vector<std::string> gathered,
                           self_.group->Gather(std::string(), deadline));
    std::vector<internal::ProducerStreamed> results(gathered.size());
    std::vector<Status> failures;
    std::vector<BoxDigest> boxes;
    if (own.ok()) {
      results[0] = *std::move(own);
      if (self_.sharded != nullptr) boxes = self_.streamed_boxes;
    } else {
      failures.push_back(own.status().WithContext("rank 0"));
    }
    for (uint32_t r = 1; r < gathered.size(); ++r) {
      const std::string where = fmt::format("rank {}", r);
      Result<Json> reply = ParseGroupMessage(gathered[r], where);
      if (!reply.ok()) {
        failures.push_back(reply.status());
        continue;
      }
      if (Status st = StatusFromJson(*reply, where); !st.ok()) {
        failures.push_back(st);
        continue;
      }
      results[r].report = StreamReportFromJson(reply->value("report", Json::object()));
      Result<std::map<std::string, uint64_t>> digests =
          DigestsFromJson(reply->value("digests", Json::object()), where);
      if (!digests.ok()) {
        failures.push_back(digests.status());
        continue;
      }
      results[r].digests = *std::move(digests);
      if (self_.sharded != nullptr) {
        Result<std::vector<BoxDigest>> reported =
            BoxDigestsFromJson(reply->value("boxes", Json::array()), r, where);
        if (!reported.ok()) {
          failures.push_back(reported.status());
          continue;
        }
        boxes.insert(boxes.end(), reported->begin(), reported->end());
      }
    }
    if (failures.empty() && self_.sharded != nullptr) {
      // The copies of every box must agree with its sender; the boxes' digests add up to each
      // tensor's, which rank 0 declares for the whole group (the receivers' flush check).
      Result<std::vector<std::pair<std::string, uint64_t>>> totals =
          CheckCopies(self_.layout_plan, boxes);
      if (!totals.ok()) return totals.status();
      for (internal::ProducerStreamed& result : results) result.digests.clear();
      results[0].digests = std::map<std::string, uint64_t>(totals->begin(), totals->end());
    }
    if (!failures.empty()) {
      // A refusal explains the cancellations it caused elsewhere: report it first.
      std::stable_sort(failures.begin(), failures.end(), [](const Status& a, const Status& b) {
        auto rank = [](StatusCode code) {
          return code == StatusCode::kCancelled || code == StatusCode::kDeadlineExceeded ? 1 : 0;
        };
        return rank(a.code()) < rank(b.code());
      });
      std::string message(failures.front().message());
      for (size_t i = 1; i < failures.size(); ++i) {
        message += "; also " + failures[i].ToString();
      }
      return Status(failures.front().code(), std::move(message));
    }
    return results;
  }

  // A sharded Sync's plan names every canonical tensor; a whole-model Sync of a tensor list
  // knows them from the list (each rank passes the whole model).
  std::vector<std::string> TensorNames() const override {
    if (self_.sharded == nullptr) return self_.listed_tensors;
    std::vector<std::string> names;
    for (const PlannedTensor& tensor : self_.layout_plan.tensors) names.push_back(tensor.name);
    return names;
  }

  Status Commit(const TransferId& id) override {
    const Status own = self_.Commit(id);
    if (own.ok()) self_.committed_plan_digest = self_.open_plan_digest;
    REFIT_ASSIGN_OR_RETURN(std::vector<Json> replies,
                           Collect(GroupMessage(kOpCommit), StatusToJson(own)));
    return FirstFailure(replies);
  }

  void Abort(const TransferId& id) override {
    self_.Abort(id);
    self_.told_abort = true;
    Json abort = GroupMessage(kOpAbort);
    abort["transfer_id"] = id.ToHex();
    // Best effort: a rank that is gone has nothing to abort, and one that missed this word
    // gives up on its own at the transfer timeout.
    Result<std::string> told =
        self_.group->Broadcast(abort.dump(), Clock::now() + kAbortNoticeBudget);
    if (!told.ok()) {
      REFIT_LOG_WARN("transfer {}: not every rank heard the abort: {}", id.ToHex(),
                     told.status().ToString());
    }
  }

 private:
  // A sharded Sync: take each rank's layout (from its proposal, or as rank 0 kept it), plan
  // which rank sends each distinct box, and return every rank's roles. Refused before anything
  // is sent: a rank syncing the other way, a gap, an overlap, a tensor the ranks disagree on.
  Status PlanPieces(const std::vector<Json>& proposals, std::vector<std::string>& roles) {
    const bool sharded = self_.sharded != nullptr;
    for (uint32_t r = 0; r < proposals.size(); ++r) {
      if (proposals[r].value("sharded", false) != sharded) {
        return FailedPrecondition(
            "rank {} syncs {} and rank 0 {}: every rank of a Sync passes the same kind of model", r,
            sharded ? "a whole model" : "a sharded model",
            sharded ? "a sharded one" : "a whole one");
      }
    }
    if (!sharded) return Status::OK();
    std::vector<ProducerLayout> layouts;
    uint64_t plan_digest = 0;
    for (uint32_t r = 0; r < proposals.size(); ++r) {
      const std::string where = fmt::format("rank {}", r);
      auto& known = self_.known_layouts[r];
      if (r == 0) {
        known.emplace(self_.sharded_layout_digest, self_.sharded->layout);
      } else if (auto layout = proposals[r].find("layout"); layout != proposals[r].end()) {
        REFIT_ASSIGN_OR_RETURN(ProducerLayout parsed, internal::LayoutFromJson(*layout, where));
        known.emplace(internal::LayoutDigest(parsed), std::move(parsed));
      }
      const std::string digest = proposals[r].value("layout_digest", std::string());
      if (!known.has_value() || DigestHex(known->first) != digest) {
        return InvalidArgument("{}: its layout (digest {}) did not arrive", where, digest);
      }
      layouts.push_back(known->second);
      plan_digest = plan_digest * 0x9E3779B97F4A7C15ull + known->first;
    }
    REFIT_ASSIGN_OR_RETURN(self_.layout_plan, PlanLayouts(layouts));
    roles.clear();
    for (const std::vector<PieceRole>& rank_roles : self_.layout_plan.roles) {
      roles.push_back(internal::RolesToString(rank_roles));
      for (char c : roles.back()) plan_digest = plan_digest * 31 + static_cast<uint8_t>(c);
    }
    self_.open_plan_digest = plan_digest;
    return Status::OK();
  }

  // Broadcast `message`, then gather every rank's reply (rank 0's is `own`).
  Result<std::vector<Json>> Collect(const Json& message, const Json& own) {
    const Clock::time_point deadline = self_.Deadline();
    const std::string op = message.value("op", std::string());
    REFIT_RETURN_NOT_OK(
        self_.group->Broadcast(message.dump(), deadline).status().WithContext("rank 0: " + op));
    Json mine = own;
    mine["protocol"] = kGroupProtocolVersion;
    REFIT_ASSIGN_OR_RETURN(std::vector<std::string> gathered,
                           self_.group->Gather(mine.dump(), deadline));
    std::vector<Json> replies;
    replies.reserve(gathered.size());
    replies.push_back(mine);
    for (uint32_t r = 1; r < gathered.size(); ++r) {
      REFIT_ASSIGN_OR_RETURN(Json reply, ParseGroupMessage(gathered[r], fmt::format("rank {}", r)));
      replies.push_back(std::move(reply));
    }
    return replies;
  }

  static Status FirstFailure(const std::vector<Json>& replies) {
    for (uint32_t r = 0; r < replies.size(); ++r) {
      REFIT_RETURN_NOT_OK(StatusFromJson(replies[r], fmt::format("rank {}", r)));
    }
    return Status::OK();
  }

  PublisherRank& self_;
  const ChunkSource& source_;
  std::vector<std::string> endpoints_;
  std::vector<uint64_t> receiver_versions_;
  std::vector<uint64_t> lineage_versions_;
  const bool per_receiver_;
  TransferPlan plan_;
  std::optional<uint64_t> fold_from_;
};

// Borrow a ProducerSet for one Coordinator (which owns what it is given).
class BorrowedProducers final : public internal::ProducerSet {
 public:
  explicit BorrowedProducers(internal::ProducerSet& inner) : inner_(inner) {}
  uint32_t size() const override { return inner_.size(); }
  uint64_t version() const override { return inner_.version(); }
  Result<TransferPlan> Begin(const TransferId& id, bool force_anchor) override {
    return inner_.Begin(id, force_anchor);
  }
  Result<std::vector<internal::ProducerStreamed>> Stream(const TransferPlan& plan,
                                                         std::span<const TransferRoute> routes,
                                                         Clock::time_point deadline) override {
    return inner_.Stream(plan, routes, deadline);
  }
  std::vector<std::string> TensorNames() const override { return inner_.TensorNames(); }
  std::optional<uint64_t> FoldableFrom() const override { return inner_.FoldableFrom(); }
  Status Commit(const TransferId& id) override { return inner_.Commit(id); }
  void Abort(const TransferId& id) override { inner_.Abort(id); }

 private:
  internal::ProducerSet& inner_;
};

}  // namespace

Result<SyncReport> PublisherRank::Lead(const ChunkSource& source, bool force_anchor) {
  Result<SyncReport> led = LeadTransfer(source, force_anchor);
  if (!led.ok() && !open.has_value() && !told_abort) {
    // Failed before any rank was told anything (a receiver unreachable): the other ranks wait
    // for rank 0's first word; make it an abort rather than leave them to time out.
    Json abort = GroupMessage(kOpAbort);
    abort["transfer_id"] = "";
    group->Broadcast(abort.dump(), Clock::now() + kAbortNoticeBudget).status().IgnoreError();
  }
  told_abort = false;
  return led;
}

Result<SyncReport> PublisherRank::LeadTransfer(const ChunkSource& source, bool force_anchor) {
  // The fleet as it is now: where each receiver sits (replica, shard) and what it holds. Asked
  // at every Sync, so a receiver that restarted or a group that changed is seen at once.
  std::vector<std::unique_ptr<ControlClient>> clients;
  std::vector<internal::CoordinatedReceiver> receivers;
  std::vector<uint64_t> versions;
  std::vector<std::string> fleet;
  const TransportCapabilities caps = transport->capabilities();
  // Catch-up receivers get routes of their own, which only relay trees give them.
  const bool per_receiver = caps.fan_out_tree;
  // Each receiver's control plane: its HTTP server, or the transport's own control channel
  // (mpi://), through the same client and the same JSON.
  std::vector<ControlClientOptions> links;
  if (options.receivers.empty() && caps.carries_control) {
    REFIT_ASSIGN_OR_RETURN(std::vector<TransportReceiver> listed, transport->ListReceivers());
    for (TransportReceiver& receiver : listed) {
      ControlClientOptions link = options.control;
      link.base_url = receiver.name;
      link.carrier = std::move(receiver.carrier);
      links.push_back(std::move(link));
      fleet.push_back(receiver.data_endpoint);
    }
  } else {
    // With a membership endpoint the fleet is the roster as it stands now: one snapshot per
    // Sync, which the begin message carries to every rank.
    std::vector<PublisherReceiver> members = options.receivers;
    if (roster != nullptr) {
      members.clear();
      for (const MemberEndpoint& member : roster->Members()) {
        members.push_back({member.control_url, member.data_endpoint});
      }
      if (members.empty()) {
        return FailedPrecondition(
            "publisher: the fleet has no members: none configured, and none joined at {}",
            membership_server != nullptr ? membership_server->url() : std::string("?"));
      }
    }
    for (const PublisherReceiver& receiver : members) {
      ControlClientOptions link = options.control;
      link.base_url = receiver.control_url;
      links.push_back(std::move(link));
      fleet.push_back(caps.needs_manifest ? receiver.control_url : receiver.data_endpoint);
    }
  }
  // Every receiver's status, asked concurrently: a receiver that does not answer costs one
  // control timeout, not one per receiver.
  std::vector<std::unique_ptr<ControlClient>> asked_clients;
  for (const ControlClientOptions& link : links) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, ControlClient::Make(link));
    asked_clients.push_back(std::move(client));
  }
  std::vector<Result<ControlStatus>> statuses(links.size(), Status(StatusCode::kInternal, "unset"));
  {
    std::vector<std::jthread> askers;
    for (size_t r = 0; r < links.size(); ++r) {
      askers.emplace_back([&, r] { statuses[r] = asked_clients[r]->GetStatus(); });
    }
  }
  // A member of an elastic fleet (membership endpoint) that cannot be reached is left out of
  // this Sync, and dropped after drop_after_missed_syncs Syncs in a row; it catches up on its own
  // when it is back. Any other error (a wrong key) fails the Sync as before.
  internal::RosterMiss missed;
  std::vector<bool> unreachable_member(links.size(), false);
  for (size_t r = 0; r < links.size() && roster != nullptr; ++r) {
    const Result<ControlStatus>& status = statuses[r];
    if (!status.ok() && (status.status().code() == StatusCode::kUnavailable ||
                         status.status().code() == StatusCode::kDeadlineExceeded)) {
      roster->RecordUnreachable(links[r].base_url, status.status(), missed);
      unreachable_member[r] = true;
    } else if (status.ok()) {
      roster->RecordReached(links[r].base_url);
    }
  }
  // Under a quorum, a receiver that did not answer is left out of this transfer — fenced before
  // it starts — as long as the quorum of the whole fleet's replicas answered
  // (docs/protocol.md "Stragglers and quorum").
  std::optional<QuorumFleet> quorum_fleet;
  if (options.commit_policy.kind == CommitPolicy::Kind::kQuorum) {
    std::vector<std::string> names;
    std::vector<std::optional<ReplicaPlace>> places;
    std::vector<Status> errors;
    for (size_t r = 0; r < links.size(); ++r) {
      names.push_back(links[r].base_url);
      places.push_back(statuses[r].ok() ? std::optional(statuses[r]->place) : std::nullopt);
      errors.push_back(statuses[r].ok()
                           ? Status::OK()
                           : statuses[r].status().WithContext("receiver " + links[r].base_url));
    }
    REFIT_ASSIGN_OR_RETURN(quorum_fleet,
                           LeaveOutUnanswered(options.commit_policy, names, places, errors));
    for (size_t r = 0; r < links.size(); ++r) {
      if (!quorum_fleet->included[r]) {
        REFIT_LOG_WARN("receiver {} is left out of this sync and fenced (commit policy {}): {}",
                       links[r].base_url, CommitPolicyName(options.commit_policy),
                       quorum_fleet->left_out_because[r].ToString());
      }
    }
  }
  // The receivers this transfer includes (all of them, but under a quorum those that answered).
  std::vector<ControlStatus> answered;
  std::vector<std::string> names;
  std::vector<HeldLineage> held;
  std::vector<std::string> included_fleet;
  for (size_t r = 0; r < links.size(); ++r) {
    if (unreachable_member[r]) continue;
    if (quorum_fleet.has_value() && !quorum_fleet->included[r]) continue;
    const ControlClientOptions& link = links[r];
    std::unique_ptr<ControlClient> client = std::move(asked_clients[r]);
    Result<ControlStatus>& status = statuses[r];
    if (!status.ok()) return status.status().WithContext("receiver " + link.base_url);
    if (auto fence = unresolved_fences.find(link.base_url); fence != unresolved_fences.end()) {
      // Decided "abort" for this receiver at the last Sync; an Abort is idempotent, and one of a
      // transfer it never opened only records the id as finished.
      if (Status aborted = client->Abort(fence->second); aborted.ok()) {
        unresolved_fences.erase(fence);
      } else {
        REFIT_LOG_WARN("receiver {}: abort of transfer {} it was fenced from failed again: {}",
                       link.base_url, fence->second.ToHex(), aborted.ToString());
      }
    }
    answered.push_back(*std::move(status));
    names.push_back(link.base_url);
    held.push_back(answered.back().receiver.lineage);
    included_fleet.push_back(fleet[r]);
    clients.push_back(std::move(client));
  }
  if (answered.empty()) {
    return Unavailable("publisher: no member of the fleet could be reached: {}",
                       fmt::join(missed.unreachable, "; "));
  }
  fleet = std::move(included_fleet);
  REFIT_RETURN_NOT_OK(DecideLineage(names, held));
  // The versions of receivers of this lineage (or of none): only they can hold a version this
  // trainer committed and no rank knows, which the next transfer is then based on.
  std::vector<uint64_t> lineage_versions;
  for (size_t r = 0; r < answered.size(); ++r) {
    const ReceiverStatus& receiver = answered[r].receiver;
    versions.push_back(receiver.version);
    const bool other_run = !receiver.lineage.run_id.empty() && receiver.lineage.run_id != run_id;
    if (!other_run) lineage_versions.push_back(receiver.version);
    if (other_run && committed_in_run && receiver.version >= tracker->version()) {
      return FailedPrecondition(
          "publisher: run '{}' epoch {} was superseded: receiver {} holds version {} of {}, at "
          "or above this trainer's version {}; a newer run took the fleet",
          run_id, epoch, names[r], receiver.version, DescribeLineage(receiver.lineage),
          tracker->version());
    }
    // A receiver of another run is caught up by an anchor of this one; whether it may take it
    // (only above the version it holds) is its decision, refused by name.
    const bool needs_anchor = receiver.needs_anchor || other_run;
    if (needs_anchor && !force_anchor && !per_receiver) {
      REFIT_LOG_INFO("receiver {} needs an anchor ({}): this sync is one", names[r],
                     other_run ? "it holds " + DescribeLineage(receiver.lineage)
                               : receiver.needs_anchor_reason);
      force_anchor = true;
    }
    receivers.push_back(
        {names[r], clients[r].get(), answered[r].place, fleet[r],
         ReceiverStanding{receiver.version, needs_anchor, receiver.accepts_target_version}});
  }
  GroupProducers producers(*this, source, std::move(fleet), std::move(versions),
                           std::move(lineage_versions), per_receiver);
  internal::CoordinatorOptions coordinator_options;
  coordinator_options.transfer_timeout = options.transfer_timeout;
  coordinator_options.observer = transport.get();
  // Every transfer names its relay trees in each receiver's prepare (the fleet as this publisher
  // lists it, which is also the order its producers pick their roots in), so receivers need no
  // peers list of their own, and one that joins or leaves changes the next tree. Payloads are
  // routed by what each receiver holds, so a TP shard gets only its cut.
  coordinator_options.relay_trees = caps.fan_out_tree;
  coordinator_options.route_by_holdings = caps.fan_out_tree && options.route_by_holdings;
  coordinator_options.tensor_names = routed_tensors;
  coordinator_options.per_receiver_plans = per_receiver;
  coordinator_options.lineage = TransferLineage{run_id, epoch, base_fingerprint};
  coordinator_options.fingerprint_version = fingerprint_version;
  coordinator_options.commit_policy =
      quorum_fleet.has_value() ? quorum_fleet->policy : options.commit_policy;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::Coordinator> coordinator,
                         internal::Coordinator::Make(coordinator_options,
                                                     std::make_unique<BorrowedProducers>(producers),
                                                     std::move(receivers)));
  REFIT_ASSIGN_OR_RETURN(RefitReport report, coordinator->Refit(force_anchor));
  committed_in_run = true;
  base_fingerprint = report.digests.empty() ? 0 : StateFingerprint(report.digests);
  fingerprint_version = report.plan.target_version;
  for (const ReceiverOutcome& outcome : report.receivers) {
    if (outcome.fenced && !outcome.fence_abort_status.ok()) {
      unresolved_fences[outcome.name] = report.plan.transfer_id;
    }
  }
  if (quorum_fleet.has_value()) {
    // The receivers left out before the transfer are fenced too: listed, at what they held.
    for (size_t r = 0; r < links.size(); ++r) {
      if (quorum_fleet->included[r]) continue;
      ReceiverOutcome outcome;
      outcome.name = links[r].base_url;
      outcome.fenced = true;
      outcome.fenced_because = quorum_fleet->left_out_because[r];
      if (statuses[r].ok()) outcome.held_version = statuses[r]->receiver.version;
      report.receivers.push_back(std::move(outcome));
      report.fenced.push_back(links[r].base_url);
    }
    report.replicas = quorum_fleet->replicas;
  }
  routed_tensors.clear();
  for (const auto& [name, digest] : report.digests) routed_tensors.push_back(name);
  if (roster != nullptr) roster->RecordSync(report);
  SyncReport synced{std::move(report), rank(), world()};
  synced.unreachable = std::move(missed.unreachable);
  synced.dropped = std::move(missed.dropped);
  return synced;
}

Result<SyncReport> PublisherRank::Follow(const ChunkSource& source) {
  const std::string leader = "rank 0";
  std::optional<internal::ProducerStreamed> sent;
  while (true) {
    Result<std::string> text = group->Broadcast({}, LeaderSilenceDeadline());
    if (!text.ok()) {
      // Rank 0 is gone or silent: nothing can be decided, so drop this rank's pending bits.
      if (open.has_value()) Abort(open->transfer_id);
      return text.status().WithContext(fmt::format("rank {}", rank()));
    }
    Result<Json> message = ParseGroupMessage(*text, leader);
    if (!message.ok()) {
      // Tell rank 0 why, in the gather it now waits for, then give up on this transfer.
      Json refusal = StatusToJson(message.status());
      refusal["protocol"] = kGroupProtocolVersion;
      group->Gather(refusal.dump(), Deadline()).status().IgnoreError();
      if (open.has_value()) Abort(open->transfer_id);
      return message.status();
    }
    const std::string op = message->value("op", std::string());
    Json reply = GroupMessage(op);
    if (op == kOpPropose) {
      Result<Json> proposal = Propose(*message);
      reply = proposal.ok() ? *proposal : StatusToJson(proposal.status());
    } else if (op == kOpBegin) {
      Result<TransferPlan> plan = PlanFromJson(*message);
      std::vector<std::string> fleet = message->value("endpoints", std::vector<std::string>());
      const auto all_roles = message->value("roles", std::vector<std::string>());
      const auto full_ranks = message->value("full_ranks", std::vector<uint32_t>());
      const bool full_self =
          std::find(full_ranks.begin(), full_ranks.end(), rank()) != full_ranks.end();
      reply = StatusToJson(plan.ok() ? Begin(*plan, std::move(fleet), all_roles, full_self)
                                     : plan.status());
      if (plan.ok() && open.has_value()) PutFoldable(reply);
    } else if (op == kOpStream) {
      Status cancelled = CheckCancelled("before the stream");
      Result<std::vector<TransferRoute>> routes =
          RoutesFromJson(message->value("routes", Json::array()), leader);
      if (cancelled.ok() && !routes.ok()) cancelled = routes.status();
      Result<internal::ProducerStreamed> own = cancelled.ok()
                                                   ? Stream(source, Deadline(), *routes)
                                                   : Result<internal::ProducerStreamed>(cancelled);
      reply = StatusToJson(own.status());
      if (own.ok()) {
        reply["report"] = StreamReportToJson(own->report);
        reply["digests"] = DigestsToJson(own->digests);
        if (sharded != nullptr) reply["boxes"] = BoxDigestsToJson(streamed_boxes);
        sent = *std::move(own);
      }
    } else if (op == kOpCommit) {
      const TransferPlan plan = open.value_or(TransferPlan{});
      const Status committed =
          open.has_value() ? Commit(plan.transfer_id) : FailedPrecondition("no open transfer");
      reply = StatusToJson(committed);
      reply["protocol"] = kGroupProtocolVersion;
      REFIT_RETURN_NOT_OK(group->Gather(reply.dump(), Deadline()).status());
      REFIT_RETURN_NOT_OK(committed);
      SyncReport report;
      report.rank = rank();
      report.world_size = world();
      report.transfer.plan = plan;
      if (sent.has_value()) {
        report.transfer.payloads = sent->report.payloads;
        report.transfer.wire_bytes = sent->report.wire_bytes;
        report.transfer.changed_elements = sent->report.changed_elements;
        report.transfer.total_elements = sent->report.total_elements;
        report.transfer.producers.push_back(sent->report);
      }
      return report;
    } else if (op == kOpAbort) {
      const std::string id = message->value("transfer_id", std::string());
      if (open.has_value()) Abort(open->transfer_id);
      return Cancelled("transfer {} was aborted by rank 0 (its error says why)", id);
    } else {
      reply = StatusToJson(InvalidArgument("{}: unknown op '{}'", leader, op));
    }
    reply["protocol"] = kGroupProtocolVersion;
    Status gathered = group->Gather(reply.dump(), Deadline()).status();
    if (!gathered.ok()) {
      if (open.has_value()) Abort(open->transfer_id);
      return gathered.WithContext(fmt::format("rank {}", rank()));
    }
  }
}

Status PublisherRank::DecideLineage(const std::vector<std::string>& names,
                                    const std::vector<HeldLineage>& held) {
  if (lineage_decided) return Status::OK();
  if (options.resume && run_id.empty()) {
    // Continue the run the fleet holds: every receiver that holds one must hold the same.
    for (size_t r = 0; r < held.size(); ++r) {
      if (held[r].run_id.empty()) continue;
      if (!run_id.empty() && held[r].run_id != run_id) {
        return InvalidArgument(
            "publisher: resume without a run id: the receivers hold two runs ('{}' and '{}' at "
            "{}); name the run to resume (PublisherOptions::run_id)",
            run_id, held[r].run_id, names[r]);
      }
      run_id = held[r].run_id;
    }
    if (run_id.empty()) {
      // Nothing to resume (every receiver loaded a checkpoint without lineage): a run of its own.
      run_id = TransferId::Random().ToHex();
      REFIT_LOG_INFO("publisher: resume: no receiver holds a lineage; starting run '{}'", run_id);
    }
  }
  uint64_t seen = 0;
  std::optional<size_t> holder;
  for (size_t r = 0; r < held.size(); ++r) {
    if (held[r].run_id != run_id) continue;
    if (!holder.has_value() || held[r].epoch > seen) holder = r;
    seen = std::max(seen, held[r].epoch);
  }
  if (!options.resume && holder.has_value()) {
    return FailedPrecondition(
        "publisher: run '{}' is held by the fleet already ({} holds it at epoch {}): a trainer "
        "that continues it resumes it (resume, as epoch {}), one that does not takes another "
        "run id",
        run_id, names[*holder], seen, seen + 1);
  }
  epoch = options.resume ? seen + 1 : 0;
  lineage_decided = true;
  REFIT_LOG_INFO("publisher: {} run '{}' as epoch {}", options.resume ? "resuming" : "starting",
                 run_id, epoch);
  return Status::OK();
}

struct Publisher::Impl : PublisherRank {};

Result<std::unique_ptr<Publisher>> Publisher::Make(const PublisherOptions& options,
                                                   std::unique_ptr<ProducerGroup> group) {
  if (group == nullptr) return InvalidArgument("publisher: no producer group");

  if (options.transfer_timeout.count() <= 0) {
    return InvalidArgument("publisher: transfer_timeout must be positive, got {} ms",
                           options.transfer_timeout.count());
  }
  if (options.run_id.size() > internal::kMaxRunIdBytes) {
    return InvalidArgument("publisher: run_id is {} bytes long, more than {}",
                           options.run_id.size(), internal::kMaxRunIdBytes);
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->run_id = options.run_id;
  // A trainer that neither names its run nor resumes one starts a lineage of its own.
  if (impl->run_id.empty() && !options.resume) impl->run_id = TransferId::Random().ToHex();
  ProducerStreamOptions stream = options.stream;
  // The link hint of item_coding's kAuto: the transport this publisher sends through.
  if (stream.link_uri.empty()) stream.link_uri = options.transport_uri;
  stream.producer_id = group->rank();
  stream.num_producers = group->world_size();
  REFIT_ASSIGN_OR_RETURN(impl->stream, ProducerStream::Make(stream));
  stream.owns_every_chunk = true;
  REFIT_ASSIGN_OR_RETURN(impl->piece_stream, ProducerStream::Make(stream));
  REFIT_ASSIGN_OR_RETURN(impl->tracker, internal::DeltaTracker::Make(options.tracker));
  if (options.tracker.op == Op::kXor && options.history_bytes > 0) {
    REFIT_ASSIGN_OR_RETURN(impl->history, DeltaHistory::Make(DeltaHistoryOptions{
                                              options.history_versions, options.history_bytes}));
  }
  // An object store's payloads are announced on the receivers' control planes, through the
  // same client settings (key, TLS, timeouts) as the coordinator's own calls.
  TransportOptions transport_options;
  transport_options.manifest_announcers = MakeControlManifestAnnouncers(options.control);
  // One key for both planes. Only rank 0 reaches the control planes, so only there is a data-plane
  // key without a control-plane key an error; the other ranks send with whichever key they got.
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(options.transport_uri));
  if (group->rank() == 0 || !options.control.api_key.empty()) {
    REFIT_ASSIGN_OR_RETURN(
        uri, internal::KeyDataPlane(std::move(uri), options.control.api_key, "publisher"));
  }
  REFIT_ASSIGN_OR_RETURN(impl->transport, MakeTransport(uri, transport_options));
  if (group->rank() == 0 && options.receivers.empty() && !options.membership.has_value() &&
      !impl->transport->capabilities().carries_control) {
    return InvalidArgument(
        "publisher: rank 0 coordinates the receivers but none were given (and no membership "
        "endpoint to join)");
  }
  if (group->rank() == 0 && options.membership.has_value()) {
    std::vector<MemberEndpoint> configured;
    for (const PublisherReceiver& receiver : options.receivers) {
      configured.push_back({receiver.control_url, receiver.data_endpoint});
    }
    MembershipOptions membership = *options.membership;
    if (membership.api_key.empty()) membership.api_key = options.control.api_key;
    impl->roster =
        std::make_unique<internal::FleetRoster>(configured, membership.drop_after_missed_syncs);
    REFIT_ASSIGN_OR_RETURN(impl->membership_server,
                           internal::MembershipServer::Make(membership, *impl->roster));
    REFIT_RETURN_NOT_OK(
        impl->membership_server->Start().WithContext("publisher: membership endpoint"));
  }
  if (Status policy = CheckCommitPolicy(options.commit_policy); !policy.ok()) {
    return policy.WithContext("publisher: commit_policy");
  }
  if (options.commit_policy.kind == CommitPolicy::Kind::kQuorum &&
      !impl->transport->capabilities().fan_out_tree) {
    // A fenced receiver must be caught up by a plan of its own at the next Sync, prepared from the
    // version it holds: per-receiver plans, which need relay trees.
    return InvalidArgument(
        "publisher: commit_policy {} needs a transport with relay trees (zmq://), which catches a "
        "fenced receiver up on its own; transport '{}' has none",
        CommitPolicyName(options.commit_policy), options.transport_uri);
  }
  impl->group = std::move(group);
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() = default;

Status Publisher::AdoptBaseline(std::span<const TensorView> model,
                                std::optional<uint64_t> version) {
  std::vector<ExportTensor> host;
  host.reserve(model.size());
  for (const TensorView& tensor : model) host.push_back(ExportTensor::Host(tensor));
  return AdoptBaseline(std::span<const ExportTensor>(host), version);
}

Status Publisher::AdoptBaseline(std::span<const ExportTensor> model,
                                std::optional<uint64_t> version) {
  uint64_t largest_device = 0;
  for (const ExportTensor& tensor : model) {
    if (tensor.device != nullptr) largest_device = std::max(largest_device, tensor.size_bytes());
  }
  REFIT_RETURN_NOT_OK(AdoptOwnedBaseline(*impl_->tracker, model, impl_->options.stream.chunk_bytes,
                                         rank(), world_size(),
                                         impl_->StagingFor(largest_device).get()));
  if (version.has_value()) REFIT_RETURN_NOT_OK(impl_->tracker->Rebase(*version));
  // Joining receivers learn the version the fleet holds (their readiness needs it).
  if (version.has_value() && impl_->roster != nullptr) impl_->roster->SetFleetVersion(*version);
  // The deltas retained before no longer chain to the adopted state.
  if (impl_->history != nullptr) impl_->history->Clear();
  impl_->version_unknown = !version.has_value();
  // One rank holds the whole model: its digests are the fleet's at that version, so the first
  // delta states what it builds on. W ranks know only their own tensors: not stated (the flush's
  // digest check still verifies the adopted baseline).
  impl_->base_fingerprint =
      world_size() == 1 && version.has_value() ? StateFingerprint(impl_->tracker->Digests()) : 0;
  impl_->fingerprint_version = version.value_or(0);
  impl_->committed_world = world_size();
  return Status::OK();
}

Status Publisher::AdoptBaseline(const ShardedModel& model, std::optional<uint64_t> version) {
  PublisherRank& self = *impl_;
  self.SetSharded(&model);
  Status adopted = self.sharded_status;
  // Built aside and swapped in at the end: nothing changes on error.
  std::unique_ptr<internal::DeltaTracker> tracker;
  if (adopted.ok()) {
    Result<std::unique_ptr<internal::DeltaTracker>> made =
        internal::DeltaTracker::Make(self.options.tracker);
    adopted = made.status();
    if (made.ok()) tracker = std::move(made).ValueOrDie();
  }
  if (adopted.ok()) {
    // Every piece this rank holds: which rank sends a replicated box is rank 0's to plan, at
    // the next Sync, which drops the boxes this rank does not send.
    const std::vector<PieceRole> all(model.layout.pieces.size(), PieceRole::kSend);
    for (const LayoutPiece& piece : model.layout.pieces) {
      adopted = tracker->Place(PieceKey(piece), PieceBox(piece), piece.extent);
      if (!adopted.ok()) break;
    }
    const uint64_t chunk_bytes = self.options.stream.chunk_bytes;
    const ChunkSource pieces = SentPiecesSource(
        model.layout, all, self.sharded_locals, chunk_bytes,
        self.StagingFor(StagingBytesNeeded(model.layout, all, self.sharded_locals, chunk_bytes)));
    std::stop_source never;
    for (uint64_t chunk = 0; adopted.ok(); ++chunk) {
      Result<std::optional<ExportChunk>> next = pieces(ChunkPull{chunk, true, never.get_token()});
      if (!next.ok()) {
        adopted = next.status();
        break;
      }
      if (!next->has_value()) break;
      for (const TensorView& box : (*next)->tensors) {
        adopted = tracker->AdoptBaseline(box);
        if (!adopted.ok()) break;
      }
    }
    if (adopted.ok()) adopted = tracker->MarkBaselineAdopted();
    if (adopted.ok() && version.has_value()) adopted = tracker->Rebase(*version);
  }
  self.SetSharded(nullptr);
  if (!adopted.ok()) return adopted.WithContext(fmt::format("publisher rank {}: adopt", rank()));
  self.tracker = std::move(tracker);
  if (self.history != nullptr) self.history->Clear();
  self.version_unknown = !version.has_value();
  self.base_fingerprint = 0;  // A rank's pieces are not the whole state.
  self.committed_world = world_size();
  self.committed_sharded = true;
  self.adopted_plan = rank() == 0;
  return Status::OK();
}

Result<SyncReport> Publisher::Sync(const ChunkSource& source, bool force_anchor) {
  impl_->SetSharded(nullptr);
  return SyncOf(source, force_anchor);
}

Result<SyncReport> Publisher::Sync(const ShardedModel& model, bool force_anchor) {
  const uint64_t read_before = DeviceReadBytes(model.locals);
  impl_->SetSharded(&model);
  // The source is unused: each rank streams the boxes rank 0's plan gives it.
  const ChunkSource none = [](const ChunkPull&) -> Result<std::optional<ExportChunk>> {
    return std::optional<ExportChunk>();
  };
  Result<SyncReport> synced = SyncOf(none, force_anchor);
  impl_->SetSharded(nullptr);
  if (synced.ok()) synced->staging = impl_->Staging(DeviceReadBytes(model.locals) - read_before);
  return synced;
}

Result<SyncReport> Publisher::SyncOf(const ChunkSource& source, bool force_anchor) {
  {
    internal::MutexLock lock(impl_->cancel_mutex);
    impl_->in_sync = true;
    impl_->cancel_requested = false;
  }
  Result<SyncReport> synced =
      rank() == 0 ? impl_->Lead(source, force_anchor) : impl_->Follow(source);
  internal::MutexLock lock(impl_->cancel_mutex);
  impl_->in_sync = false;
  impl_->cancel_requested = false;
  return synced;
}

void Publisher::Cancel() {
  internal::MutexLock lock(impl_->cancel_mutex);
  if (impl_->in_sync) impl_->cancel_requested = true;
}

Result<SyncReport> Publisher::Sync(std::vector<TensorView> tensors, bool force_anchor) {
  std::vector<ExportTensor> host;
  host.reserve(tensors.size());
  for (const TensorView& tensor : tensors) host.push_back(ExportTensor::Host(tensor));
  return Sync(std::move(host), force_anchor);
}

Result<SyncReport> Publisher::Sync(std::vector<ExportTensor> tensors, bool force_anchor) {
  impl_->listed_tensors.clear();
  for (const ExportTensor& tensor : tensors) impl_->listed_tensors.push_back(tensor.name);
  const uint64_t read_before = DeviceReadBytes(tensors);
  const uint64_t chunk_bytes = impl_->options.stream.chunk_bytes;
  std::shared_ptr<StagingPool> pool =
      impl_->StagingFor(LargestStagedChunkBytes(tensors, chunk_bytes));
  // The source takes its own copy of the list (views and pointers); `tensors` stays to count
  // what was read.
  const ChunkSource source = StagedTensorSource(tensors, chunk_bytes, std::move(pool));
  Result<SyncReport> synced = Sync(source, force_anchor);
  impl_->listed_tensors.clear();
  if (synced.ok()) synced->staging = impl_->Staging(DeviceReadBytes(tensors) - read_before);
  return synced;
}

Status Publisher::SetReceivers(std::vector<PublisherReceiver> receivers) {
  if (rank() != 0) return FailedPrecondition("publisher: only rank 0 knows the receivers");
  if (receivers.empty()) return InvalidArgument("publisher: no receivers");
  if (impl_->roster != nullptr) {
    std::vector<MemberEndpoint> members;
    for (const PublisherReceiver& receiver : receivers) {
      members.push_back({receiver.control_url, receiver.data_endpoint});
    }
    impl_->roster->Replace(members);
  }
  impl_->options.receivers = std::move(receivers);
  return Status::OK();
}

std::string Publisher::membership_url() const {
  return impl_->membership_server != nullptr ? impl_->membership_server->url() : std::string();
}

Result<FleetMembership> Publisher::membership() const {
  if (impl_->roster == nullptr) {
    return FailedPrecondition("publisher: rank {} serves no membership endpoint", rank());
  }
  return impl_->roster->Snapshot();
}

uint32_t Publisher::rank() const { return impl_->rank(); }
uint32_t Publisher::world_size() const { return impl_->world(); }
uint64_t Publisher::version() const { return impl_->tracker->version(); }

const std::string& Publisher::run_id() const { return impl_->run_id; }

uint64_t Publisher::epoch() const { return impl_->epoch; }
uint64_t Publisher::baseline_bytes() const { return impl_->tracker->baseline_bytes(); }

}  // namespace refit
