// API-key authentication of the control plane (docs/security.md): which key an HTTP request
// presents. The check itself is core/api_key.h's ApiKeyVerifier, shared with the zmq:// relay.
#pragma once

#include <optional>
#include <string_view>

#include "core/api_key.h"

namespace refit::internal {

/// Return the key a request presents: the token of "Authorization: Bearer <token>" (the scheme is
/// case-insensitive, RFC 9110 §11.1), else the value of the X-Refit-Api-Key header, else nullopt.
/// An Authorization header with another scheme (e.g. Basic) presents nothing.
std::optional<std::string_view> PresentedApiKey(std::string_view authorization_header,
                                                std::string_view api_key_header);

}  // namespace refit::internal
