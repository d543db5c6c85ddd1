#include "refit/loader.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <optional>
#include <regex>
#include <utility>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "core/digest.h"
#include "core/yaml_reader.h"
#include "refit/status_format.h"

namespace refit {
namespace {

struct KindEntry {
  LoaderKind kind;
  std::string_view name;
};

constexpr KindEntry kKinds[] = {
    {LoaderKind::kIdentity, "identity"},
    {LoaderKind::kRename, "rename"},
    {LoaderKind::kSkip, "skip"},
    {LoaderKind::kRow, "row"},
    {LoaderKind::kColumn, "column"},
    {LoaderKind::kQkv, "qkv"},
    {LoaderKind::kQkvInterleaved, "qkv_interleaved"},
    {LoaderKind::kGateUp, "gate_up"},
    {LoaderKind::kVocab, "vocab"},
    {LoaderKind::kExpertGateUp, "expert_gate_up"},
    {LoaderKind::kExpertDown, "expert_down"},
    {LoaderKind::kStackedGateUp, "stacked_gate_up"},
    {LoaderKind::kStackedDown, "stacked_down"},
};

bool IsExpertKind(LoaderKind kind) {
  return kind == LoaderKind::kExpertGateUp || kind == LoaderKind::kExpertDown ||
         kind == LoaderKind::kStackedGateUp || kind == LoaderKind::kStackedDown;
}

std::string KindNames() {
  std::string out;
  for (const KindEntry& entry : kKinds) {
    if (!out.empty()) out += ", ";
    out += entry.name;
  }
  return out;
}

/// The largest loader spec file read: a spec is a few rules; the bound keeps a wrong path (a
/// model file) from being read whole.
constexpr size_t kMaxSpecFileBytes = size_t{1} << 20;

/// The keys of a rule mapping. `kind` is always allowed; the rest depend on the kind.
constexpr std::string_view kRuleKeys[] = {"kind",
                                          "match",
                                          "to",
                                          "q",
                                          "k",
                                          "v",
                                          "gate",
                                          "up",
                                          "num_heads",
                                          "num_kv_heads",
                                          "vocab_size",
                                          "pad_to",
                                          "expert_group",
                                          "num_experts",
                                          "experts",
                                          "expert_tp_rank",
                                          "expert_tp_size"};

/// The keys every expert kind takes besides its patterns.
bool IsExpertKey(std::string_view key) {
  return key == "num_experts" || key == "experts" || key == "expert_tp_rank" ||
         key == "expert_tp_size";
}

/// Return whether `key` is meaningful for a rule of `kind`.
bool KeyApplies(LoaderKind kind, std::string_view key) {
  if (key == "kind") return true;
  // A skipped tensor has no local tensor to name.
  if (key == "to") return kind != LoaderKind::kSkip;
  switch (kind) {
    case LoaderKind::kIdentity:
    case LoaderKind::kRename:
    case LoaderKind::kSkip:
    case LoaderKind::kRow:
    case LoaderKind::kColumn:
      return key == "match";
    case LoaderKind::kQkv:
    case LoaderKind::kQkvInterleaved:
      return key == "q" || key == "k" || key == "v" || key == "num_heads" || key == "num_kv_heads";
    case LoaderKind::kGateUp:
      return key == "gate" || key == "up";
    case LoaderKind::kVocab:
      return key == "match" || key == "vocab_size" || key == "pad_to";
    case LoaderKind::kExpertGateUp:
      return key == "gate" || key == "up" || key == "expert_group" || IsExpertKey(key);
    case LoaderKind::kExpertDown:
      return key == "match" || key == "expert_group" || IsExpertKey(key);
    case LoaderKind::kStackedGateUp:
    case LoaderKind::kStackedDown:
      return key == "match" || IsExpertKey(key);
  }
  return false;
}

/// A problem with one rule: the key it concerns and what is wrong.
struct RuleProblem {
  std::string key;
  std::string message;
};

/// The patterns of a rule, in the order of its parts (qkv: q, k, v; gate_up: gate, up).
std::vector<std::pair<std::string_view, const std::string*>> RulePatterns(const LoaderRule& rule) {
  switch (rule.kind) {
    case LoaderKind::kQkv:
    case LoaderKind::kQkvInterleaved:
      return {{"q", &rule.q}, {"k", &rule.k}, {"v", &rule.v}};
    case LoaderKind::kGateUp:
    case LoaderKind::kExpertGateUp:
      return {{"gate", &rule.gate}, {"up", &rule.up}};
    default:
      return {{"match", &rule.match}};
  }
}

/// Check the expert keys of an expert rule whose patterns compiled into `compiled`.
std::optional<RuleProblem> CheckExpertRule(const LoaderRule& rule,
                                           const std::vector<std::regex>& compiled) {
  const bool per_expert =
      rule.kind == LoaderKind::kExpertGateUp || rule.kind == LoaderKind::kExpertDown;
  if (per_expert) {
    if (rule.expert_group == 0) {
      return RuleProblem{"expert_group",
                         fmt::format("a {} rule needs the capture group (≥ 1) of the expert index",
                                     LoaderKindName(rule.kind))};
    }
    for (size_t part = 0; part < compiled.size(); ++part) {
      if (rule.expert_group > compiled[part].mark_count()) {
        return RuleProblem{
            "expert_group",
            fmt::format("capture group {} does not exist: pattern {} has {}", rule.expert_group,
                        RulePatterns(rule)[part].first, compiled[part].mark_count())};
      }
    }
  }
  if (!per_expert && !rule.experts.empty() && rule.num_experts == 0) {
    return RuleProblem{"num_experts",
                       fmt::format("a {} rule that lists its experts needs num_experts (the "
                                   "canonical stack's first extent)",
                                   LoaderKindName(rule.kind))};
  }
  std::vector<uint32_t> sorted = rule.experts;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (rule.num_experts != 0 && sorted[i] >= rule.num_experts) {
      return RuleProblem{"experts", fmt::format("expert {} is not below num_experts {}", sorted[i],
                                                rule.num_experts)};
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return RuleProblem{"experts", fmt::format("expert {} is listed twice", sorted[i])};
    }
  }
  if (rule.expert_tp_size == 0 && rule.expert_tp_rank != 0) {
    return RuleProblem{"expert_tp_rank", "expert_tp_rank needs expert_tp_size"};
  }
  if (rule.expert_tp_size != 0 && rule.expert_tp_rank >= rule.expert_tp_size) {
    return RuleProblem{"expert_tp_rank", fmt::format("{} is not below expert_tp_size {}",
                                                     rule.expert_tp_rank, rule.expert_tp_size)};
  }
  return std::nullopt;
}

/// The longest run of decimal digits a pattern may hold (see CheckRule).
constexpr size_t kMaxPatternDigits = 9;

/// Return the offset of the first run of more than kMaxPatternDigits decimal digits in `pattern`.
std::optional<size_t> LongNumberAt(std::string_view pattern) {
  size_t run = 0;
  for (size_t i = 0; i < pattern.size(); ++i) {
    run = pattern[i] >= '0' && pattern[i] <= '9' ? run + 1 : 0;
    if (run > kMaxPatternDigits) return i + 1 - run;
  }
  return std::nullopt;
}

/// Check one rule against the TP size and compile its patterns into `compiled`.
std::optional<RuleProblem> CheckRule(const LoaderRule& rule, uint32_t tp_size,
                                     std::vector<std::regex>* compiled) {
  compiled->clear();
  for (const auto& [key, pattern] : RulePatterns(rule)) {
    if (pattern->empty()) {
      return RuleProblem{std::string(key), fmt::format("a {} rule needs a non-empty pattern",
                                                       LoaderKindName(rule.kind))};
    }
    // libstdc++'s std::regex reads the number of a back-reference or a repetition count into a
    // long without an overflow check (undefined behaviour, found by loader_yaml_fuzz): a number
    // that long means nothing in a tensor-name pattern, so it is refused before compiling.
    if (std::optional<size_t> at = LongNumberAt(*pattern)) {
      return RuleProblem{
          std::string(key),
          fmt::format("'{}' has a number of more than {} digits at offset {}; patterns of tensor "
                      "names need no such number",
                      *pattern, kMaxPatternDigits, *at)};
    }
    // std::regex reports a bad pattern by exception; it stops here.
    try {
      compiled->emplace_back(*pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return RuleProblem{std::string(key), fmt::format("'{}' is not a valid regular expression: {}",
                                                       *pattern, e.what())};
    }
  }
  const bool qkv = rule.kind == LoaderKind::kQkv || rule.kind == LoaderKind::kQkvInterleaved;
  const bool needs_to = rule.kind == LoaderKind::kRename || qkv ||
                        rule.kind == LoaderKind::kGateUp || IsExpertKind(rule.kind);
  if (needs_to && rule.to.empty()) {
    return RuleProblem{
        "to", fmt::format("a {} rule needs the local tensor's name", LoaderKindName(rule.kind))};
  }
  if (qkv) {
    const std::string_view kind = LoaderKindName(rule.kind);
    if (rule.num_heads == 0) {
      return RuleProblem{"num_heads", fmt::format("a {} rule needs num_heads > 0", kind)};
    }
    if (rule.num_kv_heads == 0) {
      return RuleProblem{"num_kv_heads", fmt::format("a {} rule needs num_kv_heads > 0", kind)};
    }
    if (rule.num_heads % rule.num_kv_heads != 0) {
      return RuleProblem{"num_kv_heads",
                         fmt::format("num_heads {} is not a multiple of num_kv_heads {}",
                                     rule.num_heads, rule.num_kv_heads)};
    }
    if (rule.num_heads % tp_size != 0) {
      return RuleProblem{"num_heads", fmt::format("num_heads {} is not a multiple of tp_size {}",
                                                  rule.num_heads, tp_size)};
    }
    // Megatron-Core splits whole query groups between ranks.
    if (rule.kind == LoaderKind::kQkvInterleaved && rule.num_kv_heads % tp_size != 0) {
      return RuleProblem{"num_kv_heads",
                         fmt::format("num_kv_heads {} (query groups) is not a multiple of tp_size "
                                     "{}: Megatron-Core splits whole query groups between ranks",
                                     rule.num_kv_heads, tp_size)};
    }
    if (rule.num_kv_heads % tp_size != 0 && tp_size % rule.num_kv_heads != 0) {
      return RuleProblem{
          "num_kv_heads",
          fmt::format("num_kv_heads {} neither divides nor is a multiple of tp_size {}",
                      rule.num_kv_heads, tp_size)};
    }
  }
  if (IsExpertKind(rule.kind)) {
    if (auto problem = CheckExpertRule(rule, *compiled)) return problem;
  }
  if (rule.kind == LoaderKind::kVocab) {
    if (rule.vocab_size == 0) {
      return RuleProblem{"vocab_size", "a vocab rule needs vocab_size > 0"};
    }
    if (rule.pad_to == 0) return RuleProblem{"pad_to", "pad_to must be > 0"};
    uint64_t multiple = 0;
    if (__builtin_mul_overflow(rule.pad_to, uint64_t{tp_size}, &multiple) ||
        rule.vocab_size > UINT64_MAX - multiple) {
      return RuleProblem{"pad_to",
                         fmt::format("pad_to {} × tp_size {} overflows", rule.pad_to, tp_size)};
    }
  }
  return std::nullopt;
}

/// The 2-D view of a shape: rows = shape[0], cols = the product of the rest.
std::pair<uint64_t, uint64_t> TwoD(const Shape& shape) {
  if (shape.empty()) return {1, 1};
  uint64_t cols = 1;
  for (size_t d = 1; d < shape.size(); ++d) cols *= static_cast<uint64_t>(shape[d]);
  return {static_cast<uint64_t>(shape[0]), cols};
}

/// Return `extent` × `factor` as a shape extent, or nullopt when it overflows.
std::optional<int64_t> Scaled(int64_t extent, uint64_t factor) {
  int64_t out = 0;
  if (__builtin_mul_overflow(extent, static_cast<int64_t>(factor), &out)) return std::nullopt;
  return out;
}

/// Return the expert index that capture group `group` of `match` holds.
Result<uint64_t> ExpertIndex(const std::smatch& match, uint32_t group, const std::string& where) {
  const std::string text = match.str(group);
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
    return InvalidArgument("{}: capture group {} holds '{}', not an expert index", where, group,
                           text);
  }
  return value;
}

/// Merge neighbouring pieces (sorted by row) that continue each other in both the canonical view
/// and the local tensor: the stacks of consecutive experts without a TP split become one piece,
/// and a stack of every expert one piece over the whole tensor (whose item digests a receiver
/// can then check alone).
void MergeContinuingPieces(std::vector<CanonicalPiece>* pieces) {
  std::vector<CanonicalPiece> merged;
  for (CanonicalPiece& piece : *pieces) {
    if (!merged.empty()) {
      CanonicalPiece& last = merged.back();
      if (last.row_end == piece.row_begin && last.col_begin == piece.col_begin &&
          last.col_end == piece.col_end && last.local_tensor == piece.local_tensor &&
          last.local_row_length == piece.local_row_length &&
          last.local_row_offset + (last.row_end - last.row_begin) == piece.local_row_offset) {
        last.row_end = piece.row_end;
        continue;
      }
    }
    merged.push_back(std::move(piece));
  }
  *pieces = std::move(merged);
}

/// Lay out a canonical tensor that an expert rule matched (`part`: 0 gate, 1 up for the gate_up
/// kinds) in the local stack `local` [slots, rows, cols]: set the layout's shape, its 2-D view
/// and its pieces. `tp` and `rank` are the spec's TP coordinates.
Status LayOutExperts(const LoaderRule& rule, size_t part, const std::smatch& match,
                     const TensorView& local, uint64_t tp, uint64_t rank, const std::string& where,
                     CanonicalLayout* layout) {
  const Shape& local_shape = local.shape;
  if (local_shape.size() != 3) {
    return InvalidArgument("{}: local shape {} is not a stack [local experts, rows, cols]", where,
                           ShapeToString(local_shape));
  }
  if (rule.expert_tp_size != 0) {
    tp = rule.expert_tp_size;
    rank = rule.expert_tp_rank;
  }
  const uint64_t slots = static_cast<uint64_t>(local_shape[0]);
  const uint64_t local_rows = static_cast<uint64_t>(local_shape[1]);
  const uint64_t local_cols = static_cast<uint64_t>(local_shape[2]);
  if (!rule.experts.empty() && rule.experts.size() != slots) {
    return InvalidArgument("{}: local shape {} holds {} experts, but the rule lists {}", where,
                           ShapeToString(local_shape), slots, rule.experts.size());
  }
  const uint64_t num_experts = rule.num_experts != 0 ? rule.num_experts : slots;
  if (rule.experts.empty() && slots > num_experts) {
    return InvalidArgument("{}: local shape {} holds {} experts, more than num_experts {}", where,
                           ShapeToString(local_shape), slots, num_experts);
  }
  const auto expert_in_slot = [&](uint64_t slot) -> uint64_t {
    return rule.experts.empty() ? slot : rule.experts[slot];
  };
  const bool gate_up =
      rule.kind == LoaderKind::kExpertGateUp || rule.kind == LoaderKind::kStackedGateUp;
  if (gate_up && local_rows % 2 != 0) {
    return InvalidArgument(
        "{}: local shape {} has an odd number of rows per expert ({}); gate and up take half each",
        where, ShapeToString(local_shape), local_rows);
  }
  // The extent of the dimension TP splits, per rank (block) and whole.
  const uint64_t block = gate_up ? local_rows / 2 : local_cols;
  const std::optional<int64_t> whole = Scaled(static_cast<int64_t>(block), tp);
  if (!whole) return InvalidArgument("{}: {} × tp_size {} overflows", where, block, tp);
  const uint64_t split = static_cast<uint64_t>(*whole);
  const uint64_t hidden = gate_up ? local_cols : local_rows;

  std::vector<CanonicalPiece> pieces;
  const auto add = [&](uint64_t row_begin, uint64_t rows, uint64_t col_begin, uint64_t col_end,
                       uint64_t local_row_offset, uint64_t local_row_length) {
    pieces.push_back(CanonicalPiece{.local_tensor = local.name,
                                    .row_begin = row_begin,
                                    .row_end = row_begin + rows,
                                    .col_begin = col_begin,
                                    .col_end = col_end,
                                    .local_row_offset = local_row_offset,
                                    .local_row_length = local_row_length,
                                    .id = {}});
  };
  const bool per_expert =
      rule.kind == LoaderKind::kExpertGateUp || rule.kind == LoaderKind::kExpertDown;
  std::optional<uint64_t> slot;
  if (per_expert) {
    REFIT_ASSIGN_OR_RETURN(const uint64_t expert, ExpertIndex(match, rule.expert_group, where));
    if (expert >= num_experts) {
      return InvalidArgument("{}: expert {} is not below {} ({})", where, expert, num_experts,
                             rule.num_experts != 0 ? "num_experts" : "the experts the stack holds");
    }
    if (rule.experts.empty()) {
      slot = expert;
    } else if (auto it = std::find(rule.experts.begin(), rule.experts.end(), expert);
               it != rule.experts.end()) {
      slot = static_cast<uint64_t>(it - rule.experts.begin());
    }
  }
  switch (rule.kind) {
    case LoaderKind::kExpertGateUp:
      // Canonical [I, H] → slot s, rows [s·2·I/tp + part·I/tp, …) of the stack's rows.
      layout->shape = {static_cast<int64_t>(split), static_cast<int64_t>(hidden)};
      layout->rows = split;
      layout->cols = hidden;
      if (slot) add(rank * block, block, 0, hidden, *slot * local_rows + part * block, hidden);
      break;
    case LoaderKind::kExpertDown:
      // Canonical [H, I] → slot s holds column block `rank` of every row.
      layout->shape = {static_cast<int64_t>(hidden), static_cast<int64_t>(split)};
      layout->rows = hidden;
      layout->cols = split;
      if (slot) add(0, hidden, rank * block, (rank + 1) * block, *slot * hidden, block);
      break;
    case LoaderKind::kStackedGateUp: {
      // Canonical [E, 2·I, H] seen as [E·2·I, H]: expert e's gate rows start at e·2·I, its up
      // rows at e·2·I + I.
      layout->shape = {static_cast<int64_t>(num_experts), static_cast<int64_t>(2 * split),
                       static_cast<int64_t>(hidden)};
      layout->rows = num_experts * 2 * split;
      layout->cols = hidden;
      for (uint64_t s = 0; s < slots; ++s) {
        const uint64_t first = expert_in_slot(s) * 2 * split;
        add(first + rank * block, block, 0, hidden, s * local_rows, hidden);
        add(first + split + rank * block, block, 0, hidden, s * local_rows + block, hidden);
      }
      break;
    }
    case LoaderKind::kStackedDown:
      // Canonical [E, H, I] seen as [E·H, I]: expert e is rows [e·H, (e+1)·H).
      layout->shape = {static_cast<int64_t>(num_experts), static_cast<int64_t>(hidden),
                       static_cast<int64_t>(split)};
      layout->rows = num_experts * hidden;
      layout->cols = split;
      for (uint64_t s = 0; s < slots; ++s) {
        add(expert_in_slot(s) * hidden, hidden, rank * block, (rank + 1) * block, s * hidden,
            block);
      }
      break;
    default:
      return Internal("{}: not an expert kind", where);
  }
  if (!NumElements(layout->shape).ok()) {
    return InvalidArgument("{}: canonical shape {} overflows", where, ShapeToString(layout->shape));
  }
  std::sort(pieces.begin(), pieces.end(), [](const CanonicalPiece& a, const CanonicalPiece& b) {
    return a.row_begin < b.row_begin;
  });
  MergeContinuingPieces(&pieces);
  for (CanonicalPiece& piece : pieces) {
    piece.id = PieceId(piece.row_begin, piece.row_end, piece.col_begin, piece.col_end);
  }
  layout->pieces = std::move(pieces);
  return Status::OK();
}

/// Lay out Megatron-Core's `linear_qkv`: the rank's G/TP query groups, group j at local rows
/// [j·(h + 2)·d, (j + 1)·(h + 2)·d) with h q heads per group: its h·d q rows, then d k rows, then
/// d v rows. Part 0 (q) or 1, 2 (k, v) of the canonical tensor is one piece per group: its rows
/// are contiguous in the canonical tensor but not in the local one.
Status LayOutInterleavedQkv(const LoaderRule& rule, size_t part, const TensorView& local,
                            uint64_t tp, uint64_t rank, const std::string& where,
                            CanonicalLayout* layout) {
  const Shape& local_shape = local.shape;
  if (local_shape.empty()) {
    return InvalidArgument("{}: local shape {} has no dimension to hold heads", where,
                           ShapeToString(local_shape));
  }
  const auto [local_rows, local_cols] = TwoD(local_shape);
  const uint64_t groups = rule.num_kv_heads / tp;
  const uint64_t q_per_group = rule.num_heads / rule.num_kv_heads;
  const uint64_t group_heads = q_per_group + 2;
  if (local_rows % (groups * group_heads) != 0) {
    return InvalidArgument(
        "{}: local shape {} has {} rows, not a multiple of the {} query groups × {} heads ({} q + "
        "k + v) a rank holds",
        where, ShapeToString(local_shape), local_rows, groups, group_heads, q_per_group);
  }
  const uint64_t head_dim = local_rows / (groups * group_heads);
  const uint64_t heads = part == 0 ? rule.num_heads : rule.num_kv_heads;
  uint64_t rows = 0;
  if (__builtin_mul_overflow(heads, head_dim, &rows) || rows > static_cast<uint64_t>(INT64_MAX)) {
    return InvalidArgument("{}: {} × {} canonical rows overflow", where, heads, head_dim);
  }
  layout->shape = local_shape;
  layout->shape[0] = static_cast<int64_t>(rows);
  if (!NumElements(layout->shape).ok()) {
    return InvalidArgument("{}: canonical shape {} overflows", where, ShapeToString(layout->shape));
  }
  std::tie(layout->rows, layout->cols) = TwoD(layout->shape);
  const uint64_t group_rows = (part == 0 ? q_per_group : 1) * head_dim;
  const uint64_t within_group = part == 0 ? 0 : (q_per_group + part - 1) * head_dim;
  for (uint64_t j = 0; j < groups; ++j) {
    const uint64_t row_begin = (rank * groups + j) * group_rows;
    layout->pieces.push_back(
        CanonicalPiece{.local_tensor = local.name,
                       .row_begin = row_begin,
                       .row_end = row_begin + group_rows,
                       .col_begin = 0,
                       .col_end = layout->cols,
                       .local_row_offset = j * group_heads * head_dim + within_group,
                       .local_row_length = local_cols,
                       .id = PieceId(row_begin, row_begin + group_rows, 0, layout->cols)});
  }
  return Status::OK();
}

}  // namespace

