// Context-coded deltas (see context_coding.h and docs/format/context-coding.md).

#include "codec/context_coding.h"

#include <htscodecs/arith_dynamic.h>
#include <htscodecs/rANS_static4x16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "codec/context_kernels.h"
#include "refit/status_format.h"
#include "util/check.h"

namespace refit::internal {
namespace {

/// Version byte of the layout; the only one this decoder reads.
constexpr uint8_t kLayoutVersion = 1;
/// Largest span an item may context-code: keeps every count and bit offset far from overflow,
/// and a span that large is a 2 TB bf16 tensor.
constexpr uint64_t kMaxSpan = uint64_t{1} << 40;
/// Low-plane symbols the encoder's size model tells apart (differences of 63 or more share one
/// bin); enough to separate the 1-ulp classes from the many-ulp ones.
constexpr uint32_t kModelSymbols = 64;
/// Blocks of class masks computed per kernel call: 256 KiB of old bf16 per call at most.
constexpr uint64_t kBlocksPerBatch = 2048;
/// Spans of this many elements or more sample one element in kSampleStride for the class choice:
/// the exponent histogram was most of the encoder's time, and the choice's size model moved by
/// under 0.1 % on the step pairs of bench/context_bench.cc.
constexpr uint64_t kSampleAbove = uint64_t{1} << 16;
constexpr uint64_t kSampleStride = 8;
/// Golomb split of the mask's gaps: quotients of mean about 2^kQuotientMeanBits go through the
/// entropy coder as byte symbols; kQuotientEscape and a varint carry the rare larger ones. Mean 4:
/// a small alphabet for the adaptive coder to learn on small streams (mean 16 cost 1–2 % more on
/// bench/context_bench.cc's torch pairs, mean 2 no less).
constexpr uint32_t kQuotientMeanBits = 2;
constexpr uint8_t kQuotientEscape = 255;
/// A span below 2^40 elements has gaps below 2^40.
constexpr uint32_t kMaxGapShift = 40;
/// Most candidate boundary bins of the class choice's dynamic programme.
constexpr size_t kMaxChoiceBins = 64;
/// The longest LEB128 varint of a 64-bit value.
constexpr uint64_t kMaxVarintBytes = 10;
/// Fixed per-class cost estimate in bytes: two varints of counts, a threshold, and the headers of
/// its streams (a small stream's arithmetic coding costs ~6 bytes over its entropy, a large
/// stream's rANS table and states 20–60). One value plane is counted (the low one: the others of
/// small steps are all zero and cost a byte). Tuned on the step pairs of bench/context_bench.cc
/// (sizes within 0.5 % over a 2x range of these constants).
constexpr double kClassBytes = 6;
constexpr double kMaskStreamBytes = 12;
constexpr double kPlaneStreamBytes = 10;

// htscodecs' order byte: the only flags this decoder accepts besides the order bit (the
// arithmetic coder uses the same bit for stored bytes).
constexpr int kRansOrderCat = RANS_ORDER_CAT;
// Streams longer than this go through rANS only: the adaptive arithmetic decoder runs at a
// fraction of rANS's speed, and its saving (the table and states, ~20–60 bytes) shrinks with the
// stream. 1024 against 4096: ~1 % more bytes, ~10 % faster decode on bench/context_bench.cc.
constexpr size_t kMaxArithSymbols = 1024;
// The method byte before each stream.
constexpr uint8_t kStreamRans = 0;
constexpr uint8_t kStreamArith = 1;

uint32_t MantissaBits(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 7;
    case DType::kFloat16:
      return 10;
    case DType::kFloat32:
      return 23;
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E4M3FNUZ:
      return 3;
    case DType::kFloat8E5M2:
    case DType::kFloat8E5M2FNUZ:
      return 2;
    default:
      return 0;
  }
}

// A fixed-size memcpy per width: a variable-size one is a library call.
uint64_t LoadElement(const std::byte* base, uint32_t width, uint64_t index) {
  const std::byte* at = base + index * width;
  switch (width) {
    case 1:
      return std::to_integer<uint64_t>(*at);
    case 2: {
      uint16_t v;
      std::memcpy(&v, at, 2);
      return v;
    }
    default: {
      uint32_t v;
      std::memcpy(&v, at, 4);
      return v;
    }
  }
}

void StoreElement(std::byte* base, uint32_t width, uint64_t index, uint64_t bits) {
  std::byte* at = base + index * width;
  switch (width) {
    case 1:
      *at = static_cast<std::byte>(bits);
      return;
    case 2: {
      const auto v = static_cast<uint16_t>(bits);
      std::memcpy(at, &v, 2);
      return;
    }
    default: {
      const auto v = static_cast<uint32_t>(bits);
      std::memcpy(at, &v, 4);
      return;
    }
  }
}

uint64_t WidthMask(uint32_t width) {
  return width == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
}

// Zig-zag the w-byte two's complement difference new − old: small steps either way are small.
uint64_t ZigZag(uint64_t difference, uint32_t width) {
  const uint32_t bits = 8 * width;
  const uint64_t mask = WidthMask(width);
  const uint64_t sign = (difference >> (bits - 1)) & 1;
  return ((difference << 1) ^ (sign ? mask : 0)) & mask;
}

uint64_t UnZigZag(uint64_t zigzag, uint32_t width) {
  const uint64_t mask = WidthMask(width);
  return ((zigzag >> 1) ^ ((zigzag & 1) ? mask : 0)) & mask;
}

void PutVarint(uint64_t value, std::vector<uint8_t>* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<uint8_t>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<uint8_t>(value));
}

