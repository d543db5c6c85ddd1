// fault+<scheme>://…: wraps the sender of any transport with seeded, reproducible fault
// injection, for tests of retries, dedupe, flush timeouts and checksum failures.
//
// Parameters (every other parameter goes to the inner transport, made in the same registry from the
// URI without the "fault+" prefix and without these):
//   seed=N              the seed of every decision (default 0);
//   drop=p              probability that a Send does not deliver;
//   drop_mode=error     … and returns Unavailable, as a failed network send would (default);
//   drop_mode=silent    … and returns OK, as a message lost after its ACK would: the payload is
//                       missing only at the receiver's Flush;
//   delay_ms=d          every Send waits d milliseconds before delivering;
//   duplicate=p         probability that a payload is delivered twice (the second result is
//                       returned, so the receiver's dedupe decides it);
//   corrupt=p           probability that one byte of a copy is flipped before delivery. The byte
//                       lies in the body (after the header), so the cheap header check passes and
//                       only the body checksum catches it — in-flight corruption as a receiver
//                       sees it. A duplicate delivers the same corrupted copy;
//   disconnect_after=N  the first N Send calls proceed; every later one fails with Unavailable
//                       without delivering, as after a lost connection.
//
// Determinism: each decision is a hash of (seed, producer id, payload id, attempt, fault kind),
// where attempt counts the Send calls for that payload id on this sender. The faults of a run are
// therefore the same for the same seed and the same sequence of payload ids, however threads
// interleave — except disconnect_after, which counts calls in arrival order. A retry is a new
// attempt, so it draws afresh. Listeners are not wrapped: faults happen on the sending side.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/transport_internal.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/splitmix64.h"

namespace refit::internal {
namespace {

constexpr std::string_view kFaultPrefix = "fault+";
constexpr std::array<std::string_view, 7> kFaultParams = {
    "seed", "drop", "drop_mode", "delay_ms", "duplicate", "corrupt", "disconnect_after"};
// A minute: a longer injected delay is a mistyped value, not a test.
constexpr uint64_t kMaxDelayMs = 60'000;

// A double has 53 significant bits: the top 53 bits of a hash, scaled by 2^-53, are uniform in
// [0, 1).
constexpr int kDoubleMantissaBits = 53;
constexpr double kTwoToMinus53 = 0x1.0p-53;
// Nonzero XOR masks of one byte: 1 … 255.
constexpr uint64_t kByteMasks = 255;

// A bijective 64-bit mix: the faults a seed injects are the same on every run and host.
constexpr uint64_t Mix(uint64_t x) { return internal::SplitMix64Hash(x); }

// The decisions drawn per attempt; each gets an independent hash.
enum class Draw : uint64_t { kDrop = 1, kDuplicate, kCorrupt, kCorruptPosition, kCorruptMask };

enum class DropMode : uint8_t { kError, kSilent };

struct FaultPlan {
  uint64_t seed = 0;
  double drop = 0;
  DropMode drop_mode = DropMode::kError;
  uint64_t delay_ms = 0;
  double duplicate = 0;
  double corrupt = 0;
  std::optional<uint64_t> disconnect_after;
};

class FaultSender final : public TransportSender {
 public:
  FaultSender(std::unique_ptr<TransportSender> inner, const FaultPlan& plan, std::string uri,
              PayloadLimits limits)
      : TransportSender(inner->context(), limits),
        inner_(std::move(inner)),
        plan_(plan),
        uri_(std::move(uri)),
        producer_id_(context().producer_id) {}

  void CleanupThread() override { inner_->CleanupThread(); }

 private:
  Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                 const PayloadHeader& /*header*/) override {
    const uint64_t call = calls_.fetch_add(1);
    if (plan_.disconnect_after && call >= *plan_.disconnect_after) {
      return Unavailable(
          "{}: injected disconnect after {} payloads; payload {} of producer {} "
          "not sent",
          uri_, *plan_.disconnect_after, payload_id, producer_id_);
    }
    const uint64_t attempt = NextAttempt(payload_id);
    if (Uniform(payload_id, attempt, Draw::kDrop) < plan_.drop) {
      if (plan_.drop_mode == DropMode::kSilent) return Status::OK();
      return Unavailable("{}: injected drop of payload {} of producer {} (attempt {})", uri_,
                         payload_id, producer_id_, attempt);
    }
    if (plan_.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(plan_.delay_ms));
    std::vector<std::byte> corrupted;
    if (!payload.empty() && Uniform(payload_id, attempt, Draw::kCorrupt) < plan_.corrupt) {
      corrupted.assign(payload.begin(), payload.end());
      // Within the body when there is one, so that the header check passes (see the top).
      const size_t first = payload.size() > kPayloadHeaderSize ? kPayloadHeaderSize : 0;
      const size_t position =
          first + Hash(payload_id, attempt, Draw::kCorruptPosition) % (payload.size() - first);
      const auto mask =
          static_cast<std::byte>(1 + Hash(payload_id, attempt, Draw::kCorruptMask) % kByteMasks);
      corrupted[position] ^= mask;
      payload = corrupted;
    }
    REFIT_RETURN_NOT_OK(inner_->Send(payload_id, payload));
    if (Uniform(payload_id, attempt, Draw::kDuplicate) < plan_.duplicate) {
      return inner_->Send(payload_id, payload);
    }
    return Status::OK();
  }

