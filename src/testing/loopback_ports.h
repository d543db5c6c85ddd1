// Loopback endpoints for fleets on one machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "refit/status.h"

namespace refit::testkit {

/// Return `count` distinct free TCP ports on 127.0.0.1: each is bound to port 0 and held until all
/// are chosen, so none repeats; another process may still take one before it is used.
/// Errors: IoError.
Result<std::vector<uint16_t>> FreeLoopbackPorts(size_t count);

}  // namespace refit::testkit
