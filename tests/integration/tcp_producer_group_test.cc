// The TCP producer group over real loopback sockets: ranks as threads of this process, and, for
// the failure tests that need a real process death, ranks as child processes (this binary
// re-executed with REFIT_TCP_GROUP_CHILD naming the rank's script; see main()).
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <latch>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "group_rounds.h"
#include "loopback.h"
#include "refit/logging.h"
#include "refit/producer_group.h"
#include "test_util.h"

extern char** environ;

namespace refit {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

/// Generous: collectives over loopback complete in milliseconds; this only bounds a hang.
constexpr seconds kGenerous{30};
/// For the calls that are meant to run out of time: short, since the test waits it out.
constexpr milliseconds kShort{500};
constexpr char kApiKey[] = "fleet-secret";
constexpr char kChildVariable[] = "REFIT_TCP_GROUP_CHILD";

GroupClock::time_point Soon(GroupClock::duration wait = kGenerous) {
  return GroupClock::now() + wait;
}

TcpGroupOptions Options(uint32_t rank, uint32_t world_size, std::string address,
                        std::string api_key = kApiKey) {
  TcpGroupOptions options;
  options.address = std::move(address);
  options.rank = rank;
  options.world_size = world_size;
  options.api_key = std::move(api_key);
  options.connect_timeout = kGenerous;
  return options;
}

/// The W endpoints of one group on loopback: rank 0 on an ephemeral port, then the others.
struct LoopbackGroup {
  std::string address;
  std::vector<std::unique_ptr<ProducerGroup>> ranks;
};

Result<LoopbackGroup> MakeLoopbackGroup(uint32_t world_size, std::string api_key = kApiKey) {
  LoopbackGroup group;
  REFIT_ASSIGN_OR_RETURN(auto root,
                         MakeTcpGroup(Options(0, world_size, "tcp://127.0.0.1:0", api_key)));
  group.address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  group.ranks.push_back(std::move(root));
  for (uint32_t rank = 1; rank < world_size; ++rank) {
    REFIT_ASSIGN_OR_RETURN(auto member,
                           MakeTcpGroup(Options(rank, world_size, group.address, api_key)));
    group.ranks.push_back(std::move(member));
  }
  return group;
}

TEST(TcpGroupTest, RejectsBadOptions) {
  EXPECT_STATUS(InvalidArgument, MakeTcpGroup(Options(0, 0, "127.0.0.1:0")));
  EXPECT_STATUS_MSG(InvalidArgument, "rank 3", MakeTcpGroup(Options(3, 3, "127.0.0.1:0")));
  for (const char* address : {"", "127.0.0.1", "127.0.0.1:", ":4000", "127.0.0.1:65536",
                              "127.0.0.1:4x", "::1:4000", "[::1]4000", "http://127.0.0.1:4000"}) {
    SCOPED_TRACE(address);
    EXPECT_STATUS_MSG(InvalidArgument, "is not tcp://HOST:PORT",
                      MakeTcpGroup(Options(0, 2, address)));
  }
  EXPECT_STATUS_MSG(InvalidArgument, "port 0", MakeTcpGroup(Options(1, 2, "127.0.0.1:0")));
}

TEST(TcpGroupTest, PortIsReportedForRankZeroOnly) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(2));
  EXPECT_NE(TcpGroupPort(*group.ranks[0]), 0);
  EXPECT_EQ(TcpGroupPort(*group.ranks[1]), 0);
  EXPECT_EQ(group.ranks[1]->rank(), 1u);
  EXPECT_EQ(group.ranks[1]->world_size(), 2u);
}

class TcpGroupSizeTest : public ::testing::TestWithParam<uint32_t> {};

// Alternating broadcasts and gathers, and two of each in a row: every rank gets exactly rank 0's
// message, rank 0 gets every message in rank order.
TEST_P(TcpGroupSizeTest, SequenceOfCollectivesDeliversExactContents) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(GetParam()));
  std::vector<ProducerGroup*> endpoints;
  for (auto& rank : group.ranks) endpoints.push_back(rank.get());
  testing::ExpectMixedRoundsDeliverExactly(endpoints, [] { return Soon(); });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TcpGroupSizeTest, ::testing::Values(1u, 2u, 5u));

