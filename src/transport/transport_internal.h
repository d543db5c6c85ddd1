// Helpers shared by the built-in transports: URI parameters, sender checks, the built-in
// factories the registry installs, thread naming.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transport.h"
// NameCurrentThread, for the transports' own threads.
#include "util/thread_name.h"

namespace refit::internal {

/// Return `text` with bytes outside printable ASCII written as \xNN, for error messages that
/// name untrusted or configured text.
std::string Printable(std::string_view text);

/// One key protects a node's two planes. Return `uri`, the data plane of a node whose control
/// plane has the key `control_api_key`, with that key on the data plane where the data plane takes
/// a shared key (zmq://, and wrappers of it) and the URI names none (api_key / api_key_env). A URI
/// that names its own key keeps it (a different key per plane is an explicit choice). `who`
/// prefixes errors ("receiver node", "publisher").
/// Errors: InvalidArgument for a data-plane key without a control-plane key (a receiver whose
/// control plane anyone can prepare, abort or read, or a publisher that could not reach keyed
/// receivers' control planes): give the same key to both.
Result<TransportUri> KeyDataPlane(TransportUri uri, std::string_view control_api_key,
                                  std::string_view who);

/// Refuse parameters of `uri` other than `known`, naming the first unknown one and the URI.
Status CheckKnownParams(const TransportUri& uri, std::initializer_list<std::string_view> known);

/// Return parameter `key` as a decimal integer in [0, max], or `fallback` when absent.
/// Errors: InvalidArgument naming the URI, the key and the value.
Result<uint64_t> UintParam(const TransportUri& uri, std::string_view key, uint64_t fallback,
                           uint64_t max);

/// Return parameter `key` as a probability in [0, 1], or 0 when absent.
/// Errors: InvalidArgument naming the URI, the key and the value.
Result<double> ProbabilityParam(const TransportUri& uri, std::string_view key);

/// Check what every sender needs: at least one endpoint, a forward version step.
/// Errors: InvalidArgument naming the URI.
Status CheckSenderContext(const TransportUri& uri, const SenderContext& context);

/// Check the header of a payload handed to Send: valid under `limits`, and naming the context's
/// transfer, producer and version step and `payload_id`. Reads the header only.
/// Errors: as ValidatePayloadHeader; InvalidArgument for a payload of another transfer.
Result<PayloadHeader> CheckOutgoingPayload(const SenderContext& context, uint32_t payload_id,
                                           std::span<const std::byte> payload,
                                           const PayloadLimits& limits);

/// The built-in factories, installed by the registry on first use.
Result<std::unique_ptr<Transport>> MakeInprocTransport(const TransportUri& uri,
                                                       const TransportOptions& options);
Result<std::unique_ptr<Transport>> MakeFileTransport(const TransportUri& uri,
                                                     const TransportOptions& options);
/// For `fault+<scheme>://…`: makes the inner transport with MakeTransport.
Result<std::unique_ptr<Transport>> MakeFaultTransport(const TransportUri& uri,
                                                      const TransportOptions& options);

}  // namespace refit::internal
