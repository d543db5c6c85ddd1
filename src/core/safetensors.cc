#include "refit/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/mapped_file.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/endian.h"

namespace refit {
namespace {

using Json = nlohmann::json;

// Bytes of the little-endian u64 that precedes the JSON header (safetensors spec).
constexpr size_t kLengthFieldBytes = 8;
static_assert(kLengthFieldBytes == sizeof(uint64_t), "the length field is one u64");
// Largest header accepted or written. The upstream library caps headers at 100 MB; real models
// need a few MB (about 100 bytes per tensor), so this only stops hostile lengths from driving a
// huge allocation and parse.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// The schema nests exactly three levels: the header object, a tensor entry (or "__metadata__")
// object, and its shape / data_offsets arrays. Anything deeper is invalid anyway, and refusing it
// before parsing keeps a deeply nested hostile header from costing memory per level.
constexpr int kMaxHeaderNesting = 3;
// The data section starts 8-byte aligned in the files we write, as the upstream writer pads its
// header with spaces, so that an mmapped file yields aligned tensors for every dtype.
constexpr size_t kDataAlignment = 8;
// JSON values quoted in error messages are cut to this many characters: enough to recognise the
// value, never a megabyte of a hostile array.
constexpr size_t kMaxQuotedValueChars = 64;
// The reserved header key of the free-form string map.
constexpr std::string_view kMetadataKey = "__metadata__";

// Return an IoError for the failed OS call that set errno. errno is read before the message is
// formatted: formatting allocates, and the allocator may clobber errno.
template <typename... Args>
Status ErrnoError(fmt::format_string<Args...> format, Args&&... args) {
  const int errnum = errno;
  return IoErrorFromErrno(errnum, fmt::format(format, std::forward<Args>(args)...));
}

// Return `value` as compact JSON, shortened for an error message.
std::string Quote(const Json& value) {
  std::string text = value.dump();
  if (text.size() > kMaxQuotedValueChars) {
    // Cut before the UTF-8 character that straddles the limit, keeping the message valid UTF-8.
    size_t cut = kMaxQuotedValueChars;
    while (cut > 0 && (static_cast<uint8_t>(text[cut]) & 0xC0) == 0x80) {
      --cut;
    }
    text.resize(cut);
    text += "...";
  }
  return text;
}

std::string AcceptedSafetensorsCodes() {
  std::string out;
  for (const DTypeInfo& info : AllDTypes()) {
    if (!out.empty()) {
      out += ", ";
    }
    out += info.safetensors_code;
  }
  return out;
}

// Return the value of a JSON number that is a non-negative integer no larger than `max`.
std::optional<uint64_t> NonNegativeInteger(const Json& value, uint64_t max) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v <= max) {
      return v;
    }
  } else if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    // nlohmann stores "-0" as a signed zero; every other signed value is negative.
    if (v == 0) {
      return 0;
    }
  }
  return std::nullopt;
}

