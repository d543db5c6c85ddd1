// Status and Result<T>: the error model of the whole library.
//
// No exceptions cross the library boundary. Every fallible function returns a `Status` or a
// `Result<T>`; both are [[nodiscard]]. Messages name the thing and the value, e.g.
//   "payload 7 of producer 2: item 'model.layers.3.mlp.up_proj.weight' location 9123456 >= numel
//   9123440".
// The constructors that format such messages (InvalidArgument("… {} …", value)) are in
// refit/status_format.h, so that this header — and every facade — needs only the standard
// library.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace refit {

/// The category of an error. Callers branch on the code, humans read the message.
enum class StatusCode : uint8_t {
  kOk = 0,
  /// Bad input from a caller, a file, a peer or the wire.
  kInvalidArgument,
  /// Checksum mismatch, corrupt or truncated payload.
  kDataLoss,
  /// The system is not in the state the operation needs (version/base mismatch, no baseline).
  kFailedPrecondition,
  /// A peer or resource is temporarily unreachable; retrying may succeed.
  kUnavailable,
  kDeadlineExceeded,
  /// A hard limit (size, count, memory) was hit.
  kResourceExhausted,
  kCancelled,
  kPermissionDenied,
  /// A named thing (file, tensor, transfer) does not exist.
  kNotFound,
  kAlreadyExists,
  /// An operating-system I/O call failed (open, mmap, write).
  kIoError,
  /// A broken internal invariant. Never used for bad input.
  kInternal,
};

/// Return the canonical name of `code`, e.g. "DataLoss".
std::string_view StatusCodeName(StatusCode code);
/// Return the code whose StatusCodeName is `name`, or nullopt (for codes that crossed a wire).
std::optional<StatusCode> StatusCodeFromName(std::string_view name);

/// The outcome of an operation: OK, or a code and a message.
///
/// Thread-safety: a Status is a value type; distinct objects may be used from distinct threads.
/// Copying an error Status copies its message (errors are rare; OK is free).
class [[nodiscard]] Status {
 public:
  /// Construct OK.
  Status() = default;
  Status(StatusCode code, std::string message);

  static Status OK() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  /// The message; empty for OK.
  const std::string& message() const;

  /// Return "Code: message", or "OK".
  std::string ToString() const;

  /// Return a copy whose message is `context + ": " + message()`; OK stays OK.
  Status WithContext(std::string_view context) const;

  /// Mark an error as deliberately ignored.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<const State> state_;
};

/// Return an IoError for a failed OS call, with strerror(errnum) appended.
Status IoErrorFromErrno(int errnum, std::string_view what);

/// A value of type T, or the error that prevented computing it.
///
/// Accessing the value of an error Result is a programming error (checked in debug builds).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : storage_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(storage_).ok()) {
      storage_ = Status(StatusCode::kInternal, "Result constructed from an OK Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(storage_); }
  /// The error, or OK when a value is present.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(storage_); }

  const T& ValueOrDie() const& { return std::get<T>(storage_); }
  T& ValueOrDie() & { return std::get<T>(storage_); }
  T&& ValueOrDie() && { return std::get<T>(std::move(storage_)); }
  /// Move the value out. Precondition: ok().
  T MoveValueUnsafe() { return std::get<T>(std::move(storage_)); }

  const T& operator*() const& { return ValueOrDie(); }
  T& operator*() & { return ValueOrDie(); }
  const T* operator->() const { return &ValueOrDie(); }
  T* operator->() { return &ValueOrDie(); }

 private:
  std::variant<Status, T> storage_;
};

namespace internal {
inline Status ToStatus(const Status& s) { return s; }
template <typename T>
Status ToStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace refit

#define REFIT_CONCAT_IMPL(a, b) a##b
#define REFIT_CONCAT(a, b) REFIT_CONCAT_IMPL(a, b)

/// Return the error of `expr` (a Status or Result) from the current function.
#define REFIT_RETURN_NOT_OK(expr)                                      \
  do {                                                                 \
    ::refit::Status _refit_status = ::refit::internal::ToStatus(expr); \
    if (!_refit_status.ok()) return _refit_status;                     \
  } while (false)

#define REFIT_ASSIGN_OR_RETURN_IMPL(result_name, lhs, rexpr) \
  auto result_name = (rexpr);                                \
  if (!result_name.ok()) return result_name.status();        \
  lhs = std::move(result_name).ValueOrDie()

/// Evaluate `rexpr` (a Result<T>); on error return it, else assign the value to `lhs`.
#define REFIT_ASSIGN_OR_RETURN(lhs, rexpr) \
  REFIT_ASSIGN_OR_RETURN_IMPL(REFIT_CONCAT(_refit_result_, __LINE__), lhs, rexpr)
