#include "control/control_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>

#include "control/auth.h"
#include "control/http_connections.h"
#include "control/metrics.h"
#include "control/protocol.h"
#include "control/readiness.h"
#include "core/digest.h"
#include "refit/status_format.h"
#include "util/bounded_queue.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_name.h"

namespace refit {
namespace {

using internal::Json;
using internal::JsonFields;

// OS thread names (Linux keeps at most 15 bytes).
constexpr const char* kListenerThreadName = "refit-http";
constexpr std::string_view kWorkerThreadPrefix = "refit-http";

// Accepted connections that may wait for a worker, per worker. The accept loop blocks beyond it,
// so further clients wait in the kernel's listen backlog instead of in our memory.
constexpr size_t kPendingConnectionsPerWorker = 4;

// The kernel's queue of connections not yet accepted (capped by net.core.somaxconn).
constexpr int kListenBacklog = 4096;

// The JSON body limit of the transfer routes (JsonLimit): each expected_digests entry is
// "<name>":"<16 hex digits>", (21 bytes besides the name), and a name may grow 6-fold when JSON
// escapes it (\u00XX per control byte). The slack covers the rest of the body, including
// "expected" with the payload counts of up to 65,536 producers (about 16 bytes each).
constexpr uint64_t kJsonBytesPerDigestEntry = 24;
constexpr uint64_t kJsonEscapeFactor = 6;
constexpr uint64_t kJsonBodySlackBytes = uint64_t{1} << 20;

// Bytes handed to the socket per write while streaming a tensor. OpenSSL's SSL_write takes an
// int length, so a multi-GiB tensor must go out in pieces; 4 MiB amortises the per-call cost.
constexpr size_t kDownloadChunkBytes = size_t{4} << 20;

// How long an idle keep-alive connection holds a worker. httplib's worker notices a stopped server
// only between requests, so this also bounds how long Stop() waits for idle clients; a client
// that pauses longer simply reconnects.
constexpr time_t kKeepAliveTimeoutSeconds = 1;

// How often Stop() looks whether the listener thread has started listening (see Stop()).
constexpr std::chrono::milliseconds kListenerPollInterval{1};

// HTTP status codes the server sets itself (others come from internal::HttpStatusFor).
constexpr int kHttpOk = 200;
constexpr int kHttpFirstError = 400;
constexpr int kHttpUnauthorized = 401;
constexpr int kHttpForbidden = 403;
constexpr int kHttpNotFound = 404;
constexpr int kHttpPayloadTooLarge = 413;
// GET /ready while not ready: what Kubernetes readiness probes (any status outside 200–399)
// and load balancers take as "send no traffic".
constexpr int kHttpServiceUnavailable = 503;

constexpr std::string_view kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";

// httplib's TaskQueue over named worker threads and a bounded queue of accepted connections.
// Shutdown drains the queue: every accepted connection runs (and closes its socket).
class WorkerQueue final : public httplib::TaskQueue {
 public:
  // Errors: ResourceExhausted when the OS refuses a thread.
  static Result<std::unique_ptr<WorkerQueue>> Make(size_t threads) {
    std::unique_ptr<WorkerQueue> queue(new WorkerQueue(threads));
    for (size_t i = 0; i < threads; ++i) {
      // std::thread reports an OS refusal only by throwing; no exception may leave the library.
      try {
        queue->workers_.emplace_back([raw = queue.get(), i] { raw->Run(i); });
      } catch (const std::system_error& error) {
        queue->shutdown();
        return ResourceExhausted("control server: cannot start worker thread {} of {}: {}", i,
                                 threads, error.what());
      }
    }
    return queue;
  }

  ~WorkerQueue() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    // Push fails only after shutdown(), which httplib calls once its accept loop has ended; run
    // the connection inline then rather than leak its socket.
    std::function<void()> copy = fn;
    if (!connections_.Push(std::move(fn)).ok()) copy();
  }

  void shutdown() override {
    connections_.Close();
    for (std::jthread& worker : workers_) {
      if (worker.joinable()) worker.join();
    }
  }

 private:
  explicit WorkerQueue(size_t threads)
      : connections_(threads * kPendingConnectionsPerWorker, "control server connection queue") {
    workers_.reserve(threads);
  }

  void Run(size_t index) {
    internal::NameCurrentThread(kWorkerThreadPrefix, static_cast<int>(index));
    // Pop drains what is queued after Close() before it returns nullopt.
    while (std::optional<std::function<void()>> connection = connections_.Pop()) (*connection)();
  }

