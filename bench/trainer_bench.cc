// trainer_bench: the C++ trainer process of bench/python_bench.py, the C++ counterpart of its
// Python trainer (refit.torch.Publisher over a torch module), doing the same thing step by step:
//
//   1. read CHECKPOINT_0 (safetensors) into buffers of its own, page-aligned (pread: no mapping,
//      so the file's pages never count in this process's RSS);
//   2. make a one-rank Publisher from --config (the YAML the Python trainer loads with
//      refit.Config.load) and the --receiver list, and adopt checkpoint 0 as the baseline (the
//      receivers loaded it: version 0); print {"ready": …} with its RSS so far;
//   3. per line "sync K" on stdin: read checkpoint K into the same buffers in place (untimed: a
//      training step that rewrites the weights), time Publisher::Sync from the call to its
//      return (the commit), and print the step's wall time and report as one JSON line;
//   4. at "end" (or end of input): print its RSS — the peak during set-up, and the peak during the
//      syncs (VmHWM reset before the first when the kernel allows it) — and exit.
//
// Driven by python_bench.py, which interleaves the syncs of every path step by step, so that the
// machine's load drifts alike for all of them. Not a benchmark by itself; never run by ctest.
#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "cli_common.h"
#include "codec/compare.h"
#include "config_file.h"
#include "process.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "role_options.h"

namespace refit::bench {
namespace {

struct Args {
  std::string config;
  std::vector<PublisherReceiver> receivers;
  std::vector<std::string> checkpoints;
  // Each tensor's buffer starts this many bytes past a page boundary (0: page-aligned, as any
  // allocator that aligns large blocks, torch's included, gives at least 64-byte alignment).
  uint64_t offset = 0;
};

constexpr const char* kUsage =
    "usage: trainer_bench --config REFIT.yaml --receiver CONTROL_URL=DATA_ENDPOINT [--receiver …]\n"
    "                     [--offset BYTES] CHECKPOINT_0 CHECKPOINT_1 …\n"
    "Adopts CHECKPOINT_0 as what the receivers hold and prints {\"ready\": …}; then per line\n"
    "'sync K' on stdin reads CHECKPOINT_K into the same buffers and times one Publisher::Sync\n"
    "(one JSON line per sync); 'end' prints the RSS figures and exits.\n"
    "--offset: start every tensor's buffer BYTES past a page boundary (default 0).\n";

Result<Args> ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= argc) return InvalidArgument("{} needs a value\n{}", flag, kUsage);
      return std::string(argv[++i]);
    };
    if (flag == "--config") {
      REFIT_ASSIGN_OR_RETURN(args.config, value());
    } else if (flag == "--receiver") {
      REFIT_ASSIGN_OR_RETURN(const std::string spec, value());
      const size_t equals = spec.find('=');
      if (equals == std::string::npos || equals == 0 || equals + 1 == spec.size()) {
        return InvalidArgument("--receiver '{}': expected CONTROL_URL=DATA_ENDPOINT", spec);
      }
      args.receivers.push_back({spec.substr(0, equals), spec.substr(equals + 1)});
    } else if (flag == "--offset") {
      REFIT_ASSIGN_OR_RETURN(const std::string text, value());
      REFIT_ASSIGN_OR_RETURN(args.offset, ParseUnsigned(flag, text));
      if (args.offset >= 4096) return InvalidArgument("--offset {} must be < 4096", args.offset);
    } else if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    } else if (flag.starts_with("--")) {
      return InvalidArgument("unknown flag {}\n{}", flag, kUsage);
    } else {
      args.checkpoints.emplace_back(flag);
    }
  }
  if (args.config.empty() || args.receivers.empty() || args.checkpoints.empty()) {
    return InvalidArgument("--config, --receiver and a checkpoint are required\n{}", kUsage);
  }
  return args;
}

// One tensor of the trainer's model, in a buffer of its own.
struct ModelTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  std::unique_ptr<std::byte, decltype(&std::free)> memory{nullptr, &std::free};
  std::span<std::byte> bytes;

  TensorView view() const { return TensorView{name, dtype, shape, bytes}; }
};

constexpr uint64_t kPageBytes = 4096;

// A safetensors file's tensors (bytes not allocated) and where each one's bytes lie in it.
struct FileLayout {
  std::vector<OwnedTensor> tensors;
  std::vector<uint64_t> offsets;  // absolute file offsets
  std::vector<uint64_t> sizes;
};

