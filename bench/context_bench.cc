// context_bench: context-coded deltas (src/codec/context_coding.h) against today's encodings,
// side by side in one run, with the issue 44 targets marked MET / NOT MET.
//
//   pairs     a real torch AdamW step pair (bench/adamw_step_pair.py; bf16 and fp16 exports of
//             the same fp32 masters) and synthetic bf16 Adam steps of the simulator at 1 %, 3 %
//             and 5 %. Per pair: bytes per changed element of today's payload (one payload of
//             all items, and item by item), of the context coding, and of the per-item choice
//             (the smaller of the two for each item), beside the memoryless entropy bound
//             H(gap) + H(xor) and the ideal context model (the change mask given the old
//             exponent + the difference given the old exponent, pooled over the model).
//   speed     context decode and encode in model bytes per second on one core, including the
//             O(N) pass over the old elements, beside today's payload decode and encode.
//   choice    what the producer's auto choice (src/pipeline/context_choice.h) would send per
//             link — zmq (fast), s3:// (bytes priced), file:// (its hint, 4 decode threads), a
//             10 MB/s WAN — with this run's decode rate.
//
// Usage: context_bench [--pair DIR]... [--synthetic-bytes N] [--repetitions R] [--max-classes K]
//                      [--no-avx512 1] [--json PATH]
// Prints tables and, with --json, every figure as JSON. See docs/benchmark-results.md.
#include <time.h>

#include <fmt/format.h>
#include <hwy/targets.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "codec/compare.h"
#include "codec/context_coding.h"
#include "codec/locations.h"
#include "pipeline/context_choice.h"
#include "progress.h"
#include "refit/payload.h"
#include "table.h"
#include "workload/simulator.h"