  internal::BoundedQueue<std::function<void()>> connections_;
  std::vector<std::jthread> workers_;
};

bool IsLoopback(std::string_view address) {
  return address == "127.0.0.1" || address == "localhost" || address == "::1";
}

// The route template of a request, for the per-route request counter. Only known routes get
// their own label, so the label set stays fixed whatever paths clients send.
std::string_view RouteLabel(const httplib::Request& request) {
  const std::string_view path = request.path;
  if (request.method == "GET" || request.method == "HEAD") {
    for (std::string_view route :
         {internal::kStatusPath, internal::kTensorsPath, internal::kMetricsPath,
          internal::kHealthPath, internal::kReadyPath}) {
      if (path == route) return route;
    }
    if (path.starts_with(internal::kTensorsPathPrefix)) return "/v1/tensors/{name}";
  } else if (request.method == "POST") {
    for (std::string_view route :
         {internal::kPreparePath, internal::kFlushPath, internal::kCommitPath, internal::kAbortPath,
          internal::kPayloadPath, internal::kManifestPath, internal::kRegionsPath,
          internal::kJoinPath, internal::kLeavePath}) {
      if (path == route) return route;
    }
  }
  return internal::ControlMetrics::kUnmatchedRoute;
}

void ReplyJson(httplib::Response& response, int http_status, const Json& body) {
  response.status = http_status;
  response.set_content(internal::DumpJson(body), std::string(internal::kJsonContentType));
}

void ReplyError(httplib::Response& response, const Status& status) {
  ReplyJson(response, internal::HttpStatusFor(status.code()), internal::ErrorBody(status));
}

// Run `handler` and turn anything it throws (bad_alloc, a library bug) into a 500: an exception
// must never unwind into httplib's worker.
template <typename Handler>
void Guarded(httplib::Response& response, Handler&& handler) {
  try {
    handler();
  } catch (const std::exception& error) {
    ReplyError(response, Internal("control server: unexpected exception: {}", error.what()));
  } catch (...) {
    ReplyError(response, Internal("control server: unexpected non-standard exception"));
  }
}

// Whether httplib reads a body for this method. For these methods every handler consumes the
// whole body, even when it refuses the request: bytes left unread would be parsed as the next
// request on the connection.
bool MethodCarriesBody(std::string_view method) {
  return method == "POST" || method == "PUT" || method == "PATCH" || method == "DELETE";
}

// Read and discard the request body (costs bandwidth, never memory).
void DrainBody(const httplib::ContentReader& reader) {
  reader([](const char*, size_t) { return true; });
}

// Refuse the rest of a request's body: close the connection after the reply where the server
// can (GuardedHttpServer, plain HTTP), so a refused peer costs neither the time nor the bytes of
// a body it may drip or inflate; else (TLS) drain it, keeping the refusal's status (a drain that
// fails, e.g. beyond the size limit, would otherwise set httplib's own 400 or 413 under our
// body).
void RefuseRestOfBody(const httplib::ContentReader& reader, httplib::Response& response) {
  if (internal::GuardedHttpServer::CloseConnectionAfterReply(response)) return;
  const int status = response.status;
  DrainBody(reader);
  response.status = status;
}

// Read the whole request body into `body`, a container of bytes, keeping at most `limit` bytes.
// Beyond the limit ResourceExhausted naming `limit_reason` is returned and the rest is refused
// (RefuseRestOfBody, see MethodCarriesBody).
template <typename Bytes>
Status ReadBody(const httplib::Request& request, httplib::Response& response,
                const httplib::ContentReader& reader, uint64_t limit, Bytes& body,
                std::string_view limit_reason = "") {
  const uint64_t declared = request.get_header_value<uint64_t>("Content-Length");
  if (declared > limit) {
    RefuseRestOfBody(reader, response);
    return ResourceExhausted("{} {}: request body of {} bytes exceeds the limit of {} bytes{}",
                             request.method, request.path, declared, limit, limit_reason);
  }
  body.reserve(declared);
  bool over_limit = false;
  const bool complete = reader([&](const char* data, size_t length) {
    over_limit = over_limit || body.size() + length > limit;
    if (!over_limit) {
      const auto* bytes = reinterpret_cast<const typename Bytes::value_type*>(data);
      body.insert(body.end(), bytes, bytes + length);
    }
    return true;
  });
  if (over_limit) {
    return ResourceExhausted("{} {}: request body exceeds the limit of {} bytes{}", request.method,
                             request.path, limit, limit_reason);
  }
  if (!complete) {
    return InvalidArgument("request body ended after {} of {} bytes", body.size(), declared);
  }
  return Status::OK();
}

Json VersionBody(uint64_t version) { return Json{{"ok", true}, {"version", version}}; }

// The fields of a request body that has none ({}).
constexpr std::array<std::string_view, 0> kNoFields = {};

}  // namespace

struct ControlServer::Impl {
  enum class Lifecycle : uint8_t { kCreated, kRunning, kStopped };

  Impl(const ControlServerOptions& options_in, internal::ReceiverSession& session_in,
       WeightStore& store_in)
      : options(options_in), session(session_in), store(store_in), verifier(options.api_key) {}

  const ControlServerOptions options;
  internal::ReceiverSession& session;
  WeightStore& store;
  const internal::ApiKeyVerifier verifier;
  std::unique_ptr<internal::ControlMetrics> metrics;
  // What this receiver heard of its fleet: readiness (GET /ready, status, metrics).
  internal::FleetStanding standing;
  std::unique_ptr<httplib::Server> http;
  // The listening socket httplib made (seen in its socket-options hook), or -1.
  int listen_socket = -1;
  // `http` itself when it serves plain HTTP (connections wait for their head without a
  // worker); null with TLS, which httplib's own connection handling serves.
  internal::GuardedHttpServer* guarded = nullptr;
  bool tls = false;

  // The JSON body limit of the transfer routes for the store's tensors (JsonLimit), cached for
  // the store size it was computed at.
  internal::Mutex json_limit_mutex;
  size_t json_limit_tensors = 0;
  uint64_t json_limit_bytes = 0;
  size_t json_limit_longest_name = 0;

  // Readers of the store's bytes and digests hold it shared; Prepare, Commit and Abort hold it
  // exclusively, so no transfer starts or ends under a read (see the class comment).
  std::shared_mutex store_access;
  // Cancels payload uploads blocked on a full apply queue when the server stops.
  std::stop_source stopping;

  internal::Mutex lifecycle_mutex;
  Lifecycle lifecycle = Lifecycle::kCreated;
  std::atomic<uint16_t> port{0};
  // The worker queue built by Start(), handed to httplib when it starts listening.
  std::unique_ptr<WorkerQueue> workers;
  std::jthread listener;
  std::atomic<bool> listener_done{false};

  void InstallRoutes();
  // Check the request's API key; on failure reply 401 or 403 and return false.
  bool Authorize(const httplib::Request& request, httplib::Response& response) const;
  // Authenticate requests whose methods carry no body before routing (see MethodCarriesBody).
  httplib::Server::HandlerResponse PreRoute(const httplib::Request& request,
                                            httplib::Response& response);
  void FillErrorBody(const httplib::Request& request, httplib::Response& response) const;

  // The handler of a route whose method carries a body: authenticate, draining the body of a
  // refused request, then run `handler` (which must consume the body).
  using BodyHandler = std::function<void(const httplib::Request&, httplib::Response&,
                                         const httplib::ContentReader&)>;
  httplib::Server::HandlerWithContentReader BodyRoute(BodyHandler handler);
  // The largest JSON body a transfer route takes: what expected_digests naming every tensor of
  // the store can need, within options.max_json_bytes. Sets `reason` to the explanation.
  uint64_t JsonLimit(std::string& reason);
  // A POST route whose body and reply are JSON.
  using JsonHandler = std::function<Result<Json>(const JsonFields& body)>;
  void PostJson(std::string_view path, std::span<const std::string_view> fields,
                JsonHandler handler);

