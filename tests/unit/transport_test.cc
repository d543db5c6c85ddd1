#include "refit/transport.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "codec/tracker.h"
#include "pipeline/producer_stream.h"
#include "receiver/receiver_session.h"
#include "refit/status_format.h"
#include "refit/weight_store.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

// A flush timeout no correct run reaches, even on a loaded 2-core machine.
constexpr auto kGenerousTimeout = std::chrono::seconds(60);
// Fraction of elements each training step changes.
constexpr double kDensity = 0.05;

// Each test uses its own hub, so that endpoints of one test never meet another's.
std::string UniqueHub() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return fmt::format("{}-{}", info->test_suite_name(), info->name());
}

std::unique_ptr<Transport> Make(const std::string& uri) {
  auto transport = MakeTransport(uri);
  EXPECT_TRUE(transport.ok()) << uri << ": " << transport.status().ToString();
  return transport.ok() ? std::move(transport).ValueOrDie() : nullptr;
}

// ---------------------------------------------------------------------------------------------
// URIs

TEST(TransportUriTest, ParsesSchemeTargetAndDecodedParameters) {
  ASSERT_OK_AND_ASSIGN(TransportUri uri,
                       TransportUri::Parse("Fault+Inproc://hub-1?seed=7&drop=0.5&note=a%20b%26c"));
  EXPECT_EQ(uri.scheme, "fault+inproc");
  EXPECT_EQ(uri.target, "hub-1");
  const std::vector<std::pair<std::string, std::string>> params = {
      {"seed", "7"}, {"drop", "0.5"}, {"note", "a b&c"}};
  EXPECT_EQ(uri.params, params);
  ASSERT_NE(uri.Param("note"), nullptr);
  EXPECT_EQ(*uri.Param("note"), "a b&c");
  EXPECT_EQ(uri.Param("absent"), nullptr);

  ASSERT_OK_AND_ASSIGN(TransportUri file, TransportUri::Parse("file:///mnt/drop%2Fa?"));
  EXPECT_EQ(file.target, "/mnt/drop/a");
  EXPECT_TRUE(file.params.empty());
}

TEST(TransportUriTest, ToStringRoundTripsAwkwardCharacters) {
  TransportUri uri;
  uri.scheme = "file";
  uri.target = "/tmp/a b?#%&=";
  uri.params = {{"k&=?", "v?#%&= "}, {"plain", "1"}};
  const std::string text = uri.ToString();
  ASSERT_OK_AND_ASSIGN(TransportUri parsed, TransportUri::Parse(text));
  EXPECT_EQ(parsed, uri) << text;
}

TEST(TransportUriTest, RefusesMalformedUrisNamingThem) {
  for (const std::string text :
       {"inproc:/hub", "://hub", "1nproc://hub", "in_proc://hub", "inproc://hub#frag",
        "inproc://hub?flag", "inproc://hub?=1", "inproc://hub?a=1&a=2", "inproc://hub?a=1&",
        "inproc://hub?a=1&&b=2", "inproc://hub?a=%G1", "inproc://hub?a=%4", "inproc://h%00b"}) {
    EXPECT_STATUS_MSG(InvalidArgument, "'" + text + "'", TransportUri::Parse(text));
    EXPECT_STATUS(InvalidArgument, MakeTransport(text));
  }
}

// ---------------------------------------------------------------------------------------------
// Registry and capabilities

TEST(TransportRegistryTest, BuiltinsAreRegistered) {
  const std::vector<std::string> schemes = DefaultTransportRegistry().Schemes();
  for (const std::string name : {"file", "inproc", "fault+<scheme>"}) {
    EXPECT_NE(std::find(schemes.begin(), schemes.end(), name), schemes.end()) << name;
  }
  EXPECT_TRUE(std::is_sorted(schemes.begin(), schemes.end()));
}

TEST(TransportRegistryTest, UnknownSchemeListsTheRegisteredOnes) {
  const Status status = MakeTransport("carrier-pigeon://loft").status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  for (const std::string part : {"carrier-pigeon://loft", "file", "inproc", "fault+<scheme>"}) {
    EXPECT_NE(status.message().find(part), std::string::npos) << status.message();
  }
  // A wrapper prefix without a registered inner scheme names the inner one.
  EXPECT_STATUS_MSG(InvalidArgument, "carrier-pigeon", MakeTransport("fault+carrier-pigeon://x"));
  EXPECT_STATUS_MSG(InvalidArgument, "no inner scheme", MakeTransport("fault+://x"));
  // "fault" alone is a prefix, not a scheme.
  EXPECT_STATUS_MSG(InvalidArgument, "unknown scheme", MakeTransport("fault://x"));
}