TEST(TcpGroupTest, EmptyApiKeyOnBothSidesWorks) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(2, ""));
  testing::OnEveryRank(2, [&](uint32_t rank) {
    ASSERT_OK_AND_ASSIGN(std::string got, group.ranks[rank]->Broadcast("plan", Soon()));
    EXPECT_EQ(got, "plan");
  });
}

TEST(TcpGroupTest, RankMayStartBeforeRankZero) {
  const std::string address = testing::FreeLoopbackEndpoint();
  std::optional<Result<std::unique_ptr<ProducerGroup>>> member;
  std::jthread early([&] { member = MakeTcpGroup(Options(1, 2, address)); });
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(Options(0, 2, address)));
  early.join();
  ASSERT_OK(*member);
  testing::OnEveryRank(2, [&](uint32_t rank) {
    ProducerGroup& endpoint = rank == 0 ? *root : ***member;
    ASSERT_OK_AND_ASSIGN(std::string got, endpoint.Broadcast("plan", Soon()));
    EXPECT_EQ(got, "plan");
  });
}

TEST(TcpGroupTest, RankZeroNeverStartingIsUnavailableAfterTheConnectTimeout) {
  const std::string address = testing::FreeLoopbackEndpoint();
  TcpGroupOptions options = Options(1, 2, address);
  options.connect_timeout = kShort;
  EXPECT_STATUS_MSG(Unavailable, fmt::format("cannot reach rank 0 at {} within 500 ms", address),
                    MakeTcpGroup(options));
}

// A port that another process keeps (here another rank 0) fails rank 0 within bind_timeout
// (3 s), not after the 60 s connect timeout, and the error names the port.
TEST(TcpGroupTest, TakenPortFailsRankZeroWithinSecondsNamingThePort) {
  ASSERT_OK_AND_ASSIGN(auto holder, MakeTcpGroup(Options(0, 2, "tcp://127.0.0.1:0")));
  const uint16_t port = TcpGroupPort(*holder);
  TcpGroupOptions options = Options(0, 2, fmt::format("tcp://127.0.0.1:{}", port));
  options.connect_timeout = seconds(60);
  const auto start = GroupClock::now();
  const Result<std::unique_ptr<ProducerGroup>> second = MakeTcpGroup(options);
  const auto took = GroupClock::now() - start;
  EXPECT_STATUS_MSG(Unavailable,
                    fmt::format("cannot listen on 127.0.0.1:{}: port {} is in use", port, port),
                    second);
  EXPECT_STATUS_MSG(Unavailable, "Address already in use", second);
  // bind_timeout plus a loaded machine's slack; the connect timeout would be 60 s.
  EXPECT_LT(took, seconds(10));
  EXPECT_GE(took, options.bind_timeout);
}

// While a collective waits for a rank that never connects, rank 0 says which one, and how many
// are there (at info, within a few seconds).
TEST(TcpGroupTest, RankZeroLogsWhichRanksItIsWaitingFor) {
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(Options(0, 3, "tcp://127.0.0.1:0")));
  const std::string address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  ASSERT_OK_AND_ASSIGN(auto rank1, MakeTcpGroup(Options(1, 3, address)));
  const std::string level(CurrentLogLevel());
  ASSERT_OK(SetLogLevel("info"));
  ::testing::internal::CaptureStderr();
  const Result<std::string> sent = root->Broadcast("plan", Soon(milliseconds(2600)));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_OK(SetLogLevel(level));
  EXPECT_STATUS_MSG(Unavailable, "rank 2 of 3 is not connected", sent);
  EXPECT_NE(log.find(fmt::format("tcp group rank 0 at {}: waiting for rank(s) 2 of 3 to connect "
                                 "(2 of 3 connected",
                                 address)),
            std::string::npos)
      << log;
}

