#include "util/environment.h"

#include <cstdlib>

#include "refit/status_format.h"

namespace refit {

Result<std::string> SecretFromEnvironment(std::string_view name, std::string_view what) {
  // getenv needs a NUL-terminated name; a name with '=' or NUL would read another variable.
  const bool valid_name =
      !name.empty() && name.find_first_of(std::string_view("=\0", 2)) == std::string_view::npos;
  const char* value = valid_name ? std::getenv(std::string(name).c_str()) : nullptr;
  if (value == nullptr || *value == '\0') {
    return InvalidArgument("environment variable {} ({}) is unset or empty", name, what);
  }
  return std::string(value);
}

}  // namespace refit
