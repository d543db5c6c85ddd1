// libFuzzer target for ParseChainIndex, the S3 chain's index object (<prefix>/chain/index.json),
// which a late-joining receiver downloads from a bucket it does not control.
//
// Input layout: byte 0 bit 0 — verify with a MAC key (the rest of the byte is the PruneChain
// retention below); the rest is the index text.
//
// Invariants, for an index that parses:
//   * it is a chain: the first version is an anchor, every version advances its base by one,
//     deltas follow their predecessor, anchors only move forward;
//   * SerializeChainIndex → ParseChainIndex gives it back, with and without a MAC key, and a
//     MAC'd index is refused under another key or without its MAC;
//   * PruneChain removes a prefix and leaves the active chain, starting with an anchor.
// Every error is DataLoss or (with a key) PermissionDenied.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "transport/s3/s3_chain.h"

namespace {

constexpr std::string_view kMacKey = "fuzz-chain-mac-key";
constexpr std::string_view kOtherKey = "another-chain-mac-key";

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "chain_index_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

void CheckIsChain(const refit::ChainIndex& index) {
  for (size_t i = 0; i < index.versions.size(); ++i) {
    const refit::ChainVersion& v = index.versions[i];
    Check(v.version == v.base_version + 1, "a version that does not advance its base by one");
    if (i == 0) {
      Check(v.anchor, "a chain that does not start with an anchor");
    } else if (!v.anchor) {
      Check(v.base_version == index.versions[i - 1].version, "a delta off its predecessor");
    } else {
      Check(v.version > index.versions[i - 1].version, "an anchor that is not newer");
    }
    for (size_t p = 1; p < v.payloads.size(); ++p) {
      const refit::ChainPayload& a = v.payloads[p - 1];
      const refit::ChainPayload& b = v.payloads[p];
      Check(a.producer_id < b.producer_id ||
                (a.producer_id == b.producer_id && a.payload_id < b.payload_id),
            "payloads out of (producer, payload) order");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool with_mac = (data[0] & 1) != 0;
  const uint64_t retain = data[0] >> 1;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::string_view key = with_mac ? kMacKey : std::string_view();
  refit::Result<refit::ChainIndex> index = refit::ParseChainIndex(text, key, "fuzz index");
  if (!index.ok()) {
    const refit::StatusCode code = index.status().code();
    Check(code == refit::StatusCode::kDataLoss ||
              (with_mac && code == refit::StatusCode::kPermissionDenied),
          "a chain index error that is neither DataLoss nor PermissionDenied");
    return 0;
  }
  CheckIsChain(*index);
  Check(index->ActiveAnchor() <= index->versions.size(), "ActiveAnchor out of range");

  const std::string plain = refit::SerializeChainIndex(*index, "");
  refit::Result<refit::ChainIndex> again = refit::ParseChainIndex(plain, "", "reserialized");
  Check(again.ok() && *again == *index, "an index does not survive serialize -> parse");
  Check(refit::SerializeChainIndex(*again, "") == plain, "SerializeChainIndex is not canonical");

  const std::string signed_text = refit::SerializeChainIndex(*index, kMacKey);
  refit::Result<refit::ChainIndex> verified =
      refit::ParseChainIndex(signed_text, kMacKey, "signed");
  Check(verified.ok() && *verified == *index, "a MAC'd index does not verify");
  Check(refit::ParseChainIndex(signed_text, kOtherKey, "signed").status().code() ==
            refit::StatusCode::kPermissionDenied,
        "a MAC'd index verifies under another key");
  Check(refit::ParseChainIndex(plain, kMacKey, "unsigned").status().code() ==
            refit::StatusCode::kPermissionDenied,
        "an index without a MAC verifies");

  refit::ChainIndex pruned = *index;
  const std::vector<refit::ChainVersion> removed = refit::PruneChain(pruned, retain);
  Check(removed.size() + pruned.versions.size() == index->versions.size(),
        "PruneChain lost or made versions");
  for (size_t i = 0; i < removed.size(); ++i) {
    Check(removed[i] == index->versions[i], "PruneChain removed something but a prefix");
  }
  for (size_t i = 0; i < pruned.versions.size(); ++i) {
    Check(pruned.versions[i] == index->versions[removed.size() + i], "PruneChain reordered");
  }
  Check(pruned.versions.size() >= index->versions.size() - index->ActiveAnchor(),
        "PruneChain cut into the active chain");
  if (!pruned.versions.empty()) Check(pruned.versions.front().anchor, "pruned to a delta");
  return 0;
}
