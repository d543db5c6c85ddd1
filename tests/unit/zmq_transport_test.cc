// zmq:// — the ZeroMQ relay tree on loopback: fan-out, dedupe (also after a failed or while an
// unfinished forward), seal after flush, stream ends only of open transfers and of a bounded
// number of producers, api key checked before the payload is read, refusals that reach the
// sender, CURVE (encryption, server key, authorized client keys, key files), malformed frames,
// retries, binding another address than the advertised endpoint.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "codec/tracker.h"
#include "loopback.h"
#include "receiver/receiver_session.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "refit/weight_store.h"
#include "test_data.h"
#include "test_util.h"
#include "transport/zmq/zmq_zap.h"
#include "zmq_raw_client.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

// A flush timeout no correct run reaches, even on a loaded 2-core machine.
constexpr auto kGenerousTimeout = std::chrono::seconds(60);
// How long a raw test client waits for a reply that must come.
constexpr int kReplyWaitMs = 20'000;
// How long a raw test client waits to conclude that a dropped request got no reply.
constexpr int kSilenceWaitMs = 300;
constexpr double kDensity = 0.05;
// Small enough that a test can send a frame beyond it cheaply, large enough for every payload.
constexpr uint64_t kTestMaxPayloadBytes = 64 << 10;
// Every relay count of the tree test: a single relay, full and partial heap levels, depth 3.
constexpr size_t kMaxTreeRelays = 9;
// How long a flush waits in a test where a payload is known to be missing.
constexpr auto kMissingPayloadTimeout = std::chrono::milliseconds(300);
// Z85 text of a CURVE key (ZeroMQ RFC 32), and libzmq's buffer for it with the NUL.
constexpr size_t kZ85KeyChars = 40;
constexpr size_t kZ85KeyBuffer = kZ85KeyChars + 1;

std::vector<OwnedTensor> MakeModel(uint64_t seed) {
  return {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, seed + 1),
          RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, seed + 2),
          RandomTensor("model.norm.weight", DType::kBFloat16, {257}, seed + 3)};
}

std::string U32(uint32_t value) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

struct Step {
  TransferPlan plan;
  uint32_t producer = 0;
  std::vector<std::vector<std::byte>> payloads;
  // The payload count of each producer, as the stream ends declare it.
  std::map<uint32_t, uint32_t> declared;
  std::map<std::string, uint64_t> digests;
  std::vector<OwnedTensor> model;
};

struct Receiver {
  std::unique_ptr<WeightStore> store;
  std::unique_ptr<internal::ReceiverSession> session;
  std::unique_ptr<Listener> listener;
};

// A CURVE key pair written as files, as `refit keygen` writes them.
struct KeyFiles {
  std::string secret_path;
  std::string public_path;
  std::string public_z85;
};

// A directory for key files, removed with them at the end of the test.
class KeyDir {
 public:
  KeyDir() {
    std::string pattern = ::testing::TempDir() + "refit-zmq-keys-XXXXXX";
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path_ = pattern;
  }
  ~KeyDir() { std::filesystem::remove_all(path_); }

  // Write `text` to file `name` with `mode` (whatever the umask); return its path.
  std::string Write(const std::string& name, const std::string& text, mode_t mode = 0600) {
    const std::string path = path_ + "/" + name;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
    EXPECT_EQ(::chmod(path.c_str(), mode), 0) << path;
    return path;
  }

  // A fresh key pair: <name>.key (mode 0600) and <name>.pub, each a Z85 line.
  KeyFiles NewKeyPair(const std::string& name) {
    std::array<char, kZ85KeyBuffer> public_z85{};
    std::array<char, kZ85KeyBuffer> secret_z85{};
    EXPECT_EQ(zmq_curve_keypair(public_z85.data(), secret_z85.data()), 0);
    KeyFiles files;
    files.public_z85 = public_z85.data();
    files.secret_path = Write(name + ".key", std::string(secret_z85.data()) + "\n");
    files.public_path = Write(name + ".pub", files.public_z85 + "\n", 0644);
    return files;
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A zmq:// transport with these parameters (percent-encoded as needed).
Result<std::unique_ptr<Transport>> MakeZmq(
    std::vector<std::pair<std::string, std::string>> params) {
  return MakeTransport(TransportUri{"zmq", "", std::move(params)});
}

// A sink for listeners that must fail before delivering anything.
class RefusingSink final : public PayloadSink {
 public:
  Result<StageResult> Deliver(ValidatedPayload, std::stop_token) override {
    return FailedPrecondition("this test delivers nothing");
  }
};

class ZmqTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(transport_, MakeTransport("zmq://"));
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    model_ = MakeModel(1);
    for (const OwnedTensor& t : model_) ASSERT_OK(tracker_->AdoptBaseline(t.view()));
  }

  // A receiver holding model_, without a listener.
  Receiver MakeSession() {
    Receiver receiver;
    receiver.store = WeightStore::Make();
    for (const OwnedTensor& t : model_) EXPECT_OK(receiver.store->AddCopy(t.view()));
    auto session = internal::ReceiverSession::Make({}, *receiver.store);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    if (!session.ok()) return receiver;
    receiver.session = std::move(session).ValueOrDie();
    return receiver;
  }

  // A started receiver holding model_, listening at `endpoint` among `peers` (bound at
  // `bind_address` when set).
  // A relay with the api key "open sesame", prepared for step 1's transfer, and that step's
  // first payload as a frame.
  struct KeyedRelay {
    std::unique_ptr<Transport> transport;
    Receiver receiver;
    std::string payload0;
  };
  KeyedRelay MakeKeyedRelay(const std::string& endpoint) {
    KeyedRelay keyed;
    auto transport = MakeTransport("zmq://?api_key=open%20sesame");
    EXPECT_TRUE(transport.ok()) << transport.status().ToString();
    if (!transport.ok()) return keyed;
    keyed.transport = std::move(transport).ValueOrDie();
    keyed.receiver = MakeReceiver(endpoint, {}, keyed.transport.get());
    if (keyed.receiver.listener == nullptr) return keyed;
    const Step step = EncodeStep(1, 0);
    Prepare(keyed.receiver, step);
    keyed.payload0.assign(reinterpret_cast<const char*>(step.payloads[0].data()),
                          step.payloads[0].size());
    return keyed;
  }

  Receiver MakeReceiver(const std::string& endpoint, const std::vector<std::string>& peers,
                        Transport* transport = nullptr, const std::string& bind_address = "") {
    Receiver receiver = MakeSession();
    if (receiver.session == nullptr) return receiver;
    auto listener =
        (transport ? transport : transport_.get())
            ->MakeListener(ListenerContext{endpoint, peers, bind_address}, *receiver.session);
    EXPECT_TRUE(listener.ok()) << listener.status().ToString();
    if (!listener.ok()) return receiver;
    receiver.listener = std::move(listener).ValueOrDie();
    EXPECT_OK(receiver.listener->Start());
    return receiver;
  }

  std::vector<Receiver> MakeRelays(size_t n, std::vector<std::string>& endpoints,
                                   Transport* transport = nullptr) {
    endpoints = testing::FreeLoopbackEndpoints(n);
    std::vector<Receiver> relays;
    for (const std::string& endpoint : endpoints) {
      relays.push_back(MakeReceiver(endpoint, endpoints, transport));
    }
    return relays;
  }

  // The next training step of producer `producer`, one payload per tensor; or, with
  // `producer_per_tensor`, tensor t as payload 0 of producer t.
  Step EncodeStep(uint64_t seed, uint32_t producer, bool producer_per_tensor = false) {
    Step step;
    step.producer = producer;
    auto plan = tracker_->Begin(TransferId::Random());
    EXPECT_TRUE(plan.ok()) << plan.status().ToString();
    if (!plan.ok()) return step;
    step.plan = *plan;
    for (size_t t = 0; t < model_.size(); ++t) {
      step.model.push_back(Perturb(model_[t], kDensity, seed * 100 + t));
      auto encoded = tracker_->Encode(step.plan.transfer_id, step.model.back().view());
      EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
      if (!encoded.ok() || encoded->items.empty()) continue;
      std::vector<ItemView> views;
      for (const Item& item : encoded->items) views.push_back(item.view());
      const uint32_t payload_producer =
          producer_per_tensor ? static_cast<uint32_t>(step.payloads.size()) : producer;
      const uint32_t payload_id =
          producer_per_tensor ? 0 : static_cast<uint32_t>(step.payloads.size());
      const PayloadIds ids{step.plan.transfer_id, payload_producer, payload_id,
                           step.plan.base_version, step.plan.target_version};
      ++step.declared[payload_producer];
      auto payload = EncodePayload(ids, views);
      EXPECT_TRUE(payload.ok()) << payload.status().ToString();
      if (payload.ok()) step.payloads.push_back(std::move(payload).ValueOrDie());
    }
    step.digests = tracker_->PendingDigests();
    return step;
  }

