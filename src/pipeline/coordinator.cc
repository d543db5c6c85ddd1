#include "pipeline/coordinator.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/digest.h"
#include "pipeline/quorum.h"
#include "refit/status_format.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

using Clock = std::chrono::steady_clock;

// How long past a transfer's deadline the coordinator still waits for the calls that end it
// (aborts, or commits once decided): a receiver that is up answers one in milliseconds, and one
// that does not answer within a second is as good as down (it rolls back at its lease, or commits
// implicitly at the next transfer). Bounds how far `refit push --timeout` can overshoot.
constexpr std::chrono::seconds kDecisionMargin{1};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A failure of one place in one phase ("producer 1", "receiver http://…").
struct Failure {
  std::string where;
  Status status;
};

// The failures of one phase, collected from many threads.
class Failures {
 public:
  void Add(std::string where, Status status) {
    internal::MutexLock lock(mutex_);
    list_.push_back({std::move(where), std::move(status)});
  }
  bool empty() const {
    internal::MutexLock lock(mutex_);
    return list_.empty();
  }
  std::vector<Failure> Take() {
    internal::MutexLock lock(mutex_);
    return std::move(list_);
  }

 private:
  mutable internal::Mutex mutex_;
  std::vector<Failure> list_;
};

// Run fn(0) … fn(n − 1) concurrently, one thread each, and join them. The fleet has tens of
// receivers at most per coordinator and every call blocks on the network, so a thread per call
// is the simplest correct choice; the caller's thread takes index 0.
void ForEachConcurrently(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::jthread> threads;
  threads.reserve(n > 0 ? n - 1 : 0);
  for (size_t i = 1; i < n; ++i) threads.emplace_back([&fn, i] { fn(i); });
  if (n > 0) fn(0);
}

// A Failure list as one Status: the most telling failure first (a refusal or a corrupt payload
// explains the cancellations and timeouts it caused elsewhere), its message naming the place.
Status CombineFailures(std::vector<Failure> failures) {
  std::stable_sort(failures.begin(), failures.end(), [](const Failure& a, const Failure& b) {
    auto rank = [](StatusCode code) {
      return code == StatusCode::kCancelled || code == StatusCode::kDeadlineExceeded ? 1 : 0;
    };
    return rank(a.status.code()) < rank(b.status.code());
  });
  const Failure& first = failures.front();
  // An empty place: the status names its place itself (a ProducerSet's combined failure).
  std::string message = first.where.empty()
                            ? std::string(first.status.message())
                            : fmt::format("{}: {}", first.where, first.status.message());
  for (size_t i = 1; i < failures.size(); ++i) {
    message += fmt::format("; also at {}: {}", failures[i].where, failures[i].status.ToString());
  }
  return Status(first.status.code(), std::move(message));
}

// W producers in this process, each with its own tracker, stream and channel.
class LocalProducers final : public ProducerSet {
 public:
  LocalProducers(std::vector<CoordinatedProducer> producers,
                 std::vector<std::unique_ptr<ProducerStream>> streams, ChannelFactory channels)
      : producers_(std::move(producers)),
        streams_(std::move(streams)),
        channels_(std::move(channels)) {}

  uint32_t size() const override { return static_cast<uint32_t>(producers_.size()); }
  uint64_t version() const override { return producers_.front().tracker->version(); }

  Result<TransferPlan> Begin(const TransferId& id, bool force_anchor) override {
    bool anchor = force_anchor;
    for (const CoordinatedProducer& producer : producers_) {
      anchor = anchor || producer.tracker->NextIsAnchor();
    }
    std::optional<TransferPlan> agreed;
    for (size_t p = 0; p < producers_.size(); ++p) {
      Result<TransferPlan> plan = producers_[p].tracker->Begin(id, anchor);
      Status problem;
      if (!plan.ok()) {
        problem = plan.status().WithContext(fmt::format("producer {}", p));
      } else if (agreed.has_value() && (plan->base_version != agreed->base_version ||
                                        plan->target_version != agreed->target_version)) {
        problem = FailedPrecondition(
            "producer {} is at version {} but producer 0 at version {}: the producers' trackers "
            "are at different versions",
            p, plan->base_version, agreed->base_version);
        producers_[p].tracker->Abort(id).IgnoreError();
      }
      if (!problem.ok()) {
        for (size_t q = 0; q < p; ++q) producers_[q].tracker->Abort(id).IgnoreError();
        return problem;
      }
      if (!agreed.has_value()) agreed = *plan;
    }
    for (CoordinatedProducer& producer : producers_) {
      if (producer.history != nullptr)
        producer.history->Begin(agreed->base_version, agreed->anchor);
    }
    return *agreed;
  }

  std::optional<uint64_t> FoldableFrom() const override {
    std::optional<uint64_t> oldest;
    for (const CoordinatedProducer& producer : producers_) {
      if (producer.history == nullptr) return std::nullopt;
      const std::optional<uint64_t> own = producer.history->oldest_version();
      if (!own.has_value()) return std::nullopt;
      oldest = std::max(oldest.value_or(0), *own);
    }
    return oldest;
  }

