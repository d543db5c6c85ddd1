#include "refit/control_client.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>

#include "control/protocol.h"
#include "core/digest.h"
#include "refit/status_format.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/tcp_socket.h"

namespace refit {
namespace {

using internal::Json;
using internal::JsonFields;

// Characters of a non-JSON error body quoted in a Status message (the upstream client's cut).
constexpr size_t kMaxQuotedBodyChars = 512;
// Bytes of an error body kept while downloading a tensor: a JSON error is far smaller, and a
// proxy's HTML page is quoted only up to kMaxQuotedBodyChars anyway.
constexpr size_t kMaxErrorBodyBytes = 64 << 10;
// Idle keep-alive connections kept for reuse; more concurrent callers just open more.
constexpr size_t kMaxIdleConnections = 16;

constexpr int kHttpOk = 200;
constexpr int kHttpBadGateway = 502;
constexpr int kHttpServiceUnavailable = 503;
constexpr int kHttpGatewayTimeout = 504;

constexpr uint16_t kDefaultHttpPort = 80;
constexpr uint16_t kDefaultHttpsPort = 443;

// The parts of a base URL.
struct ParsedUrl {
  // "scheme://host:port", what httplib::Client takes.
  std::string origin;
  // "" or "/prefix" without a trailing '/'.
  std::string prefix;
  // The host (IPv6 without brackets) and port, for the probe that explains a failed connect.
  internal::Endpoint endpoint;
};

Result<ParsedUrl> ParseBaseUrl(std::string_view url) {
  std::string_view rest = url;
  bool https = false;
  if (rest.starts_with("http://")) {
    rest.remove_prefix(std::string_view("http://").size());
  } else if (rest.starts_with("https://")) {
    rest.remove_prefix(std::string_view("https://").size());
    https = true;
  } else {
    return InvalidArgument("control client base URL '{}' must start with http:// or https://", url);
  }
  const size_t slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  std::string_view prefix = slash == std::string_view::npos ? "" : rest.substr(slash);
  while (prefix.ends_with('/')) prefix.remove_suffix(1);
  if (prefix.find_first_of("?#") != std::string_view::npos) {
    return InvalidArgument("control client base URL '{}' may not have a query or fragment", url);
  }
  // The host is a name, an IPv4 address or a bracketed IPv6 address; the port is optional.
  std::string_view host = authority;
  std::string_view port_text;
  if (authority.starts_with('[')) {
    const size_t close = authority.find(']');
    if (close == std::string_view::npos) {
      return InvalidArgument("control client base URL '{}': unterminated IPv6 address", url);
    }
    host = authority.substr(0, close + 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (!after.starts_with(':')) {
        return InvalidArgument("control client base URL '{}': junk after the IPv6 address", url);
      }
      port_text = after.substr(1);
    }
  } else if (const size_t colon = authority.rfind(':'); colon != std::string_view::npos) {
    host = authority.substr(0, colon);
    port_text = authority.substr(colon + 1);
  }
  if (host.empty() || host == "[]") {
    return InvalidArgument("control client base URL '{}' has no host", url);
  }
  uint16_t port = https ? kDefaultHttpsPort : kDefaultHttpPort;
  if (!port_text.empty() || authority.ends_with(':')) {
    const auto [end, error] =
        std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (error != std::errc() || end != port_text.data() + port_text.size() || port == 0) {
      return InvalidArgument("control client base URL '{}': port '{}' is not in [1, 65535]", url,
                             port_text);
    }
  }
  std::string_view bare_host = host;
  if (bare_host.starts_with('[')) bare_host = bare_host.substr(1, bare_host.size() - 2);
  return ParsedUrl{fmt::format("{}://{}:{}", https ? "https" : "http", host, port),
                   std::string(prefix), internal::Endpoint{std::string(bare_host), port}};
}

// The longest a failed connect's probe may take: a refused connect answers at once; this bounds
// a host that drops packets, whose request already waited for its own connect timeout.
constexpr std::chrono::milliseconds kConnectProbeLimit{1000};
// How near the deadline a failed read or write counts as one that waited out the budget.
constexpr std::chrono::milliseconds kDeadlineSlack{2};

// Say why a connect to `endpoint` fails, as the user needs it: httplib reports only "Connection"
// (its errno is gone by then), so one more connect asks the kernel. A refused connect means that
// nothing listens there, the usual case of a receiver that is not running (yet).
std::string DescribeConnectFailure(const internal::Endpoint& endpoint,
                                   std::chrono::steady_clock::time_point deadline) {
  const std::string where = internal::EndpointText(endpoint.host, endpoint.port);
  Result<internal::AddrInfoList> addresses = internal::Resolve(endpoint, /*passive=*/false);
  if (!addresses.ok())
    return fmt::format("cannot connect to {}: {}", where, addresses.status().message());
  int error = 0;
  for (const addrinfo* address = addresses->get(); address != nullptr && error != ECONNREFUSED;
       address = address->ai_next) {
    internal::UniqueFd fd(::socket(address->ai_family,
                                   address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                                   address->ai_protocol));
    if (!fd.valid()) continue;
    if (::connect(fd.get(), address->ai_addr, address->ai_addrlen) == 0) {
      return fmt::format("the connection to {} failed (a new one now succeeds)", where);
    }
    error = errno;
    if (error != EINPROGRESS) continue;
    if (!internal::AwaitReady(fd.get(), POLLOUT, deadline).ok()) {
      error = ETIMEDOUT;
      continue;
    }
    socklen_t error_bytes = sizeof(error);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &error_bytes) != 0) error = errno;
    if (error == 0) {
      return fmt::format("the connection to {} failed (a new one now succeeds)", where);
    }
  }
  if (error == ECONNREFUSED) {
    return fmt::format("connection refused: nothing listens on {} (is the receiver running?)",
                       where);
  }
  std::string text = internal::ErrnoText(error);
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return fmt::format("cannot connect to {}: {}", where, text);
}

