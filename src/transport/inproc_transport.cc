// inproc://<hub>: an in-process hub of named endpoints, for tests and single-process demos.
//
// A listener binds an endpoint name in a hub (a process-wide directory keyed by hub and name);
// a sender looks each of its endpoints up at every Send and calls the endpoint's sink on the
// sending thread, so Send returns the sink's own verdict (staged ACK) and nothing is ever in
// flight inside the transport. Two Transport objects made from the same URI share the hub.
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/transport_internal.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

constexpr TransportCapabilities kInprocCapabilities{
    .staged_ack = true, .in_process = true, .reports_stream_end = true};

// One bound endpoint: the sink, and a gate that lets Stop wait for the deliveries in progress.
//
// Thread-safety: every member function may be called concurrently.
class InprocEndpoint {
 public:
  InprocEndpoint(PayloadSink& sink, const PayloadLimits& limits) : sink_(sink), limits_(limits) {}

  // Deliver a copy of `payload`, its header validated under the listener's limits.
  // Errors: Unavailable once closed; as ValidatePayloadHeader; the sink's refusal.
  Result<StageResult> Deliver(std::span<const std::byte> payload) {
    REFIT_RETURN_NOT_OK(Enter());
    Result<ValidatedPayload> validated = ValidatePayload(payload, limits_);
    Result<StageResult> result = validated.ok()
                                     ? sink_.Deliver(std::move(*validated), stop_.get_token())
                                     : Result<StageResult>(validated.status());
    internal::MutexLock lock(mutex_);
    if (result.ok()) {
      ++(*result == StageResult::kDuplicate ? stats_.duplicates : stats_.delivered);
    } else {
      ++stats_.failures;
      stats_.last_error = result.status();
    }
    Leave();
    return result;
  }

  Status EndOfStream(const StreamEnd& end) {
    REFIT_RETURN_NOT_OK(Enter());
    Status status = sink_.EndOfStream(end);
    internal::MutexLock lock(mutex_);
    if (status.ok()) {
      ++stats_.streams_ended;
    } else {
      ++stats_.failures;
      stats_.last_error = status;
    }
    Leave();
    return status;
  }

  // Refuse new deliveries, cancel blocked ones, and wait until none runs.
  void Close() {
    {
      internal::MutexLock lock(mutex_);
      closed_ = true;
    }
    stop_.request_stop();
    internal::MutexLock lock(mutex_);
    idle_.wait(lock, [this] { return active_ == 0; });
  }

  ListenerStats stats() const {
    internal::MutexLock lock(mutex_);
    return stats_;
  }

 private:
  Status Enter() {
    internal::MutexLock lock(mutex_);
    if (closed_) return Unavailable("the listener stopped");
    ++active_;
    return Status::OK();
  }

  // Called with mutex_ held.
  void Leave() {
    if (--active_ == 0) idle_.notify_all();
  }

  PayloadSink& sink_;
  const PayloadLimits limits_;
  std::stop_source stop_;
  mutable internal::Mutex mutex_;
  internal::CondVar idle_;
  int active_ = 0;
  bool closed_ = false;
  ListenerStats stats_;
};

// The process-wide directory of bound endpoints, keyed by (hub, endpoint name).
class InprocDirectory {
 public:
  static InprocDirectory& Get() {
    static InprocDirectory directory;
    return directory;
  }

  Status Bind(const std::string& hub, const std::string& name,
              std::shared_ptr<InprocEndpoint> endpoint) {
    internal::MutexLock lock(mutex_);
    if (!endpoints_.emplace(std::pair(hub, name), std::move(endpoint)).second) {
      return AlreadyExists("inproc://{}: endpoint '{}' is already bound", hub, name);
    }
    return Status::OK();
  }

  // Unbind `name` if `endpoint` is still the one bound there.
  void Unbind(const std::string& hub, const std::string& name, const InprocEndpoint* endpoint) {
    internal::MutexLock lock(mutex_);
    auto it = endpoints_.find(std::pair(hub, name));
    if (it != endpoints_.end() && it->second.get() == endpoint) endpoints_.erase(it);
  }

  // Return the endpoint bound at `name`, or null.
  std::shared_ptr<InprocEndpoint> Find(const std::string& hub, const std::string& name) const {
    internal::MutexLock lock(mutex_);
    auto it = endpoints_.find(std::pair(hub, name));
    return it == endpoints_.end() ? nullptr : it->second;
  }

 private:
  mutable internal::Mutex mutex_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<InprocEndpoint>> endpoints_;
};

// Endpoint names are chosen by tests and configuration; printable ASCII keeps messages legible.
Status CheckEndpointName(const std::string& hub, const std::string& name) {
  if (name.empty()) return InvalidArgument("inproc://{}: empty endpoint name", hub);
  for (const char c : name) {
    if (c < 0x21 || c > 0x7e) {
      return InvalidArgument("inproc://{}: endpoint name '{}' has a byte outside printable ASCII",
                             hub, Printable(name));
    }
  }
  return Status::OK();
}

class InprocSender final : public TransportSender {
 public:
  InprocSender(std::string hub, SenderContext context, PayloadLimits limits)
      : TransportSender(std::move(context), limits), hub_(std::move(hub)) {}

