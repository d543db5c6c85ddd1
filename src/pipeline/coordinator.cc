#include "refit/coordinator.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "util/logging.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;

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
    std::lock_guard lock(mutex_);
    list_.push_back({std::move(where), std::move(status)});
  }
  bool empty() const {
    std::lock_guard lock(mutex_);
    return list_.empty();
  }
  std::vector<Failure> Take() {
    std::lock_guard lock(mutex_);
    return std::move(list_);
  }

 private:
  mutable std::mutex mutex_;
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

// A channel's sender that refuses to send once the transfer has used up its budget, so a slow
// transport cannot hold the fleet past the coordinator's timeout.
PayloadSender DeadlineSender(PayloadChannel& channel, Clock::time_point deadline,
                             std::chrono::milliseconds budget) {
  return [&channel, deadline, budget](uint32_t payload_id, std::span<const std::byte> payload) {
    if (Clock::now() > deadline) {
      return DeadlineExceeded("payload {}: the transfer passed its {} ms budget", payload_id,
                              budget.count());
    }
    return channel.Send(payload_id, payload);
  };
}

}  // namespace

struct Coordinator::Impl {
  CoordinatorOptions options;
  std::vector<CoordinatedProducer> producers;
  std::vector<CoordinatedReceiver> receivers;
  ChannelFactory channels;
  // One stream per producer, with its producer id set.
  std::vector<std::unique_ptr<ProducerStream>> streams;

  Result<RefitReport> Refit(const TransferId& id, bool force_anchor);

  // Begin on every tracker; on disagreement or failure, abort those that began.
  Result<TransferPlan> BeginEverywhere(const TransferId& id, bool force_anchor);
  void AbortTrackers(const TransferId& id);
  // Abort on every receiver and tracker; return the receivers whose abort failed.
  std::vector<Failure> AbortEverywhere(const TransferId& id);
  // The error Refit returns: the first failure, then the rest and any failed aborts.
  Status FailTransfer(const TransferId& id, std::string_view phase, std::vector<Failure> failures);
};

Result<TransferPlan> Coordinator::Impl::BeginEverywhere(const TransferId& id, bool force_anchor) {
  std::optional<TransferPlan> agreed;
  for (size_t p = 0; p < producers.size(); ++p) {
    Result<TransferPlan> plan = producers[p].tracker->Begin(id, force_anchor);
    Status problem;
    if (!plan.ok()) {
      problem = plan.status().WithContext(fmt::format("producer {}", p));
    } else if (agreed.has_value() &&
               (plan->anchor != agreed->anchor || plan->base_version != agreed->base_version ||
                plan->target_version != agreed->target_version)) {
      problem = FailedPrecondition(
          "producer {} plans {} v{} -> v{} but producer 0 plans {} v{} -> v{}: the producers' "
          "trackers are at different versions or anchor cadences",
          p, plan->anchor ? "an anchor" : "a delta", plan->base_version, plan->target_version,
          agreed->anchor ? "an anchor" : "a delta", agreed->base_version, agreed->target_version);
      producers[p].tracker->Abort(id).IgnoreError();
    }
    if (!problem.ok()) {
      for (size_t q = 0; q < p; ++q) producers[q].tracker->Abort(id).IgnoreError();
      return problem.WithContext(fmt::format("transfer {}: begin", id.ToHex()));
    }
    if (!agreed.has_value()) agreed = *plan;
  }
  return *agreed;
}

void Coordinator::Impl::AbortTrackers(const TransferId& id) {
  for (CoordinatedProducer& producer : producers) {
    // Only fails for another open transfer id, which BeginEverywhere has ruled out.
    producer.tracker->Abort(id).IgnoreError();
  }
}

std::vector<Failure> Coordinator::Impl::AbortEverywhere(const TransferId& id) {
  Failures failed_aborts;
  ForEachConcurrently(receivers.size(), [&](size_t r) {
    Status st = receivers[r].control->Abort(id);
    if (!st.ok()) failed_aborts.Add(receivers[r].name, std::move(st));
  });
  AbortTrackers(id);
  return failed_aborts.Take();
}

