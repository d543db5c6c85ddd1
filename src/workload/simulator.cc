#include "workload/simulator.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/half_float.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/splitmix64.h"

namespace refit {
namespace {

// Exported buffers hold host-order elements and are handed out as canonical little-endian bytes.
static_assert(std::endian::native == std::endian::little,
              "the simulator's exported buffers assume a little-endian host");

// Elements per parallel task: large enough to amortise the shared task counter, small enough to
// balance a few threads over tensors of very different sizes.
constexpr uint64_t kChunkElements = uint64_t{1} << 16;
// Upper bound on `threads`: far above any core count, low enough to catch garbage values.
constexpr int kMaxThreads = 1024;

// Calibration: the sample size bounds the cost of one bisection probe (~a few ms); 2^20 elements
// give a relative standard error of ≈1 % on a 1 % density.
constexpr uint64_t kCalibrationSampleSize = uint64_t{1} << 20;
// Bisection bracket for the learning rate. 1e-12 moves no fp32 weight of magnitude > 1e-5 by an
// ulp; 1 is far beyond any fine-tuning rate.
constexpr double kMinLearningRate = 1e-12;
constexpr double kMaxLearningRate = 1.0;
// 30 halvings of the 12-decade log bracket leave a relative rate error below 3e-8.
constexpr int kCalibrationIterations = 30;

// --- Counter-based random numbers -------------------------------------------------------------

// splitmix64's increment, 2^64 / φ: consecutive counters map to well-separated hash inputs.
constexpr uint64_t kGoldenGamma = internal::kSplitMix64Gamma;

// Purposes of the random streams, so that no two purposes share a stream.
enum class StreamPurpose : uint64_t {
  kInitialWeights = 1,
  kGradientSignal = 2,
  kGradientNoise = 3,
  kCalibrationSample = 4,
};

// splitmix64's output function: hashing a counter gives independent-looking uniform bits.
constexpr uint64_t Mix64(uint64_t z) { return internal::SplitMix64Finalize(z); }

// The key of one stream: (seed, purpose, step, tensor position). Elements of the stream are
// ElementBits(key, index), so any element can be drawn without drawing the others.
uint64_t StreamKey(uint64_t seed, StreamPurpose purpose, uint64_t step, uint64_t tensor) {
  uint64_t key = Mix64(seed + kGoldenGamma * static_cast<uint64_t>(purpose));
  key = Mix64(key + kGoldenGamma * (step + 1));
  return Mix64(key + kGoldenGamma * (tensor + 1));
}

inline uint64_t ElementBits(uint64_t key, uint64_t index) {
  return Mix64(key + kGoldenGamma * (index + 1));
}

// Irwin–Hall(4) of the four 16-bit lanes of `bits`: each lane is uniform on [0, 65535] with
// mean 32767.5 and variance (65536² − 1) / 12, so the sum has mean 131070 and standard deviation
// sqrt((65536² − 1) / 3) ≈ 65536 / √3 (relative error 1e-10).
constexpr float kIrwinHallMean = 131070.0f;
constexpr float kIrwinHallInverseStd = 1.7320508075688772f / 65536.0f;
// Adds lanes 0+1 and 2+3 in one 64-bit addition: each 32-bit half then holds a sum < 2^17.
constexpr uint64_t kAlternateLanes = 0x0000FFFF0000FFFFull;

// An approximately standard normal variate (see simulator.h for its properties).
inline float StandardNormal(uint64_t bits) {
  const uint64_t pair_sums = (bits & kAlternateLanes) + ((bits >> 16) & kAlternateLanes);
  const uint32_t sum = static_cast<uint32_t>(pair_sums) + static_cast<uint32_t>(pair_sums >> 32);
  return (static_cast<float>(static_cast<int32_t>(sum)) - kIrwinHallMean) * kIrwinHallInverseStd;
}

// --- Adam ------------------------------------------------------------------------------------

// The per-step constants of the Adam update, in the fp32 the trainer computes in.
struct AdamConstants {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float epsilon;
  // 1 / sqrt(1 − beta2^t): the second-moment bias correction.
  float inverse_sqrt_bias_correction2;
  float gradient_signal;
  float gradient_noise;
  // learning_rate / (1 − beta1^t): the step size including the first-moment bias correction.
  float step_size;
};

AdamConstants MakeAdamConstants(const SimulatorOptions& options, double learning_rate,
                                uint64_t step) {
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(options.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(options.beta2, t);
  return AdamConstants{
      .beta1 = static_cast<float>(options.beta1),
      .one_minus_beta1 = static_cast<float>(1.0 - options.beta1),
      .beta2 = static_cast<float>(options.beta2),
      .one_minus_beta2 = static_cast<float>(1.0 - options.beta2),
      .epsilon = static_cast<float>(options.epsilon),
      .inverse_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2)),
      .gradient_signal = static_cast<float>(options.gradient_signal),
      .gradient_noise = static_cast<float>(options.gradient_noise),
      .step_size = static_cast<float>(learning_rate / bias_correction1),
  };
}

inline float Gradient(uint64_t signal_key, uint64_t noise_key, uint64_t index,
                      const AdamConstants& c) {
  return c.gradient_signal * StandardNormal(ElementBits(signal_key, index)) +
         c.gradient_noise * StandardNormal(ElementBits(noise_key, index));
}

// Advance the moments by gradient `g` and return the update direction m̂ / (sqrt(v̂) + ε) up to
// the step size. Step and calibration both go through here, so calibration predicts the next
// step bit-exactly.
inline float AdvanceMoments(float& m, float& v, float g, const AdamConstants& c) {
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  return m / (std::sqrt(v) * c.inverse_sqrt_bias_correction2 + c.epsilon);
}

inline float ApplyUpdate(float weight, float direction, float step_size) {
  return weight - step_size * direction;
}

// --- Export ----------------------------------------------------------------------------------

enum class ExportKind : uint8_t { kBFloat16, kFloat16, kFloat32 };

std::optional<ExportKind> ExportKindOf(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return ExportKind::kBFloat16;
    case DType::kFloat16:
      return ExportKind::kFloat16;
    case DType::kFloat32:
      return ExportKind::kFloat32;
    default:
      return std::nullopt;
  }
}