  std::unique_ptr<TransportSender> SenderFor(const Step& step,
                                             const std::vector<std::string>& endpoints,
                                             Transport* transport = nullptr) {
    auto sender =
        (transport ? transport : transport_.get())
            ->MakeSender(SenderContext{step.plan.transfer_id, step.producer, step.plan.base_version,
                                       step.plan.target_version, endpoints});
    EXPECT_TRUE(sender.ok()) << sender.status().ToString();
    return sender.ok() ? std::move(sender).ValueOrDie() : nullptr;
  }

  static void Prepare(Receiver& receiver, const Step& step) {
    ASSERT_OK(
        receiver.session->Prepare(PrepareRequest{step.plan.transfer_id, step.plan.base_version, {}})
            .status());
  }

  // Flush with the counts the relay flush declared and the producer's digests, commit, compare.
  static void FlushCommitAndCheck(Receiver& receiver, const Step& step) {
    FlushOptions flush;
    flush.timeout = kGenerousTimeout;
    flush.expected.payloads_per_producer =
        receiver.session->DeclaredPayloads(step.plan.transfer_id);
    EXPECT_EQ(flush.expected.payloads_per_producer, step.declared);
    flush.expected.digests = step.digests;
    ASSERT_OK(receiver.session->Flush(step.plan.transfer_id, flush));
    ASSERT_OK(receiver.session->Commit(step.plan.transfer_id));
    for (const OwnedTensor& t : step.model) {
      ASSERT_OK_AND_ASSIGN(auto got, receiver.store->Find(t.name));
      EXPECT_TRUE(std::equal(got.bytes.begin(), got.bytes.end(), t.bytes.begin(), t.bytes.end()))
          << t.name;
    }
  }

  // Send all of `step` through the tree of `endpoints` (with `transport`'s sender), flush every
  // relay, advance model_.
  void RunStep(std::vector<Receiver>& relays, const std::vector<std::string>& endpoints,
               const Step& step, Transport* transport = nullptr) {
    for (Receiver& relay : relays) Prepare(relay, step);
    auto sender = SenderFor(step, endpoints, transport);
    ASSERT_NE(sender, nullptr);
    for (uint32_t id = 0; id < step.payloads.size(); ++id) {
      ASSERT_OK(sender->Send(id, step.payloads[id]));
    }
    sender->CleanupThread();
    ASSERT_OK(sender->Finish(step.payloads.size()));
    for (Receiver& relay : relays) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relay, step));
    ASSERT_OK(tracker_->Commit(step.plan.transfer_id));
    model_ = step.model;
  }

  // Check that no relay staged or ended anything of `step`: each is still receiving it, empty.
  static void ExpectNothingStaged(const std::vector<Receiver>& relays, const Step& step) {
    for (size_t i = 0; i < relays.size(); ++i) {
      SCOPED_TRACE(fmt::format("relay {}", i));
      EXPECT_EQ(relays[i].listener->stats().delivered, 0u);
      EXPECT_EQ(relays[i].listener->stats().streams_ended, 0u);
      EXPECT_TRUE(relays[i].session->DeclaredPayloads(step.plan.transfer_id).empty());
      const ReceiverStatus status = relays[i].session->GetStatus();
      EXPECT_EQ(status.state, ReceiverState::kReceiving);
      EXPECT_EQ(status.transfer_id, step.plan.transfer_id);
      EXPECT_EQ(status.staged_payloads, 0u);
      EXPECT_EQ(status.duplicate_payloads, 0u);
    }
  }

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::vector<OwnedTensor> model_;
};

TEST_F(ZmqTransportTest, EveryRelayOfEveryTreeSizeReceivesBitExactlyFromEveryRoot) {
  EXPECT_EQ(transport_->capabilities(),
            (TransportCapabilities{
                .staged_ack = true, .fan_out_tree = true, .reports_stream_end = true}));
  uint64_t seed = 1;
  for (size_t n = 1; n <= kMaxTreeRelays; ++n) {
    // Fresh relays start at version 0: restart the producer there, from the current model.
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    for (const OwnedTensor& t : model_) ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    std::vector<std::string> endpoints;
    std::vector<Receiver> relays = MakeRelays(n, endpoints);
    for (const Receiver& relay : relays) ASSERT_NE(relay.listener, nullptr);
    uint64_t payloads = 0;
    for (uint32_t root = 0; root < n; ++root) {
      SCOPED_TRACE(fmt::format("{} relays, root {}", n, root));
      // Producer `root + n` has root relay `root` too (producer_id % n).
      const Step step = EncodeStep(seed++, root + static_cast<uint32_t>(n));
      ASSERT_NO_FATAL_FAILURE(RunStep(relays, endpoints, step));
      payloads += step.payloads.size();
    }
    for (const Receiver& relay : relays) {
      // Every relay staged every payload exactly once, from every root.
      EXPECT_EQ(relay.listener->stats().delivered, payloads);
      EXPECT_EQ(relay.listener->stats().streams_ended, n);
      EXPECT_EQ(relay.listener->stats().duplicates, 0u);
      EXPECT_EQ(relay.listener->stats().failures, 0u)
          << relay.listener->stats().last_error.ToString();
    }
  }
}

TEST_F(ZmqTransportTest, ADuplicateIsStagedOnceAndNotForwardedAgain) {
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints);
  const Step step = EncodeStep(1, 0);
  for (Receiver& relay : relays) Prepare(relay, step);
  auto sender = SenderFor(step, endpoints);
  ASSERT_NE(sender, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  ASSERT_OK(sender->Send(0, step.payloads[0]));
  ASSERT_OK(sender->Finish(step.payloads.size()));
  // Producer 0's root is relay 0; relays 1 and 2 are its children.
  EXPECT_EQ(relays[0].listener->stats().delivered, step.payloads.size());
  EXPECT_EQ(relays[0].listener->stats().duplicates, 1u);
  for (size_t i = 1; i < relays.size(); ++i) {
    EXPECT_EQ(relays[i].listener->stats().delivered, step.payloads.size());
    EXPECT_EQ(relays[i].listener->stats().duplicates, 0u);
  }
  for (Receiver& relay : relays) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relay, step));
}

TEST_F(ZmqTransportTest, RelaysWithoutPeersForwardAlongTheTreeEachTransferNames) {
  // Four relays started alone (no peers list): each transfer's prepare names its tree, and the
  // next transfer may name another order or leave a relay out.
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays;
  for (int i = 0; i < 4; ++i) {
    endpoints.push_back(testing::FreeLoopbackEndpoint());
    relays.push_back(MakeReceiver(endpoints.back(), {}));
    ASSERT_NE(relays.back().listener, nullptr);
  }
  const auto run = [&](const std::vector<size_t>& members, uint64_t seed, uint32_t producer) {
    const Step step = EncodeStep(seed, producer);
    std::vector<std::string> tree;
    for (const size_t m : members) tree.push_back(endpoints[m]);
    for (uint32_t position = 0; position < members.size(); ++position) {
      ASSERT_OK(relays[members[position]].listener->RouteTransfer(step.plan.transfer_id,
                                                                  RelayTree{tree, position}));
      Prepare(relays[members[position]], step);
    }
    auto sender = SenderFor(step, tree);
    ASSERT_NE(sender, nullptr);
    for (uint32_t id = 0; id < step.payloads.size(); ++id) {
      ASSERT_OK(sender->Send(id, step.payloads[id]));
    }
    ASSERT_OK(sender->Finish(step.payloads.size()));
    for (const size_t m : members) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relays[m], step));
    ASSERT_OK(tracker_->Commit(step.plan.transfer_id));
    model_ = step.model;
  };
  // Producer 1's root is tree[1 % 4] = relay 1.
  ASSERT_NO_FATAL_FAILURE(run({0, 1, 2, 3}, 1, 1));
  const uint64_t first = relays[0].listener->stats().delivered;
  for (const Receiver& relay : relays) EXPECT_EQ(relay.listener->stats().delivered, first);
  // Relay 2 leaves the fleet; the rest in another order. Relay 2 is neither sent nor forwarded
  // anything of this transfer (it is not prepared for it and would refuse it).
  ASSERT_NO_FATAL_FAILURE(run({3, 1, 0}, 2, 0));
  EXPECT_EQ(relays[2].listener->stats().delivered, first);
  EXPECT_GT(relays[3].listener->stats().delivered, first);
  for (const Receiver& relay : relays) {
    EXPECT_EQ(relay.listener->stats().failures, 0u)
        << relay.listener->stats().last_error.ToString();
  }

  // A tree a relay cannot take is refused, naming the transfer and what is wrong.
  const TransferId id = TransferId::Random();
  Listener& listener = *relays[0].listener;
  EXPECT_STATUS_MSG(InvalidArgument, "position 2 is not among its 2 endpoints",
                    listener.RouteTransfer(id, RelayTree{{endpoints[0], endpoints[1]}, 2}));
  EXPECT_STATUS_MSG(InvalidArgument, "position 0 is not among its 0 endpoints",
                    listener.RouteTransfer(id, RelayTree{{}, 0}));
  EXPECT_STATUS_MSG(
      InvalidArgument, "names " + endpoints[1] + " more than once",
      listener.RouteTransfer(id, RelayTree{{endpoints[0], endpoints[1], endpoints[1]}, 0}));
  EXPECT_STATUS_MSG(InvalidArgument, id.ToHex(),
                    listener.RouteTransfer(id, RelayTree{{endpoints[0], "no-port"}, 0}));
}

