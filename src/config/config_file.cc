#include "config_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>
#include <zstd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

#include "codec/values.h"
#include "core/yaml_reader.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "util/environment.h"

namespace refit::config {

Result<uint64_t> ParseByteSize(const std::string& text) {
  struct Unit {
    std::string_view suffix;
    uint64_t factor;
  };
  // Longest suffixes first so "KiB" is not read as "B".
  static constexpr Unit kUnits[] = {
      {"KiB", uint64_t{1} << 10},
      {"MiB", uint64_t{1} << 20},
      {"GiB", uint64_t{1} << 30},
      {"TiB", uint64_t{1} << 40},
      {"KB", 1'000},
      {"MB", 1'000'000},
      {"GB", 1'000'000'000},
      {"TB", 1'000'000'000'000},
      {"K", uint64_t{1} << 10},
      {"M", uint64_t{1} << 20},
      {"G", uint64_t{1} << 30},
      {"B", 1},
  };
  // 2^64: the first byte count a uint64_t cannot hold (exact as a double).
  constexpr double kByteCountLimit = 18446744073709551616.0;
  std::string_view number = text;
  uint64_t factor = 1;
  for (const Unit& unit : kUnits) {
    if (number.size() > unit.suffix.size() && number.ends_with(unit.suffix)) {
      number.remove_suffix(unit.suffix.size());
      factor = unit.factor;
      break;
    }
  }
  const char* const begin = number.data();
  const char* const end = number.data() + number.size();
  // Whole numbers are parsed exactly: a double holds only 53 bits.
  uint64_t whole = 0;
  auto [whole_end, whole_error] = std::from_chars(begin, end, whole);
  if (whole_error == std::errc() && whole_end == end) {
    if (whole > std::numeric_limits<uint64_t>::max() / factor) {
      return InvalidArgument("byte size '{}' exceeds 2^64 - 1 bytes", text);
    }
    return whole * factor;
  }
  double value = 0;
  auto [value_end, value_error] = std::from_chars(begin, end, value);
  if (number.empty() || value_error != std::errc() || value_end != end || !std::isfinite(value) ||
      value < 0) {
    return InvalidArgument("'{}' is not a byte size (examples: 4096, 64MiB, 1.5GiB, 2GB)", text);
  }
  const double bytes = std::round(value * static_cast<double>(factor));
  if (bytes >= kByteCountLimit) {
    return InvalidArgument("byte size '{}' exceeds 2^64 - 1 bytes", text);
  }
  return static_cast<uint64_t>(bytes);
}

namespace {

// Upstream's `refit_transport` values and the schemes they select.
constexpr std::pair<std::string_view, std::string_view> kUpstreamTransports[] = {
    {"vllm_zmq_sparse", "zmq://"},
    {"vllm_s3_sparse", "s3://"},
};

// The zmq transport's bound on `retries` (kMaxRetries, src/transport/zmq/zmq_config.h): beyond it a
// value is a mistake, and reporting it here names the key and line.
constexpr int64_t kMaxZmqRetries = 100;

// A day: longer than any control request may sensibly take, so that a value in milliseconds
// typed as seconds is reported instead of obeyed.
constexpr double kMaxRequestTimeoutSeconds = 24.0 * 3600.0;

// A configuration is a few kilobytes; 16 MiB leaves room for a fleet of 100k receivers (about
// 80 bytes each) while bounding what a wrong path (a model file) makes us read.
constexpr size_t kMaxConfigFileBytes = size_t{16} << 20;

constexpr uint16_t kMaxPort = 65535;

// Keys of NeMo RL's configuration that refit has no use for, with the reason shown to a user
// who copies them over. Everything else unknown is reported as a plain unknown key.
constexpr std::pair<std::string_view, std::string_view> kUpstreamOnlyKeys[] = {
    {"storage",
     "refit takes no S3 storage group; name the bucket and prefix in the transport URI "
     "(s3://<bucket>/<prefix>?endpoint=...)"},
    {"verify_samples_per_payload",
     "refit verifies the whole model state by digests at every flush, so sampled checks have no "
     "counterpart"},
    {"delta_compression.delta_load_batch_size_bytes",
     "a refit receiver applies each payload in place, with no dense delta batches to size"},
    {"tuning.apply_batch_size",
     "a refit receiver applies payloads one at a time in its own process (no RPC batches); "
     "tuning.apply_queue_depth bounds the queue"},
    {"tuning.partition_workers",
     "a refit receiver applies into one weight store, with no payload partitioning"},
    {"tuning.zmq_relay_payload_workers", "refit's zmq relay has no such thread pool"},
    {"tuning.zmq_relay_forward_workers", "refit's zmq relay has no such thread pool"},
};

// Parse a whole unsigned decimal number; nullopt for anything else.
std::optional<uint64_t> ParseUnsigned(std::string_view text) {
  uint64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
    return std::nullopt;
  }
  return value;
}

// Return an empty string when `text` is host:port with a non-empty host and a port in
// [1, 65535]; otherwise what is wrong with it.
std::string HostPortProblem(std::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return "has no :port";
  if (colon == 0) return "has no host";
  const std::optional<uint64_t> port = ParseUnsigned(text.substr(colon + 1));
  if (!port || *port == 0 || *port > kMaxPort) return "has no port in [1, 65535]";
  return "";
}

// Whether `name` is a portable environment variable name (POSIX: letters, digits, '_', not
// starting with a digit).
bool IsEnvVarName(std::string_view name) {
  if (name.empty() || (name[0] >= '0' && name[0] <= '9')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// Where a value sits: its key path ("tuning.encode_workers", "receivers[2].data") and the
// position of its key in the file.
using Where = internal::YamlWhere;
using internal::YamlNodeKind;

class ConfigReader;

// A key of a mapping and how to read its (non-null) value.
struct KeySpec {
  std::string_view name;
  std::function<Status(ConfigReader&, const YAML::Node&, const Where&)> read;
};

// Walks a loaded YAML document into a RefitConfig, producing errors that name the source, line,
// column and key path (internal::YamlReader), or the flag or keyword that gave the value.
class ConfigReader : public internal::YamlReader {
 public:
  explicit ConfigReader(std::string_view source) : YamlReader(std::string(source)) {}

  // Name `origin` (a flag, a keyword) as the giver of the value at `key` and below.
  void SetOrigin(std::string key, std::string origin) {
    origins_.insert_or_assign(std::move(key), std::move(origin));
  }

  Status Error(const Where& where, std::string_view message) const override {
    if (const std::string* origin = OriginOf(where.path)) {
      return InvalidArgument("{} ({}): {}", *origin, where.path, message);
    }
    return YamlReader::Error(where, message);
  }

  // Read the keys of mapping `node` (null: no keys). Unknown and repeated keys are errors;
  // null values keep their defaults. Every key read is remembered with its position.
  Status ReadMap(const YAML::Node& node, const Where& where, std::span<const KeySpec> keys) {
    if (node.IsNull()) return Status::OK();
    return ForEachKey(
        node, where, [&](const std::string& name, const Where& child, const YAML::Node& value) {
          const auto spec = std::find_if(keys.begin(), keys.end(),
                                         [&](const KeySpec& k) { return k.name == name; });
          if (spec == keys.end()) return UnknownKey(child, keys);
          if (value.IsNull()) return Status::OK();
          present_.emplace(child.path, child.mark);
          return spec->read(*this, value, child);
        });
  }

  // The position of the key at `path` when the file gave it a non-null value.
  std::optional<YAML::Mark> Present(std::string_view path) const {
    const auto it = present_.find(path);
    if (it == present_.end()) return std::nullopt;
    return it->second;
  }

  Result<std::string> ReadScalar(const YAML::Node& node, const Where& where) const {
    return Scalar(node, where);
  }

  Status ReadString(const YAML::Node& node, const Where& where, std::string* out) const {
    REFIT_ASSIGN_OR_RETURN(*out, ReadScalar(node, where));
    return Status::OK();
  }

  Status ReadNonEmptyString(const YAML::Node& node, const Where& where, std::string* out) const {
    REFIT_ASSIGN_OR_RETURN(std::string text, ReadScalar(node, where));
    if (text.empty()) return Error(where, "must not be empty");
    *out = std::move(text);
    return Status::OK();
  }

  template <typename Int>
  Status ReadInteger(const YAML::Node& node, const Where& where, int64_t min, int64_t max,
                     Int* out) const {
    REFIT_ASSIGN_OR_RETURN(const int64_t value, Integer(node, where, min, max));
    *out = static_cast<Int>(value);
    return Status::OK();
  }

  Status ReadPositiveByteSize(const YAML::Node& node, const Where& where, uint64_t* out) const {
    REFIT_ASSIGN_OR_RETURN(const std::string text, ReadScalar(node, where));
    Result<uint64_t> bytes = ParseByteSize(text);
    if (!bytes.ok()) return Error(where, bytes.status().message());
    if (*bytes == 0) return Error(where, fmt::format("'{}' must be a positive byte size", text));
    *out = *bytes;
    return Status::OK();
  }

  Status ReadBool(const YAML::Node& node, const Where& where, bool* out) const {
    REFIT_ASSIGN_OR_RETURN(const std::string text, ReadScalar(node, where));
    // yaml-cpp's own spelling rules (true/false, yes/no, on/off, y/n in three cases), as a
    // NeMo RL file written for PyYAML may use any of them; decode does not throw.
    if (!YAML::convert<bool>::decode(node, *out)) {
      return Error(where, fmt::format("expected true or false, got '{}'", text));
    }
    return Status::OK();
  }

  Status ReadStringList(const YAML::Node& node, const Where& where,
                        std::vector<std::string>* out) const {
    if (!node.IsSequence()) {
      return Error(where, fmt::format("expected a sequence, got {}", YamlNodeKind(node)));
    }
    out->clear();
    for (const YAML::Node& element : node) {
      const Where at = where.Element(out->size(), element.Mark());
      std::string text;
      REFIT_RETURN_NOT_OK(ReadNonEmptyString(element, at, &text));
      out->push_back(std::move(text));
    }
    return Status::OK();
  }

 private:
  Status UnknownKey(const Where& where, std::span<const KeySpec> keys) const {
    for (const auto& [path, reason] : kUpstreamOnlyKeys) {
      if (path == where.path) {
        return Error(where, fmt::format("upstream key not used by refit: {}", reason));
      }
    }
    std::string known;
    for (const KeySpec& key : keys) {
      if (!known.empty()) known += ", ";
      known += key.name;
    }
    return Error(where, fmt::format("unknown key; known keys: {}", known));
  }

  // The origin of the override that gave `path` or a mapping or list above it, if any.
  const std::string* OriginOf(std::string_view path) const {
    const std::string* found = nullptr;
    size_t found_length = 0;
    for (const auto& [key, origin] : origins_) {
      const bool covers = path == key || (path.starts_with(key) && path.size() > key.size() &&
                                          (path[key.size()] == '.' || path[key.size()] == '['));
      if (covers && key.size() >= found_length) {
        found = &origin;
        found_length = key.size();
      }
    }
    return found;
  }

  std::map<std::string, YAML::Mark, std::less<>> present_;
  std::map<std::string, std::string, std::less<>> origins_;
};

// ---- The schema: one KeySpec table per mapping ----------------------------------------------

Status ReadTransport(ConfigReader& reader, const YAML::Node& node, const Where& where,
                     std::string* out) {
  REFIT_ASSIGN_OR_RETURN(std::string text, reader.ReadScalar(node, where));
  for (const auto& [upstream, uri] : kUpstreamTransports) {
    if (text == upstream) text = uri;
  }
  Result<TransportUri> uri = TransportUri::Parse(text);
  if (!uri.ok()) return reader.Error(where, uri.status().message());
  *out = std::move(text);
  return Status::OK();
}

Status ReadEncoding(ConfigReader& reader, const YAML::Node& node, const Where& where, Op* out) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, reader.ReadScalar(node, where));
  constexpr Op kDeltaOps[] = {Op::kXor, Op::kOverwrite, Op::kAdd};
  for (const Op op : kDeltaOps) {
    if (OpName(op) == text) {
      *out = op;
      return Status::OK();
    }
  }
  return reader.Error(where, fmt::format("'{}' is not one of xor, overwrite, add", text));
}

Status ReadDeltaDType(ConfigReader& reader, const YAML::Node& node, const Where& where,
                      DType* out) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, reader.ReadScalar(node, where));
  Result<DType> dtype = ParseDType(text);
  // The tracker's own test: a float32 tensor must be able to carry deltas of this dtype.
  if (!dtype.ok() || !AddSupported(DType::kFloat32, *dtype)) {
    return reader.Error(where, fmt::format("'{}' cannot carry add deltas; allowed: float16, "
                                           "bfloat16, float32, float64 (or fp16, bf16, fp32)",
                                           text));
  }
  *out = *dtype;
  return Status::OK();
}

Status ReadEnvVarName(ConfigReader& reader, const YAML::Node& node, const Where& where,
                      std::string* out) {
  REFIT_ASSIGN_OR_RETURN(std::string name, reader.ReadScalar(node, where));
  if (!IsEnvVarName(name)) {
    return reader.Error(where, fmt::format("'{}' is not an environment variable name (letters, "
                                           "digits and '_', not starting with a digit)",
                                           name));
  }
  *out = std::move(name);
  return Status::OK();
}

Status ReadZstdThreads(ConfigReader& reader, const YAML::Node& node, const Where& where) {
  int threads = 0;
  REFIT_RETURN_NOT_OK(
      reader.ReadInteger(node, where, 0, std::numeric_limits<int>::max(), &threads));
  if (threads != 0) {
    return reader.Error(where, fmt::format("{} is not supported: refit compresses each payload on "
                                           "one thread (upstream's default, 0) and runs "
                                           "tuning.serialize_workers payloads in parallel",
                                           threads));
  }
  return Status::OK();
}

// `zero_allowed`: 0 is a value of its own (e.g. "no lease"), not a mistake.
Status ReadSeconds(ConfigReader& reader, const YAML::Node& node, const Where& where,
                   std::chrono::milliseconds* out, bool zero_allowed = false) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, reader.ReadScalar(node, where));
  double seconds = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), seconds);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() ||
      !std::isfinite(seconds)) {
    return reader.Error(where, fmt::format("expected a number of seconds, got '{}'", text));
  }
  if (seconds < 0 || (seconds == 0 && !zero_allowed) || seconds > kMaxRequestTimeoutSeconds) {
    return reader.Error(where, fmt::format("{} is outside {}0, {}] seconds", text,
                                           zero_allowed ? "[" : "(", kMaxRequestTimeoutSeconds));
  }
  *out = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
  return Status::OK();
}

