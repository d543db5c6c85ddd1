// The s3:// transport against a real S3 server (Ceph RGW from scripts/s3-test-server.sh): a fleet
// of in-process receivers with real HTTP control planes, producers uploading to the bucket and
// announcing each payload on every control plane. Faults: wrong credentials, the server vanishing
// mid-transfer (a TCP proxy in front of it is cut), an object corrupted in the bucket, a forged
// object without the MAC. Chains: a late receiver bootstraps bit-identically and joins; pruning
// keeps the active chain; a forged or corrupted chain is refused with the store untouched.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>

#include "core/digest.h"
#include "fleet.h"
#include "node/chain_replay.h"
#include "s3_test_env.h"
#include "test_util.h"
#include "transport/s3/s3_chain.h"
#include "transport/s3/s3_client.h"
#include "transport/s3/s3_layout.h"

namespace refit {
namespace {

using testing::Fleet;
using testing::FleetOptions;
using testing::StoreSnapshot;

// ---- A TCP proxy that can be cut, as a server that vanishes ----------------------------------

class TcpProxy {
 public:
  explicit TcpProxy(uint16_t upstream_port) : upstream_port_(upstream_port) {}
  ~TcpProxy() { Stop(); }

  // Listen on `port` (0: any free one); return the port.
  uint16_t Start(uint16_t port = 0) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(::listen(listen_fd_, 64), 0);
    socklen_t length = sizeof address;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length);
    stopping_ = false;
    acceptor_ = std::thread([this] { Accept(); });
    return ntohs(address.sin_port);
  }

  // Refuse new connections and cut every open one.
  void Stop() {
    if (listen_fd_ < 0) return;
    stopping_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    ::close(listen_fd_);
    listen_fd_ = -1;
    std::lock_guard lock(mutex_);
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
    for (std::thread& pump : pumps_) pump.join();
    pumps_.clear();
    for (int fd : open_fds_) ::close(fd);
    open_fds_.clear();
  }

 private:
  void Accept() {
    while (!stopping_) {
      const int client = ::accept(listen_fd_, nullptr, nullptr);
      if (client < 0) return;
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      address.sin_port = htons(upstream_port_);
      if (::connect(server, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      std::lock_guard lock(mutex_);
      open_fds_.push_back(client);
      open_fds_.push_back(server);
      pumps_.emplace_back([client, server] { Pump(client, server); });
    }
  }

  static void Pump(int a, int b) {
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    std::vector<char> buffer(1 << 16);
    while (::poll(fds, 2, -1) > 0) {
      for (int i = 0; i < 2; ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = ::read(fds[i].fd, buffer.data(), buffer.size());
        if (n <= 0) return;
        for (ssize_t sent = 0; sent < n;) {
          const ssize_t w = ::write(fds[1 - i].fd, buffer.data() + sent, n - sent);
          if (w <= 0) return;
          sent += w;
        }
      }
    }
  }

  const uint16_t upstream_port_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mutex_;
  std::vector<int> open_fds_;
  std::list<std::thread> pumps_;
};

// ---- Fixture ---------------------------------------------------------------------------------

class S3TransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REFIT_REQUIRE_S3_SERVER(s3_, "refit-transport");
    ASSERT_OK_AND_ASSIGN(client_, S3Client::Make(s3_));
    ASSERT_OK(client_->CreateBucket());
  }

  void TearDown() override {
    if (client_ == nullptr) return;
    Result<std::vector<S3ObjectInfo>> left = client_->ListObjects("");
    if (left.ok()) {
      for (const S3ObjectInfo& object : *left) client_->DeleteObject(object.key).IgnoreError();
    }
  }

  // The s3:// URI of this test's bucket under `prefix`, with `extra` parameters ("&a=b…").
  std::string Uri(const std::string& prefix, const std::string& extra = "",
                  const std::string& endpoint = "") const {
    return fmt::format("s3://{}/{}?endpoint={}&region={}&retries=1&timeout_ms=20000{}", s3_.bucket,
                       prefix, endpoint.empty() ? s3_.endpoint : endpoint, s3_.region, extra);
  }