TEST(TransportRegistryTest, RegistersSchemesAndWrappersOnce) {
  std::atomic<int> calls = 0;
  TransportFactory loopback = [&calls](const TransportUri& uri, const TransportOptions& options) {
    ++calls;
    return MakeTransport(TransportUri{"inproc", uri.target, {}}, options);
  };
  std::unique_ptr<TransportRegistry> registry = TransportRegistry::MakeWithBuiltins();
  ASSERT_OK(registry->Register("Test-Loopback", loopback));  // Case-insensitive.
  ASSERT_OK_AND_ASSIGN(auto transport, registry->Make("test-loopback://hub"));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(transport->uri().scheme, "inproc");
  EXPECT_STATUS(AlreadyExists, registry->Register("test-loopback", loopback));
  EXPECT_STATUS(AlreadyExists, registry->Register("FILE", loopback));
  EXPECT_STATUS(InvalidArgument, registry->Register("bad scheme", loopback));
  EXPECT_STATUS(InvalidArgument, registry->Register("", loopback));
  EXPECT_STATUS(InvalidArgument, registry->Register("test-null", nullptr));
  const auto schemes = registry->Schemes();
  EXPECT_NE(std::find(schemes.begin(), schemes.end(), "test-loopback"), schemes.end());
  // A registry of its own leaves the default one as it was.
  EXPECT_STATUS_MSG(InvalidArgument, "unknown scheme", MakeTransport("test-loopback://hub"));

  // A wrapper sees the whole URI and makes its inner transport in the registry it was found in.
  TransportFactory passthrough = [&calls](const TransportUri& uri,
                                          const TransportOptions& options) {
    ++calls;
    TransportUri inner = uri;
    inner.scheme = uri.scheme.substr(uri.scheme.find('+') + 1);
    if (options.registry == nullptr)
      return Result<std::unique_ptr<Transport>>(Internal("no registry"));
    return options.registry->Make(inner, options);
  };
  EXPECT_STATUS(InvalidArgument, registry->RegisterWrapper("a+b", passthrough));
  EXPECT_STATUS(AlreadyExists, registry->RegisterWrapper("fault", passthrough));
  ASSERT_OK(registry->RegisterWrapper("test-pass", passthrough));
  ASSERT_OK_AND_ASSIGN(auto wrapped, registry->Make("test-pass+test-loopback://hub"));
  EXPECT_EQ(calls.load(), 3);  // The wrapper, then the loopback it made.
  EXPECT_EQ(wrapped->capabilities(), Make("inproc://x")->capabilities());
  // The built-in fault+ wrapper resolves its inner scheme in the same registry.
  ASSERT_OK(registry->Make("fault+test-loopback://hub?seed=1").status());
  EXPECT_EQ(calls.load(), 4);
}

TEST(TransportRegistryTest, AnEmptyRegistryKnowsNoScheme) {
  TransportRegistry registry;
  EXPECT_TRUE(registry.Schemes().empty());
  EXPECT_STATUS_MSG(InvalidArgument, "unknown scheme 'file'", registry.Make("file:///tmp"));
  ASSERT_OK(
      registry.Register("inproc", [](const TransportUri& uri, const TransportOptions& options) {
        return DefaultTransportRegistry().Make(uri, options);
      }));
  EXPECT_EQ(registry.Schemes(), std::vector<std::string>{"inproc"});
  ASSERT_OK(registry.Make("inproc://hub").status());
}

TEST(TransportRegistryTest, BuiltinsRefuseBadTargetsAndParameters) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"inproc://", "names no hub"},
      {"inproc://a/b", "contains '/'"},
      {"inproc://a%20b", "hub name 'a b'"},
      {"inproc://hub?x=1", "unknown parameter 'x'"},
      {"file://", "names no directory"},
      {"file:///tmp?poll_ms=abc", "poll_ms='abc'"},
      {"file:///tmp?poll_ms=99999999999", "poll_ms='99999999999'"},
      {"file:///tmp?interval=1", "unknown parameter 'interval'"},
      {"fault+inproc://hub?drop=1.5", "drop='1.5'"},
      {"fault+inproc://hub?corrupt=-0.1", "corrupt='-0.1'"},
      {"fault+inproc://hub?duplicate=nan", "duplicate='nan'"},
      {"fault+inproc://hub?drop_mode=sometimes", "drop_mode='sometimes'"},
      {"fault+inproc://hub?delay_ms=600000", "delay_ms='600000'"},
      {"fault+inproc://hub?seed=-1", "seed='-1'"},
      {"fault+inproc://hub?disconnect_after=x", "disconnect_after='x'"},
      // Parameters the wrapper does not know go to the inner transport, which refuses them.
      {"fault+inproc://hub?seed=1&x=2", "unknown parameter 'x' for scheme 'inproc'"},
  };
  for (const auto& [uri, message] : cases) {
    EXPECT_STATUS_MSG(InvalidArgument, message, MakeTransport(uri));
  }
}

TEST(TransportCapabilitiesTest, EachTransportDeclaresItsGuarantees) {
  auto inproc = Make("inproc://hub");
  auto file = Make("file:///tmp/refit-drop");
  ASSERT_NE(inproc, nullptr);
  ASSERT_NE(file, nullptr);
  const TransportCapabilities in = inproc->capabilities();
  EXPECT_TRUE(in.staged_ack);
  EXPECT_TRUE(in.in_process);
  EXPECT_TRUE(in.reports_stream_end);
  EXPECT_FALSE(in.fan_out_tree || in.needs_manifest || in.shared_filesystem || in.encrypted);
  const TransportCapabilities fs = file->capabilities();
  EXPECT_TRUE(fs.shared_filesystem);
  EXPECT_TRUE(fs.reports_stream_end);
  EXPECT_FALSE(fs.staged_ack || fs.fan_out_tree || fs.needs_manifest || fs.encrypted ||
               fs.in_process);
  // The wrapper changes what happens to payloads, not the protocol around them.
  EXPECT_EQ(Make("fault+inproc://hub?drop=0.5")->capabilities(), in);
  EXPECT_EQ(Make("fault+file:///tmp/refit-drop?poll_ms=5")->capabilities(), fs);
  EXPECT_EQ(Make("fault+fault+inproc://hub")->capabilities(), in);
}

// ---------------------------------------------------------------------------------------------
// Fixtures: payloads and sinks

