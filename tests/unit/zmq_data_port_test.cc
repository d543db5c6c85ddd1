// zmq:// — what a relay's data port allocates for what it receives: nothing for a client it
// refuses in the handshake (no api key, a wrong one), nothing for a request it refuses before the
// payload (a wrong key in the request), nothing for a frame over the payload limit, and
// one copy of an accepted payload per relay it crosses (the copy its receiver keeps; children are
// sent the frame ZeroMQ received, not a copy).
//
// The relays run in this process, so replacing the global operator new shows every allocation
// the relay code makes (libzmq allocates message bodies with malloc, which is not counted: those
// are the bytes ZeroMQ itself buffers, bounded by ZMQ_MAXMSGSIZE and ZMQ_RCVHWM). That is why
// these tests have a binary of their own.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "codec/tracker.h"
#include "loopback.h"
#include "receiver/receiver_session.h"
#include "refit/transport.h"
#include "refit/weight_store.h"
#include "test_data.h"
#include "test_util.h"
#include "transport/zmq/zmq_frames.h"
#include "transport/zmq/zmq_zap.h"
#include "zmq_raw_client.h"

namespace {

// Allocation tracking, on while `g_tracking` is set: the largest request, and how many requests
// fell inside [g_window_low, g_window_high].
std::atomic<bool> g_tracking{false};
std::atomic<size_t> g_largest{0};
std::atomic<size_t> g_window_low{0};
std::atomic<size_t> g_window_high{0};
std::atomic<int> g_in_window{0};

void* TrackedAllocate(size_t size) {
  if (g_tracking.load(std::memory_order_relaxed)) {
    size_t largest = g_largest.load(std::memory_order_relaxed);
    while (size > largest && !g_largest.compare_exchange_weak(largest, size)) {
    }
    if (size >= g_window_low.load() && size <= g_window_high.load()) ++g_in_window;
  }
  void* memory = std::malloc(size == 0 ? 1 : size);
  if (memory == nullptr) throw std::bad_alloc();
  return memory;
}

}  // namespace

void* operator new(size_t size) { return TrackedAllocate(size); }
void* operator new[](size_t size) { return TrackedAllocate(size); }
void operator delete(void* memory) noexcept { std::free(memory); }
void operator delete[](void* memory) noexcept { std::free(memory); }
void operator delete(void* memory, size_t) noexcept { std::free(memory); }
void operator delete[](void* memory, size_t) noexcept { std::free(memory); }

namespace refit {
namespace {

// How long a raw client waits for a reply that must come, and for one that must not.
constexpr int kReplyWaitMs = 20'000;
constexpr int kSilenceWaitMs = 300;
// A payload frame far larger than anything a refused request may make the relay allocate.
constexpr size_t kLargeFrameBytes = size_t{8} << 20;
// What the relay may allocate for a refused request: its small frames, replies, messages.
constexpr size_t kSmallAllocationBytes = size_t{64} << 10;
// A copy of a payload is an allocation of its size, plus what a std::string adds (the NUL).
constexpr size_t kCopySlackBytes = 64;

// A DATA request of `payload` (refit-zmq/2): its head frames, then its parts of at most
// kMaxFrameBytes.
std::vector<std::string> DataRequest(const std::string& key, const std::string& payload) {
  std::vector<std::string> request{"refit-zmq/2", "DATA", key, std::string(4, '\0')};
  for (size_t offset = 0; offset < payload.size(); offset += internal::zmq::kMaxFrameBytes) {
    request.push_back(payload.substr(offset, internal::zmq::kMaxFrameBytes));
  }
  return request;
}

std::string U32(uint32_t value) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

// Tracks allocations for its lifetime; copies of `bytes` bytes are counted.
class AllocationWatch {
 public:
  explicit AllocationWatch(size_t bytes = SIZE_MAX - kCopySlackBytes) {
    g_largest = 0;
    g_in_window = 0;
    g_window_low = bytes;
    g_window_high = bytes + kCopySlackBytes;
    g_tracking = true;
  }
  ~AllocationWatch() { g_tracking = false; }

