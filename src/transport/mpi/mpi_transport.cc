// mpi://[?producers=P&shard_group=G&timeout_ms=T]: the collective transport (docs/transports.md).
//
// Data, on producer p's communicator (p is rank 0, the receivers follow), per message:
//
//   broadcast 1   int64[4] header [kind, encoding, payload bytes, metadata bytes]
//   broadcast 2   metadata (when metadata bytes > 0; none of refit's messages has any yet)
//   broadcast 3…  the payload, in slices of at most 1 GiB (when payload bytes > 0)
//
//   kind      0 done (the stream of one transfer ended; "payload bytes" holds its payload count,
//               and no payload follows), 1 full (a payload of an anchor), 2 delta, 3 close (the
//               job ends: the producer sends nothing more)
//   encoding  0 none (done, close), 1 a refit v1 payload (docs/format/payload.md)
//
// So a producer that owns nothing, or whose chunks did not change, costs one broadcast per
// transfer, and the receivers stay in lock-step with every producer without a rank-0 funnel.
//
// Control, on the job's control communicator: producer 0 sends each control request
// ([u64 sequence][method \n path \n body]) to a receiver (tag 1), which answers
// ([u64 sequence][i32 HTTP status][body], tag 2) through ControlServer::Serve, exactly the JSON
// of the HTTP routes. A reply whose sequence is not the request's (a late answer to a request
// that timed out) is dropped. Close (tag 3, empty) ends a receiver's control channel.
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/mpi/mpi_job.h"
#include "transport/transport_internal.h"
#include "util/endian.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

using Clock = std::chrono::steady_clock;

enum MessageKind : int64_t { kDone = 0, kFull = 1, kDelta = 2, kClose = 3 };
enum MessageEncoding : int64_t { kNoPayload = 0, kRefitPayloadV1 = 1 };
constexpr int kHeaderFields = 4;
using Header = std::array<int64_t, kHeaderFields>;
// Metadata is reserved for later versions; a receiver refuses more than this, since it must be
// received whole before anything can be checked.
constexpr int64_t kMaxMetadataBytes = int64_t{1} << 20;
// The slice an oversized payload is received through, and dropped, since a receiver cannot leave
// a broadcast it is part of.
constexpr uint64_t kDiscardSliceBytes = uint64_t{16} << 20;
// The control channel's polls while idle: a receiver waits for requests between transfers.
constexpr std::chrono::microseconds kFirstProbePause{20};
constexpr std::chrono::microseconds kMaxProbePause{2000};

constexpr std::string_view kParams[] = {"producers", "shard_group", "timeout_ms"};
constexpr uint64_t kMaxTimeoutMs = uint64_t{24} * 3600 * 1000;

std::string KindName(int64_t kind) {
  switch (kind) {
    case kDone:
      return "done";
    case kFull:
      return "full";
    case kDelta:
      return "delta";
    case kClose:
      return "close";
    default:
      return fmt::format("unknown kind {}", kind);
  }
}

// Broadcast one header from producer `producer` (its root) on the job's data plane.
Status BroadcastHeader(MpiJob& job, uint32_t producer, const Header& header,
                       const std::string& what) {
  auto buffer = std::make_shared<Header>(header);
  REFIT_RETURN_NOT_OK(job.data_plane().Broadcast(
      producer, reinterpret_cast<std::byte*>(buffer->data()), sizeof(Header),
      Clock::now() + job.options().timeout, {}, buffer, what + ": header"));
  job.CountSent(sizeof(Header));
  return Status::OK();
}

// ---- Producer side ------------------------------------------------------------------------------

class MpiSender final : public TransportSender {
 public:
  MpiSender(MpiJob& job, SenderContext context, PayloadLimits limits)
      : TransportSender(std::move(context), limits), job_(job) {}