Status ReadControlUrl(ConfigReader& reader, const YAML::Node& node, const Where& where,
                      std::string* out) {
  REFIT_ASSIGN_OR_RETURN(std::string text, reader.ReadScalar(node, where));
  std::string_view rest = text;
  if (rest.starts_with("http://")) {
    rest.remove_prefix(std::string_view("http://").size());
  } else if (rest.starts_with("https://")) {
    rest.remove_prefix(std::string_view("https://").size());
  } else {
    return reader.Error(where, fmt::format("'{}' is not an http:// or https:// URL", text));
  }
  const std::string problem = HostPortProblem(rest.substr(0, rest.find('/')));
  if (!problem.empty()) {
    return reader.Error(
        where, fmt::format("'{}' {} (expected http(s)://host:port[/prefix])", text, problem));
  }
  *out = std::move(text);
  return Status::OK();
}

Status ReadReceivers(ConfigReader& reader, const YAML::Node& node, const Where& where,
                     std::vector<ReceiverConfig>* out, std::vector<YAML::Mark>* marks) {
  if (!node.IsSequence()) {
    return reader.Error(where, fmt::format("expected a sequence of {{control, data}} entries, "
                                           "got {}",
                                           YamlNodeKind(node)));
  }
  out->clear();
  marks->clear();
  for (const YAML::Node& entry : node) {
    const Where at{fmt::format("{}[{}]", where.path, out->size()), entry.Mark()};
    ReceiverConfig receiver;
    const KeySpec keys[] = {
        {"control", [&](ConfigReader& r, const YAML::Node& v,
                        const Where& w) { return ReadControlUrl(r, v, w, &receiver.control); }},
        {"data", [&](ConfigReader& r, const YAML::Node& v,
                     const Where& w) { return r.ReadNonEmptyString(v, w, &receiver.data); }},
    };
    if (!entry.IsMap()) {
      return reader.Error(
          at, fmt::format("expected a {{control, data}} mapping, got {}", YamlNodeKind(entry)));
    }
    REFIT_RETURN_NOT_OK(reader.ReadMap(entry, at, keys));
    // `data` is checked against the transport once the whole file is read (CrossChecks): an
    // object store's receivers have none.
    if (receiver.control.empty()) {
      return reader.Error(at,
                          "missing control: each receiver needs control (its "
                          "http(s)://host:port) and, on a relay tree, data (its data endpoint)");
    }
    out->push_back(std::move(receiver));
    marks->push_back(entry.Mark());
  }
  return Status::OK();
}

