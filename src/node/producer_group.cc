// The in-process producer group: W endpoints over one shared hub, for threads of one process.
//
// Every collective is a round: each endpoint counts the collectives it has called, so the k-th
// call of every rank is round k, and rounds match without any rank knowing the others' progress
// (the ranks call the same collectives in the same order). Rank 0's broadcast of round k is
// posted into each live rank's inbox under k; each rank's gather message of round k is deposited
// under k. A rank that missed a round (its deadline passed) simply finds entries of rounds it has
// passed and discards them, so a late message is never taken for a later round's — the
// in-process counterpart of the TCP group dropping a link.
#include "refit/producer_group.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "refit/status_format.h"
#include "util/mutex.h"

namespace refit {
namespace {

/// The state the W endpoints of one in-process group share.
struct InProcessHub {
  explicit InProcessHub(uint32_t world_size_in)
      : world_size(world_size_in),
        alive(world_size_in, true),
        inboxes(world_size_in),
        deposits(world_size_in) {}

  const uint32_t world_size;
  internal::Mutex mutex;
  /// Notified on every post, deposit and departure.
  internal::CondVar changed;
  /// False once a rank's endpoint was destroyed.
  std::vector<bool> alive REFIT_GUARDED_BY(mutex);
  /// Per receiving rank: rank 0's broadcast messages by round, one shared copy for all ranks.
  std::vector<std::map<uint64_t, std::shared_ptr<const std::string>>> inboxes
      REFIT_GUARDED_BY(mutex);
  /// Per contributing rank: its gather messages by round, until rank 0 takes them.
  std::vector<std::map<uint64_t, std::string>> deposits REFIT_GUARDED_BY(mutex);
};

/// One rank's endpoint of an in-process group.
///
/// Thread-safety: one collective at a time per object (as ProducerGroup); distinct endpoints of
/// one group are used from distinct threads.
class InProcessGroup final : public ProducerGroup {
 public:
  InProcessGroup(std::shared_ptr<InProcessHub> hub, uint32_t rank)
      : hub_(std::move(hub)), rank_(rank) {}

  ~InProcessGroup() override {
    internal::MutexLock lock(hub_->mutex);
    hub_->alive[rank_] = false;
    // Its deposits stay: a rank that contributed and then left did deliver.
    hub_->inboxes[rank_].clear();
    hub_->changed.notify_all();
  }

  uint32_t rank() const override { return rank_; }
  uint32_t world_size() const override { return hub_->world_size; }

  Result<std::string> Broadcast(std::string message, GroupClock::time_point deadline) override {
    const uint64_t round = round_++;
    return rank_ == 0 ? Post(std::move(message), round) : Take(round, deadline);
  }

  Result<std::vector<std::string>> Gather(std::string message,
                                          GroupClock::time_point deadline) override {
    const uint64_t round = round_++;
    if (rank_ != 0) {
      REFIT_RETURN_NOT_OK(Deposit(std::move(message), round));
      return std::vector<std::string>{};
    }
    return Collect(std::move(message), round, deadline);
  }

 private:
  /// "rank 2 of 4 left the group; rank 3 of 4 sent nothing by the deadline" for the ranks that
  /// failed a round, with their code: Unavailable when any left, else DeadlineExceeded.
  Status RoundFailure(std::string_view collective, uint64_t round,
                      const std::vector<uint32_t>& departed,
                      const std::vector<uint32_t>& late) const {
    std::vector<std::string> problems;
    for (uint32_t rank : departed) {
      problems.push_back(fmt::format("rank {} of {} left the group", rank, hub_->world_size));
    }
    for (uint32_t rank : late) {
      problems.push_back(
          fmt::format("rank {} of {} sent nothing by the deadline", rank, hub_->world_size));
    }
    const std::string message = fmt::format("in-process group: {} of round {} at rank {}: {}",
                                            collective, round, rank_, fmt::join(problems, "; "));
    if (!departed.empty()) return Status(StatusCode::kUnavailable, message);
    return Status(StatusCode::kDeadlineExceeded, message);
  }