Status ReadFully(int fd, std::span<std::byte> out, uint64_t offset, const std::string& path) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t got =
        ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return IoError("read {}: {}", path, std::strerror(errno));
    if (got == 0) return IoError("read {}: unexpected end of file", path);
    done += static_cast<size_t>(got);
  }
  return Status::OK();
}

// The header of the safetensors file `fd` (8-byte little-endian length, JSON), tensors in data
// order. The data are not read.
Result<FileLayout> ReadLayout(int fd, const std::string& path) {
  uint64_t header_bytes = 0;
  REFIT_RETURN_NOT_OK(
      ReadFully(fd, std::as_writable_bytes(std::span<uint64_t>(&header_bytes, 1)), 0, path));
  if (header_bytes == 0 || header_bytes > (uint64_t{100} << 20)) {
    return InvalidArgument("{}: implausible safetensors header length {}", path, header_bytes);
  }
  std::string text(header_bytes, '\0');
  REFIT_RETURN_NOT_OK(ReadFully(fd, std::as_writable_bytes(std::span<char>(text)), 8, path));
  const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return InvalidArgument("{}: the header is not a JSON object", path);
  struct Entry {
    uint64_t begin, end;
    OwnedTensor tensor;
  };
  std::vector<Entry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    Entry entry;
    entry.tensor.name = name;
    REFIT_ASSIGN_OR_RETURN(entry.tensor.dtype, ParseDType(info.at("dtype").get<std::string>()));
    entry.tensor.shape = info.at("shape").get<Shape>();
    entry.begin = info.at("data_offsets").at(0).get<uint64_t>();
    entry.end = info.at("data_offsets").at(1).get<uint64_t>();
    entries.push_back(std::move(entry));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  FileLayout layout;
  for (Entry& entry : entries) {
    if (entry.end < entry.begin)
      return InvalidArgument("{}: '{}' ends before it begins", path, entry.tensor.name);
    REFIT_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(entry.tensor.shape));
    if (numel * DTypeSize(entry.tensor.dtype) != entry.end - entry.begin) {
      return InvalidArgument("{}: '{}' has {} bytes for shape {}", path, entry.tensor.name,
                             entry.end - entry.begin, ShapeToString(entry.tensor.shape));
    }
    layout.offsets.push_back(8 + header_bytes + entry.begin);
    layout.sizes.push_back(entry.end - entry.begin);
    layout.tensors.push_back(std::move(entry.tensor));
  }
  return layout;
}

// Read checkpoint `path` into `model` in place; it must have the same tensors at the same sizes.
Status LoadInto(const std::string& path, std::vector<ModelTensor>& model) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError("open {}: {}", path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  REFIT_ASSIGN_OR_RETURN(FileLayout layout, ReadLayout(fd, path));
  if (layout.tensors.size() != model.size()) {
    return InvalidArgument("{} has {} tensors, checkpoint 0 {}", path, layout.tensors.size(),
                           model.size());
  }
  for (size_t t = 0; t < model.size(); ++t) {
    if (layout.tensors[t].name != model[t].name || layout.sizes[t] != model[t].bytes.size()) {
      return InvalidArgument("{}: tensor {} is '{}' of {} bytes, checkpoint 0's '{}' of {}", path,
                             t, layout.tensors[t].name, layout.sizes[t], model[t].name,
                             model[t].bytes.size());
    }
    REFIT_RETURN_NOT_OK(ReadFully(fd, model[t].bytes, layout.offsets[t], path));
  }
  return Status::OK();
}

// Read checkpoint `path` into fresh buffers, each `offset` bytes past a page boundary.
Result<std::vector<ModelTensor>> LoadModel(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError("open {}: {}", path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  REFIT_ASSIGN_OR_RETURN(FileLayout layout, ReadLayout(fd, path));
  std::vector<ModelTensor> model(layout.tensors.size());
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    ModelTensor& tensor = model[t];
    tensor.name = std::move(layout.tensors[t].name);
    tensor.dtype = layout.tensors[t].dtype;
    tensor.shape = std::move(layout.tensors[t].shape);
    const uint64_t size = layout.sizes[t];
    const uint64_t rounded =
        (offset + std::max<uint64_t>(size, 1) + kPageBytes - 1) / kPageBytes * kPageBytes;
    tensor.memory.reset(static_cast<std::byte*>(std::aligned_alloc(kPageBytes, rounded)));
    if (tensor.memory == nullptr)
      return ResourceExhausted("{} bytes for '{}'", rounded, tensor.name);
    tensor.bytes = std::span<std::byte>(tensor.memory.get() + offset, size);
    REFIT_RETURN_NOT_OK(ReadFully(fd, tensor.bytes, layout.offsets[t], path));
  }
  return model;
}

