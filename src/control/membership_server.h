// MembershipServer: the authenticated HTTP endpoint through which receivers join and leave a
// publisher's fleet (refit/membership.h lists the routes; docs/protocol.md "Admission").
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "control/fleet_roster.h"
#include "refit/membership.h"
#include "refit/status.h"

namespace refit::internal {

/// Serves a FleetRoster over plain HTTP on its own threads. Every route but /healthz needs the
/// API key (401 without one, 403 for a wrong one), checked before any body is read.
///
/// Thread-safety: Start and Stop from the owner; the roster is shared with the publisher and must
/// outlive the server.
class MembershipServer {
 public:
  /// Validate `options`; binds nothing yet. Errors: InvalidArgument for an empty bind address.
  static Result<std::unique_ptr<MembershipServer>> Make(const MembershipOptions& options,
                                                        FleetRoster& roster);
  /// Stop().
  ~MembershipServer();
  MembershipServer(const MembershipServer&) = delete;
  MembershipServer& operator=(const MembershipServer&) = delete;

  /// Bind and serve. Errors: Unavailable naming the address when binding fails;
  /// ResourceExhausted when a thread cannot start.
  Status Start();
  /// Stop serving and join the threads. Idempotent.
  void Stop();
  /// "http://<bind address>:<port>"; empty before Start.
  std::string url() const;

 private:
  struct Impl;
  explicit MembershipServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit::internal
