#include "core/yaml_reader.h"

#include <charconv>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit::internal {

std::string_view YamlNodeKind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Scalar:
      return "a scalar";
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

YamlWhere YamlWhere::Key(std::string_view name, const YAML::Mark& key_mark) const {
  return YamlWhere{path.empty() ? std::string(name) : fmt::format("{}.{}", path, name), key_mark};
}

YamlWhere YamlWhere::Element(size_t index, const YAML::Mark& element_mark) const {
  return YamlWhere{fmt::format("{}[{}]", path, index), element_mark};
}

Result<YAML::Node> LoadYamlDocument(std::string_view text, std::string_view source) {
  try {
    return YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) return InvalidArgument("{}: YAML error: {}", source, e.msg);
    return InvalidArgument("{}:{}:{}: YAML syntax error: {}", source, e.mark.line + 1,
                           e.mark.column + 1, e.msg);
  }
}

Status YamlReader::Error(const YamlWhere& where, std::string_view message) const {
  if (where.mark.is_null()) return InvalidArgument("{}: {}: {}", source_, where.path, message);
  return InvalidArgument("{}:{}:{}: {}: {}", source_, where.mark.line + 1, where.mark.column + 1,
                         where.path, message);
}

Result<std::string> YamlReader::Scalar(const YAML::Node& node, const YamlWhere& where) const {
  if (!node.IsScalar()) {
    return Error(where, fmt::format("expected a scalar value, got {}", YamlNodeKind(node)));
  }
  return node.Scalar();
}

Result<int64_t> YamlReader::Integer(const YAML::Node& node, const YamlWhere& where, int64_t min,
                                    int64_t max) const {
  // The scalar is read in place: GCC 12 at -O2 takes a moved-from copy for uninitialized.
  const Result<std::string> scalar = Scalar(node, where);
  if (!scalar.ok()) return scalar.status();
  const std::string& text = *scalar;
  // YAML allows an explicit '+'; from_chars does not.
  const std::string_view digits =
      text.starts_with('+') ? std::string_view(text).substr(1) : std::string_view(text);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  const bool whole = !digits.empty() && end == digits.data() + digits.size();
  if (whole && error == std::errc::result_out_of_range) {
    return Error(where, fmt::format("{} is outside [{}, {}]", text, min, max));
  }
  if (!whole || error != std::errc()) {
    return Error(where, fmt::format("expected an integer, got '{}'", text));
  }
  if (value < min || value > max) {
    return Error(where, fmt::format("{} is outside [{}, {}]", text, min, max));
  }
  return value;
}

Result<uint64_t> YamlReader::Unsigned(const YAML::Node& node, const YamlWhere& where, uint64_t min,
                                      uint64_t max) const {
  const Result<std::string> scalar = Scalar(node, where);
  if (!scalar.ok()) return scalar.status();
  const std::string& text = *scalar;
  const std::string_view digits =
      text.starts_with('+') ? std::string_view(text).substr(1) : std::string_view(text);
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  const bool whole = !digits.empty() && end == digits.data() + digits.size();
  if (!whole || (error != std::errc() && error != std::errc::result_out_of_range)) {
    return Error(where, fmt::format("expected a non-negative integer, got '{}'", text));
  }
  if (error == std::errc::result_out_of_range || value < min || value > max) {
    return Error(where, fmt::format("{} is outside [{}, {}]", text, min, max));
  }
  return value;
}

Status YamlReader::ForEachKey(const YAML::Node& node, const YamlWhere& where,
                              const std::function<Status(const std::string&, const YamlWhere&,
                                                         const YAML::Node&)>& visit) const {
  if (!node.IsMap()) {
    return Error(where, fmt::format("expected a mapping of keys, got {}", YamlNodeKind(node)));
  }
  std::map<std::string, YAML::Mark, std::less<>> seen;
  for (const auto& entry : node) {
    // Copies: yaml-cpp's iterator yields a temporary pair, and nodes are handles.
    const YAML::Node key = entry.first;
    const YAML::Node value = entry.second;
    if (!key.IsScalar()) {
      return Error(YamlWhere{where.path, key.Mark()},
                   fmt::format("keys must be scalars, got {}", YamlNodeKind(key)));
    }
    const std::string& name = key.Scalar();
    const YamlWhere child = where.Key(name, key.Mark());
    const auto [previous, inserted] = seen.emplace(name, key.Mark());
    if (!inserted) {
      return Error(child,
                   fmt::format("duplicate key (first at line {})", previous->second.line + 1));
    }
    REFIT_RETURN_NOT_OK(visit(name, child, value));
  }
  return Status::OK();
}

}  // namespace refit::internal