// Checks that need the whole file: settings given twice, and values whose syntax depends on
// another key.
class CrossChecks {
 public:
  CrossChecks(ConfigReader& reader, RefitConfig& config, std::vector<YAML::Mark> receiver_marks)
      : reader_(reader), config_(config), receiver_marks_(std::move(receiver_marks)) {}

  Status Run() {
    REFIT_RETURN_NOT_OK(CheckTransportGivenOnce());
    REFIT_RETURN_NOT_OK(AdoptUriRetries());
    REFIT_RETURN_NOT_OK(CheckTls());
    return CheckReceivers();
  }

 private:
  Where At(std::string path) const {
    const std::optional<YAML::Mark> mark = reader_.Present(path);
    return Where{std::move(path), mark.value_or(YAML::Mark::null_mark())};
  }

  Status CheckTransportGivenOnce() const {
    if (reader_.Present("transport") && reader_.Present("refit_transport")) {
      return reader_.Error(At("refit_transport"),
                           "give transport or upstream's refit_transport, not both");
    }
    return Status::OK();
  }

  // A zmq URI's `retries` and tuning.zmq_retries are one setting: take it from the URI when the
  // file gives it there, refuse two different values.
  Status AdoptUriRetries() {
    const Where transport =
        At(reader_.Present("refit_transport") ? "refit_transport" : "transport");
    REFIT_ASSIGN_OR_RETURN(const TransportUri uri, TransportUri::Parse(config_.transport));
    const std::string* text = uri.Param("retries");
    if (!uri.is_zmq() || text == nullptr) return Status::OK();
    const std::optional<uint64_t> retries = ParseUnsigned(*text);
    if (!retries || *retries > static_cast<uint64_t>(kMaxZmqRetries)) {
      return reader_.Error(transport,
                           fmt::format("retries={} is outside [0, {}]", *text, kMaxZmqRetries));
    }
    if (reader_.Present("tuning.zmq_retries") &&
        *retries != static_cast<uint64_t>(config_.tuning.zmq_retries)) {
      return reader_.Error(At("tuning.zmq_retries"),
                           fmt::format("{} contradicts retries={} in the transport URI; set one "
                                       "of them",
                                       config_.tuning.zmq_retries, *text));
    }
    config_.tuning.zmq_retries = static_cast<int>(*retries);
    return Status::OK();
  }

