// S3Client against a real S3 server (Ceph RGW from scripts/s3-test-server.sh; see
// tests/s3_test_env.h): every request is signed by our SigV4 signer and checked by the server,
// and every reply is parsed from the server's own XML.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "loopback.h"
#include "s3_test_env.h"
#include "test_util.h"
#include "transport/s3/s3_client.h"

namespace refit {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<std::byte> RandomBytes(size_t size, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::vector<std::byte> bytes(size);
  for (std::byte& b : bytes) b = static_cast<std::byte>(generator());
  return bytes;
}

std::span<const std::byte> AsBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

class S3ClientIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REFIT_REQUIRE_S3_SERVER(options_, "refit-s3client");
    ASSERT_OK_AND_ASSIGN(client_, S3Client::Make(options_));
    ASSERT_OK(client_->CreateBucket());
  }

  // Leave the bucket empty: no objects, no pending uploads.
  void TearDown() override {
    if (client_ == nullptr) return;
    auto uploads = client_->ListMultipartUploads("");
    if (uploads.ok()) {
      for (const S3MultipartUpload& upload : *uploads) {
        client_->AbortMultipartUpload(upload.key, upload.upload_id).IgnoreError();
      }
    }
    auto objects = client_->ListObjects("");
    if (objects.ok()) {
      for (const S3ObjectInfo& object : *objects) client_->DeleteObject(object.key).IgnoreError();
    }
  }

  // A client of the same server with different options.
  std::unique_ptr<S3Client> ClientWith(const S3ClientOptions& options) {
    auto client = S3Client::Make(options);
    EXPECT_OK(client);
    return client.ok() ? std::move(client).ValueOrDie() : nullptr;
  }

  S3ClientOptions options_;
  std::unique_ptr<S3Client> client_;
};

TEST_F(S3ClientIntegrationTest, PutGetHeadListDelete) {
  // Keys with bytes that must be percent-encoded (and signed) exactly as sent.
  const std::vector<std::string> keys = {"dir/a b+c=d&e~f(1)*!.bin", "dir/plain",
                                         "dir/\xc3\xbc/\xc3\xb1%41", "dir/x/./y"};
  std::vector<std::vector<std::byte>> contents;
  for (size_t i = 0; i < keys.size(); ++i) {
    contents.push_back(RandomBytes(1000 + i * 37, i));
    ASSERT_OK(client_->PutObject(keys[i], contents.back()));
  }
  ASSERT_OK(client_->PutObject("elsewhere", AsBytes("not listed under dir/")));
  ASSERT_OK(client_->PutObject("dir/empty", {}));

  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client_->GetObject(keys[i]));
    EXPECT_EQ(read, contents[i]) << keys[i];
    ASSERT_OK_AND_ASSIGN(S3ObjectInfo info, client_->HeadObject(keys[i]));
    EXPECT_EQ(info.size, contents[i].size());
    EXPECT_EQ(info.key, keys[i]);
    EXPECT_FALSE(info.etag.empty());
    EXPECT_EQ(info.etag.find('"'), std::string::npos) << info.etag;
  }
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> empty, client_->GetObject("dir/empty"));
  EXPECT_TRUE(empty.empty());

  ASSERT_OK_AND_ASSIGN(std::vector<S3ObjectInfo> listed, client_->ListObjects("dir/"));
  std::vector<std::string> expected_keys = keys;
  expected_keys.push_back("dir/empty");
  std::sort(expected_keys.begin(), expected_keys.end());
  ASSERT_EQ(listed.size(), expected_keys.size());
  for (size_t i = 0; i < listed.size(); ++i) {
    EXPECT_EQ(listed[i].key, expected_keys[i]);
    ASSERT_OK_AND_ASSIGN(S3ObjectInfo head, client_->HeadObject(listed[i].key));
    EXPECT_EQ(listed[i].size, head.size);
    EXPECT_EQ(listed[i].etag, head.etag);
  }

  ASSERT_OK(client_->DeleteObject(keys[0]));
  EXPECT_STATUS_MSG(NotFound, "NoSuchKey", client_->GetObject(keys[0]));
  EXPECT_STATUS(NotFound, client_->HeadObject(keys[0]));
  // Deleting again is what S3 calls success.
  EXPECT_OK(client_->DeleteObject(keys[0]));
  ASSERT_OK_AND_ASSIGN(listed, client_->ListObjects("dir/"));
  EXPECT_EQ(listed.size(), expected_keys.size() - 1);
}