 private:
  Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                 const PayloadHeader& /*header*/) override {
    REFIT_RETURN_NOT_OK(job_.CheckUsable());
    // The bytes are borrowed for this call only, but a broadcast that times out cannot be
    // cancelled and MPI may read them later: it reads a copy that is kept alive as long as MPI
    // may need it.
    auto owned = std::make_shared<std::vector<std::byte>>(payload.begin(), payload.end());
    const Header header = {context().anchor ? kFull : kDelta, kRefitPayloadV1,
                           static_cast<int64_t>(payload.size()), 0};
    const std::string what =
        fmt::format("mpi: producer {} payload {} of transfer {}", context().producer_id, payload_id,
                    context().transfer_id.ToHex());
    internal::MutexLock lock(job_.data_mutex());
    REFIT_RETURN_NOT_OK(BroadcastHeader(job_, context().producer_id, header, what));
    REFIT_RETURN_NOT_OK(job_.data_plane().Broadcast(context().producer_id, owned->data(),
                                                    owned->size(), Deadline(), {}, owned, what));
    job_.CountSent(owned->size());
    return Status::OK();
  }

  Status EndStream(uint64_t payloads) override {
    REFIT_RETURN_NOT_OK(job_.CheckUsable());
    internal::MutexLock lock(job_.data_mutex());
    REFIT_RETURN_NOT_OK(BroadcastHeader(
        job_, context().producer_id, {kDone, kNoPayload, static_cast<int64_t>(payloads), 0},
        fmt::format("mpi: producer {} done of transfer {}", context().producer_id,
                    context().transfer_id.ToHex())));
    return Status::OK();
  }

  Clock::time_point Deadline() const { return Clock::now() + job_.options().timeout; }

  MpiJob& job_;
};

// ---- Receiver side ------------------------------------------------------------------------------

// The wire form of control messages.
std::string EncodeRequest(uint64_t sequence, const ControlRequest& request) {
  std::string text(sizeof(uint64_t), '\0');
  StoreLittleEndian<uint64_t>(text.data(), sequence);
  text += request.method;
  text += '\n';
  text += request.path;
  text += '\n';
  text += request.body;
  return text;
}

Result<std::pair<uint64_t, ControlRequest>> DecodeRequest(std::string_view text) {
  if (text.size() < sizeof(uint64_t)) {
    return InvalidArgument("mpi: a control request of {} bytes is truncated", text.size());
  }
  const uint64_t sequence = LoadLittleEndian<uint64_t>(text.data());
  text.remove_prefix(sizeof(uint64_t));
  const size_t method_end = text.find('\n');
  const size_t path_end =
      method_end == std::string_view::npos ? method_end : text.find('\n', method_end + 1);
  if (path_end == std::string_view::npos) {
    return InvalidArgument("mpi: a control request without method and path");
  }
  ControlRequest request{std::string(text.substr(0, method_end)),
                         std::string(text.substr(method_end + 1, path_end - method_end - 1)),
                         std::string(text.substr(path_end + 1))};
  return std::pair{sequence, std::move(request)};
}

std::string EncodeReply(uint64_t sequence, const ControlReply& reply) {
  std::string text(sizeof(uint64_t) + sizeof(uint32_t), '\0');
  StoreLittleEndian<uint64_t>(text.data(), sequence);
  StoreLittleEndian<uint32_t>(text.data() + sizeof(uint64_t), static_cast<uint32_t>(reply.status));
  text += reply.body;
  return text;
}

// Probe for a message from `source` with `tag` on `comm` until one arrives, the deadline passes
// or `stop` is requested, and receive it whole.
Status ReceiveMessage(MPI_Comm comm, int source, int tag, Clock::time_point deadline,
                      const std::stop_token& stop, std::string& text, int& received_tag,
                      const std::string& what) {
  std::chrono::microseconds pause = kFirstProbePause;
  while (true) {
    int found = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    MPI_Status status;
    const int code = MPI_Improbe(source, tag, comm, &found, &message, &status);
    if (code != MPI_SUCCESS) return Unavailable("{}: MPI_Improbe: {}", what, MpiErrorText(code));
    if (found != 0) {
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      text.assign(static_cast<size_t>(count), '\0');
      const int received = MPI_Mrecv(text.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE);
      if (received != MPI_SUCCESS) {
        return Unavailable("{}: MPI_Mrecv: {}", what, MpiErrorText(received));
      }
      received_tag = status.MPI_TAG;
      return Status::OK();
    }
    if (stop.stop_requested()) return Cancelled("{}: stopped", what);
    if (Clock::now() >= deadline) return DeadlineExceeded("{}: no message in time", what);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kMaxProbePause);
  }
}

