// Transports: move opaque payload bytes from producers to receivers, chosen by URI scheme.
//
//   producer process                                      receiver process
//   ProducerStream ──PayloadSender──▶ TransportSender ══▶ Listener ──Deliver──▶ PayloadSink
//     (send threads)   (AsPayloadSender)  Send            Start/Stop              (SessionSink →
//                                         CleanupThread    [Poll]                  ReceiverSession)
//                                         Finish(count) ══════════EndOfStream──▶
//
// A Transport is made from a URI by a registry keyed by scheme, in the shape of Arrow Flight's
// transport registry: `MakeTransport("file:///mnt/drop?poll_ms=50")`. Each transport declares
// TransportCapabilities so the coordinator can adapt (call a relay flush, post manifests, skip
// declaring payload counts that the stream end already carries).
//
// What each built-in does with its URI (inproc://, file://, zmq://, s3://, fault+<scheme>://) is
// the user-facing reference docs/transports.md; this header is the interface a transport
// implements.
//
// A relay tree (zmq://, docs/protocol.md) fits the same interface: capabilities staged_ack and
// fan_out_tree; SenderContext::endpoints lists the relays and a sender talks to its root,
// endpoints[producer_id % n]; each relay's Listener gets the whole relay list as
// ListenerContext::peers, delivers to its own sink and forwards what the sink staged to its
// children until they ACK it (a kDuplicate whose subtree already ACKed is not forwarded again);
// Finish is the relay flush with the producer's expected count.
//
// Transports move opaque bytes (the layering rule of docs/architecture.md): a sender may read the
// ids of a payload from its header with ValidatePayloadHeader — to name files, or to check that the
// payload belongs to the sender's transfer — and a listener validates each payload it receives
// once (ValidatePayload, under TransportOptions::limits) — but neither decodes the body; the codec
// never knows which transport carries it. Receiving is transport-independent too: a Listener hands
// each ValidatedPayload to a PayloadSink; SessionSink (src/node/session_sink.h, the node layer)
// adapts a ReceiverSession to that interface.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "refit/control_message.h"
#include "refit/manifest_announcer.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transfer.h"

namespace refit {

class TransportRegistry;

// ---- URIs -------------------------------------------------------------------------------------

/// A parsed transport URI: `<scheme>://<target>[?<key>=<value>[&…]]`.
///
/// The scheme follows RFC 3986 (a letter, then letters, digits, '+', '-', '.') and is stored in
/// lower case. The target is everything between "://" and "?", interpreted by the transport (a
/// hub name, a directory, host:port). Target and parameters are percent-decoded. Fragments ('#')
/// are refused: nothing would use them, and a '#' in a path is more likely a typo than intent.
struct TransportUri {
  std::string scheme;
  std::string target;
  /// Parameters in the order given; keys are unique and non-empty.
  std::vector<std::pair<std::string, std::string>> params;

  /// Parse `text`. Errors: InvalidArgument naming the URI and the problem (no "://", empty or
  /// malformed scheme, '#', a bad percent escape, a parameter without '=', an empty or repeated
  /// key).
  static Result<TransportUri> Parse(std::string_view text);

  /// Return the value of parameter `key`, or null when absent.
  const std::string* Param(std::string_view key) const;

  /// Return the URI as text, percent-encoding what Parse would otherwise misread; Parse of the
  /// result gives back an equal TransportUri.
  std::string ToString() const;

  friend bool operator==(const TransportUri&, const TransportUri&) = default;

