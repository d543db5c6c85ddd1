// libFuzzer target for refit::config::ParseConfig, the YAML configuration file (`--config`):
// whatever the file says must come back as InvalidArgument, never a crash or an uncaught
// yaml-cpp exception. A configuration that parses is mapped onto every option struct the CLI
// builds from it (ToTrackerOptions … ToTransportUri), which must not crash either.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "config_file.h"
#include "role_options.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "config_yaml_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  refit::Result<refit::config::RefitConfig> config = refit::config::ParseConfig(text, "fuzz.yaml");
  if (!config.ok()) {
    Check(config.status().code() == refit::StatusCode::kInvalidArgument,
          "a configuration error that is not InvalidArgument");
    return 0;
  }
  (void)refit::config::ToTrackerOptions(*config);
  (void)refit::config::ToProducerStreamOptions(*config);
  (void)refit::config::ToReceiverSessionOptions(*config);
  (void)refit::config::ToControlServerOptions(*config);
  for (const refit::config::ReceiverConfig& receiver : config->receivers) {
    (void)refit::config::ToControlClientOptions(*config, receiver);
  }
  (void)refit::config::ToTransportUri(*config);
  // Parsing is a function of the text.
  refit::Result<refit::config::RefitConfig> again = refit::config::ParseConfig(text, "fuzz.yaml");
  Check(
      again.ok() && again->receivers == config->receivers && again->transport == config->transport,
      "ParseConfig is not deterministic");
  return 0;
}
