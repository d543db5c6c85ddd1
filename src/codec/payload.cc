// Payload format v1: encoder and hostile-input decoder. The byte layout is specified in
// docs/format/payload.md; every constant below names the section of that spec it comes from.
#include "refit/payload.h"

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <xxhash.h>
#include <zstd.h>

#include "codec/context_coding.h"
#include "codec/locations.h"
#include "codec/values.h"
#include "refit/dtype.h"
#include "refit/status_format.h"
#include "refit/tensor.h"
#include "util/check.h"
#include "util/endian.h"

namespace refit {
namespace {

// ---- Fixed header layout (spec §"Fixed header"). -----------------------------------------------
constexpr std::array<uint8_t, 4> kMagic = {'R', 'F', 'P', 'L'};
constexpr size_t kOffsetMagic = 0;
constexpr size_t kOffsetFormatVersion = 4;
constexpr size_t kOffsetFlags = 6;
constexpr size_t kOffsetTransferId = 8;
constexpr size_t kOffsetProducerId = 24;
constexpr size_t kOffsetPayloadId = 28;
constexpr size_t kOffsetBaseVersion = 32;
constexpr size_t kOffsetTargetVersion = 40;
constexpr size_t kOffsetItemCount = 48;
constexpr size_t kOffsetCompression = 52;
constexpr size_t kOffsetMacAlgorithm = 53;
constexpr size_t kOffsetReserved = 54;
constexpr size_t kOffsetBodyBytes = 56;
constexpr size_t kOffsetCompressedBytes = 64;
constexpr size_t kOffsetChecksum = 72;
constexpr size_t kOffsetMac = 88;
constexpr size_t kMacSize = 32;
constexpr size_t kOffsetHeaderChecksum = 120;
static_assert(kOffsetHeaderChecksum + sizeof(uint64_t) == kPayloadHeaderSize);

/// The only compression of v1: one zstd frame.
// `compression`: the body stored as it is (every item FULL), or one zstd frame.
constexpr uint8_t kCompressionNone = 0;
constexpr uint8_t kCompressionZstd = 1;
/// v1 carries no MAC; nonzero codes are reserved for the keyed MAC of a later version.
constexpr uint8_t kMacNone = 0;
/// Every flag bit this decoder understands.
constexpr uint16_t kKnownFlags = kPayloadFlagBytePlanes;

// ---- Body layout (spec §"Item table" and §"Value groups"). --------------------------------------
/// The fixed fields of an item entry after its dims: span_begin, span_end, count, location_bytes,
/// digest (5 × u64).
constexpr size_t kItemTailBytes = 5 * sizeof(uint64_t);
/// dtype, value_dtype, op, location_encoding, rank (5 × u8).
constexpr size_t kItemCodeBytes = 5;
/// The smallest possible item entry: u16 name length, a 1-byte name, the codes, rank 0.
constexpr uint64_t kMinItemEntryBytes = sizeof(uint16_t) + 1 + kItemCodeBytes + kItemTailBytes;
/// A value group header: u8 width, u64 element count.
constexpr size_t kGroupHeaderBytes = sizeof(uint8_t) + sizeof(uint64_t);
/// Value widths in bytes; a group per width that occurs.
constexpr std::array<uint32_t, 4> kValueWidths = {1, 2, 4, 8};

using internal::LoadLittleEndian;
using internal::StoreLittleEndian;

/// The 16 wire bytes of an XXH3-128 checksum: low 64 bits LE, then high 64 bits LE.
std::array<uint8_t, 16> ChecksumBytes(std::span<const std::byte> data) {
  const XXH128_hash_t hash = XXH3_128bits(data.data(), data.size());
  std::array<uint8_t, 16> out;
  StoreLittleEndian(out.data(), static_cast<uint64_t>(hash.low64));
  StoreLittleEndian(out.data() + sizeof(uint64_t), static_cast<uint64_t>(hash.high64));
  return out;
}

std::string HexBytes(std::span<const uint8_t> bytes) {
  return fmt::format("{:02x}", fmt::join(bytes, ""));
}

template <typename T>
void AppendLE(std::vector<std::byte>* out, T value) {
  const size_t at = out->size();
  out->resize(at + sizeof(T));
  StoreLittleEndian(out->data() + at, value);
}

/// Render an untrusted name for an error message: printable ASCII as is, anything else as \xNN.
std::string PrintableName(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  for (char c : name) {
    const auto byte = static_cast<unsigned char>(c);
    if (c >= ' ' && c <= '~' && c != '\\') {
      out.push_back(c);
    } else {
      out += fmt::format("\\x{:02x}", byte);
    }
  }
  return out;
}

std::string PayloadContext(const PayloadIds& ids) {
  return fmt::format("payload {} of producer {} (transfer {})", ids.payload_id, ids.producer_id,
                     ids.transfer_id.ToHex());
}

std::string ItemContext(const PayloadIds& ids, size_t index, std::string_view name) {
  return fmt::format("{}: item {} '{}'", PayloadContext(ids), index, PrintableName(name));
}

int WidthSlot(uint32_t width) {
  for (size_t slot = 0; slot < kValueWidths.size(); ++slot) {
    if (kValueWidths[slot] == width) return static_cast<int>(slot);
  }
  return -1;
}

/// Values an item carries in its value group: none for a context-coded item (its bytes code them).
uint64_t WireValueCount(const ItemView& item) {
  return item.location_encoding == LocationEncoding::kContext ? 0 : item.count;
}

/// The value groups implied by an item table, in first-seen order of value width.
struct GroupPlan {
  struct Group {
    uint32_t width = 0;
    uint64_t element_count = 0;
  };
  std::vector<Group> groups;
  /// Per item: its group and the index of its first element within the group.
  std::vector<size_t> item_group;
  std::vector<uint64_t> item_first_element;
};

/// Build the group plan. Element counts are bounded by the caller (each count ≤ 2^63 and the
/// decoder checks the group's byte size against the body), so only the sum can overflow.
Result<GroupPlan> PlanGroups(std::span<const ItemView> items, const PayloadIds& ids) {
  GroupPlan plan;
  plan.item_group.reserve(items.size());
  plan.item_first_element.reserve(items.size());
  std::array<int, kValueWidths.size()> group_of_slot;
  group_of_slot.fill(-1);
  for (size_t i = 0; i < items.size(); ++i) {
    const uint32_t width = DTypeSize(items[i].value_dtype);
    const int slot = WidthSlot(width);
    if (group_of_slot[slot] < 0) {
      group_of_slot[slot] = static_cast<int>(plan.groups.size());
      plan.groups.push_back({width, 0});
    }
    GroupPlan::Group& group = plan.groups[group_of_slot[slot]];
    const uint64_t values = WireValueCount(items[i]);
    if (values > std::numeric_limits<uint64_t>::max() - group.element_count) {
      return DataLoss("{}: value group of width {} overflows 2^64 elements",
                      ItemContext(ids, i, items[i].name), width);
    }
    plan.item_group.push_back(static_cast<size_t>(group_of_slot[slot]));
    plan.item_first_element.push_back(group.element_count);
    group.element_count += values;
  }
  return plan;
}

/// Check the rules of spec §"Item rules" that need neither location decoding nor other items.
/// `numel` is the element count of the item's shape. Codes follow the decoder's conventions;
/// the encoder re-codes every failure as InvalidArgument.
Status CheckItemRules(const ItemView& item, uint64_t numel, const PayloadLimits& limits,
                      const PayloadIds& ids, size_t index, uint16_t format_version) {
  auto context = [&] { return ItemContext(ids, index, item.name); };
  if (item.name.empty()) return DataLoss("{}: empty name", context());
  if (item.name.size() > limits.max_name_length) {
    return ResourceExhausted("{}: name length {} > limit {}", context(), item.name.size(),
                             limits.max_name_length);
  }
  if (item.name.find('\0') != std::string_view::npos) {
    return DataLoss("{}: name contains a NUL byte", context());
  }
  if (item.shape.size() > limits.max_rank) {
    return ResourceExhausted("{}: rank {} > limit {}", context(), item.shape.size(),
                             limits.max_rank);
  }
  if (item.span_begin > item.span_end || item.span_end > numel) {
    return DataLoss("{}: span [{}, {}) is not inside numel {} of shape {}", context(),
                    item.span_begin, item.span_end, numel, ShapeToString(item.shape));
  }
  const uint64_t span_length = item.span_end - item.span_begin;
  if (item.op == Op::kFull && item.location_encoding != LocationEncoding::kAll) {
    return DataLoss("{}: op full needs location encoding all, got {}", context(),
                    LocationEncodingName(item.location_encoding));
  }
  if (item.location_encoding == LocationEncoding::kAll && item.count != span_length) {
    return DataLoss("{}: location encoding all with count {} != span length {}", context(),
                    item.count, span_length);
  }
  if (item.count > span_length) {
    return DataLoss("{}: count {} > span length {}", context(), item.count, span_length);
  }
  if (item.count == 0 && item.op != Op::kFull) {
    return DataLoss("{}: op {} with zero locations", context(), OpName(item.op));
  }
  if (item.op == Op::kAdd) {
    if (!AddSupported(item.dtype, item.value_dtype)) {
      return InvalidArgument("{}: op add is not defined for dtype {} with delta dtype {}",
                             context(), DTypeName(item.dtype), DTypeName(item.value_dtype));
    }
  } else if (item.value_dtype != item.dtype) {
    return DataLoss("{}: op {} needs value dtype {} (the tensor's), got {}", context(),
                    OpName(item.op), DTypeName(item.dtype), DTypeName(item.value_dtype));
  }
  if (item.location_encoding == LocationEncoding::kAll && !item.locations.empty()) {
    return DataLoss("{}: location encoding all with {} location bytes", context(),
                    item.locations.size());
  }
  if (item.location_encoding == LocationEncoding::kContext) {
    if (format_version < 2) {
      return InvalidArgument(
          "{}: location encoding context needs payload format version 2, the "
          "payload says {}",
          context(), format_version);
    }
    if (item.op != Op::kXor) {
      return DataLoss("{}: location encoding context needs op xor, got {}", context(),
                      OpName(item.op));
    }
    if (!internal::ContextCodingSupported(item.dtype)) {
      return DataLoss("{}: location encoding context is not defined for dtype {}", context(),
                      DTypeName(item.dtype));
    }
  }
  return Status::OK();
}

/// Check that items sharing a name agree on dtype and shape (spec §"Item rules").
Status CheckSameNameAgreement(std::span<const ItemView> items, const PayloadIds& ids) {
  std::unordered_map<std::string_view, size_t> first_with_name;
  first_with_name.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const auto [it, inserted] = first_with_name.emplace(items[i].name, i);
    if (inserted) continue;
    const ItemView& first = items[it->second];
    if (first.dtype != items[i].dtype || first.shape != items[i].shape) {
      return DataLoss("{}: dtype {} shape {} disagrees with item {} of the same name ({} {})",
                      ItemContext(ids, i, items[i].name), DTypeName(items[i].dtype),
                      ShapeToString(items[i].shape), it->second, DTypeName(first.dtype),
                      ShapeToString(first.shape));
    }
  }
  return Status::OK();
}

Status ValidateLocations(const ItemView& item, const PayloadIds& ids, size_t index,
                         std::vector<LocationMark>* marks = nullptr) {
  if (item.location_encoding == LocationEncoding::kContext) {
    // Only the preamble can be checked without the old span; the receiver decodes the rest
    // against it (ExpandContextItems) before anything is applied.
    return internal::CheckContextCodedPreamble(item.dtype, item.span_end - item.span_begin,
                                               item.locations, item.count)
        .WithContext(ItemContext(ids, index, item.name));
  }
  auto decoder = LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                       item.span_begin, item.span_end);
  Status status = decoder.ok() ? decoder->ValidateAll(marks) : decoder.status();
  return status.WithContext(ItemContext(ids, index, item.name));
}

