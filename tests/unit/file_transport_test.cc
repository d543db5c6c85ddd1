// file:// — the shared-filesystem drop: layout, atomic writes, polling, retries, cleanup.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "codec/tracker.h"
#include "receiver/receiver_session.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "refit/weight_store.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

namespace fs = std::filesystem;
using testing::Perturb;
using testing::RandomTensor;

// A flush timeout no correct run reaches, even on a loaded 2-core machine.
constexpr auto kGenerousTimeout = std::chrono::seconds(60);
// Fraction of elements each training step changes.
constexpr double kDensity = 0.05;

std::vector<OwnedTensor> MakeModel(uint64_t seed) {
  return {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, seed + 1),
          RandomTensor("model.layers.0.attn.qkv.weight", DType::kFloat16, {40, 40}, seed + 2),
          RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, seed + 3),
          RandomTensor("model.norm.weight", DType::kBFloat16, {257}, seed + 4)};
}

std::vector<std::byte> ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto* data = reinterpret_cast<const std::byte*>(text.data());
  return std::vector<std::byte>(data, data + text.size());
}

void WriteBytes(const fs::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

std::set<std::string> Names(const fs::path& dir) {
  std::set<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

/// One training step of a single producer, encoded as payloads (one per tensor).
struct Step {
  TransferPlan plan;
  std::vector<std::vector<std::byte>> payloads;
  std::map<std::string, uint64_t> digests;
  std::vector<OwnedTensor> model;
};

/// A receiver: store, session, and a listener into the session (destroyed first).
struct Receiver {
  std::unique_ptr<WeightStore> store;
  std::unique_ptr<internal::ReceiverSession> session;
  std::unique_ptr<Listener> listener;
};

/// Counts deliveries and refuses every one with DataLoss.
class RefusingSink : public PayloadSink {
 public:
  Result<StageResult> Deliver(ValidatedPayload, std::stop_token) override {
    ++calls_;
    return DataLoss("rejected by the test sink");
  }
  int calls() const { return calls_; }

 private:
  std::atomic<int> calls_ = 0;
};

class FileTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "refit-file-transport-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    transport_ = MakeTransportOrNull(fmt::format("file://{}?poll_ms=0", dir_.string()));
    ASSERT_NE(transport_, nullptr);
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    model_ = MakeModel(1);
    for (const OwnedTensor& t : model_) ASSERT_OK(tracker_->AdoptBaseline(t.view()));
  }

  void TearDown() override {
    std::error_code error;
    fs::remove_all(dir_, error);
  }

  static std::unique_ptr<Transport> MakeTransportOrNull(const std::string& uri) {
    auto transport = MakeTransport(uri);
    EXPECT_TRUE(transport.ok()) << transport.status().ToString();
    return transport.ok() ? std::move(transport).ValueOrDie() : nullptr;
  }

  /// A receiver holding the model the tracker adopted, listening (not polling) at `inbox`.
  Receiver MakeReceiver(const std::string& inbox, Transport* transport = nullptr) {
    Receiver receiver;
    receiver.store = WeightStore::Make();
    for (const OwnedTensor& t : model_) EXPECT_OK(receiver.store->AddCopy(t.view()));
    auto session = internal::ReceiverSession::Make({}, *receiver.store);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    if (!session.ok()) return receiver;
    receiver.session = std::move(session).ValueOrDie();
    auto listener = (transport ? transport : transport_.get())
                        ->MakeListener(ListenerContext{inbox, {}}, *receiver.session);
    EXPECT_TRUE(listener.ok()) << listener.status().ToString();
    if (!listener.ok()) return receiver;
    receiver.listener = std::move(listener).ValueOrDie();
    EXPECT_OK(receiver.listener->Start());
    return receiver;
  }

  /// Encode the next training step as one payload per tensor.
  Step EncodeStep(uint64_t seed) {
    Step step;
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
      const PayloadIds ids{step.plan.transfer_id, 0, static_cast<uint32_t>(step.payloads.size()),
                           step.plan.base_version, step.plan.target_version};
      auto payload = EncodePayload(ids, views);
      EXPECT_TRUE(payload.ok()) << payload.status().ToString();
      if (payload.ok()) step.payloads.push_back(std::move(payload).ValueOrDie());
    }
    step.digests = tracker_->PendingDigests();
    return step;
  }

  std::unique_ptr<TransportSender> SenderFor(const Step& step,
                                             std::vector<std::string> inboxes = {""},
                                             Transport* transport = nullptr) {
    auto sender = (transport ? transport : transport_.get())
                      ->MakeSender(SenderContext{step.plan.transfer_id, 0, step.plan.base_version,
                                                 step.plan.target_version, std::move(inboxes)});
    EXPECT_TRUE(sender.ok()) << sender.status().ToString();
    return sender.ok() ? std::move(sender).ValueOrDie() : nullptr;
  }

  /// Send every payload of `step`, then finish the stream.
  void SendStep(const Step& step, std::vector<std::string> inboxes = {""}) {
    auto sender = SenderFor(step, std::move(inboxes));
    ASSERT_NE(sender, nullptr);
    for (uint32_t id = 0; id < step.payloads.size(); ++id) {
      ASSERT_OK(sender->Send(id, step.payloads[id]));
    }
    ASSERT_OK(sender->Finish(step.payloads.size()));
  }

  /// The directory of producer 0's payloads of `step` in `inbox`.
  fs::path ProducerDir(const Step& step, const std::string& inbox = "") const {
    return (inbox.empty() ? dir_ : dir_ / inbox) / step.plan.transfer_id.ToHex() / "000000";
  }

  static void Prepare(Receiver& receiver, const Step& step) {
    ASSERT_OK(
        receiver.session->Prepare(PrepareRequest{step.plan.transfer_id, step.plan.base_version, {}})
            .status());
  }

  /// Flush with the counts the stream end declared and the producer's digests, then commit.
  static void FlushAndCommit(Receiver& receiver, const Step& step) {
    FlushOptions flush;
    flush.timeout = kGenerousTimeout;
    flush.expected.payloads_per_producer =
        receiver.session->DeclaredPayloads(step.plan.transfer_id);
    EXPECT_EQ(flush.expected.payloads_per_producer,
              (std::map<uint32_t, uint32_t>{{0, static_cast<uint32_t>(step.payloads.size())}}));
    flush.expected.digests = step.digests;
    ASSERT_OK(receiver.session->Flush(step.plan.transfer_id, flush));
    ASSERT_OK(receiver.session->Commit(step.plan.transfer_id));
  }

  static void ExpectStoreHolds(const WeightStore& store, const std::vector<OwnedTensor>& model) {
    for (const OwnedTensor& t : model) {
      ASSERT_OK_AND_ASSIGN(TensorView got, store.Find(t.name));
      EXPECT_TRUE(std::equal(got.bytes.begin(), got.bytes.end(), t.bytes.begin(), t.bytes.end()))
          << t.name;
    }
    EXPECT_EQ(store.Digests(), store.RecomputeDigests());
  }

  fs::path dir_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::vector<OwnedTensor> model_;
};