Status Coordinator::Impl::FailTransfer(const TransferId& id, std::string_view phase,
                                       std::vector<Failure> failures) {
  std::vector<Failure> failed_aborts = AbortEverywhere(id);
  // Report the most telling failure first: a refusal or a corrupt payload explains the
  // cancellations and timeouts it caused elsewhere.
  std::stable_sort(failures.begin(), failures.end(), [](const Failure& a, const Failure& b) {
    auto rank = [](StatusCode code) {
      return code == StatusCode::kCancelled || code == StatusCode::kDeadlineExceeded ? 1 : 0;
    };
    return rank(a.status.code()) < rank(b.status.code());
  });
  const Failure& first = failures.front();
  std::string message = fmt::format("transfer {}: {} failed at {}: {}", id.ToHex(), phase,
                                    first.where, first.status.message());
  for (size_t i = 1; i < failures.size(); ++i) {
    message += fmt::format("; also at {}: {}", failures[i].where, failures[i].status.ToString());
  }
  if (failed_aborts.empty()) {
    message += fmt::format("; aborted on {} receiver(s) and {} producer(s)", receivers.size(),
                           producers.size());
  } else {
    for (const Failure& f : failed_aborts) {
      message += fmt::format("; abort failed at {}: {}", f.where, f.status.ToString());
    }
  }
  REFIT_LOG_WARN("{}", message);
  if (options.observer != nullptr) options.observer->TransferAborted(id);
  return Status(first.status.code(), std::move(message));
}

Result<RefitReport> Coordinator::Impl::Refit(const TransferId& id, bool force_anchor) {
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + options.transfer_timeout;
  RefitReport report;
  if (options.observer != nullptr && !force_anchor &&
      options.observer->NeedsAnchor(producers.front().tracker->version())) {
    REFIT_LOG_INFO("transfer {}: an anchor, as the transport asks", id.ToHex());
    force_anchor = true;
  }
  REFIT_ASSIGN_OR_RETURN(report.plan, BeginEverywhere(id, force_anchor));
  const TransferPlan& plan = report.plan;

  // 2. Prepare. Counts and digests are only known after streaming; they travel with Flush.
  report.receivers.resize(receivers.size());
  PrepareRequest prepare;
  prepare.transfer_id = id;
  prepare.base_version = plan.base_version;
  {
    Failures failures;
    ForEachConcurrently(receivers.size(), [&](size_t r) {
      report.receivers[r].name = receivers[r].name;
      Result<PrepareResult> prepared = receivers[r].control->Prepare(prepare);
      if (!prepared.ok()) {
        failures.Add(receivers[r].name, prepared.status());
      } else {
        report.receivers[r].implied_commit = prepared->implied_commit;
      }
    });
    if (!failures.empty()) return FailTransfer(id, "prepare", failures.Take());
  }
  report.prepare_s = SecondsSince(start);

  // 3. Stream: every producer concurrently, each through its own channel.
  const Clock::time_point stream_start = Clock::now();
  report.producers.resize(producers.size());
  {
    Failures failures;
    ForEachConcurrently(producers.size(), [&](size_t p) {
      const std::string where = fmt::format("producer {}", p);
      const uint32_t producer_id = static_cast<uint32_t>(p);
      Result<ChunkSource> source = producers[p].source(plan);
      if (!source.ok()) return failures.Add(where, source.status());
      Result<std::unique_ptr<PayloadChannel>> channel =
          channels(ChannelRequest{.transfer_id = id,
                                  .producer_id = producer_id,
                                  .base_version = plan.base_version,
                                  .target_version = plan.target_version});
      if (!channel.ok()) return failures.Add(where, channel.status());
      Result<StreamReport> streamed =
          streams[p]->Run(*producers[p].tracker, *source,
                          DeadlineSender(**channel, deadline, options.transfer_timeout),
                          (*channel)->AsSenderCleanup());
      if (!streamed.ok()) return failures.Add(where, streamed.status());
      if (Clock::now() > deadline) {
        return failures.Add(where, DeadlineExceeded("the transfer passed its {} ms budget",
                                                    options.transfer_timeout.count()));
      }
      Status finished = (*channel)->Finish(streamed->payloads);
      if (!finished.ok()) return failures.Add(where, finished.WithContext("finish"));
      report.producers[p] = *std::move(streamed);
    });
    if (!failures.empty()) return FailTransfer(id, "stream", failures.Take());
  }
  report.stream_s = SecondsSince(stream_start);

  // 4. Flush: declare what every producer sent and the state every tensor must reach.
  FlushOptions flush;
  for (size_t p = 0; p < producers.size(); ++p) {
    const StreamReport& streamed = report.producers[p];
    flush.expected.payloads_per_producer[static_cast<uint32_t>(p)] =
        static_cast<uint32_t>(streamed.payloads);
    report.payloads += streamed.payloads;
    report.wire_bytes += streamed.wire_bytes;
    report.changed_elements += streamed.changed_elements;
    report.total_elements += streamed.total_elements;
    for (const auto& [name, digest] : producers[p].tracker->PendingDigests()) {
      auto [it, inserted] = flush.expected.digests.emplace(name, digest);
      if (!inserted) {
        return FailTransfer(
            id, "flush",
            {{fmt::format("producer {}", p),
              FailedPrecondition("tensor '{}' is tracked by more than one producer", name)}});
      }
    }
  }
  const Clock::time_point flush_start = Clock::now();
  flush.timeout =
      std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - flush_start),
               std::chrono::milliseconds(1));
  {
    Failures failures;
    ForEachConcurrently(receivers.size(), [&](size_t r) {
      Result<FlushReport> flushed = receivers[r].control->Flush(id, flush);
      if (!flushed.ok()) return failures.Add(receivers[r].name, flushed.status());
      // A receiver checks the digests itself; checking its report here as well means a receiver
      // that skipped the check (an older build, a bug) cannot commit a divergent state.
      for (const auto& [name, expected] : flush.expected.digests) {
        auto it = flushed->digests.find(name);
        if (it == flushed->digests.end() || it->second != expected) {
          return failures.Add(
              receivers[r].name,
              DataLoss("tensor '{}' has state digest {} after flush, the producers expect {:016x}",
                       name,
                       it == flushed->digests.end() ? std::string("(missing)")
                                                    : fmt::format("{:016x}", it->second),
                       expected));
        }
      }
      report.receivers[r].flush = *std::move(flushed);
    });
    if (!failures.empty()) return FailTransfer(id, "flush", failures.Take());
  }
  report.flush_s = SecondsSince(flush_start);

  // 5. Commit. Every receiver is prepared and verified: the transfer is decided.
  const Clock::time_point commit_start = Clock::now();
  ForEachConcurrently(receivers.size(), [&](size_t r) {
    Status committed = receivers[r].control->Commit(id);
    if (!committed.ok()) {
      REFIT_LOG_WARN(
          "transfer {}: commit at {} failed ({}); it stays prepared and commits implicitly at "
          "the next transfer",
          id.ToHex(), receivers[r].name, committed.ToString());
    }
    report.receivers[r].commit_status = std::move(committed);
  });
  for (size_t p = 0; p < producers.size(); ++p) {
    Status committed = producers[p].tracker->Commit(id);
    if (!committed.ok()) {
      // The receivers hold the target version and this tracker does not: the fleet must be
      // re-anchored. Say so rather than leave the next delta to fail at a digest check.
      return Internal(
          "transfer {}: receivers committed but producer {}'s tracker could not: {}; "
          "the next transfer must be an anchor",
          id.ToHex(), p, committed.ToString());
    }
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
  return report;
}