  // Rank 0's broadcast: posting never waits, so only departed ranks can fail it.
  Result<std::string> Post(std::string message, uint64_t round) {
    auto shared = std::make_shared<const std::string>(message);
    std::vector<uint32_t> departed;
    {
      internal::MutexLock lock(hub_->mutex);
      for (uint32_t rank = 1; rank < hub_->world_size; ++rank) {
        if (hub_->alive[rank]) {
          hub_->inboxes[rank][round] = shared;
        } else {
          departed.push_back(rank);
        }
      }
      hub_->changed.notify_all();
    }
    if (!departed.empty()) return RoundFailure("broadcast", round, departed, {});
    return message;
  }

  Result<std::string> Take(uint64_t round, GroupClock::time_point deadline) {
    internal::MutexLock lock(hub_->mutex);
    auto& inbox = hub_->inboxes[rank_];
    // Entries of earlier rounds were posted after this rank gave up on them.
    inbox.erase(inbox.begin(), inbox.lower_bound(round));
    // The predicate runs with the mutex held (the wait retakes it first).
    hub_->changed.wait_until(lock, deadline, [&]() REFIT_REQUIRES(hub_->mutex) {
      return inbox.contains(round) || !hub_->alive[0];
    });
    const auto posted = inbox.find(round);
    if (posted == inbox.end()) {
      if (!hub_->alive[0]) return RoundFailure("broadcast", round, {0}, {});
      return RoundFailure("broadcast", round, {}, {0});
    }
    std::string message = *posted->second;
    inbox.erase(posted);
    return message;
  }

  Status Deposit(std::string message, uint64_t round) {
    internal::MutexLock lock(hub_->mutex);
    // A message rank 0 can never take is not delivered: say so, as a closed connection would.
    if (!hub_->alive[0]) return RoundFailure("gather", round, {0}, {});
    hub_->deposits[rank_][round] = std::move(message);
    hub_->changed.notify_all();
    return Status::OK();
  }

  Result<std::vector<std::string>> Collect(std::string message, uint64_t round,
                                           GroupClock::time_point deadline) {
    internal::MutexLock lock(hub_->mutex);
    const auto settled = [&](uint32_t rank) REFIT_REQUIRES(hub_->mutex) {
      return hub_->deposits[rank].contains(round) || !hub_->alive[rank];
    };
    hub_->changed.wait_until(lock, deadline, [&]() REFIT_REQUIRES(hub_->mutex) {
      for (uint32_t rank = 1; rank < hub_->world_size; ++rank) {
        if (!settled(rank)) return false;
      }
      return true;
    });
    std::vector<std::string> messages;
    messages.reserve(hub_->world_size);
    messages.push_back(std::move(message));
    std::vector<uint32_t> departed;
    std::vector<uint32_t> late;
    for (uint32_t rank = 1; rank < hub_->world_size; ++rank) {
      auto& deposits = hub_->deposits[rank];
      // A rank that deposited and then left did deliver: its message counts.
      if (const auto deposit = deposits.find(round); deposit != deposits.end()) {
        messages.push_back(std::move(deposit->second));
      } else if (!hub_->alive[rank]) {
        departed.push_back(rank);
      } else {
        late.push_back(rank);
      }
      // This round and any abandoned earlier one are done with; later ones are not (a rank may
      // already have deposited for the next gather).
      deposits.erase(deposits.begin(), deposits.upper_bound(round));
    }
    if (!departed.empty() || !late.empty()) return RoundFailure("gather", round, departed, late);
    return messages;
  }

  std::shared_ptr<InProcessHub> hub_;
  const uint32_t rank_;
  /// The round of this endpoint's next collective.
  uint64_t round_ = 0;
};

}  // namespace

Result<std::vector<std::unique_ptr<ProducerGroup>>> MakeInProcessGroup(uint32_t world_size) {
  if (world_size == 0) return InvalidArgument("in-process group: world size 0 (need at least 1)");
  auto hub = std::make_shared<InProcessHub>(world_size);
  std::vector<std::unique_ptr<ProducerGroup>> ranks;
  ranks.reserve(world_size);
  for (uint32_t rank = 0; rank < world_size; ++rank) {
    ranks.push_back(std::make_unique<InProcessGroup>(hub, rank));
  }
  return ranks;
}

}  // namespace refit