TEST(TcpGroupTest, WrongApiKeyIsRefusedAndRankZeroKeepsWorking) {
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(Options(0, 2, "127.0.0.1:0")));
  const std::string address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  EXPECT_STATUS_MSG(PermissionDenied,
                    fmt::format("rank 0 at {} refused this rank's api key", address),
                    MakeTcpGroup(Options(1, 2, address, "guessed")));
  EXPECT_STATUS_MSG(PermissionDenied, "refused this rank's api key",
                    MakeTcpGroup(Options(1, 2, address, "")));
  ASSERT_OK_AND_ASSIGN(auto member, MakeTcpGroup(Options(1, 2, address)));
  testing::OnEveryRank(2, [&](uint32_t rank) {
    ProducerGroup& endpoint = rank == 0 ? *root : *member;
    ASSERT_OK_AND_ASSIGN(auto messages, endpoint.Gather(fmt::format("report {}", rank), Soon()));
    if (rank == 0) {
      EXPECT_EQ(messages, (std::vector<std::string>{"report 0", "report 1"}));
    }
  });
}

TEST(TcpGroupTest, MembershipMismatchIsRefused) {
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(Options(0, 2, "127.0.0.1:0")));
  const std::string address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  EXPECT_STATUS_MSG(InvalidArgument, "rank 2 of 3 is not a member",
                    MakeTcpGroup(Options(2, 3, address)));
}

TEST(TcpGroupTest, GatherDeadlineNamesTheLateRankWhichThenRejoins) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(3));
  // Round 0, gather: rank 2 arrives only after rank 0 gave up on it.
  ASSERT_OK(group.ranks[1]->Gather("one", Soon()));
  const Status failed = group.ranks[0]->Gather("zero", Soon(kShort)).status();
  EXPECT_STATUS_MSG(DeadlineExceeded, "rank 2 of 3 sent nothing by the deadline", failed);
  EXPECT_EQ(failed.message().find("rank 1 "), std::string::npos) << failed.message();
  // Rank 0 dropped the late rank's link, so its late message is refused rather than queued.
  EXPECT_STATUS_MSG(Unavailable, "is gone", group.ranks[2]->Gather("late", Soon()));
  // Round 1: the abort reaches everyone, the late rank over a new connection.
  testing::OnEveryRank(3, [&](uint32_t rank) {
    ASSERT_OK_AND_ASSIGN(std::string got, group.ranks[rank]->Broadcast("abort", Soon()));
    EXPECT_EQ(got, "abort");
  });
  // Round 2: a full gather, with nothing of round 0 in it.
  testing::OnEveryRank(3, [&](uint32_t rank) {
    ASSERT_OK_AND_ASSIGN(auto messages,
                         group.ranks[rank]->Gather(fmt::format("r{}", rank), Soon()));
    if (rank == 0) {
      EXPECT_EQ(messages, (std::vector<std::string>{"r0", "r1", "r2"}));
    }
  });
}

TEST(TcpGroupTest, BroadcastDeadlineOnAMember) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(2));
  EXPECT_STATUS_MSG(DeadlineExceeded, "sent nothing by the deadline",
                    group.ranks[1]->Broadcast("", Soon(kShort)));
}

TEST(TcpGroupTest, DestroyedRankFailsGatherAndBroadcastStillReachesTheOthers) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(4));
  testing::OnEveryRank(4, [&](uint32_t rank) {
    if (rank == 2) {
      group.ranks[2].reset();
      return;
    }
    if (rank != 0) {
      ASSERT_OK(group.ranks[rank]->Gather(testing::GroupPayload(0, rank), Soon()));
      ASSERT_OK_AND_ASSIGN(std::string decision, group.ranks[rank]->Broadcast("", Soon()));
      EXPECT_EQ(decision, "abort");
      return;
    }
    const Status gathered = group.ranks[0]->Gather(testing::GroupPayload(0, 0), Soon()).status();
    EXPECT_STATUS_MSG(Unavailable, "rank 2 of 4 is gone", gathered);
    // Rank 2 never comes back: the broadcast waits for it only until its deadline.
    EXPECT_STATUS_MSG(Unavailable, "rank 2 of 4 is not connected",
                      group.ranks[0]->Broadcast("abort", Soon(kShort)));
  });
}