  std::vector<std::string> Keys(const std::string& prefix) const {
    Result<std::vector<S3ObjectInfo>> listed = client_->ListObjects(prefix);
    EXPECT_OK(listed.status());
    std::vector<std::string> keys;
    if (listed.ok()) {
      for (const S3ObjectInfo& object : *listed) keys.push_back(object.key);
    }
    return keys;
  }

  std::unique_ptr<Fleet> StartFleet(const std::string& uri, size_t receivers = 2) {
    auto fleet =
        std::make_unique<Fleet>(FleetOptions{.receivers = receivers,
                                             .producers = 2,
                                             .transport = uri,
                                             .http_control = true,
                                             .transfer_timeout = std::chrono::seconds(60)});
    EXPECT_NO_FATAL_FAILURE(fleet->Start());
    return fleet;
  }

  S3ClientOptions s3_;
  std::unique_ptr<S3Client> client_;
};

uint16_t PortOf(const std::string& endpoint) {
  return static_cast<uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
}

// ---- Live transfers ------------------------------------------------------------------------

TEST_F(S3TransportTest, StepsReachTwoReceiversBitExactlyAndObjectsAreDeleted) {
  std::unique_ptr<Fleet> fleet = StartFleet(Uri("run"));
  for (uint64_t step = 1; step <= 3; ++step) {
    fleet->TrainStep(0.02 * static_cast<double>(step), step);
    ASSERT_OK_AND_ASSIGN(RefitReport report, fleet->Refit());
    EXPECT_EQ(report.plan.target_version, step);
    EXPECT_GE(report.payloads, 2u);
    for (const ReceiverOutcome& receiver : report.receivers) {
      EXPECT_OK(receiver.commit_status);
      EXPECT_EQ(receiver.flush.payloads, report.payloads);
    }
    fleet->ExpectReceiversHold(fleet->ModelSnapshot(step));
    // Every object was deleted once both receivers ACKed it; no upload was left open.
    EXPECT_TRUE(Keys("run/").empty());
    ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> open,
                         client_->ListMultipartUploads("run/"));
    EXPECT_TRUE(open.empty());
  }
}

TEST_F(S3TransportTest, LargePayloadsGoMultipartAndArriveBitExactly) {
  // One 12 MiB fp32 tensor of random bits: its FULL payload does not compress below 5 MiB, so
  // with 5 MiB parts it is a three-part upload, downloaded in three ranged GETs.
  std::vector<OwnedTensor> model = {
      testing::RandomTensor("big.weight", DType::kFloat32, {3 << 20}, 11)};
  auto fleet = std::make_unique<Fleet>(
      FleetOptions{.receivers = 2,
                   .producers = 1,
                   .transport = Uri("big", "&part_size=5242880&parts_in_flight=3"),
                   .http_control = true,
                   .transfer_timeout = std::chrono::seconds(120),
                   .model = model,
                   .chunk_bytes = 64 << 20,
                   .bucket_bytes = 64 << 20});
  ASSERT_NO_FATAL_FAILURE(fleet->Start());
  fleet->TrainStep(0.5, 1);
  ASSERT_OK_AND_ASSIGN(RefitReport report, fleet->coordinator().Refit(/*force_anchor=*/true));
  EXPECT_EQ(report.payloads, 1u);
  EXPECT_GT(report.wire_bytes, uint64_t{10} << 20);
  fleet->ExpectReceiversHold(fleet->ModelSnapshot(1));
  EXPECT_TRUE(Keys("big/").empty());
}

