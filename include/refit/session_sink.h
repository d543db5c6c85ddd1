// The receiver's end of a transport: the PayloadSink its Listener delivers into, staging each
// payload into the receiver's ReceiverSession.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <stop_token>
#include <utility>
#include <vector>

#include "refit/receiver_session.h"
#include "refit/status.h"
#include "refit/transfer.h"
#include "refit/transport.h"

namespace refit {

/// A PayloadSink that stages payloads into a ReceiverSession (Stage, blocking while the apply
/// queue is full) and remembers the stream ends it is told about, so that a receiver learns
/// per-producer payload counts from transports that carry them.
///
/// Thread-safety: every member function may be called concurrently. The session must outlive
/// the sink.
class SessionSink final : public PayloadSink {
 public:
  explicit SessionSink(ReceiverSession& session) : session_(session) {}

  /// Stage into the session. Errors: as ReceiverSession::Stage.
  Result<StageResult> Deliver(ValidatedPayload payload, std::stop_token stop) override;

  /// Record `end`. Errors: InvalidArgument when the same producer of the same transfer ended
  /// before with another payload count.
  Status EndOfStream(const StreamEnd& end) override;

  /// Whether `transfer_id` is the session's open transfer (ReceiverSession::GetStatus).
  bool IsTransferOpen(const TransferId& transfer_id) const override {
    return session_.GetStatus().transfer_id == transfer_id;
  }

  /// Return the payload count of each producer whose stream end was reported for `transfer_id`
  /// (empty when none), in the form of TransferExpectation::payloads_per_producer.
  std::map<uint32_t, uint32_t> DeclaredPayloads(const TransferId& transfer_id) const;

 private:
  ReceiverSession& session_;
  mutable std::mutex mutex_;
  // Most recent last; at most kRememberedTransfers (refit/transport.h) entries.
  std::vector<std::pair<TransferId, std::map<uint32_t, uint32_t>>> declared_;
};

}  // namespace refit
