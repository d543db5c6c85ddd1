// CURVE (ZeroMQ RFC 26) for zmq://: the key files a URI names, the keys each side presents, and
// the ZAP handler (RFC 27) that admits only the listed client keys.
//
// Every relay of a fleet holds the same server key pair. A listener with curve_secret_key makes
// its ROUTER a CURVE server; with curve_authorized_keys it also binds a ZAP handler in its own
// context that admits only the listed client keys and the fleet's own public key, which relays
// present as clients when they forward. Senders connect with curve_server_key and their own key
// pair (curve_secret_key, or an ephemeral one). Key files are read when a sender or listener is
// made, not by the factory (which does no I/O), and must be private (a secret key file mode 600,
// an authorized keys file not writable by group or others).
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "refit/status.h"
#include "refit/transport.h"
#include "transport/zmq/zmq_frames.h"
#include "transport/zmq/zmq_zap.h"

namespace refit::internal::zmq {

// The URI parameters of CURVE.
inline constexpr std::string_view kSecretKeyParam = "curve_secret_key";
inline constexpr std::string_view kServerKeyParam = "curve_server_key";
inline constexpr std::string_view kAuthorizedKeysParam = "curve_authorized_keys";
// A CURVE key is 32 bytes (ZeroMQ RFC 26).
inline constexpr size_t kCurveKeyBytes = 32;

/// A CURVE key in binary.
using CurveKey = std::array<uint8_t, kCurveKeyBytes>;

struct CurveKeyPair {
  CurveKey public_key{};
  CurveKey secret_key{};
};

/// The files the URI names (empty: not set); read by MakeSender and MakeListener.
struct CurveFiles {
  std::string secret_key;
  std::string server_key;
  std::string authorized_keys;

  bool configured() const { return !secret_key.empty() || !server_key.empty(); }
};

/// What a DEALER presents: the server's public key and its own key pair.
struct CurveClientKeys {
  CurveKey server_key{};
  CurveKeyPair own;
};

/// What a relay's ROUTER holds, and whom it admits.
struct CurveServerKeys {
  CurveKeyPair fleet;
  /// Set (with the fleet key) when curve_authorized_keys is: only these clients pass the ZAP
  /// handler. Unset: every client that knows the server key is admitted.
  std::optional<std::set<CurveKey>> authorized;
};

/// The CURVE key files the URI names, checked for what needs no I/O. `shown` is the URI with its
/// api key redacted. Errors: InvalidArgument naming the URI and the parameter.
Result<CurveFiles> CurveParams(const TransportUri& shown);

/// A key as its 40 Z85 characters (ZeroMQ RFC 32); for public keys in messages.
std::string Z85Text(const CurveKey& key);

/// A sender's CURVE keys, or nullopt without CURVE. Without curve_secret_key the sender gets an
/// ephemeral key pair: enough where the relays admit every client (no curve_authorized_keys).
/// Errors: InvalidArgument naming the parameter and file; Unavailable when no key pair could be
/// made.
Result<std::optional<CurveClientKeys>> LoadSenderKeys(const CurveFiles& files);

/// A relay's CURVE keys, or nullopt without CURVE. Errors: InvalidArgument naming the parameter
/// and file.
Result<std::optional<CurveServerKeys>> LoadListenerKeys(const CurveFiles& files);

/// Set CURVE key option `option` (ZMQ_CURVE_SERVERKEY, …) of `socket`. Errors: Unavailable.
Status SetCurveKey(void* socket, int option, const CurveKey& key);

/// Admit CURVE clients whose key is one of `authorized`; refuse anything else (zmq_zap.h).
/// `endpoint` names the listener in refusals.
ZapAdmit AdmitCurveKeys(std::set<CurveKey> authorized, std::string endpoint);

}  // namespace refit::internal::zmq