  size_t largest() const { return g_largest.load(); }
  int copies() const { return g_in_window.load(); }
};

struct Receiver {
  std::unique_ptr<WeightStore> store;
  std::unique_ptr<internal::ReceiverSession> session;
  std::unique_ptr<Listener> listener;
};

class ZmqDataPortTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 2 MiB of float32: payloads large enough that a copy of one stands out.
    model_ = testing::RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {512, 1024}, 7);
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    ASSERT_OK(tracker_->AdoptBaseline(model_.view()));
  }

  Receiver MakeReceiver(Transport& transport, const std::string& endpoint,
                        const std::vector<std::string>& peers) {
    Receiver receiver;
    receiver.store = WeightStore::Make();
    EXPECT_OK(receiver.store->AddCopy(model_.view()));
    auto session = internal::ReceiverSession::Make({}, *receiver.store);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    if (!session.ok()) return receiver;
    receiver.session = std::move(session).ValueOrDie();
    auto listener = transport.MakeListener(ListenerContext{endpoint, peers, ""}, *receiver.session);
    EXPECT_TRUE(listener.ok()) << listener.status().ToString();
    if (!listener.ok()) return receiver;
    receiver.listener = std::move(listener).ValueOrDie();
    EXPECT_OK(receiver.listener->Start());
    return receiver;
  }

  // One payload of a step that changes every element, and its transfer's plan.
  std::vector<std::byte> EncodePayload(TransferPlan& plan) {
    auto begun = tracker_->Begin(TransferId::Random());
    EXPECT_TRUE(begun.ok()) << begun.status().ToString();
    if (!begun.ok()) return {};
    plan = *begun;
    const OwnedTensor next = testing::Perturb(model_, 1.0, 11);
    auto encoded = tracker_->Encode(plan.transfer_id, next.view());
    EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
    if (!encoded.ok()) return {};
    std::vector<ItemView> views;
    for (const Item& item : encoded->items) views.push_back(item.view());
    auto payload = refit::EncodePayload(
        PayloadIds{plan.transfer_id, 0, 0, plan.base_version, plan.target_version}, views);
    EXPECT_TRUE(payload.ok()) << payload.status().ToString();
    return payload.ok() ? std::move(payload).ValueOrDie() : std::vector<std::byte>{};
  }

  static void Prepare(Receiver& receiver, const TransferPlan& plan) {
    ASSERT_OK(receiver.session->Prepare(PrepareRequest{plan.transfer_id, plan.base_version, {}})
                  .status());
  }

  OwnedTensor model_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
};

TEST_F(ZmqDataPortTest, AClientWithoutTheKeyGetsNoMessageIntoAKeyedRelay) {
  ASSERT_OK_AND_ASSIGN(auto keyed, MakeTransport("zmq://?api_key=open%20sesame"));
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  Receiver receiver = MakeReceiver(*keyed, endpoint, {});
  ASSERT_NE(receiver.listener, nullptr);
  const std::string large(kLargeFrameBytes, 'x');
  for (const std::string& password : {internal::zmq::PlainPassword("open sesamE"), std::string()}) {
    SCOPED_TRACE(password.empty() ? "no key" : "a wrong key");
    testing::RawZmqClient client(endpoint, password);
    const std::vector<std::string> request = DataRequest("open sesame", large);
    AllocationWatch watch;
    // Taken into a pending connection, or not at all once the refused one is gone.
    (void)client.TrySend(request, kSilenceWaitMs);
    // The handshake is refused (a wrong PLAIN password, or no PLAIN at all): the request never
    // leaves the client, so there is no reply and nothing to copy.
    EXPECT_TRUE(client.Receive(kSilenceWaitMs).empty());
    EXPECT_LT(watch.largest(), kSmallAllocationBytes);
  }
  EXPECT_EQ(receiver.listener->stats().delivered, 0u);
  EXPECT_GE(receiver.listener->stats().failures, 1u);
}