// ---- zstd contexts, one per thread and reused (zstd's own advice for repeated calls). ---------
struct CCtxDeleter {
  void operator()(ZSTD_CCtx* cctx) const { ZSTD_freeCCtx(cctx); }
};
struct DCtxDeleter {
  void operator()(ZSTD_DCtx* dctx) const { ZSTD_freeDCtx(dctx); }
};

ZSTD_CCtx* ThreadCompressionContext() {
  thread_local std::unique_ptr<ZSTD_CCtx, CCtxDeleter> cctx(ZSTD_createCCtx());
  return cctx.get();
}

ZSTD_DCtx* ThreadDecompressionContext() {
  thread_local std::unique_ptr<ZSTD_DCtx, DCtxDeleter> dctx(ZSTD_createDCtx());
  return dctx.get();
}

// ---- Encoder scratch, one per thread and reused (STYLE rule 11). --------------------------------

/// Working bytes that keep their capacity between uses and are never zero-filled: the compressor
/// overwrites what it uses, and clearing a compressBound-sized buffer per payload cost a memset
/// of about the body's size.
class ScratchBytes {
 public:
  /// Return room for `size` bytes, valid until the next call; the contents are unspecified.
  std::byte* Reserve(size_t size) {
    if (size > capacity_) {
      bytes_ = std::make_unique_for_overwrite<std::byte[]>(size);
      capacity_ = size;
    }
    return bytes_.get();
  }
  size_t capacity() const { return capacity_; }
  void Release() {
    bytes_.reset();
    capacity_ = 0;
  }

 private:
  std::unique_ptr<std::byte[]> bytes_;
  size_t capacity_ = 0;
};

/// The encoder's working buffers: the uncompressed body, one value group gathered for the
/// byte-plane split, and the compressed body. Every EncodePayload on a thread reuses them, so a
/// stream of payloads allocates only the payloads it returns.
struct EncoderScratch {
  std::vector<std::byte> body;
  std::vector<std::byte> group_values;
  ScratchBytes compressed;
};

/// Capacity a thread keeps after a payload. Twice the default bucket (ProducerStreamOptions,
/// 32 MiB) of item bytes: a producer's payloads stay below it and reuse their buffers, while a
/// single huge payload (`refit encode` of a whole model in one bucket) does not pin its size on
/// the thread for the rest of the process.
constexpr size_t kMaxRetainedScratchBytes = size_t{64} << 20;

