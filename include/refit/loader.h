// Loaders: how a receiver holds canonical (checkpoint-coordinate) tensors in its own layout.
//
// The wire speaks canonical tensors. An inference worker holds them its own way: renamed, left
// out, sharded by tensor parallelism (TP), fused (q,k,v → qkv_proj; gate,up → gate_up_proj),
// padded (a vocabulary-parallel embedding). A loader is a *location transform*: canonical element
// → (local tensor, local element) or "not mine", so a sharded receiver applies a sparse delta in
// O(changes) with no dense staging buffer. Values are bit patterns, so XOR, OVERWRITE, ADD and
// FULL stay exact through any slicing.
//
// Geometry. Every canonical tensor is seen as 2-D: rows = shape[0], cols = the product of the
// other extents (a 1-D tensor is [N, 1], a 0-d tensor [1, 1]; a stacked expert tensor [E, R, C]
// is [E·R, C]); canonical element i is row i / cols, col i % cols. What a receiver holds of a
// tensor is a list of *pieces*: rectangles rows [r0, r1) × cols [c0, c1), each stored row by row in
// one local tensor, starting at a local row, with local rows of a given length. A piece's partial
// state digest is Σ h(canonical index, bits) over its elements, so the distinct pieces of a TP
// group add up (mod 2^64) to the producer's whole-tensor digest, and replicated copies of one
// rectangle (GQA kv heads when kv heads < TP; norms in every shard) carry the same piece id and
// must agree.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/weight_store.h"