// Check what the JSON parser would accept but the format does not, in one cheap pass before
// parsing: nlohmann treats a NUL byte as the end of input (silently ignoring what follows), and
// nesting beyond the schema's depth would only cost memory before failing.
Status PrescanHeader(std::string_view header, const std::string& origin) {
  if (header.empty()) {
    return InvalidArgument("{}: not a safetensors file: header length is 0", origin);
  }
  // The header must be a JSON object, and the upstream reader requires it to start at the first
  // byte, without whitespace; checking that here also settles the type of the parsed value.
  if (header.front() != '{') {
    return InvalidArgument(
        "{}: not a safetensors file: header is not a JSON object: it starts with byte 0x{:02x}, "
        "expected '{{'",
        origin, static_cast<uint8_t>(header.front()));
  }
  bool in_string = false;
  bool escaped = false;
  int depth = 0;
  for (size_t i = 0; i < header.size(); ++i) {
    const char c = header[i];
    if (c == '\0') {
      return InvalidArgument("{}: header has a NUL byte at offset {}", origin, i);
    }
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxHeaderNesting) {
        return InvalidArgument("{}: header nests deeper than {} levels at offset {}", origin,
                               kMaxHeaderNesting, i);
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return Status::OK();
}

// Parse the header JSON, rejecting duplicate keys at any level: the DOM keeps only the last of
// duplicates, so they are caught while parsing.
Result<Json> ParseHeaderJson(std::string_view header, const std::string& origin) {
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate;
  int duplicate_depth = 0;
  const Json::parser_callback_t track_keys = [&](int depth, Json::parse_event_t event,
                                                 Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!open_objects.empty()) {
          open_objects.pop_back();
        }
        break;
      case Json::parse_event_t::key:
        if (!duplicate && !open_objects.empty() &&
            !open_objects.back().insert(parsed.get<std::string>()).second) {
          duplicate = parsed.get<std::string>();
          duplicate_depth = depth;
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json root = Json::parse(header.begin(), header.end(), track_keys, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return InvalidArgument("{}: header of {} bytes is not valid JSON in UTF-8", origin,
                           header.size());
  }
  if (duplicate) {
    // Depth 1 holds the top-level keys: tensor names and "__metadata__".
    if (duplicate_depth == 1) {
      return InvalidArgument("{}: duplicate tensor name '{}'", origin, *duplicate);
    }
    return InvalidArgument("{}: duplicate key '{}' in a header entry", origin, *duplicate);
  }
  REFIT_DCHECK(root.is_object(), "PrescanHeader admits only headers that start with '{'");
  return root;
}

Status ParseMetadata(const Json& value, const std::string& origin,
                     std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return InvalidArgument("{}: {} is {}, expected an object of strings", origin, kMetadataKey,
                           Quote(value));
  }
  for (const auto& [key, entry] : value.items()) {
    if (!entry.is_string()) {
      return InvalidArgument("{}: {} value of '{}' is {}, expected a string", origin, kMetadataKey,
                             key, Quote(entry));
    }
    metadata->emplace(key, entry.get<std::string>());
  }
  return Status::OK();
}

// One header entry, before the layout of the data section is checked.
struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin;
  uint64_t end;
};

Result<TensorEntry> ParseTensorEntry(const std::string& name, const Json& value, uint64_t data_size,
                                     const std::string& origin) {
  if (!value.is_object()) {
    return InvalidArgument("{}: tensor '{}': entry is {}, expected an object", origin, name,
                           Quote(value));
  }
  for (const auto& [key, field] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return InvalidArgument("{}: tensor '{}': unknown field '{}'", origin, name, key);
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) {
      return InvalidArgument("{}: tensor '{}': missing field '{}'", origin, name, field);
    }
  }
  TensorEntry entry{name, DType::kUInt8, {}, 0, 0};

  // ParseDType also accepts PyTorch names and aliases; a safetensors header may only hold codes.
  const Json& dtype = value["dtype"];
  std::optional<DType> parsed_dtype;
  if (dtype.is_string()) {
    const std::string& code = dtype.get_ref<const std::string&>();
    Result<DType> parsed = ParseDType(code);
    if (parsed.ok() && GetDTypeInfo(*parsed).safetensors_code == code) {
      parsed_dtype = *parsed;
    }
  }
  if (!parsed_dtype) {
    return InvalidArgument("{}: tensor '{}': unknown dtype {}; accepted: {}", origin, name,
                           Quote(dtype), AcceptedSafetensorsCodes());
  }
  entry.dtype = *parsed_dtype;

  const Json& shape = value["shape"];
  if (!shape.is_array()) {
    return InvalidArgument("{}: tensor '{}': shape {} is not an array", origin, name, Quote(shape));
  }
  for (const Json& extent : shape) {
    const std::optional<uint64_t> v =
        NonNegativeInteger(extent, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
    if (!v) {
      return InvalidArgument(
          "{}: tensor '{}': shape {} has extent {}, expected a non-negative integer", origin, name,
          Quote(shape), Quote(extent));
    }
    entry.shape.push_back(static_cast<int64_t>(*v));
  }

  const Json& offsets = value["data_offsets"];
  std::optional<uint64_t> begin;
  std::optional<uint64_t> end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = NonNegativeInteger(offsets[0], std::numeric_limits<uint64_t>::max());
    end = NonNegativeInteger(offsets[1], std::numeric_limits<uint64_t>::max());
  }
  if (!begin || !end || *begin > *end) {
    return InvalidArgument(
        "{}: tensor '{}': data_offsets {} must be [begin, end] with 0 <= begin <= end", origin,
        name, Quote(offsets));
  }
  if (*end > data_size) {
    return InvalidArgument(
        "{}: tensor '{}': data_offsets {} end beyond the data section of {} bytes", origin, name,
        Quote(offsets), data_size);
  }
  entry.begin = *begin;
  entry.end = *end;

  Result<uint64_t> numel = NumElements(entry.shape);
  if (!numel.ok()) {
    return numel.status().WithContext(fmt::format("{}: tensor '{}'", origin, name));
  }
  const uint64_t element_size = DTypeSize(entry.dtype);
  const uint64_t range_bytes = entry.end - entry.begin;
  if (*numel > std::numeric_limits<uint64_t>::max() / element_size ||
      *numel * element_size != range_bytes) {
    return InvalidArgument(
        "{}: tensor '{}': shape {} of {} has {} elements of {} bytes, "
        "but data_offsets {} span {} bytes",
        origin, name, ShapeToString(entry.shape), GetDTypeInfo(entry.dtype).safetensors_code,
        *numel, element_size, Quote(offsets), range_bytes);
  }
  return entry;
}