  /// Whether the URI names a ZeroMQ data plane (`zmq://`, or a layered `…+zmq://`), whose peers
  /// prove the key given by the parameters below.
  bool is_zmq() const { return scheme == "zmq" || scheme.ends_with("+zmq"); }
};

/// The URI parameters that carry a data plane's api key: the key itself, or (preferred: it stays
/// out of process listings and logs) the name of an environment variable holding it.
inline constexpr std::string_view kUriApiKeyParam = "api_key";
inline constexpr std::string_view kUriApiKeyEnvParam = "api_key_env";

// ---- What a transport guarantees --------------------------------------------------------------

/// What a transport guarantees and needs, so the coordinator can adapt its protocol.
struct TransportCapabilities {
  /// Send returns only once every receiver endpoint has staged the payload, and a receiver's
  /// refusal (a NACK) is Send's result. When false, Send returns once the transport holds the
  /// payload durably on the receiving side, and a refusal surfaces only at the receiver's Flush.
  bool staged_ack = false;
  /// A sender reaches one root endpoint, and listeners forward to each other (a relay tree, see
  /// ListenerContext::peers). TransportSender::Finish is then the relay flush, and must return
  /// before the coordinator flushes the receivers.
  bool fan_out_tree = false;
  /// Each payload must be announced to receivers through their control plane (a manifest, as
  /// for object stores) before they can fetch it: SenderContext::endpoints are then the
  /// receivers' control-plane base URLs, and each receiver's control plane hands the manifests
  /// it gets to its Listener (AcceptManifest).
  bool needs_manifest = false;
  /// Senders and listeners share a filesystem (both must see the same directory).
  bool shared_filesystem = false;
  /// Payload bytes are encrypted in flight.
  bool encrypted = false;
  /// Senders and listeners must live in one process.
  bool in_process = false;
  /// Finish carries each producer's payload count to every listener's sink (PayloadSink::
  /// EndOfStream), so receivers learn the expectation without the control plane.
  bool reports_stream_end = false;
  /// The transport carries the control plane too (mpi://: the prepare/flush/commit/abort calls
  /// travel on the job's communicator): the coordinator reaches the receivers through
  /// Transport::ListReceivers, and each receiver's Listener answers them with
  /// ListenerContext::control_handler. No HTTP is needed. (Last, with an initializer.)
  bool carries_control = false;

  friend bool operator==(const TransportCapabilities&, const TransportCapabilities&) = default;
};

/// Options common to every transport; transport-specific settings travel as URI parameters.
struct TransportOptions {
  /// Limits for untrusted payloads: senders check each payload's header before sending it;
  /// listeners check a payload's size before reading it and its header before delivering it.
  PayloadLimits limits;
  /// Senders of transports with needs_manifest (s3://) announce each payload through the
  /// announcer this makes for each endpoint; without it their MakeSender fails. Node wires in
  /// the control plane's client (MakeControlManifestAnnouncers in refit/control_client.h).
  ManifestAnnouncerFactory manifest_announcers = nullptr;
  /// The registry a wrapper transport (fault+) makes its inner transport in. Set by
  /// TransportRegistry::Make; null means DefaultTransportRegistry().
  const TransportRegistry* registry = nullptr;
};

// ---- Producer side ----------------------------------------------------------------------------

/// Who is sending what to whom: one producer's share of one transfer.
struct SenderContext {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  /// The version step of every payload of the transfer (the tracker's TransferPlan).
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  /// Where the receivers listen, each in the transport's syntax (the ListenerContext::endpoint
  /// of each receiver). Transports without fan_out_tree deliver to every one; a relay tree sends
  /// to one root and lets the relays forward. At least one.
  std::vector<std::string> endpoints;
  /// The transfer is an anchor (FULL): mpi:// labels its messages `full` instead of `delta`.
  /// (With an initializer.)
  bool anchor = false;
  /// The transfer's deadline: no Send or Finish, retries included, runs past it (DeadlineExceeded
  /// then), where the transport can bound its waits (zmq://); nullopt: each attempt is limited
  /// by the transport's own timeout only. (Last, with an initializer.)
  std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt;
};

/// Sends the payloads of one producer's share of one transfer.
///
/// Lifecycle: any number of Send calls, concurrently from many threads; CleanupThread once on
/// each sending thread after its last Send; then, once every Send has returned and the stream
/// succeeded, Finish once. A failed stream is not finished: the coordinator aborts the transfer,
/// and destroying the sender releases everything.
///
/// Thread-safety: Send and CleanupThread may be called concurrently from any thread; Finish must
/// not run concurrently with Send.
///
/// The contract every transport keeps is checked here, once, for all of them: a transport
/// implements Deliver and EndStream, and Send and Finish hold the stream to its context first.
class TransportSender : public PayloadChannel {
 public:
  /// Send payload `payload_id`; the bytes are borrowed for the call only. Return once the
  /// transport's delivery guarantee holds (TransportCapabilities::staged_ack). The payload's
  /// header must name this sender's transfer, producer, version step and `payload_id`.
  /// Sending the same payload again is safe: receivers deduplicate it.
  /// Errors: InvalidArgument (a payload of another transfer, producer, version step or id);
  /// the header errors of ValidatePayloadHeader; FailedPrecondition after Finish; Unavailable
  /// (no receiver at an endpoint, a vanished directory: retrying may succeed); IoError; and a
  /// receiver's refusal where the transport reports it (staged_ack).
  Status Send(uint32_t payload_id, std::span<const std::byte> payload) final;