bool IsRetryableHttpStatus(int status) {
  return status == kHttpBadGateway || status == kHttpServiceUnavailable ||
         status == kHttpGatewayTimeout;
}

// Return the server's JSON error envelope as a Status, or nullopt when `body` is not one.
std::optional<Status> EnvelopeStatus(std::string_view body) {
  Result<Json> parsed = internal::ParseJson(body, "an error response");
  if (!parsed.ok() || !parsed->is_object()) return std::nullopt;
  const Json& value = *parsed;
  const JsonFields fields(value, "error response");
  Result<bool> ok = fields.Bool("ok");
  Result<std::string> code_name = fields.String("code");
  Result<std::string> message = fields.String("message");
  if (!ok.ok() || *ok || !code_name.ok() || !message.ok()) return std::nullopt;
  const std::optional<StatusCode> code = StatusCodeFromName(*code_name);
  if (!code.has_value() || *code == StatusCode::kOk) return std::nullopt;
  return Status(*code, *message);
}

// Return the error an HTTP error response reports: the server's own code and message, or the
// HTTP status's code with the start of whatever body came back (e.g. a proxy's page).
Status ErrorFromResponse(int http_status, std::string_view body, std::string_view what) {
  if (std::optional<Status> status = EnvelopeStatus(body)) return *status;
  return Status(internal::StatusCodeForHttp(http_status),
                fmt::format("{}: HTTP {}: {}", what, http_status,
                            body.substr(0, std::min(body.size(), kMaxQuotedBodyChars))));
}

// Whether a failed attempt may be repeated: 502/503/504, except the server's own
// DeadlineExceeded (the caller's Flush timeout; repeating would multiply it).
bool ShouldRetry(int http_status, std::string_view body) {
  if (!IsRetryableHttpStatus(http_status)) return false;
  const std::optional<Status> status = EnvelopeStatus(body);
  return !status.has_value() || status->code() != StatusCode::kDeadlineExceeded;
}

Result<Json> ParseSuccessBody(std::string_view body, std::string_view what) {
  Result<Json> value = internal::ParseJson(body, fmt::format("{} reply", what));
  if (!value.ok()) return DataLoss("{}", value.status().message());
  const JsonFields fields(*value, fmt::format("{} reply", what));
  Result<bool> ok = fields.Bool("ok");
  if (!ok.ok() || !*ok) {
    return DataLoss("{} reply lacks \"ok\": true: {}", what,
                    body.substr(0, std::min(body.size(), kMaxQuotedBodyChars)));
  }
  return value;
}

// A parsed reply field error is the server's fault, not the caller's: report it as DataLoss.
Status ReplyFieldError(const Status& status) {
  return Status(StatusCode::kDataLoss, status.message());
}

Json TransferBody(const TransferId& id) { return Json{{"transfer_id", id.ToHex()}}; }

using Clock = std::chrono::steady_clock;

// Cuts the connection of a request that runs past its deadline. httplib's timeouts bound each
// connect, read and write, not a request: a receiver that accepts and then drips one byte per
// read timeout would hold a call, and the coordinator behind it, for as long as it likes.
//
// Thread-safety: every member function may be called concurrently. After Disarm returns, the
// watchdog no longer touches that client.
class RequestWatchdog {
 public:
  ~RequestWatchdog() {
    if (thread_.joinable()) {
      thread_.request_stop();
      changed_.notify_all();
      thread_.join();
    }
  }