uint64_t Rss(std::string_view field) {
  Result<uint64_t> bytes = testkit::ProcessMemoryBytes("self", field);
  return bytes.ok() ? *bytes : 0;
}

Status Run(const Args& args) {
  nlohmann::json rss = {{"start", Rss("VmRSS")}};
  const double load_start = Now();
  REFIT_ASSIGN_OR_RETURN(std::vector<ModelTensor> model,
                         LoadModel(args.checkpoints[0], args.offset));
  const double load_s = Now() - load_start;
  uint64_t model_bytes = 0;
  std::vector<TensorView> views;
  for (const ModelTensor& tensor : model) {
    model_bytes += tensor.bytes.size();
    views.push_back(tensor.view());
  }
  rss["loaded"] = Rss("VmRSS");

  REFIT_ASSIGN_OR_RETURN(const config::RefitConfig config, config::LoadConfigFile(args.config));
  REFIT_ASSIGN_OR_RETURN(PublisherOptions options, config::ToPublisherOptions(config));
  options.receivers = args.receivers;
  REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<ProducerGroup>> groups, MakeInProcessGroup(1));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> publisher,
                         Publisher::Make(options, std::move(groups[0])));
  const double adopt_start = Now();
  REFIT_RETURN_NOT_OK(publisher->AdoptBaseline(views, uint64_t{0}));
  const double adopt_s = Now() - adopt_start;
  rss["adopted"] = Rss("VmRSS");
  rss["peak_setup"] = Rss("VmHWM");
  rss["peak_reset"] = testkit::ResetPeakRss("self").ok();
  std::cout << nlohmann::json{{"ready", true},
                              {"trainer", "c++"},
                              {"compare_simd_target", std::string(BestCompareTarget())},
                              {"hardware_threads", std::thread::hardware_concurrency()},
                              {"model_bytes", model_bytes},
                              {"tensors", model.size()},
                              {"buffer_offset", args.offset},
                              {"load_s", load_s},
                              {"adopt_s", adopt_s}}
                   .dump()
            << std::endl;

  std::string line;
  while (std::getline(std::cin, line) && line != "end") {
    uint64_t k = 0;
    if (!line.starts_with("sync ") || !ParseUnsigned("sync", line.substr(5)).ok() ||
        (k = *ParseUnsigned("sync", line.substr(5))) >= args.checkpoints.size()) {
      return InvalidArgument("stdin: expected 'sync K' (K < {}) or 'end', got '{}'",
                             args.checkpoints.size(), line);
    }
    const double read_start = Now();
    REFIT_RETURN_NOT_OK(LoadInto(args.checkpoints[k], model));
    const double read_s = Now() - read_start;
    const double t0 = Now();
    REFIT_ASSIGN_OR_RETURN(const SyncReport sync, publisher->Sync(views));
    const double wall_s = Now() - t0;
    const RefitReport& report = sync.transfer;
    std::cout << nlohmann::json{{"checkpoint", k},
                                {"wall_s", wall_s},
                                {"refit_s", report.total_s},
                                {"prepare_s", report.prepare_s},
                                {"stream_s", report.stream_s},
                                {"flush_s", report.flush_s},
                                {"commit_s", report.commit_s},
                                {"anchor", report.plan.anchor},
                                {"version", report.plan.target_version},
                                {"payloads", report.payloads},
                                {"wire_bytes", report.wire_bytes},
                                {"changed", report.changed_elements},
                                {"elements", report.total_elements},
                                {"read_s", read_s}}
                     .dump()
              << std::endl;
  }
  rss["peak_syncs"] = Rss("VmHWM");
  rss["end"] = Rss("VmRSS");
  std::cout << nlohmann::json{{"rss", rss}}.dump() << std::endl;
  return Status::OK();
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  using namespace refit;
  Result<bench::Args> args = bench::ParseArgs(argc, argv);
  Status status = args.status();
  try {
    if (args.ok()) status = bench::Run(*args);
  } catch (const nlohmann::json::exception& error) {  // a malformed safetensors header
    status = InvalidArgument("checkpoint header: {}", error.what());
  }
  if (!status.ok()) {
    std::cerr << "trainer_bench: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