// A zstd frame of raw (stored) blocks (RFC 8878 §3.1.1): what PayloadEncodeOptions::compress =
// false writes. Any zstd decoder reads it as it reads a compressed frame, and writing it costs a
// copy, so an anchor on a link faster than the compressor is sent at the link's speed without a
// new payload format. The frame declares its content size (8 bytes) and a 128 KiB window, so a
// decoder's memory for it is bounded as for our compressed frames.
constexpr size_t kRawBlockBytes = size_t{128} << 10;    // The largest block RFC 8878 allows.
constexpr size_t kRawFrameHeaderBytes = 4 + 1 + 1 + 8;  // Magic, descriptor, window, content size.
constexpr size_t kBlockHeaderBytes = 3;

uint64_t RawZstdFrameBytes(uint64_t body_bytes) {
  const uint64_t blocks = std::max<uint64_t>(1, (body_bytes + kRawBlockBytes - 1) / kRawBlockBytes);
  return kRawFrameHeaderBytes + blocks * kBlockHeaderBytes + body_bytes;
}

void WriteRawZstdFrame(std::span<const std::byte> body, std::span<std::byte> out) {
  REFIT_DCHECK(out.size() == RawZstdFrameBytes(body.size()), "raw frame buffer size");
  std::byte* at = out.data();
  StoreLittleEndian(at, uint32_t{ZSTD_MAGICNUMBER});
  // Frame header descriptor: an 8-byte content size (FCS flag 3), not single-segment, no
  // checksum (the payload header's XXH3-128 covers these bytes), no dictionary.
  at[4] = std::byte{0xC0};
  // Window descriptor: exponent 7, mantissa 0 → 2^(10 + 7) = 128 KiB, one raw block.
  at[5] = std::byte{7 << 3};
  StoreLittleEndian(at + 6, static_cast<uint64_t>(body.size()));
  at += kRawFrameHeaderBytes;
  size_t done = 0;
  do {
    const size_t n = std::min(kRawBlockBytes, body.size() - done);
    const bool last = done + n == body.size();
    // Block header, 3 bytes little-endian: bit 0 last block, bits 1-2 type (0 = raw), size.
    const uint32_t block_header = (static_cast<uint32_t>(n) << 3) | (last ? 1u : 0u);
    at[0] = static_cast<std::byte>(block_header & 0xff);
    at[1] = static_cast<std::byte>((block_header >> 8) & 0xff);
    at[2] = static_cast<std::byte>((block_header >> 16) & 0xff);
    if (n > 0) std::memcpy(at + kBlockHeaderBytes, body.data() + done, n);
    at += kBlockHeaderBytes + n;
    done += n;
  } while (done < body.size());
}

EncoderScratch& ThreadEncoderScratch() {
  thread_local EncoderScratch scratch;
  return scratch;
}

/// Give back what exceeds kMaxRetainedScratchBytes, on every return path of the encoder.
class ScratchTrim {
 public:
  explicit ScratchTrim(EncoderScratch& scratch) : scratch_(scratch) {}
  ScratchTrim(const ScratchTrim&) = delete;
  ScratchTrim& operator=(const ScratchTrim&) = delete;
  ~ScratchTrim() {
    for (std::vector<std::byte>* buffer : {&scratch_.body, &scratch_.group_values}) {
      if (buffer->capacity() > kMaxRetainedScratchBytes) std::vector<std::byte>().swap(*buffer);
    }
    if (scratch_.compressed.capacity() > kMaxRetainedScratchBytes) scratch_.compressed.Release();
  }

 private:
  EncoderScratch& scratch_;
};

// ---- Encoder. ----------------------------------------------------------------------------------

/// Validate one encoder input; every failure is InvalidArgument (bad input from the caller).
Status CheckEncoderItem(const ItemView& item, const PayloadIds& ids, size_t index,
                        const PayloadLimits& limits) {
  auto context = [&] { return ItemContext(ids, index, item.name); };
  if (!DTypeFromCode(static_cast<uint8_t>(item.dtype)).ok() ||
      !DTypeFromCode(static_cast<uint8_t>(item.value_dtype)).ok()) {
    return InvalidArgument("{}: invalid dtype code {} or value dtype code {}", context(),
                           static_cast<int>(item.dtype), static_cast<int>(item.value_dtype));
  }
  const auto op_code = static_cast<uint8_t>(item.op);
  if (op_code < static_cast<uint8_t>(Op::kXor) || op_code > static_cast<uint8_t>(Op::kFull)) {
    return InvalidArgument("{}: invalid op code {}", context(), op_code);
  }
  const auto encoding_code = static_cast<uint8_t>(item.location_encoding);
  if (encoding_code < static_cast<uint8_t>(LocationEncoding::kAll) ||
      encoding_code > static_cast<uint8_t>(LocationEncoding::kContext)) {
    return InvalidArgument("{}: invalid location encoding code {}", context(), encoding_code);
  }
  Result<uint64_t> numel = NumElements(item.shape);
  if (!numel.ok()) return numel.status().WithContext(context());
  Status rules = CheckItemRules(item, *numel, limits, ids, index, kPayloadFormatVersion);
  if (!rules.ok()) return Status(StatusCode::kInvalidArgument, rules.message());
  const uint32_t width = DTypeSize(item.value_dtype);
  const uint64_t values = WireValueCount(item);
  if (item.values.size() / width != values || item.values.size() % width != 0) {
    return InvalidArgument(
        "{}: {} value bytes for {} values of {} ({} bytes each; a "
        "context-coded item carries none)",
        context(), item.values.size(), values, DTypeName(item.value_dtype), width);
  }
  Status locations = ValidateLocations(item, ids, index);
  if (!locations.ok()) return Status(StatusCode::kInvalidArgument, locations.message());
  return Status::OK();
}

uint64_t ItemEntryBytes(const ItemView& item) {
  return sizeof(uint16_t) + item.name.size() + kItemCodeBytes +
         item.shape.size() * sizeof(int64_t) + kItemTailBytes;
}

void AppendItemEntry(const ItemView& item, std::vector<std::byte>* body) {
  AppendLE(body, static_cast<uint16_t>(item.name.size()));
  const auto* name = reinterpret_cast<const std::byte*>(item.name.data());
  body->insert(body->end(), name, name + item.name.size());
  AppendLE(body, static_cast<uint8_t>(item.dtype));
  AppendLE(body, static_cast<uint8_t>(item.value_dtype));
  AppendLE(body, static_cast<uint8_t>(item.op));
  AppendLE(body, static_cast<uint8_t>(item.location_encoding));
  AppendLE(body, static_cast<uint8_t>(item.shape.size()));
  for (int64_t extent : item.shape) AppendLE(body, extent);
  AppendLE(body, item.span_begin);
  AppendLE(body, item.span_end);
  AppendLE(body, item.count);
  AppendLE(body, static_cast<uint64_t>(item.locations.size()));
  AppendLE(body, item.digest);
}