std::string_view LoaderKindName(LoaderKind kind) {
  for (const KindEntry& entry : kKinds) {
    if (entry.kind == kind) return entry.name;
  }
  return "unknown-kind";
}

Result<LoaderKind> ParseLoaderKind(std::string_view text) {
  for (const KindEntry& entry : kKinds) {
    if (entry.name == text) return entry.kind;
  }
  return InvalidArgument("unknown loader kind '{}'; accepted: {}", text, KindNames());
}

std::string PieceId(uint64_t row_begin, uint64_t row_end, uint64_t col_begin, uint64_t col_end) {
  return fmt::format("rows {}:{} cols {}:{}", row_begin, row_end, col_begin, col_end);
}

uint64_t PieceDigestOf(const CanonicalPiece& piece, uint64_t canonical_cols,
                       const TensorView& local) {
  const uint32_t width = DTypeSize(local.dtype);
  const uint64_t piece_cols = piece.col_end - piece.col_begin;
  uint64_t sum = 0;
  for (uint64_t r = piece.row_begin; r < piece.row_end; ++r) {
    const uint64_t local_begin =
        (piece.local_row_offset + r - piece.row_begin) * piece.local_row_length;
    sum += RemappedDigestRange(local.bytes, width, local_begin,
                               r * canonical_cols + piece.col_begin, piece_cols);
  }
  return sum;
}

