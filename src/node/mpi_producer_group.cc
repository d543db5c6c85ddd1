// The MPI producer group: non-blocking collectives on a duplicate of the caller's communicator,
// polled with MPI_Test until they complete or the deadline passes.
//
//   Broadcast  MPI_Ibcast of the size (u64), then MPI_Ibcast of the bytes.
//   Gather     MPI_Iallgather of the sizes (u64 each), then MPI_Igatherv of the bytes to rank 0.
//
// Gather's sizes go to every rank, not only rank 0, so that every rank knows whether the bytes
// phase happens (a size over the limit cancels it everywhere) and how it is sliced: MPI counts
// and displacements are ints, so a gather whose messages total more than kMaxSliceBytes runs as
// several Igatherv calls, each carrying a slice of every message.
//
// Every buffer a collective hands to MPI lives in one heap object shared with the wait. When the
// deadline passes first, the request cannot be cancelled (MPI forbids it for collectives) and
// MPI may still write into those buffers, so the wait keeps the object with the request; the
// group then refuses every call. At destruction a request that still has not completed keeps its
// buffers for the rest of the process (KeepForever): a deliberate leak, the only safe end.
#include "refit/mpi_producer_group.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "refit/status_format.h"
#include "transport/mpi/mpi_job.h"
#include "util/logging.h"

namespace refit {
namespace {

using internal::CommFromHandle;
using internal::KeepForever;
using internal::MpiErrorText;

/// MPI_Test is polled with a pause that doubles from the first to the last: a collective among
/// processes of one node completes within microseconds, and a slow one should not cost a core.
constexpr std::chrono::microseconds kFirstTestPause{20};
constexpr std::chrono::microseconds kMaxTestPause{1000};
/// The most bytes one MPI call moves: its counts and displacements are ints.
constexpr uint64_t kMaxSliceBytes = uint64_t{1} << 30;

/// What one Broadcast hands to MPI.
struct BroadcastBuffers {
  uint64_t size = 0;
  std::string body;
};

/// What one Gather hands to MPI.
struct GatherBuffers {
  std::string message;
  uint64_t size = 0;
  std::vector<uint64_t> sizes;
  /// Rank 0, per slice: each rank's count and offset in `slice` (rank 0's own count is 0: its
  /// message stays where it is).
  std::vector<int> counts;
  std::vector<int> displacements;
  std::string slice;
};

/// One process's endpoint of an MPI group.
///
/// Thread-safety: one collective at a time (as ProducerGroup), from a thread MPI allows.
class MpiGroup final : public ProducerGroup {
 public:
  MpiGroup(MPI_Comm comm, uint32_t rank, uint32_t world_size, uint64_t max_message_bytes)
      : comm_(comm), rank_(rank), world_size_(world_size), max_message_bytes_(max_message_bytes) {}

  ~MpiGroup() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // After MPI_Finalize nothing writes into the buffers any more, and no MPI call is allowed.
    if (finalized != 0) return;
    if (abandoned_) {
      int done = 0;
      if (MPI_Test(&abandoned_->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done == 0) {
        KeepForever(std::move(abandoned_->buffers));
      }
    }
    // Pending operations on it complete normally; MPI frees it after them.
    MPI_Comm_free(&comm_);
  }

  uint32_t rank() const override { return rank_; }
  uint32_t world_size() const override { return world_size_; }

  Result<std::string> Broadcast(std::string message, GroupClock::time_point deadline) override {
    const uint64_t round = round_++;
    REFIT_RETURN_NOT_OK(broken_);
    const std::string context = Context("broadcast", round);
    auto buffers = std::make_shared<BroadcastBuffers>();
    if (rank_ == 0) {
      buffers->size = message.size();
      buffers->body = std::move(message);
    }
    REFIT_RETURN_NOT_OK(Run(
        [&](MPI_Request* request) {
          return MPI_Ibcast(&buffers->size, 1, MPI_UINT64_T, 0, comm_, request);
        },
        buffers, deadline, context + ": size"));
    // Every rank sees the same size and the same limit, so all refuse together.
    if (buffers->size > max_message_bytes_) {
      return ResourceExhausted("{}: rank 0's message of {} bytes exceeds the limit of {}", context,
                               buffers->size, max_message_bytes_);
    }
    if (rank_ != 0) buffers->body.assign(buffers->size, '\0');
    for (uint64_t offset = 0; offset < buffers->size; offset += kMaxSliceBytes) {
      const int count = static_cast<int>(std::min(kMaxSliceBytes, buffers->size - offset));
      REFIT_RETURN_NOT_OK(Run(
          [&](MPI_Request* request) {
            return MPI_Ibcast(buffers->body.data() + offset, count, MPI_BYTE, 0, comm_, request);
          },
          buffers, deadline, context + ": bytes"));
    }
    return std::move(buffers->body);
  }