  Result<std::vector<ProducerStreamed>> Stream(const TransferPlan& plan,
                                               std::span<const TransferRoute> routes,
                                               Clock::time_point deadline) override {
    std::vector<ProducerStreamed> streamed(producers_.size());
    Failures failures;
    ForEachConcurrently(producers_.size(), [&](size_t p) {
      const std::string where = fmt::format("producer {}", p);
      Result<ChunkSource> source = producers_[p].source(plan);
      if (!source.ok()) return failures.Add(where, source.status());
      // One channel per route, each to its own receivers.
      std::vector<std::unique_ptr<PayloadChannel>> channels;
      std::vector<StreamRoute> stream_routes;
      for (size_t k = 0; k < routes.size(); ++k) {
        // A catch-up route's receivers are prepared from the base it names (PlanCatchUps).
        const bool own_base = routes[k].content != CatchUp::kDelta;
        Result<std::unique_ptr<PayloadChannel>> channel = channels_(
            ChannelRequest{.transfer_id = plan.transfer_id,
                           .producer_id = static_cast<uint32_t>(p),
                           .base_version = own_base ? routes[k].from_version : plan.base_version,
                           .target_version = plan.target_version,
                           .endpoints = routes[k].endpoints,
                           .deadline = deadline});
        if (!channel.ok()) {
          return failures.Add(
              where, routes.size() == 1 ? channel.status()
                                        : channel.status().WithContext(fmt::format("route {}", k)));
        }
        channels.push_back(std::move(channel).ValueOrDie());
        stream_routes.push_back(StreamRoute{
            routes[k].items.get(), DeadlineSender(*channels.back(), deadline),
            channels.back()->AsSenderCleanup(), routes[k].content, routes[k].from_version});
      }
      Result<StreamReport> report =
          streams_[p]->Run(*producers_[p].tracker, *source, stream_routes, producers_[p].history);
      if (!report.ok()) return failures.Add(where, report.status());
      if (Clock::now() > deadline) {
        return failures.Add(where, DeadlineExceeded("the transfer passed its deadline"));
      }
      for (size_t k = 0; k < channels.size(); ++k) {
        Status finished = channels[k]->Finish(report->routes[k].payloads);
        if (!finished.ok()) {
          return failures.Add(
              where, finished.WithContext(routes.size() == 1 ? std::string("finish")
                                                             : fmt::format("finish route {}", k)));
        }
      }
      streamed[p].report = *std::move(report);
      streamed[p].digests = producers_[p].tracker->PendingDigests();
    });
    if (!failures.empty()) return CombineFailures(failures.Take());
    return streamed;
  }

  // Each tracker scatters its own changes into its own baseline: all at once.
  Status Commit(const TransferId& id) override {
    Failures failures;
    ForEachConcurrently(producers_.size(), [&](size_t p) {
      Status committed = producers_[p].tracker->Commit(id);
      if (!committed.ok()) failures.Add(fmt::format("producer {}", p), committed);
      if (producers_[p].history != nullptr) {
        // A tracker that could not commit leaves the chain broken: the next Begin clears.
        if (committed.ok()) {
          producers_[p].history->Commit();
        } else {
          producers_[p].history->Abort();
        }
      }
    });
    if (!failures.empty()) return CombineFailures(failures.Take());
    return Status::OK();
  }

  void Abort(const TransferId& id) override {
    for (CoordinatedProducer& producer : producers_) {
      // Only fails for another open transfer id, which Begin has ruled out.
      producer.tracker->Abort(id).IgnoreError();
      if (producer.history != nullptr) producer.history->Abort();
    }
  }

 private:
  // A channel's sender that refuses to send once the transfer has used up its budget, so a slow
  // transport cannot hold the fleet past the coordinator's timeout.
  static PayloadSender DeadlineSender(PayloadChannel& channel, Clock::time_point deadline) {
    return [&channel, deadline](uint32_t payload_id, std::span<const std::byte> payload) {
      if (Clock::now() > deadline) {
        return DeadlineExceeded("payload {}: the transfer passed its deadline", payload_id);
      }
      return channel.Send(payload_id, payload);
    };
  }

  std::vector<CoordinatedProducer> producers_;
  std::vector<std::unique_ptr<ProducerStream>> streams_;
  ChannelFactory channels_;
};

// The receivers of one replica, by index into the coordinator's receiver list, in shard order.
struct Replica {
  std::string name;
  std::vector<size_t> shards;
};

