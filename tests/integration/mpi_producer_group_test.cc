// The MPI producer group under a real mpirun (ctest runs `mpirun -np 3` on this program). Every
// rank checks every result it gets; the exit status is non-zero on any mismatch, which mpirun
// passes on. A plain program rather than GoogleTest: every rank must run the same collectives in
// the same order, which test discovery and filtering would break.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "refit/mpi_producer_group.h"
#include "transport/mpi/mpi_job.h"

namespace refit {
namespace {

/// Generous: collectives among local processes complete in milliseconds; this bounds a hang.
constexpr std::chrono::seconds kGenerous{60};
constexpr uint64_t kLimit = uint64_t{2} << 20;

int failures = 0;
int my_rank = -1;

void Check(bool condition, std::string_view what) {
  if (condition) return;
  std::fprintf(stderr, "mpi_producer_group_test rank %d: FAILED: %.*s\n", my_rank,
               static_cast<int>(what.size()), what.data());
  ++failures;
}

void CheckCode(const Status& status, StatusCode expected, std::string_view what) {
  Check(status.code() == expected,
        fmt::format("{}: expected {}, got {}", what, StatusCodeName(expected), status.ToString()));
}

GroupClock::time_point Soon() { return GroupClock::now() + kGenerous; }

/// A message no other round or rank sends; rank 1's is empty and rank 2's is 1 MiB.
std::string Payload(uint32_t round, uint32_t rank) {
  const size_t size = rank == 1 ? 0 : rank == 2 ? (size_t{1} << 20) : 1000 + round + rank;
  std::string payload(size, '\0');
  for (size_t i = 0; i < size; ++i) {
    payload[i] = static_cast<char>((i * 131 + round * 7 + rank * 29) & 0xff);
  }
  return payload;
}

using internal::HandleOf;

void CheckGather(ProducerGroup& group, uint32_t round, std::string_view what) {
  Result<std::vector<std::string>> got = group.Gather(Payload(round, group.rank()), Soon());
  if (!got.ok()) {
    Check(false, fmt::format("{}: {}", what, got.status().ToString()));
    return;
  }
  if (group.rank() != 0) {
    Check(got->empty(), fmt::format("{}: a rank other than 0 got messages", what));
    return;
  }
  Check(got->size() == group.world_size(), fmt::format("{}: {} messages", what, got->size()));
  for (uint32_t from = 0; from < got->size(); ++from) {
    Check((*got)[from] == Payload(round, from), fmt::format("{}: message of rank {}", what, from));
  }
}

void CheckBroadcast(ProducerGroup& group, const std::string& message, std::string_view what) {
  Result<std::string> got =
      group.Broadcast(group.rank() == 0 ? message : std::string("ignored"), Soon());
  if (!got.ok()) {
    Check(false, fmt::format("{}: {}", what, got.status().ToString()));
    return;
  }
  Check(*got == message,
        fmt::format("{}: got {} bytes, expected {}", what, got->size(), message.size()));
}

// A deadline that passes: on a group of ranks 0 and 1, rank 0 gathers before rank 1 can take
// part (rank 1 is held in a barrier that rank 0 enters only afterwards), so the deadline passes
// with the collective pending; the group is unusable from then on. Rank 1 then completes its side
// (an empty message: no bytes phase follows), which lets rank 0's pending request finish too.
void CheckDeadline(uint32_t world_rank) {
  MPI_Comm pair = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank < 2 ? 0 : MPI_UNDEFINED, static_cast<int>(world_rank),
                 &pair);
  Result<std::unique_ptr<ProducerGroup>> group = Status(StatusCode::kNotFound, "not in the pair");
  if (pair != MPI_COMM_NULL) group = MakeMpiGroup({.communicator = HandleOf(pair)});
  if (world_rank == 0 && group.ok()) {
    CheckCode((*group)->Gather("late", GroupClock::now()).status(), StatusCode::kDeadlineExceeded,
              "gather past its deadline");
    CheckCode((*group)->Gather("again", Soon()).status(), StatusCode::kFailedPrecondition,
              "gather after a timed-out one");
    CheckCode((*group)->Broadcast("again", Soon()).status(), StatusCode::kFailedPrecondition,
              "broadcast after a timed-out gather");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank == 1 && group.ok()) {
    Result<std::vector<std::string>> sent = (*group)->Gather("", Soon());
    Check(sent.ok(), fmt::format("rank 1's side of the late gather: {}", sent.status().ToString()));
  }
  // Rank 0 drives its pending request here while rank 1 completes its side.
  MPI_Barrier(MPI_COMM_WORLD);
  if (pair != MPI_COMM_NULL) {
    Check(group.ok(), "pair group");
    group = Status(StatusCode::kCancelled, "destroyed");
    MPI_Comm_free(&pair);
  }
}

int Run() {
  // MPI is not initialized yet: MakeMpiGroup does it.
  Result<std::unique_ptr<ProducerGroup>> made = MakeMpiGroup({.max_message_bytes = kLimit});
  if (!made.ok()) {
    std::fprintf(stderr, "MakeMpiGroup: %s\n", made.status().ToString().c_str());
    return 1;
  }
  ProducerGroup& group = **made;
  my_rank = static_cast<int>(group.rank());
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  Check(group.world_size() == static_cast<uint32_t>(world_size), "world size");
  if (world_size < 3) {
    Check(false, "needs mpirun -np 3 or more");
    return 1;
  }

  CheckBroadcast(group, "", "empty broadcast");
  CheckBroadcast(group, Payload(1, 2), "1 MiB broadcast");
  CheckGather(group, 2, "gather");
  CheckGather(group, 3, "second gather in a row");

  // Over the limit: refused on every rank, and the group stays usable.
  CheckCode(group.Broadcast(std::string(kLimit + 1, 'x'), Soon()).status(),
            StatusCode::kResourceExhausted, "oversized broadcast");
  CheckCode(group.Gather(std::string(group.rank() == 1 ? kLimit + 1 : 10, 'y'), Soon()).status(),
            StatusCode::kResourceExhausted, "gather with rank 1 oversized");
  CheckBroadcast(group, "still usable", "broadcast after refusals");

  // Limits that differ between ranks are refused by every rank.
  CheckCode(MakeMpiGroup({.max_message_bytes = kLimit + group.rank()}).status(),
            StatusCode::kInvalidArgument, "differing limits");

  // A group on a sub-communicator: the even ranks and the odd ranks, separately.
  MPI_Comm halves = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(group.rank() % 2), static_cast<int>(group.rank()),
                 &halves);
  {
    Result<std::unique_ptr<ProducerGroup>> half =
        MakeMpiGroup({.communicator = HandleOf(halves), .max_message_bytes = kLimit});
    if (!half.ok()) {
      Check(false, fmt::format("half group: {}", half.status().ToString()));
    } else {
      const uint32_t expected_size =
          static_cast<uint32_t>((world_size + 1 - static_cast<int>(group.rank() % 2)) / 2);
      Check((*half)->world_size() == expected_size, "half group size");
      Check((*half)->rank() == group.rank() / 2, "half group rank");
      CheckBroadcast(**half, fmt::format("half {}", group.rank() % 2), "half group broadcast");
      CheckGather(**half, 4, "half group gather");
    }
  }
  MPI_Comm_free(&halves);

  CheckGather(group, 5, "gather after the half groups");
  CheckDeadline(group.rank());
  made = Status(StatusCode::kCancelled, "destroyed before MPI_Finalize");
  // Finalizing is the caller's business (after every group is gone).
  MPI_Finalize();
  std::fprintf(stderr, "mpi_producer_group_test rank %d: %s\n", my_rank,
               failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace refit

int main() { return refit::Run(); }