// Read a minimal LEB128 varint; false on truncation, overlength or a non-minimal encoding.
bool GetVarint(std::span<const uint8_t> bytes, uint64_t* position, uint64_t* value) {
  uint64_t result = 0;
  for (uint32_t i = 0; i < kMaxVarintBytes; ++i) {
    if (*position >= bytes.size()) return false;
    const uint8_t byte = bytes[(*position)++];
    if (i == kMaxVarintBytes - 1 && byte > 1) return false;
    result |= static_cast<uint64_t>(byte & 0x7F) << (7 * i);
    if ((byte & 0x80) == 0) {
      if (i > 0 && byte == 0) return false;
      *value = result;
      return true;
    }
  }
  return false;
}

// Compress one stream with the smaller of htscodecs' static rANS (4×16, order 0) and its
// adaptive arithmetic coder (order 0; streams of up to kMaxArithSymbols), behind a method byte.
// The arithmetic coder has no frequency table and a 4-byte flush where rANS stores a table and
// four 4-byte states: it wins the small streams of small classes, rANS the large ones (and
// decodes faster). Either stores the bytes instead when coding saves nothing. Empty in, empty
// out.
Result<std::vector<uint8_t>> CompressStream(std::span<const uint8_t> raw) {
  std::vector<uint8_t> best;
  if (raw.empty()) return best;
  if (raw.size() > std::numeric_limits<int32_t>::max() / 2) {
    return InvalidArgument("context coding: a stream of {} bytes is over the coder's limit",
                           raw.size());
  }
  const auto size = static_cast<unsigned int>(raw.size());
  // Order 0 only: order 1 never came out smaller on the step pairs of bench/context_bench.cc (the
  // class split already took the context out of the streams), and it cost 2.5× the encode time
  // and a 256-table setup per stream on decode.
  constexpr int kOrder = 0;
  for (uint8_t method : {kStreamRans, kStreamArith}) {
    if (method == kStreamArith && raw.size() > kMaxArithSymbols) break;
    unsigned int out_size = method == kStreamRans ? rans_compress_bound_4x16(size, kOrder)
                                                  : arith_compress_bound(size, kOrder);
    std::vector<uint8_t> out(1 + out_size);
    out[0] = method;
    // htscodecs takes non-const input pointers; it does not write through them.
    auto* in = const_cast<uint8_t*>(raw.data());
    const unsigned char* done =
        method == kStreamRans ? rans_compress_to_4x16(in, size, out.data() + 1, &out_size, kOrder)
                              : arith_compress_to(in, size, out.data() + 1, &out_size, kOrder);
    if (done == nullptr) {
      return Status(StatusCode::kInternal, "context coding: entropy coding of a stream failed");
    }
    out.resize(1 + out_size);
    if (best.empty() || out.size() < best.size()) best = std::move(out);
  }
  return best;
}

// Decompress an untrusted stream into exactly out.size() bytes.
Status DecompressStream(std::span<const uint8_t> stream, std::span<uint8_t> out, const char* what,
                        uint32_t klass) {
  if (out.empty()) {
    if (!stream.empty()) {
      return DataLoss("context-coded {} stream of class {}: {} bytes for no symbols", what, klass,
                      stream.size());
    }
    return Status::OK();
  }
  if (stream.size() < 2) {
    return DataLoss("context-coded {} stream of class {}: {} bytes, {} symbols expected", what,
                    klass, stream.size(), out.size());
  }
  const uint8_t method = stream[0];
  const int order_byte = stream[1];
  if (method > kStreamArith || (order_byte & ~(1 | kRansOrderCat)) != 0) {
    return DataLoss(
        "context-coded {} stream of class {}: method {} with order byte 0x{:02x} is not one "
        "this decoder accepts (rANS 0 or arithmetic 1, order 0/1 or stored)",
        what, klass, method, order_byte);
  }
  if (stream.size() > std::numeric_limits<int32_t>::max() ||
      out.size() > std::numeric_limits<int32_t>::max()) {
    return DataLoss(
        "context-coded {} stream of class {}: {} bytes, {} symbols: over the coder's "
        "limit",
        what, klass, stream.size(), out.size());
  }
  auto out_size = static_cast<unsigned int>(out.size());
  auto* in = const_cast<uint8_t*>(stream.data() + 1);
  const auto in_size = static_cast<unsigned int>(stream.size() - 1);
  const unsigned char* decoded = method == kStreamRans
                                     ? rans_uncompress_to_4x16(in, in_size, out.data(), &out_size)
                                     : arith_uncompress_to(in, in_size, out.data(), &out_size);
  if (decoded == nullptr || out_size != out.size()) {
    return DataLoss(
        "context-coded {} stream of class {}: corrupt stream of {} bytes ({} "
        "symbols expected)",
        what, klass, stream.size(), out.size());
  }
  return Status::OK();
}

// The magnitude bits of an element: its sign cleared.
uint32_t Magnitude(uint64_t bits, uint32_t width) {
  return static_cast<uint32_t>(bits & (WidthMask(width) >> 1));
}

// Population count without the popcnt instruction this translation unit may not assume (the
// hot loops get theirs from the SIMD kernel); for the O(changes) paths.
uint32_t PopCount(uint64_t x) {
  x -= (x >> 1) & 0x5555555555555555ULL;
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
  return static_cast<uint32_t>((x * 0x0101010101010101ULL) >> 56);
}

