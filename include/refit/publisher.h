// Publisher: the trainer side of refit, one per trainer rank (process). The W Publishers of a job
// form a producer group (refit/producer_group.h) and sync together, SPMD: every rank calls Sync
// at the same step with its view of the model; rank p encodes and sends only the export chunks
// it owns (chunk k iff k % W == p), and rank 0 also coordinates the receivers' two-phase commit.
//
//   rank 0                                    ranks 1 … W−1
//   ── propose ─▶ (version, wants anchor) ◀── Gather
//   ── begin (plan, data endpoints) ─▶        DeltaTracker::BeginPlanned      receivers: Prepare
//   ── stream ─▶                              ProducerStream → own transport sender
//                ◀── stream report + pending digests ── Gather
//   receivers: Flush, verified per replica
//   ── commit | abort ─▶                      DeltaTracker::Commit | Abort     receivers: Commit
//
// Any failure on any rank or receiver aborts the transfer everywhere (unless a quorum commit policy
// fences receivers that did not flush, PublisherOptions::commit_policy): receivers roll back to the
// base version bit-exactly and every tracker drops its pending bits, so the next Sync starts from
// the same state. A rank that vanishes makes rank 0's collective fail within the transfer timeout
// (the group drops its link); a rank whose process restarted joins again and the next Sync is an
// anchor, which its fresh tracker needs.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/chunk_source.h"
#include "refit/commit_policy.h"
#include "refit/control_client.h"
#include "refit/membership.h"
#include "refit/producer_group.h"
#include "refit/producer_layout.h"
#include "refit/refit_report.h"
#include "refit/status.h"
#include "refit/stream_options.h"
#include "refit/tensor.h"
#include "refit/tracker_options.h"