 private:
  Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                 const PayloadHeader& /*header*/) override {
    for (const std::string& name : context().endpoints) {
      const std::shared_ptr<InprocEndpoint> endpoint = InprocDirectory::Get().Find(hub_, name);
      if (endpoint == nullptr) return NoListener(name);
      Result<StageResult> staged = endpoint->Deliver(payload);
      if (!staged.ok()) {
        return staged.status().WithContext(
            fmt::format("inproc://{} endpoint '{}', payload {} of producer {}", hub_, name,
                        payload_id, context().producer_id));
      }
    }
    return Status::OK();
  }

  Status EndStream(uint64_t payloads) override {
    const StreamEnd end{context().transfer_id, context().producer_id,
                        static_cast<uint32_t>(payloads)};
    for (const std::string& name : context().endpoints) {
      const std::shared_ptr<InprocEndpoint> endpoint = InprocDirectory::Get().Find(hub_, name);
      if (endpoint == nullptr) return NoListener(name);
      REFIT_RETURN_NOT_OK(endpoint->EndOfStream(end).WithContext(fmt::format(
          "inproc://{} endpoint '{}', end of producer {}", hub_, name, context().producer_id)));
    }
    return Status::OK();
  }

  Status NoListener(const std::string& name) const {
    return Unavailable("inproc://{}: no listener at endpoint '{}'", hub_, name);
  }

  const std::string hub_;
};

class InprocListener final : public Listener {
 public:
  InprocListener(std::string hub, std::string endpoint, PayloadSink& sink,
                 const PayloadLimits& limits)
      : hub_(std::move(hub)), endpoint_name_(std::move(endpoint)), sink_(sink), limits_(limits) {}

  ~InprocListener() override { Stop(); }

  Status Start() override {
    internal::MutexLock lock(mutex_);
    if (endpoint_ != nullptr) {
      return FailedPrecondition("inproc://{}: listener at '{}' was started before", hub_,
                                endpoint_name_);
    }
    auto endpoint = std::make_shared<InprocEndpoint>(sink_, limits_);
    REFIT_RETURN_NOT_OK(InprocDirectory::Get().Bind(hub_, endpoint_name_, endpoint));
    endpoint_ = std::move(endpoint);
    return Status::OK();
  }

  void Stop() override {
    std::shared_ptr<InprocEndpoint> endpoint;
    {
      internal::MutexLock lock(mutex_);
      if (stopped_ || endpoint_ == nullptr) {
        stopped_ = true;
        return;
      }
      stopped_ = true;
      endpoint = endpoint_;
    }
    // Unbind first so no sender finds the endpoint, then close it for those that already did.
    InprocDirectory::Get().Unbind(hub_, endpoint_name_, endpoint.get());
    endpoint->Close();
  }

  ListenerStats stats() const override {
    internal::MutexLock lock(mutex_);
    return endpoint_ == nullptr ? ListenerStats{} : endpoint_->stats();
  }

  const std::string& endpoint() const override { return endpoint_name_; }

 private:
  const std::string hub_;
  const std::string endpoint_name_;
  PayloadSink& sink_;
  const PayloadLimits limits_;
  mutable internal::Mutex mutex_;
  // Set by Start, kept after Stop for stats().
  std::shared_ptr<InprocEndpoint> endpoint_;
  bool stopped_ = false;
};

class InprocTransport final : public Transport {
 public:
  InprocTransport(TransportUri uri, TransportOptions options)
      : Transport(std::move(uri)), options_(options) {}

  TransportCapabilities capabilities() const override { return kInprocCapabilities; }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_RETURN_NOT_OK(CheckSenderContext(uri(), context));
    for (const std::string& name : context.endpoints) {
      REFIT_RETURN_NOT_OK(CheckEndpointName(uri().target, name));
    }
    return std::unique_ptr<TransportSender>(
        std::make_unique<InprocSender>(uri().target, context, options_.limits));
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    REFIT_RETURN_NOT_OK(CheckEndpointName(uri().target, context.endpoint));
    if (!context.peers.empty()) {
      return InvalidArgument(
          "inproc://{}: listener '{}' given {} relay peers; inproc does not relay", uri().target,
          context.endpoint, context.peers.size());
    }
    if (!context.bind_address.empty()) {
      return InvalidArgument(
          "inproc://{}: listener '{}' given bind address '{}'; inproc binds no address",
          uri().target, context.endpoint, Printable(context.bind_address));
    }
    return std::unique_ptr<Listener>(
        std::make_unique<InprocListener>(uri().target, context.endpoint, sink, options_.limits));
  }

 private:
  const TransportOptions options_;
};

}  // namespace

Result<std::unique_ptr<Transport>> MakeInprocTransport(const TransportUri& uri,
                                                       const TransportOptions& options) {
  REFIT_RETURN_NOT_OK(CheckKnownParams(uri, {}));
  if (uri.target.empty()) {
    return InvalidArgument("transport URI '{}': names no hub (inproc://<hub>)",
                           Printable(uri.ToString()));
  }
  // The hub appears in every message of its endpoints; keep it one legible word.
  if (uri.target.find('/') != std::string::npos || Printable(uri.target) != uri.target ||
      uri.target.find(' ') != std::string::npos) {
    return InvalidArgument(
        "transport URI '{}': hub name '{}' contains '/', a space or a byte "
        "outside printable ASCII",
        Printable(uri.ToString()), Printable(uri.target));
  }
  return std::unique_ptr<Transport>(std::make_unique<InprocTransport>(uri, options));
}

}  // namespace refit::internal
