#include "refit/status.h"

#include <cstring>

#include <fmt/format.h>

namespace refit {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kDeadlineExceeded:
      return "DeadlineExceeded";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::optional<StatusCode> StatusCodeFromName(std::string_view name) {
  // kInternal is the last enumerator.
  for (auto raw = static_cast<uint8_t>(StatusCode::kOk);
       raw <= static_cast<uint8_t>(StatusCode::kInternal); ++raw) {
    const auto code = static_cast<StatusCode>(raw);
    if (StatusCodeName(code) == name) return code;
  }
  return std::nullopt;
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) {
    state_ = std::make_shared<const State>(State{code, std::move(message)});
  }
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return fmt::format("{}: {}", StatusCodeName(code()), message());
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code(), fmt::format("{}: {}", context, message()));
}

Status IoErrorFromErrno(int errnum, std::string_view what) {
  return Status(StatusCode::kIoError, fmt::format("{}: {}", what, std::strerror(errnum)));
}

}  // namespace refit
