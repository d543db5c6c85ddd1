// The transport registry, URI parsing, and the helpers the built-in transports share.
#include "refit/transport.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit {
namespace internal {
// zmq://, defined in zmq/zmq_transport.cc; declared here, next to the only caller, so the relay
// transport adds no edit to the shared internal header.
Result<std::unique_ptr<Transport>> MakeZmqTransport(const TransportUri& uri,
                                                    const TransportOptions& options);
// s3://, defined in s3/s3_transport.cc.
Result<std::unique_ptr<Transport>> MakeS3Transport(const TransportUri& uri,
                                                   const TransportOptions& options);
#if REFIT_HAVE_MPI
// mpi://, defined in mpi/mpi_transport.cc (builds that found MPI).
Result<std::unique_ptr<Transport>> MakeMpiTransport(const TransportUri& uri,
                                                    const TransportOptions& options);
#endif
#if REFIT_HAVE_NCCL
// nccl://, defined in mpi/nccl_collective.cc (builds that found MPI, CUDA and NCCL).
Result<std::unique_ptr<Transport>> MakeNcclTransport(const TransportUri& uri,
                                                     const TransportOptions& options);
#endif
}  // namespace internal

namespace {

using internal::Printable;

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Decode %XX escapes of `part`, which starts at `offset` in the URI `text` (for messages).
Result<std::string> PercentDecode(std::string_view text, std::string_view part, size_t offset) {
  std::string out;
  out.reserve(part.size());
  for (size_t i = 0; i < part.size(); ++i) {
    if (part[i] != '%') {
      out.push_back(part[i]);
      continue;
    }
    const int high = i + 1 < part.size() ? HexValue(part[i + 1]) : -1;
    const int low = i + 2 < part.size() ? HexValue(part[i + 2]) : -1;
    if (high < 0 || low < 0) {
      return InvalidArgument("transport URI '{}': bad percent escape at offset {}", Printable(text),
                             offset + i);
    }
    if (high == 0 && low == 0) {
      // A NUL would silently truncate the path or name it ends up in.
      return InvalidArgument("transport URI '{}': %00 at offset {} decodes to NUL", Printable(text),
                             offset + i);
    }
    out.push_back(static_cast<char>(high << 4 | low));
    i += 2;
  }
  return out;
}

// Append `part` to `out`, percent-encoding '%', the bytes in `reserved` and everything outside
// printable ASCII (space included).
void PercentEncode(std::string_view part, std::string_view reserved, std::string& out) {
  for (const char c : part) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte <= 0x20 || byte >= 0x7f || c == '%' || reserved.find(c) != std::string_view::npos) {
      out += fmt::format("%{:02X}", byte);
    } else {
      out.push_back(c);
    }
  }
}

bool IsSchemeCharacter(char c, bool first) {
  const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (first) return letter;
  return letter || (c >= '0' && c <= '9') || c == '+' || c == '-' || c == '.';
}

// Return the lower-case scheme, or an error naming what (`what`) it was found in.
Result<std::string> NormalizeScheme(std::string_view scheme, std::string_view what) {
  if (scheme.empty()) return InvalidArgument("{}: empty scheme", what);
  std::string lower;
  lower.reserve(scheme.size());
  for (size_t i = 0; i < scheme.size(); ++i) {
    if (!IsSchemeCharacter(scheme[i], i == 0)) {
      return InvalidArgument(
          "{}: scheme '{}' has '{}' at {} (a letter, then letters, digits, '+', '-', '.')", what,
          Printable(scheme), Printable(scheme.substr(i, 1)), i);
    }
    lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(scheme[i]))));
  }
  return lower;
}

std::string VersionStep(uint64_t base, uint64_t target) {
  return fmt::format("versions {} -> {}", base, target);
}

}  // namespace

// ---- TransportUri ----------------------------------------------------------------------------

Result<TransportUri> internal::KeyDataPlane(TransportUri uri, std::string_view control_api_key,
                                            std::string_view who) {
  if (!uri.is_zmq()) return uri;
  const bool keyed =
      uri.Param(kUriApiKeyParam) != nullptr || uri.Param(kUriApiKeyEnvParam) != nullptr;
  if (keyed && control_api_key.empty()) {
    return InvalidArgument(
        "{}: the data plane ({}://) has an api key but the control plane has none, so anyone who "
        "reaches the control plane could prepare, abort or read transfers: give the key as the "
        "api key (Python: api_key=…, refit serve/push: --api-key-env), which protects both planes",
        who, uri.scheme);
  }
  if (!keyed && !control_api_key.empty()) uri.params.emplace_back(kUriApiKeyParam, control_api_key);
  return uri;
}