template <ExportKind kKind>
inline uint32_t ExportBits(float weight) {
  if constexpr (kKind == ExportKind::kBFloat16) {
    return FloatToBFloat16(weight);
  } else if constexpr (kKind == ExportKind::kFloat16) {
    return FloatToHalf(weight);
  } else {
    return std::bit_cast<uint32_t>(weight);
  }
}

uint32_t ExportBits(ExportKind kind, float weight) {
  switch (kind) {
    case ExportKind::kBFloat16:
      return ExportBits<ExportKind::kBFloat16>(weight);
    case ExportKind::kFloat16:
      return ExportBits<ExportKind::kFloat16>(weight);
    case ExportKind::kFloat32:
      break;
  }
  return ExportBits<ExportKind::kFloat32>(weight);
}

// --- Model state -----------------------------------------------------------------------------

template <typename T>
Result<std::unique_ptr<T[]>> AllocateUninitialized(uint64_t count, const std::string& tensor,
                                                   std::string_view what) {
  if (count > std::numeric_limits<size_t>::max() / sizeof(T)) {
    return ResourceExhausted("tensor '{}': {} elements of {} do not fit in memory", tensor, count,
                             what);
  }
  // Uninitialised on purpose: the parallel initialisation touches every page first, from the
  // worker that will step it.
  std::unique_ptr<T[]> buffer(new (std::nothrow) T[count]);
  if (buffer == nullptr) {
    return ResourceExhausted("tensor '{}': cannot allocate {} bytes for {}", tensor,
                             count * sizeof(T), what);
  }
  return buffer;
}

