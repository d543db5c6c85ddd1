#include "control/membership_server.h"

#include <atomic>
#include <chrono>
#include <exception>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <httplib.h>

#include "control/auth.h"
#include "control/http_connections.h"
#include "control/protocol.h"
#include "core/api_key.h"
#include "refit/status_format.h"
#include "util/logging.h"
#include "util/thread_name.h"

namespace refit::internal {
namespace {

constexpr const char* kListenerThreadName = "refit-members";
// A join or leave body is two short URLs; anything near this is not one.
constexpr size_t kMaxMembershipBodyBytes = 64 << 10;
// Membership calls are rare (a worker joining or leaving) and quick: two threads serve them.
constexpr size_t kMembershipWorkerThreads = 2;
constexpr int kHttpOk = 200;
constexpr int kHttpUnauthorized = 401;
constexpr int kHttpForbidden = 403;
constexpr std::string_view kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";
// How often Stop() looks whether the listener has started listening (as ControlServer::Stop).
constexpr std::chrono::milliseconds kListenerPollInterval{1};

void ReplyJson(httplib::Response& response, int http_status, const Json& body) {
  response.status = http_status;
  response.set_content(DumpJson(body), std::string(kJsonContentType));
}

void ReplyResult(httplib::Response& response, const Result<FleetMembership>& result) {
  if (!result.ok()) {
    ReplyJson(response, HttpStatusFor(result.status().code()), ErrorBody(result.status()));
    return;
  }
  ReplyJson(response, kHttpOk, MembershipToJson(*result));
}

// Prometheus text of the fleet: one series per member, labelled by its control URL.
std::string RenderMetrics(const FleetMembership& membership) {
  std::string text;
  const auto family = [&](std::string_view name, std::string_view help) {
    text += fmt::format("# HELP {} {}\n# TYPE {} gauge\n", name, help, name);
  };
  const auto label = [](const std::string& value) {
    std::string escaped;
    for (const char c : value) {
      if (c == '\\' || c == '"') escaped.push_back('\\');
      if (c == '\n') {
        escaped += "\\n";
        continue;
      }
      escaped.push_back(c);
    }
    return escaped;
  };
  family("refit_fleet_version", "The fleet's committed version (-1: unknown)");
  text +=
      fmt::format("refit_fleet_version {}\n", membership.fleet_version.has_value()
                                                  ? static_cast<int64_t>(*membership.fleet_version)
                                                  : int64_t{-1});
  family("refit_fleet_members", "Members the next sync lists");
  text += fmt::format("refit_fleet_members {}\n", membership.members.size());
  family("refit_member_version",
         "The version a member holds after the last sync it took part in (-1: none yet)");
  for (const MemberStanding& m : membership.members) {
    text += fmt::format("refit_member_version{{member=\"{}\"}} {}\n", label(m.endpoint.control_url),
                        m.version.has_value() ? static_cast<int64_t>(*m.version) : int64_t{-1});
  }
  family("refit_member_lag_versions",
         "Versions a member was behind the base when its last sync began");
  for (const MemberStanding& m : membership.members) {
    text += fmt::format("refit_member_lag_versions{{member=\"{}\"}} {}\n",
                        label(m.endpoint.control_url), m.lag);
  }
  family("refit_member_wire_bytes", "Bytes a member was sent in the last sync it took part in");
  for (const MemberStanding& m : membership.members) {
    text += fmt::format("refit_member_wire_bytes{{member=\"{}\"}} {}\n",
                        label(m.endpoint.control_url), m.wire_bytes);
  }
  family("refit_member_caught_up_by",
         "1 for how the last sync brought a member to its version (delta, folded, peer, chain, "
         "anchor)");
  for (const MemberStanding& m : membership.members) {
    if (!m.caught_up_by.has_value()) continue;
    text += fmt::format("refit_member_caught_up_by{{member=\"{}\",how=\"{}\"}} 1\n",
                        label(m.endpoint.control_url), CatchUpName(*m.caught_up_by));
  }
  family("refit_member_missed_syncs", "Consecutive syncs at whose start a member was unreachable");
  for (const MemberStanding& m : membership.members) {
    text += fmt::format("refit_member_missed_syncs{{member=\"{}\"}} {}\n",
                        label(m.endpoint.control_url), m.missed_syncs);
  }
  family("refit_member_fenced", "1 while a quorum commit left a member fenced");
  for (const MemberStanding& m : membership.members) {
    text += fmt::format("refit_member_fenced{{member=\"{}\"}} {}\n", label(m.endpoint.control_url),
                        m.fenced ? 1 : 0);
  }
  return text;
}

}  // namespace

struct MembershipServer::Impl {
  Impl(const MembershipOptions& options_in, FleetRoster& roster_in)
      : options(options_in), roster(roster_in), verifier(options.api_key) {}