TEST_F(ZmqTransportTest, ConcurrentProducersWithCrossingTreesAllArrive) {
  // Three producers with roots 0, 1 and 2 send at once: each relay is a parent in one tree and a
  // child in another, the case where relays waiting on each other would deadlock.
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints);
  const Step step = EncodeStep(1, 0, /*producer_per_tensor=*/true);
  ASSERT_EQ(step.declared.size(), 3u);
  for (Receiver& relay : relays) Prepare(relay, step);
  std::vector<Status> results(step.payloads.size());
  {
    std::vector<std::jthread> producers;
    for (uint32_t p = 0; p < step.payloads.size(); ++p) {
      producers.emplace_back([&, p] {
        auto sender = transport_->MakeSender(SenderContext{
            step.plan.transfer_id, p, step.plan.base_version, step.plan.target_version, endpoints});
        if (!sender.ok()) {
          results[p] = sender.status();
          return;
        }
        results[p] = (*sender)->Send(0, step.payloads[p]);
        (*sender)->CleanupThread();
        if (results[p].ok()) results[p] = (*sender)->Finish(1);
      });
    }
  }
  for (const Status& result : results) EXPECT_OK(result);
  for (Receiver& relay : relays) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relay, step));
}

TEST_F(ZmqTransportTest, AWrongApiKeyIsPermissionDeniedAndStagesNothing) {
  ::setenv("REFIT_ZMQ_TEST_KEY", "open sesame", 1);
  ASSERT_OK_AND_ASSIGN(auto keyed, MakeTransport("zmq://?api_key_env=REFIT_ZMQ_TEST_KEY"));
  ASSERT_OK_AND_ASSIGN(auto wrong, MakeTransport("zmq://?api_key=open%20sesamE&retries=0"));
  ASSERT_OK_AND_ASSIGN(auto right, MakeTransport("zmq://?api_key=open%20sesame"));
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(2, endpoints, keyed.get());
  const Step step = EncodeStep(1, 0);
  for (Receiver& relay : relays) Prepare(relay, step);

  auto refused = SenderFor(step, endpoints, wrong.get());
  ASSERT_NE(refused, nullptr);
  EXPECT_STATUS(PermissionDenied, refused->Send(0, step.payloads[0]));
  EXPECT_STATUS(PermissionDenied, refused->Finish(step.payloads.size()));
  // The wrong key was refused in the handshake (PLAIN), before a request could be sent.
  EXPECT_GE(relays[0].listener->stats().failures, 1u);
  EXPECT_NE(relays[0].listener->stats().last_error.message().find("handshake"), std::string::npos)
      << relays[0].listener->stats().last_error.ToString();
  // Without a key the client speaks no PLAIN: the handshake fails on the mechanism (or the
  // relay hangs up first), Unavailable after the retries.
  ASSERT_OK_AND_ASSIGN(auto none, MakeTransport("zmq://?retries=0"));
  auto unkeyed = SenderFor(step, endpoints, none.get());
  ASSERT_NE(unkeyed, nullptr);
  EXPECT_STATUS(Unavailable, unkeyed->Send(0, step.payloads[0]));
  for (const Receiver& relay : relays) {
    EXPECT_EQ(relay.listener->stats().delivered, 0u);
    EXPECT_EQ(relay.listener->stats().streams_ended, 0u);
    EXPECT_EQ(relay.session->DeclaredPayloads(step.plan.transfer_id).size(), 0u);
  }

  auto accepted = SenderFor(step, endpoints, right.get());
  ASSERT_NE(accepted, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(accepted->Send(id, step.payloads[id]));
  }
  ASSERT_OK(accepted->Finish(step.payloads.size()));
  for (Receiver& relay : relays) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relay, step));
}

TEST_F(ZmqTransportTest, MalformedRequestsAreRefusedOrDroppedAndServingGoesOn) {
  TransportOptions options;
  options.limits.max_payload_bytes = kTestMaxPayloadBytes;
  ASSERT_OK_AND_ASSIGN(auto limited, MakeTransport("zmq://", options));
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  Receiver receiver = MakeReceiver(endpoint, {endpoint}, limited.get());
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1, 0);
  Prepare(receiver, step);
  const std::string payload0(reinterpret_cast<const char*>(step.payloads[0].data()),
                             step.payloads[0].size());

  testing::RawZmqClient client(endpoint);
  // Speaks the protocol, wrong frame count: NACK.
  client.Send({"refit-zmq/2", "DATA"});
  std::vector<std::string> reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[0], "refit-zmq/2");
  EXPECT_EQ(reply[1], "NACK");
  EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(StatusCode::kInvalidArgument)));
  // Unknown kind: NACK.
  client.Send({"refit-zmq/2", "DELETE", "", U32(0), payload0});
  reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  // Garbage payload: NACK from the header check.
  client.Send({"refit-zmq/2", "DATA", "", U32(0), "not a payload at all"});
  reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  // A root index outside the transfer's relay tree: NACK. The tree depends on the transfer, so
  // the index is checked once the header named it; the refusal names the payload's ids.
  client.Send({"refit-zmq/2", "DATA", "", U32(7), payload0});
  reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(StatusCode::kInvalidArgument)));
  EXPECT_NE(reply[6].find("root relay index 7 is not one of 1 relays"), std::string::npos)
      << reply[6];
  EXPECT_EQ(reply[3], U32(0));
  EXPECT_EQ(reply[4], U32(0));
  // A short root index frame in a FLUSH: NACK.
  client.Send({"refit-zmq/2", "FLUSH", "", "x", std::string(16, '\0'), U32(0), U32(1)});
  reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  // Another protocol: dropped without a reply.
  client.Send({"http/1.1", "DATA", "", U32(0), payload0});
  EXPECT_TRUE(client.Receive(kSilenceWaitMs).empty());
  // Too many frames: dropped.
  client.Send(std::vector<std::string>(20, "refit-zmq/2"));
  EXPECT_TRUE(client.Receive(kSilenceWaitMs).empty());
  EXPECT_EQ(receiver.listener->stats().delivered, 0u);

  // A frame beyond the size limit: ZeroMQ drops it and the connection.
  {
    testing::RawZmqClient huge(endpoint);
    huge.Send({"refit-zmq/2", "DATA", "", U32(0), std::string(4 * kTestMaxPayloadBytes, 'x')});
    EXPECT_TRUE(huge.Receive(kSilenceWaitMs).empty());
  }
  EXPECT_GE(receiver.listener->stats().failures, 5u);

  // The listener still serves a correct sender.
  auto sender = SenderFor(step, {endpoint}, limited.get());
  ASSERT_NE(sender, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  ASSERT_OK(sender->Finish(step.payloads.size()));
  ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(receiver, step));
}

// Nothing listens at the only relay: every attempt is refused at once (no timeout to wait out),
// and the send fails after its retries saying so.
TEST_F(ZmqTransportTest, ASenderToADeadEndpointFailsAfterItsRetries) {
  ASSERT_OK_AND_ASSIGN(auto patient, MakeTransport("zmq://?timeout_ms=10000&retries=2"));
  const Step step = EncodeStep(1, 0);
  auto sender = SenderFor(step, {testing::FreeLoopbackEndpoint()}, patient.get());
  ASSERT_NE(sender, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const Status status = sender->Send(0, step.payloads[0]);
  EXPECT_STATUS_MSG(Unavailable, "3 attempts", status);
  EXPECT_STATUS_MSG(Unavailable, "nothing accepts connections", status);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5))
      << "a refused connection is not waited out for the 10 s timeout";
  EXPECT_STATUS(Unavailable, sender->Finish(step.payloads.size()));
}

