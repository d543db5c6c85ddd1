// Loopback ports for fleets, tests and benchmarks on one machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "refit/status.h"

namespace refit::testkit {

/// Return `count` distinct TCP ports on 127.0.0.1 that nobody listens on now, drawn at random from
/// *below* the kernel's ephemeral range (ip_local_port_range), each checked by binding it: a port-0
/// probe would hand out an ephemeral port, which another process's outgoing connection (ctest
/// runs tests in parallel) can take as its source port between the probe and the bind that
/// uses it. Another process may still bind one first. python/refit/_ports.py chooses the same way.
/// Errors: ResourceExhausted when the range below the ephemeral ports is too small or full.
Result<std::vector<uint16_t>> FreeLoopbackPorts(size_t count);

}  // namespace refit::testkit