/// A small valid payload of `context`'s transfer: one FULL item over 64 bytes.
std::vector<std::byte> TinyPayload(const SenderContext& context, uint32_t payload_id) {
  constexpr uint64_t kBytes = 64;
  OwnedTensor tensor = RandomTensor(fmt::format("t{}", payload_id), DType::kUInt8,
                                    {static_cast<int64_t>(kBytes)}, payload_id + 1);
  Item item;
  item.name = tensor.name;
  item.dtype = DType::kUInt8;
  item.shape = tensor.shape;
  item.op = Op::kFull;
  item.value_dtype = DType::kUInt8;
  item.span_end = kBytes;
  item.count = kBytes;
  item.location_encoding = LocationEncoding::kAll;
  item.values = tensor.bytes;
  const ItemView view = item.view();
  PayloadIds ids{context.transfer_id, context.producer_id, payload_id, context.base_version,
                 context.target_version};
  auto payload = EncodePayload(ids, std::span(&view, 1));
  EXPECT_TRUE(payload.ok()) << payload.status().ToString();
  return payload.ok() ? std::move(payload).ValueOrDie() : std::vector<std::byte>{};
}

SenderContext ContextFor(std::vector<std::string> endpoints, uint32_t producer_id = 0) {
  return SenderContext{TransferId::Random(), producer_id, 4, 5, std::move(endpoints)};
}