  Status CheckTls() const {
    const ServerConfig& server = config_.server;
    if (server.tls_cert.empty() != server.tls_key.empty()) {
      return reader_.Error(At(server.tls_cert.empty() ? "server.tls_key" : "server.tls_cert"),
                           "set both server.tls_cert and server.tls_key for HTTPS, or neither");
    }
    return Status::OK();
  }

  Status CheckReceivers() const {
    REFIT_ASSIGN_OR_RETURN(const TransportUri uri, TransportUri::Parse(config_.transport));
    // The index of the first receiver with each control URL and each data endpoint.
    std::map<std::string_view, size_t> controls;
    std::map<std::string_view, size_t> endpoints;
    const auto& receivers = config_.receivers;
    for (size_t i = 0; i < receivers.size(); ++i) {
      const ReceiverConfig& receiver = receivers[i];
      const Where control{fmt::format("receivers[{}].control", i), receiver_marks_[i]};
      const Where data{fmt::format("receivers[{}].data", i), receiver_marks_[i]};
      if (uri.is_zmq()) {
        const std::string problem = HostPortProblem(receiver.data);
        if (!problem.empty()) {
          return reader_.Error(data, fmt::format("'{}' {} (the zmq transport needs host:port)",
                                                 receiver.data, problem));
        }
      }
      if (const auto [first, inserted] = controls.emplace(receiver.control, i); !inserted) {
        return reader_.Error(
            control, fmt::format("'{}' repeats receivers[{}]", receiver.control, first->second));
      }
      if (receiver.data.empty()) continue;
      if (const auto [first, inserted] = endpoints.emplace(receiver.data, i); !inserted) {
        return reader_.Error(
            data, fmt::format("'{}' repeats receivers[{}]", receiver.data, first->second));
      }
    }
    return Status::OK();
  }