  // Stop `client` (shut its socket down, so the request fails at once) at `deadline`, unless
  // the returned token is disarmed first. Errors: ResourceExhausted when the OS refuses the
  // watchdog's thread.
  Result<uint64_t> Arm(Clock::time_point deadline, httplib::Client* client) {
    internal::MutexLock lock(mutex_);
    if (!thread_.joinable()) {
      // std::thread reports an OS refusal only by throwing; no exception may leave the library.
      try {
        thread_ = std::jthread([this](std::stop_token stop) { Run(stop); });
      } catch (const std::system_error& error) {
        return ResourceExhausted("control client: cannot start its deadline thread: {}",
                                 error.what());
      }
    }
    const uint64_t token = next_token_++;
    armed_.emplace(token, Armed{deadline, client});
    // The new deadline may be the earliest: the thread must look again.
    ++generation_;
    changed_.notify_all();
    return token;
  }

  void Disarm(uint64_t token) {
    internal::MutexLock lock(mutex_);
    armed_.erase(token);
  }

 private:
  struct Armed {
    Clock::time_point deadline;
    httplib::Client* client;
  };

  void Run(std::stop_token stop) {
    internal::MutexLock lock(mutex_);
    while (!stop.stop_requested()) {
      Clock::time_point next = Clock::time_point::max();
      const Clock::time_point now = Clock::now();
      for (auto it = armed_.begin(); it != armed_.end();) {
        if (it->second.deadline <= now) {
          // Under the lock, so that Disarm (and the client's destruction after it) waits.
          it->second.client->stop();
          it = armed_.erase(it);
        } else {
          next = std::min(next, it->second.deadline);
          ++it;
        }
      }
      const uint64_t seen = generation_;
      changed_.wait_until(lock, stop, next, [&] { return generation_ != seen; });
    }
  }

  internal::Mutex mutex_;
  internal::CondVar changed_;
  std::map<uint64_t, Armed> armed_;
  uint64_t next_token_ = 0;
  // Counts Arm calls, so the thread notices a deadline earlier than the one it waits for.
  uint64_t generation_ = 0;
  std::jthread thread_;
};

}  // namespace

struct ControlClient::Impl {
  ControlClientOptions options;
  ParsedUrl url;
  std::string base_url;
  // Set once Regions found a receiver that predates POST /v1/regions, so that it warns once.
  std::atomic<bool> warned_no_regions{false};
  // SetCallDeadline's bound as steady_clock ticks since its epoch; kNoCallDeadline: none.
  static constexpr Clock::rep kNoCallDeadline = std::numeric_limits<Clock::rep>::max();
  std::atomic<Clock::rep> call_deadline{kNoCallDeadline};

  // The bound SetCallDeadline set, if any.
  std::optional<Clock::time_point> CallDeadline() const {
    const Clock::rep ticks = call_deadline.load();
    if (ticks == kNoCallDeadline) return std::nullopt;
    return Clock::time_point(Clock::duration(ticks));
  }

  internal::Mutex idle_mutex;
  std::vector<std::unique_ptr<httplib::Client>> idle;
  // Declared after `idle`: destroyed first, so it never stops a client that is gone.
  RequestWatchdog watchdog;

  // One request, made on a borrowed connection; called once per attempt.
  using Request =
      std::function<httplib::Result(httplib::Client& client, const httplib::Headers& headers)>;
  // The status and body of a completed exchange.
  struct Reply {
    int status = 0;
    std::string body;
    httplib::Headers headers;
  };

  // A connection whose connect, read and write timeouts end at `deadline` at the latest.
  std::unique_ptr<httplib::Client> Borrow(std::optional<Clock::time_point> deadline);
  void Return(std::unique_ptr<httplib::Client> client);
  // Run `request` with retries; return the last reply, whatever its status (only connection
  // failures become an error here). Every attempt together ends within options.timeout plus
  // `server_time` (how long the server may take to answer: a flush's wait), whatever the
  // server does: DeadlineExceeded then. Without `server_time` (bulk bytes whose duration
  // depends on their size and on the server's apply queue) only each connect, read and write
  // is limited, to options.timeout.
  Result<Reply> Call(
      std::string_view what, const Request& request,
      std::optional<std::chrono::milliseconds> server_time = std::chrono::milliseconds(0));
  // POST a body of `content_type` and return the parsed success reply, or the error the
  // server reported.
  Result<Json> PostText(std::string_view path, const std::string& text,
                        std::string_view content_type, std::chrono::milliseconds server_time = {});
  Result<Json> PostJson(std::string_view path, const Json& body,
                        std::chrono::milliseconds server_time = {}) {
    return PostText(path, internal::DumpJson(body), internal::kJsonContentType, server_time);
  }
  Result<Json> GetJson(std::string_view path);
  // The same exchange through options.carrier instead of HTTP.
  Result<Json> Carry(std::string_view method, std::string_view path, std::string body,
                     std::chrono::milliseconds server_time);
  // FailedPrecondition for the bulk routes, which a carrier does not take.
  Status RefuseBulk(std::string_view what) const {
    return FailedPrecondition("{}: {} is not carried by the control channel of this transport",
                              base_url, what);
  }
  std::string Path(std::string_view route) const { return url.prefix + std::string(route); }
};

