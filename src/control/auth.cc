#include "control/auth.h"

#include <cctype>

namespace refit::internal {
namespace {

constexpr std::string_view kBearerScheme = "bearer";

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

std::string_view TrimSpaces(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

}  // namespace

std::optional<std::string_view> PresentedApiKey(std::string_view authorization_header,
                                                std::string_view api_key_header) {
  const std::string_view authorization = TrimSpaces(authorization_header);
  if (!authorization.empty()) {
    const size_t space = authorization.find(' ');
    if (space != std::string_view::npos &&
        EqualsIgnoringCase(authorization.substr(0, space), kBearerScheme)) {
      const std::string_view token = TrimSpaces(authorization.substr(space + 1));
      if (!token.empty()) return token;
    }
  }
  const std::string_view api_key = TrimSpaces(api_key_header);
  if (!api_key.empty()) return api_key;
  return std::nullopt;
}

}  // namespace refit::internal