// ---- Loader -----------------------------------------------------------------------------------

struct Loader::CompiledRule {
  /// One per part (see RulePatterns).
  std::vector<std::regex> patterns;
};

Loader::Loader(LoaderSpec spec, const WeightStore* store, std::vector<CompiledRule> rules)
    : spec_(std::move(spec)), store_(store), rules_(std::move(rules)) {}

Loader::~Loader() = default;

Result<std::unique_ptr<Loader>> Loader::ForShapes(const LoaderSpec& spec,
                                                  std::span<const TensorView> locals) {
  std::map<std::string, TensorView, std::less<>> shapes;
  for (const TensorView& local : locals) {
    TensorView shape_only{local.name, local.dtype, local.shape, {}};
    if (!shapes.emplace(local.name, std::move(shape_only)).second) {
      return AlreadyExists("loader: two local tensors are named '{}'", local.name);
    }
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Compile(spec, nullptr));
  loader->shapes_ = std::move(shapes);
  return loader;
}

Result<TensorView> Loader::FindLocal(std::string_view name) const {
  if (store_ != nullptr) return store_->Find(name);
  auto it = shapes_.find(name);
  if (it == shapes_.end()) return NotFound("no local tensor '{}'", name);
  return it->second;
}

std::string_view Loader::Holder() const {
  return store_ != nullptr ? "the receiver's store" : "the rank's local tensors";
}