// Group receivers into replicas and check that each replica has shards 0 … n − 1 exactly once.
Result<std::vector<Replica>> GroupReplicas(const std::vector<CoordinatedReceiver>& receivers) {
  std::vector<Replica> replicas;
  std::map<std::string, size_t> by_name;
  for (size_t r = 0; r < receivers.size(); ++r) {
    const CoordinatedReceiver& receiver = receivers[r];
    if (receiver.place.shards == 0 || receiver.place.shard >= receiver.place.shards) {
      return InvalidArgument("coordinator: receiver '{}' is shard {} of {}", receiver.name,
                             receiver.place.shard, receiver.place.shards);
    }
    if (receiver.place.replica.empty()) {
      if (receiver.place.shards != 1) {
        return InvalidArgument(
            "coordinator: receiver '{}' is shard {} of {} but names no replica: the shards of a "
            "group must share a replica name",
            receiver.name, receiver.place.shard, receiver.place.shards);
      }
      replicas.push_back({receiver.name, {r}});
      continue;
    }
    auto [it, inserted] = by_name.emplace(receiver.place.replica, replicas.size());
    if (inserted) {
      replicas.push_back(
          {receiver.place.replica, std::vector<size_t>(receiver.place.shards, SIZE_MAX)});
    }
    Replica& replica = replicas[it->second];
    if (replica.shards.size() != receiver.place.shards) {
      return InvalidArgument("coordinator: replica '{}': receiver '{}' says {} shards, another {}",
                             receiver.place.replica, receiver.name, receiver.place.shards,
                             replica.shards.size());
    }
    if (replica.shards[receiver.place.shard] != SIZE_MAX) {
      return InvalidArgument("coordinator: replica '{}' has shard {} twice: '{}' and '{}'",
                             receiver.place.replica, receiver.place.shard,
                             receivers[replica.shards[receiver.place.shard]].name, receiver.name);
    }
    replica.shards[receiver.place.shard] = r;
  }
  for (const Replica& replica : replicas) {
    for (size_t shard = 0; shard < replica.shards.size(); ++shard) {
      if (replica.shards[shard] == SIZE_MAX) {
        return InvalidArgument(
            "coordinator: replica '{}' lacks shard {} of {}: a shard group is verified as a "
            "whole, so every shard must take part",
            replica.name, shard, replica.shards.size());
      }
    }
  }
  return replicas;
}

// Verify one replica after flush: each expected tensor's state, as its shards report it, must be
// the producers'. A receiver without a loader reports whole-tensor digests; one with a loader
// reports pieces in canonical coordinates, whose distinct ids add up to the whole tensor, and
// whose copies (replicated pieces) must agree.
Status VerifyReplica(const Replica& replica, const std::vector<CoordinatedReceiver>& receivers,
                     const std::vector<ReceiverOutcome>& outcomes,
                     const std::map<std::string, uint64_t>& expected) {
  for (const auto& [name, want] : expected) {
    std::map<std::string, std::pair<uint64_t, size_t>> pieces;  // id → (digest, shard)
    size_t skipped = 0;
    for (size_t shard = 0; shard < replica.shards.size(); ++shard) {
      const FlushReport& flush = outcomes[replica.shards[shard]].flush;
      const std::string& where = receivers[replica.shards[shard]].name;
      CanonicalHolding whole;
      const CanonicalHolding* holding = nullptr;
      if (auto it = flush.holdings.find(name); it != flush.holdings.end()) {
        holding = &it->second;
      } else if (auto digest = flush.digests.find(name);
                 flush.holdings.empty() && digest != flush.digests.end()) {
        whole.pieces.emplace("", digest->second);
        holding = &whole;
      } else {
        return DataLoss("receiver '{}' reports no state for tensor '{}'", where, name);
      }
      if (holding->skipped) {
        ++skipped;
        continue;
      }
      for (const auto& [piece, digest] : holding->pieces) {
        auto [it, inserted] = pieces.emplace(piece, std::pair{digest, shard});
        if (!inserted && it->second.first != digest) {
          return DataLoss(
              "replica '{}': tensor '{}' piece '{}' has state digest {:016x} on shard {} but "
              "{:016x} on shard {}: the copies of a replicated piece differ",
              replica.name, name, piece, it->second.first, it->second.second, digest, shard);
        }
      }
    }
    if (skipped == replica.shards.size()) continue;  // The replica's loader skips this tensor.
    uint64_t sum = 0;
    for (const auto& [piece, digest] : pieces) sum += digest.first;
    if (sum != want) {
      return DataLoss(
          "replica '{}': tensor '{}' has state digest {:016x} over its {} shard(s) ({} piece(s)), "
          "the producers expect {:016x}",
          replica.name, name, sum, replica.shards.size(), pieces.size(), want);
    }
  }
  return Status::OK();
}

}  // namespace

struct Coordinator::Impl {
  CoordinatorOptions options;
  std::unique_ptr<ProducerSet> producers;
  std::vector<CoordinatedReceiver> receivers;
  std::vector<Replica> replicas;
  // The canonical tensors of the last transfer: what routing asks the receivers about.
  std::vector<std::string> tensor_names;
  // The deadline of the transfer Refit runs.
  Clock::time_point transfer_deadline{};