  /// Release the calling thread's per-thread resources (sockets, clients). Transports without
  /// per-thread resources do nothing.
  void CleanupThread() override {}

  /// Mark the end of this producer's stream: `payloads` were sent, with ids 0 … payloads − 1.
  /// Transports that report the stream end (reports_stream_end) hand it to every receiver. A
  /// Finish that failed may be called again (receivers accept a repeated, equal stream end).
  /// Errors: FailedPrecondition after a successful Finish; InvalidArgument when a sent payload id
  /// is not below `payloads` or `payloads` exceeds the 32-bit id space; as Send for delivery
  /// failures.
  Status Finish(uint64_t payloads) final;

  /// The transfer, producer, version step and endpoints this sender streams for.
  const SenderContext& context() const { return context_; }

 protected:
  /// `limits`: what the header of an outgoing payload is held to (TransportOptions::limits).
  TransportSender(SenderContext context, PayloadLimits limits);

  /// Deliver payload `payload_id`, whose header Send checked (`header`: it names this sender's
  /// transfer, producer, version step and id, and its sizes are within the limits). Errors: as
  /// Send's delivery failures.
  virtual Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                         const PayloadHeader& header) = 0;
  /// Hand the end of the stream (`payloads`, checked against the ids sent) to the receivers, as
  /// the transport reports it. Errors: as Finish's delivery failures.
  virtual Status EndStream(uint64_t payloads) = 0;

 private:
  const SenderContext context_;
  const PayloadLimits limits_;
  /// Whether Finish succeeded, and the highest payload id sent (-1: none), to check Finish's
  /// count.
  std::atomic<bool> finished_{false};
  std::atomic<int64_t> max_sent_id_{-1};
};

/// How many of the most recent transfers a receiver's sink and relays remember stream ends and
/// seals for. Transfers run one at a time per receiver; a few more cover stream ends that arrive
/// after a retry began.
inline constexpr size_t kRememberedTransfers = 16;

/// Where and how a receiver listens.
struct ListenerContext {
  /// The endpoint in the transport's syntax: an endpoint name in an inproc hub; an inbox (a
  /// sub-directory name, or "" for the drop directory itself) of a file drop; the address of a
  /// network transport, which it binds unless bind_address is set. Senders list it in
  /// SenderContext::endpoints.
  std::string endpoint;
  /// For transports with fan_out_tree: every relay's endpoint, in tree order, the same list on
  /// every relay (this one included). Other transports refuse a non-empty list.
  std::vector<std::string> peers;
  /// Where to bind instead of `endpoint`, for a receiver whose name in `endpoint` and `peers` is
  /// not an address it can bind, or that must listen on every interface. Empty: bind the
  /// endpoint itself. zmq: the host part to bind (e.g. "0.0.0.0" or "*" for every interface, or
  /// one interface's address), with the endpoint's port; `endpoint` stays the name senders and
  /// relays use. Transports that do not bind (inproc, file) refuse a non-empty value.
  /// (Last, with an initializer, so that `ListenerContext{endpoint, peers}` stays valid.)
  std::string bind_address = {};
  /// For transports with carries_control: how this receiver answers the control requests that
  /// arrive on the transport (ControlServer::Serve), for as long as the listener runs. Other
  /// transports ignore it.
  ControlHandler control_handler = nullptr;
};

/// A failed delivery, kept by the transport for a later attempt or for an operator.
struct DeliveryFailure {
  /// What failed, e.g. the path of a payload file.
  std::string source;
  Status status;
};

/// What one Poll did.
struct PollReport {
  /// Payloads the sink staged, and those it reported as duplicates.
  uint64_t delivered = 0;
  uint64_t duplicates = 0;
  /// Failures of this round. The payloads stay with the transport.
  std::vector<DeliveryFailure> failures;
  /// Stream ends handed to the sink.
  std::vector<StreamEnd> ended;
};