// A relay whose child refuses connections (a receiver that died) routes around it: the payloads
// reach the child's own children directly, the sender is ACKed, and the dead child, which missed
// the transfer, is skipped at once for the rest of it (its flush fails: under a quorum it is
// fenced).
TEST_F(ZmqTransportTest, ARelayRoutesAroundAChildThatRefusesConnections) {
  ASSERT_OK_AND_ASSIGN(auto patient, MakeTransport("zmq://?timeout_ms=10000&retries=1"));
  // Producer 0's tree: 0 → {1, 2}, 1 → {3}. Relay 1 is dead; relay 3 is reached around it.
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(4);
  const Step step = EncodeStep(1, 0);
  std::vector<Receiver> live;
  for (const size_t i : {0, 2, 3}) {
    live.push_back(MakeReceiver(endpoints[i], endpoints, patient.get()));
    ASSERT_NE(live.back().listener, nullptr);
    Prepare(live.back(), step);
  }
  auto sender = SenderFor(step, endpoints, patient.get());
  ASSERT_NE(sender, nullptr);
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  ASSERT_OK(sender->Finish(step.payloads.size()));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  for (Receiver& relay : live) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relay, step));
}

// The root itself is dead: the sender sends each payload to the root's children, with the same
// root in its frames, and they forward it down the rest of the tree.
TEST_F(ZmqTransportTest, ASenderRoutesAroundADeadRoot) {
  ASSERT_OK_AND_ASSIGN(auto patient, MakeTransport("zmq://?timeout_ms=10000&retries=1"));
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(5);
  const Step step = EncodeStep(1, 0);
  std::vector<Receiver> live;
  for (size_t i = 1; i < endpoints.size(); ++i) {
    live.push_back(MakeReceiver(endpoints[i], endpoints, patient.get()));
    ASSERT_NE(live.back().listener, nullptr);
    Prepare(live.back(), step);
  }
  auto sender = SenderFor(step, endpoints, patient.get());
  ASSERT_NE(sender, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  ASSERT_OK(sender->Finish(step.payloads.size()));
  for (Receiver& relay : live) ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(relay, step));
}

// Issue 45, item 4: a sender given the transfer's deadline (SenderContext::deadline) stops at it,
// however long its attempts and retries would take: a push's --timeout bounds its sends.
TEST_F(ZmqTransportTest, ASenderStopsAtTheTransfersDeadlineWhateverItsRetries) {
  ASSERT_OK_AND_ASSIGN(auto patient, MakeTransport("zmq://?timeout_ms=10000&retries=3"));
  const Step step = EncodeStep(1, 0);
  constexpr auto kBudget = std::chrono::milliseconds(300);
  // Scheduling slack on a loaded 2-core machine; the attempts alone would take 40 s.
  constexpr auto kSlack = std::chrono::milliseconds(1500);
  const auto start = std::chrono::steady_clock::now();
  SenderContext context{step.plan.transfer_id,
                        step.producer,
                        step.plan.base_version,
                        step.plan.target_version,
                        {testing::FreeLoopbackEndpoint()}};
  context.deadline = start + kBudget;
  ASSERT_OK_AND_ASSIGN(auto sender, patient->MakeSender(context));
  const Status status = sender->Send(0, step.payloads[0]);
  EXPECT_STATUS(DeadlineExceeded, status);
  EXPECT_NE(status.message().find("deadline passed"), std::string::npos) << status.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, kBudget + kSlack);
}

TEST_F(ZmqTransportTest, UrisEndpointsAndPeersAreChecked) {
  EXPECT_STATUS(InvalidArgument, MakeTransport("zmq://host:1").status());
  EXPECT_STATUS(InvalidArgument, MakeTransport("zmq://?color=blue").status());
  // The key never appears in an error message.
  const Status typo = MakeTransport("zmq://?api_key=hunter2&colour=blue").status();
  EXPECT_STATUS(InvalidArgument, typo);
  EXPECT_EQ(typo.message().find("hunter2"), std::string::npos) << typo.ToString();
  EXPECT_STATUS(InvalidArgument, MakeTransport("zmq://?timeout_ms=0").status());
  EXPECT_STATUS(InvalidArgument, MakeTransport("zmq://?api_key=a&api_key_env=B").status());
  ::unsetenv("REFIT_ZMQ_TEST_UNSET_KEY");
  EXPECT_STATUS(InvalidArgument,
                MakeTransport("zmq://?api_key_env=REFIT_ZMQ_TEST_UNSET_KEY").status());

  const Step step = EncodeStep(1, 0);
  for (const std::string bad : {"localhost", ":80", "host:0", "host:65536", "host:http", "a/b:1"}) {
    SCOPED_TRACE(bad);
    EXPECT_STATUS(
        InvalidArgument,
        transport_
            ->MakeSender(SenderContext{
                step.plan.transfer_id, 0, step.plan.base_version, step.plan.target_version, {bad}})
            .status());
  }
  Receiver receiver = MakeReceiver(testing::FreeLoopbackEndpoint(), {});
  ASSERT_NE(receiver.listener, nullptr);
  EXPECT_STATUS(FailedPrecondition, receiver.listener->Start());
  EXPECT_STATUS(
      InvalidArgument,
      transport_->MakeListener({"127.0.0.1:1", {"127.0.0.1:2"}}, *receiver.session).status());
  EXPECT_STATUS(
      InvalidArgument,
      transport_->MakeListener({"127.0.0.1:1", {"127.0.0.1:1", "127.0.0.1:1"}}, *receiver.session)
          .status());
  // The same endpoint cannot be bound twice.
  auto second = transport_->MakeListener({receiver.listener->endpoint(), {}}, *receiver.session);
  ASSERT_OK(second.status());
  EXPECT_STATUS(AlreadyExists, (*second)->Start());
}

TEST_F(ZmqTransportTest, ARelaySealsAProducersStreamAtItsFlush) {
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints);
  const Step step = EncodeStep(1, 0);
  ASSERT_EQ(step.payloads.size(), 3u);
  for (Receiver& relay : relays) Prepare(relay, step);
  // The producer declares 3 payloads but sent only 2 before its stream end.
  auto sender = SenderFor(step, endpoints);
  ASSERT_NE(sender, nullptr);
  ASSERT_OK(sender->Send(0, step.payloads[0]));
  ASSERT_OK(sender->Send(1, step.payloads[1]));
  ASSERT_OK(sender->Finish(step.payloads.size()));
  std::vector<ReceiverStatus> before;
  for (const Receiver& relay : relays) before.push_back(relay.session->GetStatus());

  // A late payload, at the root and straight at a child: refused, neither staged nor forwarded.
  auto late = SenderFor(step, endpoints);
  ASSERT_NE(late, nullptr);
  EXPECT_STATUS_MSG(FailedPrecondition, "sealed", late->Send(2, step.payloads[2]));
  testing::RawZmqClient child(endpoints[2]);
  child.Send({"refit-zmq/2", "DATA", "", U32(0),
              std::string(reinterpret_cast<const char*>(step.payloads[2].data()),
                          step.payloads[2].size())});
  const std::vector<std::string> reply = child.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(StatusCode::kFailedPrecondition)));
  // Another payload under a staged id: refused too.
  ASSERT_OK_AND_ASSIGN(const std::vector<std::byte> impostor,
                       EncodePayload(PayloadIds{step.plan.transfer_id, 0, 0, step.plan.base_version,
                                                step.plan.target_version},
                                     {}));
  EXPECT_STATUS_MSG(FailedPrecondition, "sealed", late->Send(0, impostor));
  // An exact copy of a staged payload is a harmless duplicate: ACKed at the root, not forwarded.
  ASSERT_OK(late->Send(0, step.payloads[0]));
  EXPECT_EQ(relays[0].listener->stats().duplicates, 1u);

  for (size_t i = 0; i < relays.size(); ++i) {
    SCOPED_TRACE(fmt::format("relay {}", i));
    EXPECT_EQ(relays[i].listener->stats().delivered, 2u);
    // Only the root saw the copy.
    EXPECT_EQ(relays[i].listener->stats().duplicates, i == 0 ? 1u : 0u);
    const ReceiverStatus after = relays[i].session->GetStatus();
    EXPECT_EQ(after.state, before[i].state);
    EXPECT_EQ(after.staged_payloads, 2u);
    EXPECT_EQ(after.staged_payloads, before[i].staged_payloads);
    EXPECT_EQ(after.duplicate_payloads, before[i].duplicate_payloads);
    // Payload 2 never arrived: the receiver's flush says so, and the transfer rolls back.
    FlushOptions flush;
    flush.timeout = kMissingPayloadTimeout;
    flush.expected.payloads_per_producer =
        relays[i].session->DeclaredPayloads(step.plan.transfer_id);
    EXPECT_STATUS(DeadlineExceeded, relays[i].session->Flush(step.plan.transfer_id, flush));
    ASSERT_OK(relays[i].session->Abort(step.plan.transfer_id));
  }
}