/// Records every delivery; a payload id seen before is reported as a duplicate.
class RecordingSink : public PayloadSink {
 public:
  Result<StageResult> Deliver(ValidatedPayload payload, std::stop_token) override {
    std::lock_guard lock(mutex_);
    const uint32_t id = payload.ids().payload_id;
    const bool duplicate = std::any_of(deliveries_.begin(), deliveries_.end(),
                                       [&](const auto& d) { return d.first == id; });
    deliveries_.emplace_back(
        id, std::vector<std::byte>(payload.bytes().begin(), payload.bytes().end()));
    return duplicate ? StageResult::kDuplicate : StageResult::kAccepted;
  }
  Status EndOfStream(const StreamEnd& end) override {
    std::lock_guard lock(mutex_);
    ends_.push_back(end);
    return Status::OK();
  }
  std::vector<std::pair<uint32_t, std::vector<std::byte>>> deliveries() const {
    std::lock_guard lock(mutex_);
    return deliveries_;
  }
  std::set<uint32_t> ids() const {
    std::set<uint32_t> ids;
    for (const auto& [id, bytes] : deliveries()) ids.insert(id);
    return ids;
  }
  std::vector<StreamEnd> ends() const {
    std::lock_guard lock(mutex_);
    return ends_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<uint32_t, std::vector<std::byte>>> deliveries_;
  std::vector<StreamEnd> ends_;
};

/// Blocks every delivery until the listener cancels it.
class BlockingSink : public PayloadSink {
 public:
  Result<StageResult> Deliver(ValidatedPayload, std::stop_token stop) override {
    {
      std::lock_guard lock(mutex_);
      entered_ = true;
    }
    entered_cv_.notify_all();
    std::mutex wait_mutex;
    std::condition_variable_any never;
    std::unique_lock wait_lock(wait_mutex);
    never.wait(wait_lock, stop, [] { return false; });
    return Cancelled("delivery stopped");
  }
  void WaitUntilEntered() {
    std::unique_lock lock(mutex_);
    entered_cv_.wait(lock, [this] { return entered_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable entered_cv_;
  bool entered_ = false;
};

std::unique_ptr<Listener> StartListener(Transport& transport, const std::string& endpoint,
                                        PayloadSink& sink) {
  auto listener = transport.MakeListener(ListenerContext{endpoint, {}}, sink);
  EXPECT_TRUE(listener.ok()) << listener.status().ToString();
  if (!listener.ok()) return nullptr;
  EXPECT_OK((*listener)->Start());
  return std::move(listener).ValueOrDie();
}

// ---------------------------------------------------------------------------------------------
// Senders and listeners (inproc)

TEST(InprocTransportTest, SenderChecksItsContextAndEveryPayloadHeader) {
  auto transport = Make("inproc://" + UniqueHub());
  ASSERT_NE(transport, nullptr);
  RecordingSink sink;
  auto listener = StartListener(*transport, "r0", sink);
  ASSERT_NE(listener, nullptr);

  EXPECT_STATUS_MSG(InvalidArgument, "no endpoints", transport->MakeSender(ContextFor({})));
  SenderContext backwards = ContextFor({"r0"});
  backwards.target_version = backwards.base_version;
  EXPECT_STATUS(InvalidArgument, transport->MakeSender(backwards));
  EXPECT_STATUS(InvalidArgument, transport->MakeSender(ContextFor({""})));
  EXPECT_STATUS(InvalidArgument, transport->MakeListener(ListenerContext{"r1", {"r0"}}, sink));

  const SenderContext context = ContextFor({"r0"}, /*producer_id=*/2);
  ASSERT_OK_AND_ASSIGN(auto sender, transport->MakeSender(context));
  const std::vector<std::byte> payload = TinyPayload(context, 3);
  // Bytes that are no payload, a payload sent under another id, of another producer or transfer.
  EXPECT_STATUS(DataLoss, sender->Send(3, std::vector<std::byte>(200, std::byte{7})));
  EXPECT_STATUS_MSG(InvalidArgument, "header names payload 3", sender->Send(4, payload));
  SenderContext other = context;
  other.producer_id = 1;
  EXPECT_STATUS(InvalidArgument, sender->Send(3, TinyPayload(other, 3)));
  other = context;
  other.transfer_id = TransferId::Random();
  EXPECT_STATUS(InvalidArgument, sender->Send(3, TinyPayload(other, 3)));
  other = context;
  other.target_version = context.target_version + 1;
  EXPECT_STATUS(InvalidArgument, sender->Send(3, TinyPayload(other, 3)));
  EXPECT_TRUE(sink.deliveries().empty());

  ASSERT_OK(sender->Send(3, payload));
  ASSERT_EQ(sink.deliveries().size(), 1u);
  EXPECT_EQ(sink.deliveries()[0].second, payload);
  // Payload 3 was sent, so the stream has at least 4 payloads.
  EXPECT_STATUS_MSG(InvalidArgument, "payload 3 was sent", sender->Finish(3));
  EXPECT_STATUS(InvalidArgument, sender->Finish(uint64_t{1} << 32));
  ASSERT_OK(sender->Finish(4));
  EXPECT_EQ(sink.ends(), (std::vector<StreamEnd>{{context.transfer_id, 2, 4}}));
  EXPECT_STATUS(FailedPrecondition, sender->Send(3, payload));
  EXPECT_STATUS(FailedPrecondition, sender->Finish(4));
}

TEST(InprocTransportTest, EndpointsBindOnceAndSendsNeedAListener) {
  const std::string hub = UniqueHub();
  auto transport = Make("inproc://" + hub);
  auto same_hub = Make("inproc://" + hub);
  auto other_hub = Make("inproc://" + hub + "-other");
  ASSERT_TRUE(transport && same_hub && other_hub);
  RecordingSink sink;
  const SenderContext context = ContextFor({"r0"});
  const std::vector<std::byte> payload = TinyPayload(context, 0);

  ASSERT_OK_AND_ASSIGN(auto sender, same_hub->MakeSender(context));
  EXPECT_STATUS_MSG(Unavailable, "no listener at endpoint 'r0'", sender->Send(0, payload));

  ASSERT_OK_AND_ASSIGN(auto listener, transport->MakeListener(ListenerContext{"r0", {}}, sink));
  EXPECT_EQ(listener->endpoint(), "r0");
  ASSERT_OK(listener->Start());
  EXPECT_STATUS(FailedPrecondition, listener->Start());
  ASSERT_OK_AND_ASSIGN(auto rival, same_hub->MakeListener(ListenerContext{"r0", {}}, sink));
  EXPECT_STATUS(AlreadyExists, rival->Start());
  // Another hub is another namespace.
  ASSERT_OK_AND_ASSIGN(auto elsewhere, other_hub->MakeListener(ListenerContext{"r0", {}}, sink));
  ASSERT_OK(elsewhere->Start());

  // Two transports made from one URI share the hub.
  ASSERT_OK(sender->Send(0, payload));
  ASSERT_OK(sender->Send(0, payload));
  EXPECT_EQ(sink.deliveries().size(), 2u);
  const ListenerStats stats = listener->stats();
  EXPECT_EQ(stats.delivered, 1u);
  EXPECT_EQ(stats.duplicates, 1u);
  EXPECT_EQ(elsewhere->stats().delivered, 0u);

  listener->Stop();
  listener->Stop();  // Idempotent.
  EXPECT_STATUS(Unavailable, sender->Send(0, payload));
  EXPECT_STATUS(FailedPrecondition, listener->Start());
  EXPECT_EQ(sink.deliveries().size(), 2u);
  // The name is free again.
  ASSERT_OK_AND_ASSIGN(auto successor, transport->MakeListener(ListenerContext{"r0", {}}, sink));
  ASSERT_OK(successor->Start());
  ASSERT_OK(sender->Send(0, payload));
  EXPECT_EQ(successor->stats().duplicates, 1u);
}

TEST(InprocTransportTest, StopCancelsADeliveryBlockedInTheSink) {
  auto transport = Make("inproc://" + UniqueHub());
  ASSERT_NE(transport, nullptr);
  BlockingSink sink;
  auto listener = StartListener(*transport, "r0", sink);
  ASSERT_NE(listener, nullptr);
  const SenderContext context = ContextFor({"r0"});
  ASSERT_OK_AND_ASSIGN(auto sender, transport->MakeSender(context));
  const std::vector<std::byte> payload = TinyPayload(context, 0);

  Status sent = Internal("not sent");
  std::thread sending([&] { sent = sender->Send(0, payload); });
  sink.WaitUntilEntered();
  // Stop returns only once the blocked delivery has left the sink.
  listener->Stop();
  sending.join();
  EXPECT_STATUS_MSG(Cancelled, "endpoint 'r0'", sent);
  EXPECT_EQ(listener->stats().failures, 1u);
  EXPECT_EQ(listener->stats().last_error.code(), StatusCode::kCancelled);
}

TEST(SessionAsSinkTest, StreamEndsHoldTheOpenTransfersPayloadCounts) {
  auto store = WeightStore::Make();
  ASSERT_OK_AND_ASSIGN(auto session, internal::ReceiverSession::Make({}, *store));
  PayloadSink& sink = *session;  // What a listener delivers into.
  const TransferId id = TransferId::Random();
  // Before Prepare nothing is open: refused, nothing recorded.
  EXPECT_STATUS_MSG(FailedPrecondition, "not the open transfer", sink.EndOfStream({id, 0, 5}));
  ASSERT_OK(session->Prepare(PrepareRequest{id, 0, {}}).status());
  EXPECT_TRUE(session->DeclaredPayloads(id).empty());
  ASSERT_OK(sink.EndOfStream({id, 0, 5}));
  ASSERT_OK(sink.EndOfStream({id, 3, 0}));
  ASSERT_OK(sink.EndOfStream({id, 0, 5}));  // A repeated end is fine.
  EXPECT_STATUS_MSG(InvalidArgument,
                    "producer 0 ended its stream with 6 payloads, and earlier with 5",
                    sink.EndOfStream({id, 0, 6}));
  EXPECT_EQ(session->DeclaredPayloads(id), (std::map<uint32_t, uint32_t>{{0, 5}, {3, 0}}));
  EXPECT_TRUE(session->DeclaredPayloads(TransferId::Random()).empty());

  // A payload beyond its producer's end is refused; one within it is staged.
  ASSERT_OK_AND_ASSIGN(const std::vector<std::byte> beyond,
                       EncodePayload(PayloadIds{id, 0, 5, 0, 1}, {}));
  EXPECT_STATUS_MSG(InvalidArgument, "producer 0 ended its stream with 5 payloads",
                    session->Stage(beyond));
  ASSERT_OK_AND_ASSIGN(const std::vector<std::byte> within,
                       EncodePayload(PayloadIds{id, 0, 4, 0, 1}, {}));
  ASSERT_OK(session->Stage(within));
  // ... and a stream end below a payload already staged is refused too.
  EXPECT_STATUS_MSG(InvalidArgument,
                    "producer 0 ended its stream with 4 payloads, and earlier with 5",
                    sink.EndOfStream({id, 0, 4}));
  ASSERT_OK_AND_ASSIGN(const std::vector<std::byte> other,
                       EncodePayload(PayloadIds{id, 1, 2, 0, 1}, {}));
  ASSERT_OK(session->Stage(other));
  EXPECT_STATUS_MSG(InvalidArgument,
                    "producer 1 ended its stream with 2 payloads, but its payload 2 was staged",
                    sink.EndOfStream({id, 1, 2}));

  // A flush expecting other counts than the producers declared fails at once, naming both,
  // instead of waiting for payloads that were never sent.
  FlushOptions flush;
  flush.timeout = std::chrono::seconds(30);
  flush.expected.payloads_per_producer = {{0, 6}, {1, 3}};
  EXPECT_STATUS_MSG(InvalidArgument,
                    "producer 0 ended its stream with 5 payloads, but the flush expects 6",
                    session->Flush(id, flush));
  ASSERT_OK(session->Abort(id));
  // A late stream end of the finished transfer is ignored.
  ASSERT_OK(sink.EndOfStream({id, 0, 7}));
  EXPECT_TRUE(session->DeclaredPayloads(id).empty());

  // A count declared at Prepare holds the stream ends to it.
  const TransferId next = TransferId::Random();
  TransferExpectation expected;
  expected.payloads_per_producer = {{0, 2}};
  ASSERT_OK(session->Prepare(PrepareRequest{next, 0, expected}).status());
  EXPECT_STATUS_MSG(InvalidArgument,
                    "producer 0 ended its stream with 3 payloads, but the transfer's payload "
                    "count expects 2",
                    sink.EndOfStream({next, 0, 3}));
  EXPECT_STATUS_MSG(InvalidArgument,
                    "producer 1 ended its stream with 1 payloads, but the transfer's payload "
                    "count expects 0",
                    sink.EndOfStream({next, 1, 1}));
  ASSERT_OK(sink.EndOfStream({next, 0, 2}));
  ASSERT_OK(sink.EndOfStream({next, 1, 0}));  // A producer the count leaves out sent nothing.
  EXPECT_EQ(session->DeclaredPayloads(next), (std::map<uint32_t, uint32_t>{{0, 2}, {1, 0}}));
  ASSERT_OK(session->Abort(next));
}

// ---------------------------------------------------------------------------------------------
// Round trips into receiver sessions

std::vector<OwnedTensor> MakeModel(uint64_t seed) {
  return {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, seed + 1),
          RandomTensor("model.layers.0.attn.qkv.weight", DType::kFloat16, {40, 40}, seed + 2),
          RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, seed + 3),
          RandomTensor("model.layers.0.mlp.up.weight_scale", DType::kFloat8E4M3FN, {900}, seed + 4),
          RandomTensor("model.norm.weight", DType::kBFloat16, {257}, seed + 5)};
}

std::vector<OwnedTensor> PerturbModel(const std::vector<OwnedTensor>& model, uint64_t seed) {
  std::vector<OwnedTensor> next;
  for (size_t i = 0; i < model.size(); ++i) next.push_back(Perturb(model[i], kDensity, seed + i));
  return next;
}

/// A model whose tensors have `model`'s names and shapes and zero bits, as a receiver that has
/// allocated its weights and waits for the first (anchor) transfer.
std::unique_ptr<WeightStore> ZeroStore(const std::vector<OwnedTensor>& model) {
  auto store = WeightStore::Make();
  for (OwnedTensor t : model) {
    std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0});
    EXPECT_OK(store->AddCopy(t.view()));
  }
  return store;
}