Result<TransportUri> TransportUri::Parse(std::string_view text) {
  constexpr std::string_view kSeparator = "://";
  const size_t separator = text.find(kSeparator);
  if (separator == std::string_view::npos) {
    return InvalidArgument("transport URI '{}': no '://' (expected <scheme>://<target>)",
                           Printable(text));
  }
  TransportUri uri;
  REFIT_ASSIGN_OR_RETURN(uri.scheme,
                         NormalizeScheme(text.substr(0, separator),
                                         fmt::format("transport URI '{}'", Printable(text))));
  const size_t rest_offset = separator + kSeparator.size();
  const std::string_view rest = text.substr(rest_offset);
  if (const size_t hash = rest.find('#'); hash != std::string_view::npos) {
    return InvalidArgument("transport URI '{}': fragment ('#' at offset {}) is not supported",
                           Printable(text), rest_offset + hash);
  }
  const size_t question = rest.find('?');
  REFIT_ASSIGN_OR_RETURN(uri.target, PercentDecode(text, rest.substr(0, question), rest_offset));
  if (question == std::string_view::npos) return uri;

  std::string_view query = rest.substr(question + 1);
  size_t offset = rest_offset + question + 1;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view segment = query.substr(0, amp);
    const size_t equals = segment.find('=');
    if (segment.empty() || equals == 0) {
      return InvalidArgument("transport URI '{}': empty parameter name at offset {}",
                             Printable(text), offset);
    }
    if (equals == std::string_view::npos) {
      return InvalidArgument("transport URI '{}': parameter '{}' has no value (key=value)",
                             Printable(text), Printable(segment));
    }
    REFIT_ASSIGN_OR_RETURN(std::string key, PercentDecode(text, segment.substr(0, equals), offset));
    REFIT_ASSIGN_OR_RETURN(std::string value,
                           PercentDecode(text, segment.substr(equals + 1), offset + equals + 1));
    if (uri.Param(key) != nullptr) {
      return InvalidArgument("transport URI '{}': parameter '{}' given twice", Printable(text),
                             Printable(key));
    }
    uri.params.emplace_back(std::move(key), std::move(value));
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
    offset += amp + 1;
    if (query.empty()) {
      return InvalidArgument("transport URI '{}': empty parameter name at offset {}",
                             Printable(text), offset);
    }
  }
  return uri;
}

const std::string* TransportUri::Param(std::string_view key) const {
  for (const auto& [name, value] : params) {
    if (name == key) return &value;
  }
  return nullptr;
}

std::string TransportUri::ToString() const {
  std::string out = scheme + "://";
  PercentEncode(target, "?#", out);
  for (size_t i = 0; i < params.size(); ++i) {
    out.push_back(i == 0 ? '?' : '&');
    PercentEncode(params[i].first, "?#&=", out);
    out.push_back('=');
    PercentEncode(params[i].second, "?#&=", out);
  }
  return out;
}

// ---- Senders, sinks, listeners ---------------------------------------------------------------

Result<PollReport> Listener::Poll() { return PollReport{}; }

Result<ManifestDelivery> Listener::AcceptManifest(std::string_view /*manifest*/,
                                                  std::stop_token /*stop*/) {
  return FailedPrecondition(
      "listener at '{}' takes no manifests: its transport delivers payloads "
      "itself (only s3:// announces payloads through the control plane)",
      Printable(endpoint()));
}

Status Listener::RouteTransfer(const TransferId& transfer_id, const RelayTree& tree) {
  return InvalidArgument(
      "listener at '{}' has no relays to route transfer {} through a tree of {} receiver(s): "
      "only zmq:// forwards payloads",
      Printable(endpoint()), transfer_id.ToHex(), tree.endpoints.size());
}

Result<std::vector<TransportReceiver>> Transport::ListReceivers() {
  return FailedPrecondition(
      "transport '{}' has no control channel of its own: reach the receivers "
      "through their control planes",
      uri().scheme);
}

// ---- TransportRegistry -----------------------------------------------------------------------

std::unique_ptr<TransportRegistry> TransportRegistry::MakeWithBuiltins() {
  // Registered by hand rather than by static initialisers in each file, which a static library
  // drops when nothing else references that file.
  auto registry = std::make_unique<TransportRegistry>();
  registry->schemes_.emplace("inproc", internal::MakeInprocTransport);
  registry->schemes_.emplace("file", internal::MakeFileTransport);
  registry->schemes_.emplace("zmq", internal::MakeZmqTransport);
  registry->schemes_.emplace("s3", internal::MakeS3Transport);
#if REFIT_HAVE_MPI
  registry->schemes_.emplace("mpi", internal::MakeMpiTransport);
#endif
#if REFIT_HAVE_NCCL
  registry->schemes_.emplace("nccl", internal::MakeNcclTransport);
#endif
  registry->wrappers_.emplace("fault", internal::MakeFaultTransport);
  return registry;
}