  Status EndStream(uint64_t payloads) override { return inner_->Finish(payloads); }

 private:
  uint64_t NextAttempt(uint32_t payload_id) {
    internal::MutexLock lock(mutex_);
    return attempts_[payload_id]++;
  }

  uint64_t Hash(uint32_t payload_id, uint64_t attempt, Draw draw) const {
    uint64_t h = Mix(plan_.seed);
    h = Mix(h ^ producer_id_);
    h = Mix(h ^ payload_id);
    h = Mix(h ^ attempt);
    return Mix(h ^ static_cast<uint64_t>(draw));
  }

  double Uniform(uint32_t payload_id, uint64_t attempt, Draw draw) const {
    return static_cast<double>(Hash(payload_id, attempt, draw) >> (64 - kDoubleMantissaBits)) *
           kTwoToMinus53;
  }

  const std::unique_ptr<TransportSender> inner_;
  const FaultPlan plan_;
  const std::string uri_;
  const uint32_t producer_id_;
  std::atomic<uint64_t> calls_{0};
  internal::Mutex mutex_;
  // Send calls so far per payload id.
  std::unordered_map<uint32_t, uint64_t> attempts_;
};

class FaultTransport final : public Transport {
 public:
  FaultTransport(TransportUri uri, const FaultPlan& plan, PayloadLimits limits,
                 std::unique_ptr<Transport> inner)
      : Transport(std::move(uri)), plan_(plan), limits_(limits), inner_(std::move(inner)) {}

  TransportCapabilities capabilities() const override { return inner_->capabilities(); }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<TransportSender> inner, inner_->MakeSender(context));
    return std::unique_ptr<TransportSender>(std::make_unique<FaultSender>(
        std::move(inner), plan_, Printable(uri().ToString()), limits_));
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    return inner_->MakeListener(context, sink);
  }

  Result<std::vector<TransportReceiver>> ListReceivers() override {
    return inner_->ListReceivers();
  }

 private:
  const FaultPlan plan_;
  const PayloadLimits limits_;
  const std::unique_ptr<Transport> inner_;
};

}  // namespace

Result<std::unique_ptr<Transport>> MakeFaultTransport(const TransportUri& uri,
                                                      const TransportOptions& options) {
  if (!uri.scheme.starts_with(kFaultPrefix) || uri.scheme.size() == kFaultPrefix.size()) {
    return InvalidArgument("transport URI '{}': names no inner scheme (fault+<scheme>://…)",
                           Printable(uri.ToString()));
  }
  FaultPlan plan;
  REFIT_ASSIGN_OR_RETURN(plan.seed, UintParam(uri, "seed", 0, UINT64_MAX));
  REFIT_ASSIGN_OR_RETURN(plan.drop, ProbabilityParam(uri, "drop"));
  REFIT_ASSIGN_OR_RETURN(plan.delay_ms, UintParam(uri, "delay_ms", 0, kMaxDelayMs));
  REFIT_ASSIGN_OR_RETURN(plan.duplicate, ProbabilityParam(uri, "duplicate"));
  REFIT_ASSIGN_OR_RETURN(plan.corrupt, ProbabilityParam(uri, "corrupt"));
  if (uri.Param("disconnect_after") != nullptr) {
    REFIT_ASSIGN_OR_RETURN(plan.disconnect_after,
                           UintParam(uri, "disconnect_after", 0, UINT64_MAX));
  }
  if (const std::string* mode = uri.Param("drop_mode")) {
    if (*mode == "silent") {
      plan.drop_mode = DropMode::kSilent;
    } else if (*mode != "error") {
      return InvalidArgument(
          "transport URI '{}': parameter drop_mode='{}' is neither 'error' nor 'silent'",
          Printable(uri.ToString()), Printable(*mode));
    }
  }

  TransportUri inner_uri;
  inner_uri.scheme = uri.scheme.substr(kFaultPrefix.size());
  inner_uri.target = uri.target;
  for (const auto& param : uri.params) {
    if (std::find(kFaultParams.begin(), kFaultParams.end(), param.first) == kFaultParams.end()) {
      inner_uri.params.push_back(param);
    }
  }
  // In the registry this wrapper was found in, so a registry of its own stays closed.
  const TransportRegistry& registry =
      options.registry != nullptr ? *options.registry : DefaultTransportRegistry();
  Result<std::unique_ptr<Transport>> inner = registry.Make(inner_uri, options);
  if (!inner.ok()) {
    return inner.status().WithContext(
        fmt::format("transport URI '{}': inner transport", Printable(uri.ToString())));
  }
  REFIT_LOG_WARN("fault injection is active on transport '{}'", Printable(uri.ToString()));
  return std::unique_ptr<Transport>(
      std::make_unique<FaultTransport>(uri, plan, options.limits, std::move(inner).ValueOrDie()));
}

}  // namespace refit::internal
