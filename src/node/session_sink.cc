#include "refit/session_sink.h"

#include <algorithm>
#include <utility>

#include "refit/status_format.h"

namespace refit {

Result<StageResult> SessionSink::Deliver(ValidatedPayload payload, std::stop_token stop) {
  return session_.Stage(std::move(payload), std::move(stop));
}

Status SessionSink::EndOfStream(const StreamEnd& end) {
  std::lock_guard lock(mutex_);
  auto it = std::find_if(declared_.begin(), declared_.end(),
                         [&](const auto& entry) { return entry.first == end.transfer_id; });
  if (it == declared_.end()) {
    if (declared_.size() == kRememberedTransfers) declared_.erase(declared_.begin());
    declared_.emplace_back(end.transfer_id, std::map<uint32_t, uint32_t>{});
    it = declared_.end() - 1;
  }
  const auto [entry, inserted] = it->second.emplace(end.producer_id, end.payloads);
  if (!inserted && entry->second != end.payloads) {
    return InvalidArgument(
        "transfer {}: producer {} ended its stream with {} payloads, and earlier with {}",
        end.transfer_id.ToHex(), end.producer_id, end.payloads, entry->second);
  }
  return Status::OK();
}

std::map<uint32_t, uint32_t> SessionSink::DeclaredPayloads(const TransferId& transfer_id) const {
  std::lock_guard lock(mutex_);
  for (const auto& [id, counts] : declared_) {
    if (id == transfer_id) return counts;
  }
  return {};
}

}  // namespace refit
