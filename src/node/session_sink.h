// The receiver's end of a transport: the PayloadSink its Listener delivers into, staging each
// payload into the receiver's ReceiverSession.
#pragma once

#include <stop_token>

#include "receiver/receiver_session.h"
#include "refit/status.h"
#include "refit/transfer.h"
#include "refit/transport.h"

namespace refit {

/// A PayloadSink that stages payloads into a ReceiverSession (Stage, blocking while the apply
/// queue is full) and hands it the stream ends it is told about (EndStream), which hold the
/// transfer's per-producer payload counts to what the producers say they sent.
///
/// Thread-safety: every member function may be called concurrently. The session must outlive
/// the sink.
class SessionSink final : public PayloadSink {
 public:
  explicit SessionSink(ReceiverSession& session) : session_(session) {}

  /// Stage into the session. Errors: as ReceiverSession::Stage.
  Result<StageResult> Deliver(ValidatedPayload payload, std::stop_token stop) override;

  /// Record `end` in the session (ReceiverSession::EndStream). Errors: as that.
  Status EndOfStream(const StreamEnd& end) override { return session_.EndStream(end); }

  /// Whether `transfer_id` is the session's open transfer (ReceiverSession::GetStatus).
  bool IsTransferOpen(const TransferId& transfer_id) const override {
    return session_.GetStatus().transfer_id == transfer_id;
  }

 private:
  ReceiverSession& session_;
};

}  // namespace refit