struct TensorState {
  std::string name;
  DType dtype = DType::kBFloat16;
  Shape shape;
  uint64_t numel = 0;
  // Index in the model: keys the tensor's random streams.
  uint64_t position = 0;
  bool trained = false;
  ExportKind kind = ExportKind::kBFloat16;
  // Trained tensors: fp32 master weights and Adam moments; 16-bit exports in export16 (a float32
  // export is the master buffer itself).
  std::unique_ptr<float[]> master;
  std::unique_ptr<float[]> first_moment;
  std::unique_ptr<float[]> second_moment;
  std::unique_ptr<uint16_t[]> export16;
  // Untrained tensors of an init_from file, exported unchanged.
  std::vector<std::byte> untrained_bytes;

  std::span<const std::byte> exported() const {
    if (!trained) return untrained_bytes;
    if (kind == ExportKind::kFloat32) {
      return std::as_bytes(std::span<const float>(master.get(), numel));
    }
    return std::as_bytes(std::span<const uint16_t>(export16.get(), numel));
  }

  Status Allocate() {
    REFIT_ASSIGN_OR_RETURN(master, AllocateUninitialized<float>(numel, name, "master weights"));
    REFIT_ASSIGN_OR_RETURN(first_moment, AllocateUninitialized<float>(numel, name, "Adam m"));
    REFIT_ASSIGN_OR_RETURN(second_moment, AllocateUninitialized<float>(numel, name, "Adam v"));
    if (kind != ExportKind::kFloat32) {
      REFIT_ASSIGN_OR_RETURN(export16, AllocateUninitialized<uint16_t>(numel, name, "export"));
    }
    return Status::OK();
  }
};

// Where a trained tensor's initial weights come from: a synthetic distribution, or file bytes.
struct InitialWeights {
  float mean = 0.0f;
  float std = 0.0f;
  std::span<const std::byte> file_bytes;
};

// A contiguous element range of one trained tensor: the unit of parallel work.
struct Chunk {
  size_t tensor;
  uint64_t begin;
  uint64_t end;
};

// Run fn(0) … fn(tasks − 1) on up to `threads` threads (the caller included). Tasks are claimed
// from a shared counter; fn must be safe to run concurrently for distinct tasks.
void ParallelFor(int threads, size_t tasks, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next_task{0};
  auto worker = [&] {
    for (size_t task = next_task.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next_task.fetch_add(1, std::memory_order_relaxed)) {
      fn(task);
    }
  };
  const size_t helpers = std::min(static_cast<size_t>(threads), tasks);
  std::vector<std::jthread> pool;
  for (size_t i = 1; i < helpers; ++i) pool.emplace_back(worker);
  worker();
}  // The jthreads join here.

void InitializeRange(TensorState& tensor, const InitialWeights& initial, uint64_t init_key,
                     uint64_t begin, uint64_t end) {
  float* master = tensor.master.get();
  std::fill(tensor.first_moment.get() + begin, tensor.first_moment.get() + end, 0.0f);
  std::fill(tensor.second_moment.get() + begin, tensor.second_moment.get() + end, 0.0f);
  if (initial.file_bytes.empty()) {
    for (uint64_t i = begin; i < end; ++i) {
      master[i] = initial.mean + initial.std * StandardNormal(ElementBits(init_key, i));
    }
    if (tensor.kind != ExportKind::kFloat32) {
      for (uint64_t i = begin; i < end; ++i) {
        tensor.export16[i] = static_cast<uint16_t>(ExportBits(tensor.kind, master[i]));
      }
    }
    return;
  }
  // From a file: the export is the file's bits exactly (NaN payloads included), the master
  // weights their exact widening.
  const std::byte* source = initial.file_bytes.data();
  if (tensor.kind == ExportKind::kFloat32) {
    std::memcpy(master + begin, source + begin * sizeof(float), (end - begin) * sizeof(float));
    return;
  }
  uint16_t* exported = tensor.export16.get();
  std::memcpy(exported + begin, source + begin * sizeof(uint16_t),
              (end - begin) * sizeof(uint16_t));
  for (uint64_t i = begin; i < end; ++i) {
    master[i] = tensor.kind == ExportKind::kBFloat16 ? BFloat16ToFloat(exported[i])
                                                     : HalfToFloat(exported[i]);
  }
}