TEST_F(FileTransportTest, WritesEachPayloadAtomicallyUnderNamesMadeOfIds) {
  const Step step = EncodeStep(1);
  ASSERT_EQ(step.payloads.size(), model_.size());
  auto sender = SenderFor(step);
  ASSERT_NE(sender, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  const fs::path producer = ProducerDir(step);
  // Only final names: a `.tmp` exists only while a Send is running.
  EXPECT_EQ(Names(producer),
            (std::set<std::string>{"000000.rfpl", "000001.rfpl", "000002.rfpl", "000003.rfpl"}));
  EXPECT_EQ(Names(dir_), (std::set<std::string>{step.plan.transfer_id.ToHex()}));
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    EXPECT_EQ(ReadBytes(producer / fmt::format("{:06}.rfpl", id)), step.payloads[id]);
  }
  ASSERT_OK(sender->Finish(step.payloads.size()));
  const std::string count = fmt::format("{}\n", step.payloads.size());
  const auto count_bytes = std::as_bytes(std::span(count));
  EXPECT_EQ(ReadBytes(producer / "done"),
            std::vector<std::byte>(count_bytes.begin(), count_bytes.end()));
  EXPECT_EQ(Names(producer).size(), step.payloads.size() + 1);
}

TEST_F(FileTransportTest, TwoInboxesReachTwoSessionsBitExactlyAndEmptyTheDrop) {
  Receiver r0 = MakeReceiver("r0");
  Receiver r1 = MakeReceiver("r1");
  ASSERT_TRUE(r0.listener && r1.listener);
  EXPECT_TRUE(fs::is_directory(dir_ / "r0"));  // Start creates the inbox.
  for (uint64_t round = 1; round <= 2; ++round) {
    SCOPED_TRACE(round);
    const Step step = EncodeStep(round);
    for (Receiver* receiver : {&r0, &r1}) Prepare(*receiver, step);
    ASSERT_NO_FATAL_FAILURE(SendStep(step, {"r0", "r1"}));
    for (Receiver* receiver : {&r0, &r1}) {
      ASSERT_OK_AND_ASSIGN(PollReport report, receiver->listener->Poll());
      EXPECT_EQ(report.delivered, step.payloads.size());
      EXPECT_EQ(report.duplicates, 0u);
      EXPECT_TRUE(report.failures.empty());
      EXPECT_EQ(report.ended,
                (std::vector<StreamEnd>{
                    {step.plan.transfer_id, 0, static_cast<uint32_t>(step.payloads.size())}}));
      ASSERT_NO_FATAL_FAILURE(FlushAndCommit(*receiver, step));
      ExpectStoreHolds(*receiver->store, step.model);
    }
    // Staged files, the done markers and the emptied directories are gone.
    EXPECT_TRUE(Names(dir_ / "r0").empty());
    EXPECT_TRUE(Names(dir_ / "r1").empty());
    ASSERT_OK(tracker_->Commit(step.plan.transfer_id));
    model_ = step.model;
  }
  EXPECT_EQ(r0.listener->stats().delivered, r1.listener->stats().delivered);
  EXPECT_EQ(r0.listener->stats().streams_ended, 2u);
}