TEST(TcpGroupTest, ReconnectingRankReplacesItsOldLink) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(2));
  testing::OnEveryRank(
      2, [&](uint32_t rank) { ASSERT_OK(group.ranks[rank]->Broadcast("first", Soon())); });
  // A second rank 1 joins while the first is still connected: it takes the first one's place.
  ASSERT_OK_AND_ASSIGN(auto replacement, MakeTcpGroup(Options(1, 2, group.address)));
  testing::OnEveryRank(2, [&](uint32_t rank) {
    ProducerGroup& endpoint = rank == 0 ? *group.ranks[0] : *replacement;
    ASSERT_OK_AND_ASSIGN(std::string got, endpoint.Broadcast("second", Soon()));
    EXPECT_EQ(got, "second");
  });
  EXPECT_STATUS_MSG(Unavailable, "rank 0 at", group.ranks[1]->Broadcast("", Soon()));
}

TEST(TcpGroupTest, RankZeroVanishingFailsTheOthersPromptly) {
  ASSERT_OK_AND_ASSIGN(LoopbackGroup group, MakeLoopbackGroup(3));
  const std::string gone = fmt::format("rank 0 at {} is gone", group.address);
  group.ranks[0].reset();
  const auto started = GroupClock::now();
  // The broadcast waits for the closed connection; by the time it sees it, rank 2's connection
  // was closed too (rank 0's destructor closed both), so the gather does not write into it.
  EXPECT_STATUS_MSG(Unavailable, gone, group.ranks[1]->Broadcast("", Soon()));
  EXPECT_STATUS_MSG(Unavailable, gone, group.ranks[2]->Gather("report", Soon()));
  EXPECT_LT(GroupClock::now() - started, kGenerous);
}

TEST(TcpGroupTest, OversizedGatherFrameIsRefusedAndTheRankRecovers) {
  TcpGroupOptions root_options = Options(0, 2, "127.0.0.1:0");
  root_options.max_message_bytes = 1024;
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(root_options));
  const std::string address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  // Rank 1's own limit is larger, so it sends; rank 0 refuses the frame by its header.
  ASSERT_OK_AND_ASSIGN(auto member, MakeTcpGroup(Options(1, 2, address)));
  std::latch abort_round_over(1);
  testing::OnEveryRank(2, [&](uint32_t rank) {
    if (rank == 0) {
      EXPECT_STATUS_MSG(ResourceExhausted, "rank 1 of 2: a frame of 2048 bytes exceeds the limit",
                        root->Gather("zero", Soon()));
      // The refused link is dropped; rank 1 finds out on its next call.
      EXPECT_STATUS(Unavailable, root->Broadcast("abort", Soon(kShort)));
      abort_round_over.count_down();
      ASSERT_OK_AND_ASSIGN(std::string got, root->Broadcast("again", Soon()));
      EXPECT_EQ(got, "again");
      return;
    }
    ASSERT_OK(member->Gather(std::string(2048, 'x'), Soon()));
    EXPECT_STATUS(Unavailable, member->Broadcast("", Soon()));
    abort_round_over.wait();
    ASSERT_OK_AND_ASSIGN(std::string got, member->Broadcast("", Soon()));
    EXPECT_EQ(got, "again");
  });
}

TEST(TcpGroupTest, OversizedBroadcastFrameIsRefusedByTheReceiver) {
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(Options(0, 2, "127.0.0.1:0")));
  TcpGroupOptions member_options = Options(1, 2, fmt::format("127.0.0.1:{}", TcpGroupPort(*root)));
  member_options.max_message_bytes = 1024;
  ASSERT_OK_AND_ASSIGN(auto member, MakeTcpGroup(member_options));
  testing::OnEveryRank(2, [&](uint32_t rank) {
    if (rank == 0) {
      // Rank 0 may or may not see the drop while writing; what matters is rank 1's answer.
      root->Broadcast(std::string(4096, 'x'), Soon()).status().IgnoreError();
      return;
    }
    EXPECT_STATUS_MSG(ResourceExhausted, "a frame of 4096 bytes exceeds the limit of 1024",
                      member->Broadcast("", Soon()));
  });
}