  const MembershipOptions options;
  FleetRoster& roster;
  const ApiKeyVerifier verifier;
  std::unique_ptr<GuardedHttpServer> http;
  std::atomic<uint16_t> port{0};
  std::jthread listener;
  std::atomic<bool> listener_done{false};
  bool started = false;

  void InstallRoutes();
  // Check the key; on failure reply 401/403, close after the reply (no body is read), false.
  bool Authorize(const httplib::Request& request, httplib::Response& response) const;
  // Parse a join or leave body.
  static Result<MemberEndpoint> MemberOf(const httplib::Request& request, bool need_data);
};

bool MembershipServer::Impl::Authorize(const httplib::Request& request,
                                       httplib::Response& response) const {
  const AuthResult auth =
      verifier.Check(PresentedApiKey(request.get_header_value("Authorization"),
                                     request.get_header_value(std::string(kApiKeyHeader))));
  if (auth == AuthResult::kAllowed) return true;
  if (auth == AuthResult::kMissing) {
    response.set_header("WWW-Authenticate", "Bearer realm=\"refit\"");
    ReplyJson(response, kHttpUnauthorized,
              ErrorBody(PermissionDenied(
                  "{} {}: missing API key: a receiver joins the fleet with the fleet's key (send "
                  "'Authorization: Bearer <key>' or '{}')",
                  request.method, request.path, kApiKeyHeader)));
  } else {
    ReplyJson(response, kHttpForbidden,
              ErrorBody(PermissionDenied("{} {}: wrong API key", request.method, request.path)));
  }
  GuardedHttpServer::CloseConnectionAfterReply(response);
  return false;
}

Result<MemberEndpoint> MembershipServer::Impl::MemberOf(const httplib::Request& request,
                                                        bool need_data) {
  REFIT_ASSIGN_OR_RETURN(const Json body, ParseJson(request.body, "membership request body"));
  const JsonFields fields(body, "membership request body");
  REFIT_RETURN_NOT_OK(fields.CheckObject(kMemberFields));
  return MemberEndpointFromJson(fields, need_data);
}

void MembershipServer::Impl::InstallRoutes() {
  http->set_pre_routing_handler(
      [this](const httplib::Request& request, httplib::Response& response) {
        if (request.path == kHealthPath) return httplib::Server::HandlerResponse::Unhandled;
        return Authorize(request, response) ? httplib::Server::HandlerResponse::Unhandled
                                            : httplib::Server::HandlerResponse::Handled;
      });
  http->Get(std::string(kHealthPath), [](const httplib::Request&, httplib::Response& response) {
    ReplyJson(response, kHttpOk, Json{{"ok", true}});
  });
  http->Get(std::string(kMembersPath),
            [this](const httplib::Request&, httplib::Response& response) {
              ReplyResult(response, roster.Snapshot());
            });
  http->Get(
      std::string(kMetricsPath), [this](const httplib::Request&, httplib::Response& response) {
        response.set_content(RenderMetrics(roster.Snapshot()), std::string(kMetricsContentType));
      });
  http->Post(std::string(kMembersJoinPath),
             [this](const httplib::Request& request, httplib::Response& response) {
               Result<MemberEndpoint> member = MemberOf(request, /*need_data=*/true);
               ReplyResult(response, member.ok() ? roster.Join(*member)
                                                 : Result<FleetMembership>(member.status()));
             });
  http->Post(std::string(kMembersLeavePath),
             [this](const httplib::Request& request, httplib::Response& response) {
               Result<MemberEndpoint> member = MemberOf(request, /*need_data=*/false);
               ReplyResult(response, member.ok() ? roster.Leave(member->control_url)
                                                 : Result<FleetMembership>(member.status()));
             });
  http->set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (!response.body.empty()) return;
    const Status status =
        response.status == 404
            ? NotFound("no route {} {} on the membership endpoint", request.method, request.path)
            : Status(StatusCodeForHttp(response.status),
                     fmt::format("{} {}: HTTP {}", request.method, request.path, response.status));
    response.set_content(DumpJson(ErrorBody(status)), std::string(kJsonContentType));
  });
  http->set_exception_handler(
      [](const httplib::Request&, httplib::Response& response, const std::exception_ptr&) {
        ReplyJson(response, 500, ErrorBody(Internal("membership endpoint: unexpected exception")));
      });
}