// Send `text` to `dest` with `tag`, waiting until MPI is done with it (or the deadline).
Status SendMessage(MpiJob& job, MPI_Comm comm, int dest, int tag, std::string text,
                   Clock::time_point deadline, const std::string& what) {
  auto buffer = std::make_shared<std::string>(std::move(text));
  if (buffer->size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return ResourceExhausted("{}: a control message of {} bytes is too large", what,
                             buffer->size());
  }
  MPI_Request request = MPI_REQUEST_NULL;
  const int code = MPI_Isend(buffer->data(), static_cast<int>(buffer->size()), MPI_BYTE, dest, tag,
                             comm, &request);
  if (code != MPI_SUCCESS) return Unavailable("{}: MPI_Isend: {}", what, MpiErrorText(code));
  return job.Wait(request, deadline, {}, /*collective=*/false, buffer, what);
}

class MpiListener final : public Listener {
 public:
  MpiListener(MpiJob& job, ListenerContext context, PayloadSink& sink, PayloadLimits limits)
      : job_(job), context_(std::move(context)), sink_(sink), limits_(limits) {}

  ~MpiListener() override { Stop(); }

  Status Start() override {
    MutexLock lock(mutex_);
    if (started_) return FailedPrecondition("mpi listener {}: started before", context_.endpoint);
    started_ = true;
    try {
      for (uint32_t p = 0; p < job_.info().producers; ++p) {
        threads_.emplace_back([this, p](const std::stop_token& stop) { ListenTo(p, stop); });
      }
      if (context_.control_handler) {
        threads_.emplace_back([this](const std::stop_token& stop) { ServeControl(stop); });
      }
    } catch (const std::system_error& error) {
      return ResourceExhausted("mpi listener {}: cannot start a thread: {}", context_.endpoint,
                               error.what());
    }
    return Status::OK();
  }

  void Stop() override {
    std::vector<std::jthread> threads;
    std::list<Handler> handlers;
    {
      MutexLock lock(mutex_);
      threads = std::move(threads_);
      handlers = std::move(handlers_);
    }
    for (std::jthread& thread : threads) thread.request_stop();
    threads.clear();
    handlers.clear();
  }

  ListenerStats stats() const override {
    MutexLock lock(mutex_);
    return stats_;
  }
  const std::string& endpoint() const override { return context_.endpoint; }

 private:
  void RecordFailure(const Status& status) {
    REFIT_LOG_WARN("{}", status.ToString());
    MutexLock lock(mutex_);
    ++stats_.failures;
    stats_.last_error = status;
  }

  // One producer's stream, in its order, until it closes or the listener stops.
  void ListenTo(uint32_t producer, const std::stop_token& stop) {
    NameCurrentThread("refit-mpi-rx", static_cast<int>(producer));
    DataCollective& plane = job_.data_plane();
    const std::string from =
        fmt::format("{}: receiver {} from producer {}", plane.name(), job_.info().index, producer);
    while (!stop.stop_requested()) {
      auto header = std::make_shared<Header>();
      // Between transfers a receiver waits as long as the producers take.
      Status waited =
          plane.Broadcast(producer, reinterpret_cast<std::byte*>(header->data()), sizeof(Header),
                          Clock::time_point::max(), stop, header, from + ": header");
      if (!waited.ok()) {
        if (!stop.stop_requested()) RecordFailure(waited);
        return;
      }
      job_.CountReceived(sizeof(Header));
      const auto [kind, encoding, payload_bytes, metadata_bytes] = *header;
      const bool carries = kind == kFull || kind == kDelta;
      const bool control = kind == kDone || kind == kClose;
      if ((!carries && !control) || encoding != (carries ? kRefitPayloadV1 : kNoPayload) ||
          payload_bytes < 0 || metadata_bytes < 0 || metadata_bytes > kMaxMetadataBytes ||
          (kind == kClose && (payload_bytes != 0 || metadata_bytes != 0))) {
        // The stream cannot be followed past a header it does not understand: what comes next
        // is unknown, so this receiver is out of step with the producer for good.
        return RecordFailure(FailedPrecondition(
            "{}: a message [{}, encoding {}, {} payload bytes, {} metadata bytes] this build "
            "does not speak (refit-mpi/{}): every rank must run the same refit build",
            from, KindName(kind), encoding, payload_bytes, metadata_bytes, kMpiProtocolVersion));
      }
      if (metadata_bytes > 0) {
        auto metadata = std::make_shared<std::vector<std::byte>>(metadata_bytes);
        Status got = plane.Broadcast(producer, metadata->data(), metadata->size(), Deadline(), stop,
                                     metadata, from + ": metadata");
        if (!got.ok()) return RecordFailure(got);
        job_.CountReceived(metadata->size());
      }
      if (kind == kClose) {
        job_.MarkDataClosed(producer);
        return;
      }
      if (kind == kDone) {
        MutexLock lock(mutex_);
        ++stats_.streams_ended;
        continue;
      }
      if (Status received =
              ReceivePayload(producer, static_cast<uint64_t>(payload_bytes), from, stop);
          !received.ok()) {
        if (job_.broken()) return RecordFailure(received);
        RecordFailure(received);
      }
    }
  }