template <ExportKind kKind>
void StepRange(TensorState& tensor, const AdamConstants& c, uint64_t signal_key, uint64_t noise_key,
               uint64_t begin, uint64_t end) {
  float* __restrict master = tensor.master.get();
  float* __restrict first_moment = tensor.first_moment.get();
  float* __restrict second_moment = tensor.second_moment.get();
  uint16_t* __restrict exported = tensor.export16.get();
  for (uint64_t i = begin; i < end; ++i) {
    float m = first_moment[i];
    float v = second_moment[i];
    const float direction = AdvanceMoments(m, v, Gradient(signal_key, noise_key, i, c), c);
    first_moment[i] = m;
    second_moment[i] = v;
    const float weight = ApplyUpdate(master[i], direction, c.step_size);
    master[i] = weight;
    if constexpr (kKind != ExportKind::kFloat32) {
      exported[i] = static_cast<uint16_t>(ExportBits<kKind>(weight));
    }
  }
}

// One calibration sample element, reduced to what a candidate learning rate changes.
struct CalibrationPoint {
  float master;
  // The next step's update direction (Adam state advanced by the next gradient).
  float direction;
  uint32_t exported_bits;
  ExportKind kind;
};

struct SampleRef {
  size_t tensor;
  uint64_t element;
};

Status ValidateOptions(const SimulatorOptions& options) {
  auto finite_at_least = [](double value, double low) {
    return std::isfinite(value) && value >= low;
  };
  if (!finite_at_least(options.learning_rate, 0.0)) {
    return InvalidArgument("simulator: learning_rate {} must be finite and >= 0",
                           options.learning_rate);
  }
  if (!(options.beta1 >= 0.0 && options.beta1 < 1.0)) {
    return InvalidArgument("simulator: beta1 {} must be in [0, 1)", options.beta1);
  }
  if (!(options.beta2 >= 0.0 && options.beta2 < 1.0)) {
    return InvalidArgument("simulator: beta2 {} must be in [0, 1)", options.beta2);
  }
  if (!(std::isfinite(options.epsilon) && options.epsilon > 0.0)) {
    return InvalidArgument("simulator: epsilon {} must be finite and > 0", options.epsilon);
  }
  if (!finite_at_least(options.gradient_signal, 0.0)) {
    return InvalidArgument("simulator: gradient_signal {} must be finite and >= 0",
                           options.gradient_signal);
  }
  if (!finite_at_least(options.gradient_noise, 0.0)) {
    return InvalidArgument("simulator: gradient_noise {} must be finite and >= 0",
                           options.gradient_noise);
  }
  if (options.threads < 1 || options.threads > kMaxThreads) {
    return InvalidArgument("simulator: threads {} must be in [1, {}]", options.threads,
                           kMaxThreads);
  }
  if (!ExportKindOf(options.export_dtype).has_value()) {
    return InvalidArgument(
        "simulator: export dtype {} is not supported (bfloat16, float16 or float32)",
        DTypeName(options.export_dtype));
  }
  return Status::OK();
}

// --- MakeTransformerSpec ---------------------------------------------------------------------

// Shape rules of Llama-style models: widths in multiples of 64, MLP width ≈ 8/3 · hidden
// (SwiGLU keeps the parameter count of a 4× MLP), about one layer per 128 of width (Llama-2 7B:
// 4096 / 32), vocabulary ≈ 8 · hidden capped at Llama's 32000.
constexpr int64_t kWidthMultiple = 64;
constexpr int64_t kMinHidden = 64;
constexpr int64_t kMaxHidden = 16384;
constexpr double kHiddenPerLayer = 128.0;
constexpr int64_t kVocabPerHidden = 8;
constexpr int64_t kMinVocab = 256;
constexpr int64_t kMaxVocab = 32000;
// Configurations within this relative size error of the target compete on realistic depth.
constexpr double kSizeTolerance = 0.02;
// Init scales: projections and embeddings as in HF's initializer_range; norm weights start at
// 1.0 with a spread far below their bf16 ulp (2^-8 just below 1.0).
constexpr float kProjectionInitStd = 0.02f;
constexpr float kNormInitMean = 1.0f;
constexpr float kNormInitStd = 1e-3f;