// Check that the tensors tile the data section exactly: sorted by offset, each begins where the
// previous ended and the last ends at the section's end. The upstream reader requires the same,
// and it guarantees no byte is shared between two tensors or left unaccounted for.
Status CheckLayout(const std::vector<TensorEntry>& sorted, uint64_t data_size,
                   const std::string& origin) {
  uint64_t expected = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& entry : sorted) {
    if (entry.begin < expected) {
      return InvalidArgument(
          "{}: tensor '{}' at data_offsets [{}, {}] overlaps tensor '{}' at [{}, {}]", origin,
          entry.name, entry.begin, entry.end, previous->name, previous->begin, previous->end);
    }
    if (entry.begin > expected) {
      return InvalidArgument(
          "{}: {} unused bytes at data offset {} before tensor '{}' at data_offsets [{}, {}]",
          origin, entry.begin - expected, expected, entry.name, entry.begin, entry.end);
    }
    expected = entry.end;
    previous = &entry;
  }
  if (expected != data_size) {
    return InvalidArgument("{}: {} unused bytes at the end of the data section of {} bytes", origin,
                           data_size - expected, data_size);
  }
  return Status::OK();
}

// Read all of `path` into `out`, looping over short reads and EINTR.
Status ReadWholeFile(const std::string& path, std::vector<std::byte>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoError("open '{}'", path);
  }
  Status status;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    status = ErrnoError("fstat '{}'", path);
  } else if (!S_ISREG(st.st_mode)) {
    status = IoError("read '{}': not a regular file", path);
  } else {
    out->resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < out->size()) {
      const ssize_t n =
          ::pread(fd, out->data() + done, out->size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0) {
        status = ErrnoError("read '{}' at offset {}", path, done);
        break;
      }
      if (n == 0) {
        status = IoError("read '{}': file shrank from {} to {} bytes while reading", path,
                         out->size(), done);
        break;
      }
      done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  return status;
}

// Write all of `bytes` to `fd`, looping over short writes and EINTR.
Status WriteAll(int fd, std::span<const std::byte> bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return ErrnoError("write '{}'", path);
    }
    // A regular file never accepts zero bytes of a non-empty write; stop rather than spin.
    if (n == 0) {
      return IoError("write '{}': no progress with {} bytes left", path, bytes.size());
    }
    bytes = bytes.subspan(static_cast<size_t>(n));
  }
  return Status::OK();
}

// Return `text` as a JSON string literal, escaped as serde_json (the upstream writer) does.
Result<std::string> JsonString(std::string_view text, std::string_view what,
                               const std::string& path) {
  // nlohmann reports invalid UTF-8 only by throwing; keep the exception inside this function.
  try {
    return Json(text).dump();
  } catch (const Json::type_error&) {
    return InvalidArgument("{}: {} is not valid UTF-8", path, what);
  }
}