  Result<std::vector<std::string>> Gather(std::string message,
                                          GroupClock::time_point deadline) override {
    const uint64_t round = round_++;
    REFIT_RETURN_NOT_OK(broken_);
    const std::string context = Context("gather", round);
    auto buffers = std::make_shared<GatherBuffers>();
    buffers->size = message.size();
    buffers->message = std::move(message);
    buffers->sizes.assign(world_size_, 0);
    REFIT_RETURN_NOT_OK(Run(
        [&](MPI_Request* request) {
          return MPI_Iallgather(&buffers->size, 1, MPI_UINT64_T, buffers->sizes.data(), 1,
                                MPI_UINT64_T, comm_, request);
        },
        buffers, deadline, context + ": sizes"));
    std::vector<std::string> refusals;
    for (uint32_t rank = 0; rank < world_size_; ++rank) {
      if (buffers->sizes[rank] > max_message_bytes_) {
        refusals.push_back(fmt::format("rank {}'s message of {} bytes exceeds the limit of {}",
                                       rank, buffers->sizes[rank], max_message_bytes_));
      }
    }
    if (!refusals.empty()) {
      return ResourceExhausted("{}: {}", context, fmt::join(refusals, "; "));
    }

    std::vector<std::string> messages;
    if (rank_ == 0) {
      messages.resize(world_size_);
      for (uint32_t rank = 1; rank < world_size_; ++rank) {
        messages[rank].resize(buffers->sizes[rank]);
      }
      buffers->counts.assign(world_size_, 0);
      buffers->displacements.assign(world_size_, 0);
    }
    // Rank 0's own message never travels.
    const uint64_t largest =
        world_size_ > 1 ? *std::max_element(buffers->sizes.begin() + 1, buffers->sizes.end()) : 0;
    // Every rank's share of a slice is at most this, so a slice's total fits an int.
    const uint64_t share = std::max<uint64_t>(1, kMaxSliceBytes / world_size_);
    for (uint64_t offset = 0; offset < largest; offset += share) {
      const auto part = [&](uint64_t size) {
        return offset >= size ? uint64_t{0} : std::min(share, size - offset);
      };
      if (rank_ == 0) {
        uint64_t total = 0;
        for (uint32_t rank = 1; rank < world_size_; ++rank) {
          buffers->counts[rank] = static_cast<int>(part(buffers->sizes[rank]));
          buffers->displacements[rank] = static_cast<int>(total);
          total += part(buffers->sizes[rank]);
        }
        buffers->slice.resize(total);
      }
      const int count = rank_ == 0 ? 0 : static_cast<int>(part(buffers->size));
      REFIT_RETURN_NOT_OK(Run(
          [&](MPI_Request* request) {
            return MPI_Igatherv(buffers->message.data() + (count > 0 ? offset : 0), count, MPI_BYTE,
                                buffers->slice.data(), buffers->counts.data(),
                                buffers->displacements.data(), MPI_BYTE, 0, comm_, request);
          },
          buffers, deadline, context + ": bytes"));
      if (rank_ == 0) {
        for (uint32_t rank = 1; rank < world_size_; ++rank) {
          if (buffers->counts[rank] == 0) continue;
          std::copy_n(buffers->slice.data() + buffers->displacements[rank], buffers->counts[rank],
                      messages[rank].data() + offset);
        }
      }
    }
    if (rank_ == 0) messages[0] = std::move(buffers->message);
    return messages;
  }

 private:
  /// A request that missed its deadline, with the buffers it may still use.
  struct Abandoned {
    MPI_Request request;
    std::shared_ptr<void> buffers;
  };

  std::string Context(std::string_view collective, uint64_t round) const {
    return fmt::format("mpi group rank {} of {}, {} of round {}", rank_, world_size_, collective,
                       round);
  }