// A message over the sender's own limit never leaves it, and the waiting side hears of it at
// once instead of waiting for its deadline.
TEST(TcpGroupTest, MessageOverTheSendersLimitFailsBothSidesAtOnce) {
  TcpGroupOptions root_options = Options(0, 2, "127.0.0.1:0");
  root_options.max_message_bytes = 1024;
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(root_options));
  TcpGroupOptions member_options = Options(1, 2, fmt::format("127.0.0.1:{}", TcpGroupPort(*root)));
  member_options.max_message_bytes = 1024;
  ASSERT_OK_AND_ASSIGN(auto member, MakeTcpGroup(member_options));
  const auto started = GroupClock::now();
  testing::OnEveryRank(2, [&](uint32_t rank) {
    if (rank == 0) {
      EXPECT_STATUS_MSG(ResourceExhausted, "2000 bytes exceeds the limit of 1024",
                        root->Broadcast(std::string(2000, 'x'), Soon()));
      EXPECT_STATUS_MSG(ResourceExhausted, "rank 1 of 2: its message of 3000 bytes",
                        root->Gather("zero", Soon()));
      ASSERT_OK_AND_ASSIGN(auto messages, root->Gather("zero", Soon()));
      EXPECT_EQ(messages, (std::vector<std::string>{"zero", "fits"}));
      return;
    }
    EXPECT_STATUS_MSG(ResourceExhausted, "rank 0's message of 2000 bytes",
                      member->Broadcast("", Soon()));
    EXPECT_STATUS_MSG(ResourceExhausted, "3000 bytes exceeds the limit of 1024",
                      member->Gather(std::string(3000, 'y'), Soon()));
    ASSERT_OK(member->Gather("fits", Soon()));
  });
  EXPECT_LT(GroupClock::now() - started, kGenerous);
}

// ---- Ranks as processes ----------------------------------------------------------------------

/// A child process running one rank's script (RunChild); killed and reaped if still running when
/// the test ends.
class ChildRank {
 public:
  /// Start this binary as rank `rank` of `world_size` running `script` against rank 0 at `port`.
  static std::unique_ptr<ChildRank> Spawn(std::string_view script, uint32_t rank,
                                          uint32_t world_size, uint16_t port) {
    std::vector<std::string> variables;
    for (char** variable = environ; *variable != nullptr; ++variable) {
      variables.emplace_back(*variable);
    }
    variables.push_back(
        fmt::format("{}={}:{}:{}:{}", kChildVariable, script, rank, world_size, port));
    std::vector<char*> envp;
    for (std::string& variable : variables) envp.push_back(variable.data());
    envp.push_back(nullptr);
    std::string program = "/proc/self/exe";
    std::vector<char*> argv = {program.data(), nullptr};
    pid_t pid = -1;
    const int error =
        ::posix_spawn(&pid, program.c_str(), nullptr, nullptr, argv.data(), envp.data());
    EXPECT_EQ(error, 0) << "posix_spawn: " << std::strerror(error);
    return std::make_unique<ChildRank>(error == 0 ? pid : -1);
  }

  explicit ChildRank(pid_t pid) : pid_(pid) {}

  ~ChildRank() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      Wait();
    }
  }

  void Kill() const { ::kill(pid_, SIGKILL); }

  /// Reap the child; return its wait status.
  int Wait() {
    int status = 0;
    if (pid_ > 0 && ::waitpid(pid_, &status, 0) == pid_) pid_ = -1;
    return status;
  }

 private:
  pid_t pid_;
};