/// Expect `store` to hold exactly `model`, with digests kept current.
void ExpectStoreHolds(const WeightStore& store, const std::vector<OwnedTensor>& model) {
  ASSERT_EQ(store.size(), model.size());
  for (const OwnedTensor& t : model) {
    ASSERT_OK_AND_ASSIGN(TensorView got, store.Find(t.name));
    EXPECT_TRUE(std::equal(got.bytes.begin(), got.bytes.end(), t.bytes.begin(), t.bytes.end()))
        << t.name;
  }
  EXPECT_EQ(store.Digests(), store.RecomputeDigests());
}

/// One receiver: a store, its session, and a listener into the session (declared last: destroyed
/// first, before the session it calls).
struct Receiver {
  std::unique_ptr<WeightStore> store;
  std::unique_ptr<internal::ReceiverSession> session;
  std::unique_ptr<Listener> listener;
};

Receiver MakeReceiver(Transport& transport, const std::string& endpoint,
                      const std::vector<OwnedTensor>& model) {
  Receiver receiver;
  receiver.store = ZeroStore(model);
  auto session = internal::ReceiverSession::Make({}, *receiver.store);
  EXPECT_TRUE(session.ok()) << session.status().ToString();
  if (!session.ok()) return receiver;
  receiver.session = std::move(session).ValueOrDie();
  receiver.listener = StartListener(transport, endpoint, *receiver.session);
  return receiver;
}