std::unique_ptr<httplib::Client> ControlClient::Impl::Borrow(
    std::optional<Clock::time_point> deadline) {
  std::unique_ptr<httplib::Client> client;
  {
    internal::MutexLock lock(idle_mutex);
    if (!idle.empty()) {
      client = std::move(idle.back());
      idle.pop_back();
    }
  }
  if (client == nullptr) {
    client = std::make_unique<httplib::Client>(url.origin);
    client->set_keep_alive(true);
    // Paths are percent-encoded here (PercentEncode), so httplib must not encode them again.
    client->set_url_encode(false);
    client->set_tcp_nodelay(true);
    if (!options.tls_ca_cert_path.empty()) client->set_ca_cert_path(options.tls_ca_cert_path);
    client->enable_server_certificate_verification(options.tls_verify);
  }
  // Each connect, read and write gives up at the deadline too; the watchdog (Call) covers the
  // sum of many reads and writes that each stay within their own limit.
  std::chrono::milliseconds limit = options.timeout;
  std::chrono::milliseconds read_limit = options.timeout;
  if (deadline.has_value()) {
    // Rounded up: a read limit cut short by truncation would end a hair before the deadline,
    // and the silence would be reported as a failed read instead of a missed deadline.
    const auto left =
        std::max(std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now()),
                 std::chrono::milliseconds(1));
    limit = std::min(left, options.timeout);
    // A flush's reply comes after its wait on the server: one read may take the whole budget.
    read_limit = left;
  }
  client->set_connection_timeout(limit);
  client->set_read_timeout(read_limit);
  client->set_write_timeout(limit);
  return client;
}

void ControlClient::Impl::Return(std::unique_ptr<httplib::Client> client) {
  internal::MutexLock lock(idle_mutex);
  if (idle.size() < kMaxIdleConnections) idle.push_back(std::move(client));
}

Result<ControlClient::Impl::Reply> ControlClient::Impl::Call(
    std::string_view what, const Request& request,
    std::optional<std::chrono::milliseconds> server_time) {
  httplib::Headers headers;
  if (!options.api_key.empty()) headers.emplace("Authorization", "Bearer " + options.api_key);
  const std::string description = fmt::format("{} {}", base_url, what);
  std::chrono::milliseconds budget = options.timeout + server_time.value_or(options.timeout);
  const Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> deadline =
      server_time.has_value() ? std::optional(start + budget) : std::nullopt;
  // The caller's bound (SetCallDeadline) cuts the call's own budget short, bulk calls included.
  if (const std::optional<Clock::time_point> bound = CallDeadline();
      bound.has_value() && (!deadline.has_value() || *bound < *deadline)) {
    deadline = std::max(*bound, start);
    budget = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - start);
  }
  auto past_deadline = [&](int attempt) {
    return DeadlineExceeded("{}: no complete answer within {} ms (attempt {} of {})", description,
                            budget.count(), attempt + 1, options.max_retries + 1);
  };
  if (deadline.has_value() && *deadline <= start) return past_deadline(0);
  Status last_error;
  std::chrono::milliseconds backoff = options.retry_backoff;
  for (int attempt = 0; attempt <= options.max_retries; ++attempt) {
    if (attempt > 0) {
      // A retry that could not finish in time is not made: the caller's budget is the limit.
      if (deadline.has_value() && Clock::now() + backoff >= *deadline) return last_error;
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, options.max_retry_backoff);
    }
    // httplib and the allocator report failures by throwing; no exception may leave the library.
    try {
      std::unique_ptr<httplib::Client> client = Borrow(deadline);
      std::optional<uint64_t> token;
      if (deadline.has_value()) {
        REFIT_ASSIGN_OR_RETURN(token, watchdog.Arm(*deadline, client.get()));
      }
      httplib::Result result = request(*client, headers);
      if (token.has_value()) watchdog.Disarm(*token);
      if (!result) {
        // The connection is in an unknown state: drop it rather than return it to the pool.
        // httplib's timers and ours are not one clock tick: a read that gave up within
        // kDeadlineSlack of the deadline waited out the budget. (A reset that happens to come
        // in those 2 ms is reported as the deadline too: the caller's budget was spent either
        // way.)
        if (deadline.has_value() && Clock::now() + kDeadlineSlack >= *deadline) {
          return past_deadline(attempt);
        }
        std::string why = httplib::to_string(result.error());
        if (result.error() == httplib::Error::Connection) {
          Clock::time_point probe_deadline = Clock::now() + kConnectProbeLimit;
          if (deadline.has_value()) probe_deadline = std::min(probe_deadline, *deadline);
          why = DescribeConnectFailure(url.endpoint, probe_deadline);
        } else if (result.error() == httplib::Error::ConnectionTimeout) {
          why = fmt::format("connect to {} timed out (a host that is down, or a firewall)",
                            internal::EndpointText(url.endpoint.host, url.endpoint.port));
        }
        last_error = Unavailable("{}: {} (attempt {} of {})", description, why, attempt + 1,
                                 options.max_retries + 1);
        continue;
      }
      Reply reply{result->status, std::move(result->body), std::move(result->headers)};
      Return(std::move(client));
      if (ShouldRetry(reply.status, reply.body) && attempt < options.max_retries) {
        last_error = ErrorFromResponse(reply.status, reply.body, description);
        continue;
      }
      return reply;
    } catch (const std::bad_alloc&) {
      return ResourceExhausted("{}: out of memory", description);
    } catch (const std::exception& error) {
      return Internal("{}: unexpected exception: {}", description, error.what());
    }
  }
  return last_error;
}