  // Bound every receiver's later calls by `deadline` (ReceiverControl::SetCallDeadline).
  void SetCallDeadlines(std::optional<Clock::time_point> deadline) {
    for (CoordinatedReceiver& receiver : receivers) receiver.control->SetCallDeadline(deadline);
  }
  // The bound of the calls that end a transfer (aborts, commits): the transfer's deadline, or
  // now once it passed, plus kDecisionMargin.
  Clock::time_point DecisionDeadline() const {
    return std::max(Clock::now(), transfer_deadline) + kDecisionMargin;
  }

  Result<RefitReport> Refit(const TransferId& id, bool force_anchor);
  // The routes of the next transfer and each receiver's route: one route of every receiver,
  // unless routing by holdings finds more than one class. Errors: a receiver that cannot say
  // what it holds, or says something malformed, named.
  // Receivers with another catch-up than the delta (`catch_ups`, PlanCatchUps) get routes of
  // their own, one per (holdings, catch-up, held version).
  Result<std::vector<TransferRoute>> PlanRoutes(std::vector<size_t>& route_of,
                                                const std::vector<PlannedCatchUp>& catch_ups);

  // Abort on every receiver and producer; return the receivers whose abort failed.
  std::vector<Failure> AbortEverywhere(const TransferId& id);
  // The error Refit returns: the first failure, then the rest and any failed aborts.
  Status FailTransfer(const TransferId& id, std::string_view phase, std::vector<Failure> failures);
};

Result<std::vector<TransferRoute>> Coordinator::Impl::PlanRoutes(
    std::vector<size_t>& route_of, const std::vector<PlannedCatchUp>& catch_ups) {
  route_of.assign(receivers.size(), 0);
  std::vector<TransferRoute> routes;
  const auto unrouted = [&] {
    TransferRoute all;
    for (size_t r = 0; r < receivers.size(); ++r) all.receivers.push_back(r);
    if (options.relay_trees) {
      for (size_t r = 0; r < receivers.size(); ++r) {
        all.endpoints.push_back(receivers[r].data_endpoint);
      }
    }
    return std::vector<TransferRoute>{std::move(all)};
  };
  const bool catching_up = std::any_of(catch_ups.begin(), catch_ups.end(),
                                       [](const auto& c) { return c.how != CatchUp::kDelta; });
  std::vector<std::string> names = producers->TensorNames();
  if (names.empty()) names = tensor_names;
  const bool by_holdings = options.route_by_holdings && !names.empty() && receivers.size() >= 2;
  if (!by_holdings && !catching_up) return unrouted();
  std::vector<HeldRegions> held(receivers.size());
  Failures failures;
  if (by_holdings) {
    ForEachConcurrently(receivers.size(), [&](size_t r) {
      Result<HeldRegions> regions = receivers[r].control->Regions(names);
      if (!regions.ok()) return failures.Add(receivers[r].name, regions.status());
      held[r] = *std::move(regions);
    });
  }
  if (!failures.empty()) return CombineFailures(failures.Take());
  // Receivers holding the same elements and caught up the same way form one class, in the
  // order their first member comes.
  std::map<std::tuple<HeldRegions, CatchUp, uint64_t>, size_t> class_of;
  for (size_t r = 0; r < receivers.size(); ++r) {
    const CatchUp how = catch_ups[r].how;
    // The base its receivers are prepared from, which its payloads' headers carry.
    const uint64_t from = how == CatchUp::kDelta ? 0 : catch_ups[r].prepared_base;
    const auto [it, inserted] = class_of.emplace(std::tuple(held[r], how, from), routes.size());
    if (inserted) {
      TransferRoute route;
      if (!held[r].empty()) {
        Result<ItemRoute> items = ItemRoute::Make(held[r]);
        if (!items.ok()) return items.status().WithContext(receivers[r].name);
        route.items = std::make_shared<const ItemRoute>(*std::move(items));
      }
      route.content = how;
      route.from_version = from;
      routes.push_back(std::move(route));
    }
    route_of[r] = it->second;
    routes[it->second].receivers.push_back(r);
    routes[it->second].endpoints.push_back(receivers[r].data_endpoint);
  }
  if (routes.size() == 1 && routes[0].items == nullptr && routes[0].content == CatchUp::kDelta) {
    return unrouted();
  }
  return routes;
}

std::vector<Failure> Coordinator::Impl::AbortEverywhere(const TransferId& id) {
  SetCallDeadlines(DecisionDeadline());
  Failures failed_aborts;
  ForEachConcurrently(receivers.size(), [&](size_t r) {
    Status st = receivers[r].control->Abort(id);
    if (!st.ok()) failed_aborts.Add(receivers[r].name, std::move(st));
  });
  producers->Abort(id);
  return failed_aborts.Take();
}