/// Flush with the payload counts the stream ends declared and the producers' digests, then
/// commit.
void FlushAndCommit(Receiver& receiver, const TransferId& id,
                    const std::map<std::string, uint64_t>& digests) {
  FlushOptions flush;
  flush.timeout = kGenerousTimeout;
  flush.expected.payloads_per_producer = receiver.session->DeclaredPayloads(id);
  ASSERT_FALSE(flush.expected.payloads_per_producer.empty());
  flush.expected.digests = digests;
  ASSERT_OK(receiver.session->Flush(id, flush));
  ASSERT_OK(receiver.session->Commit(id));
}

TEST(InprocTransportTest, PayloadsReachASessionAndEndBitExact) {
  const std::vector<OwnedTensor> v0 = MakeModel(10);
  auto transport = Make("inproc://" + UniqueHub());
  ASSERT_NE(transport, nullptr);
  Receiver receiver = MakeReceiver(*transport, "r0", v0);
  ASSERT_NE(receiver.listener, nullptr);
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));

  std::vector<OwnedTensor> model = v0;
  for (uint64_t round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    if (round > 0) model = PerturbModel(model, 100 * round);
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
    EXPECT_EQ(plan.anchor, round == 0);
    const SenderContext context{id, 0, plan.base_version, plan.target_version, {"r0"}};
    ASSERT_OK_AND_ASSIGN(auto sender, transport->MakeSender(context));

    // Before Prepare the receiver refuses, and the transport says so (staged ACK).
    std::vector<std::vector<std::byte>> payloads;
    for (const OwnedTensor& t : model) {
      ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded, tracker->Encode(id, t.view()));
      if (encoded.items.empty()) continue;
      std::vector<ItemView> views;
      for (const Item& item : encoded.items) views.push_back(item.view());
      const PayloadIds ids{id, 0, static_cast<uint32_t>(payloads.size()), plan.base_version,
                           plan.target_version};
      ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(ids, views));
      payloads.push_back(std::move(payload));
    }
    ASSERT_FALSE(payloads.empty());
    EXPECT_STATUS(FailedPrecondition, sender->Send(0, payloads[0]));

    ASSERT_OK(receiver.session->Prepare(PrepareRequest{id, plan.base_version, {}}).status());
    for (uint32_t p = 0; p < payloads.size(); ++p) ASSERT_OK(sender->Send(p, payloads[p]));
    ASSERT_OK(sender->Send(0, payloads[0]));  // A retry is deduplicated, not applied twice.
    ASSERT_OK(sender->Finish(payloads.size()));
    ASSERT_NO_FATAL_FAILURE(FlushAndCommit(receiver, id, tracker->PendingDigests()));
    ASSERT_OK(tracker->Commit(id));
    ExpectStoreHolds(*receiver.store, model);
    EXPECT_EQ(receiver.store->version(), plan.target_version);
  }
  const ListenerStats stats = receiver.listener->stats();
  EXPECT_EQ(stats.duplicates, 3u);
  EXPECT_EQ(stats.streams_ended, 3u);
  EXPECT_EQ(stats.failures, 3u);  // One refusal before each Prepare.
}