namespace refit {

/// One receiver as rank 0 reaches it.
struct PublisherReceiver {
  /// Its control plane, e.g. "http://10.0.0.5:8081".
  std::string control_url;
  /// Its data endpoint in the transport's syntax (zmq: host:port). Unused by transports that
  /// announce payloads on the control plane (s3://).
  std::string data_endpoint;
};

/// Options of Publisher::Make.
struct PublisherOptions {
  /// This rank's tracker (baseline storage, anchor cadence, op, …).
  TrackerOptions tracker;
  /// Chunking, bucketing and threads of this rank's stream; producer_id and num_producers come
  /// from the group.
  ProducerStreamOptions stream;
  /// The transport every rank sends its payloads through (each rank makes its own).
  std::string transport_uri = "zmq://";
  /// Rank 0: the fleet. Other ranks ignore it and learn the data endpoints from rank 0. Empty
  /// with a transport that carries its own control channel (mpi://): every receiver of the job,
  /// reached on the job's communicator.
  std::vector<PublisherReceiver> receivers;
  /// Rank 0: how to reach the control planes (api key, TLS, timeouts); base_url is set per
  /// receiver.
  ControlClientOptions control;
  /// The budget of one Sync from the first message to the decision, on every rank. A rank that
  /// does not answer within it is treated as failed.
  std::chrono::milliseconds transfer_timeout{std::chrono::minutes(10)};
  /// Rank 0, transports with relay trees (zmq://): route payloads by holdings — each class of
  /// receivers that hold the same elements (every TP rank-k shard; the unsharded receivers) gets
  /// only its cut of each item, through its own relay tree (docs/protocol.md "Routing by
  /// holdings"). A Sync of a tensor list or of a sharded model knows its tensor names and is
  /// routed from the first; a Sync of a bare chunk source from the second (the first tells them).
  bool route_by_holdings = true;
  /// Host memory that device tensors (ExportTensor::device; ShardedModel locals in device memory)
  /// are staged through on their way to the compare: a pool of reusable buffers, one per chunk
  /// in flight, kept between Syncs. 0: twice the largest chunk this rank stages, so that one
  /// chunk is read while the one before it is compared. A chunk larger than the budget fails the
  /// Sync, naming it and the budget it needs.
  uint64_t staging_bytes = 0;
  /// Retained history for folded deltas (docs/protocol.md "Per-receiver plans"): this rank keeps
  /// the XOR deltas of the chunks (boxes) it sends for its last `history_versions` commits, at
  /// most `history_bytes` of them (locations and values before compression; oldest dropped
  /// first), so that a receiver up to that many versions behind is caught up by one folded
  /// payload per chunk rather than an anchor. Defaults: 8 versions, 256 MiB per rank (8 deltas
  /// of an 8 GiB share at ~2 % of bf16 elements changing per step). history_bytes 0 keeps
  /// nothing. Only an XOR tracker (TrackerOptions::op) keeps history.
  uint32_t history_versions = 8;
  uint64_t history_bytes = uint64_t{256} << 20;
  /// Rank 0: the training run this trainer publishes (docs/protocol.md "Lineage and fencing"),
  /// at most 256 bytes. Empty: with `resume`, the run the fleet holds (a new random one if no
  /// receiver holds any; InvalidArgument at the first Sync if they hold several); without, a
  /// new random one. Every Prepare states it, with the epoch, and receivers refuse another run's
  /// deltas, and any transfer that would reuse a version number they hold under other contents.
  /// Other ranks' values are ignored: rank 0 alone talks to the receivers.
  std::string run_id = {};
  /// Rank 0: continue the run (`run_id`, or the fleet's) as its next epoch — the highest epoch of
  /// the run any receiver has seen, + 1 — which fences every trainer of an older epoch (a
  /// zombie). false: a new lineage; its first Sync anchors the fleet above every version it
  /// holds (a trainer that did not adopt a version), or, given a version the fleet holds (an
  /// adopted checkpoint), is refused by the receivers, naming both runs. A run id the fleet
  /// already holds, given without resume, fails the first Sync (it would be the same lineage
  /// twice). Decided at the first Sync and kept.
  bool resume = false;
  /// Rank 0: when a Sync commits although some receivers did not flush (refit/commit_policy.h;
  /// docs/protocol.md "Stragglers and quorum"): `all` (the default: one receiver that fails or
  /// misses the flush deadline aborts the Sync everywhere) or a quorum of replicas — the Sync
  /// commits on the replicas that flushed and fences the others (rolled back to the version they
  /// held, listed in RefitReport::fenced; each is caught up by a plan of its own at the next
  /// Sync). A quorum needs a transport with relay trees (zmq://). Checked at Sync against the
  /// fleet: a count above its replicas fails the Sync (InvalidArgument).
  CommitPolicy commit_policy = {};
  /// Rank 0: serve a membership endpoint (refit/membership.h) through which receivers join and
  /// leave the fleet with one authenticated call; `receivers` may then be empty (the fleet is
  /// whoever joined). Changes take effect at the next Sync. A member unreachable at a Sync's
  /// start is left out of it, and dropped after drop_after_missed_syncs such Syncs in a row.
  /// Other ranks ignore it: rank 0 snapshots the fleet at each Sync's start and its begin
  /// message carries the data endpoints to every rank. Unset: no endpoint; an unreachable
  /// receiver fails the Sync.
  std::optional<MembershipOptions> membership;
};

/// What a sharded trainer rank holds — FSDP2/DTensor shards, Megatron tensor- and
/// pipeline-parallel slices, data-parallel copies: its layout (the pieces, each a box of a
/// canonical tensor stored in one of its local tensors; refit/producer_layout.h) and those local
/// tensors. Borrowed for one Sync.
struct ShardedModel {
  ProducerLayout layout;
  /// The local tensors the pieces name (LayoutPiece::local), in any order, each once: host memory,
  /// or device memory staged through PublisherOptions::staging_bytes.
  std::vector<ExportTensor> locals;
};

/// How device tensors were staged to the host during a Sync (zeros when none was).
struct StagingReport {
  /// Bytes read from device memory, on this rank.
  uint64_t staged_bytes = 0;
  /// The staging pool's budget, and the most host memory it held (over all Syncs so far).
  uint64_t budget_bytes = 0;
  uint64_t peak_held_bytes = 0;
};

/// What one successful Sync did, as this rank saw it.
struct SyncReport {
  /// Rank 0: the whole transfer (every producer, every receiver). Other ranks: the plan, this
  /// rank's StreamReport as the only producer entry, and their sums.
  RefitReport transfer;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  /// This rank's staging of device tensors.
  StagingReport staging = {};
  /// Rank 0 with a membership endpoint: the members left out of this Sync because their control
  /// plane could not be reached at its start (each with why), and those dropped from the fleet
  /// for it (unreachable for MembershipOptions::drop_after_missed_syncs Syncs in a row).
  std::vector<std::string> unreachable = {};
  std::vector<std::string> dropped = {};
};

/// One trainer rank's publisher.
///
/// Thread-safety: one Sync at a time; the object is driven by the rank's training loop. Cancel
/// may be called from any thread.
class Publisher {
 public:
  /// Make this rank's publisher over `group` (rank and W come from it).
  /// Errors: InvalidArgument (rank 0 without receivers, stream options ProducerStream refuses,
  /// a bad transport URI); those of DeltaTracker::Make and ControlClient::Make.
  static Result<std::unique_ptr<Publisher>> Make(const PublisherOptions& options,
                                                 std::unique_ptr<ProducerGroup> group);
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  /// Adopt the tensors of `model` (canonical order, the whole model) that this rank owns as
  /// what the receivers hold now — they loaded that checkpoint — so that the first Sync is a
  /// delta. A rank that owns none adopts an empty baseline. `version`: the version the
  /// receivers hold, if this rank knows it; otherwise the first Sync's base (rank 0's, or the
  /// receivers') labels it. Local, not collective.
  /// Errors: as DeltaTracker::AdoptBaseline.
  Status AdoptBaseline(std::span<const TensorView> model,
                       std::optional<uint64_t> version = std::nullopt);
  /// As above with tensors in host or device memory (device ones are read one at a time).
  Status AdoptBaseline(std::span<const ExportTensor> model,
                       std::optional<uint64_t> version = std::nullopt);