TEST_F(FileTransportTest, PayloadsThatArriveBeforePrepareAreKeptAndRetried) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_NO_FATAL_FAILURE(SendStep(step));
  ASSERT_OK_AND_ASSIGN(PollReport early, receiver.listener->Poll());
  EXPECT_EQ(early.delivered, 0u);
  ASSERT_EQ(early.failures.size(), step.payloads.size());
  for (const DeliveryFailure& failure : early.failures) {
    EXPECT_EQ(failure.status.code(), StatusCode::kFailedPrecondition) << failure.status.ToString();
    EXPECT_TRUE(fs::exists(failure.source)) << failure.source;
  }
  EXPECT_TRUE(early.ended.empty());  // The stream is not over while its payloads wait.
  EXPECT_EQ(receiver.listener->stats().last_error.code(), StatusCode::kFailedPrecondition);

  Prepare(receiver, step);
  ASSERT_OK_AND_ASSIGN(PollReport late, receiver.listener->Poll());
  EXPECT_EQ(late.delivered, step.payloads.size());
  EXPECT_TRUE(late.failures.empty());
  EXPECT_EQ(late.ended.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(FlushAndCommit(receiver, step));
  ExpectStoreHolds(*receiver.store, step.model);
}

TEST_F(FileTransportTest, TemporaryFilesAreNeverReadAndGoWithTheirStream) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  auto sender = SenderFor(step);
  ASSERT_NE(sender, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  // Debris of a crashed writer: a partial payload under a temporary name, in this stream and in
  // the directory of a producer that never finished.
  const fs::path producer = ProducerDir(step);
  const std::vector<std::byte> partial(step.payloads[0].begin(), step.payloads[0].begin() + 100);
  WriteBytes(producer / "000009.rfpl.0123456789abcdef.tmp", partial);
  const fs::path silent = producer.parent_path() / "000005";
  fs::create_directories(silent);
  WriteBytes(silent / "000000.rfpl.fedcba9876543210.tmp", partial);

  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, step.payloads.size());
  EXPECT_TRUE(report.failures.empty());
  EXPECT_TRUE(report.ended.empty());  // No done marker yet.
  EXPECT_EQ(Names(producer), (std::set<std::string>{"000009.rfpl.0123456789abcdef.tmp"}));

  ASSERT_OK(sender->Finish(step.payloads.size()));
  ASSERT_OK_AND_ASSIGN(report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, 0u);
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(report.ended.size(), 1u);
  // With `done` present no write of the stream is in flight: the debris goes with it.
  EXPECT_FALSE(fs::exists(producer));
  // The unfinished producer's temporary file stays, unread.
  EXPECT_EQ(Names(silent), (std::set<std::string>{"000000.rfpl.fedcba9876543210.tmp"}));
  ASSERT_NO_FATAL_FAILURE(FlushAndCommit(receiver, step));
  ExpectStoreHolds(*receiver.store, step.model);
}

