// Tests of the producer's context-coding choice (src/pipeline/context_choice.h).
#include "pipeline/context_choice.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace refit::internal {
namespace {

// A 2 MiB bf16 span whose changes cost 10 000 bytes today and 7 000 context-coded; the receiver
// decodes 2 GB/s of span.
ContextChoiceInputs Item(double link_bytes_per_s) {
  return {.today_bytes = 10000,
          .context_bytes = 7000,
          .span_bytes = 2 << 20,
          .decode_bytes_per_s = 2e9,
          .link_bytes_per_s = link_bytes_per_s};
}

TEST(ContextChoice, PaysOnASlowLinkNotOnAFastOne) {
  // The decode (~1 ms) outlasts the download of either encoding at 200 MB/s (50 µs today) and on a
  // fabric: no gain.
  EXPECT_FALSE(ContextCodingPays(Item(200e6)));
  EXPECT_FALSE(ContextCodingPays(Item(12.5e9)));
  // On a slow WAN link (1 MB/s) the download dominates: 7 ms instead of 10.
  EXPECT_TRUE(ContextCodingPays(Item(1e6)));
  // At 10 MB/s one decode thread (1.05 ms) outlasts today's download (1 ms); four (0.26 ms) do
  // not, and 7 000 bytes download in 0.7 ms.
  ContextChoiceInputs threads = Item(10e6);
  EXPECT_FALSE(ContextCodingPays(threads));
  threads.decode_threads = 4;
  EXPECT_TRUE(ContextCodingPays(threads));
}

TEST(ContextChoice, NeedsAMarginAndKnownRates) {
  ContextChoiceInputs almost = Item(1e6);
  almost.context_bytes = 9600;  // 4 % smaller: under the margin
  EXPECT_FALSE(ContextCodingPays(almost));
  almost.context_bytes = 9500;  // 5 %: at the margin
  EXPECT_TRUE(ContextCodingPays(almost));
  ContextChoiceInputs unknown = Item(1e6);
  unknown.decode_bytes_per_s = 0;
  EXPECT_FALSE(ContextCodingPays(unknown));
  EXPECT_FALSE(ContextCodingPays(Item(0)));
}

TEST(ContextChoice, PricedBytesPayOverTheMarginWhateverTheDecode) {
  ContextChoiceInputs stored = Item(200e6);
  stored.bytes_priced = true;
  EXPECT_TRUE(ContextCodingPays(stored));
  stored.context_bytes = 9600;  // under the margin
  EXPECT_FALSE(ContextCodingPays(stored));
}

TEST(ContextChoice, ForceAndForbidOverrideTheEstimate) {
  EXPECT_TRUE(ChooseContextCoding(ContextCodingMode::kForce, true, Item(12.5e9)));
  EXPECT_FALSE(ChooseContextCoding(ContextCodingMode::kForce, false, Item(1e6)));
  EXPECT_FALSE(ChooseContextCoding(ContextCodingMode::kForbid, true, Item(1e6)));
  EXPECT_TRUE(ChooseContextCoding(ContextCodingMode::kAuto, true, Item(1e6)));
  EXPECT_FALSE(ChooseContextCoding(ContextCodingMode::kAuto, true, Item(12.5e9)));
}

TEST(ContextChoice, ParsesTheModes) {
  ASSERT_OK_AND_ASSIGN(ContextCodingMode mode, ParseContextCodingMode("force"));
  EXPECT_EQ(mode, ContextCodingMode::kForce);
  ASSERT_OK_AND_ASSIGN(mode, ParseContextCodingMode("auto"));
  EXPECT_EQ(mode, ContextCodingMode::kAuto);
  ASSERT_OK_AND_ASSIGN(mode, ParseContextCodingMode("forbid"));
  EXPECT_EQ(mode, ContextCodingMode::kForbid);
  EXPECT_STATUS(InvalidArgument, ParseContextCodingMode("sometimes"));
}

TEST(ContextChoice, TransportHints) {
  const LinkHint s3 = LinkHintForTransport("s3://bucket/prefix?endpoint=http://localhost:9000");
  EXPECT_GT(s3.bytes_per_s, 0);
  EXPECT_TRUE(s3.bytes_priced);
  EXPECT_TRUE(LinkHintForTransport("fault+s3://bucket/p").bytes_priced);
  const LinkHint file = LinkHintForTransport("file:///shared/drop");
  EXPECT_GT(file.bytes_per_s, 0);
  EXPECT_FALSE(file.bytes_priced);
  for (const char* fast : {"zmq://10.0.0.1:5555", "mpi://", "inproc://x", "nccl://"}) {
    EXPECT_EQ(LinkHintForTransport(fast).bytes_per_s, 0) << fast;
    EXPECT_FALSE(LinkHintForTransport(fast).bytes_priced) << fast;
  }
}

}  // namespace
}  // namespace refit::internal