  /// Make every later call fail: the ranks' collectives no longer match up.
  Status Break(Status failure) {
    broken_ = FailedPrecondition("mpi group rank {} of {} is unusable: {}", rank_, world_size_,
                                 failure.message());
    return failure;
  }

  /// Start one non-blocking collective with `start` and poll it until it completes or
  /// `deadline` passes. Errors: Unavailable (MPI reported an error), DeadlineExceeded; either
  /// breaks the group.
  Status Run(const std::function<int(MPI_Request*)>& start, std::shared_ptr<void> buffers,
             GroupClock::time_point deadline, std::string_view what) {
    MPI_Request request = MPI_REQUEST_NULL;
    if (const int error = start(&request); error != MPI_SUCCESS) {
      return Break(Unavailable("{}: {}", what, MpiErrorText(error)));
    }
    std::chrono::microseconds pause = kFirstTestPause;
    for (;;) {
      int done = 0;
      if (const int error = MPI_Test(&request, &done, MPI_STATUS_IGNORE); error != MPI_SUCCESS) {
        abandoned_ = Abandoned{request, std::move(buffers)};
        return Break(Unavailable("{}: {}", what, MpiErrorText(error)));
      }
      if (done != 0) return Status::OK();
      const auto now = GroupClock::now();
      if (now >= deadline) {
        abandoned_ = Abandoned{request, std::move(buffers)};
        return Break(DeadlineExceeded(
            "{}: not every rank took part by the deadline; an MPI collective cannot be "
            "cancelled, so this group is unusable from now on",
            what));
      }
      std::this_thread::sleep_for(std::min<GroupClock::duration>(pause, deadline - now));
      pause = std::min(2 * pause, kMaxTestPause);
    }
  }

  MPI_Comm comm_;
  const uint32_t rank_;
  const uint32_t world_size_;
  const uint64_t max_message_bytes_;
  /// The round of the next collective (for messages).
  uint64_t round_ = 0;
  /// OK until a collective failed; then the error every call returns.
  Status broken_;
  /// At most one: the group refuses every call after the first.
  std::optional<Abandoned> abandoned_;
};

}  // namespace

Result<std::unique_ptr<ProducerGroup>> MakeMpiGroup(const MpiGroupOptions& options) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) return FailedPrecondition("mpi group: MPI is already finalized");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) {
    int provided = MPI_THREAD_SINGLE;
    if (const int error = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
        error != MPI_SUCCESS) {
      return Unavailable("mpi group: MPI_Init_thread: {}", MpiErrorText(error));
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      REFIT_LOG_WARN(
          "mpi group: MPI provides thread level {} only (the group needs MPI_THREAD_SERIALIZED): "
          "use "
          "the group from the thread that initialized MPI",
          provided);
    }
  }
  const MPI_Comm base =
      options.communicator == 0 ? MPI_COMM_WORLD : CommFromHandle<MPI_Comm>(options.communicator);
  MPI_Comm comm = MPI_COMM_NULL;
  if (const int error = MPI_Comm_dup(base, &comm); error != MPI_SUCCESS) {
    return Unavailable("mpi group: MPI_Comm_dup: {}", MpiErrorText(error));
  }
  // Report failures as Status instead of aborting the job where MPI can.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0;
  int world_size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &world_size);
  // One reduction finds both the largest and (as the largest complement) the smallest limit.
  uint64_t bounds[2] = {options.max_message_bytes, ~options.max_message_bytes};
  if (const int error = MPI_Allreduce(MPI_IN_PLACE, bounds, 2, MPI_UINT64_T, MPI_MAX, comm);
      error != MPI_SUCCESS) {
    MPI_Comm_free(&comm);
    return Unavailable("mpi group: MPI_Allreduce of the message limits: {}", MpiErrorText(error));
  }
  if (bounds[0] != ~bounds[1]) {
    MPI_Comm_free(&comm);
    return InvalidArgument(
        "mpi group rank {} of {}: max_message_bytes differs between ranks (from {} to {}); every "
        "rank must use the same limit",
        rank, world_size, ~bounds[1], bounds[0]);
  }
  return std::unique_ptr<ProducerGroup>(
      std::make_unique<MpiGroup>(comm, static_cast<uint32_t>(rank),
                                 static_cast<uint32_t>(world_size), options.max_message_bytes));
}

}  // namespace refit