TEST_F(ZmqTransportTest, CurveEncryptsEveryHopOfAThreeRelayTreeBitExactly) {
  KeyDir keys;
  const KeyFiles fleet = keys.NewKeyPair("fleet");
  ASSERT_OK_AND_ASSIGN(auto relay_transport, MakeZmq({{"curve_secret_key", fleet.secret_path},
                                                      {"curve_server_key", fleet.public_path},
                                                      {"api_key", "open sesame"}}));
  // An ephemeral client key pair: these relays admit any client that knows their key.
  ASSERT_OK_AND_ASSIGN(auto sender_transport, MakeZmq({{"curve_server_key", fleet.public_path},
                                                       {"api_key", "open sesame"}}));
  ASSERT_OK_AND_ASSIGN(auto wrong_api_key, MakeZmq({{"curve_server_key", fleet.public_path},
                                                    {"api_key", "open sesamE"}}));
  for (const Transport* transport : {relay_transport.get(), sender_transport.get()}) {
    EXPECT_EQ(transport->capabilities(), (TransportCapabilities{.staged_ack = true,
                                                                .fan_out_tree = true,
                                                                .encrypted = true,
                                                                .reports_stream_end = true}));
  }
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints, relay_transport.get());
  for (const Receiver& relay : relays) ASSERT_NE(relay.listener, nullptr);

  // CURVE does not replace the api key: both are checked.
  const Step refused = EncodeStep(1, 0);
  for (Receiver& relay : relays) Prepare(relay, refused);
  auto sender = SenderFor(refused, endpoints, wrong_api_key.get());
  ASSERT_NE(sender, nullptr);
  EXPECT_STATUS(PermissionDenied, sender->Send(0, refused.payloads[0]));
  ASSERT_NO_FATAL_FAILURE(ExpectNothingStaged(relays, refused));
  for (Receiver& relay : relays) ASSERT_OK(relay.session->Abort(refused.plan.transfer_id));
  ASSERT_OK(tracker_->Abort(refused.plan.transfer_id));

  // A relay forwards as a CURVE client to CURVE children, so every hop is encrypted (a plain
  // hop would fail its handshake).
  for (uint32_t root = 0; root < relays.size(); ++root) {
    SCOPED_TRACE(fmt::format("root {}", root));
    ASSERT_NO_FATAL_FAILURE(
        RunStep(relays, endpoints, EncodeStep(2 + root, root), sender_transport.get()));
  }
  for (const Receiver& relay : relays) {
    EXPECT_EQ(relay.listener->stats().streams_ended, relays.size());
  }
}

TEST_F(ZmqTransportTest, AWrongServerKeyOrAPlainSenderCannotHandshakeAndStagesNothing) {
  KeyDir keys;
  const KeyFiles fleet = keys.NewKeyPair("fleet");
  const KeyFiles other = keys.NewKeyPair("other");
  ASSERT_OK_AND_ASSIGN(auto relay_transport, MakeZmq({{"curve_secret_key", fleet.secret_path}}));
  ASSERT_OK_AND_ASSIGN(auto wrong_server_key,
                       MakeZmq({{"curve_server_key", other.public_path}, {"retries", "1"}}));
  ASSERT_OK_AND_ASSIGN(auto plain, MakeZmq({{"retries", "1"}}));
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints, relay_transport.get());
  const Step step = EncodeStep(1, 0);
  for (Receiver& relay : relays) Prepare(relay, step);

  auto impostor = SenderFor(step, endpoints, wrong_server_key.get());
  ASSERT_NE(impostor, nullptr);
  const Status refused = impostor->Send(0, step.payloads[0]);
  EXPECT_STATUS_MSG(Unavailable, "curve_server_key", refused);
  EXPECT_NE(refused.message().find("2 attempts"), std::string::npos) << refused.ToString();
  EXPECT_STATUS(Unavailable, impostor->Finish(step.payloads.size()));
  auto unencrypted = SenderFor(step, endpoints, plain.get());
  ASSERT_NE(unencrypted, nullptr);
  // The client reports a mechanism mismatch, or the relay's hang-up if it noticed first.
  EXPECT_STATUS(Unavailable, unencrypted->Send(0, step.payloads[0]));
  ASSERT_NO_FATAL_FAILURE(ExpectNothingStaged(relays, step));
}

TEST_F(ZmqTransportTest, CurveAuthorizedKeysAdmitTheListedClientsAndTheRelaysOnly) {
  KeyDir keys;
  const KeyFiles fleet = keys.NewKeyPair("fleet");
  const KeyFiles trainer = keys.NewKeyPair("trainer");
  const KeyFiles stranger = keys.NewKeyPair("stranger");
  // The fleet's own key is not listed: relays are admitted implicitly.
  const std::string authorized =
      keys.Write("authorized", "# trainer ranks\n\n  " + trainer.public_z85 + "  \n# end\n", 0644);
  ASSERT_OK_AND_ASSIGN(auto relay_transport, MakeZmq({{"curve_secret_key", fleet.secret_path},
                                                      {"curve_authorized_keys", authorized}}));
  ASSERT_OK_AND_ASSIGN(auto trainer_transport,
                       MakeZmq({{"curve_server_key", fleet.public_path},
                                {"curve_secret_key", trainer.secret_path}}));
  ASSERT_OK_AND_ASSIGN(auto stranger_transport,
                       MakeZmq({{"curve_server_key", fleet.public_path},
                                {"curve_secret_key", stranger.secret_path}}));
  ASSERT_OK_AND_ASSIGN(auto ephemeral_transport,
                       MakeZmq({{"curve_server_key", fleet.public_path}}));
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints, relay_transport.get());
  for (const Receiver& relay : relays) ASSERT_NE(relay.listener, nullptr);

  const Step refused = EncodeStep(1, 0);
  for (Receiver& relay : relays) Prepare(relay, refused);
  for (Transport* transport : {stranger_transport.get(), ephemeral_transport.get()}) {
    auto sender = SenderFor(refused, endpoints, transport);
    ASSERT_NE(sender, nullptr);
    EXPECT_STATUS_MSG(PermissionDenied, "curve_authorized_keys",
                      sender->Send(0, refused.payloads[0]));
    EXPECT_STATUS(PermissionDenied, sender->Finish(refused.payloads.size()));
  }
  ASSERT_NO_FATAL_FAILURE(ExpectNothingStaged(relays, refused));
  // The root relay (producer 0's) reports whom it refused.
  EXPECT_GE(relays[0].listener->stats().failures, 2u);
  EXPECT_STATUS_MSG(PermissionDenied, "refused CURVE client key",
                    relays[0].listener->stats().last_error);
  for (Receiver& relay : relays) ASSERT_OK(relay.session->Abort(refused.plan.transfer_id));
  ASSERT_OK(tracker_->Abort(refused.plan.transfer_id));

  for (uint32_t root = 0; root < relays.size(); ++root) {
    SCOPED_TRACE(fmt::format("root {}", root));
    ASSERT_NO_FATAL_FAILURE(
        RunStep(relays, endpoints, EncodeStep(2 + root, root), trainer_transport.get()));
  }
}

