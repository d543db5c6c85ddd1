// Coordinator: one transfer across the whole fleet, with a two-phase commit. It moves no payload
// bytes itself: producers stream through their PayloadChannels, receivers are driven through
// their ReceiverControl. The producers are a ProducerSet: W trackers in this process
// (MakeLocalProducers), or the W ranks of a trainer job, one per process (Publisher, node/).
//
//   1. Begin       every producer's tracker opens the transfer under one plan (an anchor if any
//                  producer's cadence asks for one; their versions must agree)
//   2. Prepare     every receiver opens it at the base version (version fencing)
//   3. Stream      producers 0 … W−1 run their ProducerStream concurrently, each into its own
//                  channel, then Finish (the relay flush with the producer's payload count)
//   4. Flush       every receiver waits for the declared payload counts, applies, verifies its
//                  state digests against the producers' pending digests → prepared; each
//                  replica is verified as a whole: the canonical digests of a shard group's
//                  pieces must add up to the producers' (docs/architecture.md)
//   5. Commit      every receiver commits (the decision point is the last successful Flush),
//                  then every tracker commits its pending bits
//
// A failure or timeout in steps 1–4 aborts everywhere (under a quorum commit policy, a flush that
// fails on some replicas commits on the others and fences those, docs/protocol.md "Stragglers and
// quorum"): receivers roll back to the base version
// bit-exactly, trackers drop their pending bits, and Refit returns the first error with every
// failure listed by place. The next Refit (a new transfer id) starts from the same base, without
// restarting anything. Once every receiver is prepared the transfer is decided: a receiver whose
// Commit reply is lost stays prepared and commits implicitly at the next Prepare (docs/protocol.md
// "implied commit"), so step 5 reports such a receiver instead of failing the transfer, and
// commits the trackers whatever the receivers answered. The receivers are the decision record:
// one that committed holds the target version, so the next transfer is based on it (a restarted
// producer asks them) and the others commit implicitly; while none committed, the next transfer
// comes from the base and every prepared receiver aborts implicitly ("implied abort").
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "codec/delta_history.h"
#include "codec/routing.h"
#include "codec/tracker.h"
#include "pipeline/producer_stream.h"
#include "pipeline/receiver_plan.h"
#include "refit/commit_policy.h"
#include "refit/payload.h"
#include "refit/refit_report.h"
#include "refit/status.h"
#include "refit/transfer.h"

namespace refit::internal {

/// One producer (trainer rank) of the fleet.
struct CoordinatedProducer {
  /// Its tracker, holding the baseline of the chunks it owns. Borrowed; it must outlive the
  /// Coordinator and is driven only by it while a Refit runs.
  DeltaTracker* tracker = nullptr;
  /// Make the chunk source of one transfer: every export chunk of the model in canonical order
  /// (ProducerStream pulls them all and encodes the owned ones).
  std::function<Result<ChunkSource>(const TransferPlan& plan)> source;
  /// Its retained deltas, for receivers caught up by folded deltas (docs/protocol.md
  /// "Per-receiver plans"); borrowed, driven with the tracker. Null: it folds nothing, and a
  /// receiver behind the base gets an anchor of its own. (Last, with an initializer.)
  DeltaHistory* history = nullptr;
};

/// One receiver of the fleet.
struct CoordinatedReceiver {
  /// How errors and reports name it, e.g. its control URL.
  std::string name;
  /// Borrowed; must outlive the Coordinator.
  ReceiverControl* control = nullptr;
  /// The replica (one whole copy of the model) this receiver is part of, and its place in it,
  /// e.g. one tensor-parallel rank of a generation engine. The receivers of one replica are
  /// verified together. Default: a replica of its own. (With an initializer, so that
  /// `CoordinatedReceiver{name, control}` stays valid.)
  ReplicaPlace place = {};
  /// Where its data plane listens (the transport's syntax), for the relay trees the coordinator
  /// names (CoordinatorOptions::relay_trees) and for routing by holdings; empty: unknown.
  std::string data_endpoint = {};
  /// Where it stands (its version, whether it needs an anchor), as its status said before the
  /// transfer; with CoordinatorOptions::per_receiver_plans, what its plan is made from. nullopt:
  /// taken to be at the base.
  std::optional<ReceiverStanding> standing = std::nullopt;
};

/// What a producer's channel is opened for.
struct ChannelRequest {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  /// The data endpoints this channel must reach, in relay-tree order: one route's receivers
  /// (TransferRoute::endpoints). Empty: the whole fleet, as the factory knows it.
  std::vector<std::string> endpoints = {};
  /// The transfer's deadline, for the sender to bound its sends by (SenderContext::deadline).
  std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt;
};

/// Open the channel through which producer `request.producer_id` sends its payloads of one
/// transfer (for a transport: Transport::MakeSender with the fleet's endpoints).
using ChannelFactory =
    std::function<Result<std::unique_ptr<PayloadChannel>>(const ChannelRequest& request)>;

/// What one producer reported of the stream phase.
struct ProducerStreamed {
  StreamReport report;
  /// The state digest each tensor it tracks will have if the transfer commits
  /// (DeltaTracker::PendingDigests).
  std::map<std::string, uint64_t> digests;
};

/// The W producers of a fleet as a Coordinator drives them, whether they are trackers in this
/// process (MakeLocalProducers) or the ranks of a trainer job in W processes (node/ Publisher).
///
/// Thread-safety: driven by one Coordinator::Refit at a time, from its thread.
class ProducerSet {
 public:
  virtual ~ProducerSet() = default;