namespace refit {

/// How one rule maps the canonical tensors it matches.
enum class LoaderKind : uint8_t {
  /// The local tensor has the canonical name (or `to`) and the canonical shape. The default for
  /// tensors no rule matches.
  kIdentity,
  /// The local tensor is named by `to` (with $1… from `match`) and has the canonical shape.
  kRename,
  /// The receiver does not hold the tensor: its items are ignored.
  kSkip,
  /// TP shard of dim 0: rank r holds rows [r·R/TP, (r+1)·R/TP); the local shape is
  /// [R/TP, rest…].
  kRow,
  /// TP shard of dim 1: rank r holds block r of shape[1] (for every index of dims ≥ 2); the local
  /// shape is [shape[0], shape[1]/TP, rest…].
  kColumn,
  /// q, k and v fused into one local tensor per rank: rows [q rows of the rank's heads | k rows of
  /// its kv heads | v rows of its kv heads]. With num_kv_heads < TP each kv head is replicated on
  /// TP / num_kv_heads consecutive ranks. head_dim is derived from the local shape. Weights
  /// [rows, hidden] and biases [rows] alike.
  kQkv,
  /// Megatron-Core's `linear_qkv`: q, k and v fused per query group. A rank holds the query groups
  /// (= kv heads) [r·G/TP, (r+1)·G/TP) and lays each out as [the group's q heads | its k head |
  /// its v head]. Requires num_kv_heads % TP == 0. Weights and biases alike.
  kQkvInterleaved,
  /// gate and up fused into one local tensor per rank: [gate rows block r | up rows block r].
  kGateUp,
  /// Vocabulary-parallel embedding or LM head, canonical [V, rest…]: the vocabulary is padded to
  /// Vp = V rounded up to a multiple of pad_to × TP, rank r holds padded rows
  /// [r·Vp/TP, (r+1)·Vp/TP) as local [Vp/TP, rest…]. Padding rows (≥ V) are not canonical: never
  /// written, in no piece digest.
  kVocab,
  /// One expert's gate and up (canonical [I, H] each, the expert's index in the capture group
  /// `expert_group` of the name) into a stack of the experts a rank holds, vLLM's `w13_weight`
  /// [local experts, 2·I/TP, H]: slot s holds [gate rows block r | up rows block r].
  kExpertGateUp,
  /// One expert's down projection (canonical [H, I]) into a stack, vLLM's `w2_weight`
  /// [local experts, H, I/TP]: slot s holds column block r.
  kExpertDown,
  /// All experts' gate and up stacked in one canonical tensor [E, 2·I, H], gate rows first (the
  /// `gate_up_proj` of Hugging Face transformers ≥ 5), into the same local stack as
  /// kExpertGateUp.
  kStackedGateUp,
  /// All experts' down projections stacked, canonical [E, H, I] (transformers ≥ 5's
  /// `down_proj`), into the same local stack as kExpertDown.
  kStackedDown,
};

/// Return "identity", "rename", "skip", "row", "column", "qkv", "qkv_interleaved", "gate_up",
/// "vocab", "expert_gate_up", "expert_down", "stacked_gate_up" or "stacked_down".
std::string_view LoaderKindName(LoaderKind kind);
/// Parse a kind as LoaderKindName spells it. Errors: InvalidArgument listing the accepted names.
Result<LoaderKind> ParseLoaderKind(std::string_view text);

/// One declarative rule. Patterns are ECMAScript regular expressions matched against the whole
/// canonical name; `to` is a replacement template ($1…$99, $&, $$) over the match. Fields a kind
/// does not use are ignored. Every member has a default, so designated initializers may name
/// only the ones a rule needs: `{.kind = LoaderKind::kRow, .match = "…"}`.
struct LoaderRule {
  LoaderKind kind = LoaderKind::kIdentity;
  /// The canonical names the rule maps (every kind but qkv, qkv_interleaved and gate_up).
  std::string match{};
  /// The local tensor's name; empty: the canonical name. Required for rename, the qkv kinds and
  /// gate_up. For qkv / gate_up the groups come from whichever of q/k/v (gate/up) matched, so those
  /// patterns should capture the same groups.
  std::string to{};
  /// The qkv kinds: the patterns of the q, k and v canonical tensors.
  std::string q{};
  std::string k{};
  std::string v{};
  /// kGateUp: the patterns of the gate and up canonical tensors.
  std::string gate{};
  std::string up{};
  /// The qkv kinds: attention heads and kv heads (query groups) of the whole model (GQA:
  /// num_kv_heads ≤ num_heads). kQkv requires num_heads % TP == 0, and num_kv_heads % TP == 0 or
  /// TP % num_kv_heads == 0; kQkvInterleaved requires num_kv_heads % TP == 0.
  uint32_t num_heads = 0;
  uint32_t num_kv_heads = 0;
  /// kVocab: the canonical vocabulary size V (required: the canonical shape is not known when the
  /// loader is bound) and the padding multiple per rank (Megatron / vLLM pad to 64).
  uint64_t vocab_size = 0;
  uint64_t pad_to = 64;
  /// The expert kinds (expert_*, stacked_*):
  /// - expert_group: the capture group of the pattern that holds the global expert index
  ///   (expert_* kinds; required, ≥ 1);
  /// - num_experts: the experts of the whole layer, E (required by the stacked kinds when
  ///   `experts` is given; otherwise it only bounds the indices);
  /// - experts: the global experts the local stack holds, slot by slot (expert parallelism:
  ///   vLLM's expert map). Empty: every expert, slot = expert index;
  /// - expert_tp_rank / expert_tp_size: the TP coordinates the expert stacks are split by, when
  ///   they differ from the spec's (vLLM with expert parallelism splits experts, not their
  ///   matrices: expert_tp_size 1). expert_tp_size 0: the spec's.
  uint32_t expert_group = 0;
  uint32_t num_experts = 0;
  std::vector<uint32_t> experts{};
  uint32_t expert_tp_rank = 0;
  uint32_t expert_tp_size = 0;
};

/// A receiver's loader: its TP coordinates and its rules. The first rule that matches a canonical
/// name decides; a name no rule matches is identity when the store has a tensor of that name.
/// Overlaps are not detected: that fallback would also map a canonical name onto a local tensor
/// that rules fill (a fused qkv_proj), and two rules may target one local region; producers send
/// canonical names only, so a correct spec never meets either.
struct LoaderSpec {
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  std::vector<LoaderRule> rules{};
};

/// Parse a loader spec from YAML: a mapping with keys `tp_rank`, `tp_size` and `rules`, a sequence
/// of mappings such as `{kind: row, match: '...', to: '...'}` or
/// `{kind: qkv, q: '...', k: '...', v: '...', to: '...', num_heads: 8, num_kv_heads: 2}`.
/// `source_name` names the text in errors (a file name).
/// Errors: InvalidArgument naming the source, line and column, the rule index and the key, for a
/// syntax error, an unknown key (or one the rule's kind does not use), a missing required key, a
/// bad value or pattern, or tp_rank ≥ tp_size.
Result<LoaderSpec> LoaderSpecFromYaml(std::string_view yaml_text, std::string_view source_name);
/// Read and parse a loader spec file. Errors: NotFound (no such file), IoError, and as
/// LoaderSpecFromYaml.
Result<LoaderSpec> LoaderSpecFromYamlFile(const std::string& path);

/// One rectangle of a canonical tensor held in one local tensor.
struct CanonicalPiece {
  /// The local tensor (in the receiver's store) that holds the piece.
  std::string local_tensor;
  /// The rectangle, in the canonical tensor's 2-D view: rows [row_begin, row_end) × cols
  /// [col_begin, col_end).
  uint64_t row_begin = 0;
  uint64_t row_end = 0;
  uint64_t col_begin = 0;
  uint64_t col_end = 0;
  /// Canonical (r, c) lives at local element
  /// (local_row_offset + r − row_begin) · local_row_length + (c − col_begin).
  /// local_row_length ≥ col_end − col_begin.
  uint64_t local_row_offset = 0;
  uint64_t local_row_length = 0;
  /// "rows r0:r1 cols c0:c1": a function of the rectangle only, so copies of one rectangle held
  /// by different shards carry the same id.
  std::string id;