TEST_F(S3ClientIntegrationTest, ListingsFollowContinuationWithSmallPages) {
  S3ClientOptions small_pages = options_;
  small_pages.list_page_size = 2;
  std::unique_ptr<S3Client> client = ClientWith(small_pages);
  ASSERT_NE(client, nullptr);
  std::vector<std::string> keys;
  for (int i = 0; i < 7; ++i) {
    keys.push_back("page/" + std::to_string(i));
    ASSERT_OK(client->PutObject(keys.back(), AsBytes(keys.back())));
  }
  ASSERT_OK_AND_ASSIGN(std::vector<S3ObjectInfo> listed, client->ListObjects("page/"));
  ASSERT_EQ(listed.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(listed[i].key, keys[i]);

  std::vector<std::string> upload_ids;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(std::string id,
                         client->CreateMultipartUpload("pending/" + std::to_string(i)));
    upload_ids.push_back(id);
  }
  S3ClientOptions one_per_page = options_;
  one_per_page.list_page_size = 1;
  std::unique_ptr<S3Client> paged = ClientWith(one_per_page);
  ASSERT_NE(paged, nullptr);
  ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> uploads,
                       paged->ListMultipartUploads("pending/"));
  ASSERT_EQ(uploads.size(), upload_ids.size());
  for (size_t i = 0; i < uploads.size(); ++i) {
    EXPECT_EQ(uploads[i].key, "pending/" + std::to_string(i));
    EXPECT_EQ(uploads[i].upload_id, upload_ids[i]);
  }
}

TEST_F(S3ClientIntegrationTest, RangedGets) {
  const std::vector<std::byte> object = RandomBytes(1000, 7);
  ASSERT_OK(client_->PutObject("ranged", object));
  std::vector<std::byte> window(50);
  ASSERT_OK(client_->GetObjectRange("ranged", 100, window));
  EXPECT_TRUE(std::equal(window.begin(), window.end(), object.begin() + 100));
  std::vector<std::byte> tail(10);
  ASSERT_OK(client_->GetObjectRange("ranged", 990, tail));
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), object.begin() + 990));

  // Past the end: 416.
  EXPECT_STATUS_MSG(FailedPrecondition, "416", client_->GetObjectRange("ranged", 1000, window));
  // Straddling the end: the server sends fewer bytes than asked for.
  std::vector<std::byte> straddle(20);
  EXPECT_STATUS(DataLoss, client_->GetObjectRange("ranged", 990, straddle));
  EXPECT_STATUS(NotFound, client_->GetObjectRange("missing", 0, window));
}

TEST_F(S3ClientIntegrationTest, GetObjectRefusesObjectsOverMaxBytes) {
  ASSERT_OK(client_->PutObject("big", RandomBytes(4096, 1)));
  EXPECT_STATUS_MSG(ResourceExhausted, "max_bytes", client_->GetObject("big", 4095));
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> exact, client_->GetObject("big", 4096));
  EXPECT_EQ(exact.size(), 4096u);
}

TEST_F(S3ClientIntegrationTest, MultipartStepsCompleteAndReadBack) {
  const std::vector<std::byte> object = RandomBytes(2 * 5 * kMiB + 1234, 11);
  ASSERT_OK_AND_ASSIGN(std::string upload_id, client_->CreateMultipartUpload("multi/object"));
  std::vector<std::string> etags;
  for (uint32_t part = 0; part < 3; ++part) {
    const uint64_t offset = part * 5 * kMiB;
    const uint64_t length = std::min<uint64_t>(5 * kMiB, object.size() - offset);
    ASSERT_OK_AND_ASSIGN(std::string etag,
                         client_->UploadPart("multi/object", upload_id, part + 1,
                                             std::span(object).subspan(offset, length)));
    EXPECT_EQ(etag.find('"'), std::string::npos) << etag;
    etags.push_back(etag);
  }
  ASSERT_OK(client_->CompleteMultipartUpload("multi/object", upload_id, etags));
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client_->GetObject("multi/object"));
  EXPECT_EQ(read, object);
  ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> pending,
                       client_->ListMultipartUploads("multi/"));
  EXPECT_TRUE(pending.empty());
  // The upload is gone once completed.
  EXPECT_STATUS_MSG(NotFound, "NoSuchUpload",
                    client_->AbortMultipartUpload("multi/object", upload_id));
}