TEST_F(S3TransportTest, WrongCredentialsFailClearlyAndCommitNothing) {
  std::unique_ptr<Fleet> fleet = StartFleet(Uri("creds"));
  const StoreSnapshot at_zero = fleet->ModelSnapshot(0);
  fleet->TrainStep(0.03, 1);
  ::setenv("REFIT_TEST_WRONG_SECRET", "not-the-secret", 1);
  ASSERT_NO_FATAL_FAILURE(
      fleet->SetSenderTransport(Uri("creds", "&secret_key_env=REFIT_TEST_WRONG_SECRET")));
  Result<RefitReport> refused = fleet->Refit();
  EXPECT_STATUS(PermissionDenied, refused);
  EXPECT_NE(refused.status().message().find("SignatureDoesNotMatch"), std::string::npos)
      << refused.status().ToString();
  fleet->ExpectReceiversHold(at_zero);
  fleet->ExpectTrackersAt(0);
  EXPECT_TRUE(Keys("creds/").empty());

  ::setenv("REFIT_TEST_UNKNOWN_KEY", "NOSUCHACCESSKEY", 1);
  ASSERT_NO_FATAL_FAILURE(
      fleet->SetSenderTransport(Uri("creds", "&access_key_env=REFIT_TEST_UNKNOWN_KEY")));
  EXPECT_STATUS(PermissionDenied, fleet->Refit());
  fleet->ExpectReceiversHold(at_zero);

  ASSERT_NO_FATAL_FAILURE(fleet->SetSenderTransport(Uri("creds")));
  ASSERT_OK(fleet->Refit().status());
  fleet->ExpectReceiversHold(fleet->ModelSnapshot(1));
}

TEST_F(S3TransportTest, ServerVanishingMidTransferAbortsAndRollsBack) {
  // Everyone reaches the server through a proxy; cutting it is the server going away.
  TcpProxy proxy(PortOf(s3_.endpoint));
  const uint16_t port = proxy.Start();
  const std::string via_proxy = fmt::format("http://127.0.0.1:{}", port);
  std::unique_ptr<Fleet> fleet = StartFleet(Uri("cut", "", via_proxy));
  fleet->TrainStep(0.02, 1);
  ASSERT_OK(fleet->Refit().status());
  const StoreSnapshot at_one = fleet->ModelSnapshot(1);

  // Cut the server once the first payload of the next transfer is being applied: that one is
  // uploaded and applied, the rest cannot be. (An anchor, so that there are many payloads.)
  std::atomic<bool> cut{false};
  fleet->receivers()[0].before_apply = [&](const PayloadIds&) {
    if (!cut.exchange(true)) proxy.Stop();
  };
  fleet->TrainStep(0.05, 2);
  Result<RefitReport> failed = fleet->coordinator().Refit(/*force_anchor=*/true);
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(failed.status().code() == StatusCode::kUnavailable ||
              failed.status().code() == StatusCode::kDeadlineExceeded)
      << failed.status().ToString();
  EXPECT_TRUE(cut.load());
  fleet->ExpectReceiversHold(at_one);
  fleet->ExpectTrackersAt(1);

  // The server is back: the same step commits, and what the aborted transfer left is deleted.
  fleet->receivers()[0].before_apply = nullptr;
  ASSERT_EQ(proxy.Start(port), port);
  ASSERT_OK(fleet->Refit().status());
  fleet->ExpectReceiversHold(fleet->ModelSnapshot(2));
  EXPECT_TRUE(Keys("cut/").empty());
}

// A prepared receiver and one payload of its transfer stored at the id-derived key.
class ManifestTest : public S3TransportTest {
 protected:
  void PrepareReceiver(const std::string& uri) {
    fleet_ = StartFleet(uri, /*receivers=*/1);
    ASSERT_OK_AND_ASSIGN(config_, internal::ParseS3TransportUri(*TransportUri::Parse(uri)));
    transfer_ = TransferId::Random();
    ASSERT_OK(fleet_->receivers()[0].session->Prepare({transfer_, 0, {}}).status());
    // A FULL item of the first tensor, as a producer's anchor would encode it.
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<internal::DeltaTracker> tracker,
                         internal::DeltaTracker::Make({}));
    ASSERT_OK(tracker->Begin(transfer_, /*force_anchor=*/true).status());
    const OwnedTensor changed = testing::Perturb(fleet_->model()[0], 0.5, 3);
    ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded,
                         tracker->Encode(transfer_, changed.view()));
    std::vector<ItemView> views;
    for (const Item& item : encoded.items) views.push_back(item.view());
    ASSERT_OK_AND_ASSIGN(payload_, EncodePayload(PayloadIds{transfer_, 0, 0, 0, 1}, views));
    manifest_.transfer_id = transfer_;
    manifest_.key = internal::PayloadObjectKey(config_, false, transfer_, 0, 0);
    manifest_.size = payload_.size();
    manifest_.checksum = internal::ObjectChecksum(payload_);
  }

  // POST `manifest` to the receiver's control plane as a producer would.
  httplib::Result Post(const internal::PayloadManifest& manifest) {
    httplib::Client http(fleet_->receivers()[0].server->base_url());
    return http.Post("/v1/manifest", internal::ManifestToJson(manifest), "application/json");
  }

  std::unique_ptr<Fleet> fleet_;
  internal::S3TransportConfig config_;
  TransferId transfer_;
  std::vector<std::byte> payload_;
  internal::PayloadManifest manifest_;
};

