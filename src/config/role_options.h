// A configuration mapped onto the options of each role: the producer's (a Publisher, `refit
// push`) and the receiver's (a ReceiverNode, `refit serve`, refit.Receiver), with the option
// structs of their parts. Settings the file has no key for (timeouts of one call, a literal API
// key, the hooks) are the caller's to set on the result.
#pragma once

#include <string>

#include "config_file.h"
#include "refit/control_client.h"
#include "refit/control_server_options.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/receiver_session_options.h"
#include "refit/status.h"
#include "refit/stream_options.h"
#include "refit/tracker_options.h"

namespace refit::config {

/// Return the producer's tracker options. Options without a key keep their defaults.
TrackerOptions ToTrackerOptions(const RefitConfig& config);

/// Return the producer's stream options; producer_id and num_producers are left at their
/// defaults for the caller to set.
ProducerStreamOptions ToProducerStreamOptions(const RefitConfig& config);

/// Return a receiver's session options.
ReceiverSessionOptions ToReceiverSessionOptions(const RefitConfig& config);

/// Return the control server options of `refit serve`, with the API key read from the
/// environment variable the configuration names.
/// Errors: InvalidArgument naming the variable when it is unset or empty.
Result<ControlServerOptions> ToControlServerOptions(const RefitConfig& config);

/// Return the options of a control client of `receiver`, with the API key read as above.
/// Errors: InvalidArgument naming the variable when it is unset or empty.
Result<ControlClientOptions> ToControlClientOptions(const RefitConfig& config,
                                                    const ReceiverConfig& receiver);

/// Return the transport URI to pass to MakeTransport. For zmq:// (also wrapped, as in
/// fault+zmq://) it carries tuning.zmq_retries as `retries` and, when the configuration names an
/// API key variable and the URI sets no key of its own, `api_key_env=<variable>`, so the same key
/// guards the data plane and the control plane. Other URIs are returned as written.
/// Errors: InvalidArgument for a malformed URI, or a zmq URI whose `retries` differs from
/// tuning.zmq_retries.
Result<std::string> ToTransportUri(const RefitConfig& config);

/// Return a Publisher's options: the tracker, the stream, the transport URI (ToTransportUri),
/// the receivers in tree order and the control client (its API key read from the variable the
/// configuration names). The transfer timeout and the staging budget keep their defaults.
/// Errors: as ToTransportUri and ToControlClientOptions.
Result<PublisherOptions> ToPublisherOptions(const RefitConfig& config);

/// Return a ReceiverNode's options: the model (server.model, server.mmap), the session (tuning,
/// lease, anchor undo), the control server, the loader spec (server.loader, read from its file),
/// the replica, the payload limit, the producers' bucket size (for the default limit), the
/// bootstrap chain and the data-plane transport URI: ToTransportUri's, with server.curve_* as
/// the zmq transport's CURVE key-file parameters. The data endpoint and peers are the caller's:
/// they depend on the transport's kind and on where the receiver is reached from.
/// Errors: as ToTransportUri and ToControlServerOptions; InvalidArgument when a curve key file is
/// set both in server.* and in the transport URI; the loader spec's errors.
Result<ReceiverNodeOptions> ToReceiverNodeOptions(const RefitConfig& config);

}  // namespace refit::config