Result<Json> ControlClient::Impl::Carry(std::string_view method, std::string_view path,
                                        std::string body, std::chrono::milliseconds server_time) {
  const std::string what = fmt::format("{} {} {}", base_url, method, path);
  std::chrono::milliseconds timeout = options.timeout + server_time;
  if (const std::optional<Clock::time_point> bound = CallDeadline(); bound.has_value()) {
    timeout = std::min(
        timeout,
        std::max(std::chrono::duration_cast<std::chrono::milliseconds>(*bound - Clock::now()),
                 std::chrono::milliseconds(0)));
    if (timeout.count() == 0) return DeadlineExceeded("{}: the caller's deadline passed", what);
  }
  Result<ControlReply> reply = options.carrier(
      ControlRequest{std::string(method), std::string(path), std::move(body)}, timeout);
  if (!reply.ok()) return reply.status().WithContext(what);
  if (reply->status != kHttpOk) return ErrorFromResponse(reply->status, reply->body, what);
  return ParseSuccessBody(reply->body, fmt::format("{} {}", method, path));
}

Result<Json> ControlClient::Impl::PostText(std::string_view path, const std::string& text,
                                           std::string_view content_type,
                                           std::chrono::milliseconds server_time) {
  if (options.carrier) return Carry("POST", path, text, server_time);
  const std::string full_path = Path(path);
  REFIT_ASSIGN_OR_RETURN(const Reply reply,
                         Call(
                             fmt::format("POST {}", path),
                             [&](httplib::Client& client, const httplib::Headers& headers) {
                               return client.Post(full_path, headers, text,
                                                  std::string(content_type));
                             },
                             server_time));
  if (reply.status != kHttpOk) {
    return ErrorFromResponse(reply.status, reply.body, fmt::format("{} POST {}", base_url, path));
  }
  return ParseSuccessBody(reply.body, fmt::format("POST {}", path));
}

Result<Json> ControlClient::Impl::GetJson(std::string_view path) {
  if (options.carrier) return Carry("GET", path, std::string(), std::chrono::milliseconds(0));
  const std::string full_path = Path(path);
  REFIT_ASSIGN_OR_RETURN(const Reply reply,
                         Call(fmt::format("GET {}", path),
                              [&](httplib::Client& client, const httplib::Headers& headers) {
                                return client.Get(full_path, headers);
                              }));
  if (reply.status != kHttpOk) {
    return ErrorFromResponse(reply.status, reply.body, fmt::format("{} GET {}", base_url, path));
  }
  return ParseSuccessBody(reply.body, fmt::format("GET {}", path));
}

ControlClient::ControlClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlClient::~ControlClient() = default;

Result<std::unique_ptr<ControlClient>> ControlClient::Make(const ControlClientOptions& options) {
  if (options.max_retries < 0) {
    return InvalidArgument("control client max_retries {} is negative", options.max_retries);
  }
  if (options.timeout.count() <= 0 || options.retry_backoff.count() < 0 ||
      options.max_retry_backoff < options.retry_backoff) {
    return InvalidArgument(
        "control client timeouts must satisfy timeout > 0 and 0 <= retry_backoff <= "
        "max_retry_backoff (got {} ms, {} ms, {} ms)",
        options.timeout.count(), options.retry_backoff.count(), options.max_retry_backoff.count());
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.carrier) {
    if (options.base_url.empty()) return InvalidArgument("control client: a carrier needs a name");
    impl->base_url = options.base_url;
    return std::unique_ptr<ControlClient>(new ControlClient(std::move(impl)));
  }
  REFIT_ASSIGN_OR_RETURN(impl->url, ParseBaseUrl(options.base_url));
  impl->base_url = impl->url.origin + impl->url.prefix;
  return std::unique_ptr<ControlClient>(new ControlClient(std::move(impl)));
}

const std::string& ControlClient::base_url() const { return impl_->base_url; }

