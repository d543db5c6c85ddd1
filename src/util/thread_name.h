// Names of the threads refit starts, as top, gdb and perf show them.
#pragma once

#include <cstddef>
#include <string_view>

namespace refit::internal {

/// Linux keeps 15 bytes of a thread name, plus the terminating NUL (pthread_setname_np(3)).
inline constexpr size_t kMaxThreadNameBytes = 15;

/// Name the calling thread `name`, cut to kMaxThreadNameBytes. Naming is a debugging aid, so a
/// failure is ignored.
void NameCurrentThread(std::string_view name);

/// Name the calling thread "<prefix>-<index>", cutting the prefix rather than the index, so that
/// the workers of one pool stay told apart.
void NameCurrentThread(std::string_view prefix, int index);

}  // namespace refit::internal