  Status ReceivePayload(uint32_t producer, uint64_t size, const std::string& from,
                        const std::stop_token& stop) {
    DataCollective& plane = job_.data_plane();
    if (size > limits_.max_payload_bytes) {
      // Every rank of a broadcast takes part in it: receive the bytes and drop them.
      auto scratch = std::make_shared<std::vector<std::byte>>(std::min(size, kDiscardSliceBytes));
      for (uint64_t offset = 0; offset < size; offset += scratch->size()) {
        const uint64_t part = std::min<uint64_t>(scratch->size(), size - offset);
        REFIT_RETURN_NOT_OK(
            plane.Broadcast(producer, scratch->data(), part, Deadline(), stop, scratch, from));
      }
      return ResourceExhausted("{}: a payload of {} bytes exceeds the limit of {}: dropped", from,
                               size, limits_.max_payload_bytes);
    }
    auto payload = std::make_shared<std::vector<std::byte>>(size);
    REFIT_RETURN_NOT_OK(
        plane.Broadcast(producer, payload->data(), size, Deadline(), stop, payload, from));
    job_.CountReceived(size);
    // The sink owns the bytes from here (a broadcast that completed writes nothing more).
    Result<ValidatedPayload> validated = ValidatePayload(std::move(*payload), limits_);
    if (!validated.ok()) return validated.status().WithContext(from);
    Result<StageResult> staged = sink_.Deliver(std::move(*validated), stop);
    if (!staged.ok()) return staged.status().WithContext(from);
    MutexLock lock(mutex_);
    if (*staged == StageResult::kDuplicate) {
      ++stats_.duplicates;
    } else {
      ++stats_.delivered;
    }
    return Status::OK();
  }

  // The control channel: take producer 0's requests and answer each on a thread of its own, so
  // that an abort is answered while a flush waits.
  void ServeControl(const std::stop_token& stop) {
    NameCurrentThread("refit-mpi-ctl", 0);
    const std::string where = fmt::format("mpi: receiver {} control", job_.info().index);
    while (!stop.stop_requested()) {
      std::string text;
      int tag = 0;
      Status got = ReceiveMessage(job_.control(), MpiJob::kCoordinatorRank, MPI_ANY_TAG,
                                  Clock::time_point::max(), stop, text, tag, where);
      if (!got.ok()) {
        if (!stop.stop_requested()) RecordFailure(got);
        return;
      }
      if (tag == kMpiCloseTag) {
        job_.MarkControlClosed();
        return;
      }
      if (tag != kMpiRequestTag) continue;
      Result<std::pair<uint64_t, ControlRequest>> request = DecodeRequest(text);
      if (!request.ok()) {
        RecordFailure(request.status());
        continue;
      }
      job_.CountControl();
      MutexLock lock(mutex_);
      // Finished handlers are joined as new ones start, so their number stays small; one that
      // set `done` touches nothing any more, so joining it under the lock cannot wait for it.
      std::erase_if(handlers_, [](const Handler& handler) { return handler.done->load(); });
      auto done = std::make_shared<std::atomic<bool>>(false);
      handlers_.push_back(Handler{
          done, std::jthread([this, where, done, call = *std::move(request)]() mutable {
            const ControlReply reply = context_.control_handler(call.second);
            Status sent = SendMessage(job_, job_.control(), MpiJob::kCoordinatorRank, kMpiReplyTag,
                                      EncodeReply(call.first, reply), Deadline(), where);
            if (!sent.ok()) RecordFailure(sent);
            done->store(true);
          })});
    }
  }

  Clock::time_point Deadline() const { return Clock::now() + job_.options().timeout; }