// W producers stream through ProducerStream and inproc to two receivers; both end bit-identical
// to the trainer, an anchor and then deltas.
TEST(InprocTransportTest, ProducerStreamsReachTwoReceiversBitIdentically) {
  constexpr uint32_t kProducers = 2;
  // Small chunks and buckets, so each producer owns several chunks and sends several payloads.
  constexpr uint64_t kChunkBytes = 2048;
  constexpr uint64_t kBucketBytes = 1024;
  const std::vector<OwnedTensor> v0 = MakeModel(20);
  auto transport = Make("inproc://" + UniqueHub());
  ASSERT_NE(transport, nullptr);
  const std::vector<std::string> endpoints = {"r0", "r1"};
  std::vector<Receiver> receivers;
  for (const std::string& endpoint : endpoints) {
    receivers.push_back(MakeReceiver(*transport, endpoint, v0));
    ASSERT_NE(receivers.back().listener, nullptr);
  }
  std::vector<std::unique_ptr<internal::DeltaTracker>> trackers;
  std::vector<std::unique_ptr<ProducerStream>> streams;
  for (uint32_t p = 0; p < kProducers; ++p) {
    ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
    trackers.push_back(std::move(tracker));
    ProducerStreamOptions options;
    options.producer_id = p;
    options.num_producers = kProducers;
    options.chunk_bytes = kChunkBytes;
    options.bucket_bytes = kBucketBytes;
    options.encode_threads = 2;
    options.serialize_threads = 2;
    options.send_threads = 2;
    options.max_payloads_in_flight = 3;
    ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
    streams.push_back(std::move(stream));
  }

  std::vector<OwnedTensor> model = v0;
  for (uint64_t round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    if (round > 0) model = PerturbModel(model, 1000 * round);
    std::vector<TensorView> views;
    views.reserve(model.size());
    for (const OwnedTensor& t : model) views.push_back(t.view());
    const TransferId id = TransferId::Random();
    std::vector<TransferPlan> plans;
    for (auto& tracker : trackers) {
      ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
      plans.push_back(plan);
    }
    for (Receiver& receiver : receivers) {
      ASSERT_OK(receiver.session->Prepare(PrepareRequest{id, plans[0].base_version, {}}).status());
    }
    // The producers stream concurrently, as trainer ranks do.
    std::vector<Status> results(kProducers);
    std::vector<uint64_t> sent(kProducers);
    std::vector<std::thread> threads;
    for (uint32_t p = 0; p < kProducers; ++p) {
      threads.emplace_back([&, p] {
        const SenderContext context{id, p, plans[p].base_version, plans[p].target_version,
                                    endpoints};
        auto sender = transport->MakeSender(context);
        if (!sender.ok()) {
          results[p] = sender.status();
          return;
        }
        auto report = streams[p]->Run(*trackers[p], TensorListSource(views, kChunkBytes),
                                      (*sender)->AsPayloadSender(), (*sender)->AsSenderCleanup());
        if (!report.ok()) {
          results[p] = report.status();
          return;
        }
        sent[p] = report->payloads;
        results[p] = (*sender)->Finish(report->payloads);
      });
    }
    for (std::thread& thread : threads) thread.join();
    std::map<std::string, uint64_t> digests;
    for (uint32_t p = 0; p < kProducers; ++p) {
      ASSERT_OK(results[p]);
      EXPECT_GT(sent[p], 0u);
      for (const auto& [name, digest] : trackers[p]->PendingDigests()) digests[name] = digest;
    }
    for (Receiver& receiver : receivers) {
      EXPECT_EQ(receiver.session->DeclaredPayloads(id),
                (std::map<uint32_t, uint32_t>{{0, static_cast<uint32_t>(sent[0])},
                                              {1, static_cast<uint32_t>(sent[1])}}));
      ASSERT_NO_FATAL_FAILURE(FlushAndCommit(receiver, id, digests));
    }
    for (auto& tracker : trackers) ASSERT_OK(tracker->Commit(id));
    for (const Receiver& receiver : receivers) ExpectStoreHolds(*receiver.store, model);
  }
  EXPECT_EQ(receivers[0].store->Digests(), receivers[1].store->Digests());
}

// ---------------------------------------------------------------------------------------------
// Fault injection

/// Sends payloads 0 … count − 1 of `context` once each through a fresh sender of `uri` into a
/// fresh recording sink at endpoint "r0"; returns the sink and each Send's status.
struct FaultRun {
  std::unique_ptr<RecordingSink> sink = std::make_unique<RecordingSink>();
  std::vector<Status> results;
  std::vector<std::vector<std::byte>> payloads;
};

FaultRun RunFaults(const std::string& uri, uint32_t count, const SenderContext& context) {
  FaultRun run;
  auto transport = Make(uri);
  if (transport == nullptr) return run;
  auto listener = StartListener(*transport, "r0", *run.sink);
  auto sender = transport->MakeSender(context);
  EXPECT_TRUE(sender.ok()) << sender.status().ToString();
  if (!sender.ok()) return run;
  for (uint32_t id = 0; id < count; ++id) {
    run.payloads.push_back(TinyPayload(context, id));
    run.results.push_back((*sender)->Send(id, run.payloads.back()));
  }
  return run;
}

class FaultTransportTest : public ::testing::Test {
 protected:
  std::string Uri(const std::string& params) const {
    return fmt::format("fault+inproc://{}?{}", UniqueHub(), params);
  }
  const SenderContext context_ = ContextFor({"r0"});
};

TEST_F(FaultTransportTest, DropInErrorModeFailsTheSendWithoutDelivering) {
  const FaultRun run = RunFaults(Uri("drop=1"), 4, context_);
  ASSERT_EQ(run.results.size(), 4u);
  for (const Status& status : run.results) {
    EXPECT_STATUS_MSG(Unavailable, "injected drop", status);
  }
  EXPECT_TRUE(run.sink->deliveries().empty());
}

TEST_F(FaultTransportTest, DropInSilentModeReportsSuccessWithoutDelivering) {
  const FaultRun run = RunFaults(Uri("drop=1&drop_mode=silent"), 4, context_);
  ASSERT_EQ(run.results.size(), 4u);
  for (const Status& status : run.results) EXPECT_OK(status);
  EXPECT_TRUE(run.sink->deliveries().empty());
}

TEST_F(FaultTransportTest, DuplicateDeliversEveryPayloadTwice) {
  const FaultRun run = RunFaults(Uri("duplicate=1"), 3, context_);
  for (const Status& status : run.results) EXPECT_OK(status);
  const auto deliveries = run.sink->deliveries();
  ASSERT_EQ(deliveries.size(), 6u);
  for (uint32_t id = 0; id < 3; ++id) {
    EXPECT_EQ(deliveries[2 * id].first, id);
    EXPECT_EQ(deliveries[2 * id + 1].first, id);
    EXPECT_EQ(deliveries[2 * id].second, run.payloads[id]);
    EXPECT_EQ(deliveries[2 * id + 1].second, run.payloads[id]);
  }
}