Result<std::unique_ptr<Coordinator>> Coordinator::Make(const CoordinatorOptions& options,
                                                       std::vector<CoordinatedProducer> producers,
                                                       std::vector<CoordinatedReceiver> receivers,
                                                       ChannelFactory channels) {
  if (producers.empty()) return InvalidArgument("coordinator: no producers");
  if (!channels) return InvalidArgument("coordinator: no channel factory");
  if (options.transfer_timeout.count() <= 0) {
    return InvalidArgument("coordinator: transfer_timeout must be positive, got {} ms",
                           options.transfer_timeout.count());
  }
  for (size_t p = 0; p < producers.size(); ++p) {
    if (producers[p].tracker == nullptr || !producers[p].source) {
      return InvalidArgument("coordinator: producer {} has no tracker or no source", p);
    }
  }
  for (const CoordinatedReceiver& receiver : receivers) {
    if (receiver.control == nullptr) {
      return InvalidArgument("coordinator: receiver '{}' has no control", receiver.name);
    }
  }
  if (producers.size() > UINT32_MAX) {
    return InvalidArgument("coordinator: {} producers exceed the 32-bit producer id space",
                           producers.size());
  }
  auto impl = std::make_unique<Impl>();
  for (size_t p = 0; p < producers.size(); ++p) {
    ProducerStreamOptions stream = options.stream;
    stream.producer_id = static_cast<uint32_t>(p);
    stream.num_producers = static_cast<uint32_t>(producers.size());
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerStream> made, ProducerStream::Make(stream));
    impl->streams.push_back(std::move(made));
  }
  impl->options = options;
  impl->producers = std::move(producers);
  impl->receivers = std::move(receivers);
  impl->channels = std::move(channels);
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

}  // namespace refit