TEST_F(ManifestTest, ACorruptedObjectIsDataLossBeforeAnythingDecodesIt) {
  ASSERT_NO_FATAL_FAILURE(PrepareReceiver(Uri("corrupt")));
  std::vector<std::byte> corrupted = payload_;
  corrupted[corrupted.size() / 2] ^= std::byte{0x40};
  ASSERT_OK(client_->PutObject(manifest_.key, corrupted));
  httplib::Result reply = Post(manifest_);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 422) << reply->body;
  EXPECT_NE(reply->body.find("DataLoss"), std::string::npos) << reply->body;
  EXPECT_NE(reply->body.find("checksum"), std::string::npos) << reply->body;
  // Refused before staging: the session never saw it, so nothing decompressed it.
  const ReceiverStatus status = fleet_->receivers()[0].session->GetStatus();
  EXPECT_EQ(status.staged_payloads, 0u);
  EXPECT_EQ(status.applied_payloads, 0u);

  // The intact object is accepted with the same manifest.
  ASSERT_OK(client_->PutObject(manifest_.key, payload_));
  reply = Post(manifest_);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 200) << reply->body;
  EXPECT_EQ(fleet_->receivers()[0].session->GetStatus().staged_payloads, 1u);
}

TEST_F(ManifestTest, AForgedObjectWithoutTheMacIsRefused) {
  ::setenv("REFIT_TEST_MAC_KEY", "a shared secret of the trainer and the fleet", 1);
  ASSERT_NO_FATAL_FAILURE(PrepareReceiver(Uri("mac", "&mac_key_env=REFIT_TEST_MAC_KEY")));
  ASSERT_OK(client_->PutObject(manifest_.key, payload_));
  // A forger can write the bucket and compute checksums, but not the MAC.
  httplib::Result reply = Post(manifest_);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 403) << reply->body;
  EXPECT_NE(reply->body.find("MAC"), std::string::npos) << reply->body;
  internal::PayloadManifest forged = manifest_;
  forged.mac = internal::MacHex("a guessed key", payload_);
  reply = Post(forged);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 403) << reply->body;
  EXPECT_EQ(fleet_->receivers()[0].session->GetStatus().staged_payloads, 0u);

  internal::PayloadManifest genuine = manifest_;
  genuine.mac = internal::MacHex(config_.mac_key, payload_);
  reply = Post(genuine);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 200) << reply->body;
}

TEST_F(S3TransportTest, AFleetWithAMacKeyRefits) {
  ::setenv("REFIT_TEST_MAC_KEY", "a shared secret of the trainer and the fleet", 1);
  std::unique_ptr<Fleet> fleet = StartFleet(Uri("macfleet", "&mac_key_env=REFIT_TEST_MAC_KEY"));
  fleet->TrainStep(0.03, 1);
  ASSERT_OK(fleet->Refit().status());
  const StoreSnapshot at_one = fleet->ModelSnapshot(1);
  fleet->ExpectReceiversHold(at_one);
  // A sender without the key produces payloads the receivers refuse.
  fleet->TrainStep(0.03, 2);
  ASSERT_NO_FATAL_FAILURE(fleet->SetSenderTransport(Uri("macfleet")));
  EXPECT_STATUS(PermissionDenied, fleet->Refit());
  fleet->ExpectReceiversHold(at_one);
}