/// What a listener did with one manifest (Listener::AcceptManifest).
struct ManifestDelivery {
  StageResult result = StageResult::kAccepted;
  /// The size of the payload the manifest named.
  uint64_t payload_bytes = 0;
};

/// Counters over a listener's life.
struct ListenerStats {
  uint64_t delivered = 0;
  uint64_t duplicates = 0;
  /// Failed delivery attempts (each PollReport failure, each refused in-process delivery).
  uint64_t failures = 0;
  uint64_t streams_ended = 0;
  /// The most recent failure, or OK.
  Status last_error;
};

/// Receives payloads on one endpoint and delivers them to a PayloadSink.
///
/// Lifecycle: Start once; Stop (idempotent, also run by the destructor) is final. After Stop
/// returns, the sink is never called again. Transports that push (inproc) deliver on the
/// sender's threads; transports that pull (file) deliver on the listener's own named thread,
/// or on the caller's thread in Poll.
///
/// Thread-safety: every member function may be called concurrently from any thread.
class Listener {
 public:
  virtual ~Listener() = default;

  /// Begin receiving. Errors: FailedPrecondition when started before (or stopped); AlreadyExists
  /// (the endpoint is taken); Unavailable (the medium is gone, e.g. the drop directory);
  /// IoError; ResourceExhausted when the OS refuses a thread.
  virtual Status Start() = 0;

  /// Stop receiving: cancel a delivery blocked in the sink and wait for running ones.
  virtual void Stop() = 0;

  /// Do one round of receiving on the calling thread, for transports that pull (file): deliver
  /// what has arrived, report what failed. Transports that push return an empty report.
  /// Errors (pulling transports): FailedPrecondition when not started or stopped; Unavailable
  /// when the medium is gone.
  virtual Result<PollReport> Poll();

  /// Take a manifest (transports with needs_manifest; the body of a control-plane request, as
  /// the sender wrote it): fetch the payload it names, verify it, and deliver it to the sink.
  /// Return how the sink staged it and the payload's size. Errors: FailedPrecondition for
  /// transports without manifests; the transport's for a malformed or forged manifest or
  /// payload; the sink's refusal.
  virtual Result<ManifestDelivery> AcceptManifest(std::string_view manifest, std::stop_token stop);

  /// Forward the payloads and stream ends of `transfer_id` along `tree` (transports with
  /// fan_out_tree): this listener is the relay at tree.position, and its children below each
  /// root are its heap children in tree.endpoints. Called at Prepare, before any payload of the
  /// transfer can arrive; a transfer no tree was named for takes the static
  /// ListenerContext::peers. Relays remember the trees of their most recent transfers.
  /// Errors: InvalidArgument (a transport without relays; a malformed tree).
  virtual Status RouteTransfer(const TransferId& transfer_id, const RelayTree& tree);

  virtual ListenerStats stats() const = 0;
  /// Where producers and other relays reach this listener: ListenerContext::endpoint, with the
  /// port bound for port 0 once Start succeeded.
  virtual const std::string& endpoint() const = 0;
};

// ---- Transports and their registry ------------------------------------------------------------

/// A receiver as a transport with its own control channel knows it (carries_control).
struct TransportReceiver {
  /// How errors and reports name it, e.g. "mpi://rank/3".
  std::string name;
  /// What SenderContext::endpoints lists for it.
  std::string data_endpoint;
  /// Its control channel, for ControlClientOptions::carrier.
  ControlCarrier carrier;
};

/// One configured transport: a factory of senders and listeners. As a TransferObserver (the
/// coordinator's CoordinatorOptions::observer), it learns what became of the transfers it
/// carried; the built-ins other than s3:// keep nothing per transfer and ignore it.
///
/// Thread-safety: MakeSender and MakeListener may be called concurrently; the TransferObserver
/// calls come from the coordinator's thread. Senders and listeners may outlive the Transport
/// that made them.
class Transport : public TransferObserver {
 public:
  virtual ~Transport() = default;

  const TransportUri& uri() const { return uri_; }
  virtual TransportCapabilities capabilities() const = 0;

