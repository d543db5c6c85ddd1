// Shared plumbing of the `refit` subcommands: registration, size parsing, file helpers.
// Uses only the public API (include/refit/), like any other client of the library.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/control_client.h"
#include "refit/payload.h"
#include "refit/status.h"

namespace refit::cli {

/// Register each subcommand on `app`. Each sets the `status` a run returns through `*result`.
void RegisterDiff(CLI::App& app, Status* result);
void RegisterEncode(CLI::App& app, Status* result);
void RegisterApply(CLI::App& app, Status* result);
void RegisterInspect(CLI::App& app, Status* result);
void RegisterSimulate(CLI::App& app, Status* result);
void RegisterEstimate(CLI::App& app, Status* result);
void RegisterDemo(CLI::App& app, Status* result);
void RegisterServe(CLI::App& app, Status* result);
void RegisterPush(CLI::App& app, Status* result);
void RegisterStatus(CLI::App& app, Status* result);
void RegisterJoin(CLI::App& app, Status* result);
void RegisterAbort(CLI::App& app, Status* result);
void RegisterKeygen(CLI::App& app, Status* result);
void RegisterRawCopySink(CLI::App& app, Status* result);

/// Read a whole file. Errors: IoError naming the path.
Result<std::vector<std::byte>> ReadFile(const std::string& path);
/// Write bytes to `path` atomically (temp file + rename). Errors: IoError naming the path.
Status WriteFileAtomically(const std::string& path,
                           const std::vector<std::vector<std::byte>>& parts);

/// Return whether stdout is a terminal (tables get colour-free alignment either way).
bool StdoutIsTty();

/// Seconds since an arbitrary epoch (steady clock).
double NowSeconds();

/// Return the options of a client of the control plane at `url`, holding the key environment
/// variable `api_key_env` names (none when it is empty): what `--api-key-env` means to every
/// subcommand that talks to one receiver. Errors: InvalidArgument when the variable is unset or
/// empty.
Result<ControlClientOptions> ControlClientOptionsFor(const std::string& url,
                                                     const std::string& api_key_env);

/// Return `error`, which a call to the receiver at `url` returned, with what the user can do
/// about it, prefixed by `command` ("status", "push"): a refused key names the receiver and the
/// environment variable the key came from (`api_key_env`; when empty, how to give one), an
/// unreachable receiver is named as such. Other errors get the command and the URL as context.
Status ExplainReceiverError(const Status& error, std::string_view command, const std::string& url,
                            const std::string& api_key_env);

/// Split a `.rfp` file — one or more payloads back to back — into payloads, checking each header.
/// Errors: as ValidatePayloadHeader, naming the byte offset of the bad payload.
Result<std::vector<std::span<const std::byte>>> SplitPayloadFile(std::span<const std::byte> file,
                                                                 const PayloadLimits& limits);

}  // namespace refit::cli