  // Parse `text`, check its fields and run `handler`: the JSON routes' common part, for HTTP and
  // for other carriers (Serve).
  Result<Json> RunJson(std::string_view text, std::span<const std::string_view> fields,
                       const JsonHandler& handler);
  ControlReply Serve(const ControlRequest& request);

  Result<Json> Prepare(const JsonFields& body);
  Result<Json> Flush(const JsonFields& body);
  Result<Json> Commit(const JsonFields& body);
  Result<Json> Abort(const JsonFields& body);
  Result<Json> Regions(const JsonFields& body);
  Result<Json> Join(const JsonFields& body);
  Result<Json> Leave(const JsonFields& body);
  // The transfer routes, for HTTP (InstallRoutes) and for other carriers (Serve) alike.
  struct JsonRoute {
    std::string_view path;
    std::span<const std::string_view> fields;
    Result<Json> (Impl::*handler)(const JsonFields&);
  };
  static constexpr JsonRoute kJsonRoutes[] = {
      {internal::kPreparePath, internal::kPrepareFields, &Impl::Prepare},
      {internal::kFlushPath, internal::kFlushFields, &Impl::Flush},
      {internal::kCommitPath, internal::kTransferOnlyFields, &Impl::Commit},
      {internal::kAbortPath, internal::kAbortFields, &Impl::Abort},
      {internal::kRegionsPath, internal::kRegionsFields, &Impl::Regions},
      {internal::kJoinPath, internal::kJoinFields, &Impl::Join},
      {internal::kLeavePath, kNoFields, &Impl::Leave}};
  void StagePayload(const httplib::Request& request, httplib::Response& response,
                    const httplib::ContentReader& reader);
  // POST /v1/manifest: hand the manifest to the data plane's listener, which fetches and
  // stages the payload it names.
  void StageManifest(const httplib::Request& request, httplib::Response& response,
                     const httplib::ContentReader& reader);
  Json StatusBody();
  // GET /v1/tensors: FailedPrecondition while a transfer is receiving.
  Result<Json> TensorListingBody();
  // GET /ready: the readiness object, and 200 or 503.
  ControlReply ReadyReply();
  void SendTensor(const httplib::Request& request, httplib::Response& response);
};

httplib::Server::HandlerWithContentReader ControlServer::Impl::BodyRoute(BodyHandler handler) {
  return [this, handler = std::move(handler)](const httplib::Request& request,
                                              httplib::Response& response,
                                              const httplib::ContentReader& reader) {
    Guarded(response, [&] {
      // Authenticate first: a peer without the key learns 401/403 whatever it sends, and none
      // of its body is read (docs/security.md).
      if (!Authorize(request, response)) return RefuseRestOfBody(reader, response);
      handler(request, response, reader);
    });
  };
}

void ControlServer::Impl::PostJson(std::string_view path, std::span<const std::string_view> fields,
                                   JsonHandler handler) {
  http->Post(std::string(path),
             BodyRoute([this, fields, handler = std::move(handler)](
                           const httplib::Request& request, httplib::Response& response,
                           const httplib::ContentReader& reader) {
               std::string text;
               std::string reason;
               const uint64_t limit = JsonLimit(reason);
               Status read = ReadBody(request, response, reader, limit, text, reason);
               if (!read.ok()) return ReplyError(response, read);
               Result<Json> reply = RunJson(text, fields, handler);
               if (!reply.ok()) return ReplyError(response, reply.status());
               ReplyJson(response, kHttpOk, *reply);
             }));
}

Result<Json> ControlServer::Impl::RunJson(std::string_view text,
                                          std::span<const std::string_view> fields,
                                          const JsonHandler& handler) {
  REFIT_ASSIGN_OR_RETURN(const Json body, internal::ParseJson(text, "request body"));
  const JsonFields body_fields(body, "request body");
  REFIT_RETURN_NOT_OK(body_fields.CheckObject(fields));
  return handler(body_fields);
}

ControlReply ControlServer::Impl::Serve(const ControlRequest& request) {
  const auto reply = [](const Result<Json>& result) {
    if (!result.ok()) {
      return ControlReply{internal::HttpStatusFor(result.status().code()),
                          internal::DumpJson(internal::ErrorBody(result.status()))};
    }
    return ControlReply{kHttpOk, internal::DumpJson(*result)};
  };
  // Exceptions (bad_alloc) become a 500 here as they do for HTTP: none may reach the carrier.
  try {
    if (request.method == "GET" && request.path == internal::kStatusPath) {
      return reply(StatusBody());
    }
    if (request.method == "GET" && request.path == internal::kTensorsPath) {
      return reply(TensorListingBody());
    }
    if (request.method == "GET" && request.path == internal::kHealthPath) {
      return reply(Json{{"ok", true}});
    }
    if (request.method == "GET" && request.path == internal::kReadyPath) return ReadyReply();
    for (const JsonRoute& route : kJsonRoutes) {
      if (request.method != "POST" || request.path != route.path) continue;
      std::string reason;
      const uint64_t limit = JsonLimit(reason);
      if (request.body.size() > limit) {
        return reply(ResourceExhausted("{} {}: the body of {} bytes exceeds the limit of {}{}",
                                       request.method, request.path, request.body.size(), limit,
                                       reason));
      }
      return reply(RunJson(request.body, route.fields, [this, &route](const JsonFields& body) {
        return (this->*route.handler)(body);
      }));
    }
    return reply(NotFound("no route {} {} on the control channel", request.method, request.path));
  } catch (const std::bad_alloc&) {
    return reply(
        ResourceExhausted("control request {} {}: out of memory", request.method, request.path));
  } catch (const std::exception& error) {
    return reply(Internal("control request {} {}: unexpected exception: {}", request.method,
                          request.path, error.what()));
  }
}

uint64_t ControlServer::Impl::JsonLimit(std::string& reason) {
  internal::MutexLock lock(json_limit_mutex);
  const size_t tensors = store.size();
  if (tensors != json_limit_tensors || json_limit_bytes == 0) {
    size_t longest = 0;
    for (const TensorView& tensor : store.tensors())
      longest = std::max(longest, tensor.name.size());
    const uint64_t per_tensor = kJsonEscapeFactor * longest + kJsonBytesPerDigestEntry;
    json_limit_tensors = tensors;
    json_limit_longest_name = longest;
    json_limit_bytes = std::min<uint64_t>(options.max_json_bytes,
                                          kJsonBodySlackBytes + uint64_t{tensors} * per_tensor);
  }
  reason = json_limit_bytes < options.max_json_bytes
               ? fmt::format(" (bounded by the model: {} tensors, names up to {} bytes)",
                             json_limit_tensors, json_limit_longest_name)
               : "";
  return json_limit_bytes;
}