TEST_F(ZmqDataPortTest, ARequestWithAWrongKeyIsRefusedWithoutCopyingItsPayload) {
  ASSERT_OK_AND_ASSIGN(auto keyed, MakeTransport("zmq://?api_key=open%20sesame"));
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  Receiver receiver = MakeReceiver(*keyed, endpoint, {});
  ASSERT_NE(receiver.listener, nullptr);
  // Past the handshake with the key; the key in each request is checked as well.
  testing::RawZmqClient client(endpoint, internal::zmq::PlainPassword("open sesame"));
  // Connected and answered once, so the watch below sees only the large request.
  client.Send({"refit-zmq/2", "DATA", "open sesamE", U32(0), "x"});
  ASSERT_EQ(client.Receive(kReplyWaitMs).size(), 7u);

  const std::string large(kLargeFrameBytes, 'x');
  size_t largest = 0;
  for (const std::string& key : {std::string("open sesamE"), std::string()}) {
    SCOPED_TRACE(key.empty() ? "no key" : "a wrong key");
    // Built before the watch: the test's own copy of the frame is not the relay's.
    const std::vector<std::string> request = DataRequest(key, large);
    AllocationWatch watch;
    client.Send(request);
    const std::vector<std::string> reply = client.Receive(kReplyWaitMs);
    largest = std::max(largest, watch.largest());
    ASSERT_EQ(reply.size(), 7u);
    EXPECT_EQ(reply[1], "NACK");
    EXPECT_EQ(reply[5], U32(static_cast<uint32_t>(StatusCode::kPermissionDenied)));
  }
  // The relay looked at the key and the root frames only: the 8 MiB payload was never copied.
  EXPECT_LT(largest, kSmallAllocationBytes);
  EXPECT_EQ(receiver.listener->stats().delivered, 0u);
}

TEST_F(ZmqDataPortTest, AFrameOverThePayloadLimitIsDroppedWithoutTheRelayAllocatingIt) {
  TransportOptions options;
  options.limits.max_payload_bytes = kSmallAllocationBytes;
  ASSERT_OK_AND_ASSIGN(auto limited, MakeTransport("zmq://", options));
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  Receiver receiver = MakeReceiver(*limited, endpoint, {});
  ASSERT_NE(receiver.listener, nullptr);
  const std::vector<std::string> request{"refit-zmq/2", "DATA", "", U32(0),
                                         std::string(kLargeFrameBytes, 'x')};
  size_t largest = 0;
  {
    testing::RawZmqClient client(endpoint);
    AllocationWatch watch;
    client.Send(request);
    // ZeroMQ refuses the frame (ZMQ_MAXMSGSIZE) and drops the connection: no reply.
    EXPECT_TRUE(client.Receive(kSilenceWaitMs).empty());
    largest = watch.largest();
  }
  EXPECT_LT(largest, kSmallAllocationBytes);
  EXPECT_EQ(receiver.listener->stats().delivered, 0u);
}

TEST_F(ZmqDataPortTest, APayloadIsCopiedOncePerRelayOnItsWayDownTheTree) {
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport("zmq://"));
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(2);
  // Producer 0's root is relay 0, which forwards to relay 1.
  Receiver root = MakeReceiver(*transport, endpoints[0], endpoints);
  Receiver child = MakeReceiver(*transport, endpoints[1], endpoints);
  ASSERT_NE(root.listener, nullptr);
  ASSERT_NE(child.listener, nullptr);
  TransferPlan plan;
  const std::vector<std::byte> payload = EncodePayload(plan);
  ASSERT_GT(payload.size(), kSmallAllocationBytes);
  Prepare(root, plan);
  Prepare(child, plan);
  ASSERT_OK_AND_ASSIGN(auto sender,
                       transport->MakeSender(SenderContext{plan.transfer_id, 0, plan.base_version,
                                                           plan.target_version, endpoints}));
  int copies = 0;
  {
    AllocationWatch watch(payload.size());
    ASSERT_OK(sender->Send(0, payload));
    copies = watch.copies();
  }
  // ACK means staged on both relays; each session holds the one copy made for it, and the root
  // forwarded the frame it received.
  EXPECT_EQ(root.listener->stats().delivered, 1u);
  EXPECT_EQ(child.listener->stats().delivered, 1u);
  EXPECT_EQ(copies, 2) << "allocations of the payload's size (" << payload.size()
                       << " bytes) while it crossed 2 relays";
  sender->CleanupThread();
}

}  // namespace
}  // namespace refit