// The low `count` ≤ 40 bits of `value` into `bytes` from bit `position`, LSB first. The bits
// there are zero.
void WriteBits(uint64_t value, uint32_t count, uint64_t position, std::span<uint8_t> bytes) {
  value &= (uint64_t{1} << count) - 1;
  for (uint64_t at = position / 8; count != 0 && at < bytes.size(); ++at) {
    const uint32_t offset = at == position / 8 ? position % 8 : 0;
    bytes[at] |= static_cast<uint8_t>(value << offset);
    const uint32_t taken = std::min<uint32_t>(count, 8 - offset);
    value >>= taken;
    count -= taken;
  }
}

// Read `count` ≤ 40 bits from `bytes` at bit `position`, LSB first. Precondition: they lie within
// `bytes`.
uint64_t ReadBits(std::span<const uint8_t> bytes, uint64_t position, uint32_t count) {
  if (count == 0) return 0;
  const uint64_t first = position / 8;
  const uint64_t last = (position + count - 1) / 8;
  uint64_t window = 0;
  for (uint64_t at = first; at <= last; ++at) window |= uint64_t{bytes[at]} << (8 * (at - first));
  return (window >> (position % 8)) & ((uint64_t{1} << count) - 1);
}

// The class of a magnitude: the number of thresholds at or below it. Branch-free, since the class
// of consecutive changes is as unpredictable as the data.
uint32_t ClassOf(uint32_t magnitude, std::span<const uint32_t> thresholds) {
  uint32_t c = 0;
  for (uint32_t t : thresholds) c += static_cast<uint32_t>(magnitude >= t);
  return c;
}

// Walks the span's blocks of 64 elements and hands each block's class masks and their counts to
// `visit` (block index, masks, counts): SIMD for whole blocks, one element at a time for the
// tail, whose masks hold only the span's elements.
template <typename Visit>
void ForEachBlock(const std::byte* old, uint32_t width, uint64_t span_length,
                  std::span<const uint32_t> thresholds, Visit&& visit) {
  const uint32_t classes = static_cast<uint32_t>(thresholds.size()) + 1;
  const uint32_t threshold_count = classes - 1;
  const uint64_t whole = span_length / kContextBlock;
  if (threshold_count == 0) {
    const uint64_t all = ~uint64_t{0};
    const uint8_t full = kContextBlock;
    for (uint64_t block = 0; block < whole; ++block) visit(block, &all, &full);
  } else {
    const uint64_t batch = std::min(whole, kBlocksPerBatch);
    std::vector<uint64_t> masks(batch * classes);
    std::vector<uint8_t> counts(batch * classes);
    for (uint64_t first = 0; first < whole; first += kBlocksPerBatch) {
      const uint64_t blocks = std::min(kBlocksPerBatch, whole - first);
      ContextClassMasks(old + first * kContextBlock * width, width, blocks, thresholds.data(),
                        threshold_count, masks.data(), counts.data());
      for (uint64_t b = 0; b < blocks; ++b) {
        visit(first + b, masks.data() + b * classes, counts.data() + b * classes);
      }
    }
  }
  const uint64_t tail = span_length - whole * kContextBlock;
  if (tail == 0) return;
  uint64_t tail_masks[kMaxContextThresholds + 1] = {};
  uint8_t tail_counts[kMaxContextThresholds + 1] = {};
  for (uint64_t i = 0; i < tail; ++i) {
    const uint32_t magnitude = Magnitude(LoadElement(old, width, whole * kContextBlock + i), width);
    uint32_t c = 0;
    while (c < threshold_count && magnitude >= thresholds[c]) ++c;
    tail_masks[c] |= uint64_t{1} << i;
    ++tail_counts[c];
  }
  visit(whole, tail_masks, tail_counts);
}

// Count the elements of each exponent (magnitude >> mantissa_bits) into `members` (sized to the
// exponent range), every `stride`-th element, each counting for `stride`. Four sub-histograms:
// consecutive elements often share an exponent, and one counter would serialise on it.
template <typename T>
void ExponentHistogram(const std::byte* old, uint64_t span_length, uint64_t stride,
                       uint32_t mantissa_bits, std::vector<uint64_t>* members) {
  const uint64_t bins = members->size();
  std::vector<uint64_t> sub(4 * bins);
  constexpr T kMagnitude = static_cast<T>(~T{0}) >> 1;
  const auto load = [&](uint64_t index) {
    T v;
    std::memcpy(&v, old + index * sizeof(T), sizeof(T));
    return static_cast<uint64_t>((v & kMagnitude) >> mantissa_bits);
  };
  uint64_t i = 0;
  for (; i + 4 * stride <= span_length; i += 4 * stride) {
    ++sub[load(i)];
    ++sub[bins + load(i + stride)];
    ++sub[2 * bins + load(i + 2 * stride)];
    ++sub[3 * bins + load(i + 3 * stride)];
  }
  for (; i < span_length; i += stride) ++sub[load(i)];
  for (uint64_t e = 0; e < bins; ++e) {
    (*members)[e] = stride * (sub[e] + sub[bins + e] + sub[2 * bins + e] + sub[3 * bins + e]);
  }
}

double BinaryEntropyBits(double n, double k) {
  if (k <= 0 || k >= n) return 0;
  const double p = k / n;
  return -n * (p * std::log2(p) + (1 - p) * std::log2(1 - p));
}

struct ExponentStats {
  std::vector<uint64_t> members;  // per exponent bin
  std::vector<uint64_t> changes;  // per exponent bin
  std::vector<uint64_t> symbols;  // per bin × kModelSymbols: low-plane symbol counts
};