Result<Json> ControlServer::Impl::Prepare(const JsonFields& body) {
  PrepareRequest request;
  REFIT_ASSIGN_OR_RETURN(request.transfer_id, body.Transfer("transfer_id"));
  REFIT_ASSIGN_OR_RETURN(request.base_version, body.Uint("base_version"));
  if (body.Has("anchor")) {
    REFIT_ASSIGN_OR_RETURN(request.anchor, body.Bool("anchor"));
  }
  if (body.Has("target_version")) {
    REFIT_ASSIGN_OR_RETURN(request.target_version, body.Uint("target_version"));
  }
  REFIT_ASSIGN_OR_RETURN(request.expected, internal::GetExpectation(body));
  REFIT_ASSIGN_OR_RETURN(request.relay_tree, internal::GetRelayTree(body));
  REFIT_ASSIGN_OR_RETURN(request.lineage, internal::GetLineage(body));
  if (request.relay_tree.has_value()) {
    if (!options.route_transfer) {
      return InvalidArgument(
          "prepare of transfer {} names a relay tree of {} receiver(s), but this receiver's data "
          "plane has no relays (only zmq:// does)",
          request.transfer_id.ToHex(), request.relay_tree->endpoints.size());
    }
    // Routed before the session opens the transfer: once it is open, payloads may arrive, and a
    // relay must know where to forward them.
    REFIT_RETURN_NOT_OK(options.route_transfer(request.transfer_id, *request.relay_tree));
  }
  std::unique_lock lock(store_access);
  bool chain_replayed = false;
  if (options.catch_up && !request.anchor) {
    const ReceiverStatus now = session.GetStatus();
    if (now.state == ReceiverState::kIdle && request.base_version > now.version) {
      REFIT_RETURN_NOT_OK(options.catch_up(request.base_version)
                              .WithContext(fmt::format("catching up from version {} to {}",
                                                       now.version, request.base_version)));
      chain_replayed = true;
    }
  }
  REFIT_ASSIGN_OR_RETURN(const PrepareResult prepared, session.Prepare(request));
  // An implied commit committed the transfer this one is based on.
  if (prepared.implied_commit.has_value()) standing.ObserveCommit(request.base_version);
  standing.ObservePrepare(request, chain_replayed);
  if (prepared.implied_commit.has_value()) metrics->RecordCommitted();
  if (prepared.implied_abort.has_value()) metrics->RecordAborted();
  if (!prepared.repeated) metrics->RecordPrepared(request.transfer_id);
  Json reply{{"ok", true},
             {"repeated", prepared.repeated},
             {"implied_commit", nullptr},
             {"implied_abort", nullptr},
             {"version", session.GetStatus().version}};
  if (prepared.implied_commit.has_value()) {
    reply["implied_commit"] = prepared.implied_commit->ToHex();
  }
  if (prepared.implied_abort.has_value()) {
    reply["implied_abort"] = prepared.implied_abort->ToHex();
  }
  return reply;
}

Result<Json> ControlServer::Impl::Flush(const JsonFields& body) {
  REFIT_ASSIGN_OR_RETURN(const TransferId id, body.Transfer("transfer_id"));
  FlushOptions flush;
  // Without timeout_ms, the session's default, within the server's maximum.
  flush.timeout = std::min(flush.timeout, options.max_flush_timeout);
  REFIT_ASSIGN_OR_RETURN(const std::optional<uint64_t> timeout_ms, body.OptionalUint("timeout_ms"));
  if (timeout_ms.has_value()) {
    if (*timeout_ms > static_cast<uint64_t>(options.max_flush_timeout.count())) {
      return InvalidArgument("{} {} exceeds the server's maximum flush timeout of {} ms",
                             body.Name("timeout_ms"), *timeout_ms,
                             options.max_flush_timeout.count());
    }
    flush.timeout = std::chrono::milliseconds(*timeout_ms);
  }
  REFIT_ASSIGN_OR_RETURN(flush.expected, internal::GetExpectation(body));
  REFIT_ASSIGN_OR_RETURN(const FlushReport report, session.Flush(id, flush));
  metrics->RecordFlushed(id);
  return internal::FlushReportToJson(report);
}

Result<Json> ControlServer::Impl::Commit(const JsonFields& body) {
  REFIT_ASSIGN_OR_RETURN(const TransferId id, body.Transfer("transfer_id"));
  std::unique_lock lock(store_access);
  // Commit is idempotent; count only the call that moved the transfer out of kPrepared. The
  // exclusive lock keeps other control calls of this server from changing the state between.
  const ReceiverStatus before = session.GetStatus();
  // A Commit is the fleet's decision: the fleet holds the target from now on, whether or not
  // this receiver's own commit succeeds. Known before the session commits, so that readiness
  // never sees the new version ahead of the fleet's (the after_commit hook runs inside Commit).
  if (before.transfer_id == id) standing.ObserveFleetVersion(before.target_version);
  REFIT_RETURN_NOT_OK(session.Commit(id));
  if (before.state == ReceiverState::kPrepared && before.transfer_id == id) {
    metrics->RecordCommitted();
  }
  const uint64_t version = session.GetStatus().version;
  standing.ObserveCommit(version);
  return VersionBody(version);
}

Result<Json> ControlServer::Impl::Abort(const JsonFields& body) {
  REFIT_ASSIGN_OR_RETURN(const TransferId id, body.Transfer("transfer_id"));
  std::unique_lock lock(store_access);
  const ReceiverStatus before = session.GetStatus();
  REFIT_ASSIGN_OR_RETURN(const std::optional<uint64_t> fenced_at,
                         body.OptionalUint("fenced_at_version"));
  REFIT_RETURN_NOT_OK(session.Abort(id));
  if (before.transfer_id == id) metrics->RecordAborted();
  const uint64_t version = session.GetStatus().version;
  if (fenced_at.has_value() && *fenced_at > version) {
    // Fenced by a quorum commit: the fleet moved on without this receiver. Behind and fenced
    // until a transfer brings it to the fleet's version (its commit clears the fence).
    standing.ObserveFleetVersion(*fenced_at);
    standing.SetFenced(fmt::format(
        "transfer {} committed version {} on a quorum of the fleet without this receiver, which "
        "holds version {}",
        id.ToHex(), *fenced_at, version));
  }
  return VersionBody(version);
}