Result<std::unique_ptr<Loader>> Loader::Make(const LoaderSpec& spec, const WeightStore& store) {
  return Compile(spec, &store);
}

Result<std::unique_ptr<Loader>> Loader::Compile(const LoaderSpec& spec, const WeightStore* store) {
  if (spec.tp_size == 0) return InvalidArgument("loader: tp_size must be > 0");
  if (spec.tp_rank >= spec.tp_size) {
    return InvalidArgument("loader: tp_rank {} is not below tp_size {}", spec.tp_rank,
                           spec.tp_size);
  }
  std::vector<CompiledRule> rules(spec.rules.size());
  for (size_t i = 0; i < spec.rules.size(); ++i) {
    if (auto problem = CheckRule(spec.rules[i], spec.tp_size, &rules[i].patterns)) {
      return InvalidArgument("loader rule {} ({}): {}: {}", i, LoaderKindName(spec.rules[i].kind),
                             problem->key, problem->message);
    }
  }
  return std::unique_ptr<Loader>(new Loader(spec, store, std::move(rules)));
}

Result<const CanonicalLayout*> Loader::Resolve(std::string_view canonical_name) const {
  std::lock_guard lock(mutex_);
  if (auto it = cache_.find(canonical_name); it != cache_.end()) return it->second.get();
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<CanonicalLayout> layout, Build(canonical_name));
  const CanonicalLayout* out = layout.get();
  cache_.emplace(std::string(canonical_name), std::move(layout));
  return out;
}

