#include "transport/s3/s3_chain.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "transport/s3/s3_layout.h"

namespace refit {
namespace {

using nlohmann::json;

constexpr std::string_view kMacKey = "chain mac key";
constexpr std::string_view kWhere = "test chain index";
// A 64-digit MAC of one payload object (any well-formed value: the index only carries it).
constexpr std::string_view kPayloadMac =
    "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";

/// Version `version` (based on version − 1) with `payloads` payloads of producer 0 and one of
/// producer 1; every field derives from the version, so versions differ in each of them.
ChainVersion MakeVersion(uint64_t version, bool anchor, uint32_t payloads = 2,
                         bool with_mac = false) {
  ChainVersion v;
  v.version = version;
  v.base_version = version - 1;
  v.anchor = anchor;
  for (size_t i = 0; i < v.transfer_id.bytes.size(); ++i) {
    v.transfer_id.bytes[i] = static_cast<uint8_t>(version * 16 + i);
  }
  // High bits set: the fingerprint must survive as 16 hex digits, not a JSON number.
  v.state_fingerprint = 0xfedcba9876543210ULL ^ version;
  auto add = [&](uint32_t producer, uint32_t payload) {
    ChainPayload p;
    p.key =
        fmt::format("fleet/chain/{}/{:06}/{:06}.rfpl", v.transfer_id.ToHex(), producer, payload);
    p.producer_id = producer;
    p.payload_id = payload;
    p.size = 1000 * version + 10 * producer + payload;
    for (size_t i = 0; i < p.checksum.size(); ++i) {
      p.checksum[i] = static_cast<uint8_t>(version + 7 * producer + payload + i);
    }
    if (with_mac) p.mac = std::string(kPayloadMac);
    v.payloads.push_back(std::move(p));
  };
  for (uint32_t payload = 0; payload < payloads; ++payload) add(0, payload);
  add(1, 0);
  return v;
}

/// A1 d2 d3 A4 d5 A6 d7: Ak is an anchor of version k, dk a delta.
ChainIndex SampleChain(bool with_mac = false) {
  ChainIndex index;
  for (uint64_t v = 1; v <= 7; ++v) {
    const bool anchor = v == 1 || v == 4 || v == 6;
    index.versions.push_back(MakeVersion(v, anchor, /*payloads=*/2, with_mac));
  }
  return index;
}

std::vector<uint64_t> Versions(const std::vector<ChainVersion>& versions) {
  std::vector<uint64_t> numbers;
  for (const ChainVersion& v : versions) numbers.push_back(v.version);
  return numbers;
}

std::string ReplaceOnce(std::string text, std::string_view from, std::string_view to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << "'" << from << "' not in " << text;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

// ---- Serialize / Parse -------------------------------------------------------------------------

TEST(ChainIndexTest, RoundTripsWithoutAMacKey) {
  const ChainIndex index = SampleChain();
  const std::string text = SerializeChainIndex(index, "");
  const json body = json::parse(text);
  EXPECT_EQ(body["format"], "refit-chain/1");
  EXPECT_FALSE(body.contains("mac"));
  EXPECT_EQ(body["versions"][0]["state_fingerprint"], "fedcba9876543211");
  ASSERT_OK_AND_ASSIGN(const ChainIndex parsed, ParseChainIndex(text, "", kWhere));
  EXPECT_EQ(parsed, index);

  ASSERT_OK_AND_ASSIGN(const ChainIndex empty,
                       ParseChainIndex(SerializeChainIndex(ChainIndex{}, ""), "", kWhere));
  EXPECT_TRUE(empty.versions.empty());
}

TEST(ChainIndexTest, RoundTripsWithAMacKey) {
  const ChainIndex index = SampleChain(/*with_mac=*/true);
  const std::string text = SerializeChainIndex(index, kMacKey);
  const json body = json::parse(text);
  ASSERT_TRUE(body.contains("mac"));
  EXPECT_EQ(body["mac"].get<std::string>().size(), 64u);
  EXPECT_EQ(body["versions"][0]["payloads"][0]["mac"], kPayloadMac);
  ASSERT_OK_AND_ASSIGN(const ChainIndex parsed, ParseChainIndex(text, kMacKey, kWhere));
  EXPECT_EQ(parsed, index);
  // Serializing is deterministic, so a writer's MAC is reproducible by a reader.
  EXPECT_EQ(SerializeChainIndex(parsed, kMacKey), text);
}

TEST(ChainIndexTest, AChainWithAGapBeforeAnAnchorRoundTrips) {
  ChainIndex index;
  index.versions = {MakeVersion(1, true), MakeVersion(2, false), MakeVersion(9, true),
                    MakeVersion(10, false)};
  ASSERT_OK_AND_ASSIGN(const ChainIndex parsed,
                       ParseChainIndex(SerializeChainIndex(index, ""), "", kWhere));
  EXPECT_EQ(parsed, index);
}

TEST(ChainIndexTest, AMacKeyRefusesUnsignedWronglySignedAndTamperedIndexes) {
  const ChainIndex index = SampleChain();
  const std::string signed_text = SerializeChainIndex(index, kMacKey);
  // Without a MAC.
  EXPECT_STATUS_MSG(PermissionDenied, kWhere,
                    ParseChainIndex(SerializeChainIndex(index, ""), kMacKey, kWhere));
  // Signed under another key.
  EXPECT_STATUS(PermissionDenied,
                ParseChainIndex(SerializeChainIndex(index, "other key"), kMacKey, kWhere));
  // A MAC that is not a string.
  json mistyped = json::parse(signed_text);
  mistyped["mac"] = 12345;
  EXPECT_STATUS(PermissionDenied, ParseChainIndex(mistyped.dump(), kMacKey, kWhere));

  // One payload's size, one checksum digit, one anchor flag changed in the text.
  const ChainPayload& first = index.versions[0].payloads[0];
  const std::string size = fmt::format("\"size\":{}", first.size);
  const std::string checksum = json::parse(signed_text)["versions"][0]["payloads"][0]["checksum"];
  std::string other_checksum = checksum;
  other_checksum[0] = other_checksum[0] == '0' ? '1' : '0';
  const std::vector<std::string> tampered = {
      ReplaceOnce(signed_text, size, fmt::format("\"size\":{}", first.size + 1)),
      ReplaceOnce(signed_text, checksum, other_checksum),
      ReplaceOnce(signed_text, "\"anchor\":false", "\"anchor\":true"),
  };
  for (const std::string& text : tampered) {
    SCOPED_TRACE(text);
    // Still a well-formed index: only the MAC can tell.
    EXPECT_OK(ParseChainIndex(text, "", kWhere));
    EXPECT_STATUS(PermissionDenied, ParseChainIndex(text, kMacKey, kWhere));
  }
}

TEST(ChainIndexTest, MalformedIndexesAreDataLoss) {
  const json good = json::parse(SerializeChainIndex(SampleChain(), ""));
  ASSERT_OK(ParseChainIndex(good.dump(), "", kWhere));
  struct Case {
    std::string name;
    std::string text;
  };
  std::vector<Case> cases = {
      {"not JSON", "{\"format\": \"refit-chain/1\", "},
      {"empty", ""},
      {"an array", json::array().dump()},
  };
  auto mutated = [&](std::string name, auto&& change) {
    json body = good;
    change(body);
    cases.push_back({std::move(name), body.dump()});
  };
  mutated("wrong format", [](json& b) { b["format"] = "refit-chain/2"; });
  mutated("format a number", [](json& b) { b["format"] = 1; });
  mutated("no format", [](json& b) { b.erase("format"); });
  mutated("no versions", [](json& b) { b.erase("versions"); });
  mutated("versions an object", [](json& b) { b["versions"] = json::object(); });
  mutated("a version not an object", [](json& b) { b["versions"][1] = 2; });
  mutated("version != base + 1", [](json& b) { b["versions"][1]["version"] = 3; });
  mutated("a delta first", [](json& b) { b["versions"][0]["anchor"] = false; });
  mutated("a delta not based on the previous version", [](json& b) {
    // d3 → version 4 based on 3 (so version == base + 1), after d2: not contiguous.
    b["versions"][2]["version"] = 4;
    b["versions"][2]["base_version"] = 3;
  });
  mutated("an anchor not newer", [](json& b) {
    b["versions"][3]["version"] = 2;
    b["versions"][3]["base_version"] = 1;
  });
  for (const char* field :
       {"version", "base_version", "anchor", "transfer_id", "state_fingerprint", "payloads"}) {
    mutated(fmt::format("version lacks {}", field),
            [&](json& b) { b["versions"][1].erase(field); });
  }
  for (const char* field : {"key", "producer_id", "payload_id", "size", "checksum"}) {
    mutated(fmt::format("payload lacks {}", field),
            [&](json& b) { b["versions"][1]["payloads"][0].erase(field); });
  }
  mutated("anchor a string", [](json& b) { b["versions"][0]["anchor"] = "true"; });
  mutated("version a string", [](json& b) { b["versions"][0]["version"] = "1"; });
  mutated("version negative", [](json& b) { b["versions"][0]["version"] = -1; });
  mutated("payloads an object", [](json& b) { b["versions"][0]["payloads"] = json::object(); });
  mutated("a payload not an object", [](json& b) { b["versions"][0]["payloads"][0] = "p"; });
  mutated("producer_id > UINT32_MAX", [](json& b) {
    b["versions"][0]["payloads"][0]["producer_id"] = uint64_t{UINT32_MAX} + 1;
  });
  mutated("size fractional", [](json& b) { b["versions"][0]["payloads"][0]["size"] = 1.5; });
  mutated("key a number", [](json& b) { b["versions"][0]["payloads"][0]["key"] = 3; });
  mutated("mac a number", [](json& b) { b["versions"][0]["payloads"][0]["mac"] = 3; });
  for (const char* fingerprint : {"fedcba987654321", "fedcba98765432100", "FEDCBA9876543210",
                                  "fedcba987654321g", "0xfedcba98765432", ""}) {
    mutated(fmt::format("fingerprint '{}'", fingerprint),
            [&](json& b) { b["versions"][0]["state_fingerprint"] = fingerprint; });
  }
  mutated("fingerprint a number", [](json& b) { b["versions"][0]["state_fingerprint"] = 1234; });
  mutated("transfer_id short", [](json& b) { b["versions"][0]["transfer_id"] = "0011"; });
  mutated("transfer_id not hex",
          [](json& b) { b["versions"][0]["transfer_id"] = "zz112233445566778899aabbccddeeff"; });
  mutated("checksum short", [](json& b) { b["versions"][0]["payloads"][0]["checksum"] = "00"; });
  mutated("checksum not hex", [](json& b) {
    b["versions"][0]["payloads"][0]["checksum"] = "0011223344556677889900112233445g";
  });
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_STATUS_MSG(DataLoss, kWhere, ParseChainIndex(c.text, "", kWhere));
  }
}

TEST(ChainIndexTest, AMacKeyDoesNotMaskMalformedIndexes) {
  // Malformed before any MAC can be checked: still DataLoss.
  EXPECT_STATUS(DataLoss, ParseChainIndex("not json", kMacKey, kWhere));
  // Correctly signed (a writer that had the key) but with a delta first: DataLoss.
  json body = json::parse(SerializeChainIndex(SampleChain(), ""));
  body["versions"][0]["anchor"] = false;
  const std::string signed_part = body.dump();
  body["mac"] =
      internal::MacHex(kMacKey, std::as_bytes(std::span(signed_part.data(), signed_part.size())));
  EXPECT_STATUS(DataLoss, ParseChainIndex(body.dump(), kMacKey, kWhere));
}

// ---- AppendChainVersion ------------------------------------------------------------------------

TEST(ChainAppendTest, DeltasExtendTheNewestVersion) {
  ChainIndex index;
  ASSERT_OK(AppendChainVersion(index, MakeVersion(1, true)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(2, false)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(3, false)));
  EXPECT_EQ(Versions(index.versions), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(index.versions[2], MakeVersion(3, false));
}

TEST(ChainAppendTest, ADeltaMustBeBasedOnTheNewestVersion) {
  ChainIndex index;
  EXPECT_STATUS(FailedPrecondition, AppendChainVersion(index, MakeVersion(1, false)));
  EXPECT_TRUE(index.versions.empty());
  ASSERT_OK(AppendChainVersion(index, MakeVersion(1, true)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(2, false)));
  const ChainIndex before = index;
  // Based on 3, a version never recorded; and on 1, a fork that repeats version 2.
  for (const ChainVersion& delta : {MakeVersion(4, false), MakeVersion(2, false)}) {
    SCOPED_TRACE(delta.version);
    EXPECT_STATUS(FailedPrecondition, AppendChainVersion(index, delta));
    EXPECT_EQ(index, before);
  }
}

TEST(ChainAppendTest, AnAnchorRestartsTheChainAfterAGap) {
  ChainIndex index;
  ASSERT_OK(AppendChainVersion(index, MakeVersion(1, true)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(2, false)));
  // Versions 3 … 6 were never recorded (e.g. deltas that failed to publish).
  ASSERT_OK(AppendChainVersion(index, MakeVersion(7, true)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(8, false)));
  EXPECT_EQ(Versions(index.versions), (std::vector<uint64_t>{1, 2, 7, 8}));
  EXPECT_EQ(index.ActiveAnchor(), 2u);
  // An anchor right after the newest version also restarts it.
  ASSERT_OK(AppendChainVersion(index, MakeVersion(9, true)));
  EXPECT_EQ(index.ActiveAnchor(), 4u);
}

TEST(ChainAppendTest, AnAnchorMustBeNewerThanTheChain) {
  ChainIndex index;
  ASSERT_OK(AppendChainVersion(index, MakeVersion(1, true)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(2, false)));
  ASSERT_OK(AppendChainVersion(index, MakeVersion(3, false)));
  const ChainIndex before = index;
  for (uint64_t version : {3, 2, 1}) {
    SCOPED_TRACE(version);
    EXPECT_STATUS(FailedPrecondition, AppendChainVersion(index, MakeVersion(version, true)));
    EXPECT_EQ(index, before);
  }
}

// ---- ActiveAnchor and PruneChain ---------------------------------------------------------------

TEST(ChainPruneTest, ActiveAnchorIsTheNewestAnchor) {
  EXPECT_EQ(ChainIndex{}.ActiveAnchor(), 0u);
  EXPECT_EQ(SampleChain().ActiveAnchor(), 5u);  // A6.
  ChainIndex two;
  two.versions = {MakeVersion(1, true), MakeVersion(2, false), MakeVersion(3, false)};
  EXPECT_EQ(two.ActiveAnchor(), 0u);
  two.versions.push_back(MakeVersion(4, true));
  EXPECT_EQ(two.ActiveAnchor(), 3u);
  // Without any anchor (only possible when built by hand): versions.size().
  ChainIndex deltas;
  deltas.versions = {MakeVersion(2, false), MakeVersion(3, false)};
  EXPECT_EQ(deltas.ActiveAnchor(), 2u);
}

TEST(ChainPruneTest, RetentionKeepsWholeChainsAndAlwaysTheActiveOne) {
  struct Case {
    uint64_t retain;
    std::vector<uint64_t> pruned;
    std::vector<uint64_t> kept;
  };
  // A1 d2 d3 A4 d5 A6 d7. The retain-th newest version's chain starts at the anchor at or
  // before it: 1st d7 → A6, 2nd A6, 3rd d5 → A4, 4th A4, 5th d3 → A1.
  const std::vector<Case> cases = {
      {0, {1, 2, 3, 4, 5}, {6, 7}},
      {1, {1, 2, 3, 4, 5}, {6, 7}},
      {2, {1, 2, 3, 4, 5}, {6, 7}},
      {3, {1, 2, 3}, {4, 5, 6, 7}},
      {4, {1, 2, 3}, {4, 5, 6, 7}},
      {5, {}, {1, 2, 3, 4, 5, 6, 7}},
      {7, {}, {1, 2, 3, 4, 5, 6, 7}},
      {1000, {}, {1, 2, 3, 4, 5, 6, 7}},
      {UINT64_MAX, {}, {1, 2, 3, 4, 5, 6, 7}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.retain);
    ChainIndex index = SampleChain();
    const ChainIndex before = index;
    const std::vector<ChainVersion> pruned = PruneChain(index, c.retain);
    EXPECT_EQ(Versions(pruned), c.pruned);
    EXPECT_EQ(Versions(index.versions), c.kept);
    // Pruned versions come back whole (their payload keys are what gets deleted), oldest first.
    for (size_t i = 0; i < pruned.size(); ++i) EXPECT_EQ(pruned[i], before.versions[i]);
    // What is left still starts with an anchor and parses.
    ASSERT_FALSE(index.versions.empty());
    EXPECT_TRUE(index.versions.front().anchor);
    EXPECT_OK(ParseChainIndex(SerializeChainIndex(index, ""), "", kWhere));
  }
}

TEST(ChainPruneTest, PruningIsIdempotentAndLeavesAnActiveChainAlone) {
  ChainIndex index = SampleChain();
  EXPECT_EQ(Versions(PruneChain(index, 0)), (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_TRUE(PruneChain(index, 0).empty());
  EXPECT_EQ(Versions(index.versions), (std::vector<uint64_t>{6, 7}));
  // A chain that is a single anchor with deltas is never pruned, however small the retention.
  ChainIndex single;
  single.versions = {MakeVersion(1, true), MakeVersion(2, false), MakeVersion(3, false)};
  EXPECT_TRUE(PruneChain(single, 0).empty());
  EXPECT_TRUE(PruneChain(single, 1).empty());
  EXPECT_EQ(single.versions.size(), 3u);
  ChainIndex empty;
  EXPECT_TRUE(PruneChain(empty, 0).empty());
}

}  // namespace
}  // namespace refit