void WriteHeader(uint16_t format_version, const PayloadIds& ids, uint16_t flags,
                 uint8_t compression, uint32_t item_count, uint64_t body_bytes,
                 std::span<const std::byte> compressed, std::byte* header) {
  std::memset(header, 0, kPayloadHeaderSize);
  std::memcpy(header + kOffsetMagic, kMagic.data(), kMagic.size());
  StoreLittleEndian(header + kOffsetFormatVersion, format_version);
  StoreLittleEndian(header + kOffsetFlags, flags);
  std::memcpy(header + kOffsetTransferId, ids.transfer_id.bytes.data(),
              ids.transfer_id.bytes.size());
  StoreLittleEndian(header + kOffsetProducerId, ids.producer_id);
  StoreLittleEndian(header + kOffsetPayloadId, ids.payload_id);
  StoreLittleEndian(header + kOffsetBaseVersion, ids.base_version);
  StoreLittleEndian(header + kOffsetTargetVersion, ids.target_version);
  StoreLittleEndian(header + kOffsetItemCount, item_count);
  StoreLittleEndian(header + kOffsetCompression, compression);
  StoreLittleEndian(header + kOffsetMacAlgorithm, kMacNone);
  StoreLittleEndian(header + kOffsetBodyBytes, body_bytes);
  StoreLittleEndian(header + kOffsetCompressedBytes, static_cast<uint64_t>(compressed.size()));
  const std::array<uint8_t, 16> checksum = ChecksumBytes(compressed);
  std::memcpy(header + kOffsetChecksum, checksum.data(), checksum.size());
  // The MAC field stays zero: mac_algorithm is kMacNone in v1.
  StoreLittleEndian(header + kOffsetHeaderChecksum,
                    static_cast<uint64_t>(XXH3_64bits(header, kOffsetHeaderChecksum)));
}

// ---- Decoder. ----------------------------------------------------------------------------------

/// A bounds-checked cursor over the untrusted decompressed body. `describe` callables name what
/// is being read; they run only on failure, so the hot path formats nothing.
class BodyReader {
 public:
  explicit BodyReader(std::span<const std::byte> body) : body_(body) {}

  size_t position() const { return position_; }
  size_t remaining() const { return body_.size() - position_; }

  /// Return the next `n` bytes, or DataLoss when fewer are left.
  template <typename Describe>
  Result<std::span<const std::byte>> Take(uint64_t n, const Describe& describe) {
    if (n > remaining()) {
      return DataLoss("{} needs {} bytes at body offset {}, {} left", describe(), n, position_,
                      remaining());
    }
    auto out = body_.subspan(position_, static_cast<size_t>(n));
    position_ += static_cast<size_t>(n);
    return out;
  }

  template <typename T, typename Describe>
  Result<T> Read(const Describe& describe) {
    REFIT_ASSIGN_OR_RETURN(auto bytes, Take(sizeof(T), describe));
    return LoadLittleEndian<T>(bytes.data());
  }

 private:
  std::span<const std::byte> body_;
  size_t position_ = 0;
};

/// The fields of one item entry as read from the table, before its sections are located.
struct ParsedEntry {
  ItemView view;
  uint64_t location_bytes = 0;
};

Result<ParsedEntry> ParseItemEntry(BodyReader* reader, const PayloadIds& ids, size_t index,
                                   const PayloadLimits& limits, uint16_t format_version) {
  ParsedEntry entry;
  ItemView& item = entry.view;
  auto where = [&] { return fmt::format("{}: item {} name", PayloadContext(ids), index); };
  REFIT_ASSIGN_OR_RETURN(uint16_t name_length, reader->Read<uint16_t>(where));
  if (name_length > limits.max_name_length) {
    return ResourceExhausted("{}: length {} > limit {}", where(), name_length,
                             limits.max_name_length);
  }
  REFIT_ASSIGN_OR_RETURN(auto name, reader->Take(name_length, where));
  item.name = std::string_view(reinterpret_cast<const char*>(name.data()), name.size());
  auto context = [&] { return ItemContext(ids, index, item.name); };

  REFIT_ASSIGN_OR_RETURN(auto codes, reader->Take(kItemCodeBytes, context));
  const auto code = [&](size_t i) { return std::to_integer<uint8_t>(codes[i]); };
  Result<DType> dtype = DTypeFromCode(code(0));
  if (!dtype.ok()) return dtype.status().WithContext(context() + " dtype");
  Result<DType> value_dtype = DTypeFromCode(code(1));
  if (!value_dtype.ok()) return value_dtype.status().WithContext(context() + " value dtype");
  item.dtype = *dtype;
  item.value_dtype = *value_dtype;
  if (code(2) < static_cast<uint8_t>(Op::kXor) || code(2) > static_cast<uint8_t>(Op::kFull)) {
    return InvalidArgument("{}: unknown op code {} (valid: 1..4)", context(), code(2));
  }
  item.op = static_cast<Op>(code(2));
  const auto last_encoding =
      format_version >= 2 ? LocationEncoding::kContext : LocationEncoding::kBitmask;
  if (code(3) < static_cast<uint8_t>(LocationEncoding::kAll) ||
      code(3) > static_cast<uint8_t>(last_encoding)) {
    return InvalidArgument(
        "{}: unknown location encoding code {} (valid in format version {}: "
        "1..{})",
        context(), code(3), format_version, static_cast<int>(last_encoding));
  }
  item.location_encoding = static_cast<LocationEncoding>(code(3));
  const uint8_t rank = code(4);
  if (rank > limits.max_rank) {
    return ResourceExhausted("{}: rank {} > limit {}", context(), rank, limits.max_rank);
  }
  REFIT_ASSIGN_OR_RETURN(auto dims, reader->Take(uint64_t{rank} * sizeof(int64_t), context));
  item.shape.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    item.shape[d] = LoadLittleEndian<int64_t>(dims.data() + d * sizeof(int64_t));
  }
  REFIT_ASSIGN_OR_RETURN(auto tail, reader->Take(kItemTailBytes, context));
  const auto field = [&](size_t i) {
    return LoadLittleEndian<uint64_t>(tail.data() + i * sizeof(uint64_t));
  };
  item.span_begin = field(0);
  item.span_end = field(1);
  item.count = field(2);
  entry.location_bytes = field(3);
  item.digest = field(4);
  return entry;
}

Status CheckZstdFrame(std::span<const std::byte> compressed, const PayloadHeader& header) {
  const std::string context = PayloadContext(header.ids);
  if (compressed.size() < sizeof(uint32_t) ||
      LoadLittleEndian<uint32_t>(compressed.data()) != ZSTD_MAGICNUMBER) {
    return DataLoss("{}: compressed body is not a zstd frame", context);
  }
  const unsigned long long content_size =
      ZSTD_getFrameContentSize(compressed.data(), compressed.size());
  if (content_size == ZSTD_CONTENTSIZE_ERROR) {
    return DataLoss("{}: invalid zstd frame header", context);
  }
  if (content_size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return DataLoss("{}: zstd frame does not declare its content size", context);
  }
  if (content_size != header.body_bytes) {
    return DataLoss("{}: zstd frame content size {} != body_bytes {}", context, content_size,
                    header.body_bytes);
  }
  const size_t frame_size = ZSTD_findFrameCompressedSize(compressed.data(), compressed.size());
  if (ZSTD_isError(frame_size)) {
    return DataLoss("{}: corrupt zstd frame: {}", context, ZSTD_getErrorName(frame_size));
  }
  if (frame_size != compressed.size()) {
    return DataLoss("{}: zstd frame spans {} of {} compressed bytes", context, frame_size,
                    compressed.size());
  }
  return Status::OK();
}

}  // namespace

