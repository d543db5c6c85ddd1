// libFuzzer target: DecodePayload on hostile bytes.
//
// The first input byte selects the mode:
//   bit 0 clear — the rest is a whole payload. The checksums stop almost every mutation at the
//                 header, so this mode exercises header validation and the checksum gate.
//   bit 0 set   — the rest is a decompressed *body*: byte 1 is the item count and bit 1 of the
//                 mode byte the byte-plane flag, bit 2 format version 2 (context items, whose
//                 bytes are only checked up to their preamble without the old span); the body is
//                 wrapped in a valid header, zstd frame and checksums, so mutations reach the item
//                 table, locations and value groups.
// Whatever decodes must be internally consistent and re-encode to the same body (v1 admits one
// byte string per content); anything else must fail with a documented code. abort() otherwise.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include <xxhash.h>
#include <zstd.h>

#include "codec/locations.h"
#include "refit/dtype.h"
#include "refit/item.h"
#include "refit/payload.h"

namespace {

constexpr uint8_t kBodyModeBit = 0x01;
constexpr uint8_t kBytePlanesBit = 0x02;
constexpr uint8_t kVersion2Bit = 0x04;
/// Bodies and payloads above this are not interesting and would only slow the fuzzer down.
constexpr uint64_t kMaxFuzzBytes = uint64_t{1} << 20;

// Header offsets of docs/format/payload.md, "Fixed header".
constexpr size_t kFormatVersionOffset = 4;
constexpr size_t kItemCountOffset = 48;
constexpr size_t kBodyBytesOffset = 56;
constexpr size_t kCompressedBytesOffset = 64;
constexpr size_t kChecksumOffset = 72;
constexpr size_t kHeaderChecksumOffset = 120;

[[noreturn]] void Fail(const char* what, const refit::Status& status = refit::Status::OK()) {
  std::fprintf(stderr, "payload_decode_fuzz: %s %s\n", what, status.ToString().c_str());
  std::abort();
}

void Store(std::byte* p, uint64_t value, size_t width) {
  for (size_t i = 0; i < width; ++i) p[i] = static_cast<std::byte>(value >> (8 * i));
}

refit::PayloadIds FuzzIds() {
  refit::PayloadIds ids;
  ids.producer_id = 1;
  ids.payload_id = 2;
  ids.base_version = 0;
  ids.target_version = 1;
  return ids;
}

/// Wrap `body` into a payload whose header and checksums are valid. The header comes from the
/// real encoder (an empty payload), then item count, sizes and checksums are patched.
std::vector<std::byte> WrapBody(std::span<const std::byte> body, uint32_t item_count,
                                bool byte_planes, uint16_t format_version) {
  refit::PayloadEncodeOptions options;
  options.byte_planes = byte_planes;
  auto empty = refit::EncodePayload(FuzzIds(), {}, options);
  if (!empty.ok()) Fail("encoding an empty payload failed", empty.status());
  std::vector<std::byte> payload(empty->begin(), empty->begin() + refit::kPayloadHeaderSize);

  static thread_local std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> cctx(ZSTD_createCCtx(),
                                                                                &ZSTD_freeCCtx);
  std::vector<std::byte> frame(ZSTD_compressBound(body.size()));
  const size_t n =
      ZSTD_compressCCtx(cctx.get(), frame.data(), frame.size(), body.data(), body.size(), 1);
  if (ZSTD_isError(n)) Fail("zstd compression failed");
  payload.insert(payload.end(), frame.begin(), frame.begin() + n);

  Store(payload.data() + kFormatVersionOffset, format_version, 2);
  Store(payload.data() + kItemCountOffset, item_count, 4);
  Store(payload.data() + kBodyBytesOffset, body.size(), 8);
  Store(payload.data() + kCompressedBytesOffset, n, 8);
  const XXH128_hash_t hash = XXH3_128bits(payload.data() + refit::kPayloadHeaderSize, n);
  Store(payload.data() + kChecksumOffset, hash.low64, 8);
  Store(payload.data() + kChecksumOffset + 8, hash.high64, 8);
  Store(payload.data() + kHeaderChecksumOffset, XXH3_64bits(payload.data(), kHeaderChecksumOffset),
        8);
  return payload;
}

std::vector<std::byte> Decompress(std::span<const std::byte> payload) {
  const auto frame = payload.subspan(refit::kPayloadHeaderSize);
  std::vector<std::byte> body(ZSTD_getFrameContentSize(frame.data(), frame.size()));
  if (ZSTD_isError(ZSTD_decompress(body.data(), body.size(), frame.data(), frame.size()))) {
    Fail("cannot decompress a payload the encoder wrote");
  }
  return body;
}

/// Check what a successful decode promises, and that re-encoding gives back the same body.
void CheckAccepted(const refit::DecodedPayload& decoded, std::span<const std::byte> payload) {
  for (const refit::ItemView& item : decoded.items()) {
    if (item.location_encoding == refit::LocationEncoding::kContext) {
      // Its locations and values decode only against an old span (ExpandContextItems).
      if (decoded.header().format_version != 2) Fail("a context item in a v1 payload");
      if (!item.values.empty()) Fail("a context item with values");
      continue;
    }
    if (item.values.size() != item.count * refit::DTypeSize(item.value_dtype)) {
      Fail("decoded item has a wrong value size");
    }
    auto locations = refit::DecodeAllLocations(item);
    if (!locations.ok()) Fail("decoded item has undecodable locations", locations.status());
    if (locations->size() != item.count) Fail("decoded item has a wrong location count");
    for (size_t i = 0; i < locations->size(); ++i) {
      const uint64_t location = (*locations)[i];
      if (location < item.span_begin || location >= item.span_end ||
          (i > 0 && location <= (*locations)[i - 1])) {
        Fail("decoded item has a location outside its span or out of order");
      }
    }
  }
  refit::PayloadEncodeOptions options;
  options.byte_planes = (decoded.header().flags & refit::kPayloadFlagBytePlanes) != 0;
  auto reencoded = refit::EncodePayload(decoded.header().ids, decoded.items(), options);
  if (!reencoded.ok()) Fail("the encoder refuses what the decoder accepted", reencoded.status());
  if (Decompress(*reencoded) != Decompress(payload)) {
    Fail("re-encoding an accepted payload changed its body");
  }
}

void CheckRejected(const refit::Status& status) {
  switch (status.code()) {
    case refit::StatusCode::kDataLoss:
    case refit::StatusCode::kInvalidArgument:
    case refit::StatusCode::kResourceExhausted:
      return;
    default:
      Fail("undocumented error code", status);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > kMaxFuzzBytes) return 0;
  const uint8_t mode = data[0];
  std::span<const std::byte> input(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  std::vector<std::byte> wrapped;
  if ((mode & kBodyModeBit) != 0) {
    if (input.empty()) return 0;
    const uint32_t item_count = std::to_integer<uint8_t>(input[0]);
    wrapped = WrapBody(input.subspan(1), item_count, (mode & kBytePlanesBit) != 0,
                       (mode & kVersion2Bit) != 0 ? 2 : 1);
    input = wrapped;
  }
  refit::PayloadLimits limits;
  limits.max_body_bytes = kMaxFuzzBytes;
  auto header = refit::ValidatePayloadHeader(input, limits);
  auto decoded = refit::DecodePayload(input, limits);
  if (!header.ok()) {
    CheckRejected(header.status());
    if (decoded.ok()) Fail("DecodePayload accepted what ValidatePayloadHeader rejected");
    return 0;
  }
  if (!decoded.ok()) {
    CheckRejected(decoded.status());
    return 0;
  }
  if (decoded->items().size() != header->item_count) Fail("item count differs from the header");
  if (decoded->header().flags != header->flags ||
      decoded->header().body_bytes != header->body_bytes) {
    Fail("DecodePayload and ValidatePayloadHeader disagree on the header");
  }
  CheckAccepted(*decoded, input);
  return 0;
}