Result<std::unique_ptr<CanonicalLayout>> Loader::Build(std::string_view canonical_name) const {
  const std::string name(canonical_name);
  auto layout = std::make_unique<CanonicalLayout>();
  layout->canonical_name = name;
  const uint64_t tp = spec_.tp_size;
  const uint64_t rank = spec_.tp_rank;

  for (size_t j = 0; j < rules_.size(); ++j) {
    const LoaderRule& rule = spec_.rules[j];
    std::smatch match;
    size_t part = 0;
    bool matched = false;
    // Matching may throw on pathological backtracking (error_complexity / error_stack).
    try {
      for (; part < rules_[j].patterns.size(); ++part) {
        if (std::regex_match(name, match, rules_[j].patterns[part])) {
          matched = true;
          break;
        }
      }
    } catch (const std::regex_error& e) {
      return InvalidArgument("tensor '{}': loader rule {} ({}) failed to match: {}", name, j,
                             LoaderKindName(rule.kind), e.what());
    }
    if (!matched) continue;
    layout->rule_index = static_cast<int>(j);
    if (rule.kind == LoaderKind::kSkip) {
      layout->skipped = true;
      return layout;
    }
    const std::string local_name = rule.to.empty() ? name : match.format(rule.to);
    const auto where = [&] {
      return fmt::format("tensor '{}' → local tensor '{}' (loader rule {}, {})", name, local_name,
                         j, LoaderKindName(rule.kind));
    };
    Result<TensorView> found = FindLocal(local_name);
    if (!found.ok()) return NotFound("{}: {} has no such local tensor", where(), Holder());
    const TensorView& local = *found;
    const Shape& local_shape = local.shape;
    layout->dtype = local.dtype;
    layout->local_tensor = local_name;
    if (IsExpertKind(rule.kind)) {
      REFIT_RETURN_NOT_OK(LayOutExperts(rule, part, match, local, tp, rank, where(), layout.get()));
      return layout;
    }
    if (rule.kind == LoaderKind::kQkvInterleaved) {
      REFIT_RETURN_NOT_OK(LayOutInterleavedQkv(rule, part, local, tp, rank, where(), layout.get()));
      return layout;
    }
    CanonicalPiece piece;
    piece.local_tensor = local_name;

    const auto needs_dims = [&](size_t dims) -> Status {
      if (local_shape.size() >= dims) return Status::OK();
      return InvalidArgument("{}: local shape {} has fewer than {} dimensions", where(),
                             ShapeToString(local_shape), dims);
    };
    // The local shape with dim 0 replaced by heads × head_rows canonical rows.
    const auto scaled_dim0 = [&](uint64_t heads, uint64_t head_rows) -> Result<Shape> {
      Shape shape = local_shape;
      uint64_t rows = 0;
      if (__builtin_mul_overflow(heads, head_rows, &rows) ||
          rows > static_cast<uint64_t>(INT64_MAX)) {
        return InvalidArgument("{}: {} × {} canonical rows overflow", where(), heads, head_rows);
      }
      shape[0] = static_cast<int64_t>(rows);
      return shape;
    };
    const auto [local_rows, local_cols] = TwoD(local_shape);
    switch (rule.kind) {
      case LoaderKind::kIdentity:
      case LoaderKind::kRename:
      case LoaderKind::kSkip:
      case LoaderKind::kQkvInterleaved:  // laid out above
      case LoaderKind::kExpertGateUp:
      case LoaderKind::kExpertDown:
      case LoaderKind::kStackedGateUp:
      case LoaderKind::kStackedDown:
        layout->shape = local_shape;
        break;
      case LoaderKind::kRow: {
        REFIT_RETURN_NOT_OK(needs_dims(1));
        REFIT_ASSIGN_OR_RETURN(layout->shape, scaled_dim0(local_rows, tp));
        piece.row_begin = rank * local_rows;
        piece.row_end = piece.row_begin + local_rows;
        break;
      }
      case LoaderKind::kColumn: {
        REFIT_RETURN_NOT_OK(needs_dims(2));
        const std::optional<int64_t> dim1 = Scaled(local_shape[1], tp);
        if (!dim1) return InvalidArgument("{}: canonical dim 1 overflows", where());
        layout->shape = local_shape;
        layout->shape[1] = *dim1;
        piece.row_end = local_rows;
        piece.col_begin = rank * local_cols;
        piece.col_end = piece.col_begin + local_cols;
        break;
      }
      case LoaderKind::kQkv: {
        REFIT_RETURN_NOT_OK(needs_dims(1));
        const uint64_t q_heads = rule.num_heads / tp;
        // With fewer kv heads than ranks, each rank holds one kv head, replicated on
        // tp / num_kv_heads consecutive ranks (Megatron / vLLM GQA).
        const bool replicated = rule.num_kv_heads < tp;
        const uint64_t kv_heads = replicated ? 1 : rule.num_kv_heads / tp;
        const uint64_t heads = q_heads + 2 * kv_heads;
        if (local_rows % heads != 0) {
          return InvalidArgument(
              "{}: local shape {} has {} rows, not a multiple of the {} heads a rank holds ({} q + "
              "2 × {} kv)",
              where(), ShapeToString(local_shape), local_rows, heads, q_heads, kv_heads);
        }
        const uint64_t head_dim = local_rows / heads;
        const uint64_t kv_head_begin =
            replicated ? rank / (tp / rule.num_kv_heads) : rank * kv_heads;
        if (part == 0) {
          REFIT_ASSIGN_OR_RETURN(layout->shape, scaled_dim0(rule.num_heads, head_dim));
          piece.row_begin = rank * q_heads * head_dim;
          piece.row_end = piece.row_begin + q_heads * head_dim;
        } else {
          REFIT_ASSIGN_OR_RETURN(layout->shape, scaled_dim0(rule.num_kv_heads, head_dim));
          piece.row_begin = kv_head_begin * head_dim;
          piece.row_end = piece.row_begin + kv_heads * head_dim;
          piece.local_row_offset = (q_heads + (part - 1) * kv_heads) * head_dim;
        }
        break;
      }
      case LoaderKind::kGateUp: {
        REFIT_RETURN_NOT_OK(needs_dims(1));
        if (local_rows % 2 != 0) {
          return InvalidArgument(
              "{}: local shape {} has an odd number of rows ({}); gate and up "
              "take half each",
              where(), ShapeToString(local_shape), local_rows);
        }
        const uint64_t block = local_rows / 2;
        REFIT_ASSIGN_OR_RETURN(layout->shape, scaled_dim0(block, tp));
        piece.row_begin = rank * block;
        piece.row_end = piece.row_begin + block;
        piece.local_row_offset = part * block;
        break;
      }
      case LoaderKind::kVocab: {
        REFIT_RETURN_NOT_OK(needs_dims(1));
        const uint64_t multiple = rule.pad_to * tp;
        const uint64_t padded = (rule.vocab_size + multiple - 1) / multiple * multiple;
        const uint64_t per_rank = padded / tp;
        if (local_rows != per_rank) {
          return InvalidArgument(
              "{}: local shape {} has {} rows, but vocab_size {} padded to a multiple of pad_to "
              "{} × tp_size {} ({}) gives {} rows per rank",
              where(), ShapeToString(local_shape), local_rows, rule.vocab_size, rule.pad_to, tp,
              padded, per_rank);
        }
        REFIT_ASSIGN_OR_RETURN(layout->shape, scaled_dim0(rule.vocab_size, 1));
        piece.row_begin = std::min(rank * per_rank, rule.vocab_size);
        piece.row_end = std::min((rank + 1) * per_rank, rule.vocab_size);
        break;
      }
    }
    std::tie(layout->rows, layout->cols) = TwoD(layout->shape);
    if (!NumElements(layout->shape).ok()) {
      return InvalidArgument("{}: canonical shape {} overflows", where(),
                             ShapeToString(layout->shape));
    }
    if (rule.kind == LoaderKind::kIdentity || rule.kind == LoaderKind::kRename) {
      piece.row_end = layout->rows;
    }
    if (rule.kind != LoaderKind::kColumn) piece.col_end = layout->cols;
    piece.local_row_length = local_cols;
    piece.id = PieceId(piece.row_begin, piece.row_end, piece.col_begin, piece.col_end);
    // A vocab shard past the vocabulary holds only padding: nothing of the tensor.
    if (piece.row_begin < piece.row_end) layout->pieces.push_back(std::move(piece));
    return layout;
  }

  Result<TensorView> local = FindLocal(name);
  if (!local.ok()) {
    return NotFound("tensor '{}' is neither in {} nor mapped by its loader", name, Holder());
  }
  layout->dtype = local->dtype;
  layout->shape = local->shape;
  layout->local_tensor = name;
  std::tie(layout->rows, layout->cols) = TwoD(layout->shape);
  layout->pieces.push_back(CanonicalPiece{name, 0, layout->rows, 0, layout->cols, 0, layout->cols,
                                          PieceId(0, layout->rows, 0, layout->cols)});
  return layout;
}