int64_t RoundUpToWidthMultiple(int64_t value) {
  return (value + kWidthMultiple - 1) / kWidthMultiple * kWidthMultiple;
}

struct TransformerShape {
  int64_t hidden;
  int64_t intermediate;
  int64_t vocab;
  int64_t layers;

  // Embedding, lm_head and the final norm.
  uint64_t FixedElements() const {
    const uint64_t h = static_cast<uint64_t>(hidden);
    return 2 * static_cast<uint64_t>(vocab) * h + h;
  }
  // Four attention projections, three MLP projections, two norms.
  uint64_t LayerElements() const {
    const uint64_t h = static_cast<uint64_t>(hidden);
    return 4 * h * h + 3 * h * static_cast<uint64_t>(intermediate) + 2 * h;
  }
  uint64_t Elements() const {
    return FixedElements() + static_cast<uint64_t>(layers) * LayerElements();
  }
};

TransformerShape ChooseTransformerShape(uint64_t target_elements) {
  // Width candidates, each with the depth that brings it closest to the target.
  std::vector<TransformerShape> candidates;
  for (int64_t hidden = kMinHidden; hidden <= kMaxHidden; hidden += kWidthMultiple) {
    TransformerShape shape{
        .hidden = hidden,
        .intermediate = RoundUpToWidthMultiple(hidden * 8 / 3),
        .vocab = std::clamp(kVocabPerHidden * hidden, kMinVocab, kMaxVocab),
        .layers = 1,
    };
    const double layers = std::round(
        (static_cast<double>(target_elements) - static_cast<double>(shape.FixedElements())) /
        static_cast<double>(shape.LayerElements()));
    if (layers > 1.0) shape.layers = static_cast<int64_t>(layers);
    candidates.push_back(shape);
  }
  auto size_error = [&](const TransformerShape& shape) {
    const double target = std::max(1.0, static_cast<double>(target_elements));
    return std::fabs(static_cast<double>(shape.Elements()) - target) / target;
  };
  auto depth_misfit = [](const TransformerShape& shape) {
    return std::fabs(std::log(static_cast<double>(shape.layers) * kHiddenPerLayer /
                              static_cast<double>(shape.hidden)));
  };
  const TransformerShape* best = &candidates.front();
  for (const TransformerShape& shape : candidates) {
    const bool fits = size_error(shape) <= kSizeTolerance;
    const bool best_fits = size_error(*best) <= kSizeTolerance;
    if (fits && best_fits) {
      if (depth_misfit(shape) < depth_misfit(*best)) best = &shape;
    } else if (fits || (!best_fits && size_error(shape) < size_error(*best))) {
      best = &shape;
    }
  }
  return *best;
}

}  // namespace

std::vector<SimulatedTensorSpec> MakeTransformerSpec(uint64_t total_bytes, DType dtype) {
  const TransformerShape shape = ChooseTransformerShape(total_bytes / DTypeSize(dtype));
  const int64_t h = shape.hidden;
  auto projection = [](std::string name, Shape dims) {
    return SimulatedTensorSpec{std::move(name), std::move(dims), kProjectionInitStd, 0.0f};
  };
  auto norm = [h](std::string name) {
    return SimulatedTensorSpec{std::move(name), Shape{h}, kNormInitStd, kNormInitMean};
  };
  std::vector<SimulatedTensorSpec> tensors;
  tensors.push_back(projection("model.embed_tokens.weight", {shape.vocab, h}));
  for (int64_t layer = 0; layer < shape.layers; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    tensors.push_back(norm(prefix + "input_layernorm.weight"));
    for (const char* projection_name : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      tensors.push_back(projection(prefix + "self_attn." + projection_name + ".weight", {h, h}));
    }
    tensors.push_back(norm(prefix + "post_attention_layernorm.weight"));
    tensors.push_back(projection(prefix + "mlp.gate_proj.weight", {shape.intermediate, h}));
    tensors.push_back(projection(prefix + "mlp.up_proj.weight", {shape.intermediate, h}));
    tensors.push_back(projection(prefix + "mlp.down_proj.weight", {h, shape.intermediate}));
  }
  tensors.push_back(norm("model.norm.weight"));
  tensors.push_back(projection("lm_head.weight", {shape.vocab, h}));
  return tensors;
}

