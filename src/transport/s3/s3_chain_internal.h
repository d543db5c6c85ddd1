// What the chain replay (src/node/chain_replay.cc) needs of a chain beyond its public index: its
// settings and a client of its bucket, to fetch the payloads the index lists.
#pragma once

#include <memory>
#include <string_view>

#include "refit/status.h"
#include "transport/s3/s3_chain.h"
#include "transport/s3/s3_client.h"
#include "transport/s3/s3_layout.h"

namespace refit::internal {

/// A chain's settings, a client of its bucket, and its index as read now.
struct OpenedChain {
  S3TransportConfig config;
  std::unique_ptr<S3Client> client;
  ChainIndex index;
};

/// Open the chain an s3:// URI names and read its index. Errors: as ReadChainIndex.
Result<OpenedChain> OpenAndReadChain(std::string_view s3_uri);

}  // namespace refit::internal