// Choose class thresholds over the exponents present: a K-segment partition of the sorted
// present exponents minimising the modelled size (ideal mask bits + order-0 value bits +
// per-class overheads), K ≤ max_classes. Exact dynamic programme, O(K · D²) for D present
// exponents (≤ 256).
std::vector<uint32_t> ChooseThresholds(const ExponentStats& stats, uint32_t mantissa_bits,
                                       uint32_t width, uint32_t max_classes) {
  // Candidate boundaries: the exponents present, grouped into at most kMaxChoiceBins runs of
  // consecutive ones (weights span ~40 exponents; uniformly random bits span all 256, where
  // the O(K · D²) programme would cost more than the pass over the span).
  std::vector<uint32_t> exponents;
  for (uint32_t e = 0; e < stats.members.size(); ++e) {
    if (stats.members[e] > 0) exponents.push_back(e);
  }
  const size_t group = (exponents.size() + kMaxChoiceBins - 1) / kMaxChoiceBins;
  // present[i]: the first exponent of bin i; a bin's statistics sum its exponents'.
  std::vector<uint32_t> present;
  std::vector<std::pair<size_t, size_t>> bin_exponents;
  for (size_t i = 0; i < exponents.size(); i += std::max<size_t>(group, 1)) {
    present.push_back(exponents[i]);
    bin_exponents.emplace_back(i, std::min(exponents.size(), i + group));
  }
  const size_t d = present.size();
  if (d <= 1 || max_classes <= 1) return {};
  // Prefix sums over the bins.
  std::vector<uint64_t> pm(d + 1), pk(d + 1), ps((d + 1) * kModelSymbols);
  for (size_t i = 0; i < d; ++i) {
    pm[i + 1] = pm[i];
    pk[i + 1] = pk[i];
    for (uint32_t s = 0; s < kModelSymbols; ++s) {
      ps[(i + 1) * kModelSymbols + s] = ps[i * kModelSymbols + s];
    }
    for (size_t x = bin_exponents[i].first; x < bin_exponents[i].second; ++x) {
      const uint32_t e = exponents[x];
      pm[i + 1] += stats.members[e];
      pk[i + 1] += stats.changes[e];
      for (uint32_t s = 0; s < kModelSymbols; ++s) {
        ps[(i + 1) * kModelSymbols + s] += stats.symbols[uint64_t{e} * kModelSymbols + s];
      }
    }
  }
  auto cost = [&](size_t a, size_t b) {
    const double n = static_cast<double>(pm[b] - pm[a]);
    const double k = static_cast<double>(pk[b] - pk[a]);
    double bits = BinaryEntropyBits(n, k) + 8 * kClassBytes;
    if (k > 0 && k < n) bits += 8 * kMaskStreamBytes;
    if (k > 0) {
      bits += 8 * (kPlaneStreamBytes + width - 1);
      for (uint32_t s = 0; s < kModelSymbols; ++s) {
        const double c = static_cast<double>(ps[b * kModelSymbols + s] - ps[a * kModelSymbols + s]);
        if (c > 0) bits += -c * std::log2(c / k) + 8;  // + a byte of frequency table
      }
    }
    return bits;
  };
  const size_t max_k = std::min<size_t>(max_classes, d);
  std::vector<double> table(d * (d + 1));
  for (size_t a = 0; a < d; ++a) {
    for (size_t b = a + 1; b <= d; ++b) table[a * (d + 1) + b] = cost(a, b);
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // best[k][j]: k segments covering present[0, j); from[k][j]: start of the last segment.
  std::vector<std::vector<double>> best(max_k + 1, std::vector<double>(d + 1, kInf));
  std::vector<std::vector<size_t>> from(max_k + 1, std::vector<size_t>(d + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= max_k; ++k) {
    for (size_t j = k; j <= d; ++j) {
      for (size_t i = k - 1; i < j; ++i) {
        if (best[k - 1][i] == kInf) continue;
        const double candidate = best[k - 1][i] + table[i * (d + 1) + j];
        if (candidate < best[k][j]) {
          best[k][j] = candidate;
          from[k][j] = i;
        }
      }
    }
  }
  size_t best_k = 1;
  for (size_t k = 2; k <= max_k; ++k) {
    if (best[k][d] < best[best_k][d]) best_k = k;
  }
  std::vector<uint32_t> thresholds;
  for (size_t k = best_k, j = d; k > 1; --k) {
    j = from[k][j];
    thresholds.push_back(present[j] << mantissa_bits);
  }
  std::reverse(thresholds.begin(), thresholds.end());
  return thresholds;
}

/// The fixed fields at the start of the layout, checked against what the item declares.
struct Preamble {
  uint32_t classes = 0;
  uint64_t count = 0;
  /// Where the thresholds begin.
  uint64_t end = 0;
};

Result<Preamble> ParsePreamble(DType dtype, uint64_t span_length, std::span<const uint8_t> bytes,
                               uint64_t expected_count) {
  if (bytes.size() < 4) {
    return DataLoss("context-coded changes: {} bytes, shorter than the 4-byte preamble",
                    bytes.size());
  }
  if (bytes[0] != kLayoutVersion) {
    return InvalidArgument("context-coded changes: layout version {} (this decoder reads {})",
                           bytes[0], kLayoutVersion);
  }
  if (bytes[1] != static_cast<uint8_t>(dtype)) {
    return DataLoss("context-coded changes: dtype code {} for a {} tensor", bytes[1],
                    DTypeName(dtype));
  }
  const uint32_t classes = bytes[2];
  if (classes < 1 || classes > kMaxContextThresholds + 1) {
    return DataLoss("context-coded changes: {} classes (1 to {} allowed)", classes,
                    kMaxContextThresholds + 1);
  }
  if (bytes[3] != 0) {
    return InvalidArgument("context-coded changes: reserved byte is {}", bytes[3]);
  }
  Preamble preamble;
  uint64_t position = 4;
  auto read = [&](const char* field, uint64_t* value) -> Status {
    if (!GetVarint(bytes, &position, value)) {
      return DataLoss("context-coded changes: {} at byte {}: truncated or malformed varint", field,
                      position);
    }
    return Status::OK();
  };
  uint64_t declared_span = 0;
  uint64_t count = 0;
  REFIT_RETURN_NOT_OK(read("span length", &declared_span));
  REFIT_RETURN_NOT_OK(read("count", &count));
  if (declared_span != span_length) {
    return DataLoss("context-coded changes: span of {} elements, the old tensor's span holds {}",
                    declared_span, span_length);
  }
  if (count != expected_count || count > span_length) {
    return DataLoss("context-coded changes: {} changes, the item declares {} (span {})", count,
                    expected_count, span_length);
  }
  preamble.classes = classes;
  preamble.count = count;
  preamble.end = position;
  return preamble;
}

}  // namespace

bool ContextCodingSupported(DType dtype) { return MantissaBits(dtype) != 0; }

std::string_view ContextCodingSimdTarget() { return DispatchedContextTarget(); }

Status CheckContextCodedPreamble(DType dtype, uint64_t span_length, std::span<const uint8_t> bytes,
                                 uint64_t expected_count) {
  if (!ContextCodingSupported(dtype)) {
    return InvalidArgument("context coding is not defined for dtype {}", DTypeName(dtype));
  }
  return ParsePreamble(dtype, span_length, bytes, expected_count).status();
}

Result<std::vector<uint8_t>> EncodeContextCoded(DType dtype, std::span<const std::byte> old_span,
                                                std::span<const uint64_t> locations,
                                                std::span<const std::byte> xor_values,
                                                const ContextCodingOptions& options) {
  if (!ContextCodingSupported(dtype)) {
    return InvalidArgument("context coding is not defined for dtype {}", DTypeName(dtype));
  }
  const uint32_t width = DTypeSize(dtype);
  const uint32_t mantissa_bits = MantissaBits(dtype);
  if (old_span.size() % width != 0) {
    return InvalidArgument("context coding: old span of {} bytes is not whole {} elements",
                           old_span.size(), DTypeName(dtype));
  }
  const uint64_t span_length = old_span.size() / width;
  if (span_length >= kMaxSpan) {
    return InvalidArgument("context coding: span of {} elements is over 2^40", span_length);
  }
  const uint64_t count = locations.size();
  if (xor_values.size() != count * width) {
    return InvalidArgument("context coding: {} value bytes for {} locations of {}",
                           xor_values.size(), count, DTypeName(dtype));
  }
  if (options.max_classes < 1 || options.max_classes > kMaxContextThresholds + 1) {
    return InvalidArgument("context coding: max_classes {} is not in [1, {}]", options.max_classes,
                           kMaxContextThresholds + 1);
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (locations[i] >= span_length || (i > 0 && locations[i] <= locations[i - 1])) {
      return InvalidArgument(
          "context coding: location #{} ({}) is unsorted or outside the span "
          "of {} elements",
          i, locations[i], span_length);
    }
  }
  const std::byte* old = old_span.data();

  // Statistics per exponent: members, changes, low-plane symbols of the differences.
  const uint32_t bins = uint32_t{1} << (8 * width - 1 - mantissa_bits);
  ExponentStats stats{std::vector<uint64_t>(bins), std::vector<uint64_t>(bins),
                      std::vector<uint64_t>(uint64_t{bins} * kModelSymbols)};
  // The class choice needs the exponents' proportions, not exact counts (the class sizes written
  // are counted exactly below): a large span is sampled.
  const uint64_t stride = span_length >= kSampleAbove ? kSampleStride : 1;
  switch (width) {
    case 1:
      ExponentHistogram<uint8_t>(old, span_length, stride, mantissa_bits, &stats.members);
      break;
    case 2:
      ExponentHistogram<uint16_t>(old, span_length, stride, mantissa_bits, &stats.members);
      break;
    default:
      ExponentHistogram<uint32_t>(old, span_length, stride, mantissa_bits, &stats.members);
      break;
  }
  const uint64_t mask = WidthMask(width);
  std::vector<uint64_t> zigzags(count);
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t old_bits = LoadElement(old, width, locations[i]);
    const uint64_t new_bits = old_bits ^ LoadElement(xor_values.data(), width, i);
    if (new_bits == old_bits) {
      return InvalidArgument("context coding: location {} has a zero XOR value", locations[i]);
    }
    zigzags[i] = ZigZag((new_bits - old_bits) & mask, width);
    const uint32_t e = Magnitude(old_bits, width) >> mantissa_bits;
    ++stats.changes[e];
    ++stats.symbols[uint64_t{e} * kModelSymbols +
                    std::min<uint64_t>(zigzags[i] & 0xFF, kModelSymbols - 1)];
  }
  const std::vector<uint32_t> thresholds =
      ChooseThresholds(stats, mantissa_bits, width, options.max_classes);
  const uint32_t classes = static_cast<uint32_t>(thresholds.size()) + 1;

  // Ranks of the changes within their classes, and each class's differences in order.
  std::vector<uint64_t> members(classes, 0);
  std::vector<std::vector<uint64_t>> ranks(classes);
  std::vector<std::vector<uint64_t>> class_zigzags(classes);
  uint64_t next = 0;
  ForEachBlock(old, width, span_length, thresholds,
               [&](uint64_t block, const uint64_t* masks, const uint8_t* counts) {
                 const uint64_t block_end = (block + 1) * kContextBlock;
                 for (; next < count && locations[next] < block_end; ++next) {
                   const uint32_t bit = locations[next] % kContextBlock;
                   const uint64_t below = (uint64_t{1} << bit) - 1;
                   // Branch-free: the class of consecutive changes is as unpredictable as data.
                   uint32_t c = 0;
                   for (uint32_t j = 1; j < classes; ++j) {
                     c += j * static_cast<uint32_t>((masks[j] >> bit) & 1);
                   }
                   ranks[c].push_back(members[c] + PopCount(masks[c] & below));
                   class_zigzags[c].push_back(zigzags[next]);
                 }
                 for (uint32_t c = 0; c < classes; ++c) members[c] += counts[c];
               });

  std::vector<uint8_t> out = {kLayoutVersion, static_cast<uint8_t>(dtype),
                              static_cast<uint8_t>(classes), 0};
  PutVarint(span_length, &out);
  PutVarint(count, &out);
  for (uint32_t t : thresholds) PutVarint(t, &out);
  for (uint32_t c = 0; c < classes; ++c) {
    PutVarint(members[c], &out);
    PutVarint(ranks[c].size(), &out);
  }
  std::vector<uint8_t> raw;
  for (uint32_t c = 0; c < classes; ++c) {
    const uint64_t n = members[c];
    const uint64_t k = ranks[c].size();
    if (k == 0 || k == n) continue;
    // Gaps between the ranks of the changes, or of the unchanged members when most change.
    std::vector<uint64_t> gaps;
    uint64_t previous_end = 0;
    auto put_rank = [&](uint64_t rank) {
      gaps.push_back(rank - previous_end);
      previous_end = rank + 1;
    };
    if (2 * k <= n) {
      for (uint64_t rank : ranks[c]) put_rank(rank);
    } else {
      uint64_t r = 0;
      for (uint64_t rank : ranks[c]) {
        for (; r < rank; ++r) put_rank(r);
        r = rank + 1;
      }
      for (; r < n; ++r) put_rank(r);
    }
    // Golomb-style split: the low `shift` bits of each gap are stored raw (near uniform for
    // geometric gaps), the quotient goes through rANS. The shift leaves quotients of mean about
    // 2^kQuotientMeanBits, well inside a byte symbol.
    const uint64_t gap_sum = n - gaps.size();
    const uint64_t mean = gap_sum / gaps.size();
    const uint32_t mean_bits = static_cast<uint32_t>(std::bit_width(mean));
    const uint32_t shift = mean_bits > kQuotientMeanBits ? mean_bits - kQuotientMeanBits : 0;
    raw.clear();
    std::vector<uint8_t> low_bits((gaps.size() * shift + 7) / 8);
    uint64_t bit_position = 0;
    for (uint64_t gap : gaps) {
      const uint64_t quotient = gap >> shift;
      if (quotient < kQuotientEscape) {
        raw.push_back(static_cast<uint8_t>(quotient));
      } else {
        raw.push_back(kQuotientEscape);
        PutVarint(quotient - kQuotientEscape, &raw);
      }
      WriteBits(gap, shift, bit_position, low_bits);
      bit_position += shift;
    }
    REFIT_ASSIGN_OR_RETURN(std::vector<uint8_t> packed, CompressStream(raw));
    out.push_back(static_cast<uint8_t>(shift));
    PutVarint(raw.size(), &out);
    PutVarint(packed.size(), &out);
    out.insert(out.end(), packed.begin(), packed.end());
    out.insert(out.end(), low_bits.begin(), low_bits.end());
  }
  for (uint32_t c = 0; c < classes; ++c) {
    const std::vector<uint64_t>& values = class_zigzags[c];
    if (values.empty()) continue;
    for (uint32_t plane = 0; plane < width; ++plane) {
      raw.resize(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        raw[i] = static_cast<uint8_t>(values[i] >> (8 * plane));
      }
      if (std::all_of(raw.begin(), raw.end(), [](uint8_t b) { return b == 0; })) {
        // An all-zero plane (the high bytes of small steps) is stored as nothing: a rANS stream
        // would cost its four final states and a table.
        PutVarint(0, &out);
        continue;
      }
      REFIT_ASSIGN_OR_RETURN(std::vector<uint8_t> packed, CompressStream(raw));
      PutVarint(packed.size(), &out);
      out.insert(out.end(), packed.begin(), packed.end());
    }
  }
  return out;
}