  ConfigReader& reader_;
  RefitConfig& config_;
  std::vector<YAML::Mark> receiver_marks_;
};

// ---- Declarative keys: each KeySpec says how its value is read and where it goes -------------

// For SecondsKey: whether 0 is a value of its own (e.g. "no lease") or a mistake.
constexpr bool kZeroAllowed = true;
constexpr bool kZeroRefused = false;

KeySpec StringKey(std::string_view name, std::string* out) {
  return {name, [out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadString(v, w, out);
          }};
}

KeySpec NonEmptyStringKey(std::string_view name, std::string* out) {
  return {name, [out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadNonEmptyString(v, w, out);
          }};
}

KeySpec StringListKey(std::string_view name, std::vector<std::string>* out) {
  return {name, [out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadStringList(v, w, out);
          }};
}

KeySpec BoolKey(std::string_view name, bool* out) {
  return {name, [out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadBool(v, w, out);
          }};
}

KeySpec ByteSizeKey(std::string_view name, uint64_t* out) {
  return {name, [out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadPositiveByteSize(v, w, out);
          }};
}

KeySpec ByteSizeKey(std::string_view name, std::optional<uint64_t>* out) {
  return {name, [out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            uint64_t bytes = 0;
            REFIT_RETURN_NOT_OK(r.ReadPositiveByteSize(v, w, &bytes));
            *out = bytes;
            return Status::OK();
          }};
}

