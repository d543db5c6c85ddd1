// ZAP (ZeroMQ RFC 27): how a relay decides, inside the ZMTP handshake, whom it admits. libzmq
// asks the handler bound in the socket's context before the connection may carry a single
// message, so a refused peer never gets a byte of a request into the relay's memory.
//
// Two mechanisms use it here:
//   - PLAIN (RFC 24) carries the fleet's api key: the relay admits a client whose password is
//     PlainPassword(api key). Without CURVE this is how a keyed relay authenticates, so a client
//     without the key is refused at the handshake, not after ZeroMQ buffered its payload.
//   - CURVE (RFC 26) with curve_authorized_keys: the relay admits the listed client keys
//     (zmq_curve.h).
// A relay without either admits everyone (the NULL mechanism) and needs no handler.
#pragma once

#include <functional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>

#include "refit/status.h"
#include "transport/zmq/zmq_frames.h"

namespace refit::internal::zmq {

/// PLAIN's user name: refit authenticates the key, not a user.
inline constexpr std::string_view kPlainUsername = "refit";

/// The PLAIN password a holder of `api_key` presents: the lowercase hex SHA-256 of the key.
/// PLAIN passwords hold at most 255 bytes and api keys up to 1 KiB, so the key is hashed; the
/// hash is compared in constant time like the key itself (ApiKeyVerifier).
std::string PlainPassword(std::string_view api_key);

/// One question libzmq asks the handler: the mechanism ("PLAIN", "CURVE"), the peer's address,
/// and the mechanism's credentials (PLAIN: user name and password; CURVE: the client's key).
struct ZapRequest {
  std::string_view mechanism;
  std::string_view address;
  std::span<const std::string> credentials;
};

/// Admit (OK) or refuse a client. A refusal's Status is recorded as the listener's failure.
using ZapAdmit = std::function<Status(const ZapRequest&)>;

/// Admit PLAIN clients that present PlainPassword(api_key) (and kPlainUsername); refuse anything
/// else. `endpoint` names the listener in refusals.
ZapAdmit AdmitApiKey(std::string_view api_key, std::string endpoint);

/// Bind a ZAP handler socket in `context`. It must be bound before a PLAIN or CURVE server socket
/// of that context accepts anyone: libzmq admits every client while no handler is bound.
/// Errors: Unavailable naming `endpoint` (the listener's, for messages).
Result<ZmqSocket> BindZapHandler(void* context, const std::string& endpoint);

/// Answer libzmq's ZAP requests on `zap` (from BindZapHandler) until `stop`, as `admit` decides.
/// Each refusal and each malformed request is passed to `record_failure`. Runs on the caller's
/// thread, which owns `zap`.
void ServeZap(void* zap, const ZapAdmit& admit, const std::string& endpoint,
              const std::function<void(const Status&)>& record_failure, std::stop_token stop);

}  // namespace refit::internal::zmq