Status Coordinator::Impl::FailTransfer(const TransferId& id, std::string_view phase,
                                       std::vector<Failure> failures) {
  std::vector<Failure> failed_aborts = AbortEverywhere(id);
  const Status combined = CombineFailures(std::move(failures));
  std::string message =
      fmt::format("transfer {}: {} failed at {}", id.ToHex(), phase, combined.message());
  if (failed_aborts.empty()) {
    message += fmt::format("; aborted on {} receiver(s) and {} producer(s)", receivers.size(),
                           producers->size());
  } else {
    for (const Failure& f : failed_aborts) {
      message += fmt::format("; abort failed at {}: {}", f.where, f.status.ToString());
    }
  }
  // The caller gets this message as the returned error and reports it; a warning too would show
  // a user the same text twice.
  REFIT_LOG_INFO("{}", message);
  if (options.observer != nullptr) options.observer->TransferAborted(id);
  return Status(combined.code(), std::move(message));
}

Result<RefitReport> Coordinator::Impl::Refit(const TransferId& id, bool force_anchor) {
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + options.transfer_timeout;
  // Every control call of the transfer, retries included, ends by its deadline (aborts and
  // commits by DecisionDeadline); the bound is lifted when Refit returns.
  transfer_deadline = deadline;
  SetCallDeadlines(deadline);
  struct LiftCallDeadlines {
    Impl* impl;
    ~LiftCallDeadlines() { impl->SetCallDeadlines(std::nullopt); }
  } const lift{this};
  RefitReport report;
  if (options.observer != nullptr && !force_anchor &&
      options.observer->NeedsAnchor(producers->version())) {
    REFIT_LOG_INFO("transfer {}: an anchor, as the transport asks", id.ToHex());
    force_anchor = true;
  }
  {
    Result<TransferPlan> plan = producers->Begin(id, force_anchor);
    if (!plan.ok()) return plan.status().WithContext(fmt::format("transfer {}: begin", id.ToHex()));
    report.plan = *plan;
  }
  const TransferPlan& plan = report.plan;

  // 2. Plan each receiver (per-receiver plans), then route: which receivers get which cut of
  // which items, through which relay tree.
  std::vector<std::optional<ReceiverStanding>> standings;
  for (const CoordinatedReceiver& receiver : receivers) standings.push_back(receiver.standing);
  std::vector<PlannedCatchUp> catch_ups = PlanCatchUps(
      plan, standings, options.per_receiver_plans ? producers->FoldableFrom() : std::nullopt);
  if (!options.per_receiver_plans) {
    // Every receiver gets the transfer's own items, as it is prepared for them.
    for (PlannedCatchUp& catch_up : catch_ups) {
      catch_up.how = plan.anchor ? CatchUp::kAnchor : CatchUp::kDelta;
      catch_up.prepared_base = plan.base_version;
    }
  }
  for (size_t r = 0; r < receivers.size(); ++r) {
    if (catch_ups[r].how != CatchUp::kDelta && !plan.anchor) {
      REFIT_LOG_INFO("transfer {}: {} is caught up by {} ({})", id.ToHex(), receivers[r].name,
                     CatchUpName(catch_ups[r].how), catch_ups[r].why);
    }
  }
  std::vector<size_t> route_of;
  {
    // In an anchor every route carries the same FULL items: no class of its own for that,
    // except for receivers prepared from the version they hold (behind the base), whose payloads'
    // headers name that version.
    std::vector<PlannedCatchUp> routed = catch_ups;
    if (plan.anchor) {
      for (PlannedCatchUp& catch_up : routed) {
        if (catch_up.prepared_base == plan.base_version) catch_up.how = CatchUp::kDelta;
      }
    }
    Result<std::vector<TransferRoute>> routes = PlanRoutes(route_of, routed);
    if (!routes.ok()) return FailTransfer(id, "route", {{"", routes.status()}});
    report.routes = *std::move(routes);
  }
  // Position of each receiver in its route's tree.
  std::vector<uint32_t> position(receivers.size(), 0);
  for (const TransferRoute& route : report.routes) {
    for (size_t i = 0; i < route.receivers.size(); ++i) {
      position[route.receivers[i]] = static_cast<uint32_t>(i);
    }
  }

  // 3. Prepare. Counts and digests are only known after streaming; they travel with Flush.
  report.receivers.resize(receivers.size());
  PrepareRequest prepare;
  prepare.transfer_id = id;
  prepare.base_version = plan.base_version;
  prepare.anchor = plan.anchor;
  prepare.lineage = options.lineage;
  if (plan.base_version != options.fingerprint_version) prepare.lineage.base_fingerprint = 0;
  {
    Failures failures;
    ForEachConcurrently(receivers.size(), [&](size_t r) {
      report.receivers[r].name = receivers[r].name;
      report.receivers[r].route = route_of[r];
      report.receivers[r].held_version =
          receivers[r].standing.has_value() ? catch_ups[r].from_version : plan.base_version;
      report.receivers[r].lag = catch_ups[r].lag;
      report.receivers[r].caught_up_by = catch_ups[r].how;
      PrepareRequest mine = prepare;
      if (catch_ups[r].how == CatchUp::kAnchor) mine.anchor = true;
      // The base fingerprint names what a delta from the fleet's base builds on; an anchor builds
      // on nothing, and a folded catch-up on a version whose fingerprint is not kept here.
      if (mine.anchor || catch_ups[r].how != CatchUp::kDelta) mine.lineage.base_fingerprint = 0;
      if (catch_ups[r].prepared_base != plan.base_version) {
        // Behind the base (folded, or an anchor of its own): its own base, the fleet's target. A
        // transfer it still has open from that base is rolled back (implied abort), never
        // committed: it may be one this receiver was fenced from (docs/protocol.md "Stragglers
        // and quorum").
        mine.base_version = catch_ups[r].prepared_base;
        mine.target_version = plan.target_version;
      }
      if (options.relay_trees) {
        mine.relay_tree = RelayTree{report.routes[route_of[r]].endpoints, position[r]};
      }
      Result<PrepareResult> prepared = receivers[r].control->Prepare(mine);
      if (!prepared.ok()) {
        failures.Add(receivers[r].name, prepared.status());
      } else {
        report.receivers[r].implied_commit = prepared->implied_commit;
        report.receivers[r].implied_abort = prepared->implied_abort;
        if (prepared->implied_abort.has_value()) {
          REFIT_LOG_INFO(
              "transfer {}: {} rolled back transfer {}, which was prepared but never decided",
              id.ToHex(), receivers[r].name, prepared->implied_abort->ToHex());
        }
      }
    });
    if (!failures.empty()) return FailTransfer(id, "prepare", failures.Take());
  }
  report.prepare_s = SecondsSince(start);

  // 4. Stream: every producer concurrently, each through its own channel per route.
  const Clock::time_point stream_start = Clock::now();
  std::vector<ProducerStreamed> streamed;
  {
    Result<std::vector<ProducerStreamed>> result = producers->Stream(plan, report.routes, deadline);
    if (!result.ok()) return FailTransfer(id, "stream", {{"", result.status()}});
    streamed = *std::move(result);
  }
  report.stream_s = SecondsSince(stream_start);

  // 5. Flush: declare what every producer sent each route and the state every tensor must reach.
  FlushOptions flush;
  std::vector<TransferExpectation> route_expected(report.routes.size());
  for (size_t p = 0; p < streamed.size(); ++p) {
    const StreamReport& sent = streamed[p].report;
    if (sent.routes.size() != report.routes.size()) {
      return FailTransfer(
          id, "flush",
          {{fmt::format("producer {}", p), Internal("it reports {} routes, the transfer has {}",
                                                    sent.routes.size(), report.routes.size())}});
    }
    for (size_t k = 0; k < report.routes.size(); ++k) {
      route_expected[k].payloads_per_producer[static_cast<uint32_t>(p)] =
          static_cast<uint32_t>(sent.routes[k].payloads);
    }
    report.payloads += sent.payloads;
    report.wire_bytes += sent.wire_bytes;
    report.changed_elements += sent.changed_elements;
    report.total_elements += sent.total_elements;
    for (const auto& [name, digest] : streamed[p].digests) {
      auto [it, inserted] = flush.expected.digests.emplace(name, digest);
      if (!inserted) {
        return FailTransfer(
            id, "flush",
            {{fmt::format("producer {}", p),
              FailedPrecondition("tensor '{}' is tracked by more than one producer", name)}});
      }
    }
    report.producers.push_back(std::move(streamed[p].report));
  }
  const Clock::time_point flush_start = Clock::now();
  flush.timeout =
      std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - flush_start),
               std::chrono::milliseconds(1));
  tensor_names.clear();
  for (const auto& [name, digest] : flush.expected.digests) tensor_names.push_back(name);
  {
    // Each receiver's flush (OK, or why it failed or missed the deadline), then each replica's
    // verification; the commit policy decides from both.
    std::vector<Status> flush_status(receivers.size());
    ForEachConcurrently(receivers.size(), [&](size_t r) {
      FlushOptions mine = flush;
      mine.expected.payloads_per_producer = route_expected[route_of[r]].payloads_per_producer;
      Result<FlushReport> flushed = receivers[r].control->Flush(id, mine);
      if (!flushed.ok()) {
        flush_status[r] = flushed.status();
        return;
      }
      if (catch_ups[r].prepared_base != plan.base_version &&
          flushed->target_version != plan.target_version) {
        flush_status[r] = FailedPrecondition(
            "prepared from version {}, it reports target version {}, not {}",
            catch_ups[r].prepared_base, flushed->target_version, plan.target_version);
        return;
      }
      report.receivers[r].flush = *std::move(flushed);
    });
    std::vector<Failure> failures;
    for (size_t r = 0; r < receivers.size(); ++r) {
      if (!flush_status[r].ok()) failures.push_back({receivers[r].name, flush_status[r]});
    }
    const bool quorum = options.commit_policy.kind == CommitPolicy::Kind::kQuorum;
    // Under `all` any failed flush aborts before verifying anything, as it always did.
    if (!quorum && !failures.empty()) return FailTransfer(id, "flush", std::move(failures));
    // A receiver checks whole-tensor digests itself; checking its report here as well means a
    // receiver that skipped the check (an older build, a bug) cannot commit a divergent state,
    // and a shard group, whose shards cannot check alone, is verified as one replica. Under a
    // quorum a replica counts only when every shard flushed and the group verified.
    std::vector<std::vector<size_t>> replica_receivers;
    std::vector<bool> replica_flushed;
    std::vector<Status> replica_failure;
    for (const Replica& replica : replicas) {
      Status failed;
      for (size_t r : replica.shards) {
        if (!flush_status[r].ok()) {
          failed = flush_status[r].WithContext(fmt::format("shard at {}", receivers[r].name));
          break;
        }
      }
      if (failed.ok()) {
        failed = VerifyReplica(replica, receivers, report.receivers, flush.expected.digests);
        if (!failed.ok()) failures.push_back({fmt::format("replica '{}'", replica.name), failed});
      }
      replica_receivers.push_back(replica.shards);
      replica_flushed.push_back(failed.ok());
      replica_failure.push_back(std::move(failed));
    }
    Result<CommitDecision> decided =
        DecideCommit(options.commit_policy, replica_receivers, replica_flushed, receivers.size());
    if (!decided.ok()) return FailTransfer(id, "flush", {{"commit policy", decided.status()}});
    report.replicas = decided->replicas;
    report.flushed_replicas = decided->flushed_replicas;
    if (!decided->commit) {
      const std::string phase =
          quorum ? fmt::format("flush ({} of {} replica(s) flushed; commit policy {} needs {})",
                               decided->flushed_replicas, decided->replicas,
                               CommitPolicyName(options.commit_policy), decided->required_replicas)
                 : std::string("flush");
      return FailTransfer(id, phase, std::move(failures));
    }
    for (size_t k = 0; k < replicas.size(); ++k) {
      if (replica_flushed[k]) continue;
      for (size_t r : replicas[k].shards) {
        report.receivers[r].fenced = true;
        report.receivers[r].fenced_because = replica_failure[k];
        report.fenced.push_back(receivers[r].name);
        REFIT_LOG_WARN(
            "transfer {}: {} is fenced (commit policy {}, {} of {} replica(s) flushed): {}; it is "
            "rolled back to version {} and caught up at the next transfer",
            id.ToHex(), receivers[r].name, CommitPolicyName(options.commit_policy),
            decided->flushed_replicas, decided->replicas, replica_failure[k].ToString(),
            catch_ups[r].from_version);
      }
    }
  }
  report.flush_s = SecondsSince(flush_start);

  // 6. Commit. Every receiver is prepared and verified: the transfer is decided. From here on
  // nothing aborts it: a receiver whose Commit fails stays prepared and commits implicitly at
  // the next transfer, which is based on the target because the trackers commit below whatever
  // the receivers answered. Aborting now could split the fleet: a receiver that committed
  // cannot roll back.
  const Clock::time_point commit_start = Clock::now();
  SetCallDeadlines(DecisionDeadline());
  // The trackers commit (scatter their changes into their baselines) while the receivers do:
  // neither depends on the other's answer.
  Status producers_committed;
  std::jthread producer_commit([&] { producers_committed = producers->Commit(id); });
  ForEachConcurrently(receivers.size(), [&](size_t r) {
    if (report.receivers[r].fenced) {
      // Decided per receiver: a fenced one is aborted (rolled back to what it held). Its abort
      // may be lost; it then never commits this transfer anyway: the next transfer prepares it
      // from the version it holds, which rolls this one back (implied abort, PlanCatchUps).
      Status aborted = receivers[r].control->Fence(id, plan.target_version);
      if (!aborted.ok()) {
        REFIT_LOG_WARN(
            "transfer {}: abort of fenced {} failed ({}); the next transfer's prepare from the "
            "version it holds rolls it back",
            id.ToHex(), receivers[r].name, aborted.ToString());
      }
      report.receivers[r].fence_abort_status = std::move(aborted);
      return;
    }
    Status committed = receivers[r].control->Commit(id);
    if (!committed.ok()) {
      REFIT_LOG_WARN(
          "transfer {}: commit at {} failed ({}); it stays prepared and commits implicitly at "
          "the next transfer",
          id.ToHex(), receivers[r].name, committed.ToString());
    }
    report.receivers[r].commit_status = std::move(committed);
  });
  producer_commit.join();
  if (Status committed = std::move(producers_committed); !committed.ok()) {
    // The receivers hold the target version and a tracker does not: the fleet must be
    // re-anchored. Say so rather than leave the next delta to fail at a digest check.
    return Internal(
        "transfer {}: receivers committed but a producer could not: {}; the next transfer must "
        "be an anchor",
        id.ToHex(), committed.ToString());
  }
  if (options.observer != nullptr) {
    Status observed = options.observer->TransferCommitted(plan, flush.expected.digests);
    if (!observed.ok()) {
      REFIT_LOG_WARN("transfer {}: committed, but the transport could not record it: {}",
                     id.ToHex(), observed.ToString());
    }
  }
  report.commit_s = SecondsSince(commit_start);
  report.total_s = SecondsSince(start);
  for (ReceiverOutcome& outcome : report.receivers) {
    for (const StreamReport& producer : report.producers) {
      if (outcome.route < producer.routes.size()) {
        outcome.wire_bytes += producer.routes[outcome.route].wire_bytes;
      }
    }
  }
  report.digests = std::move(flush.expected.digests);
  options.lineage.base_fingerprint = report.digests.empty() ? 0 : StateFingerprint(report.digests);
  options.fingerprint_version = plan.target_version;
  return report;
}