template <typename Int>
KeySpec IntegerKey(std::string_view name, int64_t min, int64_t max, Int* out) {
  return {name, [min, max, out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadInteger(v, w, min, max, out);
          }};
}

KeySpec SecondsKey(std::string_view name, std::chrono::milliseconds* out, bool zero_allowed) {
  return {name, [out, zero_allowed](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return ReadSeconds(r, v, w, out, zero_allowed);
          }};
}

// A mapping of its own keys.
KeySpec MapKey(std::string_view name, std::span<const KeySpec> keys) {
  return {name, [keys](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return r.ReadMap(v, w, keys);
          }};
}

// A name `parse` turns into a value (an enum's spelling), its error reported at the key.
template <typename T>
KeySpec ParsedKey(std::string_view name, Result<T> (*parse)(std::string_view), T* out) {
  return {name, [parse, out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            REFIT_ASSIGN_OR_RETURN(const std::string text, r.ReadScalar(v, w));
            Result<T> value = parse(text);
            if (!value.ok()) return r.Error(w, value.status().message());
            *out = *value;
            return Status::OK();
          }};
}

// A value with a reader of its own (ReadTransport, ReadEncoding, ...).
template <typename T>
KeySpec ReadKey(std::string_view name,
                Status (*read)(ConfigReader&, const YAML::Node&, const Where&, T*), T* out) {
  return {name, [read, out](ConfigReader& r, const YAML::Node& v, const Where& w) {
            return read(r, v, w, out);
          }};
}