// ---- Chains --------------------------------------------------------------------------------

std::vector<OwnedTensor> StoreTensors(const WeightStore& store,
                                      const std::vector<OwnedTensor>& like) {
  std::vector<OwnedTensor> tensors;
  for (const OwnedTensor& t : like) {
    const TensorView held = *store.Find(t.name);
    tensors.push_back(OwnedTensor{held.name, held.dtype, held.shape,
                                  std::vector<std::byte>(held.bytes.begin(), held.bytes.end())});
  }
  return tensors;
}

TEST_F(S3TransportTest, ALateReceiverBootstrapsFromTheChainAndJoins) {
  const std::string uri = Uri("chain", "&chain=1");
  std::unique_ptr<Fleet> fleet = StartFleet(uri);
  for (uint64_t step = 1; step <= 4; ++step) {
    fleet->TrainStep(0.03, step);
    ASSERT_OK_AND_ASSIGN(RefitReport report, fleet->Refit());
    // The chain had no version to extend, so the first transfer is an anchor.
    EXPECT_EQ(report.plan.anchor, step == 1);
  }
  fleet->ExpectReceiversHold(fleet->ModelSnapshot(4));
  ASSERT_OK_AND_ASSIGN(ChainIndex index, ReadChainIndex(uri));
  ASSERT_EQ(index.versions.size(), 4u);
  EXPECT_TRUE(index.versions[0].anchor);
  EXPECT_EQ(index.versions.back().version, 4u);

  // A receiver that starts now from another checkpoint (other bytes, same tensors).
  std::unique_ptr<WeightStore> late = WeightStore::Make();
  for (const OwnedTensor& t : testing::FleetModel(99)) ASSERT_OK(late->AddCopy(t.view()));
  late->set_version(0);
  ASSERT_OK_AND_ASSIGN(ChainBootstrapReport report, BootstrapFromChain(uri, *late));
  EXPECT_EQ(report.final_version, 4u);
  EXPECT_EQ(report.versions_replayed, 4u);
  EXPECT_TRUE(report.replayed_anchor);
  EXPECT_EQ(testing::TakeSnapshot(*late), fleet->ModelSnapshot(4));
  EXPECT_EQ(StateFingerprint(late->Digests()), index.versions.back().state_fingerprint);

  // It joins: the next transfer reaches all three, bit-identically.
  fleet->AddReceiver(late->version(), StoreTensors(*late, fleet->model()));
  fleet->TrainStep(0.03, 5);
  ASSERT_OK_AND_ASSIGN(RefitReport joined, fleet->Refit());
  EXPECT_EQ(joined.receivers.size(), 3u);
  fleet->ExpectReceiversHold(fleet->ModelSnapshot(5));

  // A receiver one version behind replays only the newest delta.
  ASSERT_OK_AND_ASSIGN(ChainBootstrapReport again, BootstrapFromChain(uri, *late));
  EXPECT_EQ(again.versions_replayed, 1u);
  EXPECT_FALSE(again.replayed_anchor);
  EXPECT_EQ(testing::TakeSnapshot(*late), fleet->ModelSnapshot(5));
  // And one that is current replays nothing.
  ASSERT_OK_AND_ASSIGN(ChainBootstrapReport current, BootstrapFromChain(uri, *late));
  EXPECT_EQ(current.versions_replayed, 0u);
}