// Build the header JSON exactly as the upstream writer lays it out: compact, "__metadata__"
// first (omitted when empty), then each tensor with its keys in dtype, shape, data_offsets order;
// spaces pad it so the data section starts aligned.
Result<std::string> BuildHeader(const std::vector<TensorView>& tensors,
                                const std::map<std::string, std::string>& metadata,
                                const std::string& path) {
  std::string header = "{";
  if (!metadata.empty()) {
    header += fmt::format("\"{}\":{{", kMetadataKey);
    bool first = true;
    for (const auto& [key, value] : metadata) {
      REFIT_ASSIGN_OR_RETURN(std::string quoted_key,
                             JsonString(key, fmt::format("metadata key '{}'", key), path));
      REFIT_ASSIGN_OR_RETURN(std::string quoted_value,
                             JsonString(value, fmt::format("metadata value of '{}'", key), path));
      header += fmt::format("{}{}:{}", first ? "" : ",", quoted_key, quoted_value);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const TensorView& tensor : tensors) {
    REFIT_ASSIGN_OR_RETURN(
        std::string quoted_name,
        JsonString(tensor.name, fmt::format("tensor name '{}'", tensor.name), path));
    if (header.size() > 1) {
      header += ",";
    }
    header += fmt::format(R"({}:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})", quoted_name,
                          GetDTypeInfo(tensor.dtype).safetensors_code, fmt::join(tensor.shape, ","),
                          offset, offset + tensor.bytes.size());
    offset += tensor.bytes.size();
  }
  header += "}";
  header.append((kDataAlignment - header.size() % kDataAlignment) % kDataAlignment, ' ');
  if (header.size() > kMaxHeaderBytes) {
    return InvalidArgument("{}: header of {} bytes for {} tensors exceeds the limit of {} bytes",
                           path, header.size(), tensors.size(), kMaxHeaderBytes);
  }
  return header;
}

// Write the length field, the header and every tensor's bytes to `fd`, then fsync it.
Status WriteContents(int fd, const std::string& header, const std::vector<TensorView>& tensors,
                     const std::string& tmp_path) {
  std::array<std::byte, kLengthFieldBytes> length_field;
  internal::StoreLittleEndian(length_field.data(), uint64_t{header.size()});
  REFIT_RETURN_NOT_OK(WriteAll(fd, length_field, tmp_path));
  REFIT_RETURN_NOT_OK(WriteAll(fd, std::as_bytes(std::span(header)), tmp_path));
  // Tensor bytes go straight from the caller's buffers to the file: no second copy of the model.
  for (const TensorView& tensor : tensors) {
    REFIT_RETURN_NOT_OK(WriteAll(fd, tensor.bytes, tmp_path));
  }
  if (::fsync(fd) != 0) {
    return ErrnoError("fsync '{}'", tmp_path);
  }
  return Status::OK();
}

// fsync the directory holding `path`, so that a completed rename survives a crash.
Status SyncParentDirectory(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoError("open directory '{}'", dir);
  }
  Status status;
  if (::fsync(fd) != 0) {
    status = ErrnoError("fsync directory '{}'", dir);
  }
  ::close(fd);
  return status;
}

}  // namespace

SafetensorsFile::~SafetensorsFile() = default;

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path,
                                                               LoadMode mode) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  std::span<const std::byte> bytes;
  if (mode == LoadMode::kMmap) {
    REFIT_ASSIGN_OR_RETURN(file->mapping_, internal::MappedFile::OpenReadOnly(path));
    bytes = std::as_const(*file->mapping_).bytes();
  } else {
    REFIT_RETURN_NOT_OK(ReadWholeFile(path, &file->owned_));
    bytes = file->owned_;
  }
  REFIT_ASSIGN_OR_RETURN(file->tensors_, ParseSafetensors(bytes, path, &file->metadata_));
  return file;
}

Result<TensorView> SafetensorsFile::Find(std::string_view name) const {
  for (const TensorView& tensor : tensors_) {
    if (tensor.name == name) {
      return tensor;
    }
  }
  return NotFound("{}: no tensor named '{}'", path_, name);
}

