// Constant-time API-key checks, shared by every place a peer presents a key: the control
// plane's HTTP requests (control/auth.h reads the key from the headers) and the zmq:// relay's
// requests (docs/security.md). Below both layers, so neither depends on the other.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace refit::internal {

/// The outcome of checking one request's credentials.
enum class AuthResult : uint8_t {
  /// The key matches, or the verifier has no key (authentication disabled).
  kAllowed,
  /// No key was presented (HTTP 401).
  kMissing,
  /// A key was presented and differs (HTTP 403).
  kWrong,
};

/// Checks presented API keys against the configured one in constant time.
///
/// Both keys are hashed with SHA-256 and the digests compared with CRYPTO_memcmp, so the time a
/// check takes depends on neither the content nor the length of the configured key: a timing
/// attacker learns nothing byte by byte (the upstream review ask, PR #2444).
///
/// Thread-safety: immutable after construction; Check may run concurrently from any thread.
class ApiKeyVerifier {
 public:
  /// `api_key` empty disables authentication (every request is allowed).
  explicit ApiKeyVerifier(std::string_view api_key);

  bool enabled() const { return enabled_; }
  AuthResult Check(std::optional<std::string_view> presented) const;

 private:
  static constexpr size_t kSha256Bytes = 32;
  using Sha256 = std::array<uint8_t, kSha256Bytes>;
  static Sha256 Hash(std::string_view text);

  bool enabled_ = false;
  Sha256 key_digest_{};
};

}  // namespace refit::internal