Result<std::unique_ptr<ProducerSet>> MakeLocalProducers(const ProducerStreamOptions& stream,
                                                        std::vector<CoordinatedProducer> producers,
                                                        ChannelFactory channels) {
  if (producers.empty()) return InvalidArgument("coordinator: no producers");
  if (!channels) return InvalidArgument("coordinator: no channel factory");
  if (producers.size() > UINT32_MAX) {
    return InvalidArgument("coordinator: {} producers exceed the 32-bit producer id space",
                           producers.size());
  }
  for (size_t p = 0; p < producers.size(); ++p) {
    if (producers[p].tracker == nullptr || !producers[p].source) {
      return InvalidArgument("coordinator: producer {} has no tracker or no source", p);
    }
  }
  std::vector<std::unique_ptr<ProducerStream>> streams;
  for (size_t p = 0; p < producers.size(); ++p) {
    ProducerStreamOptions options = stream;
    options.producer_id = static_cast<uint32_t>(p);
    options.num_producers = static_cast<uint32_t>(producers.size());
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerStream> made, ProducerStream::Make(options));
    streams.push_back(std::move(made));
  }
  return std::unique_ptr<ProducerSet>(
      new LocalProducers(std::move(producers), std::move(streams), std::move(channels)));
}

Result<std::unique_ptr<Coordinator>> Coordinator::Make(const CoordinatorOptions& options,
                                                       std::vector<CoordinatedProducer> producers,
                                                       std::vector<CoordinatedReceiver> receivers,
                                                       ChannelFactory channels) {
  REFIT_ASSIGN_OR_RETURN(
      std::unique_ptr<ProducerSet> local,
      MakeLocalProducers(options.stream, std::move(producers), std::move(channels)));
  return Make(options, std::move(local), std::move(receivers));
}