Result<PrepareResult> ControlClient::Prepare(const PrepareRequest& request) {
  Json body = TransferBody(request.transfer_id);
  body["base_version"] = request.base_version;
  if (request.anchor) body["anchor"] = true;
  if (request.target_version != 0) body["target_version"] = request.target_version;
  internal::PutExpectation(request.expected, body);
  if (request.relay_tree.has_value()) internal::PutRelayTree(*request.relay_tree, body);
  internal::PutLineage(request.lineage, body);
  REFIT_ASSIGN_OR_RETURN(const Json reply, impl_->PostJson(internal::kPreparePath, body));
  const JsonFields fields(reply, "prepare reply");
  PrepareResult result;
  Result<bool> repeated = fields.Bool("repeated");
  if (!repeated.ok()) return ReplyFieldError(repeated.status());
  result.repeated = *repeated;
  Result<std::optional<TransferId>> implied = fields.OptionalTransfer("implied_commit");
  if (!implied.ok()) return ReplyFieldError(implied.status());
  result.implied_commit = *implied;
  // Absent from receivers older than implied aborts.
  Result<std::optional<TransferId>> aborted = fields.OptionalTransfer("implied_abort");
  if (!aborted.ok()) return ReplyFieldError(aborted.status());
  result.implied_abort = *aborted;
  return result;
}

Result<FlushReport> ControlClient::Flush(const TransferId& id, const FlushOptions& options) {
  if (options.timeout.count() < 0) {
    return InvalidArgument("flush timeout {} ms is negative", options.timeout.count());
  }
  Json body = TransferBody(id);
  body["timeout_ms"] = static_cast<uint64_t>(options.timeout.count());
  internal::PutExpectation(options.expected, body);
  // The server holds the request for up to the flush timeout before it answers.
  REFIT_ASSIGN_OR_RETURN(const Json reply,
                         impl_->PostJson(internal::kFlushPath, body, options.timeout));
  Result<FlushReport> report = internal::FlushReportFromJson(reply);
  if (!report.ok()) return ReplyFieldError(report.status());
  return report;
}

Status ControlClient::Commit(const TransferId& id) {
  return impl_->PostJson(internal::kCommitPath, TransferBody(id)).status();
}

Status ControlClient::Abort(const TransferId& id) {
  return impl_->PostJson(internal::kAbortPath, TransferBody(id)).status();
}

Status ControlClient::Fence(const TransferId& id, uint64_t fleet_version) {
  Json body = TransferBody(id);
  body["fenced_at_version"] = fleet_version;
  return impl_->PostJson(internal::kAbortPath, body).status();
}

void ControlClient::SetCallDeadline(std::optional<std::chrono::steady_clock::time_point> deadline) {
  impl_->call_deadline.store(deadline.has_value() ? deadline->time_since_epoch().count()
                                                  : Impl::kNoCallDeadline);
}

Result<HeldRegions> ControlClient::Regions(const std::vector<std::string>& canonical_names) {
  if (canonical_names.size() > kMaxRegionTensors) {
    return InvalidArgument("regions: {} tensor names, more than the {} one call may ask about",
                           canonical_names.size(), kMaxRegionTensors);
  }
  const Json body{{"tensors", canonical_names}};
  Result<Json> reply = impl_->PostJson(internal::kRegionsPath, body);
  // A receiver's own Regions never answers NotFound (it omits the names it does not hold); one
  // that predates the route answers it for the path. Sending such a receiver every item is
  // correct whatever it holds, so it is answered for as holding everything whole.
  if (reply.status().code() == StatusCode::kNotFound) {
    if (!impl_->warned_no_regions.exchange(true)) {
      REFIT_LOG_WARN(
          "{}: the receiver does not serve POST {} (it predates routing by holdings); "
          "it is sent every item: {}",
          impl_->base_url, internal::kRegionsPath, reply.status().message());
    }
    return HeldRegions{};
  }
  if (!reply.ok()) return reply.status();
  Result<HeldRegions> regions = internal::RegionsFromJson(*reply);
  if (!regions.ok()) return ReplyFieldError(regions.status());
  return regions;
}

Result<StageResult> ControlClient::SendPayload(std::span<const std::byte> payload) {
  if (impl_->options.carrier) return impl_->RefuseBulk("POST /v1/payload");
  const std::string path = impl_->Path(internal::kPayloadPath);
  const std::string what = fmt::format("POST {}", internal::kPayloadPath);
  REFIT_ASSIGN_OR_RETURN(
      const Impl::Reply reply,
      impl_->Call(
          what,
          [&](httplib::Client& client, const httplib::Headers& headers) {
            // A content provider streams the caller's bytes without copying them into the
            // request.
            return client.Post(
                path, headers, payload.size(),
                [payload](size_t offset, size_t length, httplib::DataSink& sink) {
                  return sink.write(reinterpret_cast<const char*>(payload.data() + offset), length);
                },
                std::string(internal::kOctetStreamContentType));
          },
          std::nullopt));
  if (reply.status != kHttpOk) {
    return ErrorFromResponse(reply.status, reply.body, impl_->base_url + what);
  }
  REFIT_ASSIGN_OR_RETURN(const Json body, ParseSuccessBody(reply.body, what));
  const JsonFields fields(body, "payload reply");
  Result<std::string> result = fields.String("result");
  if (!result.ok()) return ReplyFieldError(result.status());
  if (*result == "accepted") return StageResult::kAccepted;
  if (*result == "duplicate") return StageResult::kDuplicate;
  return DataLoss("payload reply: unknown result '{}'", *result);
}