// ---- TransferId. -------------------------------------------------------------------------------

TransferId TransferId::Random() {
  TransferId id;
  size_t filled = 0;
  while (filled < id.bytes.size()) {
    const ssize_t n = getrandom(id.bytes.data() + filled, id.bytes.size() - filled, 0);
    if (n > 0) {
      filled += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  if (filled < id.bytes.size()) {
    // getrandom(2) unavailable (old kernel, seccomp): the library's other entropy source.
    std::random_device device;
    for (size_t i = filled; i < id.bytes.size(); ++i) {
      id.bytes[i] = static_cast<uint8_t>(device());
    }
  }
  return id;
}

Result<TransferId> TransferId::FromHex(std::string_view hex) {
  TransferId id;
  if (hex.size() != 2 * id.bytes.size()) {
    return InvalidArgument("transfer id '{}' has {} characters, need {} hex digits",
                           PrintableName(hex), hex.size(), 2 * id.bytes.size());
  }
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < id.bytes.size(); ++i) {
    const int high = nibble(hex[2 * i]);
    const int low = nibble(hex[2 * i + 1]);
    if (high < 0 || low < 0) {
      return InvalidArgument("transfer id '{}' is not hex (character {})", PrintableName(hex),
                             high < 0 ? 2 * i : 2 * i + 1);
    }
    id.bytes[i] = static_cast<uint8_t>(high << 4 | low);
  }
  return id;
}

std::string TransferId::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * bytes.size(), '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 0xF];
  }
  return out;
}

// ---- EncodePayload. ----------------------------------------------------------------------------

uint16_t PayloadFormatVersionFor(std::span<const ItemView> items) {
  for (const ItemView& item : items) {
    if (item.location_encoding == LocationEncoding::kContext) return 2;
  }
  return kPayloadFormatVersionV1;
}

Result<std::vector<std::byte>> EncodePayload(const PayloadIds& ids, std::span<const ItemView> items,
                                             const PayloadEncodeOptions& options) {
  // The encoder never writes what the default decoder would refuse; the default name limit also
  // keeps every name length inside its u16 field.
  constexpr PayloadLimits kLimits;
  static_assert(kLimits.max_name_length <= std::numeric_limits<uint16_t>::max());
  // Formatted only on failure: a successful call formats nothing.
  const auto context = [&ids] { return PayloadContext(ids); };
  if (ids.target_version <= ids.base_version) {
    return InvalidArgument("{}: target_version {} must be > base_version {}", context(),
                           ids.target_version, ids.base_version);
  }
  if (items.size() > kLimits.max_items) {
    return InvalidArgument("{}: {} items > limit {}", context(), items.size(), kLimits.max_items);
  }
  if (options.zstd_level < ZSTD_minCLevel() || options.zstd_level > ZSTD_maxCLevel()) {
    return InvalidArgument("{}: zstd level {} outside [{}, {}]", context(), options.zstd_level,
                           ZSTD_minCLevel(), ZSTD_maxCLevel());
  }
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_RETURN_NOT_OK(CheckEncoderItem(items[i], ids, i, kLimits));
  }
  Status agreement = CheckSameNameAgreement(items, ids);
  if (!agreement.ok()) return Status(StatusCode::kInvalidArgument, agreement.message());
  Result<GroupPlan> planned = PlanGroups(items, ids);
  if (!planned.ok()) return Status(StatusCode::kInvalidArgument, planned.status().message());
  const GroupPlan& plan = *planned;

  // Exact body size, so the body is allocated once. Every term is the size of bytes the caller
  // holds in memory, so the sum cannot overflow.
  uint64_t body_bytes = 0;
  for (const ItemView& item : items) {
    body_bytes += ItemEntryBytes(item) + item.locations.size() + item.values.size();
  }
  body_bytes += plan.groups.size() * kGroupHeaderBytes;
  if (body_bytes > kLimits.max_body_bytes) {
    return InvalidArgument("{}: body of {} bytes > limit {}; split the items over payloads",
                           context(), body_bytes, kLimits.max_body_bytes);
  }

  // An anchor's payload sent raw (FULL items only) stores its body as it is (compression none),
  // which a receiver decodes without copying it: the body is written straight after the header of
  // the payload itself. Any other body is built in scratch, then framed or compressed.
  const bool stored =
      !options.compress && !items.empty() &&
      std::all_of(items.begin(), items.end(), [](const ItemView& item) {
        return item.op == Op::kFull && item.location_encoding == LocationEncoding::kAll;
      });
  if (stored && kPayloadHeaderSize + body_bytes > kLimits.max_payload_bytes) {
    return InvalidArgument("{}: payload of {} bytes > limit {}; split the items over payloads",
                           context(), kPayloadHeaderSize + body_bytes, kLimits.max_payload_bytes);
  }
  EncoderScratch& scratch = ThreadEncoderScratch();
  const ScratchTrim trim(scratch);
  std::vector<std::byte> stored_payload;
  std::vector<std::byte>& body = stored ? stored_payload : scratch.body;
  const size_t body_offset = stored ? kPayloadHeaderSize : 0;
  body.clear();
  body.reserve(body_offset + body_bytes);
  body.resize(body_offset);
  for (const ItemView& item : items) AppendItemEntry(item, &body);
  for (const ItemView& item : items) {
    const auto* locations = reinterpret_cast<const std::byte*>(item.locations.data());
    body.insert(body.end(), locations, locations + item.locations.size());
  }
  std::vector<std::byte>& group_values = scratch.group_values;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const GroupPlan::Group& group = plan.groups[g];
    AppendLE(&body, static_cast<uint8_t>(group.width));
    AppendLE(&body, group.element_count);
    if (!options.byte_planes) {
      for (size_t i = 0; i < items.size(); ++i) {
        if (plan.item_group[i] != g) continue;
        body.insert(body.end(), items[i].values.begin(), items[i].values.end());
      }
      continue;
    }
    group_values.clear();
    group_values.reserve(group.element_count * group.width);
    for (size_t i = 0; i < items.size(); ++i) {
      if (plan.item_group[i] != g) continue;
      group_values.insert(group_values.end(), items[i].values.begin(), items[i].values.end());
    }
    SplitBytePlanes(group_values, group.width, &body);
  }
  REFIT_DCHECK(body.size() == body_offset + body_bytes, "body size differs from its plan");

  const uint16_t flags = options.byte_planes ? kPayloadFlagBytePlanes : 0;
  const uint16_t format_version = PayloadFormatVersionFor(items);
  if (stored) {
    WriteHeader(format_version, ids, flags, kCompressionNone, static_cast<uint32_t>(items.size()),
                body_bytes, std::span<const std::byte>(stored_payload).subspan(kPayloadHeaderSize),
                stored_payload.data());
    return stored_payload;
  }
  if (!options.compress) {
    const uint64_t frame_bytes = RawZstdFrameBytes(body.size());
    if (kPayloadHeaderSize + frame_bytes > kLimits.max_payload_bytes) {
      return InvalidArgument("{}: payload of {} bytes > limit {}; split the items over payloads",
                             context(), kPayloadHeaderSize + frame_bytes,
                             kLimits.max_payload_bytes);
    }
    std::vector<std::byte> payload(kPayloadHeaderSize + frame_bytes);
    WriteRawZstdFrame(body, std::span<std::byte>(payload).subspan(kPayloadHeaderSize));
    WriteHeader(format_version, ids, flags, kCompressionZstd, static_cast<uint32_t>(items.size()),
                body_bytes, std::span<const std::byte>(payload).subspan(kPayloadHeaderSize),
                payload.data());
    return payload;
  }

  ZSTD_CCtx* cctx = ThreadCompressionContext();
  if (cctx == nullptr) return ResourceExhausted("{}: cannot allocate a zstd context", context());
  ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
  // Content size in the frame header lets the decoder bound its allocation before decompressing;
  // zstd's own checksum is redundant with the header's XXH3-128 over the compressed bytes.
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, options.zstd_level);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0);

  // Compressed into scratch, then copied into a payload of exactly its size: the payload is the
  // one allocation per call, and one held in flight pins no compressBound-sized capacity.
  const size_t bound = ZSTD_compressBound(body.size());
  std::byte* compressed_bytes = scratch.compressed.Reserve(bound);
  const size_t compressed = ZSTD_compress2(cctx, compressed_bytes, bound, body.data(), body.size());
  if (ZSTD_isError(compressed)) {
    return Internal("{}: zstd compression failed: {}", context(), ZSTD_getErrorName(compressed));
  }
  if (kPayloadHeaderSize + compressed > kLimits.max_payload_bytes) {
    return InvalidArgument("{}: payload of {} bytes > limit {}; split the items over payloads",
                           context(), kPayloadHeaderSize + compressed, kLimits.max_payload_bytes);
  }
  std::vector<std::byte> payload(kPayloadHeaderSize + compressed);
  std::memcpy(payload.data() + kPayloadHeaderSize, compressed_bytes, compressed);
  WriteHeader(format_version, ids, flags, kCompressionZstd, static_cast<uint32_t>(items.size()),
              body_bytes, std::span<const std::byte>(payload).subspan(kPayloadHeaderSize),
              payload.data());
  return payload;
}

