// The real S3 server the integration tests run against, as scripts/s3-test-server.sh describes it
// in the environment (scripts/test.sh starts the server and exports these):
//
//   REFIT_TEST_S3_ENDPOINT   e.g. http://127.0.0.1:7480 (unset: S3 tests skip, with a message)
//   REFIT_TEST_S3_REQUIRED   "1": a missing endpoint fails the test instead of skipping it, so CI
//                            cannot pass by silently not testing S3
//   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   the server's test user
//   AWS_REGION               optional; default us-east-1
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <random>
#include <string>

#include "transport/s3/s3_client.h"

namespace refit::testing {

/// The test server's client options for `bucket`, or nullopt when no server is configured.
inline std::optional<S3ClientOptions> S3TestServerOptions(const std::string& bucket) {
  const char* endpoint = std::getenv("REFIT_TEST_S3_ENDPOINT");
  if (endpoint == nullptr || *endpoint == '\0') return std::nullopt;
  S3ClientOptions options;
  options.endpoint = endpoint;
  if (const char* region = std::getenv("AWS_REGION"); region != nullptr && *region != '\0') {
    options.region = region;
  }
  options.bucket = bucket;
  auto credentials = S3CredentialsFromEnvironment();
  if (credentials.ok()) options.credentials = *credentials;
  // Tests that stop the server need failures fast; the defaults wait minutes.
  options.max_retries = 2;
  options.retry_backoff = std::chrono::milliseconds(20);
  options.max_retry_backoff = std::chrono::milliseconds(200);
  options.connect_timeout = std::chrono::seconds(3);
  options.stall_timeout = std::chrono::seconds(10);
  return options;
}

/// A bucket name no other test run uses: "<stem>-<random hex>".
inline std::string UniqueBucketName(const std::string& stem) {
  std::random_device device;
  const uint64_t tag = (uint64_t{device()} << 32) | device();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(tag));
  return stem + "-" + hex;
}

/// Whether the environment demands the server (REFIT_TEST_S3_REQUIRED=1).
inline bool S3TestServerRequired() {
  const char* required = std::getenv("REFIT_TEST_S3_REQUIRED");
  return required != nullptr && std::string(required) == "1";
}

}  // namespace refit::testing

/// In a test body or fixture SetUp: skip when no S3 test server is configured, or fail when the
/// environment requires one. Assigns the server's options for a fresh bucket to `options_var`.
#define REFIT_REQUIRE_S3_SERVER(options_var, bucket_stem)                                       \
  do {                                                                                          \
    auto _s3 =                                                                                  \
        ::refit::testing::S3TestServerOptions(::refit::testing::UniqueBucketName(bucket_stem)); \
    if (!_s3.has_value()) {                                                                     \
      if (::refit::testing::S3TestServerRequired()) {                                           \
        FAIL() << "REFIT_TEST_S3_REQUIRED=1 but REFIT_TEST_S3_ENDPOINT is not set";             \
      }                                                                                         \
      GTEST_SKIP() << "no S3 test server: start scripts/s3-test-server.sh and export its env";  \
    }                                                                                           \
    options_var = *_s3;                                                                         \
  } while (false)