TEST_F(FileTransportTest, ACorruptHeaderIsReportedOnceAndTheFileKeptUntilReplaced) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  ASSERT_NO_FATAL_FAILURE(SendStep(step));
  const fs::path damaged = ProducerDir(step) / "000001.rfpl";
  std::vector<std::byte> bytes = ReadBytes(damaged);
  bytes[20] ^= std::byte{0x40};  // Inside the checksummed header.
  WriteBytes(damaged, bytes);

  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, step.payloads.size() - 1);
  ASSERT_EQ(report.failures.size(), 1u);
  EXPECT_EQ(report.failures[0].source, damaged.string());
  EXPECT_EQ(report.failures[0].status.code(), StatusCode::kDataLoss);
  EXPECT_NE(report.failures[0].status.message().find(damaged.string()), std::string::npos);
  EXPECT_TRUE(fs::exists(damaged));
  EXPECT_TRUE(report.ended.empty());
  EXPECT_EQ(receiver.session->GetStatus().staged_payloads, step.payloads.size() - 1);

  // Not read again while it is unchanged: one report, not one per round.
  ASSERT_OK_AND_ASSIGN(report, receiver.listener->Poll());
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(receiver.listener->stats().failures, 1u);

  // The producer sends it again: the new file replaces the damaged one and is delivered.
  auto sender = SenderFor(step);
  ASSERT_NE(sender, nullptr);
  ASSERT_OK(sender->Send(1, step.payloads[1]));
  ASSERT_OK_AND_ASSIGN(report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, 1u);
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(report.ended.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(FlushAndCommit(receiver, step));
  ExpectStoreHolds(*receiver.store, step.model);
}

TEST_F(FileTransportTest, ASinkRefusalIsSurfacedAndTheFileKept) {
  RefusingSink sink;
  ASSERT_OK_AND_ASSIGN(auto listener, transport_->MakeListener(ListenerContext{"", {}}, sink));
  ASSERT_OK(listener->Start());
  const Step step = EncodeStep(1);
  ASSERT_NO_FATAL_FAILURE(SendStep(step));
  ASSERT_OK_AND_ASSIGN(PollReport report, listener->Poll());
  EXPECT_EQ(report.delivered, 0u);
  ASSERT_EQ(report.failures.size(), step.payloads.size());
  for (const DeliveryFailure& failure : report.failures) {
    EXPECT_EQ(failure.status.code(), StatusCode::kDataLoss);
    EXPECT_NE(failure.status.message().find("rejected by the test sink"), std::string::npos);
    EXPECT_NE(failure.status.message().find(failure.source), std::string::npos);
    EXPECT_TRUE(fs::exists(failure.source));
  }
  EXPECT_EQ(listener->stats().last_error.code(), StatusCode::kDataLoss);
  EXPECT_EQ(sink.calls(), static_cast<int>(step.payloads.size()));
  // A refusal that cannot pass by waiting is not retried until the file changes.
  ASSERT_OK_AND_ASSIGN(report, listener->Poll());
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(sink.calls(), static_cast<int>(step.payloads.size()));
}