TEST_F(ZmqTransportTest, BadCurveKeyFilesAreInvalidArgumentNamingTheParameterAndFile) {
  KeyDir keys;
  const KeyFiles fleet = keys.NewKeyPair("fleet");
  const KeyFiles other = keys.NewKeyPair("other");
  // 39 Z85 characters: one short of a key. Key text must never appear in a message.
  const std::string secret_text = "0123456789abcdefghijABCDEFGHIJ.-:+=^!/*";
  const std::string missing = keys.path() + "/missing.key";
  const std::string short_key = keys.Write("short.key", secret_text + "\n");
  const std::string not_z85 = keys.Write("tilde.key", std::string(kZ85KeyChars, '~') + "\n");
  // A correct secret key whose mode alone is wrong.
  std::ifstream fleet_secret(fleet.secret_path);
  const std::string open_secret =
      keys.Write("open.key", std::string(std::istreambuf_iterator<char>(fleet_secret), {}), 0640);
  const std::string bad_line =
      keys.Write("bad_authorized", "# ok\n" + other.public_z85 + "\n" + secret_text + "\n", 0644);
  const std::string writable = keys.Write("writable_authorized", other.public_z85 + "\n", 0664);
  RefusingSink sink;

  struct Case {
    const char* what;
    std::vector<std::pair<std::string, std::string>> params;
    bool listener;  // made as a listener (else a sender)
    std::vector<std::string> message_parts;
  };
  const std::vector<Case> cases = {
      {"a missing secret key",
       {{"curve_secret_key", missing}},
       true,
       {"curve_secret_key", missing}},
      {"a secret key of 39 characters",
       {{"curve_secret_key", short_key}},
       true,
       {"curve_secret_key", short_key, "39 characters"}},
      {"a secret key outside Z85",
       {{"curve_secret_key", not_z85}},
       true,
       {"curve_secret_key", not_z85, "Z85"}},
      {"a secret key others may read",
       {{"curve_secret_key", open_secret}},
       true,
       {"curve_secret_key", open_secret, "chmod 600"}},
      {"a directory as server key",
       {{"curve_server_key", keys.path()}},
       false,
       {"curve_server_key", keys.path(), "not a regular file"}},
      {"a server key of 39 characters",
       {{"curve_server_key", short_key}},
       false,
       {"curve_server_key", short_key}},
      {"a sender's secret key outside Z85",
       {{"curve_server_key", fleet.public_path}, {"curve_secret_key", not_z85}},
       false,
       {"curve_secret_key", not_z85}},
      {"a relay whose server key is not its own public key",
       {{"curve_secret_key", fleet.secret_path}, {"curve_server_key", other.public_path}},
       true,
       {"curve_server_key", other.public_path, fleet.secret_path}},
      {"a bad authorized key on line 3",
       {{"curve_secret_key", fleet.secret_path}, {"curve_authorized_keys", bad_line}},
       true,
       {"curve_authorized_keys", bad_line, "line 3"}},
      {"an authorized keys file others may write",
       {{"curve_secret_key", fleet.secret_path}, {"curve_authorized_keys", writable}},
       true,
       {"curve_authorized_keys", writable, "chmod go-w"}},
      {"a relay with a server key and no secret key",
       {{"curve_server_key", fleet.public_path}},
       true,
       {"curve_secret_key"}},
      {"a sender with a secret key and no server key",
       {{"curve_secret_key", fleet.secret_path}},
       false,
       {"curve_server_key"}},
  };
  const Step step = EncodeStep(1, 0);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_OK_AND_ASSIGN(auto transport, MakeZmq(c.params));
    const Status status =
        c.listener
            ? transport->MakeListener(ListenerContext{testing::FreeLoopbackEndpoint(), {}}, sink)
                  .status()
            : transport
                  ->MakeSender(SenderContext{step.plan.transfer_id,
                                             0,
                                             step.plan.base_version,
                                             step.plan.target_version,
                                             {testing::FreeLoopbackEndpoint()}})
                  .status();
    EXPECT_STATUS(InvalidArgument, status);
    for (const std::string& part : c.message_parts) {
      EXPECT_NE(status.message().find(part), std::string::npos)
          << "'" << status.message() << "' lacks '" << part << "'";
    }
    // A key's text never appears in a message.
    EXPECT_EQ(status.message().find(secret_text), std::string::npos) << status.ToString();
  }

  // What the URI alone shows wrong is refused by the factory.
  EXPECT_STATUS_MSG(InvalidArgument, "curve_secret_key",
                    MakeZmq({{"curve_authorized_keys", writable}}).status());
  EXPECT_STATUS_MSG(InvalidArgument, "curve_server_key",
                    MakeZmq({{"curve_server_key", ""}}).status());
}

TEST_F(ZmqTransportTest, AnUnauthenticatedRequestIsRefusedBeforeItsPayloadIsRead) {
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  KeyedRelay keyed = MakeKeyedRelay(endpoint);
  ASSERT_NE(keyed.receiver.listener, nullptr);
  Receiver& receiver = keyed.receiver;
  const std::string& payload0 = keyed.payload0;
  // Past the handshake (PLAIN with the key): the key in each request is checked as well.
  testing::RawZmqClient client(endpoint, internal::zmq::PlainPassword("open sesame"));
  const auto expect_nack = [&](const std::vector<std::string>& request, StatusCode code,
                               const std::string& what) {
    SCOPED_TRACE(what);
    client.Send(request);
    const std::vector<std::string> reply = client.Receive(kReplyWaitMs);
    ASSERT_EQ(reply.size(), 7u);
    EXPECT_EQ(reply[1], "NACK");
    EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(code))) << reply[6];
    // Nothing of the request was read, so the refusal names no ids.
    EXPECT_EQ(reply[2] + reply[3] + reply[4], "");
  };
  // Without the key (or with a wrong one) the answer is PermissionDenied, whatever the payload
  // or FLUSH holds: no header or frame diagnostics for an unauthenticated client.
  expect_nack({"refit-zmq/2", "DATA", "", U32(0), "not a payload at all"},
              StatusCode::kPermissionDenied, "garbage without the key");
  expect_nack({"refit-zmq/2", "DATA", "open sesamE", U32(0), payload0},
              StatusCode::kPermissionDenied, "a payload with a wrong key");
  expect_nack({"refit-zmq/2", "FLUSH", "", U32(0), "short", U32(0), U32(1)},
              StatusCode::kPermissionDenied, "a malformed FLUSH without the key");
  // With the key, the payload header comes next (its transfer's tree bounds the root index).
  expect_nack({"refit-zmq/2", "DATA", "open sesame", U32(0), "not a payload at all"},
              StatusCode::kDataLoss, "garbage with the key");
  EXPECT_EQ(receiver.listener->stats().delivered, 0u);
  EXPECT_EQ(receiver.session->GetStatus().staged_payloads, 0u);
}

TEST(ZmqPlainTest, ThePlainPasswordIsTheHexSha256OfTheApiKey) {
  // docs/protocol.md: PLAIN user "refit", password = lowercase hex SHA-256 of the api key
  // (`python3 -c "import hashlib; print(hashlib.sha256(b'open sesame').hexdigest())"`).
  EXPECT_EQ(internal::zmq::PlainPassword("open sesame"),
            "41ef4bb0b23661e66301aac36066912dac037827b4ae63a7b1165a5aa93ed4eb");
  // Keys longer than PLAIN's 255-byte password still fit.
  EXPECT_EQ(internal::zmq::PlainPassword(std::string(1024, 'k')).size(), 64u);
}

TEST_F(ZmqTransportTest, AKeyedRelayRefusesClientsWithoutTheKeyInTheHandshake) {
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  KeyedRelay keyed = MakeKeyedRelay(endpoint);
  ASSERT_NE(keyed.receiver.listener, nullptr);
  Receiver& receiver = keyed.receiver;
  const std::string& payload0 = keyed.payload0;
  const std::vector<std::string> request{"refit-zmq/2", "DATA", "open sesame", U32(0), payload0};
  uint64_t refusals = 0;
  for (const std::string& password :
       {internal::zmq::PlainPassword("open sesamE"), std::string("open sesame"), std::string()}) {
    SCOPED_TRACE(password.empty() ? "NULL mechanism" : "PLAIN password " + password);
    testing::RawZmqClient client(endpoint, password);
    // Taken into a pending connection, or not at all once the refused one is gone.
    (void)client.TrySend(request, kSilenceWaitMs);
    if (!password.empty()) {
      // The ZAP handler records each refusal; wait for this one.
      ++refusals;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (receiver.listener->stats().failures < refusals &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_EQ(receiver.listener->stats().failures, refusals);
    }
    // Even a request carrying the right key in its frames never arrives.
    EXPECT_TRUE(client.Receive(kSilenceWaitMs).empty());
  }
  EXPECT_EQ(receiver.listener->stats().delivered, 0u);
  EXPECT_EQ(receiver.session->GetStatus().staged_payloads, 0u);
  EXPECT_STATUS_MSG(PermissionDenied, "wrong api key in the handshake",
                    receiver.listener->stats().last_error);
  // The right password gets the same request through.
  testing::RawZmqClient client(endpoint, internal::zmq::PlainPassword("open sesame"));
  client.Send(request);
  const std::vector<std::string> reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "ACK") << reply[6];
  EXPECT_EQ(receiver.listener->stats().delivered, 1u);
}