  /// Adopt this rank's pieces of a sharded model (FSDP2/DTensor shards, Megatron slices) as what
  /// the receivers hold now — a trainer rank restarted from the checkpoint they loaded — so that
  /// the next Sync(const ShardedModel&) is a delta for every receiver holding that version
  /// (docs/protocol.md "Trainer restarts"). Every piece this rank holds is adopted; at the next
  /// Sync, the boxes rank 0's plan gives another rank (data-parallel copies) are dropped. Every
  /// rank of W may adopt, or one rank that restarted alone; the receivers' state digests check
  /// the adopted baseline at the next flush (a wrong checkpoint fails that Sync, rolled back).
  /// `version`: as above. Local, not collective.
  /// Errors: InvalidArgument for a layout CheckLayout refuses or a local tensor missing or of
  /// another shape, naming the piece; those of DeltaTracker::AdoptBaseline. Nothing is adopted
  /// on error (the previous baseline stays).
  Status AdoptBaseline(const ShardedModel& model, std::optional<uint64_t> version = std::nullopt);

  /// Collective: refit the fleet with the model as `source` yields it (every chunk in canonical
  /// order; ranks that own a chunk read its bytes, the others may yield views they never touch).
  /// `force_anchor` on rank 0 makes the transfer FULL.
  /// Errors: the transfer's first failure, naming the rank or receiver, after it was aborted
  /// everywhere; on ranks ≥ 1, Aborted-by-rank-0 reasons arrive as the code rank 0 failed with.
  Result<SyncReport> Sync(const ChunkSource& source, bool force_anchor = false);
  /// As above with the model's tensors, chunked by options.stream.chunk_bytes.
  Result<SyncReport> Sync(std::vector<TensorView> tensors, bool force_anchor = false);
  /// As above with tensors in host or device memory: the chunks this rank sends are staged from
  /// device memory through the staging pool (PublisherOptions::staging_bytes); the others are not
  /// read. Errors: as above; InvalidArgument for a chunk larger than the staging budget.
  Result<SyncReport> Sync(std::vector<ExportTensor> tensors, bool force_anchor = false);
  /// Collective: refit the fleet from a sharded model, every rank holding only its pieces and
  /// sending only its own boxes, straight into the fleet (no gather). Rank 0 gathers the ranks'
  /// layouts (a layout travels only while rank 0 does not hold it), checks that the distinct
  /// boxes tile every canonical tensor and plans which rank sends each (the lowest holding it;
  /// PlanLayouts), before anything is sent. Each rank's tracker keeps only the boxes it sends
  /// (DeltaTracker::Place): O(shard) memory. A rank holding a copy of a box another rank sends
  /// reports its digest, and a copy that differs fails the Sync naming the rank, the tensor and
  /// the box (a data-parallel replica that diverged); the receivers roll back. A new plan (a
  /// layout changed, boxes moved between ranks) and the first sharded Sync after a whole-model
  /// one are anchors. Every rank of a Sync must call this form.
  /// Errors: as above; InvalidArgument naming the piece for a layout CheckLayout or PlanLayouts
  /// refuses or a local tensor missing or of another shape; DataLoss for a diverged copy.
  Result<SyncReport> Sync(const ShardedModel& model, bool force_anchor = false);

