// Names of ops and location encodings, as the CLI, logs and error messages spell them.
#include "refit/item.h"

#include <array>
#include <string>

#include "refit/status_format.h"

namespace refit {
namespace {

struct OpEntry {
  Op op;
  std::string_view name;
};

// In wire-code order, so error messages list the names in that order.
constexpr std::array<OpEntry, 4> kOps = {{
    {Op::kXor, "xor"},
    {Op::kOverwrite, "overwrite"},
    {Op::kAdd, "add"},
    {Op::kFull, "full"},
}};

struct EncodingEntry {
  LocationEncoding encoding;
  std::string_view name;
};

// In wire-code order, so error messages list the names in that order.
constexpr std::array<EncodingEntry, 7> kEncodings = {{
    {LocationEncoding::kAll, "all"},
    {LocationEncoding::kRange, "range"},
    {LocationEncoding::kGap16, "gap16"},
    {LocationEncoding::kGap32, "gap32"},
    {LocationEncoding::kGap64, "gap64"},
    {LocationEncoding::kBitmask, "bitmask"},
    {LocationEncoding::kContext, "context"},
}};

// Join the `name` fields of `entries` with ", " for error messages.
template <typename Entries>
std::string JoinNames(const Entries& entries) {
  std::string out;
  for (const auto& entry : entries) {
    if (!out.empty()) out += ", ";
    out += entry.name;
  }
  return out;
}

}  // namespace

std::string_view OpName(Op op) {
  for (const OpEntry& entry : kOps) {
    if (entry.op == op) return entry.name;
  }
  // Reachable only through a cast of an unchecked wire byte; callers decode ops with a check.
  return "unknown-op";
}

Result<Op> ParseOp(std::string_view text) {
  for (const OpEntry& entry : kOps) {
    if (entry.name == text) return entry.op;
  }
  return InvalidArgument("unknown op '{}'; accepted: {}", text, JoinNames(kOps));
}

std::string_view LocationEncodingName(LocationEncoding encoding) {
  for (const EncodingEntry& entry : kEncodings) {
    if (entry.encoding == encoding) return entry.name;
  }
  // Reachable only through a cast of an unchecked wire byte; decoders reject such codes.
  return "unknown-encoding";
}

Result<LocationEncoding> ParseLocationEncoding(std::string_view text) {
  for (const EncodingEntry& entry : kEncodings) {
    if (entry.name == text) return entry.encoding;
  }
  return InvalidArgument("unknown location encoding '{}'; accepted: {}", text,
                         JoinNames(kEncodings));
}

}  // namespace refit