// ---- YAML ---------------------------------------------------------------------------------------

namespace {

using internal::YamlNodeKind;
using internal::YamlReader;
using internal::YamlWhere;

std::string RuleKeyList(LoaderKind kind) {
  std::string out;
  for (std::string_view key : kRuleKeys) {
    if (!KeyApplies(kind, key)) continue;
    if (!out.empty()) out += ", ";
    out += key;
  }
  return out;
}

/// Read one rule mapping; `marks` receives the position of each key given.
Status ReadRule(const YamlReader& reader, const YAML::Node& node, const YamlWhere& rule_where,
                LoaderRule* rule, std::map<std::string, YAML::Mark, std::less<>>* marks) {
  if (!node.IsMap()) {
    return reader.Error(rule_where,
                        fmt::format("expected a mapping with a kind, got {}", YamlNodeKind(node)));
  }
  const YAML::Node kind_node = node["kind"];
  // An absent key is a node that throws when asked for its position: ask only a defined one.
  if (!kind_node.IsDefined() || kind_node.IsNull()) {
    return reader.Error(YamlWhere{rule_where.path + ".kind", rule_where.mark},
                        fmt::format("missing; a rule needs one of {}", KindNames()));
  }
  const YamlWhere kind_where{rule_where.path + ".kind", kind_node.Mark()};
  REFIT_ASSIGN_OR_RETURN(const std::string kind_text, reader.Scalar(kind_node, kind_where));
  Result<LoaderKind> kind = ParseLoaderKind(kind_text);
  if (!kind.ok()) return reader.Error(kind_where, kind.status().message());
  rule->kind = *kind;
  return reader.ForEachKey(
      node, rule_where,
      [&](const std::string& key, const YamlWhere& where, const YAML::Node& value) -> Status {
        const YAML::Mark& mark = where.mark;
        if (key == "kind") return Status::OK();
        if (std::find(std::begin(kRuleKeys), std::end(kRuleKeys), key) == std::end(kRuleKeys)) {
          return reader.Error(
              where, fmt::format("unknown key; a {} rule takes {}", LoaderKindName(rule->kind),
                                 RuleKeyList(rule->kind)));
        }
        if (!KeyApplies(rule->kind, key)) {
          return reader.Error(where,
                              fmt::format("does not apply to a {} rule, which takes {}",
                                          LoaderKindName(rule->kind), RuleKeyList(rule->kind)));
        }
        marks->emplace(key, mark);
        std::string* text = key == "match"  ? &rule->match
                            : key == "to"   ? &rule->to
                            : key == "q"    ? &rule->q
                            : key == "k"    ? &rule->k
                            : key == "v"    ? &rule->v
                            : key == "gate" ? &rule->gate
                            : key == "up"   ? &rule->up
                                            : nullptr;
        if (text != nullptr) {
          REFIT_ASSIGN_OR_RETURN(*text, reader.Scalar(value, where));
          return Status::OK();
        }
        if (key == "num_heads" || key == "num_kv_heads") {
          REFIT_ASSIGN_OR_RETURN(const uint64_t heads,
                                 reader.Unsigned(value, where, 1, UINT32_MAX));
          (key == "num_heads" ? rule->num_heads : rule->num_kv_heads) =
              static_cast<uint32_t>(heads);
          return Status::OK();
        }
        if (key == "vocab_size") {
          REFIT_ASSIGN_OR_RETURN(rule->vocab_size, reader.Unsigned(value, where, 1, INT64_MAX));
          return Status::OK();
        }
        if (key == "experts") {
          if (!value.IsSequence()) {
            return reader.Error(where, fmt::format("expected a sequence of expert indices, got {}",
                                                   YamlNodeKind(value)));
          }
          for (const YAML::Node& element : value) {
            REFIT_ASSIGN_OR_RETURN(
                const uint64_t expert,
                reader.Unsigned(element, where.Element(rule->experts.size(), element.Mark()), 0,
                                UINT32_MAX - 1));
            rule->experts.push_back(static_cast<uint32_t>(expert));
          }
          return Status::OK();
        }
        if (key == "expert_group" || key == "num_experts" || key == "expert_tp_rank" ||
            key == "expert_tp_size") {
          const uint64_t min = key == "expert_tp_rank" ? 0 : 1;
          REFIT_ASSIGN_OR_RETURN(const uint64_t n, reader.Unsigned(value, where, min, UINT32_MAX));
          (key == "expert_group"     ? rule->expert_group
           : key == "num_experts"    ? rule->num_experts
           : key == "expert_tp_rank" ? rule->expert_tp_rank
                                     : rule->expert_tp_size) = static_cast<uint32_t>(n);
          return Status::OK();
        }
        REFIT_ASSIGN_OR_RETURN(rule->pad_to, reader.Unsigned(value, where, 1, UINT32_MAX));
        return Status::OK();
      });
}

}  // namespace