TEST_F(FaultTransportTest, CorruptFlipsOneBodyByteThatOnlyTheChecksumCatches) {
  const FaultRun run = RunFaults(Uri("corrupt=1&seed=3"), 8, context_);
  const auto deliveries = run.sink->deliveries();
  ASSERT_EQ(deliveries.size(), 8u);
  std::set<size_t> positions;
  for (const auto& [id, bytes] : deliveries) {
    const std::vector<std::byte>& original = run.payloads[id];
    ASSERT_EQ(bytes.size(), original.size());
    std::vector<size_t> differing;
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (bytes[i] != original[i]) differing.push_back(i);
    }
    ASSERT_EQ(differing.size(), 1u) << "payload " << id;
    EXPECT_GE(differing[0], kPayloadHeaderSize);
    positions.insert(differing[0]);
    // The sender's copy is untouched, the header still validates, the body does not.
    EXPECT_OK(ValidatePayloadHeader(bytes));
    EXPECT_STATUS(DataLoss, DecodePayload(bytes));
    EXPECT_OK(DecodePayload(original));
  }
  EXPECT_GT(positions.size(), 1u);  // Positions are drawn, not fixed.
}

TEST_F(FaultTransportTest, DisconnectAfterNFailsEveryLaterSend) {
  const FaultRun run = RunFaults(Uri("disconnect_after=3"), 6, context_);
  ASSERT_EQ(run.results.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    if (i < 3) {
      EXPECT_OK(run.results[i]);
    } else {
      EXPECT_STATUS_MSG(Unavailable, "disconnect after 3", run.results[i]);
    }
  }
  EXPECT_EQ(run.sink->ids(), (std::set<uint32_t>{0, 1, 2}));
}

TEST_F(FaultTransportTest, DelayStillDelivers) {
  const FaultRun run = RunFaults(Uri("delay_ms=1"), 2, context_);
  for (const Status& status : run.results) EXPECT_OK(status);
  EXPECT_EQ(run.sink->ids(), (std::set<uint32_t>{0, 1}));
}

TEST_F(FaultTransportTest, DecisionsAreReproducibleForASeed) {
  constexpr uint32_t kPayloads = 64;
  const FaultRun first = RunFaults(Uri("drop=0.5&seed=7"), kPayloads, context_);
  const FaultRun again = RunFaults(Uri("drop=0.5&seed=7"), kPayloads, context_);
  const FaultRun other = RunFaults(Uri("drop=0.5&seed=8"), kPayloads, context_);
  const std::set<uint32_t> delivered = first.sink->ids();
  EXPECT_GT(delivered.size(), 0u);
  EXPECT_LT(delivered.size(), kPayloads);
  EXPECT_EQ(again.sink->ids(), delivered);
  EXPECT_NE(other.sink->ids(), delivered);
  // The same decisions whatever the transfer: they depend on seed, producer and payload ids.
  const FaultRun other_transfer = RunFaults(Uri("drop=0.5&seed=7"), kPayloads, ContextFor({"r0"}));
  EXPECT_EQ(other_transfer.sink->ids(), delivered);
  // Another producer draws differently.
  const FaultRun other_producer =
      RunFaults(Uri("drop=0.5&seed=7"), kPayloads, ContextFor({"r0"}, /*producer_id=*/1));
  EXPECT_NE(other_producer.sink->ids(), delivered);
}

TEST_F(FaultTransportTest, ARetryDrawsAfreshSoRetriesGetThrough) {
  auto transport = Make(Uri("drop=0.5&seed=11"));
  ASSERT_NE(transport, nullptr);
  RecordingSink sink;
  auto listener = StartListener(*transport, "r0", sink);
  ASSERT_OK_AND_ASSIGN(auto sender, transport->MakeSender(context_));
  // At p = 0.5, 64 attempts all failing has probability 2^-64: a bounded retry loop suffices.
  constexpr int kMaxAttempts = 64;
  int retries = 0;
  for (uint32_t id = 0; id < 16; ++id) {
    const std::vector<std::byte> payload = TinyPayload(context_, id);
    Status status = sender->Send(id, payload);
    for (int attempt = 1; !status.ok() && attempt < kMaxAttempts; ++attempt, ++retries) {
      EXPECT_STATUS(Unavailable, status);
      status = sender->Send(id, payload);
    }
    ASSERT_OK(status);
  }
  EXPECT_GT(retries, 0);
  EXPECT_EQ(sink.ids().size(), 16u);
  EXPECT_EQ(sink.deliveries().size(), 16u);
}

TEST_F(FaultTransportTest, CorruptPayloadFailsTheReceiversFlush) {
  const std::vector<OwnedTensor> model = MakeModel(30);
  auto transport = Make(Uri("corrupt=1"));
  ASSERT_NE(transport, nullptr);
  Receiver receiver = MakeReceiver(*transport, "r0", model);
  ASSERT_NE(receiver.listener, nullptr);
  const auto before = receiver.store->Digests();
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded, tracker->Encode(id, model[0].view()));
  std::vector<ItemView> views;
  for (const Item& item : encoded.items) views.push_back(item.view());
  ASSERT_OK_AND_ASSIGN(auto payload,
                       EncodePayload({id, 0, 0, plan.base_version, plan.target_version}, views));
  ASSERT_OK(receiver.session->Prepare(PrepareRequest{id, plan.base_version, {}}).status());
  ASSERT_OK_AND_ASSIGN(
      auto sender, transport->MakeSender({id, 0, plan.base_version, plan.target_version, {"r0"}}));
  // Staged (ACK) — only the apply thread's full check sees the flipped byte.
  ASSERT_OK(sender->Send(0, payload));
  ASSERT_OK(sender->Finish(1));
  FlushOptions flush;
  flush.timeout = kGenerousTimeout;
  flush.expected.payloads_per_producer = receiver.session->DeclaredPayloads(id);
  EXPECT_STATUS(DataLoss, receiver.session->Flush(id, flush));
  ASSERT_OK(receiver.session->Abort(id));
  EXPECT_EQ(receiver.store->Digests(), before);
}

}  // namespace
}  // namespace refit