// What the store's loader holds of each named tensor; reads no weights, so no store lock.
Result<Json> ControlServer::Impl::Regions(const JsonFields& body) {
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::string> names, internal::GetRegionTensors(body));
  REFIT_ASSIGN_OR_RETURN(const HeldRegions regions, session.Regions(names));
  Json reply = internal::RegionsToJson(regions);
  reply["ok"] = true;
  return reply;
}

Result<Json> ControlServer::Impl::Join(const JsonFields& body) {
  if (!options.join) {
    return FailedPrecondition("this receiver cannot join a fleet: its control plane has no node");
  }
  REFIT_ASSIGN_OR_RETURN(const std::string publisher_url, body.String("publisher_url"));
  MemberEndpoint advertised;
  if (body.Has("control_url")) {
    REFIT_ASSIGN_OR_RETURN(advertised, internal::MemberEndpointFromJson(body, false));
  } else if (body.Has("data_endpoint")) {
    REFIT_ASSIGN_OR_RETURN(advertised.data_endpoint, body.String("data_endpoint"));
  }
  REFIT_ASSIGN_OR_RETURN(const FleetMembership membership, options.join(publisher_url, advertised));
  return internal::MembershipToJson(membership);
}

Result<Json> ControlServer::Impl::Leave(const JsonFields&) {
  if (!options.leave) {
    return FailedPrecondition("this receiver cannot leave a fleet: its control plane has no node");
  }
  REFIT_ASSIGN_OR_RETURN(const FleetMembership membership, options.leave());
  return internal::MembershipToJson(membership);
}

void ControlServer::Impl::StagePayload(const httplib::Request& request, httplib::Response& response,
                                       const httplib::ContentReader& reader) {
  // The bytes that arrived: the declared length of a refused (drained) body, else what was read.
  uint64_t received = request.get_header_value<uint64_t>("Content-Length");
  auto stage = [&]() -> Result<StageResult> {
    const std::string content_type = request.get_header_value("Content-Type");
    if (content_type != internal::kOctetStreamContentType) {
      RefuseRestOfBody(reader, response);
      return InvalidArgument(
          "payload Content-Type '{}' is not {}: the body must be the raw payload bytes",
          content_type, internal::kOctetStreamContentType);
    }
    std::vector<std::byte> payload;
    REFIT_RETURN_NOT_OK(ReadBody(request, response, reader, options.max_request_bytes, payload));
    received = payload.size();
    Result<StageResult> staged = session.Stage(std::move(payload), stopping.get_token());
    if (!staged.ok() && stopping.stop_requested() &&
        staged.status().code() == StatusCode::kCancelled) {
      return Unavailable("control server is stopping; payload of {} bytes not staged", received);
    }
    return staged;
  };
  const Result<StageResult> staged = stage();
  metrics->RecordPayload(received, staged);
  if (!staged.ok()) return ReplyError(response, staged.status());
  ReplyJson(response, kHttpOk,
            Json{{"ok", true},
                 {"result", *staged == StageResult::kAccepted ? "accepted" : "duplicate"},
                 {"bytes", received}});
}

void ControlServer::Impl::StageManifest(const httplib::Request& request,
                                        httplib::Response& response,
                                        const httplib::ContentReader& reader) {
  auto stage = [&]() -> Result<StagedManifest> {
    if (!options.manifest_handler) {
      RefuseRestOfBody(reader, response);
      return FailedPrecondition(
          "this receiver takes no manifests: its data plane delivers payloads itself (manifests "
          "are for s3://)");
    }
    std::string manifest;
    REFIT_RETURN_NOT_OK(ReadBody(request, response, reader, options.max_json_bytes, manifest));
    Result<StagedManifest> staged = options.manifest_handler(manifest, stopping.get_token());
    if (!staged.ok() && stopping.stop_requested() &&
        staged.status().code() == StatusCode::kCancelled) {
      return Unavailable("control server is stopping; manifest not staged");
    }
    return staged;
  };
  const Result<StagedManifest> staged = stage();
  metrics->RecordPayload(
      staged.ok() ? staged->payload_bytes : 0,
      staged.ok() ? Result<StageResult>(staged->result) : Result<StageResult>(staged.status()));
  if (!staged.ok()) return ReplyError(response, staged.status());
  ReplyJson(response, kHttpOk,
            Json{{"ok", true},
                 {"result", staged->result == StageResult::kAccepted ? "accepted" : "duplicate"},
                 {"bytes", staged->payload_bytes}});
}

Json ControlServer::Impl::StatusBody() {
  internal::ControlStatusFields status;
  std::shared_lock lock(store_access);
  status.receiver = session.GetStatus();
  status.tensors = store.size();
  status.place = options.place;
  status.relay = options.relay;
  if (status.receiver.state != ReceiverState::kReceiving) {
    status.state_fingerprint = StateFingerprint(std::as_const(store).Digests());
  }
  status.readiness = standing.Evaluate(status.receiver);
  return internal::StatusToJson(status);
}

Result<Json> ControlServer::Impl::TensorListingBody() {
  std::shared_lock lock(store_access);
  const ReceiverStatus status = session.GetStatus();
  if (status.state == ReceiverState::kReceiving) {
    return FailedPrecondition(
        "the tensors cannot be listed while transfer {} is receiving "
        "payloads; retry after its flush",
        status.transfer_id.value_or(TransferId{}).ToHex());
  }
  TensorListing listing;
  listing.version = status.version;
  const std::map<std::string, uint64_t> digests = std::as_const(store).Digests();
  for (const TensorView& tensor : std::as_const(store).tensors()) {
    listing.tensors.push_back(HeldTensor{std::string(tensor.name), tensor.dtype, tensor.shape,
                                         digests.at(std::string(tensor.name))});
  }
  std::sort(listing.tensors.begin(), listing.tensors.end(),
            [](const HeldTensor& a, const HeldTensor& b) { return a.name < b.name; });
  return internal::TensorListingToJson(listing);
}