Result<ContextDecoded> DecodeContextCoded(DType dtype, std::span<const std::byte> old_span,
                                          std::span<const uint8_t> bytes, uint64_t expected_count) {
  if (!ContextCodingSupported(dtype)) {
    return InvalidArgument("context coding is not defined for dtype {}", DTypeName(dtype));
  }
  const uint32_t width = DTypeSize(dtype);
  const uint64_t span_length = old_span.size() / width;
  REFIT_ASSIGN_OR_RETURN(const Preamble preamble,
                         ParsePreamble(dtype, span_length, bytes, expected_count));
  const uint32_t classes = preamble.classes;
  const uint64_t count = preamble.count;
  uint64_t position = preamble.end;
  auto read = [&](const char* field, uint64_t* value) -> Status {
    if (!GetVarint(bytes, &position, value)) {
      return DataLoss("context-coded changes: {} at byte {}: truncated or malformed varint", field,
                      position);
    }
    return Status::OK();
  };
  const uint64_t max_magnitude = WidthMask(width) >> 1;
  std::vector<uint32_t> thresholds(classes - 1);
  for (uint32_t j = 0; j + 1 < classes; ++j) {
    uint64_t t = 0;
    REFIT_RETURN_NOT_OK(read("threshold", &t));
    if (t == 0 || t > max_magnitude || (j > 0 && t <= thresholds[j - 1])) {
      return DataLoss("context-coded changes: threshold #{} is {} (must increase, in [1, {}])", j,
                      t, max_magnitude);
    }
    thresholds[j] = static_cast<uint32_t>(t);
  }
  std::vector<uint64_t> members(classes), changes(classes);
  uint64_t member_sum = 0;
  uint64_t change_sum = 0;
  for (uint32_t c = 0; c < classes; ++c) {
    REFIT_RETURN_NOT_OK(read("class members", &members[c]));
    REFIT_RETURN_NOT_OK(read("class changes", &changes[c]));
    if (members[c] > span_length || changes[c] > members[c]) {
      return DataLoss("context-coded changes: class {} has {} members and {} changes (span {})", c,
                      members[c], changes[c], span_length);
    }
    member_sum += members[c];
    change_sum += changes[c];
  }
  if (member_sum != span_length || change_sum != count) {
    return DataLoss(
        "context-coded changes: classes hold {} members and {} changes, the span {} "
        "and the item {}",
        member_sum, change_sum, span_length, count);
  }
  // Change bitmaps over each class's members, one spare word for ExtractBits.
  std::vector<std::vector<uint64_t>> bitmaps(classes);
  std::vector<uint8_t> raw;
  for (uint32_t c = 0; c < classes; ++c) {
    const uint64_t n = members[c];
    const uint64_t k = changes[c];
    bitmaps[c].assign(n / 64 + 2, k == n && n > 0 ? ~uint64_t{0} : 0);
    if (k == 0 || k == n) continue;
    const bool inverted = 2 * k > n;
    const uint64_t tokens = inverted ? n - k : k;
    if (position >= bytes.size()) {
      return DataLoss("context-coded changes: mask stream of class {} is missing", c);
    }
    const uint32_t shift = bytes[position++];
    if (shift > kMaxGapShift) {
      return DataLoss("context-coded changes: mask stream of class {}: gap shift {} (at most {})",
                      c, shift, kMaxGapShift);
    }
    uint64_t raw_size = 0;
    uint64_t packed_size = 0;
    REFIT_RETURN_NOT_OK(read("mask stream size", &raw_size));
    REFIT_RETURN_NOT_OK(read("mask stream length", &packed_size));
    const uint64_t low_size = (tokens * shift + 7) / 8;
    if (raw_size < tokens || raw_size > tokens * (1 + kMaxVarintBytes) ||
        packed_size > bytes.size() - position || low_size > bytes.size() - position - packed_size) {
      return DataLoss(
          "context-coded changes: mask stream of class {}: {} bytes for {} gaps, {} + {} "
          "bytes stored with {} left",
          c, raw_size, tokens, packed_size, low_size, bytes.size() - position);
    }
    raw.resize(raw_size);
    REFIT_RETURN_NOT_OK(DecompressStream(bytes.subspan(position, packed_size), raw, "mask", c));
    position += packed_size;
    const std::span<const uint8_t> low_bits = bytes.subspan(position, low_size);
    position += low_size;
    if (inverted) {
      for (uint64_t w = 0; w < n / 64; ++w) bitmaps[c][w] = ~uint64_t{0};
      if (n % 64 != 0) bitmaps[c][n / 64] = (uint64_t{1} << (n % 64)) - 1;
    }
    uint64_t raw_position = 0;
    uint64_t next_rank = 0;
    uint64_t bit_position = 0;
    for (uint64_t t = 0; t < tokens; ++t) {
      if (raw_position >= raw.size()) {
        return DataLoss("context-coded changes: mask stream of class {}: gap #{} is missing", c, t);
      }
      uint64_t quotient = raw[raw_position++];
      if (quotient == kQuotientEscape) {
        uint64_t more = 0;
        if (!GetVarint(raw, &raw_position, &more) || more > (n >> shift)) {
          return DataLoss(
              "context-coded changes: mask stream of class {}: gap #{} escape is "
              "malformed or over the class's {} members",
              c, t, n);
        }
        quotient += more;
      }
      const uint64_t low = ReadBits(low_bits, bit_position, shift);
      bit_position += shift;
      if (quotient > ((n - next_rank) >> shift)) {
        return DataLoss(
            "context-coded changes: mask stream of class {}: gap #{} runs past the "
            "class's {} members",
            c, t, n);
      }
      const uint64_t gap = (quotient << shift) | low;
      if (gap >= n - next_rank) {
        return DataLoss(
            "context-coded changes: mask stream of class {}: gap #{} runs past the "
            "class's {} members",
            c, t, n);
      }
      const uint64_t rank = next_rank + gap;
      bitmaps[c][rank / 64] ^= uint64_t{1} << (rank % 64);
      next_rank = rank + 1;
    }
    if (raw_position != raw.size()) {
      return DataLoss("context-coded changes: mask stream of class {}: {} trailing bytes", c,
                      raw.size() - raw_position);
    }
    if (shift != 0 && tokens * shift % 8 != 0 && (low_bits.back() >> (tokens * shift % 8)) != 0) {
      return DataLoss("context-coded changes: mask stream of class {}: padding bits set", c);
    }
  }
  std::vector<std::vector<uint8_t>> planes(classes);
  for (uint32_t c = 0; c < classes; ++c) {
    const uint64_t k = changes[c];
    if (k == 0) continue;
    planes[c].resize(k * width);
    for (uint32_t plane = 0; plane < width; ++plane) {
      uint64_t packed_size = 0;
      REFIT_RETURN_NOT_OK(read("value stream length", &packed_size));
      if (packed_size > bytes.size() - position) {
        return DataLoss("context-coded changes: value plane {} of class {}: {} bytes with {} left",
                        plane, c, packed_size, bytes.size() - position);
      }
      if (packed_size == 0) continue;  // an all-zero plane; planes[c] starts zeroed
      REFIT_RETURN_NOT_OK(DecompressStream(bytes.subspan(position, packed_size),
                                           std::span(planes[c]).subspan(plane * k, k), "value", c));
      position += packed_size;
    }
  }
  if (position != bytes.size()) {
    return DataLoss("context-coded changes: {} trailing bytes", bytes.size() - position);
  }

  // The one pass over the old elements: deposit each class's change bits at its members (SIMD
  // kernel), then turn each changed element's difference into its XOR value.
  ContextDecoded decoded;
  decoded.locations.resize(count);
  decoded.xor_values.resize(count * width);
  std::vector<uint64_t> offsets(classes, 0);
  std::vector<uint64_t> emitted(classes, 0);
  std::vector<const uint64_t*> bitmap_words(classes);
  uint32_t all_changed = 0;
  for (uint32_t c = 0; c < classes; ++c) {
    const bool uniform = changes[c] == 0 || changes[c] == members[c];
    bitmap_words[c] = uniform ? nullptr : bitmaps[c].data();
    if (changes[c] == members[c] && members[c] > 0) all_changed |= 1u << c;
  }
  uint64_t total = 0;
  const std::byte* old = old_span.data();
  const uint64_t mask = WidthMask(width);
  const auto more_members = [&](uint32_t klass) {
    return DataLoss(
        "context-coded changes: the old tensor has more than the {} members of class {} the "
        "producer saw (old weights differ)",
        members[klass], klass);
  };
  // Emit the changes of one block's changed word.
  const auto emit = [&](uint64_t block, uint64_t changed) -> Status {
    while (changed != 0) {
      const uint32_t bit = std::countr_zero(changed);
      changed &= changed - 1;
      const uint64_t location = block * kContextBlock + bit;
      const uint64_t old_bits = LoadElement(old, width, location);
      const uint32_t c = ClassOf(Magnitude(old_bits, width), thresholds);
      const uint64_t k = changes[c];
      // A class without change bitmap (none or all of it changed) is bounded per batch only: an
      // old tensor with more members than the producer saw shows up here first.
      if (emitted[c] >= k || total >= count) return more_members(c);
      const uint64_t v = emitted[c]++;
      uint64_t zigzag = 0;
      for (uint32_t plane = 0; plane < width; ++plane) {
        zigzag |= uint64_t{planes[c][plane * k + v]} << (8 * plane);
      }
      if (zigzag == 0) {
        return DataLoss("context-coded changes: location {} changes by 0", location);
      }
      const uint64_t new_bits = (old_bits + UnZigZag(zigzag, width)) & mask;
      decoded.locations[total] = location;
      StoreElement(decoded.xor_values.data(), width, total, old_bits ^ new_bits);
      ++total;
    }
    return Status::OK();
  };
  const uint64_t whole = span_length / kContextBlock;
  std::vector<uint64_t> changed_words(std::min(whole, kBlocksPerBatch));
  for (uint64_t first = 0; first < whole; first += kBlocksPerBatch) {
    const uint64_t blocks = std::min(kBlocksPerBatch, whole - first);
    if (!ContextChangedWords(old + first * kContextBlock * width, width, blocks, thresholds.data(),
                             classes - 1, bitmap_words.data(), all_changed, members.data(),
                             offsets.data(), changed_words.data())) {
      return DataLoss(
          "context-coded changes: the old tensor holds more members of a class than the producer "
          "saw, within the span's first {} elements (old weights differ)",
          (first + blocks) * kContextBlock);
    }
    for (uint64_t b = 0; b < blocks; ++b) {
      if (changed_words[b] != 0) REFIT_RETURN_NOT_OK(emit(first + b, changed_words[b]));
    }
  }
  if (span_length % kContextBlock != 0) {
    // The tail, one element at a time.
    uint64_t changed = 0;
    for (uint64_t i = 0; i < span_length % kContextBlock; ++i) {
      const uint32_t magnitude =
          Magnitude(LoadElement(old, width, whole * kContextBlock + i), width);
      uint32_t c = 0;
      while (c + 1 < classes && magnitude >= thresholds[c]) ++c;
      if (offsets[c] >= members[c]) return more_members(c);
      const uint64_t at = offsets[c]++;
      changed |= ((bitmaps[c][at / 64] >> (at % 64)) & 1) << i;
    }
    REFIT_RETURN_NOT_OK(emit(whole, changed));
  }
  for (uint32_t c = 0; c < classes; ++c) {
    if (offsets[c] != members[c]) {
      return DataLoss(
          "context-coded changes: the old tensor has {} members of class {}, the "
          "producer saw {} (old weights differ)",
          offsets[c], c, members[c]);
    }
  }
  REFIT_DCHECK(total == count, "the merge emits exactly the declared changes");
  return decoded;
}

}  // namespace refit::internal