Status ReadDocument(ConfigReader& reader, const YAML::Node& root, RefitConfig& config) {
  using R = ConfigReader;
  using N = YAML::Node;
  using W = Where;
  DeltaCompressionConfig& delta = config.delta_compression;
  BaselineConfig& baseline = config.baseline;
  TuningConfig& tuning = config.tuning;
  ServerConfig& server = config.server;
  const int max_threads = ProducerStreamOptions::kMaxThreads;

  const KeySpec delta_keys[] = {
      ReadKey("encoding", ReadEncoding, &delta.encoding),
      ReadKey("dtype", ReadDeltaDType, &delta.dtype),
      ByteSizeKey("sparse_bucket_size_bytes", &delta.sparse_bucket_size_bytes),
      ByteSizeKey("export_chunk_bytes", &delta.export_chunk_bytes),
      IntegerKey("full_sync_interval", 0, std::numeric_limits<int64_t>::max(),
                 &delta.full_sync_interval),
      IntegerKey("zstd_level", ZSTD_minCLevel(), ZSTD_maxCLevel(), &delta.zstd_level),
      {"zstd_threads", [](R& r, const N& v, const W& w) { return ReadZstdThreads(r, v, w); }},
      ParsedKey("anchor_compression", ParseAnchorCompression, &delta.anchor_compression),
      ParsedKey("item_coding", ParseItemCoding, &delta.item_coding),
      StringListKey("overwrite_names", &delta.overwrite_names),
      BoolKey("enabled", &delta.enabled),
  };
  const KeySpec baseline_keys[] = {
      BoolKey("in_memory", &baseline.in_memory),
      NonEmptyStringKey("mmap_dir", &baseline.mmap_dir),
  };
  const KeySpec tuning_keys[] = {
      IntegerKey("encode_workers", 1, max_threads, &tuning.encode_workers),
      IntegerKey("serialize_workers", 1, max_threads, &tuning.serialize_workers),
      IntegerKey("transfer_workers", 1, max_threads, &tuning.transfer_workers),
      IntegerKey("zmq_retries", 0, kMaxZmqRetries, &tuning.zmq_retries),
      IntegerKey("apply_queue_depth", 1,
                 static_cast<int64_t>(ReceiverSessionOptions::kMaxApplyQueueDepth),
                 &tuning.apply_queue_depth),
      ByteSizeKey("apply_queue_bytes", &tuning.apply_queue_bytes),
      IntegerKey("apply_threads", 1, ReceiverSessionOptions::kMaxApplyThreads,
                 &tuning.apply_threads),
      IntegerKey("decode_threads", 0, ReceiverSessionOptions::kMaxApplyThreads,
                 &tuning.decode_threads),
  };
  const KeySpec server_keys[] = {
      NonEmptyStringKey("bind", &server.bind),
      StringKey("model", &server.model),
      BoolKey("mmap", &server.mmap),
      StringKey("tls_cert", &server.tls_cert),
      StringKey("tls_key", &server.tls_key),
      StringKey("ready_file", &server.ready_file),
      SecondsKey("transfer_lease_s", &server.transfer_lease, kZeroAllowed),
      SecondsKey("preempt_after_s", &server.preempt_after, kZeroAllowed),
      ParsedKey("anchor_undo", ParseAnchorUndo, &server.anchor_undo),
      StringKey("anchor_undo_dir", &server.anchor_undo_dir),
      StringKey("curve_secret_key", &server.curve_secret_key),
      StringKey("curve_server_key", &server.curve_server_key),
      StringKey("curve_authorized_keys", &server.curve_authorized_keys),
      NonEmptyStringKey("advertise", &server.advertise),
      ByteSizeKey("max_payload_bytes", &server.max_payload_bytes),
      StringKey("loader", &server.loader),
      StringKey("replica", &server.replica),
      StringKey("bootstrap", &server.bootstrap),
      StringKey("bootstrap_peer", &server.bootstrap_peer),
      SecondsKey("fleet_watch_s", &server.fleet_watch_interval, kZeroAllowed),
  };
  std::vector<YAML::Mark> receiver_marks;
  const KeySpec top_keys[] = {
      ReadKey("transport", ReadTransport, &config.transport),
      ReadKey("refit_transport", ReadTransport, &config.transport),
      MapKey("delta_compression", delta_keys),
      MapKey("baseline", baseline_keys),
      MapKey("tuning", tuning_keys),
      SecondsKey("request_timeout_s", &config.request_timeout, kZeroRefused),
      {"receivers",
       [&](R& r, const N& v, const W& w) {
         return ReadReceivers(r, v, w, &config.receivers, &receiver_marks);
       }},
      ReadKey("http_refit_api_key_env_var", ReadEnvVarName, &config.http_refit_api_key_env_var),
      IntegerKey("http_refit_server_port", 0, kMaxPort, &config.http_refit_server_port),
      // 0: the kernel's choice, reported in the ready file (not for a static relay tree, whose
      // peers name their ports; `refit serve` checks that).
      IntegerKey("zmq_refit_server_port", 0, kMaxPort, &config.zmq_refit_server_port),
      ParsedKey("commit_policy", ParseCommitPolicy, &config.commit_policy),
      MapKey("server", server_keys),
  };
  if (!root.IsNull() && !root.IsMap()) {
    return reader.Error(Where{"(top level)", root.Mark()},
                        fmt::format("expected a mapping of keys, got {}", YamlNodeKind(root)));
  }
  REFIT_RETURN_NOT_OK(reader.ReadMap(root, Where{"", YAML::Mark::null_mark()}, top_keys));
  return CrossChecks(reader, config, std::move(receiver_marks)).Run();
}

}  // namespace

namespace {

// The YAML a value given beside the file stands for, as if the file had said it.
YAML::Node OverrideNode(const ConfigValue& value) {
  if (const auto* text = std::get_if<std::string>(&value)) return YAML::Node(*text);
  YAML::Node sequence(YAML::NodeType::Sequence);
  if (const auto* list = std::get_if<std::vector<std::string>>(&value)) {
    for (const std::string& element : *list) sequence.push_back(YAML::Node(element));
    return sequence;
  }
  for (const ReceiverConfig& receiver : std::get<std::vector<ReceiverConfig>>(value)) {
    YAML::Node entry(YAML::NodeType::Map);
    entry["control"] = receiver.control;
    if (!receiver.data.empty()) entry["data"] = receiver.data;
    sequence.push_back(entry);
  }
  return sequence;
}

// Set the key path of `entry` in `root` (a mapping) to its value, making the mappings on the way;
// the document is then read as a whole, so an override is checked as the file's keys are.
Status ApplyOverride(const ConfigOverride& entry, YAML::Node& root, ConfigReader& reader) {
  const std::string& origin = entry.origin.empty() ? entry.key : entry.origin;
  std::vector<std::string> parts;
  for (size_t begin = 0; begin <= entry.key.size();) {
    const size_t end = std::min(entry.key.find('.', begin), entry.key.size());
    parts.push_back(entry.key.substr(begin, end - begin));
    begin = end + 1;
  }
  for (const std::string& part : parts) {
    if (part.empty()) {
      return InvalidArgument("{}: '{}' is not a key path such as tuning.apply_queue_depth", origin,
                             entry.key);
    }
  }
  // Handles are rebound with reset(): assigning to a YAML::Node writes through it.
  YAML::Node mapping;
  mapping.reset(root);
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path += (i == 0 ? "" : ".") + parts[i];
    YAML::Node child = mapping[parts[i]];
    if (!child.IsDefined() || child.IsNull()) {
      mapping[parts[i]] = YAML::Node(YAML::NodeType::Map);
      child.reset(mapping[parts[i]]);
    } else if (!child.IsMap()) {
      return InvalidArgument("{} ({}): the configuration's {} is {}, not a mapping of keys", origin,
                             entry.key, path, YamlNodeKind(child));
    }
    mapping.reset(child);
  }
  mapping[parts.back()] = OverrideNode(entry.value);
  // `transport` and upstream's `refit_transport` are one setting: the override replaces both.
  if (entry.key == "transport") root.remove("refit_transport");
  reader.SetOrigin(entry.key, origin);
  return Status::OK();
}

