// What the producer-group suites (in-process and TCP) share: distinct messages per round and
// rank, one thread per rank, and the check that a sequence of mixed collectives delivers exactly.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "refit/producer_group.h"
#include "test_util.h"

namespace refit::testing {

/// A message no other round or rank sends: sizes include empty and 1 MiB.
inline std::string GroupPayload(uint32_t round, uint32_t rank) {
  static constexpr size_t kSizes[] = {0, 1, 17, 4096, size_t{1} << 20};
  const size_t size = kSizes[(round + rank) % std::size(kSizes)];
  std::string payload(size, '\0');
  for (size_t i = 0; i < size; ++i) {
    payload[i] = static_cast<char>((i * 131 + round * 7 + rank * 29) & 0xff);
  }
  // Distinct even when sizes collide: the tail names the round and the rank.
  if (size >= 16) payload.replace(size - 16, 16, fmt::format("r{:07}k{:07}", round, rank));
  return payload;
}

/// Run `body(rank)` on one thread per rank and join them all.
inline void OnEveryRank(uint32_t world_size, const std::function<void(uint32_t)>& body) {
  std::vector<std::jthread> threads;
  for (uint32_t rank = 0; rank < world_size; ++rank) threads.emplace_back(body, rank);
}

/// Alternate broadcasts and gathers (two of each in a row, where rounds could slip) on every
/// rank of `ranks` at once, each call due by `deadline()`: every rank must get exactly rank 0's
/// message, rank 0 every message in rank order.
inline void ExpectMixedRoundsDeliverExactly(
    const std::vector<ProducerGroup*>& ranks,
    const std::function<GroupClock::time_point()>& deadline) {
  constexpr uint32_t kRounds = 12;
  const auto world_size = static_cast<uint32_t>(ranks.size());
  const auto is_broadcast = [](uint32_t round) { return round % 4 == 0 || round % 4 == 1; };
  OnEveryRank(world_size, [&](uint32_t rank) {
    ProducerGroup& endpoint = *ranks[rank];
    for (uint32_t round = 0; round < kRounds; ++round) {
      if (is_broadcast(round)) {
        // Other ranks' arguments are ignored.
        Result<std::string> got =
            endpoint.Broadcast(rank == 0 ? GroupPayload(round, 0) : "ignored", deadline());
        ASSERT_OK(got);
        EXPECT_EQ(*got, GroupPayload(round, 0)) << "rank " << rank << " round " << round;
      } else {
        Result<std::vector<std::string>> got =
            endpoint.Gather(GroupPayload(round, rank), deadline());
        ASSERT_OK(got);
        if (rank != 0) {
          EXPECT_TRUE(got->empty());
          continue;
        }
        ASSERT_EQ(got->size(), world_size);
        for (uint32_t from = 0; from < world_size; ++from) {
          EXPECT_EQ((*got)[from], GroupPayload(round, from))
              << "from rank " << from << " round " << round;
        }
      }
    }
  });
}

}  // namespace refit::testing
