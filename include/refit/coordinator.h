// Coordinator: one transfer across the whole fleet, with a two-phase commit. It moves no payload
// bytes itself: producers stream through their PayloadChannels, receivers are driven through
// their ReceiverControl.
//
//   1. Begin       every producer's tracker opens the transfer; their plans must agree
//   2. Prepare     every receiver opens it at the base version (version fencing)
//   3. Stream      producers 0 … W−1 run their ProducerStream concurrently, each into its own
//                  channel, then Finish (the relay flush with the producer's payload count)
//   4. Flush       every receiver waits for the declared payload counts, applies, verifies its
//                  state digests against the producers' pending digests → prepared
//   5. Commit      every receiver commits (the decision point is the last successful Flush),
//                  then every tracker commits its pending bits
//
// A failure or timeout in steps 1–4 aborts everywhere: receivers roll back to the base version
// bit-exactly, trackers drop their pending bits, and Refit returns the first error with every
// failure listed by place. The next Refit (a new transfer id) starts from the same base, without
// restarting anything. Once every receiver is prepared the transfer is decided: a receiver whose
// Commit reply is lost stays prepared and commits implicitly at the next Prepare (DESIGN.md
// "implied commit"), so step 5 reports such a receiver instead of failing the transfer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/payload.h"
#include "refit/pipeline.h"
#include "refit/receiver_session.h"
#include "refit/status.h"
#include "refit/tracker.h"

namespace refit {

/// One producer (trainer rank) of the fleet.
struct CoordinatedProducer {
  /// Its tracker, holding the baseline of the chunks it owns. Borrowed; it must outlive the
  /// Coordinator and is driven only by it while a Refit runs.
  DeltaTracker* tracker = nullptr;
  /// Make the chunk source of one transfer: every export chunk of the model in canonical order
  /// (ProducerStream pulls them all and encodes the owned ones).
  std::function<Result<ChunkSource>(const TransferPlan& plan)> source;
};

/// One receiver of the fleet.
struct CoordinatedReceiver {
  /// How errors and reports name it, e.g. its control URL.
  std::string name;
  /// Borrowed; must outlive the Coordinator.
  ReceiverControl* control = nullptr;
};

/// What a producer's channel is opened for.
struct ChannelRequest {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
};

/// Open the channel through which producer `request.producer_id` sends its payloads of one
/// transfer (for a transport: Transport::MakeSender with the fleet's endpoints).
using ChannelFactory =
    std::function<Result<std::unique_ptr<PayloadChannel>>(const ChannelRequest& request)>;

/// Told what becomes of each transfer, by the coordinator that ran it: for a transport that keeps
/// state beyond delivering payloads (an object store publishing committed versions to a chain a
/// late receiver can replay, or deleting the objects of an aborted transfer).
///
/// Thread-safety: called from the thread that runs Coordinator::Refit, never concurrently.
class TransferObserver {
 public:
  virtual ~TransferObserver() = default;

  /// Whether the next transfer, from `base_version`, must be an anchor (FULL): e.g. the chain a
  /// late receiver replays does not hold `base_version`, so a delta from it would be useless.
  virtual bool NeedsAnchor(uint64_t /*base_version*/) { return false; }

  /// Transfer `plan` committed on every receiver and tracker; `digests` are the fleet's state
  /// digests at plan.target_version. Called after every channel of the transfer is destroyed.
  /// An error is logged and does not undo the transfer: the fleet holds the new version.
  virtual Status TransferCommitted(const TransferPlan& /*plan*/,
                                   const std::map<std::string, uint64_t>& /*digests*/) {
    return Status::OK();
  }

  /// Transfer `id` was aborted everywhere. Called after every channel of it is destroyed.
  virtual void TransferAborted(const TransferId& /*id*/) {}
};

/// Options of Coordinator::Make.
struct CoordinatorOptions {
  /// The producers' stream options; producer_id and num_producers are set per producer.
  ProducerStreamOptions stream;
  /// The budget of one transfer from Begin to the end of Flush. Past it, sends fail with
  /// DeadlineExceeded and the transfer is aborted.
  std::chrono::milliseconds transfer_timeout{std::chrono::minutes(10)};
  /// Told of each transfer's outcome, and asked whether a transfer must be an anchor; borrowed,
  /// it must outlive the Coordinator. Null: nobody is told.
  TransferObserver* observer = nullptr;
};

/// What one receiver reported.
struct ReceiverOutcome {
  std::string name;
  FlushReport flush;
  /// The transfer this receiver committed implicitly at Prepare, if any.
  std::optional<TransferId> implied_commit;
  /// OK, or why its Commit failed after the decision (it stays prepared and commits implicitly
  /// at the next transfer's Prepare).
  Status commit_status;
};

/// What one successful Refit did.
struct RefitReport {
  TransferPlan plan;
  /// Per producer, in producer order.
  std::vector<StreamReport> producers;
  /// Per receiver, in receiver order.
  std::vector<ReceiverOutcome> receivers;
  /// Sums over producers.
  uint64_t payloads = 0;
  uint64_t wire_bytes = 0;
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  /// Wall time of each phase and of the whole transfer, in seconds.
  double prepare_s = 0;
  double stream_s = 0;
  double flush_s = 0;
  double commit_s = 0;
  double total_s = 0;
};

/// Drives transfers across W producers and N receivers.
///
/// Thread-safety: Refit calls must not overlap (one transfer at a time, as on a receiver); the
/// Coordinator runs each phase on its own threads and joins them before returning.
class Coordinator {
 public:
  /// Errors: InvalidArgument (no producers, a null tracker or source, a null receiver control,
  /// a null channel factory, stream options that ProducerStream refuses, a non-positive timeout).
  static Result<std::unique_ptr<Coordinator>> Make(const CoordinatorOptions& options,
                                                   std::vector<CoordinatedProducer> producers,
                                                   std::vector<CoordinatedReceiver> receivers,
                                                   ChannelFactory channels);

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

}  // namespace refit