TEST_F(FileTransportTest, ACorruptBodyIsStagedAndFailsTheFlush) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const auto before = receiver.store->Digests();
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  ASSERT_NO_FATAL_FAILURE(SendStep(step));
  // The last payload: once an apply fails, the session refuses later payloads of the transfer
  // (the first apply error surfaces at the next Stage), which would make the count below depend
  // on timing.
  const fs::path damaged = ProducerDir(step) / fmt::format("{:06}.rfpl", step.payloads.size() - 1);
  std::vector<std::byte> bytes = ReadBytes(damaged);
  bytes[bytes.size() - 5] ^= std::byte{0x01};  // In the compressed body.
  WriteBytes(damaged, bytes);
  // The header check passes, so the payload is staged (ACK means staged, not verified) and
  // removed; the body checksum fails on the apply thread and surfaces at Flush.
  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, step.payloads.size());
  EXPECT_FALSE(fs::exists(damaged));
  FlushOptions flush;
  flush.timeout = kGenerousTimeout;
  flush.expected.payloads_per_producer = receiver.session->DeclaredPayloads(step.plan.transfer_id);
  EXPECT_STATUS(DataLoss, receiver.session->Flush(step.plan.transfer_id, flush));
  ASSERT_OK(receiver.session->Abort(step.plan.transfer_id));
  EXPECT_EQ(receiver.store->Digests(), before);
}

TEST_F(FileTransportTest, ADuplicateDeliveryIsAcknowledgedAndRemoved) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  auto sender = SenderFor(step);
  ASSERT_NE(sender, nullptr);
  ASSERT_OK(sender->Send(0, step.payloads[0]));
  ASSERT_OK(sender->Send(0, step.payloads[0]));  // Replaces the first file: one delivery.
  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, 1u);
  EXPECT_EQ(report.duplicates, 0u);
  ASSERT_OK(sender->Send(0, step.payloads[0]));  // A retry after the receiver took it.
  ASSERT_OK_AND_ASSIGN(report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, 0u);
  EXPECT_EQ(report.duplicates, 1u);
  EXPECT_TRUE(report.failures.empty());
  EXPECT_TRUE(Names(ProducerDir(step)).empty());
  EXPECT_EQ(receiver.session->GetStatus().duplicate_payloads, 1u);
}

TEST_F(FileTransportTest, AFileWhoseHeaderContradictsItsNameIsDataLoss) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  auto sender = SenderFor(step);
  ASSERT_NE(sender, nullptr);
  ASSERT_OK(sender->Send(1, step.payloads[1]));
  const fs::path producer = ProducerDir(step);
  fs::rename(producer / "000001.rfpl", producer / "000007.rfpl");
  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, 0u);
  ASSERT_EQ(report.failures.size(), 1u);
  EXPECT_EQ(report.failures[0].status.code(), StatusCode::kDataLoss);
  EXPECT_NE(report.failures[0].status.message().find("holds payload 1"), std::string::npos);
  EXPECT_TRUE(fs::exists(producer / "000007.rfpl"));
}

TEST_F(FileTransportTest, NamesThatAreNotTheWritersAreIgnored) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  ASSERT_NO_FATAL_FAILURE(SendStep(step));
  const fs::path producer = ProducerDir(step);
  WriteBytes(dir_ / "notes.txt", step.payloads[0]);
  fs::create_directories(dir_ / "not-a-transfer" / "000000");
  WriteBytes(dir_ / "not-a-transfer" / "000000" / "000000.rfpl", step.payloads[0]);
  // Not canonical: no zero padding, upper-case hex.
  WriteBytes(producer / "7.rfpl", step.payloads[0]);
  std::string upper = step.plan.transfer_id.ToHex();
  std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
  fs::create_directories(dir_ / upper / "000000");
  WriteBytes(dir_ / upper / "000000" / "000000.rfpl", step.payloads[0]);

  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, step.payloads.size());
  EXPECT_TRUE(report.failures.empty());
  // A foreign file keeps the producer directory, but not the stream end.
  EXPECT_EQ(report.ended.size(), 1u);
  EXPECT_EQ(Names(producer), (std::set<std::string>{"7.rfpl"}));
  EXPECT_TRUE(fs::exists(dir_ / "notes.txt"));
  ASSERT_NO_FATAL_FAILURE(FlushAndCommit(receiver, step));
}