// ---- ValidatePayloadHeader. --------------------------------------------------------------------

Result<uint64_t> PayloadSizeAt(std::span<const std::byte> stream, const PayloadLimits& limits) {
  if (stream.size() < kPayloadHeaderSize) {
    return DataLoss("{} bytes left, shorter than the {}-byte payload header", stream.size(),
                    kPayloadHeaderSize);
  }
  // The length field is only trusted for slicing; ValidatePayloadHeader then checks the header
  // checksum that covers it and every limit.
  const uint64_t compressed = LoadLittleEndian<uint64_t>(stream.data() + kOffsetCompressedBytes);
  if (compressed > stream.size() - kPayloadHeaderSize) {
    return DataLoss("payload declares {} body bytes but only {} follow its header", compressed,
                    stream.size() - kPayloadHeaderSize);
  }
  const uint64_t size = kPayloadHeaderSize + compressed;
  REFIT_RETURN_NOT_OK(ValidatePayloadHeader(stream.first(size), limits));
  return size;
}

Result<PayloadHeader> ValidatePayloadHeader(std::span<const std::byte> payload,
                                            const PayloadLimits& limits) {
  if (payload.size() < kPayloadHeaderSize) {
    return DataLoss("payload of {} bytes is shorter than the {}-byte header", payload.size(),
                    kPayloadHeaderSize);
  }
  const std::byte* h = payload.data();
  if (std::memcmp(h + kOffsetMagic, kMagic.data(), kMagic.size()) != 0) {
    return DataLoss("payload magic {:02x} {:02x} {:02x} {:02x} is not 'RFPL'",
                    std::to_integer<uint8_t>(h[0]), std::to_integer<uint8_t>(h[1]),
                    std::to_integer<uint8_t>(h[2]), std::to_integer<uint8_t>(h[3]));
  }
  // The version decides the header layout, so it is read before the v1 header checksum.
  PayloadHeader header;
  header.format_version = LoadLittleEndian<uint16_t>(h + kOffsetFormatVersion);
  if (header.format_version < kPayloadFormatVersionV1 ||
      header.format_version > kPayloadFormatVersion) {
    return InvalidArgument(
        "payload format version {} is not supported (this decoder reads {} to {})",
        header.format_version, kPayloadFormatVersionV1, kPayloadFormatVersion);
  }
  const uint64_t stored_header_checksum = LoadLittleEndian<uint64_t>(h + kOffsetHeaderChecksum);
  const uint64_t header_checksum = XXH3_64bits(h, kOffsetHeaderChecksum);
  if (stored_header_checksum != header_checksum) {
    return DataLoss("payload header checksum {:016x} != computed {:016x}", stored_header_checksum,
                    header_checksum);
  }
  // From here on the fields are what the producer wrote, so messages can name the payload.
  std::memcpy(header.ids.transfer_id.bytes.data(), h + kOffsetTransferId,
              header.ids.transfer_id.bytes.size());
  header.ids.producer_id = LoadLittleEndian<uint32_t>(h + kOffsetProducerId);
  header.ids.payload_id = LoadLittleEndian<uint32_t>(h + kOffsetPayloadId);
  header.ids.base_version = LoadLittleEndian<uint64_t>(h + kOffsetBaseVersion);
  header.ids.target_version = LoadLittleEndian<uint64_t>(h + kOffsetTargetVersion);
  header.flags = LoadLittleEndian<uint16_t>(h + kOffsetFlags);
  header.item_count = LoadLittleEndian<uint32_t>(h + kOffsetItemCount);
  header.body_bytes = LoadLittleEndian<uint64_t>(h + kOffsetBodyBytes);
  header.compressed_bytes = LoadLittleEndian<uint64_t>(h + kOffsetCompressedBytes);
  std::memcpy(header.checksum.data(), h + kOffsetChecksum, header.checksum.size());
  // Formatted only on failure: the success path allocates nothing.
  auto context = [&] { return PayloadContext(header.ids); };

  if ((header.flags & ~kKnownFlags) != 0) {
    return InvalidArgument("{}: unknown flag bits 0x{:04x}", context(),
                           header.flags & ~kKnownFlags);
  }
  const uint8_t compression = LoadLittleEndian<uint8_t>(h + kOffsetCompression);
  if (compression != kCompressionZstd && compression != kCompressionNone) {
    return InvalidArgument("{}: unsupported compression {} (v1 knows 0 = none, 1 = zstd)",
                           context(), compression);
  }
  header.stored_body = compression == kCompressionNone;
  const uint8_t mac_algorithm = LoadLittleEndian<uint8_t>(h + kOffsetMacAlgorithm);
  if (mac_algorithm != kMacNone) {
    return InvalidArgument("{}: unsupported MAC algorithm {} (v1 knows 0 = none)", context(),
                           mac_algorithm);
  }
  const uint16_t reserved = LoadLittleEndian<uint16_t>(h + kOffsetReserved);
  if (reserved != 0) {
    return InvalidArgument("{}: reserved field is 0x{:04x}, must be 0", context(), reserved);
  }
  for (size_t i = 0; i < kMacSize; ++i) {
    if (h[kOffsetMac + i] != std::byte{0}) {
      return InvalidArgument("{}: MAC byte {} is nonzero without a MAC algorithm", context(), i);
    }
  }
  if (header.ids.target_version <= header.ids.base_version) {
    return DataLoss("{}: target_version {} <= base_version {}", context(),
                    header.ids.target_version, header.ids.base_version);
  }
  if (payload.size() > limits.max_payload_bytes) {
    return ResourceExhausted("{}: payload of {} bytes (compressed body {}) > limit {}", context(),
                             payload.size(), header.compressed_bytes, limits.max_payload_bytes);
  }
  REFIT_RETURN_NOT_OK(CheckPayloadLimits(header, limits));
  if (header.compressed_bytes != payload.size() - kPayloadHeaderSize) {
    return DataLoss("{}: compressed_bytes {} but {} bytes follow the header ({})", context(),
                    header.compressed_bytes, payload.size() - kPayloadHeaderSize,
                    header.compressed_bytes > payload.size() - kPayloadHeaderSize
                        ? "truncated"
                        : "trailing bytes");
  }
  if (header.stored_body && header.compressed_bytes != header.body_bytes) {
    return DataLoss("{}: a stored body (compression 0) of {} bytes declares body_bytes {}",
                    context(), header.compressed_bytes, header.body_bytes);
  }
  if (header.item_count > header.body_bytes / kMinItemEntryBytes) {
    return DataLoss("{}: {} items cannot fit a body of {} bytes ({} bytes per item at least)",
                    context(), header.item_count, header.body_bytes, kMinItemEntryBytes);
  }
  return header;
}

