// The relay of zmq://: a listener that stages what it receives and forwards it down a binary
// heap of relays.
//
// Each relay's listener binds a ROUTER on its endpoint (or on ListenerContext::bind_address with
// the endpoint's port: the endpoint stays its name among the peers) and, given the relay list as
// ListenerContext::peers, forwards what its sink staged to its children in a binary heap rooted at
// the producer's root: with relays r0 … r(n−1) and root R, relay i sits at heap position
// (i − R + n) % n, and position p's children are 2p+1 and 2p+2, i.e. relays (2p+1 + R) % n and
// (2p+2 + R) % n. Each payload thus crosses into the fleet once, and each relay sends it at most
// twice.
//
// ACK means staged on the whole subtree: a relay replies once its own sink staged the payload
// and its children ACKed it. The relay remembers, per payload it staged, whether its subtree
// ACKed it: a duplicate (kDuplicate, or a late copy in a sealed stream) is ACKed at once when
// the subtree did, waits for the forward in flight when there is one (and gets its verdict), and
// is forwarded again otherwise (its earlier forward failed; the children deduplicate). The
// listener's I/O thread never waits for children, so trees of different roots that cross each
// other cannot deadlock: a forwarding thread per relay sends to the children, waits for their
// ACKs, and hands the upstream reply back to the I/O thread over an inproc socket. FLUSH
// travels the same path behind the producer's payloads: every relay hands the stream end to
// its sink and forwards it, and the FLUSH ACK means the whole tree has it.
//
// Seal: once a relay's sink took the stream end of (transfer, producer), that stream is sealed
// on the relay: a later DATA of it is NACKed FailedPrecondition and neither delivered nor
// forwarded, except an exact duplicate (same payload id and checksum) of a payload the relay
// staged, which is not delivered again and is ACKed like any duplicate (a late copy of a retried
// request is harmless). The ReceiverSession seals only at its own Flush, so without this a
// payload arriving between the relay flush and the receiver flush would be staged behind the
// declared count. A FLUSH is refused (FailedPrecondition) unless the relay's receiver has the
// transfer open (PayloadSink::IsTransferOpen): the coordinator prepares every receiver before
// any producer streams, so a FLUSH before Prepare is a coordinator bug or a forgery, and it must
// not seal a stream. A relay remembers at most kMaxStreamsPerTransfer producers per transfer.
//
// Every request is untrusted. Frame count, protocol and kind are checked first; then the api
// key (in constant time) and the root index, so an unauthenticated client's payload is never
// parsed; then the FLUSH frames or the payload header; only then is anything delivered. A
// request that does not speak the protocol is dropped (counted as a failure); one that does but
// is malformed or refused is NACKed with the reason. A frame (or handshake command) over
// kMaxFrameBytes is dropped by ZeroMQ itself (ZMQ_MAXMSGSIZE), which disconnects the peer, so a
// peer without a key can make the relay hold little more than one such frame per connection,
// for at most the handshake timeout; at most kMaxQueuedRequests complete requests wait per
// connection (ZMQ_RCVHWM). The relay reads the frames where ZeroMQ received them: nothing of a
// refused request is copied, an accepted payload's parts are joined once (the sink's copy), and
// children are sent the received frames themselves.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>

#include "refit/payload.h"
#include "refit/transfer.h"
#include "refit/transport.h"
#include "transport/zmq/zmq_config.h"
#include "transport/zmq/zmq_curve.h"

namespace refit::internal::zmq {

/// The relay listening at `context.endpoint`, `self` its index in `context.peers` (0 without
/// peers), delivering to `sink`, which must outlive it. `curve`: the relay's CURVE keys, or
/// nullopt for a plain relay. Does no I/O until Start.
std::unique_ptr<Listener> MakeZmqRelay(ZmqConfig config, std::optional<CurveServerKeys> curve,
                                       ListenerContext context, size_t self, PayloadSink& sink,
                                       PayloadLimits limits);

}  // namespace refit::internal::zmq