/// The child's side: run `script` as one rank, checking every result; exit status 0 when all
/// matched.
///   survivor  broadcast "plan-0", gather "report-R", broadcast "abort", broadcast "plan-1",
///             gather "again-R"
///   victim    broadcast "plan-0", then wait to be killed
///   rejoiner  (a restarted rank) broadcast "plan-1", gather "again-R"
int RunChild(std::string_view spec) {
  std::vector<std::string> fields;
  for (size_t start = 0;;) {
    const size_t colon = spec.find(':', start);
    fields.emplace_back(spec.substr(start, colon - start));
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  if (fields.size() != 4) {
    std::fprintf(stderr, "child: malformed %s\n", std::string(spec).c_str());
    return 2;
  }
  const std::string& script = fields[0];
  const uint32_t rank = static_cast<uint32_t>(std::stoul(fields[1]));
  const uint32_t world_size = static_cast<uint32_t>(std::stoul(fields[2]));
  Result<std::unique_ptr<ProducerGroup>> made =
      MakeTcpGroup(Options(rank, world_size, "127.0.0.1:" + fields[3]));
  if (!made.ok()) {
    std::fprintf(stderr, "child rank %u: %s\n", rank, made.status().ToString().c_str());
    return 3;
  }
  ProducerGroup& group = **made;
  int failures = 0;
  const auto expect_broadcast = [&](std::string_view expected) {
    Result<std::string> got = group.Broadcast("", Soon());
    if (!got.ok() || *got != expected) {
      std::fprintf(stderr, "child rank %u: broadcast: expected '%s', got %s\n", rank,
                   std::string(expected).c_str(),
                   got.ok() ? ("'" + *got + "'").c_str() : got.status().ToString().c_str());
      ++failures;
    }
  };
  const auto gather = [&](const std::string& message) {
    if (Status sent = group.Gather(message, Soon()).status(); !sent.ok()) {
      std::fprintf(stderr, "child rank %u: gather: %s\n", rank, sent.ToString().c_str());
      ++failures;
    }
  };
  if (script == "survivor") {
    expect_broadcast("plan-0");
    gather(fmt::format("report-{}", rank));
    expect_broadcast("abort");
    expect_broadcast("plan-1");
    gather(fmt::format("again-{}", rank));
  } else if (script == "victim") {
    expect_broadcast("plan-0");
    for (;;) ::pause();
  } else if (script == "rejoiner") {
    expect_broadcast("plan-1");
    gather(fmt::format("again-{}", rank));
  } else {
    std::fprintf(stderr, "child: unknown script %s\n", script.c_str());
    return 2;
  }
  return failures == 0 ? 0 : 1;
}

// kill -9 of a rank in the middle of a gather: rank 0's gather fails at once naming it, the
// survivors get rank 0's next broadcast, and the rank, restarted, takes part in the next round.
TEST(TcpGroupProcessTest, KilledRankFailsGatherSurvivorsAbortRestartedRankRejoins) {
  constexpr uint32_t kWorld = 4;
  ASSERT_OK_AND_ASSIGN(auto root, MakeTcpGroup(Options(0, kWorld, "127.0.0.1:0")));
  const uint16_t port = TcpGroupPort(*root);
  auto first = ChildRank::Spawn("survivor", 1, kWorld, port);
  auto victim = ChildRank::Spawn("victim", 2, kWorld, port);
  auto third = ChildRank::Spawn("survivor", 3, kWorld, port);

  // Waits until all three have connected.
  ASSERT_OK(root->Broadcast("plan-0", Soon()));

  Status gathered;
  {
    std::jthread gather([&] { gathered = root->Gather("report-0", Soon()).status(); });
    victim->Kill();
  }
  EXPECT_STATUS_MSG(Unavailable, "rank 2 of 4 is gone", gathered);
  EXPECT_EQ(gathered.message().find("rank 1 "), std::string::npos) << gathered.message();
  EXPECT_EQ(gathered.message().find("rank 3 "), std::string::npos) << gathered.message();
  const int victim_status = victim->Wait();
  EXPECT_TRUE(WIFSIGNALED(victim_status) && WTERMSIG(victim_status) == SIGKILL);

  // Rank 2 is down: the abort reaches the survivors, and names rank 2 as not reached.
  EXPECT_STATUS_MSG(Unavailable, "rank 2 of 4 is not connected",
                    root->Broadcast("abort", Soon(kShort)));

  auto restarted = ChildRank::Spawn("rejoiner", 2, kWorld, port);
  ASSERT_OK(root->Broadcast("plan-1", Soon()));
  ASSERT_OK_AND_ASSIGN(auto messages, root->Gather("again-0", Soon()));
  EXPECT_EQ(messages, (std::vector<std::string>{"again-0", "again-1", "again-2", "again-3"}));

  for (auto* child : {first.get(), third.get(), restarted.get()}) {
    const int status = child->Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
  }
}

}  // namespace
}  // namespace refit

// This binary is also its own child process: with REFIT_TCP_GROUP_CHILD set it runs one rank's
// script instead of the tests (a fresh exec, so it inherits none of the parent's sockets).
int main(int argc, char** argv) {
  if (const char* spec = std::getenv(refit::kChildVariable); spec != nullptr) {
    return refit::RunChild(spec);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