namespace {

Result<LoaderSpec> ReadLoaderSpec(std::string_view yaml_text, std::string_view source_name) {
  const YamlReader reader{std::string(source_name)};
  LoaderSpec spec;
  // One document only: YAML::LoadAll of yaml-cpp 0.7 can hang on malformed input.
  REFIT_ASSIGN_OR_RETURN(const YAML::Node root, internal::LoadYamlDocument(yaml_text, source_name));
  if (root.IsNull()) return spec;
  if (!root.IsMap()) {
    return InvalidArgument("{}: expected a mapping with tp_rank, tp_size and rules, got {}",
                           source_name, YamlNodeKind(root));
  }
  YAML::Mark tp_rank_mark = YAML::Mark::null_mark();
  std::vector<YAML::Mark> rule_marks;
  std::vector<std::map<std::string, YAML::Mark, std::less<>>> key_marks;
  const Status read = reader.ForEachKey(
      root, YamlWhere{},
      [&](const std::string& key, const YamlWhere& where, const YAML::Node& value) -> Status {
        if (key == "tp_rank" || key == "tp_size") {
          REFIT_ASSIGN_OR_RETURN(
              const uint64_t n,
              reader.Unsigned(value, where, key == "tp_size" ? 1 : 0, UINT32_MAX));
          if (key == "tp_rank") {
            spec.tp_rank = static_cast<uint32_t>(n);
            tp_rank_mark = where.mark;
          } else {
            spec.tp_size = static_cast<uint32_t>(n);
          }
          return Status::OK();
        }
        if (key != "rules") {
          return reader.Error(where, "unknown key; known keys: tp_rank, tp_size, rules");
        }
        if (value.IsNull()) return Status::OK();
        if (!value.IsSequence()) {
          return reader.Error(
              where, fmt::format("expected a sequence of rules, got {}", YamlNodeKind(value)));
        }
        for (const YAML::Node& element : value) {
          LoaderRule rule;
          key_marks.emplace_back();
          REFIT_RETURN_NOT_OK(
              ReadRule(reader, element,
                       YamlWhere{fmt::format("rules[{}]", spec.rules.size()), element.Mark()},
                       &rule, &key_marks.back()));
          spec.rules.push_back(std::move(rule));
          rule_marks.push_back(element.Mark());
        }
        return Status::OK();
      });
  REFIT_RETURN_NOT_OK(read);
  if (spec.tp_rank >= spec.tp_size) {
    return reader.Error(YamlWhere{"tp_rank", tp_rank_mark},
                        fmt::format("{} is not below tp_size {}", spec.tp_rank, spec.tp_size));
  }
  // The checks that need the whole spec (tp_size may follow the rules).
  std::vector<std::regex> compiled;
  for (size_t i = 0; i < spec.rules.size(); ++i) {
    if (auto problem = CheckRule(spec.rules[i], spec.tp_size, &compiled)) {
      const auto mark = key_marks[i].find(problem->key);
      return reader.Error(YamlWhere{fmt::format("rules[{}].{}", i, problem->key),
                                    mark == key_marks[i].end() ? rule_marks[i] : mark->second},
                          problem->message);
    }
  }
  return spec;
}

}  // namespace