Result<std::unique_ptr<Coordinator>> Coordinator::Make(const CoordinatorOptions& options,
                                                       std::unique_ptr<ProducerSet> producers,
                                                       std::vector<CoordinatedReceiver> receivers) {
  if (producers == nullptr || producers->size() == 0) {
    return InvalidArgument("coordinator: no producers");
  }
  if (options.transfer_timeout.count() <= 0) {
    return InvalidArgument("coordinator: transfer_timeout must be positive, got {} ms",
                           options.transfer_timeout.count());
  }
  for (const CoordinatedReceiver& receiver : receivers) {
    if (receiver.control == nullptr) {
      return InvalidArgument("coordinator: receiver '{}' has no control", receiver.name);
    }
  }
  auto impl = std::make_unique<Impl>();
  REFIT_ASSIGN_OR_RETURN(impl->replicas, GroupReplicas(receivers));
  if (options.per_receiver_plans && !options.relay_trees) {
    return InvalidArgument(
        "coordinator: per-receiver plans send catch-up receivers routes of their own, which "
        "needs relay_trees");
  }
  if (Result<uint64_t> required = RequiredReplicas(options.commit_policy, impl->replicas.size());
      !required.ok()) {
    return required.status().WithContext("coordinator");
  }
  if (options.commit_policy.kind == CommitPolicy::Kind::kQuorum && !options.per_receiver_plans) {
    return InvalidArgument(
        "coordinator: commit policy {} fences receivers that miss the flush, and only per-receiver "
        "plans prepare a fenced receiver from the version it holds at the next transfer (a "
        "transport with relay trees, zmq://)",
        CommitPolicyName(options.commit_policy));
  }
  if (options.relay_trees || options.route_by_holdings) {
    for (const CoordinatedReceiver& receiver : receivers) {
      if (receiver.data_endpoint.empty()) {
        return InvalidArgument(
            "coordinator: receiver '{}' has no data endpoint: relay trees and routing by "
            "holdings name receivers by it",
            receiver.name);
      }
    }
  }
  impl->options = options;
  impl->tensor_names = options.tensor_names;
  impl->producers = std::move(producers);
  impl->receivers = std::move(receivers);
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() = default;

Result<RefitReport> Coordinator::Refit(bool force_anchor) {
  return impl_->Refit(TransferId::Random(), force_anchor);
}

Result<RefitReport> Coordinator::Refit(const TransferId& id, bool force_anchor) {
  return impl_->Refit(id, force_anchor);
}

}  // namespace refit::internal