TEST_F(ZmqTransportTest, ARefusalMadeBeforeTheIdsAreReadReachesTheSender) {
  // Two attempts of 2 s everywhere: a refusal the sender could not match would end as
  // DeadlineExceeded instead.
  const std::string uri = "zmq://?timeout_ms=2000&retries=1";
  // Tensor t is payload 0 of producer t: producer 1's root is relay 1, producer 0's relay 0.
  const Step step = EncodeStep(1, 0, /*producer_per_tensor=*/true);
  ASSERT_GE(step.payloads.size(), 2u);
  size_t smallest = step.payloads[0].size();
  for (const auto& payload : step.payloads) smallest = std::min(smallest, payload.size());
  // Relay 1 takes less than every payload; the frame still fits ZeroMQ's limit (limit + slack),
  // so the refusal is the header check's, with a reply.
  TransportOptions cramped_options;
  cramped_options.limits.max_payload_bytes = smallest - 1;
  ASSERT_OK_AND_ASSIGN(auto roomy, MakeTransport(uri));
  ASSERT_OK_AND_ASSIGN(auto cramped, MakeTransport(uri, cramped_options));
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(2);
  Receiver relay0 = MakeReceiver(endpoints[0], endpoints, roomy.get());
  Receiver relay1 = MakeReceiver(endpoints[1], endpoints, cramped.get());
  ASSERT_NE(relay0.listener, nullptr);
  ASSERT_NE(relay1.listener, nullptr);
  Prepare(relay0, step);
  Prepare(relay1, step);
  // Producer 1 sends straight to relay 1; producer 0's root relay forwards to relay 1 and
  // passes its refusal up.
  for (const uint32_t producer : {1u, 0u}) {
    SCOPED_TRACE(fmt::format("producer {}", producer));
    ASSERT_OK_AND_ASSIGN(auto sender, roomy->MakeSender(SenderContext{
                                          step.plan.transfer_id, producer, step.plan.base_version,
                                          step.plan.target_version, endpoints}));
    const Status refused = sender->Send(0, step.payloads[producer]);
    EXPECT_STATUS_MSG(ResourceExhausted, endpoints[1], refused);
    // The first attempt's answer, not the retries' end.
    EXPECT_EQ(refused.message().find("attempts"), std::string::npos) << refused.ToString();
  }
  EXPECT_EQ(relay1.listener->stats().delivered, 0u);
  EXPECT_EQ(relay1.session->GetStatus().staged_payloads, 0u);
}

TEST_F(ZmqTransportTest, ARetryAfterAFailedForwardReachesTheChildThatWasSilent) {
  // Relays give up on a silent child after one attempt of 300 ms.
  ASSERT_OK_AND_ASSIGN(auto impatient, MakeTransport("zmq://?timeout_ms=300&retries=0"));
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(2);
  const Step step = EncodeStep(1, 0);
  Receiver root = MakeReceiver(endpoints[0], endpoints, impatient.get());
  ASSERT_NE(root.listener, nullptr);
  Prepare(root, step);
  auto sender = SenderFor(step, endpoints);
  ASSERT_NE(sender, nullptr);
  // Producer 0's root is relay 0, whose child, relay 1, accepts connections but never answers
  // (a stalled process: not gone, so not routed around): the forward fails, and with it the
  // Send, although the root staged the payload.
  {
    const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(silent, 0);
    const int yes = 1;
    ::setsockopt(silent, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port =
        htons(static_cast<uint16_t>(std::stoi(endpoints[1].substr(endpoints[1].rfind(':') + 1))));
    ASSERT_EQ(::bind(silent, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
    ASSERT_EQ(::listen(silent, 16), 0);
    EXPECT_STATUS(DeadlineExceeded, sender->Send(0, step.payloads[0]));
    ::close(silent);
  }
  EXPECT_EQ(root.listener->stats().delivered, 1u);

  Receiver child = MakeReceiver(endpoints[1], endpoints, impatient.get());
  ASSERT_NE(child.listener, nullptr);
  Prepare(child, step);
  // The retry is a duplicate at the root, whose subtree never ACKed the payload: it is forwarded
  // again, and ACKed once the child staged it.
  ASSERT_OK(sender->Send(0, step.payloads[0]));
  EXPECT_EQ(root.listener->stats().duplicates, 1u);
  ASSERT_EQ(child.listener->stats().delivered, 1u);
  ASSERT_EQ(child.session->GetStatus().staged_payloads, 1u);
  // Once the subtree ACKed, a copy is ACKed at the root without reaching the child.
  ASSERT_OK(sender->Send(0, step.payloads[0]));
  EXPECT_EQ(root.listener->stats().duplicates, 2u);
  EXPECT_EQ(child.listener->stats().delivered, 1u);
  EXPECT_EQ(child.listener->stats().duplicates, 0u);

  for (uint32_t id = 1; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  ASSERT_OK(sender->Finish(step.payloads.size()));
  ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(root, step));
  ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(child, step));
}

// A sink that holds every delivery until Open(), so that a test can keep a forward in flight.
class GatedSink final : public PayloadSink {
 public:
  explicit GatedSink(PayloadSink& inner) : inner_(inner) {}

  Result<StageResult> Deliver(ValidatedPayload payload, std::stop_token stop) override {
    {
      std::unique_lock lock(mutex_);
      ++entered_;
      changed_.notify_all();
      if (!changed_.wait(lock, stop, [&] { return open_; })) return Cancelled("gate stopped");
    }
    return inner_.Deliver(std::move(payload), stop);
  }
  Status EndOfStream(const StreamEnd& end) override { return inner_.EndOfStream(end); }
  bool IsTransferOpen(const TransferId& id) const override { return inner_.IsTransferOpen(id); }

  // Whether `n` deliveries reached the gate within `wait_ms`.
  bool WaitEntered(size_t n, int wait_ms) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, std::chrono::milliseconds(wait_ms),
                             [&] { return entered_ >= n; });
  }

  void Open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  PayloadSink& inner_;
  std::mutex mutex_;
  std::condition_variable_any changed_;
  size_t entered_ = 0;
  bool open_ = false;
};

TEST_F(ZmqTransportTest, ADuplicateOfAPayloadBeingForwardedWaitsForTheSubtree) {
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(2);
  const Step step = EncodeStep(1, 0);
  Receiver root = MakeReceiver(endpoints[0], endpoints);
  ASSERT_NE(root.listener, nullptr);
  // The child relay stages behind a gate. (Declared in this order so that its listener stops
  // before the gate and the session go.)
  Receiver child = MakeSession();
  ASSERT_NE(child.session, nullptr);
  GatedSink gate(*child.session);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Listener> child_listener,
                       transport_->MakeListener(ListenerContext{endpoints[1], endpoints}, gate));
  ASSERT_OK(child_listener->Start());
  Prepare(root, step);
  Prepare(child, step);

  auto first = SenderFor(step, endpoints);
  auto second = SenderFor(step, endpoints);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  const auto send_on_own_thread = [&](TransportSender& sender) {
    return std::async(std::launch::async, [&] {
      Status sent = sender.Send(0, step.payloads[0]);
      sender.CleanupThread();
      return sent;
    });
  };
  std::future<Status> first_sent = send_on_own_thread(*first);
  // The root staged the payload and forwards it; the child holds it.
  ASSERT_TRUE(gate.WaitEntered(1, kReplyWaitMs));
  std::future<Status> second_sent = send_on_own_thread(*second);
  // The copy reaches the root (a duplicate there), which must not ACK it before the subtree has
  // the payload.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReplyWaitMs);
  while (root.listener->stats().duplicates == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(root.listener->stats().duplicates, 1u);
  EXPECT_EQ(second_sent.wait_for(std::chrono::milliseconds(kSilenceWaitMs)),
            std::future_status::timeout)
      << "the copy was ACKed while the forward of its payload was still in flight";
  gate.Open();
  EXPECT_OK(first_sent.get());
  EXPECT_OK(second_sent.get());
  // The copy got the forward's verdict without being forwarded itself.
  EXPECT_EQ(child_listener->stats().delivered, 1u);
  EXPECT_EQ(child_listener->stats().duplicates, 0u);
  EXPECT_EQ(child.session->GetStatus().staged_payloads, 1u);

  for (uint32_t id = 1; id < step.payloads.size(); ++id) {
    ASSERT_OK(first->Send(id, step.payloads[id]));
  }
  ASSERT_OK(first->Finish(step.payloads.size()));
  ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(root, step));
  ASSERT_NO_FATAL_FAILURE(FlushCommitAndCheck(child, step));
}