Result<StageResult> ControlClient::AnnounceManifest(std::string_view manifest,
                                                    std::chrono::milliseconds stage_time) {
  if (stage_time.count() < 0) {
    return InvalidArgument("manifest stage time {} ms is negative", stage_time.count());
  }
  if (impl_->options.carrier) return impl_->RefuseBulk("POST /v1/manifest");
  // The server fetches and stages the payload before it answers.
  REFIT_ASSIGN_OR_RETURN(const Json reply,
                         impl_->PostText(internal::kManifestPath, std::string(manifest),
                                         internal::kJsonContentType, stage_time));
  const JsonFields fields(reply, "manifest reply");
  Result<std::string> result = fields.String("result");
  if (!result.ok()) return ReplyFieldError(result.status());
  if (*result == "accepted") return StageResult::kAccepted;
  if (*result == "duplicate") return StageResult::kDuplicate;
  return DataLoss("manifest reply: unknown result '{}'", *result);
}

Result<ControlStatus> ControlClient::GetStatus() {
  REFIT_ASSIGN_OR_RETURN(const Json body, impl_->GetJson(internal::kStatusPath));
  Result<internal::ControlStatusFields> fields = internal::StatusFromJson(body);
  if (!fields.ok()) return ReplyFieldError(fields.status());
  return ControlStatus{std::move(fields->receiver), fields->tensors, fields->state_fingerprint,
                       std::move(fields->place),    fields->relay,   std::move(fields->readiness)};
}

namespace {

// What a receiver's join or leave may take on top of the client's own timeout: its own call to
// the publisher (ControlClientOptions::timeout by default).
constexpr std::chrono::milliseconds kFleetCallServerTime = std::chrono::seconds(30);

Result<FleetMembership> MembershipReply(Result<Json> body) {
  if (!body.ok()) return body.status();
  Result<FleetMembership> membership = internal::MembershipFromJson(*body);
  if (!membership.ok()) return ReplyFieldError(membership.status());
  return membership;
}

}  // namespace

Result<FleetMembership> ControlClient::JoinFleet(const std::string& publisher_url,
                                                 const MemberEndpoint& advertised) {
  Json body{{"publisher_url", publisher_url}};
  if (!advertised.control_url.empty()) body["control_url"] = advertised.control_url;
  if (!advertised.data_endpoint.empty()) body["data_endpoint"] = advertised.data_endpoint;
  return MembershipReply(impl_->PostText(internal::kJoinPath, internal::DumpJson(body),
                                         internal::kJsonContentType, kFleetCallServerTime));
}

Result<FleetMembership> ControlClient::LeaveFleet() {
  return MembershipReply(impl_->PostText(internal::kLeavePath, "{}", internal::kJsonContentType,
                                         kFleetCallServerTime));
}

Result<FleetMembership> ControlClient::GetMembership() {
  return MembershipReply(impl_->GetJson(internal::kMembersPath));
}

Result<FleetMembership> ControlClient::AddMember(const MemberEndpoint& member) {
  return MembershipReply(impl_->PostText(internal::kMembersJoinPath,
                                         internal::DumpJson(internal::MemberEndpointToJson(member)),
                                         internal::kJsonContentType, std::chrono::milliseconds(0)));
}

Result<FleetMembership> ControlClient::RemoveMember(const std::string& control_url) {
  return MembershipReply(impl_->PostText(internal::kMembersLeavePath,
                                         internal::DumpJson(Json{{"control_url", control_url}}),
                                         internal::kJsonContentType, std::chrono::milliseconds(0)));
}

Status ControlClient::CheckHealth() { return impl_->GetJson(internal::kHealthPath).status(); }

Result<TensorListing> ControlClient::ListTensors() {
  REFIT_ASSIGN_OR_RETURN(const Json body, impl_->GetJson(internal::kTensorsPath));
  Result<TensorListing> listing = internal::TensorListingFromJson(body);
  if (!listing.ok()) return ReplyFieldError(listing.status());
  return listing;
}