TEST_F(S3ClientIntegrationTest, AbortRemovesTheUploadAndLeavesNoObject) {
  ASSERT_OK_AND_ASSIGN(std::string upload_id, client_->CreateMultipartUpload("aborted/object"));
  ASSERT_OK(client_->UploadPart("aborted/object", upload_id, 1, RandomBytes(5 * kMiB, 3)).status());
  ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> before,
                       client_->ListMultipartUploads("aborted/"));
  ASSERT_EQ(before.size(), 1u);
  EXPECT_EQ(before[0].key, "aborted/object");
  EXPECT_EQ(before[0].upload_id, upload_id);

  ASSERT_OK(client_->AbortMultipartUpload("aborted/object", upload_id));
  ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> after,
                       client_->ListMultipartUploads("aborted/"));
  EXPECT_TRUE(after.empty());
  EXPECT_STATUS(NotFound, client_->HeadObject("aborted/object"));
  EXPECT_STATUS(NotFound, client_->GetObject("aborted/object"));
  EXPECT_STATUS_MSG(NotFound, "NoSuchUpload",
                    client_->AbortMultipartUpload("aborted/object", upload_id));
}

TEST_F(S3ClientIntegrationTest, CompletingAnUndersizedPartIsEntityTooSmall) {
  ASSERT_OK_AND_ASSIGN(std::string upload_id, client_->CreateMultipartUpload("small/object"));
  std::vector<std::string> etags;
  for (uint32_t part = 1; part <= 2; ++part) {
    ASSERT_OK_AND_ASSIGN(std::string etag, client_->UploadPart("small/object", upload_id, part,
                                                               RandomBytes(kMiB, part)));
    etags.push_back(etag);
  }
  EXPECT_STATUS_MSG(InvalidArgument, "EntityTooSmall",
                    client_->CompleteMultipartUpload("small/object", upload_id, etags));
  ASSERT_OK(client_->AbortMultipartUpload("small/object", upload_id));
}

TEST_F(S3ClientIntegrationTest, UploadAndDownloadInParallelParts) {
  const S3TransferOptions transfer{.part_size = S3TransferOptions::kMinPartSize,
                                   .max_parts_in_flight = 4};
  // Five parts, the last one short.
  const std::vector<std::byte> object = RandomBytes(4 * transfer.part_size + 777, 21);
  ASSERT_OK(client_->Upload("parallel/object", object, transfer));
  ASSERT_OK_AND_ASSIGN(S3ObjectInfo info, client_->HeadObject("parallel/object"));
  EXPECT_EQ(info.size, object.size());
  // A multipart ETag is "<md5 of the part md5s>-<part count>".
  EXPECT_NE(info.etag.find("-5"), std::string::npos) << info.etag;
  ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> pending,
                       client_->ListMultipartUploads("parallel/"));
  EXPECT_TRUE(pending.empty());

  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read,
                       client_->Download("parallel/object", object.size(), transfer));
  EXPECT_TRUE(read == object) << "parallel ranged download differs from the upload";
  EXPECT_STATUS(DataLoss, client_->Download("parallel/object", object.size() + 1, transfer));
  EXPECT_STATUS(DataLoss, client_->Download("parallel/object", object.size() - 1, transfer));
  EXPECT_STATUS(DataLoss,
                client_->Download("parallel/object", object.size() + transfer.part_size, transfer));

  // At or below part_size: one PUT and one GET.
  const std::vector<std::byte> small = RandomBytes(1000, 22);
  ASSERT_OK(client_->Upload("parallel/small", small, transfer));
  ASSERT_OK_AND_ASSIGN(info, client_->HeadObject("parallel/small"));
  EXPECT_EQ(info.etag.find('-'), std::string::npos) << "single PUT expected: " << info.etag;
  ASSERT_OK_AND_ASSIGN(read, client_->Download("parallel/small", small.size(), transfer));
  EXPECT_EQ(read, small);
  EXPECT_STATUS(DataLoss, client_->Download("parallel/small", small.size() + 1, transfer));
}