TEST_F(ZmqTransportTest, AStreamEndOfATransferNotOpenIsRefusedAndSealsNothing) {
  std::vector<std::string> endpoints;
  std::vector<Receiver> relays = MakeRelays(3, endpoints);
  for (const Receiver& relay : relays) ASSERT_NE(relay.listener, nullptr);
  const Step step = EncodeStep(1, 0);
  // The coordinator prepares every receiver before any producer streams: a stream end before
  // Prepare is refused, and neither seals the stream nor is recorded.
  auto early = SenderFor(step, endpoints);
  ASSERT_NE(early, nullptr);
  EXPECT_STATUS_MSG(FailedPrecondition, "does not have open", early->Finish(step.payloads.size()));
  for (const Receiver& relay : relays) {
    EXPECT_EQ(relay.listener->stats().streams_ended, 0u);
    EXPECT_TRUE(relay.session->DeclaredPayloads(step.plan.transfer_id).empty());
  }
  // Once prepared, the same stream flows and ends.
  ASSERT_NO_FATAL_FAILURE(RunStep(relays, endpoints, step));
  // Committed, the transfer is no longer open: a late stream end is refused as well.
  auto late = SenderFor(step, endpoints);
  ASSERT_NE(late, nullptr);
  EXPECT_STATUS(FailedPrecondition, late->Finish(step.payloads.size()));
}

TEST_F(ZmqTransportTest, ARelayTakesStreamsOfAtMost65536ProducersPerTransfer) {
  // kMaxStreamsPerTransfer of src/transport/zmq/zmq_relay.cc.
  constexpr uint32_t kMaxProducers = 1u << 16;
  // Requests in flight at once: well below ZeroMQ's default high-water mark (1000 messages),
  // beyond which a ROUTER drops replies.
  constexpr uint32_t kBatch = 500;
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  Receiver receiver = MakeReceiver(endpoint, {});
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1, 0);
  Prepare(receiver, step);
  const auto& id = step.plan.transfer_id.bytes;
  const std::string transfer(reinterpret_cast<const char*>(id.data()), id.size());
  const auto flush = [&](uint32_t producer) {
    return std::vector<std::string>{"refit-zmq/2", "FLUSH",       "",    U32(0),
                                    transfer,      U32(producer), U32(0)};
  };
  testing::RawZmqClient client(endpoint);
  uint32_t acked = 0;
  for (uint32_t first = 0; first < kMaxProducers; first += kBatch) {
    const uint32_t end = std::min(first + kBatch, kMaxProducers);
    for (uint32_t producer = first; producer < end; ++producer) client.Send(flush(producer));
    for (uint32_t producer = first; producer < end; ++producer) {
      const std::vector<std::string> reply = client.Receive(kReplyWaitMs);
      ASSERT_EQ(reply.size(), 7u);
      acked += reply[1] == "ACK" ? 1 : 0;
    }
  }
  EXPECT_EQ(acked, kMaxProducers);

  // One producer more: its stream end, and a payload of another new one, are refused before
  // the sink sees them.
  client.Send(flush(kMaxProducers));
  std::vector<std::string> reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(StatusCode::kResourceExhausted))) << reply[6];
  ASSERT_OK_AND_ASSIGN(const std::vector<std::byte> newcomer,
                       EncodePayload(PayloadIds{step.plan.transfer_id, kMaxProducers + 1, 0,
                                                step.plan.base_version, step.plan.target_version},
                                     {}));
  client.Send({"refit-zmq/2", "DATA", "", U32(0),
               std::string(reinterpret_cast<const char*>(newcomer.data()), newcomer.size())});
  reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "NACK");
  EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(StatusCode::kResourceExhausted))) << reply[6];
  // A producer the relay knows may still repeat its stream end.
  client.Send(flush(7));
  reply = client.Receive(kReplyWaitMs);
  ASSERT_EQ(reply.size(), 7u);
  EXPECT_EQ(reply[1], "ACK") << reply[6];
  EXPECT_EQ(receiver.session->DeclaredPayloads(step.plan.transfer_id).size(), kMaxProducers);
  EXPECT_EQ(receiver.session->GetStatus().staged_payloads, 0u);
}

TEST_F(ZmqTransportTest, ARelayBoundOnEveryInterfaceIsReachedAtItsAdvertisedEndpoint) {
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(2);
  std::vector<Receiver> relays;
  relays.push_back(MakeReceiver(endpoints[0], endpoints, nullptr, "0.0.0.0"));
  relays.push_back(MakeReceiver(endpoints[1], endpoints));
  for (const Receiver& relay : relays) ASSERT_NE(relay.listener, nullptr);
  EXPECT_EQ(relays[0].listener->endpoint(), endpoints[0]);
  // Producer 1's root, relay 1, forwards to relay 0 at its advertised endpoint.
  ASSERT_NO_FATAL_FAILURE(RunStep(relays, endpoints, EncodeStep(1, 1)));
  // Relay 0 listens on every interface: 127.0.0.2 (loopback too, on Linux) reaches it, where a
  // bind of 127.0.0.1 would refuse the connection; it forwards to relay 1.
  const std::string port = endpoints[0].substr(endpoints[0].rfind(':'));
  ASSERT_NO_FATAL_FAILURE(RunStep(relays, {"127.0.0.2" + port}, EncodeStep(2, 0)));
  for (const Receiver& relay : relays) {
    EXPECT_EQ(relay.listener->stats().streams_ended, 2u);
    EXPECT_EQ(relay.listener->stats().failures, 0u)
        << relay.listener->stats().last_error.ToString();
  }
}

TEST_F(ZmqTransportTest, PortZeroBindsAPortTheKernelChoosesAndTheEndpointNamesIt) {
  // Two relays on port 0, on every interface and on loopback: each endpoint names the bound
  // port (no probe-then-bind), and a transfer whose tree names them reaches both.
  std::vector<Receiver> relays;
  relays.push_back(MakeReceiver("127.0.0.1:0", {}, nullptr, "0.0.0.0"));
  relays.push_back(MakeReceiver("127.0.0.1:0", {}));
  std::vector<std::string> endpoints;
  for (const Receiver& relay : relays) {
    ASSERT_NE(relay.listener, nullptr);
    endpoints.push_back(relay.listener->endpoint());
    EXPECT_TRUE(endpoints.back().starts_with("127.0.0.1:")) << endpoints.back();
    EXPECT_NE(endpoints.back(), "127.0.0.1:0");
  }
  EXPECT_NE(endpoints[0], endpoints[1]);
  const Step step = EncodeStep(1, 0);
  for (size_t i = 0; i < relays.size(); ++i) {
    ASSERT_OK(relays[i].listener->RouteTransfer(step.plan.transfer_id,
                                                RelayTree{endpoints, static_cast<uint32_t>(i)}));
  }
  ASSERT_NO_FATAL_FAILURE(RunStep(relays, endpoints, step));
  // Port 0 cannot be named among static peers: nobody could reach it by that name.
  Receiver unused = MakeSession();
  EXPECT_STATUS_MSG(
      InvalidArgument, "port 0",
      transport_->MakeListener({"127.0.0.1:0", {"127.0.0.1:0", endpoints[0]}}, *unused.session)
          .status());
}

TEST_F(ZmqTransportTest, BindAddressesAreCheckedAndOnlyZmqTakesOne) {
  RefusingSink sink;
  for (const std::string bad : {"0.0.0.0:5555", "every interface", "host/24", "[::]"}) {
    SCOPED_TRACE(bad);
    EXPECT_STATUS_MSG(
        InvalidArgument, "bind address",
        transport_->MakeListener(ListenerContext{testing::FreeLoopbackEndpoint(), {}, bad}, sink)
            .status());
  }
  ASSERT_OK_AND_ASSIGN(auto inproc, MakeTransport("inproc://zmq-bind-test"));
  EXPECT_STATUS_MSG(InvalidArgument, "bind address",
                    inproc->MakeListener(ListenerContext{"r0", {}, "0.0.0.0"}, sink).status());
  ASSERT_OK_AND_ASSIGN(auto file, MakeTransport("file://" + ::testing::TempDir()));
  EXPECT_STATUS_MSG(InvalidArgument, "bind address",
                    file->MakeListener(ListenerContext{"", {}, "0.0.0.0"}, sink).status());
}

}  // namespace
}  // namespace refit
