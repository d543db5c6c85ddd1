// The ZAP handler of zmq:// and its PLAIN admission (zmq_zap.h).
#include "transport/zmq/zmq_zap.h"

#include <openssl/sha.h>
#include <zmq.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/api_key.h"
#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit::internal::zmq {
namespace {

// libzmq asks the handler bound at this name in the socket's context.
const char* const kZapEndpoint = "inproc://zeromq.zap.01";
constexpr std::string_view kZapVersion = "1.0";
constexpr std::string_view kPlain = "PLAIN";
// version, request id, domain, address, identity, mechanism; then the credentials.
constexpr size_t kZapHeadFrames = 6;
// PLAIN's two credentials (user name, password) are the most a mechanism refit serves sends;
// read one more frame, so that a longer request is seen to be one.
constexpr size_t kMaxZapRequestFrames = kZapHeadFrames + 2 + 1;
constexpr std::string_view kZapAllowed = "200";
constexpr std::string_view kZapDenied = "400";
constexpr std::string_view kZapInternalError = "500";

}  // namespace

std::string PlainPassword(std::string_view api_key) {
  std::array<unsigned char, SHA256_DIGEST_LENGTH> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(api_key.data()), api_key.size(), digest.data());
  std::string hex;
  hex.reserve(2 * digest.size());
  for (const unsigned char byte : digest) fmt::format_to(std::back_inserter(hex), "{:02x}", byte);
  return hex;
}

ZapAdmit AdmitApiKey(std::string_view api_key, std::string endpoint) {
  auto verifier = std::make_shared<const ApiKeyVerifier>(PlainPassword(api_key));
  return [verifier, endpoint = std::move(endpoint)](const ZapRequest& request) -> Status {
    if (request.mechanism != kPlain || request.credentials.size() != 2) {
      return PermissionDenied("zmq listener {}: refused a {} handshake from {}: PLAIN expected",
                              endpoint, Printable(request.mechanism), Printable(request.address));
    }
    // The user name is not a secret and carries no authority; only the password is checked.
    if (verifier->Check(request.credentials[1]) != AuthResult::kAllowed) {
      return PermissionDenied("zmq listener {}: wrong api key in the handshake from {}", endpoint,
                              Printable(request.address));
    }
    return Status::OK();
  };
}

Result<ZmqSocket> BindZapHandler(void* context, const std::string& endpoint) {
  ZmqSocket zap(zmq_socket(context, ZMQ_REP));
  if (zap == nullptr) {
    return Unavailable("zmq listener {}: ZAP socket: {}", endpoint, ZmqError());
  }
  const int linger = 0;
  zmq_setsockopt(zap.get(), ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(zap.get(), kZapEndpoint) != 0) {
    return Unavailable("zmq listener {}: bind the ZAP handler: {}", endpoint, ZmqError());
  }
  return zap;
}

void ServeZap(void* zap, const ZapAdmit& admit, const std::string& endpoint,
              const std::function<void(const Status&)>& record_failure, std::stop_token stop) {
  while (!stop.stop_requested()) {
    zmq_pollitem_t item{zap, 0, ZMQ_POLLIN, 0};
    const int ready = zmq_poll(&item, 1, kStopCheckMs);
    if (ready < 0 && zmq_errno() != EINTR) {
      record_failure(Unavailable("zmq listener {}: ZAP poll: {}", endpoint, ZmqError()));
    }
    if (ready <= 0) continue;
    Result<std::vector<std::string>> request = ReceiveFrames(zap, kMaxZapRequestFrames);
    if (!request.ok() && request.status().code() == StatusCode::kUnavailable) continue;
    std::string_view verdict = kZapDenied;
    std::string request_id;
    if (!request.ok() || request->size() < kZapHeadFrames ||
        request->size() >= kMaxZapRequestFrames || (*request)[0] != kZapVersion) {
      // libzmq asks only well-formed questions; anything else is refused, and answered all the
      // same: a REP socket must reply before it reads the next request.
      verdict = kZapInternalError;
      record_failure(Internal("zmq listener {}: malformed ZAP request", endpoint));
      if (request.ok() && request->size() > 1) request_id = (*request)[1];
    } else {
      request_id = (*request)[1];
      const std::span<const std::string> frames(*request);
      const Status admitted = admit(ZapRequest{.mechanism = frames[5],
                                               .address = frames[3],
                                               .credentials = frames.subspan(kZapHeadFrames)});
      if (admitted.ok()) {
        verdict = kZapAllowed;
      } else {
        record_failure(admitted);
      }
    }
    const std::vector<std::string> reply{
        std::string(kZapVersion), request_id, std::string(verdict), "", "", ""};
    if (Status sent = SendFrames(zap, reply, kZapEndpoint); !sent.ok()) {
      record_failure(sent);
    }
  }
}

}  // namespace refit::internal::zmq