struct TrainingSimulator::State {
  SimulatorOptions options;
  std::vector<TensorState> tensors;
  std::vector<Chunk> chunks;
  // Global element offset of each trained tensor (ascending) and its index in `tensors`: maps a
  // calibration sample index to an element.
  std::vector<uint64_t> trained_begin;
  std::vector<size_t> trained_tensor;
  uint64_t trained_elements = 0;
  uint64_t exported_bytes = 0;
  uint64_t step = 0;
  double learning_rate = 0.0;
  // Built by the first calibration, then fixed.
  std::vector<SampleRef> calibration_sample;
};

TrainingSimulator::TrainingSimulator(std::unique_ptr<State> state) : state_(std::move(state)) {}
TrainingSimulator::~TrainingSimulator() = default;

Result<std::unique_ptr<TrainingSimulator>> TrainingSimulator::Make(
    const SimulatorOptions& options) {
  REFIT_RETURN_NOT_OK(ValidateOptions(options));
  auto state = std::make_unique<State>();
  state->options = options;
  state->options.tensors.clear();  // Only needed here; the spec list can be large.
  state->learning_rate = options.learning_rate;

  std::vector<InitialWeights> initial;
  std::unique_ptr<SafetensorsFile> file;
  std::set<std::string> names;
  auto add_tensor = [&](const std::string& name, DType dtype, const Shape& shape,
                        std::string_view origin) -> Result<TensorState*> {
    if (name.empty())
      return InvalidArgument("{}: tensor {} has an empty name", origin, state->tensors.size());
    if (!names.insert(name).second) {
      return InvalidArgument("{}: duplicate tensor name '{}'", origin, name);
    }
    REFIT_ASSIGN_OR_RETURN(uint64_t numel, NumElements(shape));
    TensorState& tensor = state->tensors.emplace_back();
    tensor.name = name;
    tensor.dtype = dtype;
    tensor.shape = shape;
    tensor.numel = numel;
    tensor.position = state->tensors.size() - 1;
    initial.emplace_back();
    return &tensor;
  };

  if (!options.init_from.empty()) {
    REFIT_ASSIGN_OR_RETURN(file, SafetensorsFile::Open(options.init_from));
    for (const TensorView& view : file->tensors()) {
      REFIT_ASSIGN_OR_RETURN(TensorState * tensor,
                             add_tensor(view.name, view.dtype, view.shape, options.init_from));
      const std::optional<ExportKind> kind = ExportKindOf(view.dtype);
      if (kind.has_value()) {
        tensor->trained = true;
        tensor->kind = *kind;
        initial.back().file_bytes = view.bytes;
      } else {
        tensor->untrained_bytes.assign(view.bytes.begin(), view.bytes.end());
      }
    }
  } else {
    for (const SimulatedTensorSpec& spec : options.tensors) {
      if (!std::isfinite(spec.init_std) || spec.init_std < 0.0f || !std::isfinite(spec.init_mean)) {
        return InvalidArgument(
            "simulator: tensor '{}' init mean {} / std {} must be finite, std >= 0", spec.name,
            spec.init_mean, spec.init_std);
      }
      REFIT_ASSIGN_OR_RETURN(TensorState * tensor,
                             add_tensor(spec.name, options.export_dtype, spec.shape, "simulator"));
      tensor->trained = true;
      tensor->kind = *ExportKindOf(options.export_dtype);
      initial.back().mean = spec.init_mean;
      initial.back().std = spec.init_std;
    }
  }

  uint64_t total_elements = 0;
  for (TensorState& tensor : state->tensors) {
    total_elements += tensor.numel;
    state->exported_bytes += tensor.numel * DTypeSize(tensor.dtype);
    if (!tensor.trained) continue;
    REFIT_RETURN_NOT_OK(tensor.Allocate());
    if (tensor.numel == 0) continue;
    state->trained_begin.push_back(state->trained_elements);
    state->trained_tensor.push_back(tensor.position);
    state->trained_elements += tensor.numel;
    for (uint64_t begin = 0; begin < tensor.numel; begin += kChunkElements) {
      state->chunks.push_back(
          Chunk{tensor.position, begin, std::min(tensor.numel, begin + kChunkElements)});
    }
  }
  if (total_elements == 0) {
    return InvalidArgument("simulator: the model {} has no elements ({} tensors)",
                           options.init_from.empty() ? "spec" : "'" + options.init_from + "'",
                           state->tensors.size());
  }

  ParallelFor(options.threads, state->chunks.size(), [&](size_t task) {
    const Chunk& chunk = state->chunks[task];
    TensorState& tensor = state->tensors[chunk.tensor];
    const uint64_t init_key =
        StreamKey(options.seed, StreamPurpose::kInitialWeights, 0, tensor.position);
    InitializeRange(tensor, initial[chunk.tensor], init_key, chunk.begin, chunk.end);
  });
  return std::unique_ptr<TrainingSimulator>(new TrainingSimulator(std::move(state)));
}

