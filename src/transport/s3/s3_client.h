// S3Client: the subset of the Amazon S3 REST API the s3:// transport needs, on libcurl with our
// own SigV4 signer (sigv4.h), so that every request is signed the same way whatever the
// libcurl version (curl's built-in CURLOPT_AWS_SIGV4 neither adds x-amz-content-sha256 nor sorts
// query parameters).
//
//   PutObject / Upload (single PUT, or multipart with bounded parts in flight, aborted on failure)
//   CreateMultipartUpload / UploadPart / CompleteMultipartUpload / AbortMultipartUpload
//   GetObject (whole or ranged) / Download (parallel ranged GETs into one buffer)
//   HeadObject / DeleteObject / ListObjects (by prefix) / ListMultipartUploads / CreateBucket
//
// Retries: a connection error, a timeout, HTTP 5xx, 408, 429, and a throttling or transient code
// in any reply (SlowDown, Throttling, ThrottlingException, RequestLimitExceeded,
// TooManyRequestsException, InternalError, ServiceUnavailable, RequestTimeout) are retried up to
// max_retries times with exponential backoff from retry_backoff, capped at max_retry_backoff, with
// full jitter. A reply body cut short (fewer bytes than its Content-Length: a connection that
// dropped mid-transfer) is retried the same way. Every other 4xx is final: repeating it cannot
// help. CompleteMultipartUpload can fail after S3 has sent "200 OK": the error then arrives in the
// body and is treated as if it had its own status.
//
// Errors carry S3's own words: "S3 PUT bucket/key (PutObject): HTTP 403 SignatureDoesNotMatch:
// <message> (request id <id>)", plus "; gave up after N attempts" once retries ran out. Codes map
// to Status as: NoSuchKey/NoSuchBucket/NoSuchUpload/404 → NotFound;
// AccessDenied/SignatureDoesNotMatch/InvalidAccessKeyId/403 → PermissionDenied;
// BucketAlreadyExists/409 → AlreadyExists; EntityTooSmall/InvalidPart/InvalidPartOrder/
// InvalidArgument/400 → InvalidArgument; 412/416 → FailedPrecondition; retries exhausted on 5xx,
// throttling or a connection error → Unavailable; a timeout (or 408) → DeadlineExceeded; a reply
// that does not parse, or a body whose length is not what the headers announced → DataLoss;
// other 3xx/4xx replies (e.g. PermanentRedirect: wrong endpoint or region) → InvalidArgument.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"
#include "transport/s3/sigv4.h"

namespace refit {

/// How a bucket is named in a request URL.
enum class S3Addressing {
  /// http(s)://<endpoint host>/<bucket>/<key>: works with every server, and the only choice for
  /// a bucket name with dots under TLS or a bare IP endpoint.
  kPath,
  /// http(s)://<bucket>.<endpoint host>/<key>: AWS's default.
  kVirtualHost,
};

/// Options of S3Client::Make.
struct S3ClientOptions {
  /// "http://host:port" or "https://host[:port]", without a path. Empty: AWS,
  /// "https://s3.<region>.amazonaws.com".
  std::string endpoint;
  /// The SigV4 signing region; must not be empty.
  std::string region = "us-east-1";
  /// The bucket every call addresses (3–63 characters of [a-z0-9.-], as S3 requires).
  std::string bucket;
  S3Addressing addressing = S3Addressing::kPath;
  /// Must hold an access key id and a secret (S3CredentialsFromEnvironment reads the usual
  /// environment variables).
  SigV4Credentials credentials;
  /// Limit of establishing a connection.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(10)};
  /// A request is abandoned (and retried) when fewer than 1 KiB/s flow for this long: a dead
  /// peer is detected without capping how long a large, healthy transfer may take.
  std::chrono::milliseconds stall_timeout{std::chrono::seconds(30)};
  /// Extra attempts of a retryable failure (see the file comment).
  int max_retries = 5;
  /// Ceiling of the first retry's random delay; it doubles per retry up to max_retry_backoff.
  std::chrono::milliseconds retry_backoff{std::chrono::milliseconds(100)};
  std::chrono::milliseconds max_retry_backoff{std::chrono::seconds(5)};
  /// Entries asked for per ListObjects / ListMultipartUploads request, in [1, 1000] (S3's
  /// maximum and default). Smaller pages cost more requests; tests use them to exercise paging.
  uint32_t list_page_size = 1000;
  /// HTTPS: a PEM file of certificates to trust; empty uses the system's store.
  std::string tls_ca_cert_path;
  /// HTTPS: verify the server's certificate and host name. Turn off only for tests.
  bool tls_verify = true;
};

/// Read credentials from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and (optional)
/// AWS_SESSION_TOKEN. Errors: NotFound naming the variable that is unset or empty.
Result<SigV4Credentials> S3CredentialsFromEnvironment();

/// One object of a listing or a HEAD.
struct S3ObjectInfo {
  std::string key;
  uint64_t size = 0;
  /// As the server sent it, without quotes.
  std::string etag;
};

/// One multipart upload that was created and neither completed nor aborted.
struct S3MultipartUpload {
  std::string key;
  std::string upload_id;
};

/// How Upload and Download split an object.
struct S3TransferOptions {
  /// S3's smallest part (every part but the last must be at least this large).
  static constexpr uint64_t kMinPartSize = uint64_t{5} << 20;
  /// S3's largest part and largest part count.
  static constexpr uint64_t kMaxPartSize = uint64_t{5} << 30;
  static constexpr uint32_t kMaxParts = 10000;