ControlReply ControlServer::Impl::ReadyReply() {
  standing.RefreshIfOverdue();
  const ReceiverStatus status = session.GetStatus();
  const Readiness readiness = standing.Evaluate(status);
  Json body{{"ok", readiness.ready}, {"version", readiness.version}};
  internal::PutReadiness(readiness, body);
  if (!readiness.ready) {
    body["code"] = std::string(StatusCodeName(StatusCode::kUnavailable));
    body["message"] =
        fmt::format("not ready ({}): {}", ReadinessReasonName(readiness.reason), readiness.detail);
  }
  return ControlReply{readiness.ready ? kHttpOk : kHttpServiceUnavailable,
                      internal::DumpJson(body)};
}

void ControlServer::Impl::SendTensor(const httplib::Request& request, httplib::Response& response) {
  const std::string name = request.path.substr(internal::kTensorsPathPrefix.size());
  // The lock must cover writing the body, which httplib does after this handler returns: the
  // content provider owns it, and httplib destroys the provider (unlocking) on this same worker
  // thread once the response is written.
  auto lock = std::make_shared<std::shared_lock<std::shared_mutex>>(store_access);
  const ReceiverStatus status = session.GetStatus();
  if (status.state == ReceiverState::kReceiving) {
    return ReplyError(response,
                      FailedPrecondition("tensor '{}' cannot be read while transfer {} is "
                                         "receiving payloads; retry after its flush",
                                         name, status.transfer_id.value_or(TransferId{}).ToHex()));
  }
  Result<TensorView> tensor = std::as_const(store).Find(name);
  if (!tensor.ok()) return ReplyError(response, tensor.status());
  Result<uint64_t> digest = store.Digest(name);
  if (!digest.ok()) return ReplyError(response, digest.status());
  Json shape = Json::array();
  for (int64_t extent : tensor->shape) shape.push_back(extent);
  response.status = kHttpOk;
  response.set_header(std::string(internal::kDtypeHeader), std::string(DTypeName(tensor->dtype)));
  response.set_header(std::string(internal::kShapeHeader), internal::DumpJson(shape));
  response.set_header(std::string(internal::kDigestHeader), internal::DigestToHex(*digest));
  response.set_header(std::string(internal::kVersionHeader), std::to_string(status.version));
  std::span<const std::byte> bytes = tensor->bytes;
  // A device tensor is read to the host for the download (O(tensor), while it is sent).
  std::shared_ptr<std::vector<std::byte>> copy;
  if (TensorMemory* device = store.DeviceMemory(name); device != nullptr) {
    copy = std::make_shared<std::vector<std::byte>>(device->size_bytes());
    Status read = store.ReadBytes(name, 0, *copy);
    if (!read.ok()) return ReplyError(response, read);
    bytes = *copy;
  }
  response.set_content_provider(
      bytes.size(), std::string(internal::kOctetStreamContentType),
      [bytes, lock, copy](size_t offset, size_t length, httplib::DataSink& sink) {
        const size_t chunk = std::min(length, kDownloadChunkBytes);
        return sink.write(reinterpret_cast<const char*>(bytes.data() + offset), chunk);
      });
}

bool ControlServer::Impl::Authorize(const httplib::Request& request,
                                    httplib::Response& response) const {
  const internal::AuthResult auth = verifier.Check(
      internal::PresentedApiKey(request.get_header_value("Authorization"),
                                request.get_header_value(std::string(internal::kApiKeyHeader))));
  switch (auth) {
    case internal::AuthResult::kAllowed:
      return true;
    case internal::AuthResult::kMissing:
      // 401 (who are you?), not the 403 (you may not) that PermissionDenied maps to.
      response.set_header("WWW-Authenticate", "Bearer realm=\"refit\"");
      ReplyJson(response, kHttpUnauthorized,
                internal::ErrorBody(PermissionDenied(
                    "{} {}: missing API key (send 'Authorization: Bearer <key>' or '{}')",
                    request.method, request.path, internal::kApiKeyHeader)));
      return false;
    case internal::AuthResult::kWrong:
      ReplyJson(response, kHttpForbidden,
                internal::ErrorBody(
                    PermissionDenied("{} {}: wrong API key", request.method, request.path)));
      return false;
  }
  return false;
}

httplib::Server::HandlerResponse ControlServer::Impl::PreRoute(const httplib::Request& request,
                                                               httplib::Response& response) {
  using HandlerResponse = httplib::Server::HandlerResponse;
  // Methods with a body are authenticated in their handlers, which can drain the body.
  // Health and readiness need no key: probes (a kubelet, a load balancer) hold no secret, and
  // they tell only whether to send traffic, the version and why not (docs/security.md).
  if (MethodCarriesBody(request.method) || request.path == internal::kHealthPath ||
      request.path == internal::kReadyPath) {
    return HandlerResponse::Unhandled;
  }
  HandlerResponse outcome = HandlerResponse::Unhandled;
  Guarded(response, [&] {
    if (!Authorize(request, response)) {
      outcome = HandlerResponse::Handled;
      // A body sent with the refused request must not be read as the next request.
      internal::GuardedHttpServer::CloseConnectionAfterReply(response);
    }
  });
  return outcome;
}

void ControlServer::Impl::FillErrorBody(const httplib::Request& request,
                                        httplib::Response& response) const {
  // httplib calls this for every error status, including the ones our handlers answered.
  if (!response.body.empty() || response.content_length_ > 0) return;
  Status status;
  if (response.status == kHttpNotFound) {
    status = NotFound("no route {} {}", request.method, request.path);
  } else if (response.status == kHttpPayloadTooLarge) {
    status = ResourceExhausted("{} {}: request body exceeds the limit of {} bytes", request.method,
                               request.path, options.max_request_bytes);
  } else {
    status = Status(internal::StatusCodeForHttp(response.status),
                    fmt::format("{} {}: HTTP {} (malformed request)", request.method, request.path,
                                response.status));
  }
  response.set_content(internal::DumpJson(internal::ErrorBody(status)),
                       std::string(internal::kJsonContentType));
}