  MpiJob& job_;
  const ListenerContext context_;
  PayloadSink& sink_;
  const PayloadLimits limits_;
  mutable Mutex mutex_;
  bool started_ REFIT_GUARDED_BY(mutex_) = false;
  ListenerStats stats_ REFIT_GUARDED_BY(mutex_);
  std::vector<std::jthread> threads_ REFIT_GUARDED_BY(mutex_);
  // The threads answering control requests; `thread`, declared last, is joined before `done` goes.
  struct Handler {
    std::shared_ptr<std::atomic<bool>> done;
    std::jthread thread;
  };
  std::list<Handler> handlers_ REFIT_GUARDED_BY(mutex_);
};

// ---- The coordinator's side of the control channel
// ------------------------------------------------

// The carrier of one receiver's control channel: one request at a time, each answered by the
// reply with its sequence number.
class ControlChannel {
 public:
  ControlChannel(MpiJob& job, uint32_t receiver) : job_(job), receiver_(receiver) {}

  Result<ControlReply> Call(const ControlRequest& request, std::chrono::milliseconds timeout) {
    MutexLock lock(mutex_);
    REFIT_RETURN_NOT_OK(job_.CheckUsable());
    const uint64_t sequence = ++sequence_;
    const int dest = job_.ReceiverRank(receiver_);
    const std::string what = fmt::format("mpi: {} {} to receiver {} (rank {})", request.method,
                                         request.path, receiver_, dest);
    const Clock::time_point deadline = Clock::now() + timeout;
    REFIT_RETURN_NOT_OK(SendMessage(job_, job_.control(), dest, kMpiRequestTag,
                                    EncodeRequest(sequence, request), deadline, what));
    job_.CountControl();
    while (true) {
      std::string text;
      int tag = 0;
      REFIT_RETURN_NOT_OK(
          ReceiveMessage(job_.control(), dest, kMpiReplyTag, deadline, {}, text, tag, what));
      if (text.size() < sizeof(uint64_t) + sizeof(uint32_t)) {
        return DataLoss("{}: a reply of {} bytes is truncated", what, text.size());
      }
      const auto* bytes = reinterpret_cast<const std::byte*>(text.data());
      if (LoadLittleEndian<uint64_t>(bytes) != sequence)
        continue;  // a late reply to an earlier request
      const int status = static_cast<int>(LoadLittleEndian<uint32_t>(bytes + sizeof(uint64_t)));
      return ControlReply{status, text.substr(sizeof(uint64_t) + sizeof(uint32_t))};
    }
  }

 private:
  MpiJob& job_;
  const uint32_t receiver_;
  Mutex mutex_;
  uint64_t sequence_ REFIT_GUARDED_BY(mutex_) = 0;
};

std::string ReceiverName(const MpiJob& job, uint32_t receiver) {
  return fmt::format("mpi://rank/{}", job.ReceiverRank(receiver));
}

// ---- The transport
// -------------------------------------------------------------------------------

class MpiTransport final : public Transport {
 public:
  MpiTransport(TransportUri uri, MpiJob& job, PayloadLimits limits)
      : Transport(std::move(uri)), job_(job), limits_(limits) {
    for (uint32_t r = 0; r < job.info().receivers; ++r) {
      channels_.push_back(std::make_shared<ControlChannel>(job, r));
    }
  }

  TransportCapabilities capabilities() const override {
    TransportCapabilities caps;
    caps.carries_control = true;
    return caps;
  }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_RETURN_NOT_OK(CheckSenderContext(uri(), context));
    const MpiJobInfo& info = job_.info();
    if (!info.producer || context.producer_id != info.index) {
      return InvalidArgument(
          "mpi: a sender for producer {}, but this rank ({} of {}) is {} {} of the job: a "
          "Publisher's rank must be its MPI rank among the producers",
          context.producer_id, info.rank, info.world_size, info.producer ? "producer" : "receiver",
          info.index);
    }
    return std::unique_ptr<TransportSender>(std::make_unique<MpiSender>(job_, context, limits_));
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    const MpiJobInfo& info = job_.info();
    if (info.producer) {
      return InvalidArgument("mpi: rank {} is producer {} of the job, not a receiver", info.rank,
                             info.index);
    }
    if (!context.peers.empty() || !context.bind_address.empty()) {
      return InvalidArgument("mpi: a listener takes no peers or bind address");
    }
    ListenerContext named = context;
    named.endpoint = ReceiverName(job_, info.index);
    return std::unique_ptr<Listener>(
        std::make_unique<MpiListener>(job_, std::move(named), sink, limits_));
  }

  Result<std::vector<TransportReceiver>> ListReceivers() override {
    const MpiJobInfo& info = job_.info();
    if (!info.producer || info.index != 0) {
      return FailedPrecondition(
          "mpi: only producer 0 (rank 0) coordinates the receivers; this is rank {}", info.rank);
    }
    std::vector<TransportReceiver> receivers;
    for (uint32_t r = 0; r < info.receivers; ++r) {
      std::shared_ptr<ControlChannel> channel = channels_[r];
      receivers.push_back(
          {ReceiverName(job_, r), ReceiverName(job_, r),
           [channel](const ControlRequest& request, std::chrono::milliseconds timeout) {
             return channel->Call(request, timeout);
           }});
    }
    return receivers;
  }

 private:
  MpiJob& job_;
  const PayloadLimits limits_;
  std::vector<std::shared_ptr<ControlChannel>> channels_;
};

}  // namespace