TEST_F(S3ClientIntegrationTest, WrongSecretIsSignatureDoesNotMatch) {
  S3ClientOptions wrong = options_;
  wrong.credentials.secret_access_key += "x";
  std::unique_ptr<S3Client> client = ClientWith(wrong);
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(PermissionDenied, "SignatureDoesNotMatch",
                    client->PutObject("denied", AsBytes("x")));
  EXPECT_STATUS_MSG(PermissionDenied, "SignatureDoesNotMatch", client->ListObjects(""));
  // HEAD replies have no body: the status alone says it.
  EXPECT_STATUS_MSG(PermissionDenied, "HTTP 403", client->HeadObject("denied"));
}

TEST_F(S3ClientIntegrationTest, UnknownAccessKeyIsInvalidAccessKeyId) {
  S3ClientOptions unknown = options_;
  unknown.credentials.access_key_id = "NOSUCHACCESSKEY";
  std::unique_ptr<S3Client> client = ClientWith(unknown);
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(PermissionDenied, "InvalidAccessKeyId", client->GetObject("anything"));
}

TEST_F(S3ClientIntegrationTest, MissingBucketIsNotFound) {
  S3ClientOptions other = options_;
  other.bucket = testing::UniqueBucketName("refit-s3client-missing");
  std::unique_ptr<S3Client> client = ClientWith(other);
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(NotFound, "NoSuchBucket", client->GetObject("anything"));
  EXPECT_STATUS_MSG(NotFound, "NoSuchBucket", client->ListObjects(""));
  EXPECT_STATUS_MSG(NotFound, "NoSuchBucket", client->PutObject("anything", AsBytes("x")));
}

TEST_F(S3ClientIntegrationTest, CreatingAnOwnedBucketAgainIsOk) {
  EXPECT_OK(client_->CreateBucket());
}

TEST_F(S3ClientIntegrationTest, VirtualHostAddressing) {
  // RGW resolves buckets from the Host header when it knows its DNS name, which the test
  // server sets to "localhost" (rgw dns name); libcurl resolves "<bucket>.localhost" to loopback.
  S3ClientOptions virtual_host = options_;
  const std::string prefix = "http://127.0.0.1:";
  if (!virtual_host.endpoint.starts_with(prefix)) GTEST_SKIP() << "endpoint is not loopback";
  virtual_host.endpoint = "http://localhost:" + virtual_host.endpoint.substr(prefix.size());
  virtual_host.addressing = S3Addressing::kVirtualHost;
  std::unique_ptr<S3Client> client = ClientWith(virtual_host);
  ASSERT_NE(client, nullptr);
  const std::vector<std::byte> object = RandomBytes(300, 5);
  ASSERT_OK(client->PutObject("virtual/key with space", object));
  // Path-style reads see what the virtual-host write stored.
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client_->GetObject("virtual/key with space"));
  EXPECT_EQ(read, object);
  ASSERT_OK_AND_ASSIGN(std::vector<S3ObjectInfo> listed, client->ListObjects("virtual/"));
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].key, "virtual/key with space");
}

TEST(S3ClientUnreachableTest, ClosedPortIsUnavailableAfterRetries) {
  S3ClientOptions options;
  REFIT_REQUIRE_S3_SERVER(options, "refit-s3client");
  const std::string closed = "http://" + testing::FreeLoopbackEndpoint();
  options.endpoint = closed;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<S3Client> client, S3Client::Make(options));
  const std::string attempts = "after " + std::to_string(options.max_retries + 1) + " attempts";
  EXPECT_STATUS_MSG(Unavailable, attempts, client->PutObject("key", AsBytes("x")));
  EXPECT_STATUS_MSG(Unavailable, attempts, client->GetObject("key"));
}

}  // namespace
}  // namespace refit