Status TrainingSimulator::Step() {
  State& state = *state_;
  ++state.step;
  const AdamConstants constants = MakeAdamConstants(state.options, state.learning_rate, state.step);
  ParallelFor(state.options.threads, state.chunks.size(), [&](size_t task) {
    const Chunk& chunk = state.chunks[task];
    TensorState& tensor = state.tensors[chunk.tensor];
    const uint64_t signal_key =
        StreamKey(state.options.seed, StreamPurpose::kGradientSignal, 0, tensor.position);
    const uint64_t noise_key =
        StreamKey(state.options.seed, StreamPurpose::kGradientNoise, state.step, tensor.position);
    switch (tensor.kind) {
      case ExportKind::kBFloat16:
        StepRange<ExportKind::kBFloat16>(tensor, constants, signal_key, noise_key, chunk.begin,
                                         chunk.end);
        break;
      case ExportKind::kFloat16:
        StepRange<ExportKind::kFloat16>(tensor, constants, signal_key, noise_key, chunk.begin,
                                        chunk.end);
        break;
      case ExportKind::kFloat32:
        StepRange<ExportKind::kFloat32>(tensor, constants, signal_key, noise_key, chunk.begin,
                                        chunk.end);
        break;
    }
  });
  return Status::OK();
}

Result<double> TrainingSimulator::CalibrateLearningRate(double density) {
  if (!(density > 0.0 && density < 1.0)) {
    return InvalidArgument("simulator: target density {} must be in (0, 1)", density);
  }
  State& state = *state_;
  if (state.trained_elements == 0) {
    return FailedPrecondition("simulator: cannot calibrate a model without trained elements");
  }
  const SimulatorOptions& options = state.options;

  if (state.calibration_sample.empty()) {
    const bool whole_model = state.trained_elements <= kCalibrationSampleSize;
    const uint64_t count = whole_model ? state.trained_elements : kCalibrationSampleSize;
    const uint64_t sample_key = StreamKey(options.seed, StreamPurpose::kCalibrationSample, 0, 0);
    std::vector<uint64_t> global(count);
    for (uint64_t k = 0; k < count; ++k) {
      // Uniform with replacement; the modulo bias is below N / 2^64.
      global[k] = whole_model ? k : ElementBits(sample_key, k) % state.trained_elements;
    }
    // In model order, so that probing the sample walks memory forward instead of at random.
    std::sort(global.begin(), global.end());
    state.calibration_sample.resize(count);
    for (uint64_t k = 0; k < count; ++k) {
      const size_t slot = static_cast<size_t>(
          std::upper_bound(state.trained_begin.begin(), state.trained_begin.end(), global[k]) -
          state.trained_begin.begin() - 1);
      state.calibration_sample[k] =
          SampleRef{state.trained_tensor[slot], global[k] - state.trained_begin[slot]};
    }
  }

  // The next step, up to the learning rate: same gradients, the current moments advanced.
  const uint64_t next_step = state.step + 1;
  const AdamConstants constants = MakeAdamConstants(options, state.learning_rate, next_step);
  std::vector<uint64_t> signal_keys(state.tensors.size());
  std::vector<uint64_t> noise_keys(state.tensors.size());
  for (const TensorState& tensor : state.tensors) {
    signal_keys[tensor.position] =
        StreamKey(options.seed, StreamPurpose::kGradientSignal, 0, tensor.position);
    noise_keys[tensor.position] =
        StreamKey(options.seed, StreamPurpose::kGradientNoise, next_step, tensor.position);
  }
  const size_t sample_size = state.calibration_sample.size();
  const size_t tasks = (sample_size + kChunkElements - 1) / kChunkElements;
  std::vector<CalibrationPoint> points(sample_size);
  ParallelFor(options.threads, tasks, [&](size_t task) {
    const size_t end = std::min(sample_size, (task + 1) * kChunkElements);
    for (size_t k = task * kChunkElements; k < end; ++k) {
      const SampleRef& ref = state.calibration_sample[k];
      const TensorState& tensor = state.tensors[ref.tensor];
      float m = tensor.first_moment[ref.element];
      float v = tensor.second_moment[ref.element];
      const float weight = tensor.master[ref.element];
      const float gradient =
          Gradient(signal_keys[ref.tensor], noise_keys[ref.tensor], ref.element, constants);
      const float direction = AdvanceMoments(m, v, gradient, constants);
      const uint32_t exported = tensor.kind == ExportKind::kFloat32
                                    ? std::bit_cast<uint32_t>(weight)
                                    : tensor.export16[ref.element];
      points[k] = CalibrationPoint{weight, direction, exported, tensor.kind};
    }
  });

  // Changed fraction of the sample at `learning_rate`. Per-task counts summed in task order keep
  // it independent of the thread count.
  std::vector<uint64_t> changed(tasks);
  auto changed_fraction = [&](double learning_rate) {
    // Derived exactly as Step derives it, so the prediction is bit-exact.
    const float step_size = MakeAdamConstants(options, learning_rate, next_step).step_size;
    ParallelFor(options.threads, tasks, [&](size_t task) {
      const size_t end = std::min(sample_size, (task + 1) * kChunkElements);
      uint64_t count = 0;
      for (size_t k = task * kChunkElements; k < end; ++k) {
        const CalibrationPoint& point = points[k];
        const float weight = ApplyUpdate(point.master, point.direction, step_size);
        count += ExportBits(point.kind, weight) != point.exported_bits;
      }
      changed[task] = count;
    });
    uint64_t total = 0;
    for (uint64_t count : changed) total += count;
    return static_cast<double>(total) / static_cast<double>(sample_size);
  };

  // Monotone in the rate: a larger step moves each weight further from its exported value.
  double low = kMinLearningRate;
  double high = kMaxLearningRate;
  if (changed_fraction(high) >= density) {
    for (int iteration = 0; iteration < kCalibrationIterations; ++iteration) {
      const double middle = std::sqrt(low * high);
      if (changed_fraction(middle) >= density) {
        high = middle;
      } else {
        low = middle;
      }
    }
  }
  state.learning_rate = high;
  return high;
}

std::vector<TensorView> TrainingSimulator::Exported() const {
  std::vector<TensorView> views;
  views.reserve(state_->tensors.size());
  for (const TensorState& tensor : state_->tensors) {
    views.push_back(TensorView{tensor.name, tensor.dtype, tensor.shape, tensor.exported()});
  }
  return views;
}

uint64_t TrainingSimulator::step() const { return state_->step; }
double TrainingSimulator::learning_rate() const { return state_->learning_rate; }
uint64_t TrainingSimulator::exported_bytes() const { return state_->exported_bytes; }

}  // namespace refit