Result<LoaderSpec> LoaderSpecFromYaml(std::string_view yaml_text, std::string_view source_name) {
  // The reader asks yaml-cpp only what does not throw on a loaded document; an exception that
  // still comes stops here, as the project uses none.
  try {
    return ReadLoaderSpec(yaml_text, source_name);
  } catch (const YAML::Exception& e) {
    return InvalidArgument("{}: YAML error: {}", source_name, e.msg);
  }
}

Result<LoaderSpec> LoaderSpecFromYamlFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    if (errno == ENOENT) return NotFound("loader spec file '{}' does not exist", path);
    return IoErrorFromErrno(errno, fmt::format("open loader spec file '{}'", path));
  }
  // Read until end of file, one block past the limit: a pipe's size is not known in advance.
  std::string text(kMaxSpecFileBytes + 1, '\0');
  const size_t n = std::fread(text.data(), 1, text.size(), file);
  const bool failed = std::ferror(file) != 0;
  const int error = errno;
  std::fclose(file);
  if (failed) return IoErrorFromErrno(error, fmt::format("read loader spec file '{}'", path));
  if (n > kMaxSpecFileBytes) {
    return InvalidArgument("loader spec file '{}' exceeds {} bytes; is it a loader spec?", path,
                           kMaxSpecFileBytes);
  }
  text.resize(n);
  return LoaderSpecFromYaml(text, path);
}

}  // namespace refit