  /// The number of producers W.
  virtual uint32_t size() const = 0;
  /// The committed version of the producers (producer 0's).
  virtual uint64_t version() const = 0;
  /// Open transfer `id` on every producer under one plan: an anchor when `force_anchor` or when
  /// any producer's cadence asks for one (DeltaTracker::NextIsAnchor), so that a producer owning
  /// nothing never disagrees with one that owns everything.
  /// Errors: FailedPrecondition naming the producers when their versions differ or one has a
  /// transfer open; whatever a producer fails with. Nothing stays open on error.
  virtual Result<TransferPlan> Begin(const TransferId& id, bool force_anchor) = 0;
  /// Stream every producer's share of the open transfer, concurrently, cut and sent per route
  /// (ProducerStream::Run with routes: one channel per route, finished with that route's payload
  /// count); no payload may be sent after `deadline` (DeadlineExceeded). Return one entry per
  /// producer, in producer order, whose report has one RouteReport per route.
  /// Errors: the most telling failure first, naming its producer, then the others.
  virtual Result<std::vector<ProducerStreamed>> Stream(
      const TransferPlan& plan, std::span<const TransferRoute> routes,
      std::chrono::steady_clock::time_point deadline) = 0;
  /// The canonical tensor names of the transfer Begin opened, when the producers know them
  /// before streaming (a sharded Publisher's layout plan, a Publisher given its tensor list);
  /// empty: unknown, and routing by holdings uses the previous transfer's. The default: unknown.
  virtual std::vector<std::string> TensorNames() const { return {}; }
  /// Commit transfer `id` on every producer: every receiver is prepared, the transfer is decided.
  /// The oldest version from which every producer can fold its retained deltas to the open
  /// transfer's target (DeltaHistory::oldest_version), once Begin opened it; nullopt: some
  /// producer keeps no history. The default: none.
  virtual std::optional<uint64_t> FoldableFrom() const { return std::nullopt; }
  /// Errors: a producer that could not commit (the fleet then needs an anchor).
  virtual Status Commit(const TransferId& id) = 0;
  /// Abort transfer `id` on every producer, best effort.
  virtual void Abort(const TransferId& id) = 0;
};

/// Make the ProducerSet of W producers in this process, each streaming with a ProducerStream
/// (`stream`, with producer_id and num_producers set per producer) into the channel `channels`
/// opens for it. Errors: InvalidArgument (no producers, a null tracker or source, no channel
/// factory, more than 2^32 producers, stream options ProducerStream refuses).
Result<std::unique_ptr<ProducerSet>> MakeLocalProducers(const ProducerStreamOptions& stream,
                                                        std::vector<CoordinatedProducer> producers,
                                                        ChannelFactory channels);

/// Options of Coordinator::Make.
struct CoordinatorOptions {
  /// The producers' stream options (for the Make that takes CoordinatedProducers);
  /// producer_id and num_producers are set per producer.
  ProducerStreamOptions stream;
  /// The budget of one transfer from Begin to the end of Flush. Past it, sends fail with
  /// DeadlineExceeded and the transfer is aborted.
  std::chrono::milliseconds transfer_timeout{std::chrono::minutes(10)};
  /// Told of each transfer's outcome, and asked whether a transfer must be an anchor; borrowed,
  /// it must outlive the Coordinator. Null: nobody is told.
  TransferObserver* observer = nullptr;
  /// Name each transfer's relay tree in every receiver's prepare (transports with fan_out_tree):
  /// the receivers of its route, by data_endpoint, in receiver order. Needs every receiver's
  /// data_endpoint.
  bool relay_trees = false;
  /// Route payloads by holdings: before each transfer, ask every receiver which elements it
  /// holds of each canonical tensor (ReceiverControl::Regions), group the receivers into classes
  /// that hold the same, and have every producer send each class only its cut of each item,
  /// through a channel to that class's endpoints. Needs every receiver's data_endpoint and a
  /// channel factory that honours ChannelRequest::endpoints. The tensors asked about are those of
  /// the producers' (ProducerSet::TensorNames), else the last transfer's (and `tensor_names`
  /// before the first); a transfer that knows none is not routed.
  bool route_by_holdings = false;
  /// The canonical tensor names to route by before any transfer told them (e.g. kept from an
  /// earlier Coordinator's RefitReport::digests).
  std::vector<std::string> tensor_names = {};
  /// Plan each receiver on its own (docs/protocol.md "Per-receiver plans", PlanCatchUps): in a
  /// delta transfer, receivers at the base get the delta, and one behind it (or new, or needing
  /// an anchor, by CoordinatedReceiver::standing) folded deltas or an anchor of its own, through
  /// routes of their own, in the same transfer. Needs relay_trees (every receiver's
  /// data_endpoint). false: every receiver gets the transfer's own items.
  bool per_receiver_plans = false;
  /// The lineage every Prepare states (docs/protocol.md "Lineage and fencing"): the trainer's
  /// run id and epoch, and `lineage.base_fingerprint`, the StateFingerprint of the producers'
  /// state at version `fingerprint_version`, which a delta from that version states (other
  /// transfers state 0: not known). Each transfer that commits moves both to its target (the
  /// fingerprint of the digests it declared). Default: no lineage stated. (Last, with
  /// initializers.)
  TransferLineage lineage = {};
  uint64_t fingerprint_version = 0;
  /// When the transfer commits although some receivers did not flush (refit/commit_policy.h):
  /// `all` (any failure aborts everywhere) or a quorum of replicas, the others fenced (aborted,
  /// reported in ReceiverOutcome::fenced, caught up at the next transfer by their own plans).
  /// A quorum needs per_receiver_plans, which is what prepares a fenced receiver from the
  /// version it holds (docs/protocol.md "Stragglers and quorum").
  CommitPolicy commit_policy = {};
};

/// Drives transfers across W producers and N receivers.
///
/// Thread-safety: Refit calls must not overlap (one transfer at a time, as on a receiver); the
/// Coordinator runs each phase on its own threads and joins them before returning.
class Coordinator {
 public:
  /// Errors: InvalidArgument (a null receiver control, a non-positive timeout, a replica whose
  /// receivers do not form shards 0 … n − 1 exactly once, a commit policy out of range or asking
  /// for more replicas than the fleet has, a quorum without per_receiver_plans, and those of
  /// MakeLocalProducers).
  static Result<std::unique_ptr<Coordinator>> Make(const CoordinatorOptions& options,
                                                   std::vector<CoordinatedProducer> producers,
                                                   std::vector<CoordinatedReceiver> receivers,
                                                   ChannelFactory channels);
  /// As above over any ProducerSet (options.stream is not used).
  static Result<std::unique_ptr<Coordinator>> Make(const CoordinatorOptions& options,
                                                   std::unique_ptr<ProducerSet> producers,
                                                   std::vector<CoordinatedReceiver> receivers);

  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  /// Run one transfer with a fresh random id. `force_anchor` makes it FULL.
  /// Errors: the first failure, its message naming the transfer, the phase and the place
  /// (producer p, receiver name), followed by the other failures and by any receiver whose
  /// Abort failed; FailedPrecondition when the producers' plans disagree (different versions)
  /// or a tracker has a transfer open.
  Result<RefitReport> Refit(bool force_anchor = false);
  /// As above with the caller's transfer id (for retries keyed by the caller).
  Result<RefitReport> Refit(const TransferId& id, bool force_anchor = false);

 private:
  struct Impl;
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit::internal
