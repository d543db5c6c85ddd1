// Secrets named by environment variable.
//
// refit never takes a secret (an API key, a MAC key, credentials) on its command line or in a
// configuration file, where `ps`, shell history and checked-in files would show it: those name an
// environment variable instead (`--api-key-env NAME`, `http_refit_api_key_env_var`, a transport
// URI's `*_env` parameter), and this is where every such variable is read.
#pragma once

#include <string>
#include <string_view>

#include "refit/status.h"

namespace refit {

/// Return the secret held by environment variable `name`. `what` names the setting that named
/// the variable (e.g. "--api-key-env"), for the error message.
///
/// An empty value counts as unset: an empty key would silently turn authentication off.
/// Thread-safety: as getenv(3), safe unless another thread changes the environment.
/// Errors: InvalidArgument "environment variable NAME (WHAT) is unset or empty", also for an
/// empty `name` or one holding '=' or a NUL byte, which no variable can have.
Result<std::string> SecretFromEnvironment(std::string_view name, std::string_view what);

}  // namespace refit
