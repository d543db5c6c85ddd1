// YamlReader: reading a YAML document against a schema, with errors that name the source, the
// line and column, and the key path ("tuning.encode_workers", "rules[2].num_heads"). Both YAML
// files refit reads go through it: the configuration (src/config/config_file.cc) and the loader
// files (src/receiver/loader.cc). Internal; yaml-cpp stays out of the installed headers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <yaml-cpp/yaml.h>

#include "refit/status.h"

namespace refit::internal {

/// What a node is, for errors: "null", "a scalar", "a sequence", "a mapping" or "nothing".
std::string_view YamlNodeKind(const YAML::Node& node);

/// Where a value sits: its key path and the position of its key in the document (a null mark
/// when it has none, e.g. the top level or a value given beside the file).
struct YamlWhere {
  std::string path;
  YAML::Mark mark = YAML::Mark::null_mark();

  /// The key `name` below this one ("a" + "b" → "a.b"), at `key_mark`.
  YamlWhere Key(std::string_view name, const YAML::Mark& key_mark) const;
  /// The element `index` of this sequence ("a" → "a[2]"), at `element_mark`.
  YamlWhere Element(size_t index, const YAML::Mark& element_mark) const;
};

/// Parse `text` as one YAML document (null for an empty one). yaml-cpp's exceptions stop here
/// (the project uses none): InvalidArgument naming `source`, the line and column.
Result<YAML::Node> LoadYamlDocument(std::string_view text, std::string_view source);

/// Reads values of a loaded document. yaml-cpp is only asked for node types, scalars and marks,
/// none of which throw on loaded nodes.
///
/// Thread-safety: const member functions may be called concurrently.
class YamlReader {
 public:
  explicit YamlReader(std::string source) : source_(std::move(source)) {}
  virtual ~YamlReader() = default;

  /// InvalidArgument "source:line:column: path: message" (without the position when the mark is
  /// null). A reader that knows more about where a value came from says so instead.
  virtual Status Error(const YamlWhere& where, std::string_view message) const;

  /// The node's scalar text. Errors: not a scalar.
  Result<std::string> Scalar(const YAML::Node& node, const YamlWhere& where) const;
  /// A decimal integer in [min, max] (YAML's explicit '+' allowed).
  Result<int64_t> Integer(const YAML::Node& node, const YamlWhere& where, int64_t min,
                          int64_t max) const;
  /// A non-negative decimal integer in [min, max].
  Result<uint64_t> Unsigned(const YAML::Node& node, const YamlWhere& where, uint64_t min,
                            uint64_t max) const;

  /// Call `visit(name, where, value)` for each key of mapping `node` in document order. Errors:
  /// `node` is not a mapping; a key that is not a scalar; a repeated key (naming the first's
  /// line); the first error of `visit`.
  Status ForEachKey(const YAML::Node& node, const YamlWhere& where,
                    const std::function<Status(const std::string& name, const YamlWhere& key,
                                               const YAML::Node& value)>& visit) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

}  // namespace refit::internal
