#include "util/thread_name.h"

#include <pthread.h>

#include <algorithm>
#include <string>

#include <fmt/format.h>

namespace refit::internal {

void NameCurrentThread(std::string_view name) {
  const std::string truncated(name.substr(0, kMaxThreadNameBytes));
  // The result is ignored: see the header.
  pthread_setname_np(pthread_self(), truncated.c_str());
}

void NameCurrentThread(std::string_view prefix, int index) {
  const std::string suffix = fmt::format("-{}", index);
  const size_t prefix_bytes = kMaxThreadNameBytes - std::min(suffix.size(), kMaxThreadNameBytes);
  NameCurrentThread(fmt::format("{}{}", prefix.substr(0, prefix_bytes), suffix));
}

}  // namespace refit::internal