Status CheckPayloadLimits(const PayloadHeader& header, const PayloadLimits& limits) {
  auto context = [&] { return PayloadContext(header.ids); };
  if (header.item_count > limits.max_items) {
    return ResourceExhausted("{}: {} items > limit {}", context(), header.item_count,
                             limits.max_items);
  }
  if (header.body_bytes > limits.max_body_bytes) {
    return ResourceExhausted("{}: body_bytes {} > limit {}", context(), header.body_bytes,
                             limits.max_body_bytes);
  }
  const uint64_t max_compressed_bytes =
      limits.max_payload_bytes - std::min<uint64_t>(limits.max_payload_bytes, kPayloadHeaderSize);
  if (header.compressed_bytes > max_compressed_bytes) {
    return ResourceExhausted("{}: compressed body of {} bytes > limit {} on the whole payload",
                             context(), header.compressed_bytes, limits.max_payload_bytes);
  }
  return Status::OK();
}

Result<ValidatedPayload> ValidatePayload(std::vector<std::byte> payload,
                                         const PayloadLimits& limits) {
  REFIT_ASSIGN_OR_RETURN(const PayloadHeader header, ValidatePayloadHeader(payload, limits));
  return ValidatedPayload(header, std::move(payload));
}

Result<ValidatedPayload> ValidatePayload(std::span<const std::byte> payload,
                                         const PayloadLimits& limits) {
  REFIT_ASSIGN_OR_RETURN(const PayloadHeader header, ValidatePayloadHeader(payload, limits));
  return ValidatedPayload(header, std::vector<std::byte>(payload.begin(), payload.end()));
}

// ---- DecodePayload. ----------------------------------------------------------------------------

Result<DecodedPayload> DecodePayload(std::span<const std::byte> payload,
                                     const PayloadLimits& limits) {
  REFIT_ASSIGN_OR_RETURN(const PayloadHeader header, ValidatePayloadHeader(payload, limits));
  return DecodedPayload::DecodeBody(header, payload.subspan(kPayloadHeaderSize), limits);
}

Result<DecodedPayload> DecodePayload(const ValidatedPayload& payload, const PayloadLimits& limits) {
  REFIT_RETURN_NOT_OK(CheckPayloadLimits(payload.header(), limits));
  return DecodedPayload::DecodeBody(payload.header(), payload.bytes().subspan(kPayloadHeaderSize),
                                    limits);
}

Result<DecodedPayload> DecodePayload(ValidatedPayload&& payload, const PayloadLimits& limits) {
  REFIT_RETURN_NOT_OK(CheckPayloadLimits(payload.header(), limits));
  if (!payload.header().stored_body) {
    return DecodedPayload::DecodeBody(payload.header(), payload.bytes().subspan(kPayloadHeaderSize),
                                      limits);
  }
  std::vector<std::byte> bytes = std::move(payload.bytes_);
  return DecodedPayload::DecodeBody(payload.header(),
                                    std::span<const std::byte>(bytes).subspan(kPayloadHeaderSize),
                                    limits, &bytes);
}