void ControlServer::Impl::InstallRoutes() {
  for (const JsonRoute& route : kJsonRoutes) {
    PostJson(route.path, route.fields,
             [this, &route](const JsonFields& body) { return (this->*route.handler)(body); });
  }
  http->Post(std::string(internal::kPayloadPath),
             BodyRoute([this](const httplib::Request& request, httplib::Response& response,
                              const httplib::ContentReader& reader) {
               StagePayload(request, response, reader);
             }));
  http->Post(std::string(internal::kManifestPath),
             BodyRoute([this](const httplib::Request& request, httplib::Response& response,
                              const httplib::ContentReader& reader) {
               StageManifest(request, response, reader);
             }));
  // Every other request with a body: authenticate and drain it, then 404. (httplib would read
  // the body of an unmatched route into memory, up to max_request_bytes, before answering.)
  const auto no_route = BodyRoute([](const httplib::Request& request, httplib::Response& response,
                                     const httplib::ContentReader& reader) {
    ReplyError(response, NotFound("no route {} {}", request.method, request.path));
    RefuseRestOfBody(reader, response);
  });
  constexpr std::string_view kAnyPath = ".*";
  http->Post(std::string(kAnyPath), no_route);
  http->Put(std::string(kAnyPath), no_route);
  http->Patch(std::string(kAnyPath), no_route);
  http->Delete(std::string(kAnyPath), no_route);
  http->Get(std::string(internal::kStatusPath),
            [this](const httplib::Request&, httplib::Response& response) {
              Guarded(response, [&] { ReplyJson(response, kHttpOk, StatusBody()); });
            });
  http->Get(std::string(internal::kTensorsPath),
            [this](const httplib::Request&, httplib::Response& response) {
              Guarded(response, [&] {
                Result<Json> body = TensorListingBody();
                if (!body.ok()) return ReplyError(response, body.status());
                ReplyJson(response, kHttpOk, *body);
              });
            });
  // Route patterns are regular expressions over the URL-decoded path; "." in a tensor name is
  // matched by "(.+)" like any other character.
  http->Get(std::string(internal::kTensorsPathPrefix) + "(.+)",
            [this](const httplib::Request& request, httplib::Response& response) {
              Guarded(response, [&] { SendTensor(request, response); });
            });
  http->Get(std::string(internal::kMetricsPath),
            [this](const httplib::Request&, httplib::Response& response) {
              Guarded(response, [&] {
                const ReceiverStatus status = session.GetStatus();
                response.set_content(metrics->Render(status, standing.Evaluate(status)),
                                     std::string(kMetricsContentType));
              });
            });
  http->Get(std::string(internal::kHealthPath),
            [](const httplib::Request&, httplib::Response& response) {
              ReplyJson(response, kHttpOk, Json{{"ok", true}});
            });
  http->Get(std::string(internal::kReadyPath),
            [this](const httplib::Request&, httplib::Response& response) {
              Guarded(response, [&] {
                const ControlReply ready = ReadyReply();
                response.status = ready.status;
                response.set_content(ready.body, std::string(internal::kJsonContentType));
              });
            });
  http->set_pre_routing_handler(
      [this](const httplib::Request& request, httplib::Response& response) {
        return PreRoute(request, response);
      });
  http->set_error_handler([this](const httplib::Request& request, httplib::Response& response) {
    Guarded(response, [&] { FillErrorBody(request, response); });
  });
  http->set_exception_handler(
      [](const httplib::Request&, httplib::Response& response, const std::exception_ptr&) {
        ReplyError(response, Internal("control server: unexpected exception in httplib"));
      });
  // Count each request just before its reply is written (so a client that has the reply also
  // sees it counted), whichever path produced it: our handlers, the pre-routing check, or
  // httplib's own errors.
  http->set_post_routing_handler(
      [this](const httplib::Request& request, httplib::Response& response) {
        // Not Guarded: a failure to count must neither replace the reply nor unwind into
        // httplib; dropping one sample is the lesser harm.
        try {
          metrics->RecordRequest(RouteLabel(request), response.status);
          if (response.status >= kHttpFirstError) {
            REFIT_LOG_DEBUG("control server: {} {} from {} -> {}", request.method, request.path,
                            request.remote_addr, response.status);
          }
        } catch (...) {
        }
      });
}

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ControlServer::~ControlServer() { Stop(); }

Result<std::unique_ptr<ControlServer>> ControlServer::Make(const ControlServerOptions& options,
                                                           internal::ReceiverSession& session,
                                                           WeightStore& store) {
  if (options.tls_cert_path.empty() != options.tls_key_path.empty()) {
    return InvalidArgument(
        "control server TLS needs both a certificate and a key (certificate '{}', key '{}')",
        options.tls_cert_path, options.tls_key_path);
  }
  if (options.worker_threads == 0 || options.worker_threads > kMaxWorkerThreads) {
    return InvalidArgument("control server worker_threads {} is outside [1, {}]",
                           options.worker_threads, kMaxWorkerThreads);
  }
  if (options.max_request_bytes == 0 || options.max_json_bytes == 0) {
    return InvalidArgument(
        "control server byte limits must be positive (max_request_bytes {}, "
        "max_json_bytes {})",
        options.max_request_bytes, options.max_json_bytes);
  }
  if (options.max_flush_timeout.count() <= 0) {
    return InvalidArgument("control server max_flush_timeout {} ms must be positive",
                           options.max_flush_timeout.count());
  }
  auto impl = std::make_unique<Impl>(options, session, store);
  REFIT_ASSIGN_OR_RETURN(impl->metrics, internal::ControlMetrics::Make(options.place));
  try {
    if (!options.tls_cert_path.empty()) {
      for (const std::string& path : {options.tls_cert_path, options.tls_key_path}) {
        if (access(path.c_str(), R_OK) != 0) {
          return NotFound("control server TLS file '{}' does not exist or is not readable", path);
        }
      }
      impl->http = std::make_unique<httplib::SSLServer>(options.tls_cert_path.c_str(),
                                                        options.tls_key_path.c_str());
      impl->tls = true;
    } else {
      REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::GuardedHttpServer> guarded,
                             internal::GuardedHttpServer::Make(internal::HttpConnectionLimits{
                                 .worker_threads = options.worker_threads,
                                 .head_timeout = options.request_head_timeout,
                                 .io_timeout = options.io_timeout,
                                 .max_connections_per_peer = options.max_connections_per_peer,
                                 .max_connections = options.max_connections}));
      impl->guarded = guarded.get();
      impl->http = std::move(guarded);
    }
    if (!impl->http->is_valid()) {
      return InvalidArgument(
          "control server TLS certificate '{}' or key '{}' does not load (PEM expected, and the "
          "key must match the certificate)",
          options.tls_cert_path, options.tls_key_path);
    }
    impl->http->set_payload_max_length(options.max_request_bytes);
    impl->http->set_tcp_nodelay(true);
    impl->http->set_keep_alive_timeout(kKeepAliveTimeoutSeconds);
    // TLS connections are served by httplib's own loop: each read and write is limited, a
    // request head as a whole is not (docs/security.md, known gaps).
    impl->http->set_read_timeout(options.io_timeout);
    impl->http->set_write_timeout(options.io_timeout);
    // httplib's default socket options set SO_REUSEPORT, which lets a second server bind a port
    // that is in use and silently steal half its connections. SO_REUSEADDR alone still allows a
    // restart while old connections linger in TIME_WAIT, but reports a port in use.
    Impl* raw = impl.get();
    impl->http->set_socket_options([raw](socket_t socket) {
      const int enable = 1;
      setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &enable, sizeof(enable));
      raw->listen_socket = socket;  // the listening socket, before httplib binds it
    });
    impl->InstallRoutes();
  } catch (const std::exception& error) {
    return Internal("control server setup failed: {}", error.what());
  }
  return std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
}