  /// Make the Sync in flight on this rank fail soon with Cancelled, aborted everywhere as any
  /// other failure: it is checked before the transfer begins, before the stream and before each
  /// payload, so a Sync blocked in a collective or a receiver's flush returns when that call
  /// does (within the transfer timeout). No effect when no Sync is in flight. The Python binding
  /// calls it on Ctrl-C. Thread-safe: the one call that may overlap a Sync.
  void Cancel();

  /// Rank 0: replace the fleet from the next Sync on (a receiver dropped or added). Each Sync
  /// asks every receiver where it sits, what it holds and which version: over a transport with
  /// relay trees (zmq://) a receiver at the base gets the delta, and one that is new, behind
  /// (restarted from an older checkpoint) or needs an anchor is caught up in the same Sync by
  /// folded deltas or an anchor of its own (RefitReport's ReceiverOutcome::caught_up_by); the
  /// others' payloads do not change. Over other transports such a receiver makes the Sync an
  /// anchor. Errors: FailedPrecondition on other ranks; InvalidArgument for an empty list.
  Status SetReceivers(std::vector<PublisherReceiver> receivers);

  /// Rank 0 with PublisherOptions::membership: the membership endpoint's URL, where receivers
  /// join (`refit join --publisher URL`); empty otherwise.
  std::string membership_url() const;
  /// Rank 0 with a membership endpoint: the members and how each stood at the last Sync (as
  /// GET /v1/members). Errors: FailedPrecondition without one.
  Result<FleetMembership> membership() const;

  uint32_t rank() const;
  uint32_t world_size() const;
  /// The version this rank's tracker has committed.
  uint64_t version() const;
  /// Rank 0: the run and epoch its transfers state; the epoch of a resumed run is known once the
  /// first Sync asked the fleet (0 before). Other ranks: what their options say.
  const std::string& run_id() const;
  uint64_t epoch() const;
  /// The bytes of baseline this rank's tracker keeps: the boxes (chunks) it sends, O(shard).
  uint64_t baseline_bytes() const;

 private:
  struct Impl;
  explicit Publisher(std::unique_ptr<Impl> impl);
  Result<SyncReport> SyncOf(const ChunkSource& source, bool force_anchor);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