namespace refit::bench {
namespace {

/// Issue 44's targets.
constexpr double kTargetRatioToBound = 0.78;
constexpr double kTargetDecodeGBps = 1.0;
constexpr double kTargetEncodeGBps = 0.5;

struct Args {
  /// Directories of adamw_step_pair.py step pairs (--pair, repeatable).
  std::vector<std::string> pair_dirs;
  uint64_t synthetic_bytes = uint64_t{64} << 20;
  int repetitions = 3;
  std::string json_path;
  internal::ContextCodingOptions coding;
};

struct Tensor {
  std::string name;
  std::vector<std::byte> old_bytes;
  std::vector<std::byte> new_bytes;
};

struct Pair {
  std::string label;
  DType dtype = DType::kBFloat16;
  std::vector<Tensor> tensors;
};

// This thread's CPU time: the figures are per core, and the machine the benchmark runs on is
// shared, so wall time would count other processes' time slices.
double Now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

template <typename Fn>
double MedianSeconds(int repetitions, Fn&& fn) {
  std::vector<double> times;
  for (int r = 0; r < repetitions; ++r) {
    const double t0 = Now();
    fn();
    times.push_back(Now() - t0);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

std::vector<std::byte> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

// The pair adamw_step_pair.py wrote: index.txt ("name numel element_offset") and the old/new
// exports of `tag` ("bf16" or "fp16"). Empty on a missing or short file (said on stderr).
Pair LoadTorchPair(const std::string& dir, const std::string& tag, DType dtype) {
  const std::string base = dir.substr(dir.find_last_of('/') + 1);
  Pair pair{fmt::format("torch AdamW lr 1e-6, {} ({})", tag, base), dtype, {}};
  const std::vector<std::byte> old_all = ReadFile(dir + "/old_" + tag + ".bin");
  const std::vector<std::byte> new_all = ReadFile(dir + "/new_" + tag + ".bin");
  std::ifstream index(dir + "/index.txt");
  std::string name;
  uint64_t numel = 0;
  uint64_t offset = 0;
  const uint32_t width = DTypeSize(dtype);
  while (index >> name >> numel >> offset) {
    if ((offset + numel) * width > old_all.size() || old_all.size() != new_all.size()) {
      std::cerr << "context_bench: " << dir << " is short of tensor " << name << "\n";
      return {};
    }
    const auto* o = old_all.data() + offset * width;
    const auto* n = new_all.data() + offset * width;
    pair.tensors.push_back(Tensor{name, std::vector<std::byte>(o, o + numel * width),
                                  std::vector<std::byte>(n, n + numel * width)});
  }
  return pair;
}

Pair SyntheticPair(uint64_t bytes, double density) {
  SimulatorOptions options;
  options.tensors = MakeTransformerSpec(bytes, DType::kBFloat16);
  options.threads = 2;
  auto simulator = std::move(TrainingSimulator::Make(options)).ValueOrDie();
  // Two steps first so that Adam's moments are not those of step 1 (every update exactly lr).
  for (int i = 0; i < 2; ++i) {
    (void)simulator->CalibrateLearningRate(density);
    (void)simulator->Step();
  }
  Pair pair{fmt::format("simulator bf16 Adam {:.0f} %", density * 100), DType::kBFloat16, {}};
  for (const TensorView& t : simulator->Exported()) {
    pair.tensors.push_back(Tensor{t.name, {t.bytes.begin(), t.bytes.end()}, {}});
  }
  (void)simulator->CalibrateLearningRate(density);
  (void)simulator->Step();
  const std::vector<TensorView> exported = simulator->Exported();
  for (size_t i = 0; i < exported.size(); ++i) {
    pair.tensors[i].new_bytes.assign(exported[i].bytes.begin(), exported[i].bytes.end());
  }
  return pair;
}

// A pair where the old value predicts nothing: uniformly random bf16 bits, 3 % of elements
// changed at random positions to random other bits. Context coding cannot win here; the per-item
// choice must fall back to today's encodings.
Pair UniformPair(uint64_t bytes) {
  Pair pair{"uniform random bits, 3 %", DType::kBFloat16, {}};
  std::mt19937_64 rng(44);
  const uint64_t per_tensor = std::max<uint64_t>(bytes / 8, 2) / 2 * 2;
  for (int t = 0; t < 4; ++t) {
    Tensor tensor{fmt::format("uniform.{}.weight", t), std::vector<std::byte>(per_tensor), {}};
    for (std::byte& b : tensor.old_bytes) b = static_cast<std::byte>(rng());
    tensor.new_bytes = tensor.old_bytes;
    for (uint64_t i = 0; i < per_tensor / 2; ++i) {
      if (rng() % 100 >= 3) continue;
      const uint16_t bits = static_cast<uint16_t>(rng() | 1);
      tensor.new_bytes[2 * i] ^= static_cast<std::byte>(bits);
      tensor.new_bytes[2 * i + 1] ^= static_cast<std::byte>(bits >> 8);
    }
    pair.tensors.push_back(std::move(tensor));
  }
  return pair;
}

struct Changes {
  std::vector<uint64_t> locations;
  std::vector<std::byte> xor_values;
};

Changes FindChanges(const Tensor& t, uint32_t width) {
  Changes c;
  const uint64_t numel = t.old_bytes.size() / width;
  for (uint64_t i = 0; i < numel; ++i) {
    if (std::memcmp(t.old_bytes.data() + i * width, t.new_bytes.data() + i * width, width) != 0) {
      c.locations.push_back(i);
      for (uint32_t b = 0; b < width; ++b) {
        c.xor_values.push_back(t.old_bytes[i * width + b] ^ t.new_bytes[i * width + b]);
      }
    }
  }
  return c;
}

Item MakeXorItem(const Tensor& t, DType dtype, const Changes& c) {
  const uint64_t numel = t.old_bytes.size() / DTypeSize(dtype);
  Item item;
  item.name = t.name;
  item.dtype = dtype;
  item.value_dtype = dtype;
  item.shape = {static_cast<int64_t>(numel)};
  item.op = Op::kXor;
  item.span_end = numel;
  item.count = c.locations.size();
  item.location_encoding = ChooseLocationEncoding(c.locations, 0, numel).ValueOrDie();
  (void)EncodeLocations(item.location_encoding, c.locations, 0, numel, &item.locations);
  item.values = c.xor_values;
  return item;
}

double EntropyBits(const std::map<uint64_t, uint64_t>& histogram) {
  double total = 0;
  for (const auto& [symbol, count] : histogram) total += static_cast<double>(count);
  double bits = 0;
  for (const auto& [symbol, count] : histogram) {
    bits -= static_cast<double>(count) * std::log2(static_cast<double>(count) / total);
  }
  return bits;
}

uint32_t ExponentOf(uint64_t bits, DType dtype) {
  const uint32_t width = DTypeSize(dtype);
  const uint32_t mantissa = dtype == DType::kFloat16 ? 10 : dtype == DType::kFloat32 ? 23 : 7;
  return static_cast<uint32_t>((bits & ((uint64_t{1} << (8 * width - 1)) - 1)) >> mantissa);
}

std::string Verdict(bool met) { return met ? "MET" : "NOT MET"; }

nlohmann::json MeasurePair(const Pair& pair, const Args& args, Table* sizes, Table* speeds,
                           Table* choices) {
  const uint32_t width = DTypeSize(pair.dtype);
  uint64_t model_bytes = 0;
  uint64_t changed = 0;
  std::vector<Changes> changes;
  std::vector<Item> items;
  for (const Tensor& t : pair.tensors) {
    model_bytes += t.old_bytes.size();
    changes.push_back(FindChanges(t, width));
    changed += changes.back().locations.size();
  }
  // Entropy bounds, pooled over the model.
  std::map<uint64_t, uint64_t> gaps, xors;
  std::map<uint32_t, uint64_t> members, changed_by_exponent;
  std::map<uint32_t, std::map<uint64_t, uint64_t>> differences;
  for (size_t i = 0; i < pair.tensors.size(); ++i) {
    const Tensor& t = pair.tensors[i];
    const Changes& c = changes[i];
    const uint64_t numel = t.old_bytes.size() / width;
    for (uint64_t e = 0; e < numel; ++e) {
      uint64_t bits = 0;
      std::memcpy(&bits, t.old_bytes.data() + e * width, width);
      ++members[ExponentOf(bits, pair.dtype)];
    }
    for (size_t j = 0; j < c.locations.size(); ++j) {
      ++gaps[j == 0 ? c.locations[0] : c.locations[j] - c.locations[j - 1]];
      uint64_t x = 0, o = 0;
      std::memcpy(&x, c.xor_values.data() + j * width, width);
      std::memcpy(&o, t.old_bytes.data() + c.locations[j] * width, width);
      ++xors[x];
      const uint32_t e = ExponentOf(o, pair.dtype);
      ++changed_by_exponent[e];
      const uint64_t mask = width == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
      ++differences[e][((o ^ x) - o) & mask];
    }
  }
  const double memoryless = (EntropyBits(gaps) + EntropyBits(xors)) / 8 / changed;
  double ideal_bits = 0;
  for (const auto& [e, n] : members) {
    const double k = static_cast<double>(changed_by_exponent[e]);
    const double p = k / static_cast<double>(n);
    if (k > 0 && k < static_cast<double>(n)) {
      ideal_bits -= static_cast<double>(n) * (p * std::log2(p) + (1 - p) * std::log2(1 - p));
    }
    ideal_bits += EntropyBits(differences[e]);
  }
  const double ideal = ideal_bits / 8 / changed;

  // Today: one payload of every item, and each item in a payload of its own (minus the header).
  for (size_t i = 0; i < pair.tensors.size(); ++i) {
    items.push_back(MakeXorItem(pair.tensors[i], pair.dtype, changes[i]));
  }
  std::vector<ItemView> views;
  for (const Item& item : items) {
    if (item.count > 0) views.push_back(item.view());
  }
  const PayloadIds ids{TransferId{}, 0, 0, 0, 1};
  std::vector<std::byte> payload = EncodePayload(ids, views).ValueOrDie();
  // Context coding, item by item, with the choice.
  uint64_t today_items = 0, context_items = 0, chosen_items = 0, chosen_context = 0;
  std::vector<uint64_t> today_of(pair.tensors.size(), 0), context_of(pair.tensors.size(), 0);
  std::vector<std::vector<uint8_t>> coded(pair.tensors.size());
  for (size_t i = 0; i < pair.tensors.size(); ++i) {
    const Item& item = items[i];
    if (item.count == 0) continue;
    const ItemView one = item.view();
    const uint64_t today = EncodePayload(ids, {&one, 1}).ValueOrDie().size() - kPayloadHeaderSize;
    coded[i] =
        internal::EncodeContextCoded(pair.dtype, pair.tensors[i].old_bytes, changes[i].locations,
                                     changes[i].xor_values, args.coding)
            .ValueOrDie();
    // What a context-coded item carries besides its coded bytes — its table entry, compressed
    // with the body as today's is — measured as today's payload of the item cut to its first
    // change, less that change's raw bytes (its gap and value).
    Item first = item;
    first.count = 1;
    first.location_encoding = LocationEncoding::kGap64;
    first.locations.clear();
    (void)EncodeLocations(first.location_encoding, std::span(changes[i].locations).first(1), 0,
                          first.span_end, &first.locations);
    first.values.resize(DTypeSize(pair.dtype));
    const ItemView first_view = first.view();
    const uint64_t framed =
        EncodePayload(ids, {&first_view, 1}).ValueOrDie().size() - kPayloadHeaderSize;
    const uint64_t entry = framed - std::min<uint64_t>(framed, 8 + DTypeSize(pair.dtype));
    const uint64_t context = coded[i].size() + entry;
    today_of[i] = today;
    context_of[i] = context;
    today_items += today;
    context_items += context;
    chosen_items += std::min(today, context);
    if (context < today) ++chosen_context;
  }
  const auto per = [&](uint64_t bytes) { return static_cast<double>(bytes) / changed; };

  // Speed: one core.
  double decode_s = MedianSeconds(args.repetitions, [&] {
    for (size_t i = 0; i < pair.tensors.size(); ++i) {
      if (coded[i].empty()) continue;
      auto decoded = internal::DecodeContextCoded(pair.dtype, pair.tensors[i].old_bytes, coded[i],
                                                  changes[i].locations.size());
      if (!decoded.ok() || decoded->locations != changes[i].locations ||
          decoded->xor_values != changes[i].xor_values) {
        std::cerr << "context_bench: round trip failed on " << pair.tensors[i].name << "\n";
        std::exit(1);
      }
    }
  });
  double encode_s = MedianSeconds(args.repetitions, [&] {
    for (size_t i = 0; i < pair.tensors.size(); ++i) {
      if (changes[i].locations.empty()) continue;
      (void)internal::EncodeContextCoded(pair.dtype, pair.tensors[i].old_bytes,
                                         changes[i].locations, changes[i].xor_values, args.coding);
    }
  });
  double today_decode_s = MedianSeconds(args.repetitions, [&] {
    auto decoded = DecodePayload(payload).ValueOrDie();
    for (const ItemView& item : decoded.items()) (void)DecodeAllLocations(item).ValueOrDie();
  });
  double today_encode_s =
      MedianSeconds(args.repetitions, [&] { (void)EncodePayload(ids, views).ValueOrDie(); });
  const auto gbps = [&](double s) { return static_cast<double>(model_bytes) / s / 1e9; };

  // The producer's auto choice (pipeline/context_choice.h) per link, with this run's decode rate:
  // what each link would carry, in bytes per changed element, and how many items go
  // context-coded.
  const double decode_rate = static_cast<double>(model_bytes) / decode_s;
  struct Link {
    std::string name;
    internal::LinkHint hint;
    uint32_t decode_threads;
  };
  const internal::LinkHint s3 = internal::LinkHintForTransport("s3://bucket/prefix");
  const std::vector<Link> links = {
      {"zmq", internal::LinkHintForTransport("zmq://host:5555"), 1},
      {"s3:// (priced)", s3, 1},
      {"file:// (500 MB/s)", internal::LinkHintForTransport("file:///drop"), 4},
      {"WAN 10 MB/s", {10e6, false}, 1}};
  nlohmann::json link_rows = nlohmann::json::array();
  std::vector<std::string> link_cells;
  for (const Link& link : links) {
    uint64_t bytes = 0;
    uint64_t picked = 0;
    for (size_t i = 0; i < pair.tensors.size(); ++i) {
      if (items[i].count == 0) continue;
      const internal::ContextChoiceInputs inputs{.today_bytes = today_of[i],
                                                 .context_bytes = context_of[i],
                                                 .span_bytes = pair.tensors[i].old_bytes.size(),
                                                 .decode_bytes_per_s = decode_rate,
                                                 .decode_threads = link.decode_threads,
                                                 .link_bytes_per_s = link.hint.bytes_per_s,
                                                 .bytes_priced = link.hint.bytes_priced};
      const bool context =
          internal::ChooseContextCoding(internal::ContextCodingMode::kAuto, true, inputs);
      bytes += context ? context_of[i] : today_of[i];
      picked += context ? 1 : 0;
    }
    link_cells.push_back(fmt::format("{:.3f} ({})", per(bytes), picked));
    link_rows.push_back(
        {{"link", link.name}, {"b_per_changed", per(bytes)}, {"items_context_coded", picked}});
  }
  choices->AddRow({pair.label, link_cells[0], link_cells[1], link_cells[2], link_cells[3]});

  const double density = static_cast<double>(changed) / (static_cast<double>(model_bytes) / width);
  const double ratio = per(chosen_items) / memoryless;
  sizes->AddRow(
      {pair.label, fmt::format("{:.2f} %", 100 * density), fmt::format("{}", changed),
       fmt::format("{:.3f}", per(payload.size())), fmt::format("{:.3f}", per(today_items)),
       fmt::format("{:.3f}", per(context_items)), fmt::format("{:.3f}", per(chosen_items)),
       fmt::format("{}/{}", chosen_context, views.size()), fmt::format("{:.3f}", memoryless),
       fmt::format("{:.3f}", ideal), fmt::format("{:.3f}", ratio),
       fmt::format("{:.3f}", per(chosen_items) / per(today_items))});
  speeds->AddRow({pair.label, FormatBytes(model_bytes), fmt::format("{:.2f}", gbps(decode_s)),
                  fmt::format("{:.2f}", gbps(encode_s)),
                  fmt::format("{:.2f}", gbps(today_decode_s)),
                  fmt::format("{:.2f}", gbps(today_encode_s))});
  return {{"pair", pair.label},
          {"dtype", std::string(DTypeName(pair.dtype))},
          {"model_bytes", model_bytes},
          {"changed", changed},
          {"density", density},
          {"today_payload_b_per_changed", per(payload.size())},
          {"today_items_b_per_changed", per(today_items)},
          {"context_b_per_changed", per(context_items)},
          {"choice_b_per_changed", per(chosen_items)},
          {"items_context_chosen", chosen_context},
          {"items", views.size()},
          {"memoryless_bound_b_per_changed", memoryless},
          {"ideal_context_b_per_changed", ideal},
          {"choice_over_bound", ratio},
          {"choice_over_today", per(chosen_items) / per(today_items)},
          {"context_decode_gbps", gbps(decode_s)},
          {"context_encode_gbps", gbps(encode_s)},
          {"today_decode_gbps", gbps(today_decode_s)},
          {"today_encode_gbps", gbps(today_encode_s)},
          {"auto_choice_by_link", link_rows}};
}

int Main(int argc, char** argv) {
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--pair")
      args.pair_dirs.push_back(argv[i + 1]);
    else if (flag == "--synthetic-bytes")
      args.synthetic_bytes = std::stoull(argv[i + 1]);
    else if (flag == "--repetitions")
      args.repetitions = std::stoi(argv[i + 1]);
    else if (flag == "--json")
      args.json_path = argv[i + 1];
    else if (flag == "--no-avx512" && std::string(argv[i + 1]) == "1")
      // Measure the AVX2 kernels on an AVX-512 machine.
      hwy::DisableTargets(HWY_AVX3 | HWY_AVX3_DL);
    else if (flag == "--max-classes")
      args.coding.max_classes = std::stoul(argv[i + 1]);
    else {
      std::cerr << "context_bench: unknown flag " << flag << "\n";
      return 2;
    }
  }
  std::vector<Pair> pairs;
  for (const std::string& dir : args.pair_dirs) {
    pairs.push_back(LoadTorchPair(dir, "bf16", DType::kBFloat16));
    pairs.push_back(LoadTorchPair(dir, "fp16", DType::kFloat16));
  }
  for (double density : {0.01, 0.03, 0.05}) {
    pairs.push_back(SyntheticPair(args.synthetic_bytes, density));
  }
  pairs.push_back(UniformPair(args.synthetic_bytes));
  const std::string target(internal::ContextCodingSimdTarget());
  std::cout << "== context-coded deltas, SIMD target " << target
            << ", 1 thread, thread CPU time, median of " << args.repetitions << "\n";
  Table sizes({"pair", "density", "changed", "today payload", "today items", "context", "choice",
               "ctx items", "memoryless", "ideal ctx", "choice/bound", "choice/today"});
  Table speeds({"pair", "model", "ctx decode GB/s", "ctx encode GB/s", "today decode GB/s",
                "today encode GB/s"});
  Table choices({"pair", "zmq", "s3:// (priced)", "file://, 4 decode threads", "WAN 10 MB/s"});
  nlohmann::json rows = nlohmann::json::array();
  for (const Pair& pair : pairs) {
    if (pair.tensors.empty()) continue;
    rows.push_back(MeasurePair(pair, args, &sizes, &speeds, &choices));
  }
  std::cout << "-- bytes per changed element\n";
  sizes.Print(std::cout);
  std::cout << "-- speed, model bytes per second\n";
  speeds.Print(std::cout);
  std::cout << "-- auto choice per link (pipeline/context_choice.h, this run's decode rate): "
               "B/changed sent (items context-coded)\n";
  choices.Print(std::cout);

  // Targets.
  Table targets({"target", "figure", "goal", "verdict"});
  nlohmann::json verdicts = nlohmann::json::array();
  const auto add = [&](const std::string& what, double figure, const std::string& goal, bool met) {
    targets.AddRow({what, fmt::format("{:.3f}", figure), goal, Verdict(met)});
    verdicts.push_back({{"target", what}, {"figure", figure}, {"goal", goal}, {"met", met}});
  };
  for (const auto& row : rows) {
    const std::string label = row["pair"];
    if (label.starts_with("torch")) {
      add("B/changed ÷ memoryless bound, " + label, row["choice_over_bound"].get<double>(),
          fmt::format("≤ {}", kTargetRatioToBound),
          row["choice_over_bound"].get<double>() <= kTargetRatioToBound);
    } else {
      add("choice ÷ today, " + label, row["choice_over_today"].get<double>(), "≤ 1",
          row["choice_over_today"].get<double>() <= 1.0);
    }
    if (row["dtype"] == "bfloat16") {
      add("decode GB/s/core, " + label, row["context_decode_gbps"].get<double>(),
          fmt::format("≥ {}", kTargetDecodeGBps),
          row["context_decode_gbps"].get<double>() >= kTargetDecodeGBps);
      add("encode GB/s/core, " + label, row["context_encode_gbps"].get<double>(),
          fmt::format("≥ {}", kTargetEncodeGBps),
          row["context_encode_gbps"].get<double>() >= kTargetEncodeGBps);
    }
  }
  std::cout << "-- targets (issue 44)\n";
  targets.Print(std::cout);
  if (!args.json_path.empty()) {
    std::ofstream(args.json_path)
        << nlohmann::json{{"simd_target", target}, {"pairs", rows}, {"targets", verdicts}}.dump(2)
        << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