TEST_F(S3TransportTest, AReceiverThatFellBehindCatchesUpFromTheChainAtPrepare) {
  const std::string uri = Uri("behind", "&chain=1");
  auto fleet = std::make_unique<Fleet>(FleetOptions{.receivers = 2,
                                                    .producers = 2,
                                                    .transport = uri,
                                                    .http_control = true,
                                                    .catch_up_chain = uri});
  ASSERT_NO_FATAL_FAILURE(fleet->Start());
  fleet->TrainStep(0.03, 1);
  ASSERT_OK(fleet->Refit().status());
  const std::vector<OwnedTensor> at_one = fleet->model();
  for (uint64_t step = 2; step <= 3; ++step) {
    fleet->TrainStep(0.03, step);
    ASSERT_OK(fleet->Refit().status());
  }
  // Receiver 1 comes back from version 1 (it was cut off for two transfers).
  ASSERT_NO_FATAL_FAILURE(fleet->RestartReceiver(1, 1, at_one));
  fleet->TrainStep(0.03, 4);
  ASSERT_OK_AND_ASSIGN(RefitReport report, fleet->Refit());
  EXPECT_FALSE(report.plan.anchor);
  fleet->ExpectReceiversHold(fleet->ModelSnapshot(4));

  // One that holds no version of the chain cannot catch up: the transfer aborts, naming why.
  ASSERT_NO_FATAL_FAILURE(fleet->RestartReceiver(1, 1, testing::FleetModel(77)));
  fleet->TrainStep(0.03, 5);
  Result<RefitReport> refused = fleet->Refit();
  EXPECT_STATUS(FailedPrecondition, refused);
  EXPECT_NE(refused.status().message().find("--bootstrap"), std::string::npos)
      << refused.status().ToString();
}

TEST_F(S3TransportTest, PruningKeepsTheActiveChainOnly) {
  const std::string uri = Uri("prune", "&chain=1");
  std::unique_ptr<Fleet> fleet = StartFleet(uri, /*receivers=*/1);
  // Versions A1 d2 d3 A4 d5: retention 0 keeps A4 d5.
  for (uint64_t step = 1; step <= 5; ++step) {
    fleet->TrainStep(0.02, step);
    ASSERT_OK(fleet->coordinator().Refit(/*force_anchor=*/step == 4).status());
  }
  ASSERT_OK_AND_ASSIGN(ChainIndex index, ReadChainIndex(uri));
  ASSERT_EQ(index.versions.size(), 2u);
  EXPECT_EQ(index.versions[0].version, 4u);
  EXPECT_TRUE(index.versions[0].anchor);
  // Only the kept versions' objects and the index remain.
  size_t kept_objects = 1;
  for (const ChainVersion& v : index.versions) kept_objects += v.payloads.size();
  EXPECT_EQ(Keys("prune/").size(), kept_objects);
  // A bootstrap from the pruned chain still ends at the trainer's state.
  std::unique_ptr<WeightStore> late = WeightStore::Make();
  for (const OwnedTensor& t : testing::FleetModel(5)) ASSERT_OK(late->AddCopy(t.view()));
  ASSERT_OK_AND_ASSIGN(ChainBootstrapReport report, BootstrapFromChain(uri, *late));
  EXPECT_EQ(report.versions_replayed, 2u);
  EXPECT_EQ(testing::TakeSnapshot(*late), fleet->ModelSnapshot(5));
}

TEST_F(S3TransportTest, ARestartedRunStartsANewChainUnderTheSamePrefix) {
  const std::string uri = Uri("restart", "&chain=1");
  {
    std::unique_ptr<Fleet> first_run = StartFleet(uri, /*receivers=*/1);
    for (uint64_t step = 1; step <= 3; ++step) {
      first_run->TrainStep(0.03, step);
      ASSERT_OK(first_run->Refit().status());
    }
  }
  ASSERT_OK_AND_ASSIGN(const ChainIndex old_index, ReadChainIndex(uri));
  ASSERT_EQ(old_index.versions.back().version, 3u);

  // A new run from version 0 (another seed: other weights) under the same prefix.
  auto second_run = std::make_unique<Fleet>(FleetOptions{
      .receivers = 1, .producers = 2, .transport = uri, .http_control = true, .seed = 1234});
  ASSERT_NO_FATAL_FAILURE(second_run->Start());
  for (uint64_t step = 1; step <= 2; ++step) {
    second_run->TrainStep(0.03, step);
    ASSERT_OK_AND_ASSIGN(RefitReport report, second_run->Refit());
    EXPECT_EQ(report.plan.anchor, step == 1);
  }
  ASSERT_OK_AND_ASSIGN(const ChainIndex index, ReadChainIndex(uri));
  ASSERT_EQ(index.versions.size(), 2u);
  EXPECT_EQ(index.versions[0].version, 1u);
  EXPECT_NE(index.versions[0].transfer_id, old_index.versions[0].transfer_id);
  // The old run's objects are gone; only the new chain and its index remain.
  size_t kept_objects = 1;
  for (const ChainVersion& v : index.versions) kept_objects += v.payloads.size();
  EXPECT_EQ(Keys("restart/").size(), kept_objects);
  std::unique_ptr<WeightStore> late = WeightStore::Make();
  for (const OwnedTensor& t : testing::FleetModel(5)) ASSERT_OK(late->AddCopy(t.view()));
  ASSERT_OK(BootstrapFromChain(uri, *late).status());
  EXPECT_EQ(testing::TakeSnapshot(*late), second_run->ModelSnapshot(2));
}