  uint64_t numel() const { return (row_end - row_begin) * (col_end - col_begin); }
};

/// Return the piece id of a rectangle: "rows r0:r1 cols c0:c1".
std::string PieceId(uint64_t row_begin, uint64_t row_end, uint64_t col_begin, uint64_t col_end);

/// Return the partial digest of `piece` of a canonical tensor with `canonical_cols` columns,
/// read from `local` (the piece's local tensor). Complexity: O(piece elements).
uint64_t PieceDigestOf(const CanonicalPiece& piece, uint64_t canonical_cols,
                       const TensorView& local);

/// What a receiver holds of one canonical tensor, as its loader resolved it.
struct CanonicalLayout {
  std::string canonical_name;
  /// The receiver does not hold the tensor (a skip rule); nothing below is set.
  bool skipped = false;
  /// The canonical dtype and shape the receiver expects items to carry.
  DType dtype = DType::kUInt8;
  Shape shape;
  /// The 2-D view the pieces are drawn in: rows = shape[0], cols = the product of the rest; the
  /// stacked expert kinds use rows = shape[0] × shape[1] (an expert's matrix rows are then rows
  /// of the view). Either way canonical element i is (i / cols, i % cols).
  uint64_t rows = 0;
  uint64_t cols = 0;
  /// The pieces this receiver holds, disjoint. May be empty (a vocab shard holding only padding).
  std::vector<CanonicalPiece> pieces;
  /// The local tensor the tensor maps onto (every piece's, even when there is none).
  std::string local_tensor;
  /// The rule that produced this layout, or -1 for the implicit identity.
  int rule_index = -1;

  /// Whether one piece covers the whole tensor: only then can the producer's per-item digest be
  /// checked at this receiver alone.
  bool held_whole() const {
    return pieces.size() == 1 && pieces[0].row_begin == 0 && pieces[0].row_end == rows &&
           pieces[0].col_begin == 0 && pieces[0].col_end == cols;
  }
};

/// A loader bound to one store: it resolves canonical names lazily, on first use, against the
/// store's local tensors, and caches each layout.
///
/// Thread-safety: Resolve may be called concurrently (the cache is guarded by a mutex); returned
/// layouts are immutable and live as long as the loader. The store must outlive the loader and
/// must not gain or lose tensors while Resolve runs.
class Loader {
 public:
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// Validate `spec` and bind it to `store` (which must outlive the loader; attach the loader to
  /// that same store). Nothing is resolved yet. Errors: InvalidArgument naming the rule index and
  /// the key (tp_rank ≥ tp_size, a bad pattern, a missing parameter, heads that do not divide by
  /// TP).
  static Result<std::unique_ptr<Loader>> Make(const LoaderSpec& spec, const WeightStore& store);
  /// Validate `spec` and bind it to the names, dtypes and shapes of `locals` instead of a store:
  /// their bytes are never read (they may be empty, or device memory). A trainer rank resolves
  /// what it holds this way (ProducerLayoutFromLoader, refit/loader_layout.h). Errors: as Make,
  /// and AlreadyExists for two locals of one name.
  static Result<std::unique_ptr<Loader>> ForShapes(const LoaderSpec& spec,
                                                   std::span<const TensorView> locals);

  /// Return the layout of `canonical_name`, resolving it on first use (O(rules) regex matches,
  /// then cached; errors are not cached).
  /// Errors: NotFound when a rule names a local tensor the store lacks (naming both tensors), or
  /// when no rule matches and the store has no tensor of that name; InvalidArgument when the
  /// local tensor's shape does not fit the rule (naming both tensors and the shape).
  Result<const CanonicalLayout*> Resolve(std::string_view canonical_name) const;

  const LoaderSpec& spec() const { return spec_; }
  /// The store this loader was bound to; nullptr for a loader made by ForShapes.
  const WeightStore* store() const { return store_; }

 private:
  struct CompiledRule;
  Loader(LoaderSpec spec, const WeightStore* store, std::vector<CompiledRule> rules);
  static Result<std::unique_ptr<Loader>> Compile(const LoaderSpec& spec, const WeightStore* store);
  Result<std::unique_ptr<CanonicalLayout>> Build(std::string_view canonical_name) const;
  /// The local tensor `name` (from the store, or the shapes ForShapes was given).
  Result<TensorView> FindLocal(std::string_view name) const;
  /// "the receiver's store" or "the rank's local tensors", for errors.
  std::string_view Holder() const;

  LoaderSpec spec_;
  const WeightStore* store_;
  /// ForShapes' locals, by name, with empty bytes.
  std::map<std::string, TensorView, std::less<>> shapes_;
  std::vector<CompiledRule> rules_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, std::unique_ptr<CanonicalLayout>, std::less<>> cache_;
};

}  // namespace refit