Result<OwnedTensor> ControlClient::GetTensor(std::string_view name, uint64_t* digest_out) {
  if (impl_->options.carrier) return impl_->RefuseBulk("GET /v1/tensors");
  const std::string route =
      std::string(internal::kTensorsPathPrefix) + internal::PercentEncode(name);
  const std::string path = impl_->Path(route);
  const std::string what = fmt::format("GET {}", route);
  std::vector<std::byte> bytes;
  int http_status = 0;
  REFIT_ASSIGN_OR_RETURN(
      const Impl::Reply reply,
      impl_->Call(
          what,
          [&](httplib::Client& client, const httplib::Headers& headers) {
            bytes.clear();
            return client.Get(
                path, headers,
                [&](const httplib::Response& response) {
                  http_status = response.status;
                  if (http_status == kHttpOk) {
                    bytes.reserve(response.get_header_value<uint64_t>("Content-Length"));
                  }
                  return true;
                },
                [&](const char* data, size_t length) {
                  // An error body is kept only as far as it can be quoted.
                  const size_t keep =
                      http_status == kHttpOk
                          ? length
                          : std::min(length, kMaxErrorBodyBytes -
                                                 std::min(bytes.size(), kMaxErrorBodyBytes));
                  const auto* begin = reinterpret_cast<const std::byte*>(data);
                  bytes.insert(bytes.end(), begin, begin + keep);
                  return true;
                });
          },
          std::nullopt));
  if (reply.status != kHttpOk) {
    const std::string_view body(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return ErrorFromResponse(reply.status, body, impl_->base_url + what);
  }
  auto header = [&](std::string_view key) -> Result<std::string> {
    const auto it = reply.headers.find(std::string(key));
    if (it == reply.headers.end()) {
      return DataLoss("{}: reply lacks the {} header", what, key);
    }
    return it->second;
  };
  OwnedTensor tensor{std::string(name), DType::kUInt8, {}, {}};
  REFIT_ASSIGN_OR_RETURN(const std::string dtype_name, header(internal::kDtypeHeader));
  Result<DType> dtype = ParseDType(dtype_name);
  if (!dtype.ok()) return DataLoss("{}: {}", what, dtype.status().message());
  tensor.dtype = *dtype;
  REFIT_ASSIGN_OR_RETURN(const std::string shape_text, header(internal::kShapeHeader));
  Result<Json> parsed_shape = internal::ParseJson(shape_text, internal::kShapeHeader);
  const Json shape = parsed_shape.ok() ? std::move(*parsed_shape) : Json();
  if (!shape.is_array()) {
    return DataLoss("{}: {} '{}' is not a JSON array", what, internal::kShapeHeader, shape_text);
  }
  for (const Json& extent : shape) {
    if (!extent.is_number_unsigned()) {
      return DataLoss("{}: {} '{}' has a non-integer extent", what, internal::kShapeHeader,
                      shape_text);
    }
    tensor.shape.push_back(static_cast<int64_t>(extent.get<uint64_t>()));
  }
  REFIT_ASSIGN_OR_RETURN(const std::string digest_hex, header(internal::kDigestHeader));
  Result<uint64_t> digest = internal::DigestFromHex(digest_hex, internal::kDigestHeader);
  if (!digest.ok()) return DataLoss("{}: {}", what, digest.status().message());
  tensor.bytes = std::move(bytes);
  Status size = CheckTensorSize(tensor.view());
  if (!size.ok()) return DataLoss("{}: {}", what, size.message());
  const uint64_t actual = TensorDigest(tensor.view());
  if (actual != *digest) {
    return DataLoss("{}: tensor '{}' digest {} != {} sent by the server", what, tensor.name,
                    internal::DigestToHex(actual), digest_hex);
  }
  if (digest_out != nullptr) *digest_out = actual;
  return tensor;
}

ManifestAnnouncerFactory MakeControlManifestAnnouncers(const ControlClientOptions& options) {
  // One client per receiver, kept for the factory's life: its idle connections are reused from
  // one transfer's senders to the next.
  struct Clients {
    internal::Mutex mutex;
    std::map<std::string, std::shared_ptr<ControlClient>> by_url;
  };
  auto clients = std::make_shared<Clients>();
  return [options,
          clients](const std::string& endpoint) -> Result<std::shared_ptr<ManifestAnnouncer>> {
    internal::MutexLock lock(clients->mutex);
    std::shared_ptr<ControlClient>& client = clients->by_url[endpoint];
    if (client == nullptr) {
      ControlClientOptions receiver = options;
      receiver.base_url = endpoint;
      Result<std::unique_ptr<ControlClient>> made = ControlClient::Make(receiver);
      if (!made.ok()) {
        clients->by_url.erase(endpoint);
        return made.status();
      }
      client = std::shared_ptr<ControlClient>(std::move(made).ValueOrDie());
    }
    return std::shared_ptr<ManifestAnnouncer>(client);
  };
}

std::string ControlStatusToJson(const ControlStatus& status) {
  internal::Json body = internal::StatusToJson(
      internal::ControlStatusFields{status.receiver, status.tensors, status.state_fingerprint,
                                    status.place, status.relay, status.readiness});
  body.erase("ok");
  return internal::DumpJson(body);
}

std::string ControlMembershipToJson(const FleetMembership& membership) {
  internal::Json body = internal::MembershipToJson(membership);
  body.erase("ok");
  return internal::DumpJson(body);
}

}  // namespace refit