MembershipServer::MembershipServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MembershipServer::~MembershipServer() { Stop(); }

Result<std::unique_ptr<MembershipServer>> MembershipServer::Make(const MembershipOptions& options,
                                                                 FleetRoster& roster) {
  if (options.bind_address.empty()) {
    return InvalidArgument("membership endpoint: bind_address is empty");
  }
  auto impl = std::make_unique<Impl>(options, roster);
  REFIT_ASSIGN_OR_RETURN(
      impl->http,
      GuardedHttpServer::Make(HttpConnectionLimits{.worker_threads = kMembershipWorkerThreads}));
  impl->http->set_payload_max_length(kMaxMembershipBodyBytes);
  try {
    impl->InstallRoutes();
  } catch (const std::exception& error) {
    return Internal("membership endpoint setup failed: {}", error.what());
  }
  return std::unique_ptr<MembershipServer>(new MembershipServer(std::move(impl)));
}

Status MembershipServer::Start() {
  Impl& impl = *impl_;
  if (impl.started) return FailedPrecondition("membership endpoint already started");
  REFIT_RETURN_NOT_OK(impl.http->StartThreads());
  const int bound = impl.options.port == 0
                        ? impl.http->bind_to_any_port(impl.options.bind_address)
                        : (impl.http->bind_to_port(impl.options.bind_address, impl.options.port)
                               ? impl.options.port
                               : -1);
  if (bound <= 0) {
    return Unavailable(
        "membership endpoint cannot bind {}:{} (address in use, not local, or not "
        "permitted)",
        impl.options.bind_address, impl.options.port);
  }
  impl.port = static_cast<uint16_t>(bound);
  try {
    impl.listener = std::jthread([&impl] {
      NameCurrentThread(kListenerThreadName);
      impl.http->listen_after_bind();
      impl.listener_done = true;
    });
  } catch (const std::system_error& error) {
    return ResourceExhausted("membership endpoint: cannot start its thread: {}", error.what());
  }
  impl.started = true;
  if (!impl.verifier.enabled()) {
    REFIT_LOG_WARN(
        "membership endpoint {} has NO API KEY: anyone who can reach it can add "
        "receivers to the fleet. Set the fleet's API key.",
        url());
  } else {
    REFIT_LOG_INFO("membership endpoint listening on {}", url());
  }
  return Status::OK();
}

void MembershipServer::Stop() {
  Impl& impl = *impl_;
  if (!impl.started) return;
  impl.started = false;
  while (!impl.http->is_running() && !impl.listener_done) {
    std::this_thread::sleep_for(kListenerPollInterval);
  }
  if (!impl.listener_done) impl.http->stop();
  impl.listener.join();
}

std::string MembershipServer::url() const {
  const uint16_t port = impl_->port;
  if (port == 0) return "";
  const std::string& address = impl_->options.bind_address;
  const bool ipv6 = address.find(':') != std::string::npos;
  return fmt::format("http://{}{}{}:{}", ipv6 ? "[" : "", address, ipv6 ? "]" : "", port);
}

}  // namespace refit::internal