Status ControlServer::Start() {
  Impl& impl = *impl_;
  internal::MutexLock lock(impl.lifecycle_mutex);
  if (impl.lifecycle != Impl::Lifecycle::kCreated) {
    return FailedPrecondition("control server already {}",
                              impl.lifecycle == Impl::Lifecycle::kRunning ? "started" : "stopped");
  }
  if (impl.guarded != nullptr) {
    REFIT_RETURN_NOT_OK(impl.guarded->StartThreads());
  } else {
    REFIT_ASSIGN_OR_RETURN(impl.workers, WorkerQueue::Make(impl.options.worker_threads));
    // httplib takes ownership of the queue it gets from new_task_queue (its API wants a raw
    // pointer); it asks exactly once, when the listener starts.
    impl.http->new_task_queue = [&impl]() -> httplib::TaskQueue* { return impl.workers.release(); };
  }
  int bound_port = 0;
  if (impl.options.port == 0) {
    bound_port = impl.http->bind_to_any_port(impl.options.bind_address);
  } else {
    bound_port = impl.http->bind_to_port(impl.options.bind_address, impl.options.port)
                     ? impl.options.port
                     : -1;
  }
  if (bound_port <= 0) {
    impl.workers.reset();
    return Unavailable(
        "control server cannot bind {}:{} (address in use, not local, or not "
        "permitted)",
        impl.options.bind_address, impl.options.port);
  }
  impl.port = static_cast<uint16_t>(bound_port);
  // httplib listens with a backlog of 5: a burst of connections (a flood, or many clients at
  // once) overflows it and the kernel drops the next SYNs, so even the coordinator's connect
  // then stalls for a second per retransmit. Listening again only enlarges the queue; the
  // connections still wait for a head without a thread (GuardedHttpServer).
  if (impl.listen_socket >= 0 && ::listen(impl.listen_socket, kListenBacklog) != 0) {
    REFIT_LOG_WARN("control server: cannot enlarge the listen backlog to {}: {}", kListenBacklog,
                   std::strerror(errno));
  }
  try {
    impl.listener = std::jthread([&impl] {
      internal::NameCurrentThread(kListenerThreadName);
      impl.http->listen_after_bind();
      impl.listener_done = true;
    });
  } catch (const std::system_error& error) {
    impl.workers.reset();
    return ResourceExhausted("control server: cannot start the listener thread: {}", error.what());
  }
  impl.lifecycle = Impl::Lifecycle::kRunning;
  if (!impl.verifier.enabled()) {
    REFIT_LOG_WARN(
        "control server {} has NO API KEY: anyone who can reach {}:{} can prepare, commit and "
        "abort transfers and write weights. Set an API key unless the network is trusted.",
        base_url(), impl.options.bind_address, bound_port);
  } else if (!impl.tls && !IsLoopback(impl.options.bind_address)) {
    REFIT_LOG_WARN(
        "control server {} uses plain HTTP on a non-loopback address: the API key "
        "travels in clear text. Configure TLS unless the network is trusted.",
        base_url());
  } else {
    REFIT_LOG_INFO("control server listening on {}", base_url());
  }
  return Status::OK();
}

void ControlServer::Stop() {
  Impl& impl = *impl_;
  internal::MutexLock lock(impl.lifecycle_mutex);
  if (impl.lifecycle != Impl::Lifecycle::kRunning) {
    impl.lifecycle = Impl::Lifecycle::kStopped;
    return;
  }
  impl.stopping.request_stop();
  // httplib's stop() acts only once the listener has entered its accept loop (is_running());
  // called earlier it would be lost and the join below would hang. The window is the few
  // microseconds between Start() and the listener thread's first instructions.
  while (!impl.http->is_running() && !impl.listener_done) {
    std::this_thread::sleep_for(kListenerPollInterval);
  }
  if (!impl.listener_done) impl.http->stop();
  impl.listener.join();
  impl.lifecycle = Impl::Lifecycle::kStopped;
}

uint16_t ControlServer::port() const { return impl_->port; }

ControlReply ControlServer::Serve(const ControlRequest& request) { return impl_->Serve(request); }

Readiness ControlServer::readiness() const {
  impl_->standing.RefreshIfOverdue();
  return impl_->standing.Evaluate(impl_->session.GetStatus());
}

internal::FleetStanding& ControlServer::fleet_standing() { return impl_->standing; }

std::string ControlServer::base_url() const {
  const uint16_t port = impl_->port;
  if (port == 0) return "";
  const std::string& address = impl_->options.bind_address;
  const bool ipv6 = address.find(':') != std::string::npos;
  return fmt::format("{}://{}{}{}:{}", impl_->tls ? "https" : "http", ipv6 ? "[" : "", address,
                     ipv6 ? "]" : "", port);
}

}  // namespace refit
