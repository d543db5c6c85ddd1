// Fleet membership (docs/protocol.md "Admission"): receivers join and leave a publisher's fleet
// with one authenticated call to its membership endpoint, which rank 0 of the trainer serves.
// Changes take effect at the next Sync; a member unreachable for
// MembershipOptions::drop_after_missed_syncs consecutive Syncs is dropped.
//
//   GET  /v1/members         → FleetMembership (every member, its standing, the fleet version)
//   POST /v1/members/join    {"control_url", "data_endpoint"} → FleetMembership
//   POST /v1/members/leave   {"control_url"}                  → FleetMembership
//   GET  /metrics            → per-member gauges (Prometheus text)
//   GET  /healthz            → {"ok": true}; the only route that needs no API key
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "refit/refit_report.h"

namespace refit {

/// Options of the membership endpoint a Publisher serves on rank 0 (PublisherOptions::membership).
struct MembershipOptions {
  /// Where it listens; port 0: a free port (Publisher::membership_url() names it).
  std::string bind_address = "127.0.0.1";
  uint16_t port = 0;
  /// The key a joining receiver must present ("Authorization: Bearer <key>" or X-Refit-Api-Key);
  /// empty: PublisherOptions::control.api_key, the fleet's one key. Empty both: no key (warned).
  std::string api_key;
  /// A member whose control plane cannot be reached (Unavailable, DeadlineExceeded) when a Sync
  /// starts is left out of that Sync; after this many consecutive such Syncs it is dropped from
  /// the fleet, logged and reported (SyncReport::dropped). 3: one missed Sync is a restart or a
  /// blip, three in a row (minutes, at RL step rates) is a worker that is gone. 0: never drop.
  uint32_t drop_after_missed_syncs = 3;
};

/// One member as the publisher reaches it.
struct MemberEndpoint {
  /// Its control plane, e.g. "http://10.0.0.5:8081": also its name in the fleet.
  std::string control_url;
  /// Its data endpoint in the transport's syntax (zmq: host:port).
  std::string data_endpoint;
};

/// One member and how it stood at the last Sync that reached it.
struct MemberStanding {
  MemberEndpoint endpoint;
  /// It joined through the membership endpoint (false: configured in PublisherOptions).
  bool joined = false;
  /// Consecutive Syncs at whose start it could not be reached.
  uint32_t missed_syncs = 0;
  /// Of the last Sync it took part in (nullopt: none yet): the version it holds after it, the
  /// version it held before, how many versions behind the base that was, how it was caught up,
  /// and the bytes it was sent.
  std::optional<uint64_t> version;
  uint64_t held_version = 0;
  uint64_t lag = 0;
  std::optional<CatchUp> caught_up_by;
  uint64_t wire_bytes = 0;
  /// A quorum commit fenced it in the last Sync (issue 40 item 4 sets it); it is then behind.
  bool fenced = false;
};

/// The fleet as the membership endpoint reports it.
struct FleetMembership {
  /// The version the fleet committed last (the publisher's); nullopt while unknown (no Sync yet
  /// and no version adopted).
  std::optional<uint64_t> fleet_version;
  /// The members in the order the next Sync lists them (its relay tree order).
  std::vector<MemberStanding> members;
};

}  // namespace refit
