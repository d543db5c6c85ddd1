#include "node/session_sink.h"

#include <utility>

namespace refit {

Result<StageResult> SessionSink::Deliver(ValidatedPayload payload, std::stop_token stop) {
  return session_.Stage(std::move(payload), std::move(stop));
}

}  // namespace refit