  /// Make a sender for one producer's share of one transfer.
  /// Errors: InvalidArgument (no endpoints, a malformed endpoint, target_version ≤ base).
  virtual Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) = 0;

  /// Make a listener (not started) that delivers to `sink`, which must outlive it.
  /// Errors: InvalidArgument (a malformed endpoint, peers for a transport without relays).
  virtual Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                         PayloadSink& sink) = 0;

  /// Transports with carries_control: every receiver of the job, in order, with its control
  /// channel. Errors: FailedPrecondition for other transports, and on a rank that does not
  /// coordinate (mpi://: producers other than 0, receivers).
  virtual Result<std::vector<TransportReceiver>> ListReceivers();

 protected:
  explicit Transport(TransportUri uri) : uri_(std::move(uri)) {}

 private:
  TransportUri uri_;
};

/// Make a transport from a parsed URI. A factory validates the URI's target and parameters
/// (refusing unknown parameters, so typos are reported) and does no I/O.
using TransportFactory = std::function<Result<std::unique_ptr<Transport>>(
    const TransportUri& uri, const TransportOptions& options)>;

/// The transports a process can make, by URI scheme, in the shape of Arrow Flight's
/// TransportRegistry: an object, so that a program (or a test) can hold a registry of its own
/// with only the schemes it allows, and a process-wide default (DefaultTransportRegistry()) that
/// MakeTransport uses and everything in refit that takes a URI resolves it in.
///
/// Thread-safety: every method may be called concurrently; factories run outside the lock.
class TransportRegistry {
 public:
  /// An empty registry: no scheme is known until it is registered.
  TransportRegistry() = default;
  /// A registry holding the built-ins: inproc, file, zmq, s3 and the fault+ wrapper.
  static std::unique_ptr<TransportRegistry> MakeWithBuiltins();

  TransportRegistry(const TransportRegistry&) = delete;
  TransportRegistry& operator=(const TransportRegistry&) = delete;

  /// Register `factory` for URIs of scheme `scheme` (case-insensitive).
  /// Errors: InvalidArgument (a malformed scheme, a null factory); AlreadyExists (the scheme, or
  /// a built-in, is registered).
  Status Register(std::string_view scheme, TransportFactory factory);

  /// Register `factory` for every scheme `<prefix>+<inner>` not registered as a whole: the
  /// factory gets the whole URI and makes the inner transport itself, in the registry that
  /// TransportOptions::registry names (see `fault+`).
  /// Errors: as Register; InvalidArgument for a prefix containing '+'.
  Status RegisterWrapper(std::string_view prefix, TransportFactory factory);

  /// Return the registered schemes, sorted, with each wrapper as "<prefix>+<scheme>".
  std::vector<std::string> Schemes() const;

  /// Make the transport that `uri` names. The factory gets `options` with `registry` set to
  /// this registry, so that a wrapper resolves its inner scheme here too.
  /// Errors: InvalidArgument for a malformed URI or an unknown scheme (listing the registered
  /// ones), and whatever the factory returns (a bad target or parameter, naming the URI).
  Result<std::unique_ptr<Transport>> Make(std::string_view uri,
                                          const TransportOptions& options = {}) const;
  Result<std::unique_ptr<Transport>> Make(const TransportUri& uri,
                                          const TransportOptions& options = {}) const;

 private:
  Status Add(std::string_view scheme, TransportFactory factory, bool wrapper);
  // The factory for `scheme`: an exact match, else the wrapper of its '+' prefix; null if none.
  TransportFactory Find(const std::string& scheme) const;

  mutable std::mutex mutex_;
  std::map<std::string, TransportFactory> schemes_;   // guarded by mutex_
  std::map<std::string, TransportFactory> wrappers_;  // guarded by mutex_
};

/// The process-wide registry, holding the built-ins from its first use (a function-local static:
/// no static initialisation order is involved). Register a scheme here to make it available to
/// refit's own URI-taking APIs (Publisher, ReceiverNode, the CLI's --transport).
TransportRegistry& DefaultTransportRegistry();

/// DefaultTransportRegistry().Make(uri, options).
Result<std::unique_ptr<Transport>> MakeTransport(std::string_view uri,
                                                 const TransportOptions& options = {});
Result<std::unique_ptr<Transport>> MakeTransport(const TransportUri& uri,
                                                 const TransportOptions& options = {});

}  // namespace refit