Result<MpiJob*> JoinMpiJobOfUri(const TransportUri& uri) {
  REFIT_RETURN_NOT_OK(CheckKnownParams(uri, {kParams[0], kParams[1], kParams[2]}));
  if (!uri.target.empty() && uri.target != "world") {
    return InvalidArgument(
        "transport URI '{}': {}:// runs on MPI_COMM_WORLD (target empty or 'world'); hand a "
        "sub-communicator in with JoinMpiJob before making the transport",
        Printable(uri.ToString()), uri.scheme);
  }
  MpiJobOptions job_options;
  // A job joined already (JoinMpiJob with a communicator of the launcher's) is used as it is,
  // unless the URI names a layout of its own.
  if (MpiJob* joined = MpiJob::Current(); joined != nullptr) job_options = joined->options();
  REFIT_ASSIGN_OR_RETURN(const uint64_t producers,
                         UintParam(uri, "producers", job_options.producers, 1u << 20));
  REFIT_ASSIGN_OR_RETURN(const uint64_t shard_group,
                         UintParam(uri, "shard_group", job_options.shard_group, 1u << 20));
  REFIT_ASSIGN_OR_RETURN(
      const uint64_t timeout_ms,
      UintParam(uri, "timeout_ms", static_cast<uint64_t>(job_options.timeout.count()),
                kMaxTimeoutMs));
  job_options.producers = static_cast<uint32_t>(producers);
  job_options.shard_group = static_cast<uint32_t>(shard_group);
  job_options.timeout = std::chrono::milliseconds(timeout_ms);
  Result<MpiJob*> job = MpiJob::Join(job_options);
  if (!job.ok()) return job.status().WithContext(Printable(uri.ToString()));
  return job;
}

Result<std::unique_ptr<Transport>> MakeCollectiveTransport(const TransportUri& uri,
                                                           const TransportOptions& options,
                                                           MpiJob& job) {
  REFIT_RETURN_NOT_OK(job.ClaimDataPlane(uri.scheme));
  return std::unique_ptr<Transport>(std::make_unique<MpiTransport>(uri, job, options.limits));
}

Result<std::unique_ptr<Transport>> MakeMpiTransport(const TransportUri& uri,
                                                    const TransportOptions& options) {
  REFIT_ASSIGN_OR_RETURN(MpiJob * job, JoinMpiJobOfUri(uri));
  return MakeCollectiveTransport(uri, options, *job);
}

}  // namespace refit::internal

namespace refit {

Status CloseMpiJob() {
  internal::MpiJob* job = internal::MpiJob::Current();
  if (job == nullptr) return FailedPrecondition("mpi: this process joined no MPI job");
  const MpiJobInfo& info = job->info();
  if (!info.producer) return FailedPrecondition("mpi: only producers close the job");
  REFIT_RETURN_NOT_OK(job->CheckUsable());
  const auto deadline = std::chrono::steady_clock::now() + job->options().timeout;
  const std::string what = fmt::format("mpi: producer {} closing the job", info.index);
  {
    internal::MutexLock lock(job->data_mutex());
    REFIT_RETURN_NOT_OK(internal::BroadcastHeader(
        *job, info.index, {internal::kClose, internal::kNoPayload, 0, 0}, what));
  }
  if (info.index == 0) {
    for (uint32_t r = 0; r < info.receivers; ++r) {
      REFIT_RETURN_NOT_OK(internal::SendMessage(*job, job->control(), job->ReceiverRank(r),
                                                internal::kMpiCloseTag, std::string(), deadline,
                                                what));
    }
  }
  return Status::OK();
}

}  // namespace refit
