// A receiver with an HTTP control plane for black-box tests: it loads two small deterministic
// tensors, serves them on 127.0.0.1 at an ephemeral port, prints "port <N>" on stdout, and serves
// until its stdin closes (so a test that dies cannot leave it running).
//
// Usage: control_server_fixture [--api-key KEY]
//
// The tensors: "model.layers.0.weight", float32 [2, 3], holding 0, 1, …, 5; and
// "model.norm.weight", bfloat16 [4], every element 1.0 (bits 0x3f80). Public API only.
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "control/control_server.h"
#include "receiver/receiver_session.h"
#include "refit/weight_store.h"

namespace {

constexpr int kExitUsage = 2;
constexpr int kExitFailure = 1;

std::vector<std::byte> LittleEndianFloats(int count) {
  std::vector<std::byte> bytes;
  for (int i = 0; i < count; ++i) {
    const auto value = static_cast<float>(i);
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<std::byte>(bits >> (8 * b)));
  }
  return bytes;
}

refit::Status Run(const std::string& api_key) {
  std::unique_ptr<refit::WeightStore> store = refit::WeightStore::Make();
  const std::vector<std::byte> weight = LittleEndianFloats(6);
  REFIT_RETURN_NOT_OK(
      store->AddCopy({"model.layers.0.weight", refit::DType::kFloat32, {2, 3}, weight}));
  // bfloat16 1.0 is 0x3f80, stored little-endian.
  const std::vector<std::byte> norm = {std::byte{0x80}, std::byte{0x3f}, std::byte{0x80},
                                       std::byte{0x3f}, std::byte{0x80}, std::byte{0x3f},
                                       std::byte{0x80}, std::byte{0x3f}};
  REFIT_RETURN_NOT_OK(store->AddCopy({"model.norm.weight", refit::DType::kBFloat16, {4}, norm}));
  REFIT_ASSIGN_OR_RETURN(auto session, refit::internal::ReceiverSession::Make({}, *store));
  refit::ControlServerOptions options;
  options.api_key = api_key;
  REFIT_ASSIGN_OR_RETURN(auto server, refit::ControlServer::Make(options, *session, *store));
  REFIT_RETURN_NOT_OK(server->Start());
  std::cout << "port " << server->port() << std::endl;
  // Serve until the test closes our stdin.
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  server->Stop();
  return refit::Status::OK();
}

}  // namespace

int main(int argc, char** argv) {
  // cpp-httplib writes without MSG_NOSIGNAL: a client hanging up mid-response must not kill us.
  std::signal(SIGPIPE, SIG_IGN);
  std::string api_key;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--api-key" && i + 1 < argc) {
      api_key = argv[++i];
    } else {
      std::cerr << "usage: " << argv[0] << " [--api-key KEY]\n";
      return kExitUsage;
    }
  }
  const refit::Status status = Run(api_key);
  if (!status.ok()) {
    std::cerr << "control_server_fixture: " << status.ToString() << "\n";
    return kExitFailure;
  }
  return 0;
}