Status TransportRegistry::Register(std::string_view scheme, TransportFactory factory) {
  return Add(scheme, std::move(factory), /*wrapper=*/false);
}

Status TransportRegistry::RegisterWrapper(std::string_view prefix, TransportFactory factory) {
  return Add(prefix, std::move(factory), /*wrapper=*/true);
}

Status TransportRegistry::Add(std::string_view scheme, TransportFactory factory, bool wrapper) {
  const std::string what = fmt::format("registering transport scheme '{}'", Printable(scheme));
  REFIT_ASSIGN_OR_RETURN(std::string name, NormalizeScheme(scheme, what));
  if (!factory) return InvalidArgument("{}: null factory", what);
  if (wrapper && name.find('+') != std::string::npos) {
    return InvalidArgument("{}: a wrapper prefix cannot contain '+'", what);
  }
  std::lock_guard lock(mutex_);
  auto& table = wrapper ? wrappers_ : schemes_;
  if (!table.emplace(std::move(name), std::move(factory)).second) {
    return AlreadyExists("{}: already registered", what);
  }
  return Status::OK();
}

TransportFactory TransportRegistry::Find(const std::string& scheme) const {
  std::lock_guard lock(mutex_);
  if (auto it = schemes_.find(scheme); it != schemes_.end()) return it->second;
  if (const size_t plus = scheme.find('+'); plus != std::string::npos) {
    if (auto it = wrappers_.find(scheme.substr(0, plus)); it != wrappers_.end()) {
      return it->second;
    }
  }
  return nullptr;
}

std::vector<std::string> TransportRegistry::Schemes() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, factory] : schemes_) names.push_back(name);
  for (const auto& [name, factory] : wrappers_) names.push_back(name + "+<scheme>");
  std::sort(names.begin(), names.end());
  return names;
}

Result<std::unique_ptr<Transport>> TransportRegistry::Make(std::string_view uri,
                                                           const TransportOptions& options) const {
  REFIT_ASSIGN_OR_RETURN(TransportUri parsed, TransportUri::Parse(uri));
  return Make(parsed, options);
}

Result<std::unique_ptr<Transport>> TransportRegistry::Make(const TransportUri& uri,
                                                           const TransportOptions& options) const {
  // Called outside the lock: a wrapper's factory makes its inner transport here too.
  const TransportFactory factory = Find(uri.scheme);
  if (!factory) {
    return InvalidArgument("transport URI '{}': unknown scheme '{}' (registered: {})",
                           Printable(uri.ToString()), uri.scheme, fmt::join(Schemes(), ", "));
  }
  TransportOptions resolved = options;
  resolved.registry = this;
  return factory(uri, resolved);
}

TransportRegistry& DefaultTransportRegistry() {
  static const std::unique_ptr<TransportRegistry> registry = TransportRegistry::MakeWithBuiltins();
  return *registry;
}

Result<std::unique_ptr<Transport>> MakeTransport(std::string_view uri,
                                                 const TransportOptions& options) {
  return DefaultTransportRegistry().Make(uri, options);
}

Result<std::unique_ptr<Transport>> MakeTransport(const TransportUri& uri,
                                                 const TransportOptions& options) {
  return DefaultTransportRegistry().Make(uri, options);
}

// ---- Helpers of the built-ins ----------------------------------------------------------------

namespace internal {

std::string Printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out.push_back(c);
    } else {
      out += fmt::format("\\x{:02x}", byte);
    }
  }
  return out;
}

Status CheckKnownParams(const TransportUri& uri, std::initializer_list<std::string_view> known) {
  for (const auto& [key, value] : uri.params) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      return InvalidArgument("transport URI '{}': unknown parameter '{}' for scheme '{}' ({})",
                             Printable(uri.ToString()), Printable(key), uri.scheme,
                             known.size() == 0 ? std::string("it takes none")
                                               : fmt::format("known: {}", fmt::join(known, ", ")));
    }
  }
  return Status::OK();
}