  /// Objects up to this size go in one PUT (or one GET); larger ones in parts of this size (the
  /// last smaller). Must be within [kMinPartSize, kMaxPartSize].
  uint64_t part_size = uint64_t{64} << 20;
  /// Parts transferred concurrently by one call (≥ 1).
  size_t max_parts_in_flight = 8;
};

/// A client of one bucket.
///
/// Every call taking a key refuses an empty key or one over S3's 1024 bytes (InvalidArgument)
/// before sending anything; calls taking an upload id refuse an empty one likewise.
///
/// Thread-safety: every member function may be called concurrently from any thread. Connections
/// are kept alive and reused between calls.
class S3Client {
 public:
  /// Validate the options; connects nothing yet.
  /// Errors: InvalidArgument naming the option (an endpoint that is not http(s)://host[:port], an
  /// empty region, a malformed bucket name, empty credentials, a negative retry count, a
  /// timeout that is not positive, a negative backoff, list_page_size outside [1, 1000], or
  /// virtual-host addressing where it cannot work: an IP-address endpoint, or a bucket name with
  /// dots over HTTPS, which no wildcard certificate covers); Internal when libcurl cannot be
  /// initialised.
  static Result<std::unique_ptr<S3Client>> Make(const S3ClientOptions& options);

  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  /// Create the bucket. A bucket this account already owns is not an error.
  Status CreateBucket();

  /// PUT `bytes` as `key` in one request (S3's limit for that is 5 GiB).
  Status PutObject(std::string_view key, std::span<const std::byte> bytes);

  /// Upload `bytes` as `key`: one PUT up to options.part_size, a multipart upload beyond (parts
  /// of part_size, at most max_parts_in_flight at once). A multipart upload that fails is
  /// aborted before returning, so no parts are left stored. Errors: InvalidArgument for options
  /// out of range or an object needing more than kMaxParts parts; those of the requests.
  Status Upload(std::string_view key, std::span<const std::byte> bytes,
                const S3TransferOptions& options = {});

  /// The steps of a multipart upload. Part numbers are 1 … 10000; CompleteMultipartUpload takes
  /// the ETags of parts 1 … n in order.
  Result<std::string> CreateMultipartUpload(std::string_view key);
  /// Return the part's ETag.
  Result<std::string> UploadPart(std::string_view key, std::string_view upload_id,
                                 uint32_t part_number, std::span<const std::byte> bytes);
  Status CompleteMultipartUpload(std::string_view key, std::string_view upload_id,
                                 const std::vector<std::string>& part_etags);
  /// Aborting an upload that no longer exists (completed, aborted) is NotFound.
  Status AbortMultipartUpload(std::string_view key, std::string_view upload_id);
  /// Uploads under `prefix` that were created and neither completed nor aborted.
  Result<std::vector<S3MultipartUpload>> ListMultipartUploads(std::string_view prefix);

  /// GET the whole object. Errors: NotFound; DataLoss when the body's length differs from the
  /// reply's Content-Length; ResourceExhausted when the object is larger than `max_bytes`
  /// (checked before reading the body).
  Result<std::vector<std::byte>> GetObject(std::string_view key, uint64_t max_bytes = UINT64_MAX);
  /// GET bytes [offset, offset + length) into `out` (whose size is `length`); an empty `out`
  /// sends no request. Errors: as GetObject; FailedPrecondition (416) past the end; DataLoss for
  /// a short or long body, or a reply for another range (Content-Range).
  Status GetObjectRange(std::string_view key, uint64_t offset, std::span<std::byte> out);
  /// Download an object of `size` bytes (from HeadObject or a manifest): one GET up to
  /// options.part_size, else ranged GETs of part_size, max_parts_in_flight at once. Errors: as
  /// GetObjectRange; DataLoss when the object's size is not `size`.
  Result<std::vector<std::byte>> Download(std::string_view key, uint64_t size,
                                          const S3TransferOptions& options = {});

  /// HEAD. Errors: NotFound.
  Result<S3ObjectInfo> HeadObject(std::string_view key);
  /// DELETE. Deleting a key that does not exist is OK (as S3 answers it).
  Status DeleteObject(std::string_view key);
  /// Every object whose key starts with `prefix`, in key order (ListObjectsV2, following
  /// continuation tokens).
  Result<std::vector<S3ObjectInfo>> ListObjects(std::string_view prefix);

  const S3ClientOptions& options() const;

 private:
  struct Impl;
  explicit S3Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