// Counts documents and nothing else (ParseConfig's first pass).
class DocumentCounter final : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

}  // namespace

Result<RefitConfig> ParseConfig(std::string_view yaml_text, std::string_view source_name,
                                std::span<const ConfigOverride> overrides) {
  RefitConfig config;
  ConfigReader reader(source_name);
  // yaml-cpp reports errors by exception; they stop here, as the project uses none.
  try {
    // Count the documents first, at most kMaxCountedDocuments of them: yaml-cpp 0.7 (Debian's)
    // reports a document forever for some inputs, such as a lone ',' (jbeder/yaml-cpp#1040, so
    // YAML::LoadAll never returns); a bounded count turns such a typo into an error naming the
    // file. Then load the one document.
    constexpr int kMaxCountedDocuments = 8;
    int documents = 0;
    {
      std::istringstream in{std::string(yaml_text)};
      YAML::Parser parser(in);
      DocumentCounter counter;
      while (documents <= kMaxCountedDocuments && parser.HandleNextDocument(counter)) ++documents;
    }
    if (documents > kMaxCountedDocuments) {
      return InvalidArgument(
          "{}: is not a YAML document yaml-cpp can read to its end (more than {} documents; a "
          "stray ',' or '---'?); a configuration is one mapping",
          source_name, kMaxCountedDocuments);
    }
    if (documents > 1) {
      return InvalidArgument("{}: holds {} YAML documents; a configuration is one", source_name,
                             documents);
    }
    YAML::Node root = documents == 0 ? YAML::Node() : YAML::Load(std::string(yaml_text));
    if (!overrides.empty() && root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
    // A document that is not a mapping takes no overrides; ReadDocument reports it.
    if (root.IsMap()) {
      for (const ConfigOverride& entry : overrides) {
        REFIT_RETURN_NOT_OK(ApplyOverride(entry, root, reader));
      }
    }
    REFIT_RETURN_NOT_OK(ReadDocument(reader, root, config));
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) return InvalidArgument("{}: YAML error: {}", source_name, e.msg);
    return InvalidArgument("{}:{}:{}: YAML syntax error: {}", source_name, e.mark.line + 1,
                           e.mark.column + 1, e.msg);
  }
  return config;
}

Result<std::string> ReadConfigFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound("configuration file '{}' does not exist", path);
    return IoErrorFromErrno(errno, fmt::format("open configuration file '{}'", path));
  }
  // Read in blocks until end of file, stopping one block past the limit: the size of a file
  // that is not regular (a pipe) is not known in advance.
  constexpr size_t kBlockBytes = size_t{64} << 10;
  std::string text;
  size_t done = 0;
  while (done <= kMaxConfigFileBytes) {
    text.resize(done + kBlockBytes);
    const ssize_t n = ::read(fd, text.data() + done, kBlockBytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return IoErrorFromErrno(error, fmt::format("read configuration file '{}'", path));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (done > kMaxConfigFileBytes) {
    return InvalidArgument("configuration file '{}' exceeds {} bytes; is it a configuration?", path,
                           kMaxConfigFileBytes);
  }
  text.resize(done);
  return text;
}

Result<RefitConfig> LoadConfigFile(const std::string& path,
                                   std::span<const ConfigOverride> overrides) {
  if (path.empty()) return ParseConfig("", "(no configuration file)", overrides);
  REFIT_ASSIGN_OR_RETURN(const std::string text, ReadConfigFile(path));
  return ParseConfig(text, path, overrides);
}

}  // namespace refit::config