Result<uint64_t> UintParam(const TransportUri& uri, std::string_view key, uint64_t fallback,
                           uint64_t max) {
  const std::string* text = uri.Param(key);
  if (text == nullptr) return fallback;
  uint64_t value = 0;
  const char* end = text->data() + text->size();
  const auto [ptr, error] = std::from_chars(text->data(), end, value);
  if (text->empty() || error != std::errc() || ptr != end || value > max) {
    return InvalidArgument("transport URI '{}': parameter {}='{}' is not an integer in [0, {}]",
                           Printable(uri.ToString()), key, Printable(*text), max);
  }
  return value;
}

Result<double> ProbabilityParam(const TransportUri& uri, std::string_view key) {
  const std::string* text = uri.Param(key);
  if (text == nullptr) return 0.0;
  double value = 0;
  const char* end = text->data() + text->size();
  const auto [ptr, error] = std::from_chars(text->data(), end, value);
  if (text->empty() || error != std::errc() || ptr != end || !std::isfinite(value) || value < 0.0 ||
      value > 1.0) {
    return InvalidArgument("transport URI '{}': parameter {}='{}' is not a probability in [0, 1]",
                           Printable(uri.ToString()), key, Printable(*text));
  }
  return value;
}

Status CheckSenderContext(const TransportUri& uri, const SenderContext& context) {
  if (context.endpoints.empty()) {
    return InvalidArgument("transport '{}': sender of producer {} for transfer {} has no endpoints",
                           Printable(uri.ToString()), context.producer_id,
                           context.transfer_id.ToHex());
  }
  if (context.target_version <= context.base_version) {
    return InvalidArgument(
        "transport '{}': sender of producer {} for transfer {}: {} do not step forward",
        Printable(uri.ToString()), context.producer_id, context.transfer_id.ToHex(),
        VersionStep(context.base_version, context.target_version));
  }
  return Status::OK();
}

Result<PayloadHeader> CheckOutgoingPayload(const SenderContext& context, uint32_t payload_id,
                                           std::span<const std::byte> payload,
                                           const PayloadLimits& limits) {
  Result<PayloadHeader> header = ValidatePayloadHeader(payload, limits);
  if (!header.ok()) {
    return header.status().WithContext(
        fmt::format("sending payload {} of producer {}", payload_id, context.producer_id));
  }
  const PayloadIds& ids = header->ids;
  if (ids.transfer_id != context.transfer_id || ids.producer_id != context.producer_id ||
      ids.payload_id != payload_id || ids.base_version != context.base_version ||
      ids.target_version != context.target_version) {
    return InvalidArgument(
        "sending payload {} of producer {} in transfer {} ({}): its header names payload {} of "
        "producer {} in transfer {} ({})",
        payload_id, context.producer_id, context.transfer_id.ToHex(),
        VersionStep(context.base_version, context.target_version), ids.payload_id, ids.producer_id,
        ids.transfer_id.ToHex(), VersionStep(ids.base_version, ids.target_version));
  }
  return header;
}

}  // namespace internal

TransportSender::TransportSender(SenderContext context, PayloadLimits limits)
    : context_(std::move(context)), limits_(limits) {}

Status TransportSender::Send(uint32_t payload_id, std::span<const std::byte> payload) {
  if (finished_.load()) {
    return FailedPrecondition("producer {} of transfer {} already finished its stream",
                              context_.producer_id, context_.transfer_id.ToHex());
  }
  REFIT_ASSIGN_OR_RETURN(const PayloadHeader header,
                         internal::CheckOutgoingPayload(context_, payload_id, payload, limits_));
  int64_t seen = max_sent_id_.load();
  while (seen < int64_t{payload_id} && !max_sent_id_.compare_exchange_weak(seen, payload_id)) {
  }
  return Deliver(payload_id, payload, header);
}

Status TransportSender::Finish(uint64_t payloads) {
  if (finished_.load()) {
    return FailedPrecondition("producer {} of transfer {} already finished its stream",
                              context_.producer_id, context_.transfer_id.ToHex());
  }
  if (payloads > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("finishing producer {} of transfer {}: {} payloads exceed 32-bit ids",
                           context_.producer_id, context_.transfer_id.ToHex(), payloads);
  }
  const int64_t max_sent_id = max_sent_id_.load();
  if (max_sent_id >= 0 && static_cast<uint64_t>(max_sent_id) >= payloads) {
    return InvalidArgument(
        "finishing producer {} of transfer {} with {} payloads, but payload {} was sent",
        context_.producer_id, context_.transfer_id.ToHex(), payloads, max_sent_id);
  }
  REFIT_RETURN_NOT_OK(EndStream(payloads));
  finished_.store(true);
  return Status::OK();
}

}  // namespace refit
