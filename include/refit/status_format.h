// The Status constructors that format their message with {fmt}: InvalidArgument("tensor '{}'
// has {} elements", name, n) is Status(StatusCode::kInvalidArgument, fmt::format(…)). Kept out of
// refit/status.h so that including the library's facades does not pull in fmt; code that makes
// errors (the library itself, the CLI, a custom transport or sink) includes this header.
#pragma once

#include <utility>

#include <fmt/format.h>

#include "refit/status.h"

namespace refit {

#define REFIT_STATUS_FACTORY(Name)                                                        \
  template <typename... Args>                                                             \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {                       \
    return Status(StatusCode::k##Name, fmt::format(format, std::forward<Args>(args)...)); \
  }

REFIT_STATUS_FACTORY(InvalidArgument)
REFIT_STATUS_FACTORY(DataLoss)
REFIT_STATUS_FACTORY(FailedPrecondition)
REFIT_STATUS_FACTORY(Unavailable)
REFIT_STATUS_FACTORY(DeadlineExceeded)
REFIT_STATUS_FACTORY(ResourceExhausted)
REFIT_STATUS_FACTORY(Cancelled)
REFIT_STATUS_FACTORY(PermissionDenied)
REFIT_STATUS_FACTORY(NotFound)
REFIT_STATUS_FACTORY(AlreadyExists)
REFIT_STATUS_FACTORY(IoError)
REFIT_STATUS_FACTORY(Internal)

#undef REFIT_STATUS_FACTORY

}  // namespace refit