TEST_F(FileTransportTest, AMalformedDoneMarkerIsReportedOnce) {
  Receiver receiver = MakeReceiver("");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  ASSERT_NO_FATAL_FAILURE(SendStep(step));
  const std::string garbage = "four\n";
  WriteBytes(ProducerDir(step) / "done", std::as_bytes(std::span(garbage)));
  ASSERT_OK_AND_ASSIGN(PollReport report, receiver.listener->Poll());
  EXPECT_EQ(report.delivered, step.payloads.size());
  ASSERT_EQ(report.failures.size(), 1u);
  EXPECT_EQ(report.failures[0].status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(report.ended.empty());
  ASSERT_OK_AND_ASSIGN(report, receiver.listener->Poll());
  EXPECT_TRUE(report.failures.empty());
  EXPECT_TRUE(fs::exists(ProducerDir(step) / "done"));
}

TEST_F(FileTransportTest, AVanishedDirectoryIsUnavailable) {
  Receiver receiver = MakeReceiver("r0");
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  // The producer names an inbox no receiver created.
  auto stray = SenderFor(step, {"r9"});
  ASSERT_NE(stray, nullptr);
  EXPECT_STATUS_MSG(Unavailable, "no listener inbox", stray->Send(0, step.payloads[0]));

  fs::remove_all(dir_);
  EXPECT_STATUS_MSG(Unavailable, "is gone", receiver.listener->Poll());
  EXPECT_EQ(receiver.listener->stats().last_error.code(), StatusCode::kUnavailable);
  auto sender = SenderFor(step, {"r0"});
  ASSERT_NE(sender, nullptr);
  EXPECT_STATUS_MSG(Unavailable, "is gone", sender->Send(0, step.payloads[0]));
  EXPECT_FALSE(fs::exists(dir_));  // Not recreated on the local disk.
  RefusingSink sink;
  ASSERT_OK_AND_ASSIGN(auto late, transport_->MakeListener(ListenerContext{"r1", {}}, sink));
  EXPECT_STATUS(Unavailable, late->Start());
}

TEST_F(FileTransportTest, ListenersAndSendersCheckInboxesAndLifecycle) {
  RefusingSink sink;
  for (const std::string bad : {"..", ".", "a/b", "../up", "sp ace"}) {
    EXPECT_STATUS(InvalidArgument, transport_->MakeListener(ListenerContext{bad, {}}, sink));
    EXPECT_STATUS(InvalidArgument,
                  transport_->MakeSender(SenderContext{TransferId::Random(), 0, 1, 2, {bad}}));
  }
  EXPECT_STATUS(InvalidArgument, transport_->MakeListener(ListenerContext{"r0", {"r1"}}, sink));
  ASSERT_OK_AND_ASSIGN(auto listener, transport_->MakeListener(ListenerContext{"r0", {}}, sink));
  EXPECT_EQ(listener->endpoint(), "r0");
  EXPECT_STATUS_MSG(FailedPrecondition, "not started", listener->Poll());
  ASSERT_OK(listener->Start());
  EXPECT_STATUS(FailedPrecondition, listener->Start());
  ASSERT_OK(listener->Poll().status());
  listener->Stop();
  EXPECT_STATUS_MSG(FailedPrecondition, "stopped", listener->Poll());
}

TEST_F(FileTransportTest, ThePollingThreadDeliversWithoutPollCalls) {
  auto polling = MakeTransportOrNull(fmt::format("file://{}?poll_ms=1", dir_.string()));
  ASSERT_NE(polling, nullptr);
  Receiver receiver = MakeReceiver("r0", polling.get());
  ASSERT_NE(receiver.listener, nullptr);
  const Step step = EncodeStep(1);
  Prepare(receiver, step);
  auto sender = SenderFor(step, {"r0"}, polling.get());
  ASSERT_NE(sender, nullptr);
  for (uint32_t id = 0; id < step.payloads.size(); ++id) {
    ASSERT_OK(sender->Send(id, step.payloads[id]));
  }
  ASSERT_OK(sender->Finish(step.payloads.size()));
  // Flush waits (generously) for the counts the producer knows; the thread delivers meanwhile.
  FlushOptions flush;
  flush.timeout = kGenerousTimeout;
  flush.expected.payloads_per_producer = {{0, static_cast<uint32_t>(step.payloads.size())}};
  flush.expected.digests = step.digests;
  ASSERT_OK(receiver.session->Flush(step.plan.transfer_id, flush));
  ASSERT_OK(receiver.session->Commit(step.plan.transfer_id));
  ExpectStoreHolds(*receiver.store, step.model);
  receiver.listener->Stop();
  EXPECT_EQ(receiver.listener->stats().delivered, step.payloads.size());
}

// Producers write concurrently into one inbox while the polling thread reads, ends streams and
// removes directories under them.
TEST_F(FileTransportTest, ConcurrentProducersMeetThePollingThread) {
  constexpr uint32_t kSpans = 3;
  const auto producers = static_cast<uint32_t>(model_.size());
  auto polling = MakeTransportOrNull(fmt::format("file://{}?poll_ms=1", dir_.string()));
  ASSERT_NE(polling, nullptr);
  Receiver receiver = MakeReceiver("r0", polling.get());
  ASSERT_NE(receiver.listener, nullptr);
  for (uint64_t round = 1; round <= 3; ++round) {
    SCOPED_TRACE(round);
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker_->Begin(id));
    // Producer p owns tensor p and sends one payload per span of it.
    std::vector<std::vector<std::vector<std::byte>>> payloads(producers);
    std::vector<OwnedTensor> next;
    for (uint32_t p = 0; p < producers; ++p) {
      next.push_back(Perturb(model_[p], kDensity, round * 100 + p));
      const uint64_t numel = next.back().view().numel();
      for (uint64_t span = 0; span < kSpans; ++span) {
        ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded,
                             tracker_->Encode(id, next.back().view(), numel * span / kSpans,
                                              numel * (span + 1) / kSpans));
        std::vector<ItemView> views;
        for (const Item& item : encoded.items) views.push_back(item.view());
        const PayloadIds ids{id, p, static_cast<uint32_t>(payloads[p].size()), plan.base_version,
                             plan.target_version};
        ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(ids, views));
        payloads[p].push_back(std::move(payload));
      }
    }
    ASSERT_OK(receiver.session->Prepare(PrepareRequest{id, plan.base_version, {}}).status());
    std::vector<Status> results(producers);
    std::vector<std::thread> threads;
    for (uint32_t p = 0; p < producers; ++p) {
      threads.emplace_back([&, p] {
        auto sender = polling->MakeSender(
            SenderContext{id, p, plan.base_version, plan.target_version, {"r0"}});
        if (!sender.ok()) {
          results[p] = sender.status();
          return;
        }
        for (uint32_t i = 0; i < payloads[p].size(); ++i) {
          results[p] = (*sender)->Send(i, payloads[p][i]);
          if (!results[p].ok()) return;
        }
        results[p] = (*sender)->Finish(payloads[p].size());
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (const Status& result : results) ASSERT_OK(result);
    FlushOptions flush;
    flush.timeout = kGenerousTimeout;
    for (uint32_t p = 0; p < producers; ++p) flush.expected.payloads_per_producer[p] = kSpans;
    flush.expected.digests = tracker_->PendingDigests();
    ASSERT_OK(receiver.session->Flush(id, flush));
    ASSERT_OK(receiver.session->Commit(id));
    ASSERT_OK(tracker_->Commit(id));
    model_ = next;
    ExpectStoreHolds(*receiver.store, model_);
  }
  receiver.listener->Stop();
  EXPECT_EQ(receiver.listener->stats().delivered, 3 * producers * kSpans);
  EXPECT_EQ(receiver.listener->stats().failures, 0u);
}

TEST_F(FileTransportTest, TheFaultWrapperDropsBeforeTheFileIsWritten) {
  auto faulty = MakeTransportOrNull(
      fmt::format("fault+file://{}?poll_ms=0&drop=1&drop_mode=silent", dir_.string()));
  ASSERT_NE(faulty, nullptr);
  const Step step = EncodeStep(1);
  auto sender = SenderFor(step, {""}, faulty.get());
  ASSERT_NE(sender, nullptr);
  ASSERT_OK(sender->Send(0, step.payloads[0]));
  EXPECT_TRUE(Names(dir_).empty());
  ASSERT_OK(sender->Finish(1));  // The stream end still travels: the receiver sees a gap.
  EXPECT_EQ(Names(ProducerDir(step)), (std::set<std::string>{"done"}));
}

}  // namespace
}  // namespace refit