Result<DecodedPayload> DecodedPayload::DecodeBody(const PayloadHeader& header,
                                                  std::span<const std::byte> compressed,
                                                  const PayloadLimits& limits,
                                                  std::vector<std::byte>* payload_bytes) {
  DecodedPayload decoded;
  decoded.header_ = header;
  const PayloadIds& ids = header.ids;
  const std::string context = PayloadContext(ids);

  // Checksum first: nothing of a corrupt body reaches the decompressor.
  const std::array<uint8_t, 16> checksum = ChecksumBytes(compressed);
  if (checksum != header.checksum) {
    return DataLoss("{}: body checksum {} != computed {}", context, HexBytes(header.checksum),
                    HexBytes(checksum));
  }
  std::span<std::byte> body;
  if (header.stored_body) {
    // The body as it is (ValidatePayloadHeader checked its size): taken over with the payload's
    // bytes when the caller hands them over, else copied once.
    if (payload_bytes != nullptr) {
      decoded.body_ = std::make_unique<std::vector<std::byte>>(std::move(*payload_bytes));
      body = std::span<std::byte>(*decoded.body_).subspan(kPayloadHeaderSize);
    } else {
      decoded.body_ =
          std::make_unique<std::vector<std::byte>>(compressed.begin(), compressed.end());
      body = std::span<std::byte>(*decoded.body_);
    }
  } else {
    // The frame must declare exactly body_bytes (bounded by the limits) before we allocate it.
    REFIT_RETURN_NOT_OK(CheckZstdFrame(compressed, header));
    decoded.body_ = std::make_unique<std::vector<std::byte>>(header.body_bytes);
    body = std::span<std::byte>(*decoded.body_);
    ZSTD_DCtx* dctx = ThreadDecompressionContext();
    if (dctx == nullptr) return ResourceExhausted("{}: cannot allocate a zstd context", context);
    ZSTD_DCtx_reset(dctx, ZSTD_reset_session_and_parameters);
    const size_t decompressed =
        ZSTD_decompressDCtx(dctx, body.data(), body.size(), compressed.data(), compressed.size());
    if (ZSTD_isError(decompressed)) {
      return DataLoss("{}: zstd decompression failed: {}", context,
                      ZSTD_getErrorName(decompressed));
    }
    if (decompressed != header.body_bytes) {
      return DataLoss("{}: body decompressed to {} bytes, header says {}", context, decompressed,
                      header.body_bytes);
    }
  }

  // Item table.
  BodyReader reader(body);
  std::vector<uint64_t> location_bytes;
  location_bytes.reserve(header.item_count);
  decoded.items_.reserve(header.item_count);
  for (size_t i = 0; i < header.item_count; ++i) {
    REFIT_ASSIGN_OR_RETURN(ParsedEntry entry,
                           ParseItemEntry(&reader, ids, i, limits, header.format_version));
    Result<uint64_t> numel = NumElements(entry.view.shape);
    if (!numel.ok()) {
      return DataLoss("{}: {}", ItemContext(ids, i, entry.view.name), numel.status().message());
    }
    REFIT_RETURN_NOT_OK(CheckItemRules(entry.view, *numel, limits, ids, i, header.format_version));
    location_bytes.push_back(entry.location_bytes);
    decoded.items_.push_back(std::move(entry.view));
  }
  std::span<ItemView> items(decoded.items_);
  REFIT_RETURN_NOT_OK(CheckSameNameAgreement(items, ids));
  if (header.stored_body) {
    // A stored body is an anchor's: its bytes are never kept to undo an XOR item with.
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].op != Op::kFull || items[i].location_encoding != LocationEncoding::kAll) {
        return DataLoss("{}: a stored body (compression 0) carries only FULL items",
                        ItemContext(ids, i, items[i].name));
      }
    }
  }

  // Location section: each item's bytes in item order.
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].location_encoding == LocationEncoding::kAll && location_bytes[i] != 0) {
      return DataLoss("{}: location encoding all with {} location bytes",
                      ItemContext(ids, i, items[i].name), location_bytes[i]);
    }
    auto where = [&] { return ItemContext(ids, i, items[i].name) + " locations"; };
    REFIT_ASSIGN_OR_RETURN(auto locations, reader.Take(location_bytes[i], where));
    items[i].locations = std::span<const uint8_t>(
        reinterpret_cast<const uint8_t*>(locations.data()), locations.size());
  }

  // Value groups: their headers must match what the item table implies.
  REFIT_ASSIGN_OR_RETURN(GroupPlan plan, PlanGroups(items, ids));
  std::vector<size_t> group_offset(plan.groups.size());
  uint64_t largest_group_bytes = 0;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const GroupPlan::Group& group = plan.groups[g];
    auto where = [&] { return fmt::format("{}: value group {}", context, g); };
    REFIT_ASSIGN_OR_RETURN(uint8_t width, reader.Read<uint8_t>(where));
    REFIT_ASSIGN_OR_RETURN(uint64_t element_count, reader.Read<uint64_t>(where));
    if (width != group.width || element_count != group.element_count) {
      return DataLoss("{} declares width {} × {} elements; the item table implies {} × {}", where(),
                      width, element_count, group.width, group.element_count);
    }
    if (element_count > reader.remaining() / width) {
      return DataLoss("{}: {} elements of {} bytes exceed the {} bytes left in the body", where(),
                      element_count, width, reader.remaining());
    }
    group_offset[g] = reader.position();
    const uint64_t group_bytes = element_count * width;
    if (width > 1) largest_group_bytes = std::max(largest_group_bytes, group_bytes);
    REFIT_RETURN_NOT_OK(reader.Take(group_bytes, where).status());
  }
  if (reader.remaining() != 0) {
    return DataLoss("{}: {} trailing bytes after the last value group at body offset {}", context,
                    reader.remaining(), reader.position());
  }

  // Every structure is consistent; now the O(count) checks of each item's locations.
  decoded.marks_.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_RETURN_NOT_OK(ValidateLocations(items[i], ids, i, &decoded.marks_[i]));
  }

  // Join byte planes in place (through one scratch buffer), then point each item at its values.
  if ((header.flags & kPayloadFlagBytePlanes) != 0) {
    std::vector<std::byte> joined(largest_group_bytes);
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      const uint32_t width = plan.groups[g].width;
      const size_t group_bytes = plan.groups[g].element_count * width;
      if (width == 1 || group_bytes == 0) continue;  // One plane is the values themselves.
      std::span<std::byte> planes(body.data() + group_offset[g], group_bytes);
      JoinBytePlanes(planes, width, std::span<std::byte>(joined.data(), group_bytes));
      std::memcpy(planes.data(), joined.data(), group_bytes);
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t g = plan.item_group[i];
    const uint32_t width = plan.groups[g].width;
    items[i].values = std::span<const std::byte>(
        body.data() + group_offset[g] + plan.item_first_element[i] * width,
        WireValueCount(items[i]) * width);
  }
  return decoded;
}

bool DecodedPayload::has_context_items() const { return PayloadFormatVersionFor(items_) >= 2; }

Result<DecodedPayload> ExpandContextItems(const DecodedPayload& payload,
                                          const OldSpanReader& read_old) {
  DecodedPayload out;
  out.header_ = payload.header_;
  out.marks_ = payload.marks_;
  out.items_ = payload.items_;
  // The other items keep viewing the body: a copy of it, views moved to the copy.
  out.body_ = std::make_unique<std::vector<std::byte>>(*payload.body_);
  const auto* old_begin = reinterpret_cast<const uint8_t*>(payload.body_->data());
  const auto* old_end = old_begin + payload.body_->size();
  const auto* new_begin = reinterpret_cast<const uint8_t*>(out.body_->data());
  auto moved = [&](const void* p) {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= old_begin && b <= old_end ? new_begin + (b - old_begin) : b;
  };
  for (ItemView& item : out.items_) {
    item.name =
        std::string_view(reinterpret_cast<const char*>(moved(item.name.data())), item.name.size());
    item.locations = std::span<const uint8_t>(moved(item.locations.data()), item.locations.size());
    item.values = std::span<const std::byte>(
        reinterpret_cast<const std::byte*>(moved(item.values.data())), item.values.size());
  }
  const PayloadIds& ids = payload.header_.ids;
  std::vector<std::byte> old_span;
  for (size_t i = 0; i < out.items_.size(); ++i) {
    const ItemView& coded = out.items_[i];
    if (coded.location_encoding != LocationEncoding::kContext) continue;
    const auto context = [&] { return ItemContext(ids, i, coded.name); };
    const uint32_t width = DTypeSize(coded.dtype);
    old_span.resize((coded.span_end - coded.span_begin) * width);
    Result<bool> held = read_old(coded, old_span);
    if (!held.ok()) return held.status().WithContext(context() + " old span");
    if (!*held) continue;
    Result<internal::ContextDecoded> decoded =
        internal::DecodeContextCoded(coded.dtype, old_span, coded.locations, coded.count);
    if (!decoded.ok()) return decoded.status().WithContext(context());
    auto plain = std::make_unique<Item>();
    plain->name = std::string(coded.name);
    plain->dtype = coded.dtype;
    plain->shape = coded.shape;
    plain->op = Op::kXor;
    plain->value_dtype = coded.value_dtype;
    plain->span_begin = coded.span_begin;
    plain->span_end = coded.span_end;
    plain->count = coded.count;
    plain->digest = coded.digest;
    std::vector<uint64_t>& locations = decoded->locations;
    for (uint64_t& location : locations) location += coded.span_begin;
    REFIT_ASSIGN_OR_RETURN(plain->location_encoding,
                           ChooseAndEncodeLocations(locations, plain->span_begin, plain->span_end,
                                                    std::nullopt, &plain->locations));
    plain->values = std::move(decoded->xor_values);
    out.items_[i] = plain->view();
    out.marks_[i].clear();
    REFIT_RETURN_NOT_OK(ValidateLocations(out.items_[i], ids, i, &out.marks_[i]));
    out.expanded_.push_back(std::move(plain));
  }
  return out;
}

}  // namespace refit
