#include "core/api_key.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

namespace refit::internal {

ApiKeyVerifier::ApiKeyVerifier(std::string_view api_key)
    : enabled_(!api_key.empty()), key_digest_(Hash(api_key)) {}

ApiKeyVerifier::Sha256 ApiKeyVerifier::Hash(std::string_view text) {
  Sha256 digest{};
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

AuthResult ApiKeyVerifier::Check(std::optional<std::string_view> presented) const {
  if (!enabled_) return AuthResult::kAllowed;
  if (!presented.has_value()) return AuthResult::kMissing;
  const Sha256 presented_digest = Hash(*presented);
  return CRYPTO_memcmp(presented_digest.data(), key_digest_.data(), kSha256Bytes) == 0
             ? AuthResult::kAllowed
             : AuthResult::kWrong;
}

}  // namespace refit::internal