Result<std::vector<TensorView>> ParseSafetensors(std::span<const std::byte> file_bytes,
                                                 const std::string& origin,
                                                 std::map<std::string, std::string>* metadata) {
  // The first checks are the ones any other kind of file fails (random bytes, a PyTorch .bin, a
  // text file): they say so first, then what exactly did not fit.
  if (file_bytes.size() < kLengthFieldBytes) {
    return InvalidArgument(
        "{}: not a safetensors file: file of {} bytes is shorter than the {}-byte header length",
        origin, file_bytes.size(), kLengthFieldBytes);
  }
  const uint64_t header_size = internal::LoadLittleEndian<uint64_t>(file_bytes.data());
  if (header_size > kMaxHeaderBytes) {
    return InvalidArgument(
        "{}: not a safetensors file: header length {} exceeds the limit of {} bytes (a "
        "safetensors file starts with the length of its JSON header, 8 bytes little-endian)",
        origin, header_size, kMaxHeaderBytes);
  }
  const uint64_t after_length = file_bytes.size() - kLengthFieldBytes;
  if (header_size > after_length) {
    return InvalidArgument(
        "{}: not a safetensors file, or a truncated one: header length {} exceeds the {} bytes "
        "after the length field",
        origin, header_size, after_length);
  }
  const std::span<const std::byte> header_bytes =
      file_bytes.subspan(kLengthFieldBytes, static_cast<size_t>(header_size));
  const std::span<const std::byte> data =
      file_bytes.subspan(kLengthFieldBytes + header_bytes.size());
  const std::string_view header(reinterpret_cast<const char*>(header_bytes.data()),
                                header_bytes.size());

  REFIT_RETURN_NOT_OK(PrescanHeader(header, origin));
  REFIT_ASSIGN_OR_RETURN(Json root, ParseHeaderJson(header, origin));

  std::map<std::string, std::string> parsed_metadata;
  std::vector<TensorEntry> entries;
  entries.reserve(root.size());
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      REFIT_RETURN_NOT_OK(ParseMetadata(value, origin, &parsed_metadata));
      continue;
    }
    REFIT_ASSIGN_OR_RETURN(TensorEntry entry, ParseTensorEntry(key, value, data.size(), origin));
    entries.push_back(std::move(entry));
  }
  // Ties (zero-byte tensors at one offset) are broken by name, so the order is deterministic.
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  REFIT_RETURN_NOT_OK(CheckLayout(entries, data.size(), origin));

  std::vector<TensorView> views;
  views.reserve(entries.size());
  for (TensorEntry& entry : entries) {
    views.push_back(TensorView{std::move(entry.name), entry.dtype, std::move(entry.shape),
                               data.subspan(static_cast<size_t>(entry.begin),
                                            static_cast<size_t>(entry.end - entry.begin))});
  }
  if (metadata != nullptr) {
    *metadata = std::move(parsed_metadata);
  }
  return views;
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::unordered_set<std::string_view> names;
  for (const TensorView& tensor : tensors) {
    if (tensor.name == kMetadataKey) {
      return InvalidArgument("{}: tensor name '{}' is reserved for metadata", path, tensor.name);
    }
    if (!names.insert(tensor.name).second) {
      return InvalidArgument("{}: duplicate tensor name '{}'", path, tensor.name);
    }
    REFIT_RETURN_NOT_OK(CheckTensorSize(tensor).WithContext(path));
  }
  REFIT_ASSIGN_OR_RETURN(std::string header, BuildHeader(tensors, metadata, path));

  // Write beside the target and rename over it: readers see the old file or the new one, never
  // a partial one. The pid keeps concurrent writers of one path from sharing a temporary.
  const std::string tmp_path = fmt::format("{}.tmp.{}", path, ::getpid());
  // 0644 before the umask: the permissions of a file written by an ordinary open().
  constexpr mode_t kFileMode = S_IRUSR | S_IWUSR | S_IRGRP | S_IROTH;
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, kFileMode);
  if (fd < 0) {
    return ErrnoError("open '{}'", tmp_path);
  }
  Status status = WriteContents(fd, header, tensors, tmp_path);
  if (::close(fd) != 0 && status.ok()) {
    status = ErrnoError("close '{}'", tmp_path);
  }
  if (status.ok() && ::rename(tmp_path.c_str(), path.c_str()) != 0) {
    status = ErrnoError("rename '{}' to '{}'", tmp_path, path);
  }
  if (!status.ok()) {
    ::unlink(tmp_path.c_str());
    return status;
  }
  return SyncParentDirectory(path);
}

uint64_t WeightVersionOf(const SafetensorsFile& file) {
  auto it = file.metadata().find(kWeightVersionMetadataKey);
  if (it == file.metadata().end()) return 0;
  return std::strtoull(it->second.c_str(), nullptr, 10);
}

}  // namespace refit