TEST_F(S3TransportTest, AForgedOrCorruptedChainIsRefusedAndTheStoreKept) {
  const std::string mac_key = "a shared secret of the trainer and the fleet";
  ::setenv("REFIT_TEST_MAC_KEY", mac_key.c_str(), 1);
  const std::string signed_uri = Uri("forged", "&chain=1&mac_key_env=REFIT_TEST_MAC_KEY");
  std::unique_ptr<Fleet> fleet = StartFleet(signed_uri, /*receivers=*/1);
  for (uint64_t step = 1; step <= 2; ++step) {
    fleet->TrainStep(0.03, step);
    ASSERT_OK(fleet->Refit().status());
  }
  ASSERT_OK_AND_ASSIGN(ChainIndex index, ReadChainIndex(signed_uri));
  const std::vector<OwnedTensor> stale = testing::FleetModel(99);
  auto fresh_store = [&] {
    std::unique_ptr<WeightStore> store = WeightStore::Make();
    for (const OwnedTensor& t : stale) EXPECT_OK(store->AddCopy(t.view()));
    store->set_version(0);
    return store;
  };

  // A forger rewrites the index without the key: refused before any payload is read.
  const std::string index_key = "forged/chain/index.json";
  const std::string unsigned_index = SerializeChainIndex(index, "");
  ASSERT_OK(client_->PutObject(index_key, std::as_bytes(std::span(unsigned_index))));
  std::unique_ptr<WeightStore> store = fresh_store();
  const StoreSnapshot before = testing::TakeSnapshot(*store);
  EXPECT_STATUS(PermissionDenied, BootstrapFromChain(signed_uri, *store));
  EXPECT_EQ(testing::TakeSnapshot(*store), before);

  // A forged payload object under a correctly signed index: its MAC fails.
  const std::string signed_index = SerializeChainIndex(index, mac_key);
  ASSERT_OK(client_->PutObject(index_key, std::as_bytes(std::span(signed_index))));
  const ChainPayload& victim = index.versions[1].payloads[0];
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> original, client_->GetObject(victim.key));
  std::vector<std::byte> forged = original;
  forged[forged.size() - 1] ^= std::byte{1};
  ASSERT_OK(client_->PutObject(victim.key, forged));
  // The signed index's checksum no longer matches the object: DataLoss, before the MAC.
  EXPECT_STATUS(DataLoss, BootstrapFromChain(signed_uri, *store));
  // The anchor (version 1) verified and committed; version 2 was rolled back.
  EXPECT_EQ(store->version(), 1u);
  EXPECT_EQ(store->RecomputeDigests(), store->Digests());
  EXPECT_EQ(StateFingerprint(store->Digests()), index.versions[0].state_fingerprint);

  // Restored, the chain replays to the end.
  ASSERT_OK(client_->PutObject(victim.key, original));
  ASSERT_OK_AND_ASSIGN(ChainBootstrapReport report, BootstrapFromChain(signed_uri, *store));
  EXPECT_EQ(report.final_version, 2u);
  EXPECT_EQ(testing::TakeSnapshot(*store), fleet->ModelSnapshot(2));
}

}  // namespace
}  // namespace refit
